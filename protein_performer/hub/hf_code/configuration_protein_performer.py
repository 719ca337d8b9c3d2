"""transformers configuration of an exported protein-performer model (copied by its export).

The keys are those of ``config.json`` as protein-performer writes it: the model settings
(dim, depth, heads, ff_mult, dropout, position, max_positions, attention), the objective
(mlm: bidirectional, clm: causal; ``causal`` repeats it) and what was trained with it (tokenizer version, the training
set's amino-acid frequencies).
"""
from transformers import PretrainedConfig


class ProteinPerformerConfig(PretrainedConfig):
    model_type = "protein_performer"

    def __init__(self, vocab_size=30, objective="mlm", causal=False, dim=128, depth=4, heads=4, ff_mult=4,
                 dropout=0.1, position="rotary", max_positions=1024, attention=None, tokenizer_version=1,
                 aa_frequencies=None, vocabulary="protein-performer", qkv_bias=False, norm_eps=1e-5,
                 token_dropout=False, lm_head="tied", rotary_inv_freq="float64", rotary_base=10000.0, finetune_task=None, pooling="mean",
                 target_scale=None, classifier_dropout=0.0, ensemble_share=None, pooling_ends=0, **kwargs):
        self.vocab_size, self.objective, self.causal = vocab_size, objective, causal
        self.dim, self.depth, self.heads, self.ff_mult, self.dropout = dim, depth, heads, ff_mult, dropout
        self.position, self.max_positions, self.rotary_base = position, max_positions, rotary_base
        self.attention = dict(attention or {})
        self.tokenizer_version, self.aa_frequencies = tokenizer_version, aa_frequencies
        # models converted from ESM-2 (protein-performer convert-esm); the defaults are protein-performer's own
        self.vocabulary, self.qkv_bias, self.norm_eps = vocabulary, qkv_bias, norm_eps
        self.token_dropout, self.lm_head, self.rotary_inv_freq = token_dropout, lm_head, rotary_inv_freq
        # a fine-tuned head (protein-performer finetune): classification | regression | residue, its pooling,
        # the regression target's (mean, std) (outputs are standardized), the dropout before its linear layer
        self.finetune_task, self.pooling, self.target_scale = finetune_task, pooling, target_scale
        self.pooling_ends = pooling_ends  # pooling=termini: the residues at each end the head also averages
        self.classifier_dropout = classifier_dropout
        # finetune's output-space ensemble: the fine-tuned network's share, the probe's network beside it (None: none)
        self.ensemble_share = ensemble_share
        super().__init__(**kwargs)
