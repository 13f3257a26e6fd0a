"""Choosing the next token from the last hop's logits: greedy (argmax) or seeded sampling.

Pure torch, no I/O. The last hop of a route calls :func:`pick_token` on each step that wants
a token. Greedy stays the default (``params`` None or ``temperature`` 0): the same
``argmax`` as before sampling existed, bit for bit.

Sampling draws from a ``torch.Generator`` seeded from ``(seed, position)`` only, so a step
replayed after a failover, or computed by another peer holding the same weights, picks the
same token; and one request's seed gives the same text on every run.
"""

from __future__ import annotations

import torch

from meshinfer.core.sampling_params import SamplingParams
from meshinfer.engine.kernels.step_ops import argmax

#: Odd 64-bit constant (2**64 / golden ratio) that spreads positions across the seed space.
_GOLDEN = 0x9E3779B97F4A7C15


def step_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator seeded from ``(seed, position)``: ``(seed * 0x9E37...15 + position) mod 2**64``."""
    return torch.Generator().manual_seed((seed * _GOLDEN + position) % (1 << 64))


def pick_token(logits: torch.Tensor, params: SamplingParams | None, *, position: int) -> int:
    """The token id chosen from one position's logits.

    Args:
        logits: (V,) logits of the last position, any float dtype, any device.
        params: None or greedy: ``argmax`` (ties: the lowest id, as ``torch.argmax``;
            :func:`meshinfer.engine.kernels.step_ops.argmax`).
        position: the position the chosen token will take in the conversation (prompt
            length + tokens generated so far); with ``params.seed`` it seeds the draw.

    Sampling: ``p = softmax(logits / temperature)`` in float32 on the CPU; the tokens sorted by
    ``p`` (descending, ties by id) are cut after the first whose cumulative probability reaches
    ``top_p``; one uniform draw ``u`` in [0, 1) from :func:`step_generator` picks the first
    kept token whose cumulative probability exceeds ``u`` times the kept total (inverse CDF).
    """
    if params is None or params.greedy:
        return argmax(logits.reshape(-1))
    scaled = logits.detach().float().cpu() / params.temperature
    if not bool(torch.isfinite(scaled).all()):  # a tiny temperature overflows float32: its limit is the argmax
        return argmax(logits.reshape(-1))
    probs = torch.softmax(scaled, dim=-1)  # (V,)
    order = torch.sort(probs, descending=True, stable=True)
    cdf = torch.cumsum(order.values, dim=0)  # (V,)
    keep = int(torch.searchsorted(cdf, torch.tensor([params.top_p]), right=False)) + 1
    keep = min(keep, cdf.numel())
    u = float(torch.rand((), generator=step_generator(params.seed, position)))
    target = torch.tensor([u * float(cdf[keep - 1])])
    index = min(int(torch.searchsorted(cdf[:keep], target, right=True)), keep - 1)
    return int(order.indices[index])
