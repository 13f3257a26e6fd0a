"""Lying shards: a peer whose forward pass is replaced (tests/test_lying.py, tests/test_draft.py)."""

from __future__ import annotations

import torch

class LyingShard:
    """A shard whose forward pass is replaced by ``lie(shard, x, start, cache, run, logits)``:
    a peer with wrong weights or a missing layer (it logs what it sends, as such a peer would)."""

    def __init__(self, shard, lie) -> None:
        self._shard, self._lie = shard, lie

    def __getattr__(self, name):
        return getattr(self._shard, name)

    def __call__(self, x, start, cache=None, *, run=None, logits="last", abandoned=None):
        return self._lie(self._shard, x, start, cache, run or self._shard.range, logits)


def noise(relative: float, *, from_position: int = 0):
    """Add ``relative`` x the per-position RMS of Gaussian noise at positions >= ``from_position``."""
    def lie(shard, x, start, cache, run, logits):
        out = shard(x, start, cache, run=run, logits=logits)
        g = torch.Generator().manual_seed(start)
        rms = out.pow(2).mean(-1, keepdim=True).sqrt()  # (1, T, 1)
        bad = out + relative * rms * torch.randn(out.shape, generator=g)
        keep = torch.arange(start, start + out.shape[1]).view(1, -1, 1) < from_position
        return torch.where(keep, out, bad)
    return lie
