#!/usr/bin/env bash
# The GPU checks of issue 6 in one run, on a machine with a CUDA build of torch:
#   1. a CUDA f32 peer picks the same tokens as a CPU f32 peer (whole model, batched decode, and
#      routes mixing CPU and CUDA peers): tests/test_gpu.py, on the tiny model and, when it is in
#      the model cache, the default model's reference cases;
#   2. a single CUDA peer against a 2-peer CUDA split (decode tok/s, TTFT);
#   3. cold-start TTFT against warm TTFT, and the time from join to ready.
# Steps 2-3 need the default model in the cache (`meshinfer pull`); without it they are reported
# as not run. Output: the pytest summary and markdown tables for docs/benchmarks.md.
#
#   bash tests/benchmarks/gpu_check.sh [PYTHON]      # PYTHON: an interpreter with meshinfer + CUDA torch
#
# DEVICE=cpu runs the same steps on the CPU (to try the script where there is no GPU).
set -euo pipefail
PY=${1:-python}
DEVICE=${DEVICE:-cuda}
cd "$(dirname "$0")/../.."
"$PY" -c "
from meshinfer.engine.executor import parse_device
import torch
parse_device('$DEVICE')
print(f'torch {torch.__version__}, CUDA {torch.version.cuda},',
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
HAVE_MODEL=$("$PY" -c "
from meshinfer.engine.weights.registry import is_verified
print(int(is_verified('qwen2.5-coder-0.5b-instruct-q4_k_m')))")
if [ "$HAVE_MODEL" = 1 ]; then MARK="gpu"; else MARK="gpu and not realmodel"; fi
MESHINFER_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -m "$MARK" tests/test_gpu.py
if [ "$HAVE_MODEL" != 1 ]; then
  echo "benchmarks not run: the default model is not in the cache (meshinfer pull)" >&2
  exit 0
fi
export MESHINFER_DEVICE=$DEVICE   # the peers `meshinfer bench` starts run there
"$PY" -m meshinfer bench --splits 1,2 --max-tokens 64 --repeats 3
"$PY" -m meshinfer bench --suite ttft --splits 1,2
