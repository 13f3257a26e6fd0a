"""One conversation over a route (:class:`Conversation`): open, generate, close; its positions
live in a :class:`~meshinfer.client.ledger.PositionLedger`, its steps go out through
:mod:`~meshinfer.client.hops`, failed and lying hops are replaced by :mod:`~meshinfer.client.failover`
and decode steps run in :mod:`~meshinfer.client.decode`."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable, Sequence

from meshinfer.client import spotcheck
from meshinfer.client.decode import DecodeSteps
from meshinfer.client.draft import DraftModel, Drafter
from meshinfer.client.failover import Failover
from meshinfer.client.hops import DEADLINE_FLOOR_S, FAILOVER_CODES, MAX_FAILOVERS, HopSteps
from meshinfer.client.ledger import PositionLedger
from meshinfer.client.results import ChatResult, StepTimes
from meshinfer.client.routing import Route
from meshinfer.client.speculative import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftPolicy
from meshinfer.core.errors import CacheFull, InvalidInput, MeshError, NoRoute, PeerUnavailable
from meshinfer.core.generation import check_context
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.wire import convkeys

if TYPE_CHECKING:
    from meshinfer.client.mesh import MeshClient

log = logging.getLogger(__name__)

#: Bytes of a conversation's unread ``token``/``error`` frames kept (:meth:`Conversation.hear`):
#: a step's reply is a few hundred bytes (its token and one trace entry per hop), so this holds
#: thousands; beyond it the oldest go first. Unbounded, a hop's 64 MiB frames naming an idle
#: conversation took gigabytes of the client.
INBOX_BYTES = 1 << 20
#: Unread frames a conversation keeps at most (the same reason, for many small frames).
INBOX_FRAMES = 1024


class Conversation(HopSteps, Failover, DecodeSteps):
    """One conversation over a route: prefill, decode, multi-turn reuse, failover with replay.

    Args:
        client: the :class:`MeshClient`.
        route: the planned route.
        max_tokens_total: context reserved on every hop, tokens (prompt + generated, all turns).
        deadline_floor_s: the smallest per-step deadline, seconds (see :data:`DEADLINE_FLOOR_S`).
        spot_check_rate: share of decode steps followed by a spot-check of one random hop, on
            top of a check of every hop after each prefill (0: no spot-checks); see
            :mod:`meshinfer.peer.verify`.
        spot_check_seed: seed of the random choice of checked steps and hops (None: random).
        speculate: verify drafts with decode steps when it pays (exact under greedy decoding;
            see :mod:`meshinfer.client.speculative`). Sampled generation (temperature > 0) never drafts.
        draft_tokens: most drafts per step, 1 to :data:`~meshinfer.client.speculative.MAX_DRAFT_TOKENS`;
            each step's draft length is chosen within it by a
            :class:`~meshinfer.client.speculative.DraftPolicy`.
        draft_model: draft with this :class:`~meshinfer.client.draft.DraftModel` (a per-conversation
            KV cache, freed by :meth:`close`) instead of prompt lookup; its vocabulary is checked
            against the route's before the conversation opens.
        draft_ahead: draft the next step's tokens while the mesh verifies a step (True, False,
            or "auto", the default: when the route's round trip holds a draft pass, see
            :meth:`_ahead_pays`). With a gguf-a16 draft it measured 1.03x (100 ms RTT) and 1.16x
            (370 ms) the speed of drafting after each step (docs/benchmarks.md).

    Raises:
        InvalidInput: ``draft_tokens`` out of range.

    When a hop's connection closes, a hop reports that it lost the next hop, or a step misses
    its deadline, the conversation finds the failed hops (closed links, unanswered probes, or
    the first hop that did not get the step), backs them off, plans a new route with the same
    weights identity, keeps the caches of hops that stay, replays the confirmed tokens to the
    new hops (kept hops resend their logged hidden states rather than recompute) and retries.

    A hop caught lying (:class:`LyingPeer`: cheap checks on a hop, a position count that does
    not add up, a failed spot-check) is banned for the client's lifetime, the conversation is
    rolled back to the last position whose output from that hop was verified, and it fails
    over to a route without it.
    """

    def __init__(self, client: MeshClient, route: Route, *, max_tokens_total: int,
                 deadline_floor_s: float = DEADLINE_FLOOR_S,
                 spot_check_rate: float = spotcheck.DEFAULT_SPOT_CHECK_RATE,
                 spot_check_seed: int | None = None, speculate: bool = True,
                 draft_tokens: int = DEFAULT_DRAFT_TOKENS, draft_model: DraftModel | None = None,
                 draft_ahead: bool | str = "auto") -> None:
        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidInput(f"draft_tokens must be 1-{MAX_DRAFT_TOKENS}, got {draft_tokens}")
        if draft_ahead not in (True, False, "auto"):
            raise InvalidInput(f"draft_ahead must be True, False or 'auto', got {draft_ahead!r}")
        self.speculate, self.draft_tokens, self.draft_ahead = speculate, draft_tokens, draft_ahead

        self.client, self.route = client, route
        self.key = convkeys.ConversationKey()  # the conversation's id is its key's; it signs opens and steps
        self.conv_id = self.key.conv_id
        self.max_tokens_total = max_tokens_total
        self.deadline_floor_s = deadline_floor_s
        self.inbox: asyncio.Queue = asyncio.Queue()  # (link, type, fields, frame bytes): see hear()
        self._inbox_bytes = 0
        self.ledger = PositionLedger()  # cached, confirmed and held positions
        self.draft_model = draft_model
        self.drafter: Drafter | None = None  # made on the first speculative generate
        self.policy: DraftPolicy | None = None  # chooses each step's draft length
        self._warm: asyncio.Future | None = None  # the drafter's prefill of a generate() in progress
        self.max_step_tokens = 512
        self.failovers: list[dict] = []
        self.unconfirmed_reports: dict[str, int] = {}  # reporting hop -> its unconfirmed reports here (see client.reports)
        self._seq = 0
        self._min_seq = 0  # replies to steps before this one are stale
        self._open = False
        self.times = StepTimes()
        self._opening = 0
        self._opened: set[str] = set()  # peers that may hold this conversation (opened, not closed since)
        self.sampling: SamplingParams | None = None  # set by generate(); None: greedy
        self.audit = spotcheck.Auditor(rate=spot_check_rate, seed=spot_check_seed)
        self.detections: list[dict] = []
        self._reply_length: int | None = None  # positions the last hop said it holds after a step

    def hear(self, link, msg_type: str, f, nbytes: int = 0) -> None:
        """Queue a frame for :meth:`_await_token` (``nbytes``: its size on the wire; 0 for the
        client's own "closed" notices). Beyond :data:`INBOX_FRAMES` frames or
        :data:`INBOX_BYTES` bytes unread, the oldest are dropped (a late reply is stale by then;
        the newest frame is always kept)."""
        self.inbox.put_nowait((link, msg_type, f, nbytes))
        self._inbox_bytes += nbytes
        while self.inbox.qsize() > 1 and (self.inbox.qsize() > INBOX_FRAMES or self._inbox_bytes > INBOX_BYTES):
            self._inbox_bytes -= self.inbox.get_nowait()[3]

    @property
    def cached(self) -> list[int]:
        """Token ids sent to the route, in order (the ledger's; do not change it)."""
        return self.ledger.cached

    @property
    def confirmed(self) -> int:
        """Leading tokens of :attr:`cached` every hop is known to hold."""
        return self.ledger.confirmed

    async def open(self) -> None:
        """Open the conversation on every hop (reserving KV), in order.

        Raises:
            CacheFull: a hop has no room; PeerUnavailable: a hop is unreachable.
        """
        if self.draft_model is not None:  # refuse another vocabulary before any hop reserves room
            await self.client.tokenizer(self.route)
        self.client.attach(self)
        full: set[str] = set()
        try:
            for attempt in range(MAX_FAILOVERS + 1):
                try:
                    for i in range(len(self.route.hops)):
                        await self._open_hop(i, self.route.hops)
                    self._open = True
                    return
                except CacheFull as exc:  # that hop is full: plan around it with what we need
                    await self._close_on(self.route.hops)
                    hop = self.route.hops[self._opening]
                    full.add(hop.peer_id)
                    if attempt == MAX_FAILOVERS:
                        raise
                    self.route = await self._plan_around_full(exc, hop.peer_id, full)
                except PeerUnavailable:  # the hop (or the relay its circuit ran through) is gone:
                    await self._close_on(self.route.hops)  # back it off and plan again (a relay that
                    self.client.mark_failed(self.client.culprit(self.route.hops[self._opening].peer_id))
                    if attempt == MAX_FAILOVERS:  # cut every circuit during open failed each chat)
                        raise
                    self.route = await self.client.plan(compat_key=self.route.compat_key)
        except BaseException:
            await self.close()
            raise

    async def _plan_around_full(self, exc: CacheFull, peer_id: str, full: set[str]) -> Route:
        """A route of this conversation's weights that avoids the hops in ``full`` and has
        room for :attr:`max_tokens_total` tokens.

        Raises:
            CacheFull: no such route; the message names the full hop, its numbers (from
                ``exc``: tokens asked, free, capacity) and what the planner found missing.
        """
        log.info("a hop has no room (%s); planning around it", exc)
        try:
            return await self.client.plan(compat_key=self.route.compat_key, exclude=frozenset(full),
                                          min_free_kv_tokens=self.max_tokens_total)
        except NoRoute as no_route:
            raise CacheFull(f"peer {peer_id[:12]} is full: {exc}; no other route has room ({no_route})") from no_route

    async def close(self) -> None:
        """Free the conversation on every hop, and the draft model's cache. Safe to call twice."""
        self.client.detach(self.conv_id)
        self._open = False
        drafter, self.drafter = self.drafter, None
        if drafter is not None:
            await drafter.close()
        await self._close_on(self.route.hops)

    def reused_prefix(self, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of ``prompt_ids`` the hops already hold and :meth:`generate`
        keeps (confirmed by every hop, and never the whole prompt: its last token is resent to
        get the next one); the rest is prefilled."""
        keep, limit = 0, min(self.confirmed, len(prompt_ids) - 1)
        while keep < limit and self.cached[keep] == prompt_ids[keep]:
            keep += 1
        return keep

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int | None, eos_ids=(),
                       on_token: Callable[[int], bool | None] | None = None,
                       sampling: SamplingParams | None = None) -> ChatResult:
        """Generation continuing this conversation: greedy, or sampled on the last hop.

        ``prompt_ids`` is the whole conversation so far (rendered by the chat template); the
        longest prefix the hops already cache is reused, the rest is prefilled in chunks of at
        most the hops' ``max_step_tokens``, sent back to back so hops work in a pipeline.
        ``on_token`` gets each kept id; when it returns True generation ends with
        ``finish_reason`` "stop" (a stop sequence). ``sampling`` (None or temperature 0: greedy)
        travels with each step that wants a token; the last hop seeds its draw with (seed, position).

        Raises:
            ContextOverflow: prompt + ``max_tokens`` exceed the conversation's reserved context.
            MeshError: a hop reported an error (its code and message are kept), or failover
                found no route.
        """
        prompt_ids = list(prompt_ids)
        self.sampling = sampling if sampling is not None and not sampling.greedy else None
        budget = check_context(len(prompt_ids), max_tokens, self.max_tokens_total,
                               what="the conversation's reserved context")
        if not self._open:
            await self.open()
        result = ChatResult(prompt_ids=prompt_ids)
        keep = self.reused_prefix(prompt_ids)
        if keep < len(self.cached):
            try:
                await self._truncate(keep)
            except MeshError as exc:
                if getattr(exc, "code", None) not in FAILOVER_CODES:
                    raise
                self.ledger.forget_after(keep)
                await self._failover(exc, in_flight=keep)
        t0 = time.perf_counter()
        eos = set(eos_ids)  # speculation verifies greedy choices: sampled generation decodes plainly
        spec = self._start_speculation() if self.speculate and self.sampling is None else None
        # the drafter reads the prompt while the mesh does, and while plain steps run if it is
        # slower; not when the policy, from earlier conversations on this route, would not draft
        # (on loopback the draft model's prefill only takes CPU from the hops)
        warm = spec is not None and self.policy.choose(self.draft_tokens) > 0
        self._warm = asyncio.ensure_future(self.drafter.prefill(prompt_ids)) if warm else None
        try:
            ids, _ = await self._audited_step(prompt_ids[keep:], result, prefill=True)
            result.ttft_ms = (time.perf_counter() - t0) * 1e3
            await self._decode_all(result, prompt_ids, ids, budget=budget, eos=eos, on_token=on_token, spec=spec)
        finally:
            if self._warm is not None:  # a failed step's error is the one to see
                await asyncio.gather(self._warm, return_exceptions=True)
                self._warm = None
            if self.drafter is not None:  # no drafting ahead past the reply
                await self.drafter.stop_ahead()
        result.route = self.hop_stats()
        result.failovers = list(self.failovers)
        result.detections = list(self.detections)
        result.unverified = self.unverified_hops()
        result.speculative = spec.to_dict() if spec else {}
        return result

    def unverified_hops(self) -> list[dict]:
        """Hops of the current route whose output no spot-check has verified, each with why:
        ``{"peer", "layers", "reason"}`` (no other peer serves its layers at the route's precision
        and weights, spot-checks are off, sampled tokens, a conversation longer than one step
        frame, or not checked yet). Peers on the client's ``allow_ids`` are trusted."""
        out = []
        trusted = self.client.allow_ids or frozenset()
        for i, hop in enumerate(self.route.hops):
            if hop.peer_id in trusted or self.audit.mark(hop) > 0:
                continue
            disputed = self.audit.disputed_by(hop.peer_id, self.client.backed_off())
            if disputed:
                why = f"peer {disputed[0][:12]} disagrees with its output and no third peer can settle it"
            elif not spotcheck.alternates(self.client, self.route, hop):
                why = (f"no other peer serves these layers at {self.route.compat_key[1]} with these weights, "
                       f"so nothing can check them")
            elif self.audit.rate <= 0:
                why = "spot-checks are off"
            elif i == len(self.route.hops) - 1 and self.sampling is not None:
                why = "sampled tokens are not checked"
            elif len(self.cached) > self.max_step_tokens:
                why = (f"the conversation is longer than one step frame ({self.max_step_tokens} positions), "
                       f"which a spot-check recomputes at once, so it cannot be checked")
            else:
                why = "not checked yet"
            out.append({"peer": hop.peer_id, "layers": hop.layers.cli(), "reason": why})
        return out

    def hop_stats(self) -> list[dict]:
        """Per-hop compute ms/token (from the hops' traces) and network ms/token.

        Network time is the client-measured step time minus all hops' compute, split across
        the links into each hop in proportion to their measured RTTs (client->hop 1 and the
        way back count for the first and last hop). See docs/architecture.md and
        :meth:`~meshinfer.client.results.StepTimes.hop_stats`.
        """
        return self.times.hop_stats(self.client, self.route)
