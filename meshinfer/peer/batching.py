"""The batching policy of a peer's step scheduler: which queued steps share the next forward
pass, and how long that pass waits for conversations that are coming. Pure: no torch, no
asyncio, no clock of its own; :class:`~meshinfer.peer.scheduler.StepScheduler` runs the passes
and asks :meth:`BatchPolicy.schedule` before each one.

Taking a pass (:meth:`BatchPolicy.take`):

- the oldest pending step runs in the next pass, except that right after a prefill pass the
  oldest small step goes first: decode steps wait for at most one prefill however many are
  queued, and prefills keep their order with at most one batch of decode steps between two
  (no starvation);
- steps of at most :data:`BATCH_STEP_TOKENS` tokens that run the same layers join that
  one, up to ``max_batch`` conversations (plain decode and speculative verification steps
  mix: each gets the logits it needs);
- a longer step (prefill) runs alone.

Holding a pass (:meth:`BatchPolicy.schedule`): the conversations of a pass come back together
(their clients answer each token with the next step within about one round trip), but their
steps arrive one by one. A pass that started on the first arrival would carry only it, and the
rest would wait a whole pass for the next one: the conversations drift into small batches.
So while a conversation whose last step succeeded ("coming") has not sent its next step, a
decode pass waits for it, at most :data:`HOLD_FRACTION` of a recent pass's time
(:meth:`BatchPolicy.ran`) and at most ``max_hold_s`` after its first step arrived. A
conversation that misses the wait is no longer counted as coming until its next step arrives
(one that ended costs one wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

#: Steps of at most this many tokens may share a pass (decode is 1; short speculative
#: verification steps fit too). Longer steps are prefill chunks and run alone: their
#: matmuls already read each weight once for many rows.
BATCH_STEP_TOKENS = 8
#: Default most conversations in one batched pass (``PeerSettings.max_batch``).
DEFAULT_MAX_BATCH = 32
#: A decode pass waits for coming conversations at most this fraction of the recent decode
#: pass time: a wait that gains nothing costs at most half a pass, one that fills the batch
#: saves a whole pass for the late steps.
HOLD_FRACTION = 0.5
#: Default cap on that wait, seconds (``PeerSettings.max_hold_s``): on loopback the steps of a
#: batch arrive within a few ms of each other, across the Internet within the clients' jitter.
DEFAULT_MAX_HOLD_S = 0.05
#: Weight of the newest decode pass in the running mean of pass time that sizes the wait.
PASS_TIME_EWMA = 0.2


@dataclass(frozen=True)
class Step:
    """What the policy knows of one queued step.

    Attributes:
        conv: its conversation's identity (any hashable; the scheduler uses ``id(conv)``).
        layers: the layers it runs, ``(start, stop)`` half-open: steps share a pass only when
            they run the same layers.
        tokens: its new tokens (1 for decode, a few for speculative verification, more for a
            prefill chunk).
        queued_at: when it arrived, seconds on the clock of ``now`` in :meth:`BatchPolicy.schedule`
            (``time.perf_counter``); only holding reads it (:meth:`BatchPolicy.take` does not).
    """

    conv: Hashable
    layers: tuple[int, int]
    tokens: int
    queued_at: float = 0.0


@dataclass(frozen=True)
class Decision:
    """What the scheduler does next (:meth:`BatchPolicy.schedule`).

    Attributes:
        run: indexes into the queue of the steps of the next pass, its head first, then in
            queue order; empty while holding or when the queue is empty.
        hold_s: above 0: run nothing yet; wait at most this many seconds for coming
            conversations (less when a step arrives or a conversation ends), then ask again.
        give_up: coming conversations that missed the wait: stop counting them as coming.
    """

    run: tuple[int, ...] = ()
    hold_s: float = 0.0
    give_up: tuple = ()


class BatchPolicy:
    """Group queued steps into passes; hold a decode pass for coming conversations.

    Holds two facts of the past: whether the last pass taken ran a prefill step
    (``after_prefill``: a small step goes next) and the running mean of decode pass time
    (``pass_s``, seconds, fed by :meth:`ran`; it sizes the wait).

    Args:
        max_batch: most conversations per pass; 1 turns batching off.
        max_hold_s: the most a decode pass waits for coming conversations, seconds; 0 never waits.

    Raises:
        ValueError: ``max_batch`` below 1 or ``max_hold_s`` negative.
    """

    def __init__(self, *, max_batch: int = DEFAULT_MAX_BATCH, max_hold_s: float = DEFAULT_MAX_HOLD_S) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if not max_hold_s >= 0:
            raise ValueError(f"max_hold_s must be 0 or more seconds, got {max_hold_s}")
        self.max_batch, self.max_hold_s = max_batch, max_hold_s
        self.after_prefill = False  # the last pass taken ran a prefill step: a small step goes next
        self.pass_s = 0.0  # running mean of decode pass time (PASS_TIME_EWMA), seconds

    def schedule(self, queue: Sequence[Step], coming: Mapping[Hashable, tuple[int, int]], now: float) -> Decision:
        """The next pass, or how long to hold it.

        Args:
            queue: the pending steps, oldest first (steps withdrawn by cancellation left out).
            coming: conversation -> its layers, for each conversation whose last step succeeded
                and whose next step has not arrived, in the order they became coming.
            now: the current time, seconds, on the clock of the steps' ``queued_at``.

        Returns:
            a hold (``hold_s`` above 0) while conversations that would join the next decode pass
            are coming, until :meth:`hold_limit_s` after its head step (:meth:`head`) arrived;
            else the pass (:meth:`take`, which updates ``after_prefill``), with the coming
            conversations it gave up on. An empty queue gives an empty ``run``.
        """
        missing = self.missing(queue, coming)
        if missing:
            remaining = queue[self.head(queue)].queued_at + self.hold_limit_s() - now
            if remaining > 0:
                return Decision(hold_s=remaining)
        return Decision(run=self.take(queue), give_up=tuple(missing))

    def missing(self, queue: Sequence[Step], coming: Mapping[Hashable, tuple[int, int]]) -> list:
        """Coming conversations that would join the next pass but have not sent their step.

        None for an empty queue, with batching off, for a prefill head, or with the pass full.
        """
        if not queue or self.max_batch == 1 or not coming:
            return []
        first = queue[self.head(queue)]
        if first.tokens > BATCH_STEP_TOKENS:
            return []
        room = self.max_batch - sum(1 for s in queue if s.tokens <= BATCH_STEP_TOKENS and s.layers == first.layers)
        if room <= 0:
            return []
        here = {s.conv for s in queue}
        missing = [c for c, layers in coming.items() if c not in here and layers == first.layers]
        return missing[:room]

    def hold_limit_s(self) -> float:
        """The longest a pass waits after its head step (:meth:`head`) arrived, seconds."""
        return min(self.max_hold_s, HOLD_FRACTION * self.pass_s)

    def head(self, queue: Sequence[Step]) -> int:
        """Index of the step the next pass is built around (``queue`` must not be empty): the
        oldest, except right after a prefill pass, when the oldest small step goes first. So however
        many prefill chunks one client queues, another conversation's decode step waits for at most one."""
        if self.after_prefill:
            for i, step in enumerate(queue):
                if step.tokens <= BATCH_STEP_TOKENS:
                    return i
        return 0

    def take(self, queue: Sequence[Step]) -> tuple[int, ...]:
        """The next pass without holding: indexes of :meth:`head` plus the compatible small steps
        queued with it (in queue order, ``max_batch`` at most); () for an empty queue.
        Updates ``after_prefill``."""
        if not queue:
            return ()
        h = self.head(queue)
        first = queue[h]
        group = [h]
        if first.tokens <= BATCH_STEP_TOKENS and self.max_batch > 1:
            for i, step in enumerate(queue):
                if len(group) >= self.max_batch:
                    break
                if i != h and step.tokens <= BATCH_STEP_TOKENS and step.layers == first.layers:
                    group.append(i)
        self.after_prefill = first.tokens > BATCH_STEP_TOKENS
        return tuple(group)

    def ran(self, tokens: int, took_s: float) -> None:
        """A pass whose head step had ``tokens`` tokens took ``took_s`` seconds on the device; a
        decode pass updates the running mean ``pass_s`` that sizes the wait for the next."""
        if tokens <= BATCH_STEP_TOKENS:
            self.pass_s = took_s if not self.pass_s else (1 - PASS_TIME_EWMA) * self.pass_s + PASS_TIME_EWMA * took_s
