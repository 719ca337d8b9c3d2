"""Probe: recovers a planted signal, scores chance on shuffled labels, composition by hand,
task detection, id / sequence matching, the three evaluation protocols."""
import json
import os
import re
import sys

import h5py
import numpy as np
import pytest

from protein_performer.formats.tabular import sequence_id
from protein_performer.probe import composition_features, detect_task, load_embeddings, read_labels, run_probe

from conftest import ROOT
from forkserver import forks

AA = np.array(list("ACDEFGHIKLMNPQRSTVWY"))


def write_h5(path, ids, X, layers=None):
    with h5py.File(path, "w") as f:
        f.create_dataset("ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
        if layers is None:
            f["mean"] = X.astype(np.float32)
        else:
            for layer, x in zip(layers, X):
                f[f"mean/{layer}"] = x.astype(np.float32)


def planted(n=240, d=8, seed=0, noise=0.3):
    """Binary labels carried by embedding dimension 0 (and nothing in the sequences)."""
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < 0.35).astype(int)
    X = rng.normal(size=(n, d))
    X[:, 0] += 2.5 * (2 * y - 1) * (1 + noise * rng.normal(size=n))
    seqs = ["".join(rng.choice(AA, rng.integers(30, 60))) for _ in range(n)]
    return X, y, seqs


def write_labels(path, rows, header):
    path.write_text(",".join(header) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))


def test_planted_signal_is_found_and_shuffled_labels_give_chance(tmp_path):
    X, y, seqs = planted()
    ids = [sequence_id(s) for s in seqs]
    write_h5(tmp_path / "e.h5", ids, X)
    write_labels(tmp_path / "l.csv", zip(seqs, y), ["seq", "label"])
    r = run_probe(str(tmp_path / "e.h5"), str(tmp_path / "l.csv"), folds=3)
    assert r["task"] == "classification" and r["protocol"] == "3-fold cross-validation"
    assert r["n_train"] == 240 and r["missing_embeddings"] == 0
    majority = 1 - y.mean()
    assert r["chance"]["accuracy"] == pytest.approx(majority)
    assert r["embedding"]["accuracy"] > 0.93 and r["embedding"]["macro_f1"] > 0.9
    # random sequences carry no signal: composition and shuffled labels sit near chance
    for name in ("composition", "shuffled_labels"):
        assert abs(r[name]["accuracy"] - majority) < 0.08, (name, r[name])
        assert r[name]["macro_f1"] < 0.6


def test_regression_spearman_and_split_column(tmp_path):
    rng = np.random.default_rng(1)
    n = 200
    X = rng.normal(size=(n, 6))
    target = X[:, 2] * 1.5 + 0.2 * rng.normal(size=n)
    ids = [f"p{i}" for i in range(n)]
    write_h5(tmp_path / "e.h5", ids, X)
    split = ["test" if i % 4 == 0 else "train" for i in range(n)]
    write_labels(tmp_path / "l.csv", zip(ids, [f"{t:.4f}" for t in target], split), ["id", "label", "split"])
    r = run_probe(str(tmp_path / "e.h5"), str(tmp_path / "l.csv"), shuffle_control=True)
    assert r["task"] == "regression" and r["protocol"] == "split column"
    assert (r["n_train"], r["n_test"]) == (150, 50)
    assert r["embedding"]["spearman"] > 0.95 and r["embedding"]["r2"] > 0.9
    assert abs(r["shuffled_labels"]["spearman"]) < 0.35
    assert r["composition"] == {"skipped": "labels have no seq column"}


def test_test_file_layers_and_missing_rows(tmp_path):
    X, y, seqs = planted(n=200, seed=2)
    ids = [f"id{i}" for i in range(200)]
    # two layers: only layer 3 carries the signal
    noise = np.random.default_rng(5).normal(size=X.shape)
    write_h5(tmp_path / "e.h5", ids[:190], [noise[:190], X[:190]], layers=[0, 3])
    write_labels(tmp_path / "train.csv", zip(ids[:150], y[:150]), ["id", "label"])
    write_labels(tmp_path / "test.csv", zip(ids[150:], y[150:]), ["id", "label"])
    with pytest.raises(ValueError, match="holds layers"):
        run_probe(str(tmp_path / "e.h5"), str(tmp_path / "train.csv"))
    r = run_probe(str(tmp_path / "e.h5"), str(tmp_path / "train.csv"), str(tmp_path / "test.csv"), layer=3,
                  shuffle_control=False)
    assert r["protocol"] == "test file" and (r["n_train"], r["n_test"]) == (150, 40)
    assert r["missing_embeddings"] == 10  # ids 190..199 have no embedding: counted, not fatal
    assert r["embedding"]["accuracy"] > 0.9 and "C" in r["embedding"]
    r0 = run_probe(str(tmp_path / "e.h5"), str(tmp_path / "train.csv"), str(tmp_path / "test.csv"), layer=0,
                   shuffle_control=False)
    assert r0["embedding"]["accuracy"] < r["embedding"]["accuracy"] - 0.15


