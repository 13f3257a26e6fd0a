"""Pieces shared by Llama-family decoders: RMSNorm, RoPE, causal attention with a KV cache.

Pure computation: nothing here logs, prints, awaits or touches files. float32 on the CPU goes
through the C kernels where they are built (``engine/kernels``: few-row products, RMSNorm, RoPE,
step attention); the torch operations below are the definition and the path everywhere else.
Shape vocabulary: B batch, T new tokens, S cached + new length, H / Hkv query / key-value
heads, D head dim, C hidden width, V vocabulary.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.core.config import ModelConfig
from meshinfer.engine.kernels import step_ops
from meshinfer.engine.kernels.blocks import matmul_f32

#: Query rows per attention call during prefill: bounds score memory to H * 256 * S floats
#: instead of H * T * S (a 3,000-token prompt on Qwen2.5-0.5B: 43 MB instead of 504 MB).
ATTENTION_QUERY_CHUNK = 256


#: Rows from which :func:`linear` stays with ``F.linear``: by 512 rows (a prefill chunk) the
#: transposed form is 5-12% slower (``tests/benchmarks/small_m_gemm.py``).
TRANSPOSED_MAX_ROWS = 64
#: Weight elements from which :func:`linear` takes the transposed form: the 4864 x 896 and
#: 896 x 4864 projections (4.4 M) and the head gain 1.6-3.6x; the 896 x 896 and 128 x 896 ones
#: (0.8 M, 0.1 M) lose up to 30% there.
TRANSPOSED_MIN_WEIGHT = 1 << 21


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + b`` for ``x`` ``(..., K)``, ``w`` ``(N, K)``, ``b`` ``(N,)`` or None: ``(..., N)``.

    A float32 product on the CPU of at most ``blocks.F32_KERNEL_MAX_ROWS`` rows (decode and
    verification steps) runs through the C kernel :func:`meshinfer.engine.kernels.blocks.matmul_f32`
    where it is built: torch's one-row GEMV uses one thread and its few-row GEMM is slow on
    this project's AMD EPYC (MKL 2024); the kernel is 1.3-6x faster there.

    Without the kernel, a float32 product of 2 to :data:`TRANSPOSED_MAX_ROWS` rows by a weight
    of at least :data:`TRANSPOSED_MIN_WEIGHT` elements on the CPU runs as ``(w @ x.T).T``.
    torch's ``F.linear`` form (``x @ w.T``) takes a slow small-M GEMM path there: with MKL 2024
    on the 2-core EPYC, 2 threads (``python tests/benchmarks/small_m_gemm.py --threads 2``,
    docs/performance.md), a 4864 x 896 weight took 5.2 / 7.2 ms for 2 / 9 rows against 1.9 /
    2.6 ms transposed, and the 151,936 x 896 output head 168 / 253 ms against 58 / 80 ms.

    Either way the results differ from ``F.linear``'s by summation order only (within 1e-5
    relative). Every other device and dtype uses ``F.linear``.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    y = matmul_f32(x.reshape(rows, x.shape[-1]), w)  # None where the kernel does not apply
    if y is not None:
        y = y if b is None else y + b
        return y.reshape(*x.shape[:-1], w.shape[0])
    if (x.device.type != "cpu" or w.dtype != torch.float32 or not 2 <= rows <= TRANSPOSED_MAX_ROWS
            or w.numel() < TRANSPOSED_MIN_WEIGHT):
        return F.linear(x, w, b)
    x2 = x.reshape(rows, x.shape[-1])  # (M, K)
    y = (w @ x2.T).T.contiguous()  # (M, N)
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) computing through :func:`linear`.
    Quantized precisions replace it like any ``nn.Linear`` (``quant.quantize_modules``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., in_features)`` -> ``(..., out_features)``."""
        return linear(x, self.weight, self.bias)


