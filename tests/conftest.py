"""Shared test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def model_path(name: str) -> Path:
    """Path of the GGUF model ``name`` in ``$MESHINFER_HOME/models`` (default ~/.cache/meshinfer).

    Fails the test (never skips) when the file is missing.
    """
    home = Path(os.environ.get("MESHINFER_HOME", "~/.cache/meshinfer")).expanduser()
    path = home / "models" / f"{name}.gguf"
    if not path.is_file():
        pytest.fail(f"model file {path} is missing; run `meshinfer pull {name}`")
    return path
