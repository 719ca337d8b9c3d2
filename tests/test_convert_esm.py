"""convert-esm against the references themselves: transformers' EsmForMaskedLM and fair-esm's ESM2,
random small models built offline, converted with kernel=exact, must give their logits and hidden
states (1e-5) at 10, 300 and 2,000 tokens (past ESM-2's 1,024 through rotary), and ESM's token ids."""
import argparse
import sys
from pathlib import Path

import pytest
import torch

from protein_performer.convert_esm import convert
from protein_performer.hub.load import load_pretrained

from forkserver import forks

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
SEQ = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVHSLAKWKRQTLGQHDFSAGEGLYTHMKALRPDEDRLSPLHSVYVDQWDWERVMGDGERQFSTLKSTVEAIWAGIKATEAAVSEEFGLAPFLPDQIHFVHSQELLSRYPDLDAKGRERAIAKDLGAVFLVGIGGKLSDGHRHDVRAPDYDDWSTPSELGHAGLNGDILVWNPVLEDAFELSSMGIRVDADTLKHQLALTGDEDRLELEWHQALLRGEMPQTIGGGIGQSRLTMLLLQLPHIGQVQAGVWPAACRESAL"


def _hf_model(token_dropout: bool):
    torch.manual_seed(1 + token_dropout)
    cfg = transformers.EsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, position_embedding_type="rotary", token_dropout=token_dropout,
                                 mask_token_id=32, pad_token_id=1, layer_norm_eps=1e-5, max_position_embeddings=4096,
                                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, emb_layer_norm_before=False)
    model = transformers.EsmForMaskedLM(cfg).eval()
    with torch.no_grad():  # biases and norms away from their 0 / 1 init, so a mapping slip shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ids(tok, length: int) -> torch.Tensor:
    """<cls> residues <eos> of ``length`` tokens, a few residues masked (token dropout's ratio)."""
    seq = (SEQ * (length // len(SEQ) + 1))[:length - 2]
    ids = torch.as_tensor(tok.encode(seq), dtype=torch.long)[None]
    ids[0, 3:3 + max(1, length // 20)] = tok.mask_id
    return ids


@pytest.mark.parametrize("token_dropout", [True, False])
def test_transformers_esm_converted_exactly(tmp_path, token_dropout):
    hf = _hf_model(token_dropout)
    hf.save_pretrained(tmp_path / "esm")
    convert(tmp_path / "esm", tmp_path / "out")
    model, tok = load_pretrained(tmp_path / "out")
    # ESM's float32 rotary frequencies, bit for bit (float64 ones differ by an ulp: 1e-4 rad at 2,000,
    # below what these small random models show in their logits)
    rotary = getattr(hf.esm, "rotary_embeddings", None) or hf.esm.encoder.layer[0].attention.self.rotary_embeddings
    assert torch.equal(model.blocks[0].attn.rotary.inv_freq, rotary.inv_freq)
    for length in (10, 300, 2000):
        ids = _ids(tok, length)
        with torch.no_grad():
            ref = hf(ids, output_hidden_states=True)
            logits, layers = model(ids, return_layers=True)
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=0)
        assert len(layers) == len(ref.hidden_states) == 3
        for ours, theirs in zip(layers, ref.hidden_states):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    # a padded batch: the real positions of the short protein are those transformers gives
    long, short = _ids(tok, 40)[0], _ids(tok, 25)[0]
    ids = torch.full((2, 40), tok.pad_id)
    ids[0], ids[1, :25] = long, short
    pad = ids == tok.pad_id
    with torch.no_grad():
        ref = hf(ids, attention_mask=(~pad).long()).logits
        ours = model(ids, padding_mask=pad)
    torch.testing.assert_close(ours[~pad], ref[~pad], atol=1e-5, rtol=0)


def test_tokenizer_encodes_to_esm_ids(tmp_path):
    _hf_model(True).save_pretrained(tmp_path / "esm")
    convert(tmp_path / "esm", tmp_path / "out")
    _, tok = load_pretrained(tmp_path / "out")
    esm_tok = transformers.EsmTokenizer(str(tmp_path / "out" / "vocab.txt"))
    seq = "ACDEFGHIKLMNPQRSTVWYXBUZO" + SEQ[:40]
    assert tok.encode(seq).tolist() == esm_tok(seq)["input_ids"]
    assert (tok.cls_id, tok.pad_id, tok.eos_id, tok.unk_id, tok.mask_id, tok.vocab_size) == (0, 1, 2, 3, 32, 33)
    assert tok.encode("LAGV").tolist() == [0, 4, 5, 6, 7, 2]  # ESM's order: L=4, A=5, G=6, V=7


def test_fair_esm_checkpoint_converted_exactly(tmp_path):
    esm = pytest.importorskip("esm")
    torch.manual_seed(3)
    alphabet = esm.Alphabet.from_architecture("ESM-1b")
    ref = esm.model.esm2.ESM2(num_layers=2, embed_dim=64, attention_heads=4, alphabet=alphabet,
                              token_dropout=True).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
        # nn.Embedding's N(0, 1) init gives logits near 30, where float32 round-off alone (fair-esm's
        # against float64) reaches 2e-5; at ESM-2's scale (transformers inits 0.02) 1e-5 means a mapping error
        ref.embed_tokens.weight.mul_(0.1)
    # fair-esm's checkpoint layout: prefixed state dict, settings as an argparse.Namespace
    state = {("encoder." if k.startswith("lm_head") else "encoder.sentence_encoder.") + k: v
             for k, v in ref.state_dict().items()}
    cfg = argparse.Namespace(encoder_layers=2, encoder_embed_dim=64, encoder_attention_heads=4, token_dropout=True)
    torch.save({"model": state, "cfg": {"model": cfg}}, tmp_path / "esm2_tiny.pt")
    convert(tmp_path / "esm2_tiny.pt", tmp_path / "out")
    model, tok = load_pretrained(tmp_path / "out")
    batch_converter = alphabet.get_batch_converter()
    for length in (10, 300, 2000):
        ids = _ids(tok, length)
        seq = (SEQ * (length // len(SEQ) + 1))[:length - 2]
        _, _, esm_ids = batch_converter([("p", seq)])
        assert esm_ids[0].tolist() == tok.encode(seq).tolist()  # fair-esm's own ids
        with torch.no_grad():
            out = ref(ids, repr_layers=[2])
            logits, layers = model(ids, return_layers=True)
        torch.testing.assert_close(logits, out["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(layers[-1], out["representations"][2], atol=1e-5, rtol=0)


def test_linear_kernel_keeps_esm_weights(tmp_path):
    _hf_model(True).save_pretrained(tmp_path / "esm")
    convert(tmp_path / "esm", tmp_path / "exact")
    convert(tmp_path / "esm", tmp_path / "relu", attention={"kernel": "relu", "nb_features": 32})
    exact, tok = load_pretrained(tmp_path / "exact")
    relu, _ = load_pretrained(tmp_path / "relu")
    assert relu.blocks[0].attn.kernel == "relu" and relu.blocks[0].attn.num_features == 32
    e, r = exact.state_dict(), relu.state_dict()
    for k, v in e.items():
        if not k.endswith("_extra_state"):
            assert torch.equal(v, r[k]), k
    ids = _ids(tok, 50)
    with torch.no_grad():  # the same weights, another attention: other outputs
        assert not torch.allclose(exact(ids), relu(ids), atol=1e-3)
    card = (tmp_path / "relu" / "README.md").read_text()
    assert "license: mit" in card and "transformers EsmForMaskedLM" in card


def test_bad_inputs_are_one_line(tmp_path):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    code = ("import sys\nfrom protein_performer.cli import main\nfor a in sys.argv[1:]:\n"
            "    try:\n        main(['convert-esm', 'input=' + a, 'output=' + a + '.out'])\n"
            "    except SystemExit as e:\n        print('rc', e.code, flush=True)\n")
    inputs = [tmp_path / n for n in ("missing", "bert", "junk.pt", "other.pt")]
    r = forks().run([sys.executable, "-c", code, *map(str, inputs)], capture_output=True, text=True, cwd=ROOT,
                    timeout=120)
    assert r.stdout.split("\n")[:4] == ["rc 2"] * 4, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 4 and len(r.stderr.strip().splitlines()) == 4, r.stderr
    assert "no such file" in errors[0] and "model_type is 'bert'" in errors[1]
    assert "junk.pt" in errors[2] and "other.pt" in errors[3] and "fair-esm" in errors[3]
    assert not any(p.with_name(p.name + ".out").exists() for p in inputs)


def test_transformers_code_of_the_converted_directory(tmp_path):
    """The directory's own transformers code (trust_remote_code) gives ESM-2's logits and hidden states too."""
    hf = _hf_model(True)
    hf.save_pretrained(tmp_path / "esm")
    convert(tmp_path / "esm", tmp_path / "out")
    remote = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "out", trust_remote_code=True).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    batch = tok([SEQ[:300], SEQ[:120]], return_tensors="pt", padding=True)
    batch["input_ids"][:, 5:9] = tok.mask_token_id
    with torch.no_grad():
        ref = hf(**batch, output_hidden_states=True)
        ours = remote(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(ours.logits[real], ref.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.hidden_states[-1][real], ref.hidden_states[-1][real], atol=1e-5, rtol=0)


def test_embed_reads_esm_ids(tmp_path):
    """embed's mean of the converted directory is that of transformers' ESM on ESM's ids (a tokenizer
    of protein-performer's vocabulary would feed it other residues)."""
    from protein_performer.embed import embed_sequences
    hf = _hf_model(True)
    hf.save_pretrained(tmp_path / "esm")
    convert(tmp_path / "esm", tmp_path / "out")
    esm_tok = transformers.EsmTokenizer(str(tmp_path / "out" / "vocab.txt"))
    seqs = {"a": SEQ[:50], "b": SEQ[100:130]}
    got = embed_sequences(str(tmp_path / "out"), seqs)
    for i, (name, seq) in enumerate(seqs.items()):
        with torch.no_grad():
            h = hf.esm(torch.tensor([esm_tok(seq)["input_ids"]])).last_hidden_state[0, 1:-1]
        assert got["ids"][i] == name
        torch.testing.assert_close(torch.as_tensor(got["mean"][i]), h.mean(0), atol=1e-5, rtol=0)
