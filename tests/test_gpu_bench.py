"""benchmarks/speed/gpu.py on the CPU (``--device cpu --quick``: tiny models, L = 64 and 256): every planned row
ends measured or says why not, the figures are finite and positive, the markdown holds each section's
rows, and rows reach the files as they are measured (a run ended after its first row keeps it)."""
import json
import math
import sys

import pytest

from benchmarks import common
from benchmarks.speed import gpu
from conftest import ROOT
from forkserver import forks

SECTIONS = {"train", "embed", "startup", "compiled"}


def _rows(path):
    return json.loads(path.read_text())["rows"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench") / "bench.md"
    gpu.main(["--device", "cpu", "--quick", "--out", str(out)])
    return out, json.loads(out.with_suffix(".json").read_text())


def test_quick_cpu_run_measures_every_row(quick):
    md, data = quick
    assert data["finished"] and data["facts"]["device"].startswith("CPU") and data["versions"]["torch"]
    rows = data["rows"]
    assert {r["section"] for r in rows} == SECTIONS
    train = [r for r in rows if r["section"] == "train"]
    # --quick: 2 models x 2 directions x 3 kernels x 2 lengths, batch = max(1, 512 // L)
    assert len(train) == 24 and {r["kernel"] for r in train} == {"default", "elu", "exact"}
    assert {(r["L"], r["batch"]) for r in train} == {(64, 8), (256, 2)}
    for r in rows:
        if r["section"] == "startup" and r["backend"] == "fla":   # fla needs CUDA: refused in one line
            assert r["status"].startswith("refused: ") and "CUDA" in r["status"], r
            continue
        assert r["status"] == "ok", r
        assert set(r["shape"]) >= {"dim", "depth", "heads", "kernel", "local_heads"} and r["ran"]
        if r["section"] == "startup":
            assert math.isfinite(r["build_to_first_step_s"]) and r["build_to_first_step_s"] > 0
            continue
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and r["n"] == len(r["times_ms"]) >= 1
        assert all(math.isfinite(t) and t > 0 for t in r["times_ms"])
        rate = r["tokens_per_s"] if r["section"] in ("train", "compiled") else r["residues_per_s"]
        assert math.isfinite(rate) and rate > 0
    # the path each row ran, read from the model: the CPU's torch path under backend=auto, SDPA for exact
    assert {r["ran"] for r in train if r["kernel"] != "exact"} == {"torch"}
    assert {r["ran"] for r in rows if r["kernel"] == "exact"} == {"sdpa"}
    assert {r["backend"]: r.get("ran") for r in rows if r["section"] == "startup" and r["kernel"] != "exact"} == \
        {"auto": "torch", "parallel": "parallel", "torch": "torch", "fla": None}
    # presets come from conf/: the quick run shrinks them, the names stay
    assert {r["model"] for r in train} == {"default", "35m"}
    # section 4 --quick: one compiled row (reduce-overhead: inductor's plain code on a CPU), the torch path
    # runs as the parallel one inside a graph
    compiled = [r for r in rows if r["section"] == "compiled"]
    assert [(r["kernel"], r["direction"], r["L"], r["compile_mode"]) for r in compiled] == \
        [("default", "bidirectional", 64, "reduce-overhead")]


def test_markdown_has_each_section_and_row(quick):
    md, data = quick
    text = md.read_text()
    assert "not GPU figures" in text.splitlines()[0]
    assert "commit" in text and "command `python benchmarks/speed/gpu.py" in text
    for heading in ("## 1. LM training step", "### default model (conf/model/base.yaml), bidirectional",
                    "### preset model/size=35m, causal", "## 2. Embedding one long protein",
                    "## 3. From model build to the end of the first training step", "## 4. Compiled steps"):
        assert heading in text
    table = common.read_md_table(md, "default model (conf/model/base.yaml), causal")
    assert [row["batch x L"] for row in table] == ["8 x 64", "2 x 256"]
    for row in table:
        assert float(row["FAVOR+ (default) ms (GiB)"].replace(",", "")) > 0
        assert row["exact / FAVOR+"].endswith("x") and float(row["exact / FAVOR+"][:-1]) > 0
    startup = common.read_md_table(md, "3. From model build to the end of the first training step")
    assert [r["backend"] for r in startup] == ["auto", "parallel", "torch", "fla", "exact (SDPA)"]
    assert startup[0]["<= 30 s"] == "met" and startup[3]["seconds"].startswith("refused")
    assert common.KEEP_BELOW in text


def test_rows_reach_the_files_as_measured(tmp_path):
    """A run that ends right after its first row (as a kill would: no final write) has that row in both
    files, and the rows it never reached say so."""
    out = tmp_path / "b.md"
    proc = forks().run([sys.executable, str(ROOT / "benchmarks" / "speed" / "gpu.py"), "--device", "cpu", "--quick",
                        "--sections", "3,2", "--out", str(out), "--stop-after-rows", "1"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    rows = _rows(out.with_suffix(".json"))
    assert rows[0]["status"] == "ok" and rows[0]["build_to_first_step_s"] > 0
    assert {r["status"] for r in rows[1:]} == {"pending"}
    text = out.read_text()
    assert "IN PROGRESS, or stopped before its end" in text
    startup = common.read_md_table(out, "3. From model build to the end of the first training step")
    assert startup[0]["backend"] == "auto" and float(startup[0]["seconds"]) > 0
    assert {r["seconds"] for r in startup[1:]} == {"not reached"}


def test_rows_past_the_budget_are_not_run_and_text_below_the_marker_is_kept(tmp_path):
    out = tmp_path / "b.md"
    out.write_text("old figures\n\n" + common.KEEP_BELOW + "\nkept notes\n")
    gpu.main(["--device", "cpu", "--quick", "--sections", "2,3", "--budget", "0", "--out", str(out)])
    rows = _rows(out.with_suffix(".json"))
    assert rows and {r["status"] for r in rows} == {"not run (budget)"}
    text = out.read_text()
    assert "old figures" not in text and text.endswith(common.KEEP_BELOW + "\nkept notes\n")
    assert "not run (budget)" in text


def test_cpu_run_needs_an_explicit_output(tmp_path):
    with pytest.raises(SystemExit) as e:
        gpu.main(["--device", "cpu", "--quick"])
    assert "--out" in str(e.value)
