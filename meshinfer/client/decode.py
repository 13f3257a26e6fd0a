"""A conversation's decode steps: plain, or speculative (drafts verified by the mesh) with the
draft policy's choice of length (:class:`DecodeSteps`)."""

from __future__ import annotations

import logging
import time
from typing import Sequence

from meshinfer.client.draft import PromptLookup
from meshinfer.client.results import ChatResult
from meshinfer.client.speculative import SpecStats
from meshinfer.core.errors import DraftsRefused

log = logging.getLogger(__name__)

#: Least network time per step, ms (the planner's estimate less compute), for "auto" to draft
#: ahead during steps: on loopback (a few ms) the drafting would take CPU from the hops instead.
AHEAD_MIN_NETWORK_MS = 20.0


class DecodeSteps:
    """The decoding half of :class:`~meshinfer.client.conversation.Conversation` (a mixin: it
    uses the conversation's drafter, policy and :meth:`_audited_step`)."""

    async def _decode_all(self, result: ChatResult, prompt_ids: list[int], ids: list[int], *, budget: int,
                          eos: set[int], on_token, spec: SpecStats | None) -> None:
        """Decode steps after the prefill's ``ids`` until a token ends generation; sets the decode rate."""
        t1 = time.perf_counter()
        taken = 0  # chosen ids seen by accept: the prefill's one, then one per plain decode step

        def take(token: int) -> bool:
            nonlocal taken
            taken += 1
            return result.accept(token, budget=budget, eos=eos, on_token=on_token)

        # all() stops at the first token that ends generation: later ids of that step are dropped
        while all(take(t) for t in ids):
            ts = time.perf_counter()
            ids, trace = await self._decode_step(result, prompt_ids + result.token_ids,
                                                 budget - len(result.token_ids), spec)
            self.times.record(trace, (time.perf_counter() - ts) * 1e3, len(ids))
        result.set_decode_rate(taken - 1, time.perf_counter() - t1)

    def _start_speculation(self) -> SpecStats:
        """Counters for one generation; the drafter and policy are made once per conversation."""
        if self.drafter is None:
            self.drafter = self.draft_model.drafter() if self.draft_model is not None else PromptLookup()
        if self.policy is None:
            self.policy = self.client.draft_policy(self.route, self.drafter, ahead=self.draft_ahead)
        self.policy.new_text()  # another prompt: an earlier text's fruitless drafts say little of it
        return SpecStats(draft_tokens=self.draft_tokens, drafter=self.drafter.name)

    async def _decode_step(self, result: ChatResult, history: list[int], remaining: int,
                           spec: SpecStats | None) -> tuple[list[int], list]:
        """One decode step after ``history`` (whose last token is not sent yet): 1 to k + 1 new ids.

        With speculation, the policy chooses the draft length k (0: a plain step), the drafter
        proposes up to k ids, and :func:`~meshinfer.client.speculative.accept` keeps what plain greedy
        decoding would choose. Drafts are clipped to the ``remaining`` tokens of the budget and to
        the conversation's reserved context, so a step never asks a hop for positions it did not
        reserve. Positions of rejected drafts stay on the hops until the next step rolls them back
        (``rollback: true``): no extra round trip. The drafter's cost, the step's wall time and
        its acceptance go back to the policy.
        """
        if spec is None or not self.speculate:
            return await self._timed_step(history[-1:], result)
        if self._warm is not None and self._warm.done():
            self._warm, warm = None, self._warm
            warm.result()  # the draft prefill's error, if any
        room = min(remaining - 1, self.max_tokens_total - len(self.cached) - 1, self.max_step_tokens - 1)
        # no drafts while the drafter still reads the prompt (plain steps need not wait for it)
        k = 0 if self._warm is not None else self.policy.choose(min(self.draft_tokens, room))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("conversation %s: %d drafts (%s)", self.conv_id[:12], k, self.policy.describe())
        t0, before = time.perf_counter(), (len(self.failovers), len(self.detections))
        drafts = (await self.drafter.propose(history, k))[:k] if k > 0 else []
        self.policy.record_draft_cost(len(drafts), self.drafter.last_cost_ms)
        # draft the next step's tokens while the mesh answers this one, only while drafting is in
        # use: during plain steps the work would be wasted, and on a machine shared with hops it
        # would slow the very steps the policy compares drafting against
        if drafts and self._ahead_pays():
            self.drafter.draft_ahead(history + drafts, self.draft_tokens + 1)
        if not drafts:
            spec.plain_steps += 1
            out, trace = await self._timed_step(history[-1:], result)
        else:
            try:
                out, trace = await self._timed_step([history[-1], *drafts], result, drafts=drafts)
            except DraftsRefused as exc:  # a hop that predates speculative decoding: go on without it
                log.warning("conversation %s: a hop does not verify drafts (%s); speculation off",
                            self.conv_id[:12], exc)
                self.speculate = False
                await self.drafter.stop_ahead()
                return await self._timed_step(history[-1:], result)
            spec.steps += 1
            spec.proposed += len(drafts)
            spec.accepted += len(out) - 1
            self.policy.record_drafts(len(drafts), len(out) - 1)
        if before == (len(self.failovers), len(self.detections)):  # an ordinary step: what it yielded
            self.policy.record_yield(bool(drafts), len(out), (time.perf_counter() - t0) * 1e3)
        return out, trace

    def _ahead_pays(self) -> bool:
        """Whether to draft ahead (:meth:`~meshinfer.client.draft.Drafter.draft_ahead`) during steps:
        ``draft_ahead`` True or False decides; "auto" drafts ahead when the route's network
        time per step (the planner's estimate less its hops' compute) holds at least one draft
        pass, so the drafting hides in the round trip instead of taking CPU from hops that may
        share this machine (loopback)."""
        if self.draft_ahead != "auto":
            return bool(self.draft_ahead)
        if self.draft_model is None:
            return False
        compute = sum(h.peer.compute_ms_per_token * len(h.layers) / max(1, len(h.peer.layers))
                      for h in self.route.hops)
        network_ms = self.route.estimated_ms_per_token - compute
        return network_ms >= max(self.draft_model.ms_per_token, AHEAD_MIN_NETWORK_MS)

    async def _timed_step(self, tokens: list[int], result: ChatResult, *,
                          drafts: Sequence[int] | None = None) -> tuple[list[int], list]:
        """:meth:`_audited_step`, its wall time recorded by the draft policy (when there is one)
        unless a failover or a detection made it unlike an ordinary step."""
        before = (len(self.failovers), len(self.detections))
        t0 = time.perf_counter()
        out = await self._audited_step(tokens, result, drafts=drafts)
        if self.policy is not None and before == (len(self.failovers), len(self.detections)):
            self.policy.record_step(len(tokens), (time.perf_counter() - t0) * 1e3)
        return out

