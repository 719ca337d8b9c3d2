"""Zero-shot scoring: every strategy against the test's own computation from plain forwards,
multi-mutant sums, the offset, the causal ratio against whole-sequence log-likelihoods from
the scoring core (the shared wild-type prefix changes nothing), the metrics against hand-
computed values, and bad input as one line, exit 2, nothing written."""
import csv
import json
import math
import random
import sys

import numpy as np
import pytest
import torch

from protein_performer import score as S
from protein_performer.objectives import score_rows, scored_example
from protein_performer.training.task import ProteinLM
from protein_performer.tokenizer import Tokenizer

from conftest import ROOT, TINY_MODEL, run_command, save_checkpoint
from forkserver import forks

AA = "ACDEFGHIKLMNPQRSTVWY"
TOK = Tokenizer()


def tiny(causal=False, kernel="softmax", seed=0):
    torch.manual_seed(seed)
    model = {**TINY_MODEL, "causal": causal, "attention": {"kernel": kernel, "nb_features": 16}}
    return ProteinLM(model=model, objective="clm" if causal else "mlm").eval()


def random_protein(n, seed):
    rng = random.Random(seed)
    return "".join(rng.choice(AA) for _ in range(n))


def random_mutants(wt, n, seed, offset=1, multi_every=4):
    """Single mutants, every ``multi_every``-th a double or triple (positions numbered from offset)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        positions = rng.sample(range(len(wt)), 1 if k % multi_every else 2 + k % 2)
        out.append(":".join(f"{wt[p]}{p + offset}{rng.choice(AA)}" for p in sorted(positions)))
    return out


def write_assay(path, mutants, dms=None, bins=None, extra=None):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["mutant", *(["DMS_score"] if dms is not None else []), *(["DMS_score_bin"] if bins is not None else []),
                    *(extra or {})])
        for k, m in enumerate(mutants):
            w.writerow([m, *([dms[k]] if dms is not None else []), *([bins[k]] if bins is not None else []),
                        *(v[k] for v in (extra or {}).values())])
    return path


def read_scores(path, column):
    with open(path, newline="") as fh:
        return [float(r[column]) if r[column] else math.nan for r in csv.DictReader(fh)]


def substitutions(mutant, offset=1):
    return [(int(s[1:-1]) - offset, s[0], s[-1]) for s in mutant.split(":")]


# --- the test's own computation: one plain forward per question --------------------------
@torch.no_grad()
def logprobs(net, seq, mask_at=None):
    x = torch.tensor(TOK.encode(seq), dtype=torch.long)
    if mask_at is not None:
        x[mask_at + 1] = TOK.mask_id
    return torch.log_softmax(net(x[None])[0].double(), -1)


def aa(c):
    return TOK.aa_offset + "ACDEFGHIKLMNPQRSTVWYXBZUO".index(c)


def hand_masked_marginal(net, wt, mutant, offset=1):
    total = 0.0
    for i, w, m in substitutions(mutant, offset):
        lp = logprobs(net, wt, mask_at=i)[i + 1]
        total += float(lp[aa(m)] - lp[aa(w)])
    return total


def hand_wt_marginal(net, wt, mutant):
    lp = logprobs(net, wt)
    return sum(float(lp[i + 1, aa(m)] - lp[i + 1, aa(w)]) for i, w, m in substitutions(mutant))


def hand_pll(net, seq):
    return sum(float(logprobs(net, seq, mask_at=i)[i + 1, aa(c)]) for i, c in enumerate(seq))


def mutate(wt, mutant, offset=1):
    s = list(wt)
    for i, _, m in substitutions(mutant, offset):
        s[i] = m
    return "".join(s)


@torch.no_grad()
def core_log_likelihood(net, seq):
    """log p(protein) from the project's scoring core: residues given the ones before."""
    inputs, labels = scored_example(TOK.encode(seq), "clm", TOK)
    return -float(score_rows(net(inputs[None]), labels[None])["nll"][0])


