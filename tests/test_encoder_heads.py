"""The encoder/head split: PerformerLM keeps the state_dict keys (and parameter order) of the
single class it was, so older checkpoints and exports load; the encoder's hidden states, the
tied LM head and the task heads against hand-computed references; token ids of any integer
dtype (the tokenizer's uint8) go straight into the model."""
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn

import protein_performer
from protein_performer.model.heads import (LayerMeansHead, LMHead, SequenceClassificationHead, TokenClassificationHead,
                                           masked_mean, residue_mask)
from protein_performer.model.pooling import end_masks
from protein_performer.model import PerformerEncoder, PerformerLM
from protein_performer.hub.load import load_pretrained
from protein_performer.tokenizer import Tokenizer

TOK = Tokenizer()
PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "MQIFVKTLTG", "GSHMLEDPVAGKW"]


def tiny(**kw):
    torch.manual_seed(0)
    settings = dict(dim=16, depth=2, heads=2, ff_mult=2, dropout=0.0, attention={"kernel": "favor++", "nb_features": 8})
    model = PerformerLM(**{**settings, **kw}).eval()
    with torch.no_grad():  # away from the initialization, so that every part of the model matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def batch(sequences=PROTEINS):
    """Right-padded int64 ids (B, L) and the padding mask (True = padding)."""
    ids = [torch.as_tensor(TOK.encode(s), dtype=torch.long) for s in sequences]
    tokens = nn.utils.rnn.pad_sequence(ids, batch_first=True, padding_value=TOK.pad_id)
    return tokens, tokens == TOK.pad_id


def block_keys(i, kernel_buffers):
    return [f"blocks.{i}.norm1.weight", f"blocks.{i}.norm1.bias", f"blocks.{i}.attn._extra_state",
            f"blocks.{i}.attn.to_qkv.weight", f"blocks.{i}.attn.to_out.weight", f"blocks.{i}.attn.to_out.bias",
            *[f"blocks.{i}.attn.feature_map.{b}" for b in kernel_buffers],
            f"blocks.{i}.norm2.weight", f"blocks.{i}.norm2.bias", f"blocks.{i}.ff.fc1.weight", f"blocks.{i}.ff.fc1.bias",
            f"blocks.{i}.ff.fc2.weight", f"blocks.{i}.ff.fc2.bias"]


# the keys, in order, of PerformerLM's state_dict before the split (written down from that code)
BEFORE_SPLIT = {
    "learned favor++": (dict(position="learned", max_positions=40),
                        ["head_bias", "embed.weight", "pos_embed.weight",
                         *block_keys(0, ["projection", "rho", "rho_updates"]),
                         *block_keys(1, ["projection", "rho", "rho_updates"]), "norm.weight", "norm.bias"]),
    "rotary exact": (dict(depth=1, attention={"kernel": "exact"}),
                     ["head_bias", "embed.weight", *block_keys(0, []), "norm.weight", "norm.bias"]),
}


@pytest.mark.parametrize("name", sorted(BEFORE_SPLIT))
def test_state_dict_keys_and_parameter_order_are_those_before_the_split(name):
    settings, keys = BEFORE_SPLIT[name]
    model = tiny(**settings)
    state = model.state_dict()
    assert list(state) == keys
    # the parameters in the same order (an optimizer's state in a checkpoint is by position)
    params = [k for k in keys if not k.endswith(("_extra_state", "projection", "rho", "rho_updates"))]
    assert [p.data_ptr() for p in model.parameters()] == [state[k].data_ptr() for k in params]
    # a state in the old keys loads strictly, also nested (a Lightning checkpoint's "model." prefix)
    other = PerformerLM(model.config)
    other.load_state_dict(state)
    parent = nn.Module()
    parent.model = PerformerLM(model.config)
    parent.load_state_dict({f"model.{k}": v for k, v in state.items()})
    for m in (other, parent.model):
        assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items() if torch.is_tensor(v))
        assert m.embed.weight is m.encoder.embed.weight and m.head_bias is m.lm_head.bias
    # keys it does not know are still refused by name, in the old spelling
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "head\.weight"'):
        other.load_state_dict({**state, "head.weight": state["embed.weight"]})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "head_bias", "norm\.bias"'):
        other.load_state_dict({k: v for k, v in state.items() if k not in ("norm.bias", "head_bias")})
    deeper = {**state, **{k.replace("blocks.0.", "blocks.7."): v for k, v in state.items() if "blocks.0." in k}}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "model\.blocks\.7\.norm1\.weight"'):
        parent.load_state_dict({f"model.{k}": v for k, v in deeper.items()})
    assert "_loading_prefix" not in vars(other)


