"""Share a trained model as a directory anyone can open: ``export`` a checkpoint (:mod:`.export`), ``load_pretrained`` (:mod:`.load`) it.

A Lightning checkpoint is a pickle: opening one runs code and needs this project's classes.
An exported directory (Hugging Face layout) holds only JSON, text and safetensors:

    config.json         model settings (every default written out), objective, vocabulary size,
                        tokenizer version, the training set's amino-acid frequencies (the
                        perplexity baseline), training step, and transformers' model_type,
                        architectures and auto_map
    model.safetensors   every parameter and persistent buffer of PerformerLM. The random-feature
                        projections and FAVOR++'s rho are buffers that training redrew and
                        updated: they cannot be recomputed from the settings, so they are stored.
                        The output head is the embedding matrix itself (tied in the forward pass,
                        not a copy), so it is stored once, as ``embed.weight``.
    vocab.txt, tokenizer_config.json
                        the vocabulary, one token per line (id = line number); transformers
                        opens it as an EsmTokenizer (same token names, <cls> residues <eos>)
    configuration_protein_performer.py, modeling_protein_performer.py
                        self-contained transformers code (from protein_performer/hub/hf_code), for
                        ``AutoModelFor{MaskedLM,CausalLM}.from_pretrained(dir, trust_remote_code=True)``
    README.md           model card: kernel, size, training data and steps, held-out figures

``load_pretrained`` (:mod:`.load`) needs neither Lightning nor transformers and never unpickles.
"""


