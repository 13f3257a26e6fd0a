"""Which file builds the decoder layers of each architecture (``ModelConfig.architecture``).

=============  ===========================  ==========================================
architecture   file                         what differs
=============  ===========================  ==========================================
``llama``      ``models/llama.py``          the base: RMSNorm, GQA + RoPE, SwiGLU
``qwen2``      ``models/llama.py``          q/k/v bias
``qwen3``      ``models/qwen3.py``          per-head q/k RMSNorm, explicit head_dim
``qwen3moe``   ``models/moe.py``            Qwen3 attention, sparse MoE feed-forward
``qwen2moe``   ``models/moe.py``            Qwen2 attention, sparse MoE + gated shared expert
``mixtral``    ``models/moe.py``            Llama attention, sparse MoE feed-forward
``phi3``       ``models/phi3.py``           fused qkv and gate_up, LongRoPE, sliding window
``gemma2``     ``models/gemma.py``          (1 + w) norms around both sublayers, soft-caps,
                                            sqrt(C) embedding scale, GeLU, sliding layers
``gemma3``     ``models/gemma.py``          Gemma 2 without caps, q/k norms, 5:1 sliding,
                                            a RoPE base per layer kind
=============  ===========================  ==========================================

``meshinfer.core.config.SUPPORTED_ARCHITECTURES`` lists the same names without importing torch.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from meshinfer.core.config import SUPPORTED_ARCHITECTURES, ModelConfig
from meshinfer.engine.models import gemma, llama, moe, phi3, qwen3
from meshinfer.engine.models.common import RMSNorm

#: architecture -> a function building one decoder layer from the config (most families build
#: every layer alike; Gemma's differ by layer index: sliding or full attention).
BLOCKS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {
    "llama": lambda cfg, layer: llama.Block(cfg),
    "qwen2": lambda cfg, layer: llama.Block(cfg),
    "qwen3": lambda cfg, layer: qwen3.make_block(cfg),
    "qwen3moe": lambda cfg, layer: moe.make_qwen3moe_block(cfg),
    "qwen2moe": lambda cfg, layer: moe.make_qwen2moe_block(cfg),
    "mixtral": lambda cfg, layer: moe.make_mixtral_block(cfg),
    "phi3": lambda cfg, layer: phi3.make_block(cfg),
    "gemma2": gemma.make_block,
    "gemma3": gemma.make_block,
}
assert set(BLOCKS) == set(SUPPORTED_ARCHITECTURES)


def make_block(cfg: ModelConfig, layer: int) -> nn.Module:
    """Decoder layer ``layer`` of ``cfg``'s family.

    Raises:
        ValueError: an architecture outside :data:`BLOCKS`; the message lists the supported ones.
    """
    build = BLOCKS.get(cfg.architecture)
    if build is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return build(cfg, layer)


def make_final_norm(cfg: ModelConfig) -> nn.Module:
    """The norm before the output projection: Gemma's ``(1 + w)`` RMSNorm, else the common one."""
    cls = gemma.GemmaRMSNorm if cfg.architecture in ("gemma2", "gemma3") else RMSNorm
    return cls(cfg.hidden_size, cfg.rms_norm_eps)

