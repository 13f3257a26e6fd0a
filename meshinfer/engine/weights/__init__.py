"""Weights readers: GGUF files and Hugging Face safetensors directories.

Both readers expose ``config`` (a :class:`~meshinfer.core.config.ModelConfig`) and
``iter_shard_tensors(layers)``, which yields only the tensors a shard over ``layers`` needs.
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import TYPE_CHECKING, Union

from meshinfer.core.errors import WeightsError

if TYPE_CHECKING:  # the readers import torch; `meshinfer pull` should not pay for that
    from meshinfer.engine.weights.gguf_file import GGUFFile
    from meshinfer.engine.weights.safetensors_dir import SafetensorsDir

WeightsSource = Union["GGUFFile", "SafetensorsDir"]


def open_weights(path: str | os.PathLike) -> WeightsSource:
    """Open a GGUF file or a Hugging Face directory (one with ``config.json``).

    Raises:
        WeightsError: the path does not exist, is neither kind, or is malformed.
    """
    p = Path(path)
    if p.is_dir():
        from meshinfer.engine.weights.safetensors_dir import SafetensorsDir
        return SafetensorsDir(p)
    if p.is_file():
        from meshinfer.engine.weights.gguf_file import GGUFFile
        return GGUFFile(p)
    raise WeightsError(f"{p}: no such file or directory")


__all__ = ["WeightsSource", "open_weights"]
