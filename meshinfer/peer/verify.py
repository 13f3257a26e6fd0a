"""A peer's side of catching lying peers: cheap checks on every hidden state a hop receives,
and the recomputation behind a verify request.

- **Cheap checks** (:func:`check_hidden`), run by every hop on the hidden states its previous
  hop sent: float32, shape ``(1, T, C)``, finite, and a per-position RMS inside
  [:data:`RMS_MIN`, :data:`RMS_MAX`]. A violation is a :class:`~meshinfer.core.errors.LyingPeer`
  naming the *sender*; the receiving hop reports it to the conversation's client.
- **Verify** (:func:`recompute`): a second peer serving the same layers recomputes a hop's
  output for the client's spot-check (:mod:`meshinfer.client.spotcheck`).

The numbers are documented in ``docs/security.md``.
"""

from __future__ import annotations

import logging

import torch

from meshinfer.core.config import LayerRange
from meshinfer.core.errors import LyingPeer

log = logging.getLogger(__name__)

#: Per-position RMS of hidden states a hop accepts from its previous hop. Measured at every
#: layer boundary over the shared reference prompts plus 32 generated tokens: the default
#: model spans 0.150..75.8, SmolLM2-135M 1.22..1046, the tests' tiny random models 0.98..3.9
#: (docs/security.md, "Cheap checks"). The band leaves a factor of 15 below the smallest and
#: about 100 above the largest: it flags zeros, wrong scales and blown-up values, not a
#: subtly wrong layer (that is the spot-check's job).
RMS_MIN, RMS_MAX = 1e-2, 1e5


def check_hidden(x: torch.Tensor, *, width: int, sender: str | None) -> None:
    """Cheap checks on hidden states ``x`` received from the previous hop ``sender``.

    Args:
        x: the decoded tensor, expected ``(1, T, C)`` float32 with ``C == width``.
        width: the model's hidden width C.
        sender: peer id of the hop that sent ``x`` (named in the error).

    Raises:
        LyingPeer: wrong dtype or shape, non-finite values, or a position whose RMS is outside
            [:data:`RMS_MIN`, :data:`RMS_MAX`]; ``suspect`` is ``sender``.
    """
    who = f"previous hop {(sender or '?')[:12]}"
    if x.dtype != torch.float32:
        raise LyingPeer(f"{who} sent hidden states of dtype {x.dtype}, not float32", suspect=sender)
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != width:
        raise LyingPeer(f"{who} sent hidden states of shape {tuple(x.shape)}, not (1, T, {width})",
                        suspect=sender)
    if not bool(torch.isfinite(x).all()):
        raise LyingPeer(f"{who} sent NaN or inf hidden states", suspect=sender)
    rms = x[0].pow(2).mean(-1).sqrt()  # (T,)
    lo, hi = float(rms.min()), float(rms.max())
    if lo < RMS_MIN or hi > RMS_MAX:
        bad = lo if lo < RMS_MIN else hi
        raise LyingPeer(f"{who} sent hidden states with RMS {bad:.3g}, outside the plausible band "
                        f"[{RMS_MIN:g}, {RMS_MAX:g}]", suspect=sender)


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