def test_composition_by_hand():
    c = composition_features(["AAC", "wy", "AXB"])
    assert c.shape == (3, 20)
    assert c[0, 0] == pytest.approx(2 / 3) and c[0, 1] == pytest.approx(1 / 3) and c[0, 2:].sum() == 0
    assert c[1, -2] == pytest.approx(0.5) and c[1, -1] == pytest.approx(0.5)  # W, Y (lowercase ok)
    assert c[2].sum() == pytest.approx(1 / 3)  # X and B count in the length only


def test_detect_task():
    assert detect_task(["a", "b", "c"]) == "classification"
    assert detect_task(["0", "1", "1"]) == "classification"
    assert detect_task(["0.5", "1.25", "3"]) == "regression"
    assert detect_task([str(i) for i in range(50)]) == "regression"


def test_read_labels_errors_and_skips(tmp_path):
    p = tmp_path / "x.csv"
    p.write_text("name,label\nA,1\n")
    with pytest.raises(ValueError, match=r"x.csv:1: .*'id' or 'seq'"):
        read_labels(p)
    p.write_text("seq,label\nMKT,1\nMKV,\nACD,0\n")
    t = read_labels(p)
    assert t.ids == [sequence_id("MKT"), sequence_id("ACD")] and t.skipped == {"empty": 1, "duplicate": 0}
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        load_embeddings(tmp_path / "nope.csv")
    # a byte-order mark before the header (spreadsheet exports) and non-ASCII residues
    p.write_bytes("\ufeffid,seq,label\nA,MKT,1\nB,MK→,0\n".encode())
    t = read_labels(p)
    assert t.ids == ["A", "B"] and t.labels == ["1", "0"]
    assert composition_features(t.seqs)[1].sum() == pytest.approx(2 / 3)  # '→' counts in the length only


def test_cli_writes_json(tmp_path):
    X, y, seqs = planted(n=120, seed=3)
    write_h5(tmp_path / "e.h5", [sequence_id(s) for s in seqs], X)
    write_labels(tmp_path / "l.csv", zip(y, seqs), ["label", "seq"])
    r = forks().run([sys.executable, str(ROOT / "scripts" / "probe.py"), f"embeddings={tmp_path / 'e.h5'}",
                     f"labels={tmp_path / 'l.csv'}", f"output={tmp_path / 'r.json'}", "folds=3",
                     "shuffle_control=false"],
                    capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "WANDB_MODE": "disabled"})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["embedding"]["accuracy"] > 0.9 and "composition" in res
    assert "embedding " in r.stdout


def test_cli_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    from test_embed import run_script  # (pytest puts tests/ on sys.path)
    X, y, seqs = planted(n=60, seed=4)
    ids = [f"p{i}" for i in range(60)]
    write_h5(tmp_path / "e.h5", ids, X)
    write_labels(tmp_path / "nolabel.csv", zip(ids, y), ["id", "class"])
    write_labels(tmp_path / "other.csv", zip([f"q{i}" for i in range(60)], y), ["id", "label"])
    (tmp_path / "e.txt").write_text("not hdf5\n")
    out = tmp_path / "r.json"
    cases = [
        ([f"labels={tmp_path / 'nolabel.csv'}"], r"nolabel\.csv:1: header \['id', 'class'\] needs a 'label' column"),
        ([f"labels={tmp_path / 'other.csv'}"], r"no labeled rows of .*other\.csv match ids in .*e\.h5"),
        ([f"labels={tmp_path / 'nope.csv'}"], r"labels .*nope\.csv: no such file"),
        ([f"embeddings={tmp_path / 'e.txt'}"], r"embeddings .*e\.txt: not an HDF5 file"),
        (["pooling=cls"], r"embeddings .*e\.h5: no 'ids' and 'cls' datasets \(has \['ids', 'mean'\]\)"),
    ]
    before = sorted(p.name for p in tmp_path.iterdir())
    for overrides, pattern in cases:
        args = {"embeddings": f"embeddings={tmp_path / 'e.h5'}", "labels": f"labels={tmp_path / 'other.csv'}",
                "output": f"output={out}"}
        for o in overrides:
            args[o.split("=")[0]] = o
        code, err = run_script("probe", capsys, *args.values())
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (overrides, err)
        assert re.search(pattern, lines[0]), (pattern, lines[0])
        assert sorted(p.name for p in tmp_path.iterdir()) == before
    code, err = run_script("probe", capsys)
    assert code == 2 and err.startswith("error: embeddings is required")


