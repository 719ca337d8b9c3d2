"""Generation in RNN mode, held to independent references:

* the per-token logits of recurrent decoding against the parallel causal forward on the
  same tokens (every kernel, rotary and learned positions, with a prompt, several chunks);
* sampling filters against hand-made distributions;
* eos/min_length/max_length rules with a model whose eos logit is forced;
* the reported log-likelihood against log-softmax of the parallel forward;
* FASTA/JSON output parsed back with Biopython, composition against hand counts.
"""
import json
import math
import os
import sys

import pytest
import torch
from Bio import SeqIO

from protein_performer.errors import UserError
from protein_performer.generate import (GenerationError, composition_report, filter_logits,
                                        generate, likelihood_summary, load_generator, residue_frequencies, run,
                                        sample_next)
from protein_performer.training.task import ProteinLM
from protein_performer.tokenizer import AMINO_ACIDS, Tokenizer

from conftest import save_checkpoint as save
from forkserver import forks

KERNELS = ["softmax", "favor++", "relu", "trig", "elu", "exact"]
TOK = Tokenizer()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny per-token ops: intra-op threads only add contention on a shared machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_task(kernel="softmax", position="rotary", objective="clm", chunk_size=8, seed=0, **kw):
    torch.manual_seed(seed)
    task = ProteinLM(model=dict(dim=32, depth=2, heads=2, position=position, max_positions=64, dropout=0.1,
                                attention=dict(kernel=kernel, nb_features=16, chunk_size=chunk_size)),
                     objective=objective, **kw)
    model = task.model
    with torch.no_grad():
        # larger weights than the init, so attention is far from uniform and logits spread out
        model.embed.weight.normal_(0, 1.0)
        for b in model.blocks:
            b.attn.to_qkv.weight.mul_(3.0)
            fm = b.attn.feature_map
            if kernel == "favor++":
                fm.rho.fill_(0.8)  # a non-trivial OPRF (A != 0), as after training
    return task.eval()


def rnn_logits(model, tokens):
    """Feed tokens (B, L) one at a time through model.step -> (B, L, V)."""
    state = model.init_state(tokens.size(0))
    out = []
    for t in range(tokens.size(1)):
        logits, state = model.step(tokens[:, t], state)
        out.append(logits)
    return torch.stack(out, 1)


# --- equivalence: recurrent decoding == parallel causal forward ------------------------------
def fp32_tolerance(kernel, ref):
    """Absolute tolerance for fp32 logits: 2e-6 of the largest |logit| (a few ulps per layer).
    trig features are signed, so their normalizer q'.Z can be close to 0 and amplifies
    rounding (same algorithm: in float64 trig agrees to 1e-10, see the fp64 test); it gets 5e-4."""
    return (5e-4 if kernel == "trig" else 2e-6) * float(ref.abs().max())


