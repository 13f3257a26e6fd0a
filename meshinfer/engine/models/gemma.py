"""Gemma 2 and Gemma 3 (text) decoders (Gemma Team 2024, "Gemma 2: Improving Open Language
Models at a Practical Size"; 2025, "Gemma 3 Technical Report"; HF ``modeling_gemma2``,
``modeling_gemma3``), on the Llama attention and ``Shard``:

- RMSNorm with a ``(1 + w)`` scale, applied in float32; the checkpoints store ``w``, llama.cpp's
  GGUF stores ``1 + w``, and so does this module (the safetensors reader adds the 1).
- Norms on both sides of each sublayer: ``h = x + post_attn(attn(norm(x)))``, then
  ``h + post_ffw(mlp(pre_ffw(h)))``.
- GeLU (tanh approximation) in the gated MLP.
- Attention scores scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped
  (``cap * tanh(s / cap)``) before the mask; sliding-window and full layers alternate
  (``ModelConfig.layer_types``).
- Embeddings times ``sqrt(C)`` and final logits soft-capped: in ``Shard`` (``embed_scale``,
  ``final_logit_softcapping``).
- Gemma 3: no soft-caps, ``(1 + w)`` RMSNorm on each query and key head, five sliding layers to
  one full, and two RoPE bases (sliding: ``rope_local_theta``; full: ``rope_theta`` with linear
  scaling), so ``Shard`` passes ``(2, T, R)`` tables and each layer takes its own.

Pure torch: nothing here logs, prints, awaits or touches files.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.core.config import ModelConfig
from meshinfer.engine.models.common import ATTENTION_QUERY_CHUNK, Linear, RMSNorm
from meshinfer.engine.models.llama import Attention


class GemmaRMSNorm(RMSNorm):
    """RMSNorm whose ``weight`` holds ``1 + w`` and multiplies in float32 (HF ``Gemma2RMSNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, *,
                         scale: float, cap: float, window: int) -> torch.Tensor:
    """Causal GQA attention with soft-capped scores, as HF's eager Gemma 2 attention.

    q ``(B, H, T, D)``, k/v ``(B, Hkv, S, D)``, ``S == start + T`` -> ``(B, H, T, D)``; scores
    ``cap * tanh(q.k * scale / cap)`` (no cap when 0), keys ``j <= i`` and, with a window,
    ``j > i - window``; softmax in float32. Query rows go :data:`ATTENTION_QUERY_CHUNK` at a time.
    """
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, D)
    key_pos = torch.arange(k.shape[2], device=q.device)  # (S,)
    outs = []
    for i in range(0, q.shape[2], ATTENTION_QUERY_CHUNK):
        qc = q[:, :, i:i + ATTENTION_QUERY_CHUNK]  # (B, H, t, D)
        scores = torch.matmul(qc, k.transpose(2, 3)) * scale  # (B, H, t, S)
        if cap:
            scores = torch.tanh(scores / cap) * cap
        query_pos = start + i + torch.arange(qc.shape[2], device=q.device)  # (t,)
        allowed = key_pos[None, :] <= query_pos[:, None]  # (t, S)
        if window:
            allowed &= key_pos[None, :] > query_pos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), v))  # (B, H, t, D)
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


class GemmaAttention(Attention):
    """Llama attention with Gemma's score scale, soft-cap and this layer's window; Gemma 3 adds
    ``(1 + w)`` RMSNorms on query and key heads and its layer kind's RoPE table."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg)
        self.window = cfg.window(layer)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.cap = cfg.attn_logit_softcapping
        sliding = bool(cfg.layer_types) and cfg.layer_types[layer] == "sliding_attention"
        self.rope_index = 1 if sliding else 0  # of a (2, T, R) table: full, sliding
        if cfg.architecture == "gemma3":
            self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)  # (B, H, T, D), (B, Hkv, T, D) x 2
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's ``(T, R)`` tables from ``(T, R)`` or, with two bases, ``(2, T, R)``."""
        return (cos[self.rope_index], sin[self.rope_index]) if cos.dim() == 3 else (cos, sin)

    def forward(self, x, cos, sin, start, cache, layer):  # (B, T, C) -> (B, T, C), see Attention
        return super().forward(x, *self._rope(cos, sin), start, cache, layer)

    def forward_ragged(self, x, cos, sin, segments, layer):  # (1, N, C) -> (1, N, C), see Attention
        return super().forward_ragged(x, *self._rope(cos, sin), segments, layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        return softcapped_attention(q, k, v, start, scale=self.scale, cap=self.cap, window=self.window)


class GemmaMLP(nn.Module):
    """Gated feed-forward with tanh-approximated GeLU: ``down(gelu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))  # (B, T, C)


class GemmaBlock(nn.Module):
    """One Gemma 2 layer: norms before and after attention and before and after the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        C, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(C, eps)
        self.self_attn = GemmaAttention(cfg, layer)
        self.post_attention_layernorm = GemmaRMSNorm(C, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(C, eps)
        self.mlp = GemmaMLP(cfg)
        self.post_feedforward_layernorm = GemmaRMSNorm(C, eps)

    def forward(self, x, cos, sin, start, cache, layer):  # (B, T, C) -> (B, T, C)
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, start, cache, layer))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def forward_ragged(self, x, cos, sin, segments, layer):  # (1, N, C) -> (1, N, C), see llama.Attention
        a = self.self_attn.forward_ragged(self.input_layernorm(x), cos, sin, segments, layer)
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def make_block(cfg: ModelConfig, layer: int) -> nn.Module:
    """Decoder layer ``layer`` of a Gemma 2 or 3 model (HF ``Gemma2DecoderLayer``,
    ``Gemma3DecoderLayer``)."""
    return GemmaBlock(cfg, layer)
