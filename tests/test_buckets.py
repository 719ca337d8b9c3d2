"""Static length buckets (data/buckets.py): the bucket set, batch shapes, and padding that changes no
result: evaluation's figures, embeddings and variant scores with and without buckets (float64, 1e-10)."""
import numpy as np
import pytest
import torch

from protein_performer.data.buckets import bucket_of, bucket_shape, check_buckets, default_buckets, padding_share
from protein_performer.data.sampler import TokenBudgetBatchSampler
from protein_performer.embed.embedder import Embedder
from protein_performer.errors import UserError
from protein_performer.evaluate import evaluate_model
from protein_performer.hub.load import load_model
from protein_performer.model import PerformerLM
from protein_performer.score import Scorer
from protein_performer.tokenizer import Tokenizer

AA = list("ACDEFGHIKLMNPQRSTVWY")


def test_default_buckets_are_three_per_octave_from_64():
    assert default_buckets(1) == [64]
    assert default_buckets(300) == [64, 80, 96, 128, 160, 192, 256, 320]
    assert default_buckets(320) == default_buckets(300)
    assert bucket_of([64, 80, 96], 65) == 80 and bucket_of([64, 80, 96], 96) == 96
    assert bucket_of([64, 80, 96], 97) == 97 and bucket_of(None, 97) == 97  # beyond the last / no buckets
    assert bucket_shape([64, 128], 70, 3, 1024) == (8, 128) and bucket_shape([64, 128], 70, 3, None) == (3, 128)
    assert bucket_shape(None, 70, 3, 1024) == (3, 70)
    # 10 + 60 real tokens padded to 2 x 64 (budget 128): 58 of 128 are padding
    assert padding_share([[10, 60]], [64], 128) == pytest.approx(58 / 128)
    assert check_buckets([128, 64, 64], 100) == [64, 128] and check_buckets([64], 100) == [64, 100]
    for bad in ("often", [0, 64], ["a"], []):
        with pytest.raises(UserError, match="data.buckets"):
            check_buckets(bad, 100)


def test_sampler_cuts_batches_by_their_bucket():
    lengths = np.array([60, 61, 62, 63, 70, 70, 90, 120])
    sampler = TokenBudgetBatchSampler(lengths, 256, shuffle=False, buckets=[64, 128])
    batches = [lengths[b].tolist() for b in sampler]
    # four of <= 64 fit 256 tokens of 64; those of 65-128 go two by two
    assert batches == [[60, 61, 62, 63], [70, 70], [90, 120]]
    assert sampler.padding()[0] == pytest.approx(1 - lengths.sum() / (4 * 64 + 2 * 128 + 2 * 128))


@pytest.fixture(scope="module")
def model64():
    torch.manual_seed(0)
    net = PerformerLM(vocab_size=Tokenizer().vocab_size, dim=32, depth=2, heads=2, dropout=0.0,
                      attention=dict(kernel="softmax", nb_features=16, local_heads=1, local_window=8))
    return load_model(net.double())


def proteins(n, seed=0):
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(AA, int(k))) for k in rng.integers(20, 150, n)]


def test_buckets_change_no_embedding(model64):
    tok = model64.tokenizer
    seqs = [tok.encode(s) for s in proteins(7)]
    out = []
    for buckets in (None, default_buckets(160)):
        emb = Embedder(model64.net, [1, 2], ["mean", "max"], per_residue=True, tokenizer=tok,
                       buckets=buckets)
        rows = [None] * len(seqs)
        for batch in emb.batches([len(s) for s in seqs], 400):
            for k, r in zip(batch, emb.forward([seqs[k] for k in batch], tok.pad_id)):
                rows[k] = r
        out.append(rows)
    for a, b in zip(*out):
        for layer in (1, 2):
            for p in ("mean", "max"):
                np.testing.assert_allclose(b["pooled"][p][layer], a["pooled"][p][layer], rtol=0, atol=1e-10)
            np.testing.assert_allclose(b["per_residue"][layer], a["per_residue"][layer], rtol=0, atol=1e-10)
    assert np.abs(out[0][0]["pooled"]["mean"][2]).max() > 0.1


def test_buckets_change_no_evaluation_figure(model64):
    seqs = proteins(9, seed=1)
    plain = evaluate_model(model64, seqs, max_tokens=512, progress=False)
    bucketed = evaluate_model(model64, seqs, max_tokens=512, progress=False, buckets="auto")
    assert plain["num_tokens"] > 100 and plain["num_sequences"] == 9
    for key in ("loss", "perplexity", "accuracy", "num_tokens"):
        assert bucketed[key] == pytest.approx(plain[key], rel=0, abs=1e-10)


def test_buckets_change_no_variant_score(model64):
    wt = model64.tokenizer.encode(proteins(1, seed=2)[0]).astype(np.int64)
    positions = list(range(1, len(wt) - 1))
    plain = Scorer(model64, max_tokens=1024).masked(wt, positions)
    bucketed = Scorer(model64, max_tokens=1024, buckets=default_buckets(len(wt))).masked(wt, positions)
    assert bucket_of(default_buckets(len(wt)), len(wt)) > len(wt)  # padding really happened
    np.testing.assert_allclose(bucketed, plain, rtol=0, atol=1e-10)
    assert np.isfinite(plain).all() and plain.max() < 0


def test_inference_batches_are_padded_to_their_bucket():
    """What the equality tests above rest on: pad_batch really pads to the bucket (so they compare
    padded against unpadded), marking every added position as padding."""
    from protein_performer.data.collate import pad_batch
    tokens, mask = pad_batch([np.arange(5, 10), np.arange(5, 8)], 0, [4, 8])
    assert tokens.shape == (2, 8) and tokens[0, :5].tolist() == [5, 6, 7, 8, 9] and tokens[:, 5:].eq(0).all()
    assert mask.tolist() == [[False] * 5 + [True] * 3, [False] * 3 + [True] * 5]
    assert pad_batch([np.arange(5, 9)], 0, [4, 8])[1] is None  # a bucket's length exactly: nothing padded
