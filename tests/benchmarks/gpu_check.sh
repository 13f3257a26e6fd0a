#!/usr/bin/env bash
# The GPU checks in one run, on a machine with a CUDA build of torch:
#   1. a CUDA f32 peer picks the same tokens as a CPU f32 peer (whole model, batched decode, and
#      routes mixing CPU and CUDA peers): tests/test_gpu.py on the tiny model, and on each real
#      model in the model cache (`meshinfer pull NAME`) its reference cases, whole on CUDA and on
#      a CPU -> CUDA route;
#   2. `meshinfer bench --single --device cuda`: decode tok/s, TTFT and device memory of f32, bf16
#      and f16 on CUDA (and transformers on CUDA), each with its fidelity against f32 on the CPU;
#   3. a single CUDA peer against a 2-peer CUDA split (decode tok/s), then cold against warm TTFT
#      and the time from join to ready.
# Steps 2-3 use $BENCH_MODEL (default: the default model when it is in the cache, else
# SmolLM2-135M); without either they are reported as not run. Output: the pytest summary and
# markdown tables for docs/benchmarks.md; with OUTDIR set, the --single rows as JSON there too.
#
#   bash tests/benchmarks/gpu_check.sh [PYTHON]      # PYTHON: an interpreter with meshinfer + CUDA torch
#
# DEVICE=cpu runs the same steps on the CPU (to try the script where there is no GPU).
# THREADS (default 4): CPU threads of each --single engine (the CPU f32 reference among them).
set -euo pipefail
PY=${1:-python}
DEVICE=${DEVICE:-cuda}
THREADS=${THREADS:-4}
cd "$(dirname "$0")/../.."
"$PY" -c "
from meshinfer.engine.executor import parse_device
import torch
parse_device('$DEVICE')
print(f'torch {torch.__version__}, CUDA {torch.version.cuda},',
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
# The real models in the cache, as "name pytest-keyword" lines.
PRESENT=$("$PY" -c "
from meshinfer.engine.weights.registry import is_verified
for name, word in [('qwen2.5-coder-0.5b-instruct-q4_k_m', 'qwen2'), ('smollm2-135m-instruct-q4_1', 'smollm2')]:
    if is_verified(name):
        print(name, word)")
KEYWORDS="tiny"
while read -r name word; do
  [ -n "$name" ] && KEYWORDS="$KEYWORDS or $word"
done <<<"$PRESENT"
echo "real models in the cache: ${PRESENT:-none}"
MESHINFER_TEST_DEVICE=$DEVICE "$PY" -m pytest -q -m gpu -k "$KEYWORDS" tests/test_gpu.py || TESTS_FAILED=1
BENCH_MODEL=${BENCH_MODEL:-$(echo "$PRESENT" | head -n1 | cut -d' ' -f1)}
if [ -z "$BENCH_MODEL" ]; then
  echo "benchmarks not run: no real model is in the cache (meshinfer pull)" >&2
  exit "${TESTS_FAILED:-0}"
fi
OUT_JSON=()
[ -n "${OUTDIR:-}" ] && OUT_JSON=(--out "$OUTDIR/single.json")
FAILED=0   # a failed step is reported and the next one still runs (device time is scarce)
"$PY" -m meshinfer bench --single --device "$DEVICE" --model "$BENCH_MODEL" --dtypes f32,bf16,f16 \
  --threads "$THREADS" "${OUT_JSON[@]}" || FAILED=1
"$PY" -m meshinfer bench --device "$DEVICE" --model "$BENCH_MODEL" --splits 1,2 --max-tokens 64 --repeats 3 \
  || FAILED=1
"$PY" -m meshinfer bench --device "$DEVICE" --model "$BENCH_MODEL" --suite ttft --splits 1,2 || FAILED=1
exit $(( FAILED || ${TESTS_FAILED:-0} ))
