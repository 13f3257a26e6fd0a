"""Per-peer step scheduler: decode steps of different conversations that are ready together
run as one batched forward pass.

Each conversation's worker (``Peer._conv_worker``) submits one step at a time and awaits its
result, so a conversation's steps stay in order. The scheduler runs one pass at a time on the
device executor; while a pass runs, the steps that arrive queue up, and the next pass takes
them together. A lone conversation runs exactly as before (one :meth:`Shard.forward`), with
no added wait.

Policy, in :meth:`StepScheduler._take`:

- the oldest pending step runs in the next pass, except that right after a prefill pass the
  oldest small step goes first: decode steps wait for at most one prefill however many are
  queued, and prefills keep their order with at most one batch of decode steps between two
  (no starvation);
- steps of at most :data:`BATCH_STEP_TOKENS` tokens that run the same layers join that
  one, up to ``max_batch`` conversations (plain decode and speculative verification steps
  mix: each gets the logits it needs);
- a longer step (prefill) runs alone.

Holding a pass (:meth:`StepScheduler._hold`): the conversations of a pass come back together
(their clients answer each token with the next step within about one round trip), but their
steps arrive one by one. A pass that started on the first arrival would carry only it, and the
rest would wait a whole pass for the next one: the conversations drift into small batches.
So while a conversation whose last step succeeded here ("coming") has not sent its next
step, a decode pass waits for it, at most :data:`HOLD_FRACTION` of a recent pass's time and
at most ``max_hold_s`` after its first step arrived. A conversation that misses the wait is
no longer counted as coming until its next step arrives (one that ended costs one wait).

Error isolation: each step is checked (:meth:`Shard.check_step`) before the batch is built,
so a bad step fails alone; if the batched pass itself raises, every step of the batch is
rerun alone, so the error lands on the conversation that caused it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from meshinfer.core.errors import MeshError

log = logging.getLogger(__name__)

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


@dataclass
class StepJob:
    """One step of one conversation, waiting for a pass.

    Attributes:
        conv: the peer's conversation (its ``cache`` and ``run`` are used).
        x: token ids ``(1, T)`` int64 on the first hop, else hidden states ``(1, T, C)``.
        start: position of the step's first token.
        want: what the client asked the last hop for (``"token"`` or ``"none"``).
        future: resolved with the step's result, or its exception.
        sampling: the step's sampling settings for the last hop, or None (greedy); passed
            to ``finish`` as is (they never change the forward pass, so they batch freely).
    """

    conv: Any
    x: torch.Tensor
    start: int
    want: str
    future: asyncio.Future
    sampling: Any = None
    queued_at: float = field(default_factory=time.perf_counter)

    @property
    def tokens(self) -> int:
        return self.x.shape[1]


@dataclass
class BatchStats:
    """Counters of the passes a peer ran (read them on the event loop).

    Attributes:
        passes: forward passes run for steps, batched or not.
        batched_passes: passes that carried more than one conversation.
        batched_steps: steps that ran inside a batched pass.
        largest_batch: most conversations seen in one pass.
        fallbacks: batched passes that raised and were rerun one step at a time.
        holds: passes that waited for coming conversations (:meth:`StepScheduler._hold`).
        hold_s: seconds spent in those waits, in total.
    """

    passes: int = 0
    batched_passes: int = 0
    batched_steps: int = 0
    largest_batch: int = 0
    fallbacks: int = 0
    holds: int = 0
    hold_s: float = 0.0


class StepScheduler:
    """Group ready steps into passes on one device executor.

    Args:
        executor: the :class:`~meshinfer.engine.executor.DeviceExecutor` owning ``shard``.
        get_shard: returns the peer's :class:`~meshinfer.engine.models.llama.Shard`, looked up at
            every pass (a peer's shard object may be replaced, e.g. wrapped).
        finish: ``finish(conv, start, tokens, want, out, sampling)``, called on the device
            thread with a step's forward output; returns what the step yields (a token id on the last hop,
            the hidden states to send otherwise) or raises a :class:`MeshError` for that step.
        logits_mode: ``logits_mode(want)`` -> the ``logits=`` argument a step needs
            (``"last"`` or ``"all"``).
        spawn: starts and tracks a task (the peer's ``_spawn``); the scheduler's loop is
            started by :meth:`start` or on first use, and cancelled with the peer's tasks.
        max_batch: most conversations per pass; 1 turns batching off.
        max_hold_s: the most a decode pass waits for coming conversations, seconds; 0 never waits.

    Raises:
        ValueError: ``max_batch`` below 1 or ``max_hold_s`` negative.
    """

    def __init__(self, executor, get_shard: Callable, *, finish: Callable, logits_mode: Callable[[str], str],
                 spawn: Callable, max_batch: int = DEFAULT_MAX_BATCH, max_hold_s: float = DEFAULT_MAX_HOLD_S) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if not max_hold_s >= 0:
            raise ValueError(f"max_hold_s must be 0 or more seconds, got {max_hold_s}")
        self.executor, self.get_shard = executor, get_shard
        self.finish, self.logits_mode, self.spawn = finish, logits_mode, spawn
        self.max_batch, self.max_hold_s = max_batch, max_hold_s
        self.stats = BatchStats()
        self._pending: list[StepJob] = []
        self._coming: dict[int, Any] = {}  # id(conv) -> conv: last step succeeded, next not yet here
        self._after_prefill = False  # the last pass taken ran a prefill step: a small step goes next
        self._pass_s = 0.0  # running mean of decode pass time (PASS_TIME_EWMA), seconds
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the scheduling loop (on the running event loop) unless it runs already.

        :meth:`submit` starts it too; a peer starts it with its other tasks so its task count
        is steady from then on.
        """
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = self.spawn(self._loop(), "step scheduler")

    async def submit(self, conv, x: torch.Tensor, start: int, want: str, sampling=None):
        """Run one step of ``conv`` in the next pass that can take it; return what ``finish``
        returned.

        Cancelling the caller withdraws a step still pending; a step already in a pass
        completes (its cache advances) and the result is dropped, as with
        :meth:`DeviceExecutor.run`.

        Raises:
            MeshError: the step's own error (bad input, position, a full cache, NaN output).
            Exception: an unexpected error of the forward pass run for this step alone.
        """
        self.start()
        job = StepJob(conv, x, start, want, asyncio.get_running_loop().create_future(), sampling)
        self._coming.pop(id(conv), None)
        self._pending.append(job)
        self._wake.set()
        return await job.future

    def forget(self, conv) -> None:
        """``conv`` has ended: never wait for its next step. Safe to call for any conversation.

        A pass held for ``conv`` stops waiting for it at once.
        """
        if self._coming.pop(id(conv), None) is not None:
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # steps that arrived in this loop turn join the same pass
            while True:
                await self._hold()
                group = self._take()
                if not group:
                    break
                await self._run(group)

    async def _hold(self) -> None:
        """Wait while conversations that share the next decode pass's layers are coming.

        Returns at once without a pending step, for a prefill, with batching off or the batch
        full; else when every coming conversation has sent its step, or :meth:`_hold_limit_s`
        after the pass's first step (:meth:`_head`) arrived. Conversations still missing then
        stop counting as coming.
        """
        t0, held = time.perf_counter(), False
        while True:
            self._wake.clear()
            missing = self._missing()
            if not missing:
                break
            remaining = self._head().queued_at + self._hold_limit_s() - time.perf_counter()
            if remaining <= 0:
                for conv in missing:
                    self._coming.pop(id(conv), None)
                break
            held = True
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        if held:  # (not the time the checks took: on a loaded machine they can pass 0.1 ms)
            self.stats.holds += 1
            self.stats.hold_s += time.perf_counter() - t0

    def _missing(self) -> list:
        """Coming conversations that would join the next pass but have not sent their step."""
        self._pending = [j for j in self._pending if not j.future.done()]  # withdrawn by cancellation
        if not self._pending or self.max_batch == 1 or not self._coming:
            return []
        first = self._head()
        if first.tokens > BATCH_STEP_TOKENS:
            return []
        key = self._key(first.conv)
        room = self.max_batch - sum(1 for j in self._pending
                                    if j.tokens <= BATCH_STEP_TOKENS and self._key(j.conv) == key)
        if room <= 0:
            return []
        here = {id(j.conv) for j in self._pending}
        missing = [c for i, c in self._coming.items() if i not in here and self._key(c) == key]
        return missing[:room]

    def _hold_limit_s(self) -> float:
        """The longest a pass waits after its first step (:meth:`_head`) arrived, seconds."""
        return min(self.max_hold_s, HOLD_FRACTION * self._pass_s)

    def _head(self) -> StepJob:
        """The step the next pass is built around (``_pending`` must not be empty): the oldest,
        except right after a prefill pass, when the oldest small step goes first. So however many
        prefill chunks one client queues, another conversation's decode step waits for at most one."""
        if self._after_prefill:
            for job in self._pending:
                if job.tokens <= BATCH_STEP_TOKENS:
                    return job
        return self._pending[0]

    def _take(self) -> list[StepJob]:
        """The next pass: :meth:`_head` plus the compatible small steps pending with it."""
        self._pending = [j for j in self._pending if not j.future.done()]  # withdrawn by cancellation
        if not self._pending:
            return []
        first = self._head()
        group = [first]
        if first.tokens <= BATCH_STEP_TOKENS and self.max_batch > 1:
            key = self._key(first.conv)
            for job in self._pending:
                if len(group) >= self.max_batch:
                    break
                if job is not first and job.tokens <= BATCH_STEP_TOKENS and self._key(job.conv) == key:
                    group.append(job)
        self._after_prefill = first.tokens > BATCH_STEP_TOKENS
        taken = {id(j) for j in group}
        self._pending = [j for j in self._pending if id(j) not in taken]
        return group

    @staticmethod
    def _key(conv) -> tuple:
        """Conversations share a pass only when they run the same layers."""
        return conv.run.start, conv.run.stop

    async def _run(self, group: list[StepJob]) -> None:
        try:
            results, took = await self.executor.run(self._timed_compute, group)
        except Exception as exc:  # the executor itself failed (shut down): no step may hang on it
            for job in group:
                if not job.future.done():
                    job.future.set_exception(exc)
            return
        if group[0].tokens <= BATCH_STEP_TOKENS:  # a decode pass: it sizes the wait for the next
            self._pass_s = took if not self._pass_s else (1 - PASS_TIME_EWMA) * self._pass_s + PASS_TIME_EWMA * took
        ran = sum(1 for r in results if not isinstance(r, _Skipped))
        self.stats.passes += 1
        self.stats.largest_batch = max(self.stats.largest_batch, ran)
        if ran > 1:
            self.stats.batched_passes += 1
            self.stats.batched_steps += ran
        if any(isinstance(r, _Fallback) for r in results):
            self.stats.fallbacks += 1
        for job, result in zip(group, results):
            if job.future.done():
                continue
            value = result.value
            if isinstance(value, BaseException):
                job.future.set_exception(value)
            else:
                self._coming[id(job.conv)] = job.conv
                job.future.set_result(value)

    # ---------------------------------------------------------------- on the device thread
    def _timed_compute(self, group: list[StepJob]) -> tuple[list, float]:
        """:meth:`_compute` and the seconds it took on the device thread.

        Only the pass itself counts, not the time it queued behind other work on the thread (a
        verify, a cache free) nor the event loop's delay in resuming: those would let one slow
        verify lengthen every wait for coming conversations up to ``max_hold_s``.
        """
        t0 = time.perf_counter()
        outcomes = self._compute(group)
        return outcomes, time.perf_counter() - t0

    def _compute(self, group: list[StepJob]) -> list:
        """Run ``group`` as one pass (or one step alone); one outcome per job, never raises."""
        if len(group) == 1:
            return [_Outcome(self._one(group[0]))]
        outcomes: list = [None] * len(group)
        valid = []
        for i, job in enumerate(group):
            try:
                self.get_shard().check_step(job.x, job.start, job.conv.cache, job.conv.run)
                valid.append(i)
            except MeshError as exc:
                outcomes[i] = _Skipped(exc)
        if len(valid) == 1:
            outcomes[valid[0]] = _Outcome(self._one(group[valid[0]]))
        elif valid:
            self._batch([group[i] for i in valid], outcomes, valid)
        return outcomes

    def _batch(self, jobs: list[StepJob], outcomes: list, where: list[int]) -> None:
        try:
            outs = self.get_shard().forward_batch([j.x for j in jobs], [j.start for j in jobs],
                                            [j.conv.cache for j in jobs], run=jobs[0].conv.run,
                                            logits=[self.logits_mode(j.want) for j in jobs])
        except Exception:
            log.warning("a batched pass of %d steps failed; running them one by one", len(jobs), exc_info=True)
            for i, job in zip(where, jobs):
                outcomes[i] = _Fallback(self._one(job))
            return
        for i, job, out in zip(where, jobs, outs):
            try:
                outcomes[i] = _Outcome(self.finish(job.conv, job.start, job.tokens, job.want, out, job.sampling))
            except Exception as exc:
                outcomes[i] = _Outcome(exc)

    def _one(self, job: StepJob):
        """One step alone: its result, or the exception it raised."""
        try:
            shard = self.get_shard()
            out = shard(job.x, job.start, job.conv.cache, run=job.conv.run,
                        logits=self.logits_mode(job.want))
            return self.finish(job.conv, job.start, job.tokens, job.want, out, job.sampling)
        except Exception as exc:
            return exc


@dataclass
class _Outcome:
    value: Any


class _Fallback(_Outcome):
    """A step rerun alone after its batched pass raised."""


class _Skipped(_Outcome):
    """A step refused by its check before the pass: it ran nothing."""