# --- running the command in this process ----------------------------------------------------
def run_score(capsys, *overrides):
    """``protein-performer score`` with ``overrides``: (exit status, stdout, stderr)."""
    return run_command("score", capsys, "device=cpu", *overrides)

@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    task = tiny()
    return task, save_checkpoint(task, tmp_path_factory.mktemp("mlm") / "mlm.ckpt")


@pytest.fixture(scope="module")
def clm(tmp_path_factory):
    task = tiny(causal=True, seed=1)
    return task, save_checkpoint(task, tmp_path_factory.mktemp("clm") / "clm.ckpt")


# --- masked-LM strategies ---------------------------------------------------------------------
def test_masked_strategies_equal_plain_forwards_and_multi_mutants_sum(mlm, tmp_path, capsys):
    task, ckpt = mlm
    wt = random_protein(37, 0)
    mutants = random_mutants(wt, 14, 1) + ["A1A" if wt[0] == "A" else f"{wt[0]}1{wt[0]}"]  # synonymous: 0
    singles = mutants[4].split(":")  # a double or triple, and its parts as single mutants
    assert len(singles) >= 2
    mutants += singles
    assay = write_assay(tmp_path / "assay.csv", mutants)
    out = tmp_path / "scored.csv"
    code, stdout, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={wt}", f"output={out}",
                                  "strategies=[masked_marginal,wt_marginal,pll]", "max_tokens=100")  # 2 copies a batch
    assert code == 0, err
    net = task.model
    mm, wm, pl = (read_scores(out, c) for c in ("masked_marginal", "wt_marginal", "pll"))
    base = hand_pll(net, wt)
    for k, m in enumerate(mutants):
        assert mm[k] == pytest.approx(hand_masked_marginal(net, wt, m), abs=1e-6), m
        assert wm[k] == pytest.approx(hand_wt_marginal(net, wt, m), abs=1e-6), m
        assert pl[k] == pytest.approx(hand_pll(net, mutate(wt, m)) - base, abs=1e-5), m
    assert mm[14] == 0.0 and pl[14] == pytest.approx(0.0, abs=1e-9)
    n = len(singles)
    assert mm[4] == pytest.approx(sum(mm[-n:]), abs=1e-9)  # masked marginal of a multi-mutant: the sum
    assert wm[4] == pytest.approx(sum(wm[-n:]), abs=1e-9)
    assert abs(mm[4]) > 1e-3 and len({round(v, 6) for v in mm}) > 10  # not all equal / zero
    with open(out, newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ["mutant", "masked_marginal", "wt_marginal", "pll"] and [r[0] for r in rows[1:]] == mutants
    summary = json.loads((tmp_path / "scored.metrics.json").read_text())
    assert summary["assays"]["assay.csv"]["scored"] == len(mutants) and summary["average"] == {}


def test_the_whole_long_protein_is_the_context(mlm, tmp_path, capsys):
    """1,300 residues (longer than ESM's 1,022 window): a mutation far from a masked position
    changes it, and the score equals one forward over the whole protein."""
    task, ckpt = mlm
    wt = random_protein(1300, 2)
    mutants = [f"{wt[1249]}1250{'A' if wt[1249] != 'A' else 'C'}", f"{wt[9]}10{'W' if wt[9] != 'W' else 'Y'}"]
    assay = write_assay(tmp_path / "long.csv", mutants)
    out = tmp_path / "long_scored.csv"
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={wt}", f"output={out}")
    assert code == 0, err
    got = read_scores(out, "masked_marginal")
    for k, m in enumerate(mutants):
        assert got[k] == pytest.approx(hand_masked_marginal(task.model, wt, m), abs=1e-6)
    cut = wt[1000:]  # what a 300-residue window around position 1250 would see
    windowed = hand_masked_marginal(task.model, cut, f"{wt[1249]}250{mutants[0][-1]}")
    assert abs(windowed - got[0]) > 1e-6


def test_offset_renumbers_the_positions(mlm, tmp_path, capsys):
    task, ckpt = mlm
    wt = random_protein(30, 3)
    at1 = random_mutants(wt, 8, 4)
    at101 = random_mutants(wt, 8, 4, offset=101)
    assert at1 != at101
    a1, a101 = write_assay(tmp_path / "a1.csv", at1), write_assay(tmp_path / "a101.csv", at101)
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={a101}", f"sequence={wt}", "offset=101",
                             f"output={tmp_path / 's101.csv'}")
    assert code == 0, err
    got = read_scores(tmp_path / "s101.csv", "masked_marginal")
    for k, m in enumerate(at101):
        assert got[k] == pytest.approx(hand_masked_marginal(task.model, wt, m, offset=101), abs=1e-6)
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={a1}", f"sequence={wt}", f"output={tmp_path / 's1.csv'}")
    assert code == 0 and read_scores(tmp_path / "s1.csv", "masked_marginal") == got
    # the same file read without its offset: positions past the end, or the wrong residue
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={a101}", f"sequence={wt}", f"output={tmp_path / 'x.csv'}")
    assert code == 2 and f"{a101}:2: mutant {at101[0]!r}" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.csv").exists()


