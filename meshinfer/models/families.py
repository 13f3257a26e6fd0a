"""Which file builds the decoder layers of each architecture (``ModelConfig.architecture``).

=============  ===========================  ==========================================
architecture   file                         what differs
=============  ===========================  ==========================================
``llama``      ``models/llama.py``          the base: RMSNorm, GQA + RoPE, SwiGLU
``qwen2``      ``models/llama.py``          q/k/v bias
``qwen3``      ``models/qwen3.py``          per-head q/k RMSNorm, explicit head_dim
``qwen3moe``   ``models/moe.py``            Qwen3 attention, sparse MoE feed-forward
``mixtral``    ``models/moe.py``            Llama attention, sparse MoE feed-forward
``phi3``       ``models/phi3.py``           fused qkv and gate_up, LongRoPE, sliding window
=============  ===========================  ==========================================

``meshinfer.config.SUPPORTED_ARCHITECTURES`` lists the same names without importing torch.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..config import SUPPORTED_ARCHITECTURES, ModelConfig
from . import llama, moe, phi3, qwen3

#: architecture -> a function building one decoder layer from the config.
BLOCKS: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "llama": llama.Block,
    "qwen2": llama.Block,
    "qwen3": qwen3.make_block,
    "qwen3moe": moe.make_qwen3moe_block,
    "mixtral": moe.make_mixtral_block,
    "phi3": phi3.make_block,
}
assert set(BLOCKS) == set(SUPPORTED_ARCHITECTURES)


def make_block(cfg: ModelConfig) -> nn.Module:
    """One decoder layer of ``cfg``'s family.

    Raises:
        ValueError: an architecture outside :data:`BLOCKS`; the message lists the supported ones.
    """
    build = BLOCKS.get(cfg.architecture)
    if build is None:
        raise ValueError(f"architecture {cfg.architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return build(cfg)