class LayerCache(Protocol):
    """What attention needs from a KV cache (see ``meshinfer.engine.kv_cache.KVCache``)."""

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v`` ``(B, Hkv, T, D)`` for ``layer``; return all keys/values ``(B, Hkv, S, D)``."""
        ...


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32 as in HF transformers.

    ``(B, T, C) -> (B, T, C)``, same dtype as the input.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = step_ops.rms_norm(x, self.weight, self.eps)  # float32 on the CPU: one C call
        if y is not None:
            return y
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, overwrite_gate: bool = False) -> torch.Tensor:
    """SwiGLU's product (Shazeer 2020): ``silu(gate) * up``, ``(..., N)`` each -> ``(..., N)``.
    A float32 CPU step of a few rows runs as one C call (``step_ops.swiglu``).

    ``overwrite_gate``: the caller no longer needs ``gate`` (a projection's fresh output that
    does not overlap ``up``), so torch's path computes in place in it, the same values without
    two more ``(..., N)`` tensors: 20 MiB less at the peak of a 512-position prefill chunk of the
    default model (4,864 wide)."""
    y = step_ops.swiglu(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])) if gate.dim() else None
    if y is not None:
        return y.view(gate.shape)
    return F.silu(gate, inplace=True).mul_(up) if overwrite_gate else F.silu(gate) * up


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, *,
                 ext_factors: Sequence[float] = (), scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding tables for ``positions`` ``(T,)`` int64 -> cos, sin ``(T, D)`` in ``dtype``.

    Frequencies ``theta ** (-2i / D)`` as in RoFormer (Su et al. 2021) and HF's
    ``LlamaRotaryEmbedding``; the angle is computed in float32 whatever ``dtype`` is.
    ``head_dim`` is the rotated width (less than D under partial rotary). LongRoPE (Ding et al.
    2024; Phi-3): ``ext_factors`` ``(D/2,)`` divide the frequencies and ``scale`` multiplies
    cos and sin (HF ``_compute_longrope_parameters``).
    """
    wavelength = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                        device=positions.device).float() / head_dim)  # (D/2,)
    if ext_factors:
        wavelength = torch.tensor(ext_factors, dtype=torch.float32, device=positions.device) * wavelength
    inv_freq = 1.0 / wavelength  # (D/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    if scale != 1.0:
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_tables(cfg: ModelConfig, positions: torch.Tensor, seq_len: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(T, R)`` for ``positions`` ``(T,)`` of a sequence ``seq_len`` tokens long so far.

    ``R = cfg.rotary_dim``. Under LongRoPE the long factors apply once the sequence is longer
    than ``original_max_position_embeddings``, the short ones before, as HF decides per forward
    pass from its last position (``longrope_frequency_update``). With two RoPE bases
    (``cfg.rope_local_theta``, Gemma 3) the result is ``(2, T, R)``: index 0 for the full
    layers (``rope_theta``, divided by ``rope_linear_factor``), 1 for the sliding ones.
    """
    ext, scale = (), 1.0
    if cfg.rope_long_factor:
        long = seq_len > cfg.original_max_position_embeddings
        ext, scale = (cfg.rope_long_factor if long else cfg.rope_short_factor), cfg.rope_attention_factor
    if cfg.rope_linear_factor != 1.0:
        ext = (cfg.rope_linear_factor,) * (cfg.rotary_dim // 2)
    cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, dtype, ext_factors=ext, scale=scale)
    if not cfg.rope_local_theta:
        return cos, sin
    local_cos, local_sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_local_theta, dtype)
    return torch.stack((cos, local_cos)), torch.stack((sin, local_sin))  # (2, T, R) x 2


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: ``x`` ``(B, H, T, D)``, ``cos/sin`` ``(T, R)`` -> ``(B, H, T, D)``.

    With ``R < D`` (partial rotary) only the first ``R`` dims rotate; the rest pass through.
    float32 on the CPU, laid out as attention's projections leave q and k, goes through one C
    call (``step_ops.rope``) that gives the same bits as the torch operations below.
    """
    y = step_ops.rope(x, cos, sin)
    if y is not None:
        return y
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (B, H, T, D)
    return x * cos + rotated * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, *,
                     window: int = 0) -> torch.Tensor:
    """Grouped-query causal attention of new queries over all keys.

    Args:
        q: ``(B, H, T, D)`` queries for positions ``start .. start+T-1``.
        k, v: ``(B, Hkv, S, D)`` keys/values for positions ``0 .. S-1`` with ``S == start + T``.
        start: position of the first query.
        window: 0, or a sliding window: the query at ``i`` sees keys ``j > i - window``
            (HF ``sliding_window_overlay``; Phi-3, Mistral-style models).

    Returns:
        ``(B, H, T, D)``. float32 on the CPU with at most ``step_ops.ATTENTION_MAX_QUERIES``
        queries (decode and verification steps) runs in C, each query alone
        (``step_ops.attention``). Otherwise queries are processed :data:`ATTENTION_QUERY_CHUNK`
        rows at a time, so memory stays ``O(chunk * S)`` rather than ``O(T * S)``.
    """
    y = step_ops.attention(q, k, v, start, window=window)  # float32 CPU steps of a few positions
    if y is not None:
        return y
    T, S = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if T == 1:  # decode: the one query may see every cached key (the last `window` of them)
        if window and S > window:
            k, v = k[:, :, S - window:], v[:, :, S - window:]  # (B, Hkv, window, D)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    outs = []
    key_pos = torch.arange(S, device=q.device)  # (S,)
    for i in range(0, T, ATTENTION_QUERY_CHUNK):
        qc = q[:, :, i:i + ATTENTION_QUERY_CHUNK]  # (B, H, t, D)
        query_pos = start + i + torch.arange(qc.shape[2], device=q.device)  # (t,)
        mask = key_pos[None, :] <= query_pos[:, None]  # (t, S) True = may attend
        if window:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        outs.append(F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, enable_gqa=gqa))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