# --- causal LM ------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["softmax", "exact"])
def test_causal_ratio_equals_whole_sequence_log_likelihoods(kernel, tmp_path, capsys):
    """The wild type's state is shared up to each group's first mutated position (groups of 3
    mutants with different first positions); the ratio equals the difference of whole-sequence
    log-likelihoods, each from one full forward through the scoring core."""
    task = tiny(causal=True, kernel=kernel, seed=1)
    ckpt = save_checkpoint(task, tmp_path / "clm.ckpt")
    wt = random_protein(33, 5)
    mutants = random_mutants(wt, 11, 6, multi_every=3)
    mutants += [f"{wt[0]}1{'G' if wt[0] != 'G' else 'A'}", f"{wt[-1]}33{'G' if wt[-1] != 'G' else 'A'}"]  # ends
    assay = write_assay(tmp_path / "assay.csv", mutants)
    out = tmp_path / "scored.csv"
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={wt}", f"output={out}",
                             "rnn_batch=3")
    assert code == 0, err
    got = read_scores(out, "log_likelihood_ratio")
    base = core_log_likelihood(task.model, wt)
    want = [core_log_likelihood(task.model, mutate(wt, m)) - base for m in mutants]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert min(map(abs, want)) > 1e-3  # every mutant changes the likelihood


def test_strategies_refused_for_the_other_kind_of_model(mlm, clm, tmp_path, capsys):
    wt = random_protein(20, 7)
    assay = write_assay(tmp_path / "a.csv", random_mutants(wt, 3, 8))
    for (_, ckpt), strategy, needle in ((clm, "masked_marginal", "needs a mlm model"),
                                        (mlm, "log_likelihood_ratio", "needs a clm model"),
                                        (mlm, "best", "is not one of")):
        code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={wt}",
                                 f"output={tmp_path / 'o.csv'}", f"strategies=[{strategy}]")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv"]


# --- metrics ----------------------------------------------------------------------------------
def test_metrics_against_hand_computed_values():
    assert S.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(1 - 6 * 4 / (5 * 24))  # 0.8
    # ties take average ranks: x ranks 1, 2.5, 2.5, 4; y ranks 1, 3, 2, 4 -> Pearson 4.5 / sqrt(4.5 * 5)
    assert S.spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert S.spearman([1, 1, 1], [1, 2, 3]) is None
    # 20 mutants, top 10 % = 2: predicted best are mutants 19 (gain 1) and 10 (gain 10/19)
    y_true = np.arange(20.0)
    y_score = np.zeros(20)
    y_score[19], y_score[10] = 5.0, 4.0
    ideal = 1 + (18 / 19) / math.log2(3)
    assert S.ndcg(y_true, y_score) == pytest.approx((1 + (10 / 19) / math.log2(3)) / ideal)
    assert S.ndcg(y_true, y_true) == pytest.approx(1.0)
    assert S.ndcg(np.arange(9.0), np.arange(9.0)) is None  # no top 10 % of 9
    assert S.auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)  # 3 of 4 pairs ordered
    assert S.auc([1, 1], [0.1, 0.2]) is None