def test_a_progress_line_per_fitted_probe(tmp_path, caplog):
    X, y, seqs = planted(n=80, seed=5)
    write_h5(tmp_path / "e.h5", [sequence_id(s) for s in seqs], X)
    write_labels(tmp_path / "l.csv", zip(seqs, y), ["seq", "label"])
    caplog.set_level("INFO", logger="protein_performer")
    run_probe(str(tmp_path / "e.h5"), str(tmp_path / "l.csv"), folds=3)
    done = [r.getMessage() for r in caplog.records if "done in" in r.getMessage()]
    assert [m.split(":")[0] for m in done] == ["probe 1/3 (embedding)", "probe 2/3 (composition)",
                                               "probe 3/3 (shuffled labels)"]


def test_a_rare_class_is_one_plain_warning_and_no_sklearn_repeats(caplog):
    """A class with one training protein: one warning naming it as the file writes it ('c', not
    np.str_('c')), and none of scikit-learn's per-fold 'least populated class' warnings."""
    import logging
    import warnings

    import numpy as np

    from protein_performer.probe import check_split, fit_and_score
    y = np.array(["a"] * 12 + ["b"] * 12 + ["c"])
    X = np.random.default_rng(0).normal(size=(len(y), 4)) + (y == "b")[:, None]
    with caplog.at_level(logging.WARNING, logger="protein_performer"):
        check_split([(np.arange(len(y)), y)], "classification", "l.csv", "l.csv", folds=3)
    assert caplog.messages == ["classes with fewer than 4 training proteins, the least the probe's 3-fold "
                               "cross-validation needs: 'c' (1); their scores are unreliable"]  # one fold count
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fit_and_score("classification", X, y, folds=3, seed=0)
    assert not [w for w in seen if "least populated" in str(w.message)]
    assert 0 <= result["accuracy"] <= 1


@pytest.mark.parametrize("classes", [2, 5])
def test_the_probes_solver_reaches_newton_choleskys_optimum(classes):
    """Newton-CG (Hessian-vector products: fast on wide multiclass features), which the probe's "auto" takes on
    these 200 rows, and scikit-learn's Newton-Cholesky (the explicit Hessian) minimize the same penalized
    log-loss: same C, same probabilities."""
    from protein_performer.probe import SOLVER, make_probe
    rng = np.random.default_rng(classes)
    X = rng.normal(size=(300, 40))
    y = np.argmax(X[:, :classes] + 0.8 * rng.normal(size=(300, classes)), 1)  # the first dims carry the class
    fast = make_probe("classification", 3, 0).fit(X[:200], y[:200])
    ref = make_probe("classification", 3, 0, solver="newton-cholesky").fit(X[:200], y[:200])
    assert SOLVER == "auto" and fast[-1].solver == "auto" and fast[-1].solver_ == "newton-cg"
    assert ref[-1].solver_ == "newton-cholesky"
    assert float(np.ravel(fast[-1].C_)[0]) == float(np.ravel(ref[-1].C_)[0])
    np.testing.assert_allclose(fast.predict_proba(X[200:]), ref.predict_proba(X[200:]), atol=2e-3)
    assert np.mean(fast.predict(X[200:]) == y[200:]) > 1.5 / classes  # it learned: well above chance


def test_the_probes_solver_follows_rows_per_coefficient():
    """solver_for by hand: Newton-Cholesky from 20 rows per coefficient (features x classes; one column when
    binary), Newton-CG below; "auto" fitted on many rows of few features is Newton-Cholesky's fit exactly."""
    from protein_performer.probe import make_probe
    from protein_performer.probe_solver import ROWS_PER_COEF, solver_for
    assert ROWS_PER_COEF == 20
    assert solver_for(2000, 100, 2) == "newton-cholesky" and solver_for(2000, 101, 2) == "newton-cg"
    assert solver_for(20000, 256, 3) == "newton-cholesky"            # ss3's per-residue probe: 15,360 <= 20,000
    assert solver_for(2000, 640, 12) == "newton-cg" and solver_for(2000, 128, 7) == "newton-cg"
    assert solver_for(300, 5, 3) == "newton-cholesky" and solver_for(299, 5, 3) == "newton-cg"
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 5))
    y = np.argmax(X[:, :3] + rng.normal(size=(600, 3)), 1)
    auto = make_probe("classification", 3, 0).fit(X, y)
    ref = make_probe("classification", 3, 0, solver="newton-cholesky").fit(X, y)
    assert auto[-1].solver_ == "newton-cholesky" and auto[-1].get_params()["solver"] == "auto"
    np.testing.assert_array_equal(auto[-1].coef_, ref[-1].coef_)
    assert np.mean(auto.predict(X) == y) > 0.5                       # three classes: chance is about 1/3
    import pickle  # a probe the test built itself: it pickles by name and predicts the same after
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(auto)).predict_proba(X), auto.predict_proba(X))
    one_class = make_probe("classification", 3, 0)[-1]
    with pytest.raises(ValueError):
        one_class.fit(X, np.zeros(len(X), int))
    assert not hasattr(one_class, "solver_") and one_class.solver == "auto"  # a failed fit claims no solver
