import math

import torch

from protein_performer.data.collate import Collator
from protein_performer.objectives import IGNORE, Scores, clm_labels, mask_tokens, score_rows, scored_example
from protein_performer.tokenizer import Tokenizer

tok = Tokenizer()


def _random_proteins(n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    aa = torch.tensor(tok.standard_aa_ids)[torch.randint(20, (n, length), generator=g)]
    cls = torch.full((n, 1), tok.cls_id)
    eos = torch.full((n, 1), tok.eos_id)
    return torch.cat([cls, aa, eos], 1)


def test_masking_statistics_80_10_10():
    tokens = _random_proteins(400, 500)
    inputs, labels = mask_tokens(tokens, tok, torch.Generator().manual_seed(1), 0.15)
    residues = tokens >= tok.aa_offset
    selected = labels != IGNORE
    n_res, n_sel = residues.sum().item(), selected.sum().item()
    # 200,000 residues: selection rate within 5 standard errors of 15 %
    assert abs(n_sel / n_res - 0.15) < 5 * math.sqrt(0.15 * 0.85 / n_res)
    assert not (selected & ~residues).any(), "special tokens are never selected"
    assert torch.equal(labels[selected], tokens[selected])
    masked = (inputs == tok.mask_id) & selected
    changed = (inputs != tokens) & (inputs != tok.mask_id) & selected
    kept = (inputs == tokens) & selected
    # random replacement keeps the original 1/20 of the time, so 'kept' = 10 % + 10 %/20
    se = 5 * math.sqrt(0.25 / n_sel)
    assert abs(masked.sum().item() / n_sel - 0.80) < se
    assert abs(changed.sum().item() / n_sel - 0.10 * 19 / 20) < se
    assert abs(kept.sum().item() / n_sel - (0.10 + 0.10 / 20)) < se
    assert torch.equal(inputs[~selected], tokens[~selected]), "unselected positions untouched"
    assert set(inputs[changed].unique().tolist()) <= set(tok.standard_aa_ids)


def test_clm_labels_shift_and_ignore_padding():
    tokens = torch.tensor([[2, 5, 6, 3], [2, 7, 3, 0]])
    inputs, labels = clm_labels(tokens, tok.pad_id)
    assert inputs.tolist() == [[2, 5, 6], [2, 7, 3]]
    assert labels.tolist() == [[5, 6, 3], [7, 3, IGNORE]]


def test_metrics_on_hand_made_batch():
    # vocab of 3; two scored positions and one ignored.
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [1 / 3, 1 / 3, 1 / 3]]]))
    labels = torch.tensor([[0, 2, IGNORE]])
    rows = score_rows(logits, labels)
    assert all(v.dtype == torch.float64 and v.shape == (1,) for v in rows.values())
    expected_nll = -(math.log(0.5) + math.log(0.1))
    assert math.isclose(rows["nll"].item(), expected_nll, rel_tol=1e-6)
    assert rows["count"].item() == 2 and rows["correct"].item() == 1
    m = Scores(sequences=1).add({k: v.item() for k, v in rows.items()}).metrics(baseline=False)
    assert math.isclose(m["perplexity"], math.sqrt(20), rel_tol=1e-6)  # exp(nll / 2)
    assert m["accuracy"] == 0.5 and m["num_tokens"] == 2 and m["baseline_perplexity"] is None


def test_perplexity_is_token_weighted_across_batches():
    """exp of the summed NLL over all tokens, not exp of the mean of per-batch means."""
    s = Scores()
    s.add({k: v.sum().item() for k, v in score_rows(torch.log(torch.tensor([[[0.5, 0.5]]])), torch.tensor([[0]])).items()})
    s.add({k: v.sum().item() for k, v in
           score_rows(torch.log(torch.tensor([[[0.9, 0.1]] * 3])), torch.tensor([[0, 0, 0]])).items()})
    total = -(math.log(0.5) + 3 * math.log(0.9)) / 4
    assert math.isclose(s.metrics(False)["perplexity"], math.exp(total), rel_tol=1e-6)
    assert not math.isclose(s.metrics(False)["perplexity"], math.exp((-math.log(0.5) - math.log(0.9)) / 2), rel_tol=1e-3)


def test_sums_stay_exact_past_float32_precision():
    # 2^25 + 1 scored tokens: a float32 count would round the + 1 away
    s = Scores().add({"count": 2.0 ** 25}).add({"count": 1.0})
    assert s.count == 2 ** 25 + 1


def test_unigram_baseline_equals_entropy_against_frequencies():
    freqs = torch.zeros(tok.vocab_size, dtype=torch.float64)
    freqs[tok.standard_aa_ids[0]], freqs[tok.standard_aa_ids[1]] = 0.75, 0.25
    labels = torch.tensor([[tok.standard_aa_ids[0]] * 3 + [tok.standard_aa_ids[1]]])
    rows = score_rows(torch.zeros(1, 4, tok.vocab_size), labels, freqs)
    m = Scores().add({k: v.item() for k, v in rows.items()}).metrics()
    assert math.isclose(m["baseline_perplexity"], math.exp(-(3 * math.log(0.75) + math.log(0.25)) / 4), rel_tol=1e-9)
    assert m["baseline_accuracy"] == 0.75


def test_clm_scores_residues_given_the_residues_before_them():
    ids = tok.encode("MKV")  # <cls> M K V <eos>
    inputs, labels = scored_example(ids, "clm", tok)
    assert inputs.tolist() == [tok.cls_id, *tok.encode("MK", add_cls=False, add_eos=False).tolist()] + \
        [int(tok.encode("V", add_cls=False, add_eos=False)[0])]
    assert labels.tolist() == tok.encode("MKV", add_cls=False, add_eos=False).tolist() + [IGNORE]


def test_collator_pads_and_fixed_seed_is_reproducible():
    seqs = [torch.from_numpy(tok.encode("MKTAYIAKQR" * 5)).long(), torch.from_numpy(tok.encode("MKV")).long()]
    c = Collator(tok, "mlm", fixed_seed=3)
    b1, b2 = c(seqs), c(seqs)
    assert b1["inputs"].shape == (2, 52)
    assert torch.equal(b1["inputs"], b2["inputs"]) and torch.equal(b1["labels"], b2["labels"])
    assert b1["padding_mask"][1, 5:].all() and not b1["padding_mask"][1, :5].any()
    assert (b1["labels"][b1["padding_mask"]] == IGNORE).all()