def hand_spearman(x, y):
    """Pearson of average ranks, written out."""
    def ranks(v):
        v = np.asarray(v, float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            r[order[i:j + 1]] = (i + j) / 2 + 1
            i = j + 1
        return r
    a, b = ranks(x), ranks(y)
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / math.sqrt((a * a).sum() * (b * b).sum()))


def test_folder_of_assays_with_a_reference_file(mlm, tmp_path, capsys):
    """Two assays with their own wild types; per-assay Spearman against a hand-written rank
    correlation of the written scores; the average is their mean; rows without a score skip."""
    task, ckpt = mlm
    folder = tmp_path / "assays"
    folder.mkdir()
    wts = {"ONE_HUMAN": random_protein(25, 9), "TWO_YEAST": random_protein(31, 10)}
    for k, (name, wt) in enumerate(wts.items()):
        mutants = random_mutants(wt, 12, 11 + k)
        rng = random.Random(k)
        dms = [f"{rng.gauss(0, 1):.4f}" for _ in mutants]
        dms[3] = ""  # an unmeasured row: scored, left out of the metrics
        bins = [str(int(float(d) > 0)) if d else "" for d in dms]
        write_assay(folder / f"{name}.csv", mutants, dms, bins)
    ref = tmp_path / "reference.csv"
    ref.write_text("DMS_id,DMS_filename,target_seq,seq_len\n"
                   + "".join(f"{n},{n}.csv,{s},{len(s)}\n" for n, s in wts.items()) + "OTHER,OTHER.csv,MKV,3\n")
    out = tmp_path / "scored"
    code, stdout, err = run_score(capsys, f"ckpt={ckpt}", f"input={folder}", f"reference={ref}", f"output={out}")
    assert code == 0, err
    summary = json.loads((out / "metrics.json").read_text())
    rhos = []
    for name, wt in wts.items():
        with open(out / f"{name}.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
        assert len(rows) == 12
        for r in rows:
            assert float(r["masked_marginal"]) == pytest.approx(hand_masked_marginal(task.model, wt, r["mutant"]),
                                                                abs=1e-6)
        rows = [r for r in rows if r["DMS_score"]]
        rho = hand_spearman([float(r["masked_marginal"]) for r in rows], [float(r["DMS_score"]) for r in rows])
        m = summary["assays"][f"{name}.csv"]["metrics"]["masked_marginal"]
        assert m["spearman"] == pytest.approx(rho, abs=1e-12) and m["n"] == 11
        assert m["auc"] is not None and m["ndcg"] is not None  # 11 rows: top 10 % is 1 row
        assert f"{name}.csv: 12 mutants scored; masked_marginal: spearman {rho:.3f}" in stdout
        rhos.append(rho)
    assert summary["average"]["masked_marginal"]["spearman"] == pytest.approx(np.mean(rhos))
    assert summary["average"]["masked_marginal"]["assays"] == 2
    # the output may not be the input folder: it would replace the assays
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={folder}", f"reference={ref}", f"output={folder}")
    assert code == 2 and f"output={folder}: holds the input input ONE_HUMAN.csv=" in err
    # an assay the reference does not name
    (folder / "NEW.csv").write_text("mutant\nA1C\n")
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={folder}", f"reference={ref}",
                             f"output={tmp_path / 'other'}")
    assert code == 2 and "no wild type for NEW.csv" in err and not (tmp_path / "other").exists()


