#!/usr/bin/env bash
# The prepared GPU check for astrai's CUDA kernels (issue 10), for the day a device is lent.
#
#   bash bench/gpu_check.sh              # logs and JSON under ${OUT:-out/gpu_check}
#
# 1. which python has CUDA torch + CuPy (override with PYTHON=...), nvidia-smi, versions;
# 2. the compile tier and every `gpu`-marked kernel/engine test (same shapes as the CPU emulation,
#    NaN-poisoned outputs, float32 references; engine greedy cuda == torch);
# 3. bench/kernel_bandwidth.py --quick: paged-decode bandwidth vs a d2d copy in the same run, rotary throughput.
# Budget: a few minutes on an H100/H200 (first call compiles each kernel once through NVRTC).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$cand" ] || continue
  if "$cand" -c "import torch, cupy; assert torch.cuda.is_available()" 2>/dev/null; then PY=$cand; break; fi
done
{
  date -u
  nvidia-smi || true
  for cand in .venv/bin/python python3; do
    "$cand" -c "import sys, torch; print(sys.executable, torch.__version__, torch.version.cuda, torch.cuda.is_available())" 2>&1 || true
    "$cand" -c "import cupy; print('cupy', cupy.__version__)" 2>&1 || true
  done
} | tee "$OUT/env.txt"
if [ -z "$PY" ]; then
  echo "no python with CUDA torch and CuPy found; set PYTHON=/path/to/python" | tee -a "$OUT/env.txt"
  exit 2
fi
echo "using $PY" | tee -a "$OUT/env.txt"

status=0
timeout 300 "$PY" -m pytest tests/kernels/test_compile.py tests/kernels/test_attention_kernels.py \
  tests/kernels/test_elementwise_kernels.py tests/kernels/test_engine_backends.py -m gpu -q -rs -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu_tests.txt" || status=1  # pipefail: pytest's status, not tee's
timeout 240 "$PY" bench/kernel_bandwidth.py --quick --json "$OUT/kernels.jsonl" 2>&1 | tee "$OUT/bench.txt" || status=1
echo "gpu_check exit status $status" | tee -a "$OUT/bench.txt"
exit $status
