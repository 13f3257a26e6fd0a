#!/usr/bin/env bash
# Create a virtual environment and install meshinfer and torch into it. Used by the README,
# CI, `deploy/local-mesh.sh --setup` and deploy/Dockerfile (the same commands everywhere).
#
# Environment:
#   MESHINFER_VENV         where the environment goes (default: .venv in the checkout)
#   MESHINFER_TORCH        the torch requirement when torch is missing (e.g. a CUDA build)
#   MESHINFER_TORCH_INDEX  a pip index URL to fetch torch from (e.g. PyTorch's CPU-only wheel
#                          index, for a smaller image); empty: pip's configured index
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MESHINFER_VENV:-.venv}
[ -d "$VENV" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# torch first and pinned when none is installed (pinned so every machine runs the same kernels).
# From pip's default index on Linux this is the multi-GB CUDA build; MESHINFER_TORCH_INDEX picks
# a CPU-only index instead.
INDEX=()
[ -n "${MESHINFER_TORCH_INDEX:-}" ] && INDEX=(--index-url "$MESHINFER_TORCH_INDEX")
python -c "import torch" 2>/dev/null || python -m pip install -q ${INDEX[@]+"${INDEX[@]}"} "${MESHINFER_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[test]"
meshinfer --help >/dev/null
# The gguf precisions' C kernels, built now for this CPU so the first peer or draft model need not
# wait for the compiler; without a C compiler this prints one line and the torch path is used.
python -m meshinfer.engine.kernels.native >&2 || echo "note: no gguf kernels: --dtype gguf will be slow, gguf-a16 and gguf-a8 refused" >&2
echo "meshinfer installed in $VENV" >&2