@pytest.mark.parametrize("causal", [False, True])
def test_encoder_gives_the_hidden_states_and_the_head_the_logits(causal):
    model = tiny(causal=causal)
    tokens, pad = batch()
    with torch.no_grad():
        hidden = model.encoder(tokens, pad)
        logits, layers = model(tokens, pad, return_layers=True)
        # the reference: each part applied by hand
        x = model.encoder.embed.weight[tokens]
        for block in model.encoder.blocks:
            x = block(x, pad)
        ref = nn.functional.layer_norm(x, (16,), model.encoder.norm.weight, model.encoder.norm.bias)
    assert hidden.shape == (3, tokens.shape[1], 16) and isinstance(model.encoder, PerformerEncoder)
    torch.testing.assert_close(hidden, ref, rtol=0, atol=1e-6)
    assert torch.equal(layers[-1], hidden) and len(layers) == 3
    torch.testing.assert_close(logits, hidden @ model.embed.weight.T + model.head_bias, rtol=0, atol=1e-6)
    assert torch.equal(model.logits(hidden), logits)


def test_step_gives_the_hidden_state_of_the_parallel_pass():
    model = tiny(causal=True, position="learned", max_positions=40)
    tokens, _ = batch(PROTEINS[:1])
    with torch.no_grad():
        parallel = model.encoder(tokens)
    state, lm_state = model.encoder.init_state(1), model.init_state(1)
    for i in range(8):
        h, state = model.encoder.step(tokens[:, i], state)
        logits, lm_state = model.step(tokens[:, i], lm_state)
        torch.testing.assert_close(h, parallel[:, i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, h @ model.embed.weight.T + model.head_bias, rtol=0, atol=1e-6)
    assert state["pos"] == 8


def test_lm_head_is_tied_and_holds_only_its_bias():
    head = LMHead(30)
    assert [n for n, _ in head.named_parameters()] == ["bias"]
    with torch.no_grad():
        head.bias.copy_(torch.arange(30.0))
    w, h = torch.randn(30, 4), torch.randn(2, 3, 4)
    by_hand = torch.stack([torch.stack([torch.tensor([float(h[b, i] @ w[v]) + v for v in range(30)])
                                        for i in range(3)]) for b in range(2)])
    torch.testing.assert_close(head(h, w), by_hand, rtol=1e-5, atol=1e-5)


def test_sequence_head_pools_over_residues_only():
    model = tiny()
    tokens, pad = batch()
    residues = residue_mask(tokens)
    lengths = [len(s) for s in PROTEINS]
    # residues: positions 1..n of "<cls> residues <eos>", as embed's mean pooling counts them
    assert residues.tolist() == [[1 <= j <= n for j in range(tokens.shape[1])] for n in lengths]
    torch.manual_seed(1)
    head = SequenceClassificationHead(16, 3, dropout=0.5).eval()
    with torch.no_grad():
        hidden = model.encoder(tokens, pad)
        out = head(hidden, residues)
        by_hand = torch.stack([hidden[i, 1:n + 1].mean(0) for i, n in enumerate(lengths)]) @ head.out.weight.T \
            + head.out.bias
        torch.testing.assert_close(out, by_hand, rtol=1e-5, atol=1e-6)
        # padding changes nothing: each protein alone gives the same output
        for i, s in enumerate(PROTEINS):
            alone, _ = batch([s])
            torch.testing.assert_close(head(model.encoder(alone), residue_mask(alone))[0], out[i], rtol=1e-4, atol=1e-5)
    assert out.shape == (3, 3) and SequenceClassificationHead(16, 1)(hidden, residues).shape == (3, 1)  # regression
    torch.testing.assert_close(masked_mean(hidden, None), hidden.mean(1))


def test_end_masks_by_hand():
    # <cls> A B C D E <eos> <pad>: residues at 1..5; then a protein of 2 residues, padded
    mask = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    first, last = end_masks(mask, 3)
    assert first.int().tolist() == [[0, 1, 1, 1, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert last.int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]  # fewer than 3: all of them


def test_termini_head_reads_each_layers_mean_and_the_ends_of_the_last():
    model = tiny()
    seqs = ["MKTAYIAKQRQISFVKSHFSRQ", "MEEPQ", "ACDEFGHIKLMNPQRSTVWYACDEFG"]
    tokens, pad = batch(seqs)
    k = 4
    torch.manual_seed(1)
    head = LayerMeansHead(16, 2, dropout=0.0, layers=model.encoder.depth + 1, ends=k).eval()
    assert head.out.in_features == 16 * (model.encoder.depth + 3)
    with torch.no_grad():
        _, hs = model.encoder(tokens, pad, return_layers=True)
        got = head.probe_features(hs, residue_mask(tokens))
        for i, s in enumerate(seqs):  # each protein alone, its residues sliced by hand
            _, own = model.encoder(batch([s])[0], return_layers=True)
            own = [h[0, 1:len(s) + 1] for h in own]
            want = torch.cat([h.mean(0) for h in own] + [own[-1][:k].mean(0), own[-1][-k:].mean(0)])
            torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(got[0, -32:-16], got[0, -16:])  # the two ends differ where the protein is long


def test_token_head_gives_one_output_per_position():
    torch.manual_seed(2)
    head = TokenClassificationHead(4, 3).eval()
    h = torch.randn(2, 5, 4)
    out = head(h)
    w, b = head.out.weight, head.out.bias
    for i in range(2):
        for j in range(5):
            torch.testing.assert_close(out[i, j], torch.stack([h[i, j] @ w[c] + b[c] for c in range(3)]))


@pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy.ndarrays")  # torch's, about speed
def test_tokenizer_output_goes_straight_into_the_model():
    model = tiny()
    ids = TOK.encode(PROTEINS[0])
    assert ids.dtype == np.uint8  # compact, as the shards hold them
    with torch.no_grad():
        ref = model(torch.as_tensor(ids, dtype=torch.long)[None])
        for tokens in (torch.tensor([TOK.encode(PROTEINS[0])]), torch.tensor(ids[None]), torch.from_numpy(ids)[None], torch.tensor([ids.tolist()], dtype=torch.int32),
                       torch.tensor([ids.tolist()], dtype=torch.int16)):
            assert torch.equal(model(tokens), ref), tokens.dtype
        assert torch.equal(model.encoder(torch.from_numpy(ids)[None]), model.encoder(torch.from_numpy(ids)[None].long()))
    causal = tiny(causal=True)
    _, state = causal.step(torch.from_numpy(ids[:1]), causal.init_state(1))  # uint8 in RNN mode too
    with pytest.raises(TypeError, match="token ids must be integers, got a torch.float32 tensor"):
        model(torch.as_tensor(ids, dtype=torch.float32)[None])


def test_load_pretrained_is_at_the_top_level_and_the_import_stays_light():
    assert protein_performer.load_pretrained is load_pretrained
    code = ("import sys, protein_performer\n"
            "assert 'torch' not in sys.modules and 'load_pretrained' in dir(protein_performer)\n"
            "protein_performer.load_pretrained\n"
            "assert 'torch' in sys.modules\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    with pytest.raises(AttributeError, match="no attribute 'load_pretrainde'"):
        protein_performer.load_pretrainde
