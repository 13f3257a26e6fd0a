"""RMSNorm, RoPE, attention and SwiGLU of a step through the C library (``step_ops.c``).

Each function returns None where it does not apply (no library, not float32 on the CPU, a
layout it does not take); the caller then computes with torch. Why: a decode step of the
default model ran about 30 small torch operations per layer around its projections, 7 ms of a
46 ms gguf-a8 step at 2 threads (torch.profiler, 2026-12-03), attention alone 78 us a call;
each of these is one call of a few microseconds (docs/performance.md, "Around the
projections").

Each computes every row (every query) alone in a fixed order, so a position's result does not
depend on how many positions share the step: a verification step of k + 1 positions gives each
what a one-position step gives it. Against torch: RoPE is equal bit for bit, RMSNorm and
attention differ by summation order only (tests/test_step_ops.py).

Pure computation: nothing here logs (except ``native.library()``'s one warning) or prints.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from typing import Iterator

import torch

from meshinfer.engine.kernels import native

#: Most new positions per sequence :func:`attention` takes: decode steps (1), verification
#: steps (1 + up to 16 drafts) and short chunks. Longer passes (prefills) use torch's tiled
#: scaled_dot_product_attention, which does T x S work faster than one query at a time.
ATTENTION_MAX_QUERIES = 32
#: Most rows :func:`swiglu` takes: every pass below the gguf precisions' dense path
#: (``gguf_linear.DENSE_MIN_ROWS``, 48 rows), so that a row of a batched pass of several
#: conversations gets the bits it gets alone (a pass of 33 rows once took torch's ``silu``
#: while its rows alone took C's: an attack run saw a conversation's token change with what it
#: was batched with). Inside :func:`packed_pass` it takes any number of rows; outside, a pass
#: of 48 rows or more is one sequence's own prefill, where torch's vectorized exp beats libm's
#: over thousands of rows.
SWIGLU_MAX_ROWS = 47


_pass = threading.local()


@contextmanager
def packed_pass() -> Iterator[None]:
    """Mark the computation inside as a pass that packs several conversations' rows
    (``Shard.forward_batch``), on this thread: every per-row operation then takes the path a
    conversation's step takes alone, whatever the pass's row count (:func:`swiglu` any number of
    rows; the gguf precisions' products their block kernels, ``gguf_linear``), so that no
    conversation's result depends on the strangers beside it."""
    before = getattr(_pass, "packed", False)
    _pass.packed = True
    try:
        yield
    finally:
        _pass.packed = before


def in_packed_pass() -> bool:
    """Whether this thread is inside :func:`packed_pass`."""
    return getattr(_pass, "packed", False)


def _cpu_f32(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dimension: ``x`` ``(..., C)``
    float32, ``weight`` ``(C,)`` float32 -> ``(..., C)`` float32, or None (see the module).
    Formula: Zhang & Sennrich 2019, as HF's LlamaRMSNorm computes it in float32."""
    lib = native.library()
    C = x.shape[-1] if x.dim() else 0
    if lib is None or not C or not _cpu_f32(x, weight) or weight.shape != (C,):
        return None
    x, w = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    if lib.mi_rmsnorm(x.data_ptr(), x.numel() // C, C, w.data_ptr(), ctypes.c_float(eps), out.data_ptr()):
        return None
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Rotate-half RoPE of ``x`` ``(B, H, T, D)`` with ``cos/sin`` ``(T, R)`` (``R <= D``; the
    dimensions past ``R`` pass through) -> ``(B, H, T, D)``, equal bit for bit to
    ``common.apply_rope``'s torch operations; or None (see the module). ``x`` must be a
    ``(B, T, H, D)`` contiguous tensor seen through ``transpose(1, 2)``, as attention's
    projections leave q and k (or have ``T == 1``); the result has the same layout."""
    lib = native.library()
    if lib is None or x.dim() != 4 or cos.dim() != 2 or not _cpu_f32(x, cos, sin):
        return None
    B, H, T, D = x.shape
    bthd = x.transpose(1, 2)  # (B, T, H, D)
    if cos.shape[0] != T or sin.shape != cos.shape or not bthd.is_contiguous():
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(bthd)  # (B, T, H, D)
    if lib.mi_rope(bthd.data_ptr(), B * T, H, D, T, cos.data_ptr(), sin.data_ptr(), cos.shape[1], out.data_ptr()):
        return None
    return out.transpose(1, 2)  # (B, H, T, D)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, *,
              window: int = 0) -> torch.Tensor | None:
    """Causal grouped-query attention, as ``common.causal_attention`` defines it: ``q``
    ``(B, H, T, D)`` for positions ``start .. start+T-1`` over ``k, v`` ``(B, Hkv, S, D)``
    (``S == start + T``; any strides with a unit stride along D, as the KV cache's views
    have), ``window`` 0 or a sliding window -> ``(B, H, T, D)`` float32 contiguous; or None for
    ``T`` above :data:`ATTENTION_MAX_QUERIES` or what the module says. Scale ``1 / sqrt(D)``
    (Vaswani et al. 2017), softmax in float32; differs from torch's
    ``scaled_dot_product_attention`` by summation order only."""
    lib = native.library()
    if lib is None or q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or not _cpu_f32(q, k, v):
        return None
    B, H, T, D = q.shape
    _, Hkv, S, _ = k.shape
    if (not 1 <= T <= ATTENTION_MAX_QUERIES or k.shape[0] != B or k.shape[3] != D or S != start + T
            or Hkv < 1 or H % Hkv or k.stride(3) != 1 or v.stride(3) != 1):
        return None
    if q.stride(3) != 1:
        q = q.contiguous()
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (q, k, v)]
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    if lib.mi_attention(q.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2],
                        B, H, Hkv, T, S, D, start, window, ctypes.c_float(D ** -0.5), out.data_ptr(),
                        torch.get_num_threads()):
        return None
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` (Shazeer 2020; ``silu(g) = g / (1 + exp(-g))``): ``gate, up``
    ``(M, N)`` float32 -> ``(M, N)`` float32, or None for ``M`` above :data:`SWIGLU_MAX_ROWS`
    (outside :func:`packed_pass`) or what the module says. Differs from torch's ``F.silu`` by
    its exp's last bit at most."""
    lib = native.library()
    if lib is None or gate.dim() != 2 or up.shape != gate.shape or not _cpu_f32(gate, up):
        return None
    if gate.shape[0] < 1 or (gate.shape[0] > SWIGLU_MAX_ROWS and not in_packed_pass()):
        return None
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    lib.mi_swiglu(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> int:
    """The index of the largest value of ``x`` ``(V,)`` (any float dtype, any device), as
    ``int(torch.argmax(x))`` gives it: the first on ties, the first NaN when there is one. One C
    pass for float32 on the CPU (``mi_argmax``; torch's took 0.23 ms over a step's 151,936
    logits at 2 threads here, the C pass about a tenth of that), torch otherwise.

    Raises:
        ValueError: ``x`` is not one-dimensional or is empty.
    """
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"argmax takes a non-empty (V,) tensor, got shape {tuple(x.shape)}")
    lib = native.library()
    if lib is None or not _cpu_f32(x):
        return int(x.argmax())
    x = x.contiguous()
    return int(lib.mi_argmax(x.data_ptr(), x.numel()))


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` (any shape, any float dtype, any device) is finite: one C
    pass for float32 on the CPU (``mi_all_finite``; torch's ``isfinite(x).all()`` took 1.7 ms
    over a step's 151,936 logits at 2 threads here), torch otherwise."""
    lib = native.library()
    if lib is None or not _cpu_f32(x):
        return bool(torch.isfinite(x).all())
    x = x.contiguous()
    return bool(lib.mi_all_finite(x.data_ptr(), x.numel()))
