"""Per-peer step scheduler: decode steps of different conversations that are ready together
run as one batched forward pass.

Each conversation's worker (:meth:`~meshinfer.peer.steps.Steps.worker`) submits one step at a time and awaits its
result, so a conversation's steps stay in order. The scheduler runs one pass at a time on the
device executor; while a pass runs, the steps that arrive queue up, and the next pass takes
them together. A lone conversation runs exactly as before (one :meth:`Shard.forward`), with
no added wait.

Policy, in :mod:`meshinfer.peer.batching` (pure, no torch): before each pass the scheduler
gives :meth:`BatchPolicy.schedule` the pending steps' facts and the conversations that are
coming, and runs the pass it names (:meth:`StepScheduler._next`) or waits as long as it says,
waking early when a step arrives or a conversation ends. Small steps of different
conversations that run the same layers share a pass; a prefill runs alone.

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
from meshinfer.peer.batching import BATCH_STEP_TOKENS, DEFAULT_MAX_BATCH, DEFAULT_MAX_HOLD_S, BatchPolicy, Step

__all__ = ["BATCH_STEP_TOKENS", "DEFAULT_MAX_BATCH", "DEFAULT_MAX_HOLD_S", "BatchStats", "StepJob", "StepScheduler"]

log = logging.getLogger(__name__)


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
        took_s: seconds the pass that ran this step took on the device thread (0 until it ran).
    """

    conv: Any
    x: torch.Tensor
    start: int
    want: str
    future: asyncio.Future
    sampling: Any = None
    queued_at: float = field(default_factory=time.perf_counter)
    took_s: float = 0.0

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
        holds: passes that waited for coming conversations (:meth:`StepScheduler._next`).
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
        self.executor, self.get_shard = executor, get_shard
        self.finish, self.logits_mode, self.spawn = finish, logits_mode, spawn
        self.policy = BatchPolicy(max_batch=max_batch, max_hold_s=max_hold_s)
        self.stats = BatchStats()
        self._pending: list[StepJob] = []
        self._coming: dict[int, Any] = {}  # id(conv) -> conv: last step succeeded, next not yet here
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the scheduling loop (on the running event loop) unless it runs already.

        :meth:`submit` starts it too; a peer starts it with its other tasks so its task count
        is steady from then on.
        """
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = self.spawn(self._loop(), "step scheduler")

    async def submit(self, conv, x: torch.Tensor, start: int, want: str, sampling=None, *,
                     timing: dict | None = None):
        """Run one step of ``conv`` in the next pass that can take it; return what ``finish``
        returned. ``timing``, when given, gets ``pass_s``: the seconds the pass that ran the step
        took on the device thread (not its wait behind other passes, holds or other work).

        Cancelling the caller withdraws a step still pending; a step already in a pass of its
        own (a prefill chunk, say) stops at the next layer (``Shard.forward``'s ``abandoned``:
        the conversation ended, its cache is to be freed), and one in a batched pass completes
        with the others (its cache advances) and its result is dropped.

        Raises:
            MeshError: the step's own error (bad input, position, a full cache, NaN output).
            Exception: an unexpected error of the forward pass run for this step alone.
        """
        self.start()
        job = StepJob(conv, x, start, want, asyncio.get_running_loop().create_future(), sampling)
        self._coming.pop(id(conv), None)
        self._pending.append(job)
        self._wake.set()
        try:
            return await job.future
        finally:
            if timing is not None:
                timing["pass_s"] = job.took_s

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
                group = await self._next()
                if not group:
                    break
                await self._run(group)

    async def _next(self) -> list[StepJob]:
        """The steps of the next pass ([] when none is pending), once :meth:`BatchPolicy.schedule`
        stops holding it.

        A hold returns early when a step arrives or a conversation ends (:meth:`forget`), and
        the policy is asked again. Conversations it gives up on stop counting as coming.
        """
        t0, held = time.perf_counter(), False
        while True:
            self._wake.clear()
            decision = self.policy.schedule(self._steps(), self._coming_layers(), time.perf_counter())
            for conv in decision.give_up:
                self._coming.pop(conv, None)
            if decision.hold_s <= 0:
                break
            held = True
            try:
                await asyncio.wait_for(self._wake.wait(), decision.hold_s)
            except asyncio.TimeoutError:
                pass
        if held:  # (not the time the checks took: on a loaded machine they can pass 0.1 ms)
            self.stats.holds += 1
            self.stats.hold_s += time.perf_counter() - t0
        return self._pop(decision.run)

    def _take(self) -> list[StepJob]:
        """The next pass without holding (:meth:`BatchPolicy.take`): the policy's head step plus the
        compatible small steps pending with it."""
        return self._pop(self.policy.take(self._steps(timed=False)))

    def _steps(self, *, timed: bool = True) -> list[Step]:
        """The policy's facts of the pending steps, oldest first, after dropping the steps withdrawn
        by cancellation. Without ``timed``, arrival times are left out (taking a pass reads none)."""
        self._pending = [j for j in self._pending if not j.future.done()]  # withdrawn by cancellation
        return [Step(id(j.conv), self._key(j.conv), j.tokens, j.queued_at if timed else 0.0) for j in self._pending]

    def _coming_layers(self) -> dict[int, tuple]:
        """``id(conv)`` -> layers of each coming conversation, in the order they became coming."""
        return {i: self._key(c) for i, c in self._coming.items()}

    def _pop(self, run: tuple[int, ...]) -> list[StepJob]:
        """Remove the pending steps at indexes ``run`` (a pass the policy took) and return them in that order."""
        group = [self._pending[i] for i in run]
        taken = set(run)
        self._pending = [j for i, j in enumerate(self._pending) if i not in taken]
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
        self.policy.ran(group[0].tokens, took)  # a decode pass sizes the wait for the next
        ran = sum(1 for r in results if not isinstance(r, _Skipped))
        self.stats.passes += 1
        self.stats.largest_batch = max(self.stats.largest_batch, ran)
        if ran > 1:
            self.stats.batched_passes += 1
            self.stats.batched_steps += ran
        if any(isinstance(r, _Fallback) for r in results):
            self.stats.fallbacks += 1
        for job, result in zip(group, results):
            job.took_s = took
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
        """One step alone: its result, or the exception it raised. The pass stops between two
        layers once the step's caller is gone (its future cancelled: the conversation ended)."""
        try:
            shard = self.get_shard()
            out = shard(job.x, job.start, job.conv.cache, run=job.conv.run,
                        logits=self.logits_mode(job.want), abandoned=job.future.done)
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
