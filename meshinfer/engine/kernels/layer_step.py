"""A whole Llama-family decoder layer of a decode or verification step as one C call
(``mi_layer_step`` in ``step_ops.c``), at the gguf precisions and at f32.

Why: at the gguf precisions a decode step of the default model made about 20 Python-level
operations per layer (4 products, 2 norms, 2 RoPE, the cache write, attention, SwiGLU, 2
residual adds, views), each tens of microseconds of dispatch on this project's 2-core machine
while the kernels' other thread spins: several milliseconds of a 35-45 ms step
(docs/performance.md, "Around the projections"). One call runs the same C functions in the same
order, so its result equals the operation-by-operation path bit for bit
(tests/test_layer_step.py).

Pure computation: nothing here logs or prints.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from meshinfer.engine.kernels import native
from meshinfer.engine.kernels.blocks import F32_KERNEL_MAX_ROWS, FusedProduct
from meshinfer.engine.kernels.step_ops import ATTENTION_MAX_QUERIES

_i64, _p = ctypes.c_int64, ctypes.c_void_p


class _Product(ctypes.Structure):
    """``struct mi_product``: one ``mi_matmul_many`` call's weights."""
    _fields_ = [("act_bits", ctypes.c_int), ("nt", ctypes.c_int), ("types", _p), ("ws", _p), ("ns", _p),
                ("biases", _p), ("k", _i64)]