def random_tokens(B=3, L=41, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(TOK.aa_offset, TOK.vocab_size, (B, L), generator=g)
    tokens[:, 0] = TOK.cls_id
    return tokens


@pytest.mark.parametrize("position", ["rotary", "learned"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_rnn_logits_match_parallel_forward(kernel, position):
    model = make_task(kernel, position).model
    tokens = random_tokens()
    with torch.no_grad():
        ref = model(tokens)                                  # chunk_size=8: 6 chunks
    got = rnn_logits(model, tokens)
    assert got.dtype == ref.dtype == torch.float32
    assert ref.std() > 2                                     # logits are far from flat
    err = (got - ref).abs().max()
    assert err <= fp32_tolerance(kernel, ref), err


@pytest.mark.parametrize("kernel", KERNELS)
def test_rnn_logits_match_parallel_forward_fp64(kernel):
    model = make_task(kernel).model.double()
    tokens = random_tokens()
    with torch.no_grad():
        ref = model(tokens)
    got = rnn_logits(model, tokens)
    assert got.dtype == torch.float64
    assert (got - ref).abs().max() <= 1e-10 * ref.abs().max()


@pytest.mark.parametrize("kernel", KERNELS)
def test_generated_logits_and_likelihood_match_parallel_forward_with_prompt(kernel):
    model = make_task(kernel).model
    samples = generate(model, num_samples=3, max_length=30, prompt="MKTAYIAK", seed=3, return_logits=True)
    for s in samples:
        assert s.sequence.startswith("MKTAYIAK")
        tokens = torch.tensor(s.tokens)
        with torch.no_grad():
            ref = model(tokens[None, :-1])[0]
        assert s.logits.shape == ref.shape
        assert (s.logits - ref).abs().max() <= fp32_tolerance(kernel, ref)
        # log-likelihood of the generated tokens (after <cls> + 8 prompt residues)
        logp = torch.log_softmax(ref.double(), -1).gather(-1, tokens[1:, None]).squeeze(-1)
        gen = logp[8:]
        assert s.num_scored == len(gen) == len(s.tokens) - 9
        assert s.log_likelihood == pytest.approx(float(gen.sum()), abs=1e-4 if kernel != "trig" else 1e-2)


def test_state_size_constant_for_linear_kernels_and_growing_kv_cache_for_exact():
    """Linear kernels (with the default local head, window 128): the state stops growing once the local
    cache holds window - 1 positions; exact attention (every head global, as model=transformer): a KV
    cache that grows with every token."""
    def nbytes(state):
        flat = [t for layer in state["layers"] for v in layer.values() for t in (v if isinstance(v, tuple) else (v,))]
        return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))

    tokens = torch.full((2,), TOK.aa_offset)
    for kernel, local in (("softmax", 1), ("elu", 1), ("exact", 0)):
        torch.manual_seed(0)
        model = ProteinLM(model=dict(dim=32, depth=2, heads=2, max_positions=64, dropout=0.0,
                                     attention=dict(kernel=kernel, nb_features=16, local_heads=local)),
                          objective="clm").model.eval()
        state = model.init_state(2)
        sizes = []
        for _ in range(160):
            _, state = model.step(tokens, state)
            sizes.append(nbytes(state))
        if kernel == "exact":  # 2 (k, v) x depth x B x H x pos x head_dim x 4 bytes
            assert sizes[49] == 2 * 2 * 2 * 2 * 50 * 16 * 4 and sizes[-1] > sizes[49]
        else:  # per layer, fp32: S (B,1,r,d) + Z (B,1,r) + running key log-scale m (B,1,1) of the kernel head,
            # and the local head's k, v of the last window - 1 = 127 positions (B,1,127,d)
            r = model.blocks[0].attn.num_features
            assert sizes[-1] == sizes[130] == 2 * ((2 * r * 16 + 2 * r + 2) * 4 + 2 * 2 * 127 * 16 * 4)
            assert sizes[50] < sizes[130]


# --- sampling filters against hand-made distributions ---------------------------------------------
def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.5]])
    out = filter_logits(logits, top_k=2)
    assert torch.isinf(out).tolist() == [[True, False, True, True, False]]
    assert out[0, 1] == 3.0 and out[0, 4] == 2.5
    assert torch.equal(filter_logits(logits, top_k=0), logits)
    assert torch.equal(filter_logits(logits, top_k=10), logits)


