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

from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.core.config import PRECISION_NAMES

#: Rows quantized at a time. Bounds the float temporaries of quantizing the
#: 151,936 x 896 output head to ~30 MB each instead of 545 MB, keeping the load peak low.
QUANT_ROWS_PER_CHUNK = 8192
#: Rows (tokens in one pass) from which a quantized projection dequantizes its weight to
#: bfloat16 and runs one dense bf16 matmul instead of the int8 kernel. The kernel is built
#: for decode: on many rows it turns compute-bound, while dequantizing costs about one pass
#: over the weight. ``tests/benchmarks/prefill_kernels.py`` on the 2-core CPU
#: (docs/performance.md), 4864x896 at 128 / 512 rows: int8 kernel 13.2 / 54.5 ms against
#: 3.8 / 8.6 dense (the break-even is below 128 rows; 128 was set when the int4 precisions,
#: since removed, shared it). Decode steps and batches of them stay below it, so they keep
#: the compact kernel.
DENSE_MIN_ROWS = 128


@dataclass(frozen=True)
class Precision:
    """One kernel family.

    Attributes:
        name: the identity string (``--dtype`` value and advert ``precision``).
        act_dtype: dtype of hidden states, norms, the KV cache and float weights.
        weights: ``"float"`` (weights in ``act_dtype``), ``"int8"`` or ``"gguf"`` (the file's
            own blocks).
    """

    name: str
    act_dtype: torch.dtype
    weights: str = "float"

    @property
    def quantized(self) -> bool:
        return self.weights != "float"


FLOAT_PRECISIONS = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
#: The precisions that compute from the GGUF file's own blocks -> bits of their decode activations.
GGUF_ACT_BITS = {"gguf": 32, "gguf-a16": 16, "gguf-a8": 8}


def precision_names() -> list[str]:
    """Every accepted precision name (``meshinfer.core.config.PRECISION_NAMES``)."""
    return list(PRECISION_NAMES)


def parse_precision(name: str) -> Precision:
    """``"f32" | "bf16" | "f16" | "q8-bf16" | "gguf" | "gguf-a16" | "gguf-a8"`` -> :class:`Precision`.

    Raises:
        ValueError: any other name; the message lists the choices.
    """
    if name in FLOAT_PRECISIONS:
        return Precision(name, FLOAT_PRECISIONS[name])
    if name == "q8-bf16":
        return Precision(name, torch.float32, "int8")
    if name in GGUF_ACT_BITS:
        return Precision(name, torch.float32, "gguf")
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


def _by_rows(quantize, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``quantize`` to ``w`` ``(N, K)`` in chunks of :data:`QUANT_ROWS_PER_CHUNK` rows and
    join the results (rows on dim 0 of both)."""
    parts = [quantize(w[i:i + QUANT_ROWS_PER_CHUNK].contiguous()) for i in range(0, w.shape[0], QUANT_ROWS_PER_CHUNK)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])


def quantized_linear(linear: nn.Linear, precision: Precision) -> nn.Module:
    """An empty quantized module with ``linear``'s shape (weights set later by ``set_float_weight``)."""
    K, N, bias = linear.in_features, linear.out_features, linear.bias is not None
    if precision.weights == "gguf":
        from meshinfer.engine.models.gguf_linear import GGUFLinear
        return GGUFLinear(K, N, bias, act_bits=GGUF_ACT_BITS[precision.name])
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
