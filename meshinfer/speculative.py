"""Exact speculative decoding with prompt-lookup drafting: the pure parts (no I/O, no torch).

Prompt lookup (Saxena 2023, "prompt lookup decoding"; the n-gram variant of Leviathan et al.
2023, "Fast inference from transformers via speculative decoding") needs no draft model: the
last ``n`` tokens of the conversation are looked up earlier in the conversation (prompt and
generated tokens), and the tokens that followed that earlier occurrence are proposed as the
continuation. Editing code ("reproduce this function with one change") repeats long spans of
the prompt, so most drafts are right.

The client sends ``[last token] + drafts`` as one step; the last hop returns the argmax at every
position (``want="tokens"``). :func:`accept` keeps the longest prefix of drafts that equals those
argmaxes plus the one argmax after it, so greedy output is exactly what plain decoding gives
(up to the float rounding of a T > 1 matmul, see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

#: Longest n-gram looked up; shorter ones (down to :data:`MIN_NGRAM`) are tried when it has no match.
MAX_NGRAM = 3
#: Shortest n-gram looked up. A 1-gram matches often and wrongly, but a rejected draft costs only
#: the extra positions of one step (tens of ms on a CPU), not a round trip.
MIN_NGRAM = 1
#: Default most drafts per step (``--draft-tokens``). A step of 1 + 8 tokens costs about 1.5x a
#: one-token step on a CPU peer for the default model, and accepted runs on code edits are long.
DEFAULT_DRAFT_TOKENS = 8
#: Most drafts one step may carry: a peer computes the output head at every position of a
#: verification step (T x V float32 logits, 9.7 MB for T = 16 and V = 151,936).
MAX_DRAFT_TOKENS = 31
#: How far back the lookup searches, tokens: bounds the per-step cost on long conversations.
LOOKUP_WINDOW = 4096


def propose(history: Sequence[int], k: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM,
            window: int = LOOKUP_WINDOW) -> list[int]:
    """Draft up to ``k`` tokens that follow ``history`` by prompt lookup.

    For n from ``max_ngram`` down to ``min_ngram``, the last n tokens of ``history`` are searched
    for in the last ``window`` tokens (most recent occurrence first, the suffix itself excluded);
    the first occurrence found proposes the (at most ``k``) tokens that followed it.

    Args:
        history: token ids of the conversation so far (prompt + generated), oldest first.
        k: most tokens to propose; 0 or less proposes nothing.

    Returns:
        The drafts, possibly empty (no n-gram recurs).
    """
    if k <= 0:
        return []
    hist = list(history[-window:])
    L = len(hist)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = hist[L - n:]
        for i in range(L - n - 1, -1, -1):  # occurrence hist[i:i+n]; something must follow it
            if hist[i:i + n] == suffix:
                return hist[i + n:i + n + k]
    return []


def accept(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens plain greedy decoding would produce, given one verification step.

    Args:
        drafts: the ``k`` drafted tokens d0..d(k-1) sent after the last chosen token.
        argmax: the last hop's argmax at each of the ``k + 1`` positions of the step: ``argmax[i]``
            is the greedy choice after the last token and ``drafts[:i]``.

    Returns:
        ``argmax[:m + 1]`` where ``m`` is the length of the longest prefix of ``drafts`` equal to
        ``argmax``: the accepted drafts, then the corrected (or bonus) token. 1 to k + 1 tokens.

    Raises:
        ValueError: ``argmax`` does not have ``len(drafts) + 1`` entries.
    """
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"a step with {len(drafts)} drafts needs {len(drafts) + 1} argmaxes, got {len(argmax)}")
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return list(argmax[:m + 1])


def next_draft_length(k: int, accepted: int, proposed: int, *, limit: int) -> int:
    """Adapt the draft length: double it after a fully accepted draft, else shrink to what was accepted + 1.

    A long draft that is mostly rejected costs compute on every hop for nothing; a fully
    accepted one suggests the span repeats further. The result is in ``[1, limit]``.
    """
    if proposed and accepted == proposed:
        return max(1, min(limit, 2 * max(k, 1)))
    return max(1, min(limit, accepted + 1))


@dataclass
class SpecStats:
    """Speculation counters of one generation (``speculative`` in ``chat --json``).

    Attributes:
        proposed: drafted tokens sent for verification.
        accepted: drafted tokens that equalled the greedy choice.
        steps: verification steps (decode steps that carried at least one draft).
        draft_tokens: the most drafts a step could carry (``--draft-tokens``).
    """

    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    def to_dict(self) -> dict:
        return asdict(self) | {"acceptance": round(self.accepted / self.proposed, 3) if self.proposed else 0.0}
