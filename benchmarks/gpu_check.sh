#!/usr/bin/env bash
# The GPU check of issue 20 in one command that fits in 5 minutes on one GPU: the CUDA tests
# (tests/test_cuda.py, marker cuda), then benchmarks/gpu.py, which writes docs/benchmarks_gpu.md.
#
#   bash benchmarks/gpu_check.sh [--out DIR]     # on the GPU machine; DIR gets the doc, JSON and logs
#   (GIT_COMMIT=<sha> names the commit measured where the copied tree has no .git)
#   bash benchmarks/gpu_check.sh --download      # where pip works: fill benchmarks/gpu_wheels/
#
# Where pip works on the GPU machine, `pip install -e ".[dev,gpu]"` first is all it needs. On a GPU
# machine without a package index but with torch, Lightning and pytest (this project's lent H200:
# fla, hydra-core and omegaconf are missing there), run --download here first: it puts those
# (pure-Python) wheels in benchmarks/gpu_wheels/ (ignored by git, about 1.5 MB); carry that folder
# along with the working tree, and the check installs them with --no-index into a folder on
# PYTHONPATH. The repository itself runs from its root (PYTHONPATH), uninstalled.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS=benchmarks/gpu_wheels
# pure-Python wheels, one version each (antlr4 4.9.3 ships as a source archive only: pip wheel builds it)
PACKAGES="fla-core==0.6.0 hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3"

if [ "${1:-}" = --download ]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PY" -m pip wheel -q --no-deps -w "$WHEELS" $PACKAGES
    ls -l "$WHEELS"
    exit 0
fi
OUT=""
if [ "${1:-}" = --out ]; then OUT="$2"; mkdir -p "$OUT"; fi
LOGS="${OUT:-/tmp/gpu_check}"
mkdir -p "$LOGS"

if ls "$WHEELS"/*.whl >/dev/null 2>&1 && ! "$PY" -c "import fla, hydra" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_site "$WHEELS"/*.whl
    export PYTHONPATH="/tmp/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, fla; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'fla', fla.__version__)"

status=0
# the CUDA tests: about 2 minutes (first calls compile fla's Triton kernels)
timeout 160 "$PY" -m pytest -q -m cuda tests/test_cuda.py -p no:cacheprovider -rs 2>&1 | tee "$LOGS/test_cuda.log" \
    || status=$?
# the benchmark: starts no new measurement after --budget seconds
timeout 130 "$PY" benchmarks/gpu.py --budget 100 --json "$LOGS/benchmarks_gpu.json" 2>&1 | tee "$LOGS/gpu_bench.log" \
    || status=$?
if [ -n "$OUT" ]; then cp docs/benchmarks_gpu.md "$OUT/" || true; fi
exit $status
