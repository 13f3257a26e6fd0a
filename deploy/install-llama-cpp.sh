#!/usr/bin/env bash
# Build llama-cpp-python into .venv-llama, for `meshinfer bench --single` only (not a meshinfer
# dependency). PyPI ships it as source, so this compiles llama.cpp (10-30 minutes on 2 cores).
#
# The best build the machine runs: first a native one (-DGGML_NATIVE=ON), checked by decoding a
# few tokens of the default model (when it is pulled) in a child process; if that dies (a VM
# that lists AMX in /proc/cpuinfo without the kernel enabling AMX tiles died with SIGILL on the
# first token), a build with fixed flags for the CPU's vector extensions: AVX-512 (with VNNI and
# BF16) where /proc/cpuinfo lists avx512f, else AVX2 + FMA + F16C. CMAKE_ARGS=... overrides both.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
[ -d .venv-llama ] || "$PY" -m venv .venv-llama
.venv-llama/bin/python -m pip install -q --upgrade pip

build() {  # $1: CMAKE_ARGS
  CMAKE_ARGS="$1" .venv-llama/bin/python -m pip install -q --no-cache-dir --force-reinstall --no-deps \
    "llama-cpp-python==$VERSION"
  .venv-llama/bin/python -m pip install -q "llama-cpp-python==$VERSION"  # its pure-python dependencies
}

smoke() {  # decode 4 tokens of the default model, if it is here; exit status 0 when it runs
  local model
  model=$(ls "${MESHINFER_HOME:-$HOME/.cache/meshinfer}"/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf 2>/dev/null || true)
  .venv-llama/bin/python - "$model" <<'EOF'
import sys
import llama_cpp
if sys.argv[1]:
    llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, verbose=False)
    llm("Hello", max_tokens=4)
EOF
}

if [ -n "${CMAKE_ARGS:-}" ]; then
  build "$CMAKE_ARGS"
else
  echo "building llama.cpp for this CPU (native)" >&2
  if build "-DGGML_NATIVE=ON" && smoke; then
    echo "native build runs" >&2
  else
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
      FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    else
      FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
    fi
    echo "the native build failed or died; building with fixed flags: $FLAGS" >&2
    build "$FLAGS"
    smoke
  fi
fi
.venv-llama/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'in .venv-llama')"