# --- bad input --------------------------------------------------------------------------------
WT = "MKTAYIAKQRQISFVKSHFSRQ"
BAD = {  # mutant (row 3 of the file) -> what the one line says
    "K2G:T3W:Q10A": "the wild type has 'R' at position 10, not 'Q'",
    "A40G": "position 40 is outside the wild type (residues 1..22",
    "A4": "malformed substitution 'A4'",
    "A4G;Y5F": "malformed substitution 'A4G;Y5F'",
    "a4g": "malformed substitution 'a4g'",
    "A4G:A4C": "position 4 is mutated twice",
    "A4*": "malformed substitution 'A4*'",
}


@pytest.mark.parametrize("mutant", BAD)
def test_bad_mutant_is_one_line_exit_2_and_writes_nothing(mutant, mlm, tmp_path, capsys):
    _, ckpt = mlm
    assay = write_assay(tmp_path / "assay.csv", ["M1A", "K2R", mutant, "T3S"])
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={WT}",
                             f"output={tmp_path / 'out' / 'scored.csv'}")
    assert code == 2
    assert err.startswith(f"error: {assay}:4: mutant {mutant!r}: {BAD[mutant]}") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_mutated_sequence_is_checked_and_skips_are_counted(mlm, tmp_path, capsys):
    task, ckpt = mlm
    mutants = ["M1A", "K2R", "A4G", "Q10A", "T3S"]
    seqs = [mutate(WT, m) for m in mutants]
    seqs[2] = mutate(WT, "A4C")  # says A4C, the mutant says A4G
    assay = write_assay(tmp_path / "assay.csv", mutants, extra={"mutated_sequence": seqs})
    out = tmp_path / "scored.csv"
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={WT}", f"output={out}")
    assert code == 2 and err.count("\n") == 1 and not out.exists()
    assert f"{assay}:4: mutant 'A4G': mutated_sequence is not the wild type with this mutant applied" in err
    code, stdout, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={WT}", f"output={out}",
                                  "on_invalid=skip")
    assert code == 0, err
    got = read_scores(out, "masked_marginal")
    assert math.isnan(got[2]) and math.isnan(got[3])  # Q10A: position 10 is R
    for k in (0, 1, 4):
        assert got[k] == pytest.approx(hand_masked_marginal(task.model, WT, mutants[k]), abs=1e-6)
    assert "3 mutants scored, 2 skipped" in stdout
    assert json.loads((tmp_path / "scored.metrics.json").read_text())["assays"]["assay.csv"]["skipped"] == 2
    # a second run does not replace what exists unless asked
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence={WT}", f"output={out}",
                             "on_invalid=skip")
    assert code == 2 and "exists; pass overwrite=true" in err


def test_wild_type_from_a_fasta_and_the_script_entry_point(mlm, tmp_path, capsys):
    task, ckpt = mlm
    fasta = tmp_path / "wt.fasta"
    fasta.write_text(f">wt some protein\n{WT[:10]}\n{WT[10:]}\n")
    assay = write_assay(tmp_path / "assay.csv", ["M1A", "K2R:Y5F"])
    out = tmp_path / "scored.csv"
    cmd = [sys.executable, str(ROOT / "scripts" / "score.py"), f"ckpt={ckpt}", f"input={assay}",
           f"sequence_file={fasta}", f"output={out}", "device=cpu"]
    r = forks().run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert read_scores(out, "masked_marginal") == pytest.approx(
        [hand_masked_marginal(task.model, WT, m) for m in ("M1A", "K2R:Y5F")], abs=1e-6)
    code, _, err = run_score(capsys, f"ckpt={ckpt}", f"input={assay}", f"sequence_file={fasta}", f"output={assay}")
    assert code == 2 and err == f"error: output={assay}: is the input input={assay}; choose another output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assay.csv", "scored.csv", "scored.metrics.json", "wt.fasta"]
    assert not list(tmp_path.glob("outputs"))
