"""Weight-only quantized projections and the precisions that use them.

A *precision* names one kernel family; it is also the identity a peer advertises, so a route
never mixes families (``routing.py`` compares it exactly). The families:

=============== ============================================================ ==============
name            weights / matmul kernel                                      hidden + KV
=============== ============================================================ ==============
``f32``         float32, ``torch.matmul``                                    float32
``bf16``        bfloat16, ``torch.matmul``                                   bfloat16
``f16``         float16, ``torch.matmul``                                    float16
``q8-bf16``     int8 per output channel, symmetric; ``torch._weight_int8pack_mm``
                with bfloat16 activations                                    float32
``q4-gG-bf16``  int4 asymmetric in groups of G = 32, 64 or 128 input columns;
                ``torch._weight_int4pack_mm_for_cpu`` with bfloat16
                activations; a matrix the int4 kernel cannot take
                (``out % 16 != 0`` or ``in % G != 0``) uses the q8 kernel    float32
``gguf``        the GGUF file's own blocks (Q4_K, Q5_0, Q6_K, Q8_0, ...), float32
                activations; the C kernels of ``engine/kernels``
                (``models/gguf_linear.py``); the same weights as f32         float32
``gguf-a16``    the same blocks; decode activations quantized per 32 columns
                to int16 (integer dot products; ~2e-5 relative error)        float32
``gguf-a8``     the same, to int8 (llama.cpp's CPU path; ~0.5-1%)            float32
=============== ============================================================ ==============

Quantized precisions keep the residual stream, norms, RoPE, attention and the KV cache in
float32; only the input of each projection is rounded to bfloat16 (the CPU kernels are fast for
bfloat16 activations and 4-10x slower for float32 ones, see docs/performance.md). The token
embedding is stored as int8 per row and dequantized row by row on lookup. On a pass of
:data:`DENSE_MIN_ROWS` rows or more (prefill), a projection instead dequantizes its weight to
bfloat16 for one dense matmul, where the decode kernels would be compute-bound.

Pure torch: nothing here logs, prints, awaits or touches files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.core.config import PRECISION_NAMES

#: Group sizes (input columns sharing one int4 scale and zero) that ``q4-gG-bf16`` accepts.
INT4_GROUP_SIZES = (32, 64, 128)
#: The int4 CPU kernel packs output rows in blocks of 16.
INT4_ROW_MULTIPLE = 16
#: Rows quantized at a time; a multiple of 64 (the int4 packing works in 64-row blocks, so
#: packing chunk by chunk equals packing at once). Bounds the float temporaries of quantizing the
#: 151,936 x 896 output head to ~30 MB each instead of 545 MB, keeping the load peak low.
QUANT_ROWS_PER_CHUNK = 8192
#: Rows (tokens in one pass) from which a quantized projection dequantizes its weight to
#: bfloat16 and runs one dense bf16 matmul instead of the int8/int4 kernel. The kernels are
#: built for decode: on many rows they turn compute-bound, while dequantizing costs about one
#: pass over the weight. ``tests/benchmarks/prefill_kernels.py`` on the 2-core CPU
#: (docs/performance.md), 4864x896 at 128 / 512 rows: int4 kernel 11.3 / 45.2 ms against
#: 10.1 / 17.1 dense, int8 13.2 / 54.5 against 3.8 / 8.6; the int4 break-even is near 128
#: rows (int8's lower, but one threshold keeps both simple). Decode steps and batches of them
#: stay below it, so they keep the compact kernels.
DENSE_MIN_ROWS = 128
#: Rows per block of the int4 kernel's packed layout (:func:`unpack_int4`).
INT4_PACK_BLOCK = 64


@dataclass(frozen=True)
class Precision:
    """One kernel family.

    Attributes:
        name: the identity string (``--dtype`` value and advert ``precision``).
        act_dtype: dtype of hidden states, norms, the KV cache and float weights.
        weights: ``"float"`` (weights in ``act_dtype``), ``"int8"``, ``"int4"`` or ``"gguf"``
            (the file's own blocks).
        group_size: int4 group size in input columns (0 unless ``weights == "int4"``).
    """

    name: str
    act_dtype: torch.dtype
    weights: str = "float"
    group_size: int = 0

    @property
    def quantized(self) -> bool:
        return self.weights != "float"


FLOAT_PRECISIONS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
#: The precisions that compute from the GGUF file's own blocks -> bits of their decode activations.
GGUF_ACT_BITS = {"gguf": 32, "gguf-a16": 16, "gguf-a8": 8}
_Q4 = re.compile(r"q4-g(\d+)-bf16")


def precision_names() -> list[str]:
    """Every accepted precision name (``meshinfer.core.config.PRECISION_NAMES``)."""
    return list(PRECISION_NAMES)


def parse_precision(name: str) -> Precision:
    """``"f32" | "bf16" | "f16" | "q8-bf16" | "q4-g{32,64,128}-bf16" | "gguf"`` -> :class:`Precision`.

    Raises:
        ValueError: any other name; the message lists the choices.
    """
    if name in FLOAT_PRECISIONS:
        return Precision(name, FLOAT_PRECISIONS[name])
    if name == "q8-bf16":
        return Precision(name, torch.float32, "int8")
    if name in GGUF_ACT_BITS:
        return Precision(name, torch.float32, "gguf")
    m = _Q4.fullmatch(name)
    if m and int(m.group(1)) in INT4_GROUP_SIZES:
        return Precision(name, torch.float32, "int4", int(m.group(1)))
    raise ValueError(f"precision {name!r} is not one of {', '.join(precision_names())}")


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """``x`` f32 rounded to a bfloat16 value ``>= x`` (kept as f32), so a scale never shrinks."""
    b = x.to(torch.bfloat16)
    up = torch.nextafter(b, torch.full_like(b, float("inf")))
    return torch.where(b.float() >= x, b, up).float()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: ``w`` ``(N, K)`` float -> (``q`` ``(N, K)`` int8, ``scale`` ``(N,)`` f32).

    ``w ≈ q * scale[:, None]`` with ``scale = max|w_row| / 127`` rounded up to a bfloat16 value
    (the kernels take bf16 scales), so ``|w - q * scale| <= scale / 2``; an all-zero row gets
    scale 1.
    """
    w = w.float()
    scale = w.abs().amax(dim=1) / 127.0  # (N,)
    scale = _bf16_at_least(torch.where(scale > 0, scale, torch.ones_like(scale)))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric grouped int4 (the gpt-fast / ``_weight_int4pack_mm`` convention).

    For each row and each group of ``group_size`` columns: ``scale = (max - min) / 15`` and
    ``zero = min + 8 * scale``, both rounded to bfloat16 (what the kernel reads; the scale
    rounded up), then ``q = round((w - zero) / scale) + 8`` in ``[0, 15]``, so
    ``w ≈ (q - 8) * scale + zero`` within ``scale / 2`` plus the zero's bf16 rounding.

    Args:
        w: ``(N, K)`` float with ``K % group_size == 0``.

    Returns:
        ``q`` ``(N, K)`` int32 in ``[0, 15]`` and ``scales_zeros`` ``(K / group_size, N, 2)`` f32.
    """
    N, K = w.shape
    g = w.float().reshape(N, K // group_size, group_size)  # (N, K/G, G)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)  # (N, K/G, 1)
    scale = _bf16_at_least(((hi - lo) / 15.0).clamp_(min=1e-8))
    zero = (lo + 8.0 * scale).to(torch.bfloat16).float()
    q = (torch.round((g - zero) / scale) + 8).clamp_(0, 15).to(torch.int32).reshape(N, K)
    scales_zeros = torch.cat([scale, zero], dim=2).transpose(0, 1).contiguous()  # (K/G, N, 2)
    return q, scales_zeros


def dequantize_int4(q: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int4`: ``(N, K)`` int32 + ``(K/G, N, 2)`` -> ``(N, K)`` f32."""
    N, K = q.shape
    sz = scales_zeros.float().transpose(0, 1)  # (N, K/G, 2)
    g = q.float().reshape(N, K // group_size, group_size)
    return ((g - 8.0) * sz[..., :1] + sz[..., 1:]).reshape(N, K)


def unpack_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The int4 kernel's packed weight back to ``q`` ``(N, K)`` uint8 in ``[0, 15]``.

    ``torch._convert_weight_to_int4pack_for_cpu(q, 1)`` (torch 2.13) stores rows in blocks of
    :data:`INT4_PACK_BLOCK`: in block ``b``, byte ``(k, n)`` for ``n < 32`` holds row
    ``64 b + n`` in its low nibble and row ``64 b + 32 + n`` in its high one, column ``k``. The
    layout is private to torch: :func:`int4_layout_known` checks it once per process, and
    callers use this only then and only for ``N % 64 == 0``.
    """
    N, K = out_features, in_features
    p = packed.reshape(N // INT4_PACK_BLOCK, K, INT4_PACK_BLOCK // 2)  # (N/64, K, 32)
    q = torch.cat([p & 0xF, p >> 4], dim=2)  # (N/64, K, 64): rows n, then rows n + 32
    return q.permute(0, 2, 1).reshape(N, K)


@cache
def int4_layout_known() -> bool:
    """Whether this torch packs int4 weights as :func:`unpack_int4` reads them (checked on a
    random ``(128, 64)`` matrix, once per process)."""
    q = torch.randint(0, 16, (2 * INT4_PACK_BLOCK, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        return bool(torch.equal(unpack_int4(packed, *q.shape).to(torch.int32), q))
    except RuntimeError:
        return False


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with int8 weights, via ``torch._weight_int8pack_mm``.

    Buffers: ``weight`` ``(N, K)`` int8, ``scales`` ``(N,)`` bf16, ``bias`` ``(N,)`` f32 or None.
    ``(..., K)`` float -> ``(..., N)`` in the input's dtype; the matmul runs on bf16 activations.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(out_features, dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    def set_float_weight(self, w: torch.Tensor) -> None:
        """Quantize ``w`` ``(N, K)`` float into this module's buffers (replacing any meta ones)."""
        q, scale = _by_rows(quantize_int8, w)
        self.weight, self.scales = q, scale.to(torch.bfloat16)  # exact: scale is bf16-valued

    def dequantized(self) -> torch.Tensor:
        """The effective weight ``(N, K)`` f32 (for tests and error bounds)."""
        return self.weight.float() * self.scales.float()[:, None]

    def dense_weight(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of the weight dequantized to bf16, ``(stop - start, K)``."""
        return self.weight[start:stop].to(torch.bfloat16) * self.scales[start:stop, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., K)`` -> ``(..., N)``; from :data:`DENSE_MIN_ROWS` rows on, one bf16 matmul with
        the weight dequantized to bf16 (``q * scale`` rounded to bf16)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, K)
        if x2.shape[0] >= DENSE_MIN_ROWS:
            y = _dense_matmul(x2, self.out_features, self.dense_weight)  # (M, N) bf16
        else:
            y = torch._weight_int8pack_mm(x2, self.weight, self.scales)  # (M, N) bf16
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)


class Int4Linear(nn.Module):
    """``y = x @ W.T + bias`` with grouped int4 weights, via ``torch._weight_int4pack_mm_for_cpu``.

    Buffers: ``weight`` ``(N, K / 2)`` uint8 (the kernel's packed layout), ``scales_zeros``
    ``(K / G, N, 2)`` bf16, ``bias`` ``(N,)`` f32 or None. Needs ``N % 16 == 0`` and ``K % G == 0``
    (see :func:`int4_fits`). ``(..., K)`` float -> ``(..., N)`` in the input's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_zeros", torch.empty(in_features // group_size, out_features, 2,
                                                         dtype=torch.bfloat16))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)

    def set_float_weight(self, w: torch.Tensor) -> None:
        """Quantize ``w`` ``(N, K)`` float into this module's buffers (replacing any meta ones)."""
        def pack(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            q, sz = quantize_int4(rows, self.group_size)
            return torch._convert_weight_to_int4pack_for_cpu(q, 1), sz.to(torch.bfloat16)

        self.weight, self.scales_zeros = _by_rows(pack, w, sz_dim=1)  # (N, K/2) uint8, (K/G, N, 2)

    def dequantized(self) -> torch.Tensor:
        """The effective weight ``(N, K)`` f32 (multiplies the identity through the kernel)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        return torch._weight_int4pack_mm_for_cpu(eye, self.weight, self.group_size,
                                                 self.scales_zeros).float().T.contiguous()

    def dense_weight(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` (multiples of :data:`INT4_PACK_BLOCK`) of the weight dequantized
        to bf16, ``(q - 8) * scale + zero`` (see :func:`quantize_int4`), from the packed buffer
        (:func:`unpack_int4`; a packed block of 64 rows is 64 rows of it): ``(stop - start, K)``."""
        N, K, G = stop - start, self.in_features, self.group_size
        q = unpack_int4(self.weight[start:stop], N, K).to(torch.bfloat16).reshape(N, K // G, G)  # (N, K/G, G)
        sz = self.scales_zeros[:, start:stop].transpose(0, 1)  # (N, K/G, 2) bf16
        return ((q - 8) * sz[..., :1] + sz[..., 1:]).reshape(N, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., K)`` -> ``(..., N)``; from :data:`DENSE_MIN_ROWS` rows on (and when
        :func:`int4_layout_known`), one bf16 matmul with :meth:`dense_weight`."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (M, K)
        if (x2.shape[0] >= DENSE_MIN_ROWS and self.out_features % INT4_PACK_BLOCK == 0
                and int4_layout_known()):
            y = _dense_matmul(x2, self.out_features, self.dense_weight)  # (M, N) bf16
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.weight, self.group_size, self.scales_zeros)  # (M, N)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)


@cache
def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX).

    Without it (AVX2-only x86 CPUs, e.g. AMD EPYC before Zen 4), torch's bf16 GEMM converts in
    software: on this project's 2-core AVX2 EPYC, one thread, ``F.linear`` of a (349, 896) by
    (4864, 896) product took 329 ms in bf16 against 65 ms in f32 (docs/performance.md).
    """
    probe = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(f() for f in probe if f is not None)


def _dense_matmul(x: torch.Tensor, n: int, dense_weight) -> torch.Tensor:
    """``x`` ``(M, K)`` bf16 times the weight's ``n`` rows, dequantized by ``dense_weight(start,
    stop)`` :data:`QUANT_ROWS_PER_CHUNK` rows at a time: ``(M, n)`` bf16. The chunks bound the
    dequantized copy of the output head (151,936 rows, 272 MB in bf16) to about 15 MB.

    On a CPU without bf16 hardware (:func:`native_bf16_matmul`) the product runs in f32 on the
    same bf16 values (exact widening; f32 accumulation, as the bf16 kernels accumulate) and is
    rounded to bf16: the same result up to summation order, at a fifth of the time there.
    """
    f32 = x.device.type == "cpu" and not native_bf16_matmul()
    xm = x.float() if f32 else x

    def part(i: int, j: int) -> torch.Tensor:
        w = dense_weight(i, j)  # (j - i, K) bf16
        return F.linear(xm, w.float()).to(torch.bfloat16) if f32 else F.linear(xm, w)
    if n <= QUANT_ROWS_PER_CHUNK:
        return part(0, n)
    return torch.cat([part(i, min(i + QUANT_ROWS_PER_CHUNK, n)) for i in range(0, n, QUANT_ROWS_PER_CHUNK)], dim=1)


class Int8Embedding(nn.Module):
    """Token embedding stored int8 per row: ids ``(B, T)`` int64 -> ``(B, T, C)`` in ``out_dtype``.

    Buffers: ``weight`` ``(V, C)`` int8, ``scales`` ``(V,)`` f32.
    """

    def __init__(self, num_embeddings: int, dim: int, out_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_dtype = out_dtype
        self.register_buffer("weight", torch.empty(num_embeddings, dim, dtype=torch.int8))
        self.register_buffer("scales", torch.empty(num_embeddings))

    def set_float_weight(self, w: torch.Tensor) -> None:
        """Quantize ``w`` ``(V, C)`` float into this module's buffers."""
        self.weight, self.scales = _by_rows(quantize_int8, w)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight).to(self.out_dtype)  # (B, T, C)
        return rows * F.embedding(ids, self.scales[:, None]).to(self.out_dtype)  # (B, T, 1) scale


