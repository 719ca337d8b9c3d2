#!/usr/bin/env bash
# The GPU check (issues 20, 42) in one command that returns figures within 4 minutes on one GPU,
# compiles included: the CUDA tests (tests/test_cuda.py, marker cuda; at most ~90 s, each test under
# its own pytest-timeout limit), then benchmarks/speed/gpu.py (at most ~2 minutes: it starts no row after
# --budget seconds and writes each row to docs/benchmarks_gpu.md and the JSON as soon as it is measured,
# so whatever stops it, the rows measured so far are kept). Nothing in it depends on fla working.
#
#   bash benchmarks/gpu_check.sh [--out DIR]     # on the GPU machine; DIR gets the doc, the JSON and the logs
#   (GIT_COMMIT=<sha> names the commit measured where the copied tree has no .git)
#   bash benchmarks/gpu_check.sh --download      # where pip works: fill benchmarks/gpu_wheels/
#
# Where pip works on the GPU machine, `pip install -e ".[dev,gpu]"` first is all it needs. On a GPU
# machine without a package index but with torch, Lightning and pytest, run --download here first: it
# puts the pure-Python wheels it may lack (fla, hydra-core, omegaconf, pytest-timeout) in
# benchmarks/gpu_wheels/ (ignored by git, about 1.5 MB); carry that folder along with the working tree,
# and the check installs them with --no-index into a folder on PYTHONPATH. The repository itself runs
# from its root (PYTHONPATH), uninstalled.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS=benchmarks/gpu_wheels
# pure-Python wheels, one version each (antlr4 4.9.3 ships as a source archive only: pip wheel builds it)
PACKAGES="fla-core==0.6.0 hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 pytest-timeout==2.4.0"
# time limits (seconds): the whole test run, one test (longer ones are marked in tests/test_cuda.py),
# the benchmark's budget for starting rows, and its hard stop (a row started late may still run ~20 s)
TESTS_LIMIT=88
TEST_LIMIT=30
BENCH_BUDGET=90
BENCH_LIMIT=118

if [ "${1:-}" = --download ]; then
    set -e
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip wheel -q --no-deps -w "$WHEELS" $PACKAGES
    ls -l "$WHEELS"
    exit 0
fi
# no CUDA GPU for torch: one line saying so and what to do, exit 2, before any output or install
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())" >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is false, or torch does not import with $PY):" \
         "run it on a machine with an NVIDIA GPU and a CUDA build of torch; the CPU tests are pytest -q" >&2
    exit 2
fi
OUT=""
if [ "${1:-}" = --out ]; then OUT="$2"; mkdir -p "$OUT"; fi
LOGS="${OUT:-/tmp/gpu_check}"
mkdir -p "$LOGS"
START=$SECONDS

if ls "$WHEELS"/*.whl >/dev/null 2>&1 && ! "$PY" -c "import fla, hydra, pytest_timeout" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" - <<'EOF' || true
import importlib.metadata as m
import torch
v = {}
for p in ("triton", "fla-core", "hydra-core", "pytest-timeout", "scikit-learn"):  # scikit-learn: >= 1.8 for probes
    try:
        v[p] = m.version(p)
    except m.PackageNotFoundError:
        v[p] = "missing"
print("torch", torch.__version__, "cuda", torch.version.cuda, *(f"{k} {x}" for k, x in v.items()))
EOF

status=0
# 1. the CUDA tests: verbose, every outcome listed (-rA), each failure with its full output (a command
#    line's stderr included); each test under its own limit, the whole run under TESTS_LIMIT (SIGINT:
#    pytest still prints its summary)
PER_TEST=()
if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    PER_TEST=(--timeout "$TEST_LIMIT")
else
    echo "WARNING: pytest-timeout is missing (pip install pytest-timeout, or --download): no per-test limit"
fi
timeout -s INT -k 7 "$TESTS_LIMIT" "$PY" -m pytest -m cuda tests/test_cuda.py -p no:cacheprovider -v -rA \
    --tb=long --durations=15 ${PER_TEST[@]+"${PER_TEST[@]}"} 2>&1 | tee "$LOGS/test_cuda.log" || status=$?
echo "gpu_check: tests done at $((SECONDS - START)) s (status $status)"

# 2. the benchmark: rows written as measured; no row started after BENCH_BUDGET s
timeout -k 4 "$BENCH_LIMIT" "$PY" benchmarks/speed/gpu.py --budget "$BENCH_BUDGET" --json "$LOGS/benchmarks_gpu.json" \
    2>&1 | tee "$LOGS/gpu_bench.log" || status=$?
echo "gpu_check: benchmark done at $((SECONDS - START)) s (status $status)"
if [ -n "$OUT" ]; then cp docs/benchmarks_gpu.md "$OUT/" || true; fi
exit $status
