"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import pytest


def model_path(name: str) -> Path:
    """Path of the real GGUF model ``name``, fetched with ``meshinfer pull`` when missing.

    Uses ``$MESHINFER_HOME`` (default ``~/.cache/meshinfer``). Fails the test (never skips)
    when the model cannot be fetched and verified.
    """
    from meshinfer.core.errors import MeshError
    from meshinfer.engine.weights.registry import pull

    try:
        return pull(name, progress=False)
    except MeshError as exc:
        pytest.fail(f"model {name} is not available ({exc}); run `meshinfer pull {name}`")
