"""Tensor framing: a tensor travels as ``{"dtype", "shape", "data"}`` (raw little-endian bytes),
never pickle, never JSON floats; and the per-row digests hops keep of what they received.

The one ``wire`` module that imports torch: the message catalogue and its validation
(:mod:`meshinfer.wire.protocol`) stay torch-free, so the route planner imports without it.
"""

from __future__ import annotations

import hashlib
import math
import sys
from typing import Any

import torch

from meshinfer.core.errors import ProtocolError
from meshinfer.wire.protocol import MAX_TENSOR_DIMS, Fields


#: Wire dtype names -> (torch dtype, bytes per element).
WIRE_DTYPES = {"f32": (torch.float32, 4), "bf16": (torch.bfloat16, 2), "f16": (torch.float16, 2)}


# --------------------------------------------------------------------------- tensors
def tensor_to_wire(t: torch.Tensor, dtype: str = "f32") -> dict:
    """Encode ``t`` (any shape, up to :data:`MAX_TENSOR_DIMS` dims) as dtype + shape + raw bytes.

    The tensor is cast to ``dtype`` (``"f32"`` by default) and sent little-endian.
    """
    torch_dtype, _ = WIRE_DTYPES[dtype]
    t = t.detach().to("cpu", torch_dtype).contiguous()
    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("big-endian hosts are not supported")
    return {"dtype": dtype, "shape": list(t.shape), "data": raw.numpy().tobytes()}


def tensor_from_wire(d: Any, *, max_elements: int, width: int | None = None) -> torch.Tensor:
    """Decode a wire tensor, trusting no number in it.

    Args:
        d: the decoded map.
        max_elements: most elements accepted (the receiver's own limit, not the sender's).
        width: when given, the last dimension must equal it (the model's hidden width C).

    Returns:
        A CPU tensor of the wire dtype viewing a copy of the payload.

    Raises:
        ProtocolError: unknown dtype; a shape with zero, negative or too many dimensions; more
            than ``max_elements``; a payload whose length differs from shape x element size.
    """
    f = Fields(d, "tensor")
    dtype = f.str("dtype")
    if dtype not in WIRE_DTYPES:
        raise ProtocolError(f"tensor: dtype {dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    shape = f.get("shape", list)
    if not 1 <= len(shape) <= MAX_TENSOR_DIMS or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 < x <= max_elements for x in shape):
        raise ProtocolError(f"tensor: shape {shape[:8]} must have 1-{MAX_TENSOR_DIMS} positive dimensions")
    n = math.prod(shape)
    if n > max_elements:
        raise ProtocolError(f"tensor: {n} elements exceed the limit of {max_elements}")
    if width is not None and shape[-1] != width:
        raise ProtocolError(f"tensor: last dimension {shape[-1]} differs from the hidden width {width}")
    data = f.get("data", bytes)
    torch_dtype, size = WIRE_DTYPES[dtype]
    if len(data) != n * size:
        raise ProtocolError(f"tensor: shape {shape} of {dtype} needs {n * size} bytes, payload has {len(data)}")
    flat = torch.frombuffer(bytearray(data), dtype=torch_dtype)  # copy: the frame buffer is read-only
    return flat.view(shape)


def log_from_wire(f: "Fields", *, count: int, hidden: bool, received: bool,
                  digest_bytes: int = 16) -> tuple[torch.Tensor | None, bytes | None]:
    """A ``log`` reply: (``hidden`` float32 ``(1, count, C)`` or None, ``received`` digests
    (``count`` x ``digest_bytes`` bytes) or None), each required when asked for.

    Raises:
        ProtocolError: a missing field, another dtype, shape or digest length.
    """
    x = digests = None
    if hidden:
        x = tensor_from_wire(f.get("hidden", dict), max_elements=count << 16)
        if x.dtype != torch.float32 or x.dim() != 3 or x.shape[:2] != (1, count):
            raise ProtocolError(f"log: hidden states must be float32 (1, {count}, C), got {tuple(x.shape)} {x.dtype}")
    if received:
        digests = f.get("received", bytes)
        if len(digests) != count * digest_bytes:
            raise ProtocolError(f"log: {len(digests)} bytes of digests for {count} positions")
    return x, digests


def verified_from_wire(f: "Fields", *, count: int, width: int | None) -> torch.Tensor | list[int]:
    """A ``verified`` reply: ``count`` token ids (``width`` None, a last-layer check) or hidden
    states float32 ``(1, count, width)``.

    Raises:
        ProtocolError: a missing field, another count, dtype or shape.
    """
    if width is None:
        tokens = f.get("tokens", list)
        if len(tokens) != count or not all(type(t) is int and t >= 0 for t in tokens):
            raise ProtocolError(f"verified: tokens must be {count} non-negative ids")
        return tokens
    x = tensor_from_wire(f.get("hidden", dict), max_elements=count * width, width=width)
    if x.dtype != torch.float32 or x.dim() != 3 or x.shape[:2] != (1, count):
        raise ProtocolError(f"verified: hidden states must be float32 (1, {count}, {width}), got {tuple(x.shape)}")
    return x


#: Bytes of SHA-256 kept per received position (collisions need 2^64 work).
DIGEST_BYTES = 16


def wire_row_digests(wire: dict) -> bytes:
    """:func:`row_digests` of the float32 ``(1, T, C)`` tensor that ``wire`` (a
    :func:`tensor_to_wire` dict of dtype ``"f32"``) encodes, from its bytes: no second copy of
    the tensor off its device."""
    data, row = wire["data"], 4 * wire["shape"][-1]
    return b"".join(hashlib.sha256(data[i:i + row]).digest()[:DIGEST_BYTES] for i in range(0, len(data), row))


def row_digests(x: torch.Tensor) -> bytes:
    """SHA-256 (first :data:`DIGEST_BYTES`) of each position's float32 row of ``x`` ``(1, T, C)``,
    concatenated: ``T x DIGEST_BYTES`` bytes. Rows hash their exact wire bytes."""
    rows = x.detach().to("cpu", torch.float32).contiguous()[0].numpy()  # (T, C)
    return b"".join(hashlib.sha256(r.tobytes()).digest()[:DIGEST_BYTES] for r in rows)
