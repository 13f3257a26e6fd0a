"""Qwen3 dense decoder: the Llama-style block with an RMSNorm on each query and key head.

Differences from Qwen2 (Qwen team 2025, "Qwen3 Technical Report", and HF ``modeling_qwen3``):
no q/k/v bias, ``head_dim`` set apart from ``hidden_size / num_attention_heads``, and
``q_norm`` / ``k_norm`` (RMSNorm over D, weights ``(D,)``) applied per head before RoPE.
Qwen3-MoE (``moe.py``) uses the same attention. Pure torch: nothing here logs, prints,
awaits or touches files.
"""

from __future__ import annotations

import torch
from torch import nn

from meshinfer.core.config import ModelConfig
from meshinfer.engine.models.common import RMSNorm
from meshinfer.engine.models.llama import Attention, Block


class Qwen3Attention(Attention):
    """Grouped-query attention with per-head q/k RMSNorm (``q_norm``, ``k_norm``: ``(D,)``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(B, T, C)`` -> normed q ``(B, H, T, D)``, normed k and v ``(B, Hkv, T, D)``."""
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v  # RMSNorm over D, the last dim


def make_block(cfg: ModelConfig) -> nn.Module:
    """One Qwen3 dense decoder layer (HF ``Qwen3DecoderLayer``)."""
    return Block(cfg, attention=Qwen3Attention)
