"""Sending a conversation's steps to its hops: opening and closing it on each hop, truncating,
sending chunks to the first hop, and awaiting the last hop's token (:class:`HopSteps`)."""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

from meshinfer.core.errors import LyingPeer, MeshError, PeerUnavailable, ProtocolError
from meshinfer.wire import convkeys, discovery, plausible, tensors
from meshinfer.wire.protocol import MAX_VERIFY_TOKENS
from meshinfer.wire.transport import Link, remote_error

#: Most floats of a hop's evidence the client decodes (``weigh_evidence``): a 512-position step
#: of a model 8,192 wide; larger evidence is refused as unreadable.
MAX_EVIDENCE_ELEMENTS = 512 * 8192

#: A step's deadline: this floor plus DEADLINE_FACTOR x the route's estimated time for the
#: step's tokens (decode estimate x tokens), so a 3,000-token prefill gets proportionally longer.
DEADLINE_FLOOR_S, DEADLINE_FACTOR = 10.0, 4.0
#: Failovers tried for one step before the error reaches the caller.
MAX_FAILOVERS = 3
#: Error codes that mean "this route is broken", answered by failover; others are the caller's.
FAILOVER_CODES = frozenset({"peer_unavailable"})


def _next_hop(hop, avoid: frozenset[str] = frozenset()) -> dict:
    """The ``next`` field of an ``open``/``reroute`` naming ``hop`` (its relays only when it has some,
    so frames to reachable hops keep their old bytes). Relays in ``avoid`` (the client's backed-off
    peers, e.g. a relay that just died) are left out, unless that would leave none."""
    out = {"peer_id": hop.peer_id, "addrs": list(hop.peer.addrs)}
    if hop.peer.relays:
        out["relays"] = [r for r in hop.peer.relays if r not in avoid] or list(hop.peer.relays)
    return out


