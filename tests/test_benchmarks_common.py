"""benchmarks/common.py, the plumbing every benchmark shares, against known contents: child
processes' JSON lines, exit reasons and timeouts; docs rewritten with the hand-written text
kept; markdown tables written and read back."""
from benchmarks import common  # the repository root is on sys.path (pyproject: pytest pythonpath)


def test_child_records_failures_and_timeouts(tmp_path):
    script = tmp_path / "child.py"
    script.write_text("import json, sys, time\n"
                      "print('not json'); print(json.dumps({'L': 8, 't': 0.5})); print(json.dumps([1]))\n"
                      "sys.stdout.flush()\n"
                      "if sys.argv[1] == 'fail': sys.exit('out of memory at L=16')\n"
                      "if sys.argv[1] == 'hang': time.sleep(30)\n")
    ok = common.run_child(script, ["ok"])
    assert ok.ok and ok.records == [{"L": 8, "t": 0.5}]
    bad = common.run_child(script, ["fail"])
    assert not bad.ok and bad.records == [{"L": 8, "t": 0.5}] and bad.reason == "out of memory at L=16"
    slow = common.run_child(script, ["hang"], timeout=1)
    assert slow.timed_out and not slow.ok and slow.reason == "killed after 1 s"


def test_docs_keep_hand_written_text(tmp_path):
    doc = tmp_path / "doc.md"
    common.write_doc(doc, "# Generated\n\ntable v1", keep_below=True)
    doc.write_text(doc.read_text() + "My reading of the table.\n")
    common.write_doc(doc, "# Generated\n\ntable v2")
    text = doc.read_text()
    assert "table v2" in text and "table v1" not in text and text.endswith("My reading of the table.\n")

    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- s -->\nold\n" + common.KEEP_BELOW + "\nkept\n<!-- e -->\noutro\n")
    assert common.write_between(page, "<!-- s -->", "<!-- e -->", "new")
    text = page.read_text()
    assert text.startswith("intro\n<!-- s -->\nnew") and "old" not in text and "kept" in text
    assert text.endswith("<!-- e -->\noutro\n")
    assert not common.write_between(page, "<!-- x -->", "<!-- e -->", "new")  # a missing marker: nothing written


def test_markdown_tables_round_trip(tmp_path):
    lines = common.md_table(["model", "L", "seconds"], [["performer", "8,192", "0.239"], ["exact", "", "1.390"]])
    (tmp_path / "t.md").write_text("# Results\n\n" + "\n".join(lines) + "\n\n# Next\n")
    rows = common.read_md_table(tmp_path / "t.md", "Results")
    assert rows == [{"model": "performer", "L": "8,192", "seconds": "0.239"}, {"model": "exact", "L": "", "seconds": "1.390"}]
    assert common.number(rows[0]["L"]) == 8192 and common.number(rows[1]["seconds"]) == 1.39


def test_measure_keeps_warmup_apart():
    calls = []
    t = common.measure(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and len(t.warmup) == 2 and len(t.runs) == 3 and t.best <= t.median


def test_every_benchmark_script_parses_its_arguments():
    """Each benchmarks/**/*.py and data/labeled/scripts/*.py answers --help (its argument parser, defaults
    included, is built without error): a benchmark is only run by hand, so nothing else would notice a broken one."""
    import sys

    from forkserver import forks  # each script in a child process of its own, its imports of torch done
    scripts = sorted(p for p in [*common.ROOT.joinpath("benchmarks").rglob("*.py"), *common.ROOT.glob("data/labeled/scripts/*.py")]
                     if p.name not in ("__init__.py", "common.py"))
    assert len(scripts) >= 10
    for script in scripts:
        r = forks().run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                        cwd=common.ROOT)
        assert r.returncode == 0 and "usage:" in r.stdout, (script.name, r.stderr[-500:])


def test_downstream_per_task_values_parse_and_refuse(capsys):
    """downstream's --train / --task-epochs TASK=N: a good list gives {task: N}; an unknown task or a
    non-positive count is one line naming the flag and the item, exit 2 (argparse's error)."""
    import argparse

    import pytest

    from benchmarks.quality import downstream
    ap = argparse.ArgumentParser(prog="downstream.py")
    assert downstream.parse_per_task(ap, "--train", ["scop=8000", "ss3=10"]) == {"scop": 8000, "ss3": 10}
    for bad in ("foo=3", "scop=0", "scop", "scop=x"):
        with pytest.raises(SystemExit) as e:
            downstream.parse_per_task(ap, "--train", [bad])
        assert e.value.code == 2 and f"--train {bad!r}" in capsys.readouterr().err


def test_downstream_kept_column_names_the_weights_and_their_confidence():
    """The top table's `kept (confidence)` cell, from finetune's selection: the epoch or the probe, and the
    best epoch's bootstrap confidence where one was measured (none: the probe won validation outright)."""
    from benchmarks.quality import downstream
    assert downstream.kept({"selection": {"kept": "epoch 6", "confidence": 0.9975}}) == "epoch 6 (0.998)"
    assert downstream.kept({"selection": {"kept": "probe", "confidence": 0.896}}) == "probe (0.896)"
    assert downstream.kept({"selection": {"kept": "probe"}}) == "probe"
    assert downstream.kept(None) == "–" and downstream.kept({"accuracy": 0.9}) == "–"
    # pooling=auto's choice after it
    assert downstream.kept({"selection": {"kept": "probe"}, "pooling": {"chosen": "layers"}}) == "probe; layers"
