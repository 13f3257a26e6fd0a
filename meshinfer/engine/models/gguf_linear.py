"""Projections and the token embedding of the ``gguf`` precision: the file's own blocks.

A ``GGUFLinear`` holds its weight as the GGUF file stores it (``kernels.blocks.QuantBlocks``:
Q4_K, Q5_0, Q6_K, Q8_0, Q4_0, Q4_1 or F16 blocks, or float32 rows for every other type,
dequantized exactly at load) and multiplies float32 activations by it. The weights are exactly
gguf-py's dequantization, so the model computed is the f32 precision's, up to float32
summation order. Pure torch plus the C kernels: nothing here logs, prints, awaits or touches files.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.engine.kernels import blocks as kb
from meshinfer.engine.kernels.step_ops import in_packed_pass
from meshinfer.engine.models.common import linear, swiglu

#: Rows (tokens in one pass) from which a projection dequantizes its weight chunk by chunk and
#: runs torch's float32 GEMM instead of the block kernel: the kernel dequantizes each block once
#: per 16 rows, while the GEMM is compute-efficient on many. ``tests/benchmarks/gguf_kernels.py``
#: on the 2-core AVX2 EPYC (docs/performance.md).
DENSE_MIN_ROWS = 48


class GGUFLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` ``(N, K)`` held as GGUF blocks.

    ``(..., K)`` float -> ``(..., N)`` float32. With ``act_bits`` 16 (``gguf-a16``) or 8
    (``gguf-a8``) a decode or verification pass quantizes its activations per 32 columns to
    int16 / int8 first; a pass of one sequence of :data:`DENSE_MIN_ROWS` rows or more (a prefill)
    rounds its activations the same way and multiplies them in float32
    (``kb.dequantize_chunks``). A pass that packs several conversations' steps
    (``step_ops.packed_pass``, ``Shard.forward_batch``) always takes the block kernels, so a
    conversation's rows get the bits they get alone, however many rows strangers add (the dense
    path's summation order moved a victim's gguf-a8 logits by 2.5e-2 on the real model).
    Buffers: ``blocks`` ``(N, row_bytes)`` uint8 and ``bias`` ``(N,)`` f32 or None; ``qtype`` (a
    GGML type id) is a plain attribute.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, *, act_bits: int = 32) -> None:
        super().__init__()
        self.in_features, self.out_features, self.qtype = in_features, out_features, 0
        self.act_bits = act_bits  # 32 (gguf), 16 (gguf-a16) or 8 (gguf-a8): kernels.blocks.matmul
        self.register_buffer("blocks", torch.empty(out_features, in_features * 4, dtype=torch.uint8))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    @property
    def weight_blocks(self) -> kb.QuantBlocks:
        """The weight as :class:`~meshinfer.engine.kernels.blocks.QuantBlocks`, made (and checked)
        once per ``blocks`` buffer rather than on every call."""
        wb = self.__dict__.get("_wb")
        if wb is None or wb.data is not self.blocks or wb.qtype != self.qtype:
            wb = self.__dict__["_wb"] = kb.QuantBlocks(self.qtype, self.blocks, self.in_features)
        return wb

    def set_blocks(self, w: kb.QuantBlocks) -> None:
        """Keep ``w`` (the file's bytes) as this projection's weight."""
        self.qtype, self.blocks = w.qtype, w.data.contiguous()

    def set_float_weight(self, w: torch.Tensor) -> None:
        """Keep ``w`` ``(N, K)`` as float32 rows (a tensor type the kernels do not take)."""
        self.set_blocks(kb.QuantBlocks.from_float(w))

    def dequantized(self) -> torch.Tensor:
        """The weight ``(N, K)`` f32 (exactly gguf-py's dequantization)."""
        return kb.dequantize(self.weight_blocks)

    def fused(self, others: Sequence["GGUFLinear"] = ()) -> kb.FusedProduct | None:
        """This projection and ``others`` (which share its input) as one kernel call, or None
        where they cannot share one (``kb.FusedProduct.make``). Made once and kept until a
        weight, bias or type of one of them changes."""
        mods = (self, *others)
        state = [(m.blocks, m.bias, m.qtype, m.act_bits) for m in mods]
        cache = self.__dict__.setdefault("_fused", {})
        key = tuple(map(id, others))
        entry = cache.get(key)
        if entry is None or not all(a[0] is b[0] and a[1] is b[1] and a[2:] == b[2:] for a, b in zip(entry[0], state)):
            made = None
            if all(m.act_bits == self.act_bits for m in mods):
                made = kb.FusedProduct.make([m.weight_blocks for m in mods], [m.bias for m in mods], self.act_bits)
            cache[key] = entry = (state, made)
        return entry[1]

    def dense_for(self, x: torch.Tensor) -> bool:
        """Whether a pass of ``x`` ``(..., K)`` is dense-sized: one sequence of
        :data:`DENSE_MIN_ROWS` rows or more (a prefill). Weights held as blocks then take the
        dense path; float32 rows (``qtype`` 0) keep their own kernel."""
        return x.numel() >= DENSE_MIN_ROWS * self.in_features and not in_packed_pass()

    def forward(self, x: torch.Tensor, *, overwrite_input: bool = False) -> torch.Tensor:
        """``x`` ``(..., K)`` -> ``(..., N)`` float32. ``overwrite_input``: the caller no longer
        needs ``x`` (a float32 temporary of its own), which the dense path may then round in
        its own memory (``kb.dequantize_chunks``); the result is the same."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()  # (M, K)
        dense = self.dense_for(x2)
        fused = None if dense else self.fused()
        if fused is not None:  # a decode or verification pass: one prepared kernel call, bias included
            return fused(x2)[0].reshape(*lead, self.out_features)
        w = self.weight_blocks
        if self.qtype == 0:  # float32 rows: the kernel on every CPU (the same bits), else torch
            wf = self.blocks.view(torch.float32).reshape(self.out_features, self.in_features)
            y = kb.matmul_f32(x2, wf, every_cpu=True)
            y = linear(x2, wf) if y is None else y
        elif dense:
            y = kb.dequantize_chunks(x2, w, act_bits=self.act_bits, overwrite_x=overwrite_input)  # (M, N)
        else:
            y = kb.matmul(x2, w, act_bits=self.act_bits)  # (M, N)
        if self.bias is not None:
            y.add_(self.bias)  # y is this call's own tensor: no second (M, N)
        return y.reshape(*lead, self.out_features)


def project_many(x: torch.Tensor, mods: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Each of ``mods``' outputs for one input ``x`` ``(..., K)``: ``[(..., N_t)]``.

    :class:`GGUFLinear` projections of a decode or verification pass (fewer than
    :data:`DENSE_MIN_ROWS` rows, or any packed pass of several conversations) run as one kernel
    call (``GGUFLinear.fused``: a layer's q, k and v, or gate and up); anything else runs module
    by module. The results are the same
    either way, bit for bit."""
    first = mods[0]
    if (isinstance(first, GGUFLinear) and all(isinstance(m, GGUFLinear) for m in mods)
            and (x.numel() < DENSE_MIN_ROWS * x.shape[-1] or in_packed_pass())):
        fused = first.fused(mods[1:])
        if fused is not None:
            lead = x.shape[:-1]
            return [y.reshape(*lead, y.shape[1]) for y in fused(x.reshape(-1, x.shape[-1]).float())]
    return [m(x) for m in mods]


def swiglu_product(x: torch.Tensor, gate_proj: nn.Module, up_proj: nn.Module) -> torch.Tensor:
    """SwiGLU's product (Shazeer 2020) of one input: ``silu(gate_proj(x)) * up_proj(x)``,
    ``(..., K)`` -> ``(..., I)``.

    In a prefill pass (``GGUFLinear.dense_for``) through two bias-free :class:`GGUFLinear` held
    as blocks, the up projection runs chunk by chunk (``kb.dense_row_chunks``), each chunk
    multiplied into its columns of the gate's output at once, so no whole ``(..., I)`` up
    output exists: 10 MiB less at a 512-position chunk of the default model (I = 4,864). The
    bits are those of ``swiglu(gate, up)``: each element is the same float32 product. Anything
    else takes :func:`project_many` and ``common.swiglu``."""
    if not (isinstance(gate_proj, GGUFLinear) and isinstance(up_proj, GGUFLinear)
            and gate_proj.bias is None and up_proj.bias is None and gate_proj.qtype and up_proj.qtype
            and gate_proj.dense_for(x) and up_proj.dense_for(x)):
        gate, up = project_many(x, (gate_proj, up_proj))  # one kernel call at gguf*
        return swiglu(gate, up, overwrite_gate=True)
    gate = F.silu(gate_proj(x), inplace=True)  # (..., I), this call's own tensor
    rows = gate.view(-1, up_proj.out_features)  # (M, I)
    w = up_proj.weight_blocks
    xu = kb.dense_input(x.reshape(-1, up_proj.in_features).float(), w, up_proj.act_bits)  # (M, K)
    for i, j, wc in kb.dense_row_chunks(w):
        rows[:, i:j].mul_(torch.mm(xu, wc.t()))
    return gate


def project_spent(x: torch.Tensor, proj: nn.Module) -> torch.Tensor:
    """``proj(x)`` where ``x`` is the caller's own temporary, no longer needed after: a
    :class:`GGUFLinear` may round it in place (``overwrite_input``); any other module is
    called as it is."""
    return proj(x, overwrite_input=True) if isinstance(proj, GGUFLinear) else proj(x)


class GGUFEmbedding(nn.Module):
    """Token embedding kept as GGUF blocks: ids ``(B, T)`` int64 -> ``(B, T, C)`` float32, each
    looked-up row dequantized exactly. Buffer: ``blocks`` ``(V, row_bytes)`` uint8."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.dim, self.qtype = dim, 0
        self.register_buffer("blocks", torch.empty(num_embeddings, dim * 4, dtype=torch.uint8))

    def set_blocks(self, w: kb.QuantBlocks) -> None:
        self.qtype, self.blocks = w.qtype, w.data.contiguous()

    def set_float_weight(self, w: torch.Tensor) -> None:
        self.set_blocks(kb.QuantBlocks.from_float(w))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = kb.QuantBlocks(self.qtype, self.blocks, self.dim).rows(ids.reshape(-1))
        return kb.dequantize(rows).reshape(*ids.shape, self.dim)