class HopSteps:
    """The hop-facing half of :class:`~meshinfer.client.conversation.Conversation` (a mixin: it
    uses the conversation's ``client``, ``route``, ``ledger``, ``inbox`` and sequence fields)."""

    async def _open_hop(self, i: int, hops, *, reroute: bool = False) -> None:
        """Open the conversation on hop ``i`` of ``hops`` (``reroute``: the hop keeps its cache and
        learns its new neighbours). A hop that may still hold this conversation from an earlier
        route (it failed by stalling, not by dying, and a later failover chose it again) is told
        to close it first, on the same connection, so the open that follows starts it afresh."""
        self._opening = i
        hop = hops[i]
        link = await self.client.link(hop.peer)
        self.max_step_tokens = min(self.max_step_tokens, link.info.get("max_step_tokens", 512))
        nxt = hops[i + 1] if i + 1 < len(hops) else None
        if not reroute and hop.peer_id in self._opened:
            await link.send("close", conv=self.conv_id)  # frames of one link are handled in order
        kind, layers, prev = "reroute" if reroute else "open", [hop.layers.start, hop.layers.stop], \
            hops[i - 1].peer_id if i else None
        next_field = _next_hop(nxt, self.client.backed_off()) if nxt else None
        await link.request(kind, timeout_s=self.client.request_timeout_s, conv=self.conv_id, layers=layers,
                           max_tokens=self.max_tokens_total, prev=prev, next=next_field,
                           **self.key.open_fields(kind, hop.peer_id, self._seq + 1, layers, self.max_tokens_total, prev,
                                                  next_field))
        self._opened.add(hop.peer_id)

    async def _close_on(self, hops) -> None:
        """Tell each of ``hops`` that still has an open link to free this conversation."""
        for hop in hops:
            self._opened.discard(hop.peer_id)
            link = self.client.open_link(hop.peer_id)
            if link is not None:
                try:
                    await link.send("close", conv=self.conv_id)
                except MeshError:
                    pass

    async def _truncate(self, length: int, hops=None) -> None:
        """Truncate the conversation to ``length`` positions on ``hops`` (default: the route's),
        then in the ledger and the auditor."""
        for hop in hops if hops is not None else self.route.hops:
            link = await self.client.link(hop.peer)
            await link.request("truncate", timeout_s=self.client.request_timeout_s, conv=self.conv_id,
                               length=length)
        self.ledger.truncate(length)
        self.audit.truncate(length)

    async def _send(self, tokens: Sequence[int], start: int, *, want: str, replay: bool = False) -> int:
        """Send one step frame of ``tokens`` at position ``start`` to the first hop; return its seq."""
        self._seq += 1
        first = await self.client.link(self.route.hops[0].peer)
        sampling = self.sampling if want == "token" and self.sampling else None
        extra = {"sampling": sampling.to_wire()} if sampling else {}
        rollback = self.ledger.rolls_back(start) and not replay
        if rollback:
            extra["rollback"] = True  # hops drop the rejected drafts of the step before
        header = convkeys.StepHeader(self.conv_id, self._seq, start, len(tokens), want, sampling, rollback, replay,
                                     convkeys.tokens_digest(tokens))
        await first.send("step", conv=self.conv_id, seq=self._seq, start=start, tokens=list(tokens),
                         want=want, replay=replay, **extra, **self.key.step_fields(header))
        self.ledger.hold(self._seq, start, start + len(tokens))
        return self._seq

    def _deadline_s(self, n_tokens: int) -> float:
        """Seconds a step of ``n_tokens`` may take (see :data:`DEADLINE_FLOOR_S`)."""
        return self.deadline_floor_s + DEADLINE_FACTOR * self.route.estimated_ms_per_token / 1e3 * n_tokens

    async def _await_token(self, seq: int, timeout_s: float, n_tokens: int | None = None) -> tuple[list[int], list]:
        """The chosen ids of step ``seq`` (``n_tokens`` of them for want="tokens", else one) and its trace."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                link, msg_type, f, nbytes = await asyncio.wait_for(self.inbox.get(), max(remaining, 0.001))
            except asyncio.TimeoutError:
                raise PeerUnavailable(f"no token for step {seq} within {timeout_s:.1f} s") from None
            self._inbox_bytes -= nbytes
            if msg_type == "closed":
                if f in self.route.peer_ids:
                    raise PeerUnavailable(f"the connection to hop {f[:12]} closed")
                continue
            if link is None or link.remote_id not in self.route.peer_ids:
                continue  # only the route's hops speak for this conversation (a stranger knowing its id does not)
            msg_seq = f.get("seq", int, None)
            if msg_seq is not None and msg_seq < self._min_seq:
                continue  # a late reply from before a failover
            if msg_type == "error":
                raise self._credible(remote_error(f), link, f)
            if msg_seq != seq:
                continue
            if link.remote_id != self.route.hops[-1].peer_id:
                raise ProtocolError(f"token for step {seq} came from {link.remote_id}, not the last hop")
            self._reply_length = f.get("length", int, None)
            if n_tokens is None:
                return [f.int("token", lo=0, hi=1 << 31)], f.get("trace", list, [])
            ids = f.int_list("tokens", lo=0, hi=1 << 31, max_len=MAX_VERIFY_TOKENS)
            if len(ids) != n_tokens:
                raise ProtocolError(f"step {seq} carried {n_tokens} tokens; the last hop chose {len(ids)}")
            return ids, f.get("trace", list, [])

    def _credible(self, exc: MeshError, link: Link, f=None) -> MeshError:
        """``exc`` as far as the reporting hop (``link``'s peer) can know it (``f``: the error frame).

        A :class:`LyingPeer` stands when its ``suspect`` is the hop just before the reporter (the
        only hop whose hidden states the reporter checks), and, when the frame carries
        ``evidence`` of implausible values, when that evidence holds (:func:`weigh_evidence`);
        without evidence it stands as ``unproven`` (``reporter`` set), which costs the suspect a
        backoff, not a ban;
        otherwise it becomes a :class:`LyingPeer` naming the reporter, which accused a hop it
        cannot have checked, or showed what the accused did not sign or what passes the checks. A :class:`PeerUnavailable`
        naming a ``peer`` (the reporter's link to its next hop closed) keeps that name only when
        it is the hop just after the reporter, and its ``relay`` only when that hop lists it; every
        :class:`PeerUnavailable` from a hop carries the reporter's id as ``reporter``.
        """
        hops = self.route.hops
        if isinstance(exc, PeerUnavailable):
            nxt = next((b for a, b in zip(hops, hops[1:]) if a.peer_id == link.remote_id), None)
            if exc.peer is not None and (nxt is None or nxt.peer_id != exc.peer):
                exc = PeerUnavailable(str(exc))
            elif exc.relay not in (None, *(nxt.peer.relays if nxt is not None else ())):
                exc = PeerUnavailable(str(exc), peer=exc.peer)
            exc.reporter = link.remote_id  # whose word it is (see Failover._find_failed)
            return exc
        if not isinstance(exc, LyingPeer) or exc.suspect is None:
            return exc
        accused = next((a for a, b in zip(hops, hops[1:]) if a.peer_id == exc.suspect and b.peer_id == link.remote_id),
                       None)
        if accused is not None:
            evidence = None if f is None else f.get("evidence", dict, None)
            if evidence is None:  # nothing to check: the hop's word (Failover._exclude_liar weighs it)
                exc.reporter, exc.unproven = link.remote_id, True
                return exc
            return weigh_evidence(exc, self.conv_id, f.get("seq", int, -1), accused, link.remote_id, evidence)
        return LyingPeer(f"peer {(link.remote_id or '?')[:12]} blamed peer {exc.suspect[:12]}, whose output it "
                         f"does not receive: {exc}", suspect=link.remote_id)

    async def _step(self, tokens: Sequence[int], *, want: str = "token") -> tuple[list[int], list]:
        """Append ``tokens`` (chunked) to the conversation; return the chosen ids and the trace.

        ``want="token"``: one id, the next token. ``want="tokens"`` (one chunk, speculative
        verification): the greedy choice after each of ``tokens``.

        Retries through :meth:`_failover` up to :data:`MAX_FAILOVERS` times.
        """
        for attempt in range(MAX_FAILOVERS + 1):
            self._min_seq = self._seq + 1
            start = len(self.cached)
            try:
                seq = 0
                for i in range(0, len(tokens), self.max_step_tokens):
                    chunk = tokens[i:i + self.max_step_tokens]
                    seq = await self._send(chunk, start + i,
                                           want=want if i + self.max_step_tokens >= len(tokens) else "none")
                self.ledger.send(tokens)
                ids, trace = await self._await_token(seq, self._deadline_s(len(tokens)),
                                                     len(tokens) if want == "tokens" else None)
                self.ledger.confirm()
                return ids, trace
            except MeshError as exc:
                self.ledger.drop_failed(start)
                if getattr(exc, "code", None) not in FAILOVER_CODES or attempt == MAX_FAILOVERS:
                    raise
                await self._failover(exc, in_flight=start + len(tokens))
        raise AssertionError("unreachable")


def weigh_evidence(exc: LyingPeer, conv_id: str, seq: int, accused, reporter: str, evidence: dict) -> LyingPeer:
    """``exc`` (a hop's report that its previous hop, ``accused``, sent implausible hidden states
    in step ``seq``) when its ``evidence`` holds: hidden states (``hidden``, a tensor frame) the
    accused signed (``sig`` over ``conv_id``, ``seq``, ``start`` and their row digests,
    :func:`meshinfer.wire.discovery.check_step`) that fail
    :func:`meshinfer.wire.plausible.check_values`. Otherwise a :class:`LyingPeer` naming the
    ``reporter``: it showed what the accused never signed, or values that pass the checks."""
    who = f"peer {(reporter or '?')[:12]} accused peer {accused.peer_id[:12]} of implausible hidden states"
    start, sig = evidence.get("start"), evidence.get("sig")
    try:
        x = tensors.tensor_from_wire(evidence.get("hidden"), max_elements=MAX_EVIDENCE_ELEMENTS)
        if type(start) is not int or not 0 <= start < 1 << 62 or not 0 <= seq < 1 << 62 \
                or not isinstance(sig, bytes) or x.dim() != 3 or x.shape[0] != 1:
            raise ProtocolError("malformed evidence")
        signed = discovery.check_step(accused.peer.public_key, sig, conv_id, seq, start, tensors.row_digests(x))
    except (ProtocolError, TypeError, ValueError) as err:
        return LyingPeer(f"{who}, with evidence that does not read: {err}", suspect=reporter)
    if not signed:
        return LyingPeer(f"{who}, with hidden states it did not sign", suspect=reporter)
    try:
        plausible.check_values(x, sender=accused.peer_id)
    except LyingPeer:
        return exc
    return LyingPeer(f"{who}, but the signed hidden states it shows pass the checks", suspect=reporter)

