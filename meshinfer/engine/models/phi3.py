"""Phi-3 decoder (Abdin et al. 2024, "Phi-3 Technical Report"): the Llama block with fused
projections, LongRoPE and a sliding window.

- ``self_attn.qkv_proj`` ``(H*D + 2*Hkv*D, C)`` holds q, k, v stacked; ``mlp.gate_up_proj``
  ``(2F, C)`` holds gate then up (HF ``Phi3Attention``, ``Phi3MLP``; llama.cpp ``attn_qkv``
  and a fused ``ffn_up``).
- LongRoPE (128k variants) and partial rotary live in ``common.rope_tables``; the sliding
  window (``sliding_window``, 2047 in Phi-3-mini) in ``common.causal_attention``.

Pure torch: nothing here logs, prints, awaits or touches files.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.core.config import ModelConfig
from meshinfer.engine.models.common import Linear
from meshinfer.engine.models.llama import Attention, Block


class Phi3Attention(Attention):
    """Grouped-query attention whose q, k, v come from one fused projection ``qkv_proj``."""

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)  # not Attention's: no separate q/k/v projections
        C, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = H, Hkv, D, cfg.sliding_window
        self.qkv_proj = Linear(C, (H + 2 * Hkv) * D, bias=False)
        self.o_proj = Linear(H * D, C, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(B, T, C)`` -> q ``(B, H, T, D)``, k and v ``(B, Hkv, T, D)``, before RoPE."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split((H * D, Hkv * D, Hkv * D), dim=-1)  # (B, T, H*D), (B, T, Hkv*D) x 2
        return (q.reshape(B, T, H, D).transpose(1, 2), k.reshape(B, T, Hkv, D).transpose(1, 2),
                v.reshape(B, T, Hkv, D).transpose(1, 2))


class Phi3MLP(nn.Module):
    """SwiGLU with gate and up fused: ``down(silu(gate) * up)``, ``gate, up = gate_up(x).chunk(2)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, F) x 2
        return self.down_proj(up * F.silu(gate))  # (B, T, C)


def make_block(cfg: ModelConfig) -> nn.Module:
    """One Phi-3 decoder layer (HF ``Phi3DecoderLayer``; its dropouts are identities at inference)."""
    return Block(cfg, attention=Phi3Attention, mlp=Phi3MLP)