def _by_rows(quantize, w: torch.Tensor, *, sz_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``quantize`` to ``w`` ``(N, K)`` in chunks of :data:`QUANT_ROWS_PER_CHUNK` rows and
    join the results (rows on dim 0 of the first result and on ``sz_dim`` of the second)."""
    parts = [quantize(w[i:i + QUANT_ROWS_PER_CHUNK].contiguous()) for i in range(0, w.shape[0], QUANT_ROWS_PER_CHUNK)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts], dim=sz_dim)


def int4_fits(in_features: int, out_features: int, group_size: int) -> bool:
    """Whether the int4 CPU kernel takes an ``(out, in)`` matrix at ``group_size``."""
    return out_features % INT4_ROW_MULTIPLE == 0 and in_features % group_size == 0 and in_features % 2 == 0


def quantized_linear(linear: nn.Linear, precision: Precision) -> nn.Module:
    """An empty quantized module with ``linear``'s shape (weights set later by ``set_float_weight``)."""
    K, N, bias = linear.in_features, linear.out_features, linear.bias is not None
    if precision.weights == "gguf":
        from meshinfer.engine.models.gguf_linear import GGUFLinear
        return GGUFLinear(K, N, bias, act_bits=GGUF_ACT_BITS[precision.name])
    if precision.weights == "int4" and int4_fits(K, N, precision.group_size):
        return Int4Linear(K, N, bias, precision.group_size)
    return Int8Linear(K, N, bias)


def quantize_modules(root: nn.Module, precision: Precision) -> None:
    """Swap every ``nn.Linear`` under ``root`` for its quantized module and every
    ``nn.Embedding`` for an :class:`Int8Embedding`, in place (works on the meta device).
    """
    if not precision.quantized:
        return
    for name, module in list(root.named_modules()):
        if isinstance(module, nn.Linear):
            new = quantized_linear(module, precision)
        elif isinstance(module, nn.Embedding) and precision.weights == "gguf":
            from meshinfer.engine.models.gguf_linear import GGUFEmbedding
            new = GGUFEmbedding(module.num_embeddings, module.embedding_dim)
        elif isinstance(module, nn.Embedding):
            new = Int8Embedding(module.num_embeddings, module.embedding_dim, precision.act_dtype)
        else:
            continue
        owner, _, attr = name.rpartition(".")
        setattr(root.get_submodule(owner) if owner else root, attr, new)
