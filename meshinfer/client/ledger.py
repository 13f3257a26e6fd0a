"""A conversation's position ledger: which token ids went to the route, how many of them every
hop is known to hold, and how many positions the hops may hold (:class:`PositionLedger`).

It is the only place these counters change; each change is named for what happened.
Invariant: ``confirmed <= len(cached)``.
"""

from __future__ import annotations

from typing import Sequence


class PositionLedger:
    """The positions of one conversation, from the client's side.

    Attributes:
        cached: token ids sent to the route, in order (read it; change it only through the
            methods below).
        confirmed: leading tokens of ``cached`` every hop is known to hold (a token came back
            after them).
        held: positions the hops may hold: more than ``len(cached)`` after rejected drafts,
            which the next step rolls back.
        seq_at: the ``seq`` of the last step that sent each position the hops may hold: the
            step whose signature a hop shows for what it received there (docs/security.md).
        issued: every step this client sent: seq -> (start, positions). A hop's signature of a
            step not in it is proof that the hop made that step up.
    """

    def __init__(self) -> None:
        self.cached: list[int] = []
        self.confirmed = 0
        self.held = 0
        self.seq_at: list[int] = []
        self.issued: dict[int, tuple[int, int]] = {}

    def send(self, tokens: Sequence[int]) -> None:
        """A step's ``tokens`` went to the route: append them to ``cached``."""
        self.cached.extend(tokens)

    def hold(self, seq: int, start: int, stop: int) -> None:
        """Step ``seq`` (or a replayed chunk) went out with positions ``[start, stop)``: the hops
        may hold positions ``[0, stop)``."""
        self.held = stop
        del self.seq_at[start:]
        self.seq_at += [seq] * (stop - start)
        self.issued[seq] = (start, stop - start)

    def rolls_back(self, start: int) -> bool:
        """Whether a step starting at ``start`` must tell the hops to drop positions from
        ``start`` on (rejected drafts of the step before)."""
        return start < self.held

    def confirm(self) -> None:
        """A token came back: every hop holds every cached token."""
        self.confirmed = len(self.cached)

    def drop_failed(self, start: int) -> None:
        """The step that started at ``start`` failed: its tokens leave ``cached``
        (``confirmed`` is untouched: it is at most ``start``)."""
        del self.cached[start:]

    def keep_accepted(self, stop: int) -> None:
        """A verification step kept the drafts before ``stop``: the rejected ones leave
        ``cached`` (the hops roll them back with the next step) and the rest is confirmed."""
        del self.cached[stop:]
        self.confirm()

    def roll_back(self, keep: int) -> None:
        """A lying hop was caught: keep the first ``keep`` tokens, all of them confirmed."""
        del self.cached[keep:]
        self.confirmed = keep

    def forget_after(self, length: int) -> None:
        """Keep the first ``length`` tokens (fewer confirmed if they were more); the hops'
        positions are left to a failover to set right."""
        del self.cached[length:]
        self.confirmed = min(self.confirmed, length)

    def truncate(self, length: int) -> None:
        """The hops were truncated to ``length`` positions: :meth:`forget_after` ``length``,
        and the hops hold exactly ``length``."""
        self.forget_after(length)
        self.held = length
        del self.seq_at[length:]
