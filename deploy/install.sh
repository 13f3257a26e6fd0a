#!/usr/bin/env bash
# Create .venv and install meshinfer (CPU torch) into it. Used by the README and CI.
# Set MESHINFER_TORCH to choose another torch requirement (e.g. a CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned to a CPU build when none is installed: an unpinned torch pulls a
# multi-GB CUDA build on Linux.
python -c "import torch" 2>/dev/null || python -m pip install -q "${MESHINFER_TORCH:-torch==2.13.0}"
python -m pip install -q -e ".[test]"
meshinfer --help >/dev/null
echo "meshinfer installed in $(pwd)/.venv" >&2
