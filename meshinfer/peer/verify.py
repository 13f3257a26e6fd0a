"""A peer's side of catching lying peers: cheap checks on every hidden state a hop receives,
and the recomputation behind a verify request.

- **Cheap checks** (:func:`meshinfer.wire.plausible.check_hidden`), run by every hop on the
  hidden states its previous hop sent: float32, shape ``(1, T, C)``, finite, and a per-position
  RMS inside [``RMS_MIN``, ``RMS_MAX``]. A violation is a :class:`~meshinfer.core.errors.LyingPeer`
  naming the *sender*; the receiving hop reports it to the conversation's client.
- **Verify** (:func:`recompute`): a second peer serving the same layers recomputes a hop's
  output for the client's spot-check (:mod:`meshinfer.client.spotcheck`).

The numbers are documented in ``docs/security.md``.
"""

from __future__ import annotations

import logging

import torch

from meshinfer.core.config import LayerRange

log = logging.getLogger(__name__)

def recompute(shard, x: torch.Tensor, run: LayerRange, check_from: int):
    """On the device thread: run layers ``run`` over a whole prefix in a throwaway cache (a verify).

    Positions before ``check_from`` are run first and only fill the cache, so last-layer
    logits exist for the checked positions only.

    Args:
        shard: the peer's :class:`~meshinfer.engine.models.llama.Shard`.
        x: token ids ``(1, P)`` int64 when ``run.start == 0``, else hidden states ``(1, P, C)``.
        run: the layers to apply, within the shard.
        check_from: first position to return, ``0 <= check_from < P``.

    Returns:
        Hidden states ``(1, P - check_from, C)`` float32 on the CPU, or, when ``run`` ends at
        the last layer, the argmax token id of each position ``check_from .. P-1``.
    """
    from meshinfer.engine.kv_cache import KVCache

    cfg = shard.cfg
    cache = KVCache(run, cfg.num_key_value_heads, cfg.head_dim, dtype=shard.dtype, device=shard.device,
                    max_tokens=x.shape[1])
    try:
        if check_from:
            shard(x[:, :check_from], 0, cache, run=run, logits="last")
        out = shard(x[:, check_from:], check_from, cache, run=run, logits="all")  # (1, P-c, C|V)
    finally:
        cache.free()
    if run.stop == cfg.num_hidden_layers:
        return [int(t) for t in out[0].argmax(-1)]
    return out.float().cpu()


