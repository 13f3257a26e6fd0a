"""Replacing a conversation's dead or lying hops: probing for the failed hop, planning a new
route that keeps the others' caches, replaying; and the lying-peer checks after each step
(:class:`Failover`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from meshinfer.client import spotcheck
from meshinfer.client.results import ChatResult
from meshinfer.client.speculative import accept
from meshinfer.core.errors import LyingPeer, MeshError, NoRoute, PeerUnavailable

log = logging.getLogger(__name__)

#: Lying hops excluded during one step before the error reaches the caller.
MAX_DETECTIONS = 3


class Failover:
    """The repair half of :class:`~meshinfer.client.conversation.Conversation` (a mixin: it uses
    the conversation's ``client``, ``route``, ``ledger``, ``audit`` and hop methods)."""

    # ------------------------------------------------------------------ dead hops
    async def probe(self, hop) -> int | None:
        """Positions ``hop`` holds for this conversation, or None when it does not answer
        (:meth:`_probe`; spot-checks ask it to find a hop that miscounts)."""
        return await self._probe(hop)

    async def _probe(self, hop) -> int | None:
        """Positions ``hop`` holds for this conversation, or None when it does not answer."""
        link = self.client.open_link(hop.peer_id)
        if link is None:
            return None
        try:
            _, f = await link.request("probe", timeout_s=min(2.0, self.client.request_timeout_s),
                                      conv=self.conv_id)
            return f.int("length", lo=0, hi=1 << 40)
        except MeshError:
            return None

    async def _find_failed(self, in_flight: int, cause: MeshError | None = None) -> set[str]:
        """Peer ids of the hops to replace: those that do not answer a probe, else the first that
        does not hold ``in_flight`` positions (the step did not get past it).

        When ``cause`` is a hop's report that its connection to the next hop closed (a
        :class:`PeerUnavailable` naming ``peer``, checked by ``_credible``), the step was lost
        between two hops that may both be fine: only the hops that do not answer are replaced,
        and the relay the connection ran through (``cause.relay``, not a hop) is named as failed,
        so it is backed off and the next hop is reached another way.

        A hop's reports that no probe bears out (every hop answers) are counted per reporter, in
        the client's :class:`~meshinfer.client.reports.ReportLedger` (``client.reports``), which
        outlives conversations; from the ``UNCONFIRMED_REPORTS_BLAMED``-th on, the reporter is
        replaced, at that count with its next hop (:meth:`_count_report`): the link between them
        broke again, or the reporter says so falsely, and the client cannot tell which. A hop on
        the route that made reports up used to cost :data:`~meshinfer.client.hops.MAX_FAILOVERS`
        failovers a step, every step, and was chosen again."""
        lengths = await asyncio.gather(*(self._probe(h) for h in self.route.hops))
        failed = {h.peer_id for h, n in zip(self.route.hops, lengths) if n is None}
        relay = {cause.relay} if isinstance(cause, PeerUnavailable) and cause.relay else set()
        reporter = self._countable_reporter(cause)
        if not failed and reporter is not None:
            blamed = self._count_report(reporter, self._next_hop(reporter))
            if blamed:
                return blamed | relay
        if isinstance(cause, PeerUnavailable) and cause.peer is not None:
            return failed | relay
        if not failed:  # everyone answers: the first hop that has not finished the step is stuck
            # (!=, not <: a hop that never got a step after rejected drafts still holds them, maybe
            # more positions than the step would leave; a hop that finished holds exactly in_flight)
            hops = self.route.hops
            i = next((i for i, n in enumerate(lengths) if n != in_flight), None)
            if i is not None:
                before = hops[i - 1].peer_id if i else None  # finished the step; the step was lost after it
                counted = before is not None and before != getattr(cause, "reporter", None)  # once per event
                failed |= (self._count_report(before, hops[i].peer_id) if counted else set()) or {hops[i].peer_id}
        return failed

    def _countable_reporter(self, cause: MeshError | None) -> str | None:
        """The hop that reported ``cause`` when it is a ``peer_unavailable`` report to count, else None.

        A report naming a relay that is not backed off yet is not counted: the relay is blamed
        for it. Counted, a relay that cut a circuit twice got both honest hops backed off."""
        reporter = getattr(cause, "reporter", None) if isinstance(cause, PeerUnavailable) else None
        if reporter is None:
            return None
        if cause.relay is not None and cause.relay not in self.client.backed_off():
            return None  # the relay takes this one (it is backed off); a report naming it again counts
        return reporter

    def _count_report(self, hop_id: str, next_id: str | None) -> frozenset[str]:
        """Count one step lost between hop ``hop_id`` and its next hop ``next_id`` while every hop
        answers its probe (``hop_id`` reported the link gone, or finished the step and its next hop
        never got it: which of the two lies cannot be told); return whom to replace for it
        (:meth:`~meshinfer.client.reports.ReportLedger.blame`: nobody before the
        ``UNCONFIRMED_REPORTS_BLAMED``-th of ``hop_id`` in the client's memory). A hop that
        withheld its output got each next hop it was given blamed alone, and was never blamed
        itself; one that made a false report in each new conversation was never counted twice.
        ``unconfirmed_reports`` keeps this conversation's share of the counts."""
        self.unconfirmed_reports[hop_id] = self.unconfirmed_reports.get(hop_id, 0) + 1
        return self.client.reports.blame(hop_id, next_id)

    def _next_hop(self, hop_id: str) -> str | None:
        """The hop after ``hop_id`` on the route (the one its reports are about), or None."""
        ids = list(self.route.peer_ids)
        i = ids.index(hop_id) if hop_id in ids else len(ids)
        return ids[i + 1] if i + 1 < len(ids) else None

    async def _failover(self, exc: MeshError, *, in_flight: int, failed: set[str] | None = None,
                        fallback: set[str] | None = None) -> set[str]:
        """Replace failed hops (found by probing unless given), keep the others' caches, replay
        the confirmed tokens; return the hops replaced. When no route avoids ``failed``, the
        hops in ``fallback`` are replaced instead, if given.

        Raises:
            NoRoute: no route avoids the failed hops (nor the fallback); they are backed off.
        """
        t0 = time.perf_counter()
        failed = failed if failed is not None else await self._find_failed(in_flight, exc)
        # a hop behind a dead relay is fine: the relay is backed off, the hop reopened
        culprits = {self.client.culprit(pid) for pid in failed}
        old = self.route
        try:
            new = await asyncio.wait_for(self.client.plan(compat_key=old.compat_key, exclude=frozenset(culprits)),
                                         self.client.request_timeout_s * 3)
        except NoRoute:
            if fallback is not None:
                return await self._failover(exc, in_flight=in_flight, failed=fallback)
            self._back_off(culprits)
            raise
        except asyncio.TimeoutError:
            self._back_off(culprits)
            raise PeerUnavailable("no new route found in time after a hop failed") from exc
        self._back_off(culprits)
        log.warning("conversation %s: %s; failing over from %s", self.conv_id[:12], exc,
                    ", ".join(p[:12] for p in failed) or "an unknown hop")
        kept = {(h.peer_id, h.layers) for h in old.hops if h.peer_id not in failed} & \
            {(h.peer_id, h.layers) for h in new.hops}
        await self._close_on([h for h in old.hops if (h.peer_id, h.layers) not in kept and h.peer_id not in failed])
        self.route = new
        self.max_step_tokens = 512
        for i, hop in enumerate(new.hops):
            await self._open_hop(i, new.hops, reroute=(hop.peer_id, hop.layers) in kept)
        await self._truncate(self.confirmed, [h for h in new.hops if (h.peer_id, h.layers) in kept])
        history = self.cached[:self.confirmed]
        self._min_seq = self._seq + 1
        for i in range(0, len(history), self.max_step_tokens):
            await self._send(history[i:i + self.max_step_tokens], i, want="none", replay=True)
        self.failovers.append({"failed": sorted(failed), "reason": str(exc), "replayed_tokens": len(history),
                               "kept_hops": len(kept), "seconds": round(time.perf_counter() - t0, 3)})
        return failed

    def _back_off(self, peer_ids: set[str]) -> None:
        """Mark each of ``peer_ids`` failed in the client (its backoff)."""
        for pid in peer_ids:
            self.client.mark_failed(pid)

    # ------------------------------------------------------------------ lying hops
    async def _audited_step(self, tokens: Sequence[int], result: ChatResult, *, prefill: bool = False,
                            drafts: Sequence[int] | None = None) -> tuple[list[int], list]:
        """:meth:`_step`, then the lying-peer checks; a liar is excluded and the step redone.

        With ``drafts`` (the tail of ``tokens``) the step verifies them: the accepted ids are
        returned and the rejected positions dropped from ``cached`` before the checks.
        On :class:`LyingPeer` the tokens after the rollback point are dropped from ``result``
        (``on_token`` has already seen them) and regenerated over a route without the liar
        (plainly: drafts are never trusted tokens).
        """
        tokens = list(tokens)
        for attempt in range(MAX_DETECTIONS + 1):
            start = len(self.cached)
            try:
                ids, trace = await self._step(tokens, want="tokens" if drafts else "token")
                held = len(self.cached)  # positions every hop holds after the step
                if drafts:
                    ids = accept(drafts, ids)
                    self.ledger.keep_accepted(start + len(ids))  # rejected drafts: the hops roll them back later
                await self._audit_step(ids, held=held, prefill=prefill)
                return ids, trace
            except LyingPeer as exc:
                if attempt == MAX_DETECTIONS or exc.suspect not in self.route.peer_ids:
                    raise
                tokens = await self._exclude_liar(exc, self.cached[:start] + tokens, result)
                prefill, drafts = True, None  # the new route's hops are checked from their first position
        raise AssertionError("unreachable")

    async def _audit_step(self, ids: list[int], *, held: int, prefill: bool) -> None:
        """Check the step just answered: the last hop's position count (``held``: positions the
        step left on every hop, rejected drafts included), then spot-checks of kept positions.

        Raises:
            LyingPeer: naming the hop at fault.
        """
        n = len(self.cached)
        for i, token in enumerate(ids):  # the choice after each kept position of the step
            self.audit.emitted[n - len(ids) + i] = token
        length, self._reply_length = self._reply_length, None
        if length is not None and length != held:
            suspect = await spotcheck.find_length_liar(self, held, length)
            raise LyingPeer(f"the last hop holds {length} positions after the step; the conversation has {held}",
                            suspect=suspect)
        for i in self.audit.hops_to_check(self.route.hops, after_prefill=prefill):
            try:
                await spotcheck.spot_check(self, i)
            except LyingPeer as exc:
                if exc.suspect in self.route.peer_ids:
                    raise
                self.client.ban(exc.suspect, str(exc))  # a checker that lied: the route stands
                self.detections.append({"peer": exc.suspect, "layers": None, "reason": str(exc),
                                        "kept_tokens": len(self.cached), "dropped_tokens": 0})

    async def _exclude_liar(self, exc: LyingPeer, sent: list[int], result: ChatResult) -> list[int]:
        """Ban the liar (or, for an ``unproven`` accusation, weigh it: :meth:`_replaced_for`),
        roll back to its last verified position, fail over; return the tokens to send next
        (``sent`` is every token the route was given, the failed step's included)."""
        hop = next(h for h in self.route.hops if h.peer_id == exc.suspect)
        verified, n_prompt = self.audit.mark(hop), len(result.prompt_ids)
        failed = self._replaced_for(exc)
        trusted = min(len(sent), max(n_prompt, verified + 1))  # tokens chosen from verified output, or given
        keep = min(verified, trusted - 1, self.confirmed)  # positions the hops keep
        self.ledger.roll_back(keep)
        self.audit.truncate(keep)
        # nobody else serving the accused's layers, one hop's word replaces the accuser instead
        # (a liar used to end the conversation by accusing a peer that has no twin)
        fallback = {exc.reporter} if exc.unproven and exc.reporter in self.route.peer_ids and exc.reporter not in failed \
            else None
        failed = await self._failover(exc, in_flight=keep, failed=failed, fallback=fallback)
        del result.token_ids[max(0, trusted - n_prompt):]
        self.detections.append({"peer": exc.suspect, "layers": hop.layers.cli(), "reason": str(exc),
                                "kept_tokens": trusted, "dropped_tokens": len(sent) - trusted,
                                "proven": not exc.unproven, "replaced": sorted(failed)})
        return sent[keep:trusted]

    def _replaced_for(self, exc: LyingPeer) -> set[str]:
        """The hops to replace for ``exc``, banning whom it proves a liar. A detection the client
        made or checked itself bans the suspect. A hop's accusation of its previous hop with
        nothing to check (``unproven``: an unsigned or unreadable step, one out of order, fields
        the client did not sign) used to ban the accused on the accuser's word, so a lying hop
        got one honest peer banned per accusation; now it is counted in the client's
        ``accusations`` (:meth:`~meshinfer.client.reports.ReportLedger.accuse`): the accused is
        backed off, the accuser too from its second such accusation, and only a peer accused by
        two independent witnesses is banned (``reports.witnesses``: identities on one other
        machine are one witness)."""
        if not exc.unproven or exc.reporter is None:
            self.client.ban(exc.suspect, str(exc))
            return {exc.suspect}
        host = self.client.host
        failed, ban = self.client.accusations.accuse(exc.reporter, exc.suspect, host(exc.reporter), host(exc.suspect))
        if ban:
            self.client.ban(exc.suspect, f"{exc} (accused by {len(self.client.accusations.accusers(exc.suspect))} "
                                         f"hops, independent witnesses)")
        return set(failed)