class _Layer(ctypes.Structure):
    """``struct mi_layer``."""
    _fields_ = [("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("norm_in", _p), ("norm_post", _p), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64), ("inter", _i64),
                ("window", _i64)]


class F32Product:
    """Float32 weights ``W_t`` ``(N_t, K)`` (and biases ``(N_t,)`` or None) that share one input,
    as a :class:`LayerStep` product: each ``x @ W_t.T`` through ``mi_matmul_f32`` (the f32
    precision's few-row kernel, ``blocks.matmul_f32``), then its bias added, as ``common.linear``
    computes it. :meth:`make` returns None where that kernel would not take them."""

    #: Most rows per step: where ``common.linear`` stops using the kernel.
    max_rows = F32_KERNEL_MAX_ROWS

    def __init__(self, ws: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> None:
        n = len(ws)
        self.in_features, self.out_features = ws[0].shape[1], tuple(w.shape[0] for w in ws)
        self._keep = (tuple(ws), tuple(biases))
        self._arrays = ((ctypes.c_void_p * n)(*(w.data_ptr() for w in ws)), (ctypes.c_int64 * n)(*self.out_features),
                        (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for b in biases)))
        self.args = (0, n, None, *(ctypes.addressof(a) for a in self._arrays), self.in_features)

    @classmethod
    def make(cls, ws: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> "F32Product | None":
        """The product of ``ws`` with ``biases``, or None: not float32 contiguous on the CPU, widths
        that differ or are not a multiple of 8, no kernels (or built without AVX2)."""
        lib = native.library()
        if lib is None or lib.mi_simd() != 1 or not ws or len(biases) != len(ws):
            return None
        for w, b in zip(ws, biases):
            if (w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 or not w.is_contiguous()
                    or w.shape[1] != ws[0].shape[1] or w.shape[1] % 8):
                return None
            if b is not None and (b.dtype != torch.float32 or b.device.type != "cpu" or not b.is_contiguous()
                                  or b.shape != (w.shape[0],)):
                return None
        return cls(ws, biases)


class LayerStep:
    """One layer's prepared call: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``, with q/k/v,
    o, gate/up and down as :class:`FusedProduct` s (GGUF blocks) or :class:`F32Product` s, and
    the two RMSNorm weights ``(C,)`` float32. ``max_rows``: the most positions one call takes
    (the products' own limit, or ``step_ops.ATTENTION_MAX_QUERIES``).

    Args:
        products: the q/k/v, o, gate/up and down products, in that order.
        norms: the input and post-attention RMSNorm weights, ``(C,)`` float32 contiguous, CPU.
        eps: the RMSNorm epsilon.
        heads, kv_heads, head_dim: H, Hkv, D.
        window: 0, or the sliding window in positions.

    Raises:
        ValueError: sizes that do not fit together (the products' widths against C, H, Hkv, D).
    """

    def __init__(self, products: Sequence[FusedProduct | F32Product], norms: Sequence[torch.Tensor], eps: float, *,
                 heads: int, kv_heads: int, head_dim: int, window: int = 0) -> None:
        qkv, o, gate_up, down = products
        C = norms[0].shape[0]
        if min(heads, kv_heads, head_dim) < 1 or heads % kv_heads:
            raise ValueError(f"{heads} query heads over {kv_heads} key/value heads of width {head_dim} "
                             f"do not fit one Llama-family layer")
        inter = gate_up.out_features[0]
        if (qkv.out_features != (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim) or qkv.in_features != C
                or o.out_features != (C,) or o.in_features != heads * head_dim or gate_up.in_features != C
                or gate_up.out_features != (inter, inter) or down.in_features != inter or down.out_features != (C,)
                or any(n.shape != (C,) or n.dtype != torch.float32 or not n.is_contiguous() for n in norms)):
            raise ValueError("the layer's products and norms do not fit one Llama-family layer")
        self.products, self.norms = tuple(products), tuple(norms)  # kept: the struct points into them
        self.hidden = C
        self.max_rows = min([ATTENTION_MAX_QUERIES, *(getattr(p, "max_rows", ATTENTION_MAX_QUERIES) for p in products)])
        self._layer = _Layer(*(_Product(*p.args) for p in products), norms[0].data_ptr(), norms[1].data_ptr(),
                             eps, head_dim ** -0.5, C, heads, kv_heads, head_dim, inter, window)
        self._ref = ctypes.byref(self._layer)

    def inputs_fit(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether the kernel takes ``x`` ``(1, T, C)`` and ``cos/sin`` ``(T, R)``, float32, with
        ``1 <= T <= max_rows``."""
        T = x.shape[1] if x.dim() == 3 else 0
        return (1 <= T <= self.max_rows and x.shape == (1, T, self.hidden) and x.dtype == torch.float32
                and cos.dim() == 2 and cos.shape[0] == T and sin.shape == cos.shape
                and cos.dtype == torch.float32 and sin.dtype == torch.float32)

    def cache_fits(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether ``k_cache, v_cache`` are this layer's KV storage as the kernel reads and
        writes it: ``(1, Hkv, capacity, D)`` float32 contiguous."""
        L = self._layer
        return (k_cache.dim() == 4 and tuple(k_cache.shape) == (1, L.kv_heads, k_cache.shape[2], L.head_dim)
                and v_cache.shape == k_cache.shape and k_cache.dtype == torch.float32
                and v_cache.dtype == torch.float32 and k_cache.is_contiguous() and v_cache.is_contiguous())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
        """The layer over ``x`` ``(1, T, C)`` float32 at positions ``start .. start+T-1``, with
        ``cos/sin`` ``(T, R)`` float32 and the layer's KV storage ``k_cache, v_cache``
        ``(1, Hkv, capacity, D)`` float32 contiguous, whose first ``start`` positions hold the
        earlier keys and values; the new ones are written after them. Returns ``(1, T, C)``
        (``x`` itself is not changed), or None for tensors of other sizes, dtypes or layouts, or
        when the kernel refused (the caller then runs the layer operation by operation)."""
        if not self.inputs_fit(x, cos, sin) or not self.cache_fits(k_cache, v_cache):
            return None  # the kernel reads and writes by these sizes: anything else goes through torch
        out = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = native.library().mi_layer_step(self._ref, out.data_ptr(), x.shape[1], cos.data_ptr(), sin.data_ptr(),
                                            cos.shape[1], k_cache.data_ptr(), v_cache.data_ptr(),
                                            k_cache.shape[2], start, torch.get_num_threads())
        return None if rc else out


class LayerStack:
    """Consecutive layers' :class:`LayerStep` s as one C call (``mi_layers_step``): a decode or
    verification step's whole stack of layers runs in one OpenMP parallel region, whose threads
    share out each product and the attention and meet at a barrier after each operation, instead
    of one region per product (about 120 a decode step of the default model, each start waiting
    for a vCPU that had gone to sleep; docs/performance.md, "One team per step"). The result
    equals calling each :class:`LayerStep` in turn bit for bit (tests/test_layer_step.py).

    Raises:
        ValueError: no steps, or steps of different hidden widths.
    """

    def __init__(self, steps: Sequence[LayerStep]) -> None:
        if not steps or len({s.hidden for s in steps}) != 1:
            raise ValueError("a layer stack needs layers of one hidden width")
        self.steps = tuple(steps)
        self.max_rows = min(s.max_rows for s in steps)
        self._layers = (ctypes.c_void_p * len(steps))(*(ctypes.addressof(s._layer) for s in steps))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                 kvs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """Every layer in turn over ``x`` ``(1, T, C)`` float32 at positions
        ``start .. start+T-1``, as :meth:`LayerStep.__call__` with ``kvs[i]`` the KV storage of
        layer ``i`` (all of one capacity). Returns ``(1, T, C)`` (``x`` is not changed), or None
        where any layer's call would return None; nothing is written then."""
        n = len(self.steps)
        if len(kvs) != n or x.dim() != 3 or x.shape[1] > self.max_rows or not self.steps[0].inputs_fit(x, cos, sin):
            return None
        cap = kvs[0][0].shape[2] if kvs[0][0].dim() == 4 else -1
        if not all(s.cache_fits(k, v) and k.shape[2] == cap for s, (k, v) in zip(self.steps, kvs)):
            return None
        out = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        ks = (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in kvs))
        vs = (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in kvs))
        rc = native.library().mi_layers_step(self._layers, n, out.data_ptr(), x.shape[1], cos.data_ptr(),
                                             sin.data_ptr(), cos.shape[1], ks, vs, cap, start,
                                             torch.get_num_threads())
        return None if rc else out
