#!/usr/bin/env bash
# Build llama-cpp-python into .venv-llama, for `meshinfer bench --single` only (not a meshinfer
# dependency). PyPI ships it as source, so this compiles llama.cpp (10-30 minutes on 2 cores).
# The CPU flags are fixed rather than -march=native: a native build on a VM that lists AMX in
# /proc/cpuinfo without the kernel enabling AMX tiles died with SIGILL on the first token.
# Override with CMAKE_ARGS=... if your CPU lacks AVX-512.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv-llama ] || "$PY" -m venv .venv-llama
export CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"}
.venv-llama/bin/python -m pip install -q --upgrade pip
.venv-llama/bin/python -m pip install -q --no-cache-dir "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
.venv-llama/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'in .venv-llama')"
