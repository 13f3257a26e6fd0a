"""Sparse mixture-of-experts decoders: Qwen3-MoE, Mixtral and Qwen2-MoE.

Each layer's feed-forward is ``E`` SwiGLU experts and a linear router (Shazeer et al. 2017;
Jiang et al. 2024, "Mixtral of Experts"): a token goes to the ``k`` experts with the highest
router probability (softmax over all ``E`` logits, in float32), and its output is their sum
weighted by those probabilities, renormalised over the ``k`` when ``norm_topk_prob``
(Mixtral always; Qwen3-MoE per its config). Sources: HF ``modeling_qwen3_moe`` /
``modeling_mixtral`` (``TopKRouter``, ``Experts``), llama.cpp ``build_moe_ffn``.

Attention is Qwen3's (q/k norms) for ``qwen3moe``, Llama's for ``mixtral`` and Qwen2's (q/k/v bias)
for ``qwen2moe``, which adds a shared expert every token runs, scaled by a sigmoid gate. Module names
follow Qwen3-MoE's checkpoints (``mlp.gate.weight``, ``mlp.experts.3.up_proj.weight``); the
readers map Mixtral's (``block_sparse_moe``, ``w1/w2/w3``) and GGUF's merged expert tensors
onto them. Pure torch: nothing here logs, prints, awaits or touches files.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from meshinfer.core.config import ModelConfig
from meshinfer.engine.models.llama import MLP, Attention, Block
from meshinfer.engine.models.qwen3 import Qwen3Attention


class Router(nn.Module):
    """Top-k router: ``weight`` ``(E, C)``; computed in float32 whatever the compute dtype.

    Not an ``nn.Linear``, so a quantized precision never touches it: routing is a discrete
    choice, and a rounding error there swaps an expert rather than nudging a value.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(N, C)`` -> weights ``(N, k)`` float32 and expert ids ``(N, k)`` int64."""
        probs = F.linear(x.float(), self.weight.float()).softmax(dim=-1)  # (N, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's gate on the shared expert: ``sigmoid(x @ weight.T)``, ``weight`` ``(1, C)``;
    like the router, not an ``nn.Linear``, so quantization leaves this one row alone."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, cfg.hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(N, C)`` -> ``(N, 1)`` in ``x``'s dtype."""
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoE(nn.Module):
    """``E`` SwiGLU experts of width ``moe_intermediate_size`` behind a :class:`Router`.

    Tokens are grouped by expert: each expert that any token chose runs once over all the
    rows that chose it, so a batched pass (several sequences packed along T) reads each
    chosen expert's weights once for the whole batch. Each row's result depends only on that
    row, so a batched pass equals unbatched ones up to BLAS rounding.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        if cfg.shared_expert_intermediate_size:  # Qwen2-MoE
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = SharedExpertGate(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(B, T, C)`` -> ``(B, T, C)`` in ``x``'s dtype."""
        y = self.routed(x)  # (B, T, C)
        if hasattr(self, "shared_expert"):
            flat = x.reshape(-1, x.shape[-1])  # (N, C)
            shared = self.shared_expert_gate(flat) * self.shared_expert(flat)  # (N, C)
            y = y + shared.view(x.shape)
        return y

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' part: ``x`` ``(B, T, C)`` -> ``(B, T, C)``."""
        flat = x.reshape(-1, x.shape[-1])  # (N, C)
        weights, experts = self.gate(flat)  # (N, k) float32, (N, k) int64
        if flat.shape[0] == 1:  # one decode token: no grouping to do, k experts in a row
            w = weights[0].to(flat.dtype).tolist()
            ys = [self.experts[e](flat) * w[j] for j, e in enumerate(experts[0].tolist())]  # k x (1, C)
            return torch.stack(ys, dim=1).sum(dim=1).view(x.shape)  # (B, T, C), as the grouped sum below
        picked = flat.new_empty(*experts.shape, flat.shape[-1])  # (N, k, C): each row's k expert outputs
        for e in torch.unique(experts).tolist():
            rows, slot = torch.where(experts == e)  # (n_e,), (n_e,): a row picks an expert at most once
            y = self.experts[e](flat[rows])  # (n_e, C)
            picked[rows, slot] = y * weights[rows, slot, None].to(y.dtype)
        # A plain store and a sum over k, not index_add_: on torch 2.13's CPU kernels index_add_
        # of one (1, C) row took ~10 ms, longer than the whole layer.
        return picked.sum(dim=1).view(x.shape)  # (B, T, C)


def make_qwen3moe_block(cfg: ModelConfig) -> nn.Module:
    """One Qwen3-MoE decoder layer (HF ``Qwen3MoeDecoderLayer``, every layer sparse)."""
    return Block(cfg, attention=Qwen3Attention, mlp=SparseMoE)


def make_qwen2moe_block(cfg: ModelConfig) -> nn.Module:
    """One Qwen2-MoE decoder layer (HF ``Qwen2MoeDecoderLayer``, every layer sparse): Qwen2
    attention (q/k/v bias), routed experts plus the gated shared expert."""
    return Block(cfg, attention=Attention, mlp=SparseMoE)


def make_mixtral_block(cfg: ModelConfig) -> nn.Module:
    """One Mixtral decoder layer (HF ``MixtralDecoderLayer``)."""
    return Block(cfg, attention=Attention, mlp=SparseMoE)
