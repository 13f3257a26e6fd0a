"""On-disk cache of quantized (converted) shard tensors, so a second ``join`` skips quantizing.

Layout: ``<cache_dir>/<weights hash>/<precision>/<unit>.safetensors`` with one file per unit:
``embed`` (token embedding), ``layer-<i>`` (block ``i``, global index) and ``head`` (final norm +
output projection). Units are per layer rather than per range, so peers over ``[0, 12)`` and
``[0, 24)`` share files. ``cache_dir`` is normally ``<meshinfer home>/converted``.

Each file is a safetensors file (no pickle) whose metadata holds ``format``
(:data:`FORMAT`), ``precision``, ``weights`` (the source weights hash) and ``sha256``: the
digest of every tensor's name, dtype, shape and raw bytes in name order. A file that does not
parse, names another format/precision/hash, or fails the digest is *corrupt*: the whole shard is
then rebuilt from the source weights and every unit rewritten. Writes go to a temporary file in
the same folder and are renamed into place (``os.replace``), so a crash never leaves a partial
file under the final name. ``FORMAT`` carries the torch version, so a torch upgrade rebuilds the
files rather than trusting a layout an older build wrote.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch

from meshinfer.core.config import LayerRange

log = logging.getLogger(__name__)

#: Layout tag written into and required from every file's metadata.
FORMAT = f"meshinfer-converted-1/torch-{torch.__version__.split('+')[0]}"


def unit_of(name: str) -> str:
    """The cache unit of a state-dict key: ``layers.3.mlp.up_proj.weight`` -> ``layer-3``."""
    if name.startswith("layers."):
        return "layer-" + name.split(".", 2)[1]
    return "embed" if name.startswith("embed_tokens.") else "head"


def units_for(layers: LayerRange, num_layers: int) -> list[str]:
    """The units a shard over ``layers`` needs, in load order."""
    units = ["embed"] if layers.start == 0 else []
    units += [f"layer-{i}" for i in range(layers.start, layers.stop)]
    return units + (["head"] if layers.stop == num_layers else [])


def unit_meta(weights_digest: str, precision: str) -> dict[str, str]:
    """The metadata every unit file of ``(weights, precision)`` carries and must match on read."""
    return {"format": FORMAT, "precision": precision, "weights": weights_digest}


def unit_path(cache_dir: str | os.PathLike, weights_digest: str, precision: str, unit: str) -> Path:
    """``<cache_dir>/<weights hash>/<precision>/<unit>.safetensors``."""
    return Path(cache_dir) / weights_digest / precision / f"{unit}.safetensors"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_unit(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Write one unit atomically (temporary file + ``os.replace``), with its digest."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={**meta, "sha256": _digest(tensors)})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_unit(path: Path, meta: dict[str, str]) -> dict[str, torch.Tensor] | None:
    """The tensors of one unit (each in its own 64-byte-aligned storage), or None when the file
    is missing or corrupt (logged)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            found = f.metadata() or {}
            # clone: safetensors hands out views at any byte offset, and the int8 CPU
            # kernels use aligned vector loads (an unaligned view crashed with SIGSEGV); torch's
            # allocator aligns to 64 bytes
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        log.warning("converted cache %s is unreadable (%s); rebuilding", path, exc)
        return None
    wrong = [k for k, v in meta.items() if found.get(k) != v]
    if wrong or found.get("sha256") != _digest(tensors):
        log.warning("converted cache %s is corrupt (%s); rebuilding", path,
                    f"metadata {', '.join(wrong)} differ" if wrong else "digest mismatch")
        return None
    return tensors
