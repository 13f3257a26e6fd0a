"""Cheap checks of hidden states a hop receives from its previous hop, shared by the hop that
receives them and by the client that weighs the hop's accusation (docs/security.md, "Cheap
checks"): float32, shape ``(1, T, C)``, finite, and a per-position RMS inside
[:data:`RMS_MIN`, :data:`RMS_MAX`]. A violation is a :class:`~meshinfer.core.errors.LyingPeer`
naming the *sender*.
"""

from __future__ import annotations

import torch

from meshinfer.core.errors import LyingPeer

#: Per-position RMS of hidden states a hop accepts from its previous hop. Measured at every
#: layer boundary over the shared reference prompts plus 32 generated tokens: the default
#: model spans 0.150..75.8, SmolLM2-135M 1.22..1046, the tests' tiny random models 0.98..3.9
#: (docs/security.md, "Cheap checks"). The band leaves a factor of 15 below the smallest and
#: about 100 above the largest: it flags zeros, wrong scales and blown-up values, not a
#: subtly wrong layer (that is the spot-check's job).
RMS_MIN, RMS_MAX = 1e-2, 1e5


def check_hidden(x: torch.Tensor, *, width: int, sender: str | None) -> None:
    """Cheap checks on hidden states ``x`` received from the previous hop ``sender``:
    :func:`check_shape`, then :func:`check_values`.

    Raises:
        LyingPeer: either check failed; ``suspect`` is ``sender``.
    """
    check_shape(x, width=width, sender=sender)
    check_values(x, sender=sender)


def check_shape(x: torch.Tensor, *, width: int, sender: str | None) -> None:
    """``x`` must be ``(1, T, width)`` float32.

    Raises:
        LyingPeer: another dtype or shape; ``suspect`` is ``sender``.
    """
    who = f"previous hop {(sender or '?')[:12]}"
    if x.dtype != torch.float32:
        raise LyingPeer(f"{who} sent hidden states of dtype {x.dtype}, not float32", suspect=sender)
    if x.dim() != 3 or x.shape[0] != 1 or x.shape[2] != width:
        raise LyingPeer(f"{who} sent hidden states of shape {tuple(x.shape)}, not (1, T, {width})",
                        suspect=sender)


def check_values(x: torch.Tensor, *, sender: str | None) -> None:
    """``x`` ``(1, T, C)`` float32 must be finite, with every position's RMS inside
    [:data:`RMS_MIN`, :data:`RMS_MAX`]: the part of the checks that needs no model width, which
    the client can repeat on the evidence a hop shows (``Steps.accept_from_previous_hop``).

    Raises:
        LyingPeer: non-finite values, or a position's RMS outside the band; ``suspect`` is ``sender``.
    """
    who = f"previous hop {(sender or '?')[:12]}"
    if not bool(torch.isfinite(x).all()):
        raise LyingPeer(f"{who} sent NaN or inf hidden states", suspect=sender)
    rms = x[0].pow(2).mean(-1).sqrt()  # (T,)
    lo, hi = float(rms.min()), float(rms.max())
    if lo < RMS_MIN or hi > RMS_MAX:
        bad = lo if lo < RMS_MIN else hi
        raise LyingPeer(f"{who} sent hidden states with RMS {bad:.3g}, outside the plausible band "
                        f"[{RMS_MIN:g}, {RMS_MAX:g}]", suspect=sender)