@pytest.mark.parametrize("top_p, kept", [(0.3, [0]), (0.5, [0]), (0.7, [0, 1]), (0.85, [0, 1, 2]),
                                         (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_nucleus(top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    perm = torch.tensor([2, 0, 3, 1])                        # shuffled order: filtering is by value
    logits = probs.log()[perm][None]
    out = filter_logits(logits, top_p=top_p)
    kept_ids = sorted(int(perm[i]) for i in range(4) if torch.isfinite(out[0, i]))
    assert kept_ids == kept


def test_temperature_and_filters_sample_the_renormalized_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    # temperature T: p^(1/T) / sum, computed by hand
    for T in (0.5, 2.0):
        target = probs ** (1 / T) / (probs ** (1 / T)).sum()
        x = sample_next(logits, temperature=T, generator=torch.Generator().manual_seed(0))
        freq = torch.bincount(x, minlength=4).double() / len(x)
        sigma = (target * (1 - target) / len(x)).sqrt()
        assert ((freq - target).abs() <= 5 * sigma + 1e-9).all(), (freq, target)
    # top-k=2 then top-p=0.6 on the two kept (0.625, 0.375): only token 0 survives
    x = sample_next(logits, top_k=2, top_p=0.6, generator=torch.Generator().manual_seed(0))
    assert (x == 0).all()
    x = sample_next(logits, top_k=2, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(x, minlength=4).double() / len(x)
    assert freq[2] == freq[3] == 0 and abs(freq[0] - 0.625) < 0.02
    # temperature 0: greedy
    assert (sample_next(torch.tensor([[0.1, 2.0, 1.0]]), temperature=0) == 1).all()


# --- stopping rules ---------------------------------------------------------------------------------
def forced_eos(model, bias):
    with torch.no_grad():
        model.head_bias[TOK.eos_id] = bias
    return model


def test_stops_at_eos_and_min_length_suppresses_it():
    model = forced_eos(make_task("elu").model, 50.0)          # eos ~ certain
    s = generate(model, num_samples=4, max_length=20, seed=0)
    assert all(x.sequence == "" and x.stopped_at_eos and x.tokens == [TOK.cls_id, TOK.eos_id] for x in s)
    s = generate(model, num_samples=4, max_length=20, min_length=7, seed=0)
    assert all(len(x.sequence) == 7 and x.stopped_at_eos and x.tokens[-1] == TOK.eos_id for x in s)
    # min_length counts the prompt
    s = generate(model, num_samples=2, max_length=20, min_length=7, prompt="MKT", seed=0)
    assert all(len(x.sequence) == 7 and x.sequence.startswith("MKT") for x in s)


def test_stops_at_max_length_and_never_samples_special_tokens():
    model = forced_eos(make_task("softmax").model, -50.0)     # eos ~ impossible
    with torch.no_grad():
        model.head_bias[[TOK.pad_id, TOK.mask_id, TOK.cls_id, TOK.unk_id]] = 50.0  # must stay banned
    s = generate(model, num_samples=3, max_length=25, prompt="MK", seed=0, batch_size=2)
    assert len(s) == 3
    for x in s:
        assert len(x.sequence) == 25 and not x.stopped_at_eos
        assert all(t >= TOK.aa_offset for t in x.tokens[1:])
        assert x.num_scored == 23


def test_seed_reproducibility():
    model = make_task("favor++").model
    a = generate(model, num_samples=4, max_length=30, seed=7)
    b = generate(model, num_samples=4, max_length=30, seed=7)
    c = generate(model, num_samples=4, max_length=30, seed=8)
    assert [x.sequence for x in a] == [x.sequence for x in b]
    assert [x.log_likelihood for x in a] == [x.log_likelihood for x in b]
    assert [x.sequence for x in a] != [x.sequence for x in c]


# --- reports and output -------------------------------------------------------------------------------
def test_composition_against_hand_counts():
    comp = residue_frequencies(["AAC", "CA", "W"])
    assert comp["A"] == pytest.approx(3 / 6) and comp["C"] == pytest.approx(2 / 6)
    assert comp["W"] == pytest.approx(1 / 6) and comp["G"] == 0.0

    class S:  # minimal stand-in for Sample: composition counts generated residues only
        def __init__(self, seq, prompt):
            self.sequence, self.prompt = seq, prompt
    freqs = [0.0] * TOK.vocab_size
    freqs[TOK.aa_offset + AMINO_ACIDS.index("A")] = 0.5
    freqs[TOK.aa_offset + AMINO_ACIDS.index("G")] = 0.5
    rep = composition_report([S("MKAA", "MK"), S("MKAC", "MK")], freqs)
    assert rep["generated"]["A"] == pytest.approx(0.75) and rep["generated"]["M"] == 0
    # TV = 0.5 * (|0.75-0.5| + |0-0.5| + |0.25-0|) = 0.5
    assert rep["total_variation"] == pytest.approx(0.5)
    assert rep["kl_generated_training"] > 1  # C has (almost) zero training frequency


@pytest.fixture(scope="module")
def clm_ckpt(tmp_path_factory):
    freqs = [0.0] * TOK.vocab_size
    for i in range(20):
        freqs[TOK.aa_offset + i] = 0.05
    return save(make_task("softmax", aa_frequencies=freqs), tmp_path_factory.mktemp("ckpt") / "clm.ckpt")


def test_run_writes_fasta_with_settings_and_json_report(clm_ckpt, tmp_path, capsys):
    out = tmp_path / "gen" / "out.fasta"
    payload = run(clm_ckpt, str(out), num_samples=5, max_length=40, min_length=10, temperature=0.8, top_k=15,
                  top_p=0.95, prompt="mkt", seed=11, batch_size=2, device="cpu", progress=False)
    records = list(SeqIO.parse(str(out), "fasta"))
    assert len(records) == 5
    for i, r in enumerate(records):
        seq = str(r.seq)
        assert r.id == f"sample_{i}" and seq.startswith("MKT") and 10 <= len(seq) <= 40
        for kv in ("temperature=0.8", "top_k=15", "top_p=0.95", "min_length=10", "max_length=40",
                   "prompt=MKT", "seed=11", "ckpt=clm.ckpt", f"length={len(seq)}"):
            assert kv in r.description, (kv, r.description)
        mean = float(r.description.split("mean_loglik=")[1].split()[0])
        assert mean == pytest.approx(payload["samples"][i]["mean_log_likelihood"], abs=1e-4)
    rep = json.loads((tmp_path / "gen" / "out.json").read_text())
    assert rep["settings"]["top_p"] == 0.95 and rep["summary"]["num_samples"] == 5
    assert rep["composition"]["training"]["A"] == pytest.approx(0.05)
    assert rep["composition"]["generated"] == pytest.approx(
        residue_frequencies([str(r.seq)[3:] for r in records]))
    printed = capsys.readouterr().out
    assert "mean per-token log-likelihood" in printed and "total variation distance" in printed
    # the same settings and seed give the same file
    run(clm_ckpt, str(tmp_path / "again.fasta"), num_samples=5, max_length=40, min_length=10, temperature=0.8,
        top_k=15, top_p=0.95, prompt="MKT", seed=11, batch_size=2, device="cpu", progress=False)
    assert (tmp_path / "again.fasta").read_text() == out.read_text()


def test_likelihood_summary_is_token_weighted():
    class S:
        def __init__(self, ll, n, seq):
            self.log_likelihood, self.num_scored, self.sequence, self.stopped_at_eos = ll, n, seq, True

        @property
        def mean_log_likelihood(self):
            return self.log_likelihood / self.num_scored
    s = likelihood_summary([S(-2.0, 1, "A"), S(-6.0, 3, "AAA")])
    assert s["mean_log_likelihood_per_token"] == pytest.approx(-2.0)
    assert s["mean_of_sample_means"] == pytest.approx(-2.0)
    assert s["perplexity"] == pytest.approx(math.exp(2.0))


# --- bad input: one-line errors ---------------------------------------------------------------------------
def test_errors(clm_ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.ckpt: no such file"):
        load_generator(str(tmp_path / "missing.ckpt"))
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="junk.ckpt: cannot load"):
        load_generator(str(tmp_path / "junk.ckpt"))
    mlm = save(make_task("softmax", objective="mlm"), tmp_path / "mlm.ckpt")
    with pytest.raises(GenerationError, match="objective=mlm.*objective=clm"):
        load_generator(mlm)
    model, _ = load_generator(clm_ckpt)
    with pytest.raises(GenerationError, match=r"invalid residue '1' at position 3"):
        generate(model, prompt="MK1T")
    with pytest.raises(GenerationError, match="max_length=3 leaves none to generate"):
        generate(model, prompt="MKTAY", max_length=3)
    with pytest.raises(GenerationError, match="min_length"):
        generate(model, max_length=5, min_length=6)
    with pytest.raises(GenerationError, match="top_p"):
        generate(model, top_p=0.0)
    with pytest.raises(GenerationError, match="learned positions"):
        generate(make_task("elu", position="learned").model, max_length=65)
    for e in (GenerationError,):
        assert "\n" not in str(e("x"))


def test_script_end_to_end(clm_ckpt, tmp_path):
    out = tmp_path / "s.fasta"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = forks().run([sys.executable, "scripts/generate.py", f"ckpt={clm_ckpt}", "num_samples=3", "max_length=20",
                     "temperature=0.9", "top_k=10", "top_p=0.9", "prompt=MKT", "seed=5", f"output={out}",
                     "device=cpu", f"hydra.run.dir={tmp_path}/h"],
                    cwd=REPO, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    recs = list(SeqIO.parse(str(out), "fasta"))
    assert len(recs) == 3 and all(str(r.seq).startswith("MKT") for r in recs)
    assert "top_k=10" in recs[0].description and (tmp_path / "s.json").exists()
    p = forks().run([sys.executable, "scripts/generate.py", f"ckpt={tmp_path}/nope.ckpt", f"output={tmp_path / 't.fasta'}",
                     f"hydra.run.dir={tmp_path}/h"], cwd=REPO, capture_output=True, text=True, env=env,
                    timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: checkpoint")
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "t.fasta").exists()


@pytest.mark.parametrize("kernel", ["softmax", "trig", "exact"])
def test_prompt_prefilled_in_one_call_samples_the_tokens_of_token_by_token_prefill(kernel):
    """generate feeds the prompt in one chunked call; feeding it one token at a time (as before)
    gives the same tokens for a fixed seed, and the same logits to float tolerance."""
    model = make_task(kernel).model
    one_by_one = make_task(kernel).model
    step = one_by_one.step

    def token_by_token(tokens, state):
        if tokens.dim() == 1:
            return step(tokens, state)
        logits = []
        for t in range(tokens.shape[1]):
            lg, state = step(tokens[:, t], state)
            logits.append(lg)
        return torch.stack(logits, 1), state
    one_by_one.step = token_by_token
    a = generate(model, num_samples=4, max_length=40, prompt="MKTAYIAKQRQISFVK", seed=5, return_logits=True)
    b = generate(one_by_one, num_samples=4, max_length=40, prompt="MKTAYIAKQRQISFVK", seed=5, return_logits=True)
    assert [s.tokens for s in a] == [s.tokens for s in b]
    for x, y in zip(a, b):
        assert (x.logits - y.logits).abs().max() <= fp32_tolerance(kernel, y.logits)
