"""The step data path on a peer: a ``step`` frame is checked and queued in its conversation,
run by the conversation's worker through the scheduler, and its output forwarded to the next
hop as hidden states or, on the last hop, sent to the client as the chosen token.

Steps of one conversation run in order (one worker task each); the scheduler batches the
decode steps of different conversations into one forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from meshinfer.core.errors import (CacheFull, InvalidInput, LyingPeer, MeshError, PositionError, ProtocolError,
    RateLimited, Unauthenticated)
from meshinfer.core.logs import context
from meshinfer.engine.kernels.step_ops import all_finite
from meshinfer.engine.kv_cache import KVCache
from meshinfer.engine.sampling import pick_token
from meshinfer.peer import limits
from meshinfer.peer.limits import client_host
from meshinfer.peer.conversations import STATEMENT_BYTES_PER_TOKEN, Conv
from meshinfer.wire import convkeys, discovery, plausible, protocol, tensors
from meshinfer.wire.transport import Link

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer

#: Weight of each served one-position step's compute time in the advertised ms per token (an
#: exponential average from the warm-up's measurement): the warm-up runs once, often while other
#: processes load on the same machine, and routes are planned from the advert, so it follows
#: what steps really cost (about the last 10). Steps of several positions (prefill,
#: verification) are not per-token costs and do not count, and a step counts the time of its
#: own pass on the device thread only: not its wait behind another conversation's prefill, a
#: batching hold or a verify, which a client could otherwise queue to inflate the advert.
COMPUTE_EWMA_WEIGHT = 0.2
#: Half-life, seconds, of the advertised cost's return toward the peer's idle cost while it
#: serves no decode step (:class:`ComputeCost`). A minute: longer than a burst of batched
#: conversations, short enough that a peer is not avoided for the rest of the day.
COMPUTE_IDLE_HALF_LIFE_S = 60.0
#: Half-life, seconds of serving decode steps, of that idle cost's (the floor's) rise toward the
#: advertised value (:class:`ComputeCost`): ten minutes of steady serving at a slower speed move
#: it half way, while a burst of a few seconds moves it by under 1%. Each step counts the time
#: since the one before, at most 1 s, so idle time does not count as serving.
COMPUTE_FLOOR_HALF_LIFE_S = 600.0
#: a child of the node's logger: configuring ``meshinfer.peer.node`` configures all of a peer
log = logging.getLogger("meshinfer.peer.node.steps")


class ComputeCost:
    """What a peer's advert says one token costs on its whole range, milliseconds.

    :meth:`set` takes a measurement (the warm-up's); :meth:`observe` folds in a served
    one-position step over the whole range (weight :data:`COMPUTE_EWMA_WEIGHT`; ``Steps.run``
    ignores steps over part of it, which a client chooses and which would set the floor).
    Between observations the value relaxes toward the floor (the idle machine's cost), with
    half-life :data:`COMPUTE_IDLE_HALF_LIFE_S`: a peer slowed by a burst of real load (many
    batched conversations, another process) used to stay avoided until a decode step came to
    measure it again, and none came, since routes avoided it. The floor is the lowest value
    seen, and follows served steps up with half-life :data:`COMPUTE_FLOOR_HALF_LIFE_S` of
    serving time, so a machine that became slower for good (a throttled CPU, a new neighbour)
    stops relaxing to its old speed. Times: ``time.monotonic()`` seconds.
    """

    def __init__(self) -> None:
        self.ms = self.floor_ms = 0.0
        self.at = time.monotonic()

    def set(self, ms: float, now: float | None = None) -> None:
        """A measurement of ``ms`` per token taken at ``now``: the value from now on."""
        self.ms, self.at = ms, time.monotonic() if now is None else now
        self.floor_ms = ms if self.floor_ms <= 0 else min(self.floor_ms, ms)

    def observe(self, ms: float, now: float | None = None) -> None:
        """A served decode step's own pass took ``ms``: move the value toward it, and the
        floor up toward the new value (half-life :data:`COMPUTE_FLOOR_HALF_LIFE_S` of serving)."""
        now = time.monotonic() if now is None else now
        old, serving_s = self.value(now), min(max(0.0, now - self.at), 1.0)
        self.set(ms if old <= 0 else old + COMPUTE_EWMA_WEIGHT * (ms - old), now)
        self.floor_ms += (self.ms - self.floor_ms) * (1 - 0.5 ** (serving_s / COMPUTE_FLOOR_HALF_LIFE_S))

    def value(self, now: float | None = None) -> float:
        """The cost to advertise at ``now``, ms per token (0 before any measurement)."""
        idle_s = max(0.0, (time.monotonic() if now is None else now) - self.at)
        return self.floor_ms + (self.ms - self.floor_ms) * 0.5 ** (idle_s / COMPUTE_IDLE_HALF_LIFE_S)


@dataclass(frozen=True)
class QueuedStep:
    """One checked ``step`` frame, waiting in its conversation's queue for the worker.

    Attributes:
        seq: the step's number, echoed in its replies and errors.
        start: position of the step's first token.
        want: what the client asked the last hop for (:data:`meshinfer.wire.protocol.STEP_WANTS`).
        trace: the hops' timings so far, each a dict (``trace_from_wire``).
        received_at: ``time.perf_counter()`` when the frame was queued, seconds.
        replay: the frame was a failover replay (passed on to the next hop as such).
        x: token ids ``(1, T)`` int64 on the first hop, else hidden states ``(1, T, C)`` float32;
            None for a resend of positions this hop kept (:attr:`kept_tokens` of them).
        kept_tokens: positions to resend from this hop's log, when ``x`` is None.
        sampling: the last hop's sampling settings, or None (greedy).
        rollback: the step starts below the hop's length (speculative decoding).
        header: what the client signed for this step (passed on with ``csig``).
        csig: the client's signature of ``header``.
        host: the client host whose share of queued bytes the step counts in (set by ``enqueue``).
    """

    seq: int
    start: int
    want: str
    trace: list
    received_at: float
    replay: bool
    x: torch.Tensor | None = None
    host: str = ""  # the conversation's client host when queued, whose share of queued bytes it counts in
    kept_tokens: int = 0
    sampling: Any = None
    rollback: bool = False
    header: convkeys.StepHeader | None = None
    csig: bytes = b""

    @property
    def nbytes(self) -> int:
        """Bytes of ``x`` this step holds while queued (0 for a resend)."""
        return 0 if self.x is None else self.x.nbytes


async def warmup(peer: Peer, *, prompt_tokens: int = 16) -> float:
    """Run one prefill and one decode on ``peer``'s shard, on dummy input; return decode ms per token.

    A cold GPU compiles kernels on its first request, so peers warm up before announcing.
    """
    def work() -> float:
        cache = KVCache(peer.shard.range, peer.cfg.num_key_value_heads, peer.cfg.head_dim,
                        dtype=peer.shard.dtype, device=peer.shard.device, max_tokens=prompt_tokens + 8)
        if peer.shard.is_first:
            x = torch.zeros(1, prompt_tokens, dtype=torch.int64)
            step = torch.zeros(1, 1, dtype=torch.int64)
        else:
            x = torch.zeros(1, prompt_tokens, peer.cfg.hidden_size)
            step = torch.zeros(1, 1, peer.cfg.hidden_size)
        peer.shard(x, 0, cache)
        times = []
        for i in range(3):
            t0 = time.perf_counter()
            peer.shard(step, prompt_tokens + i, cache)
            times.append(time.perf_counter() - t0)
        cache.free()
        return min(times) * 1e3

    t0 = time.perf_counter()
    peer.compute_ms_per_token = await peer.executor.run(work)
    log.info("warm-up done in %.2f s: decode %.1f ms/token for layers %s",
             time.perf_counter() - t0, peer.compute_ms_per_token, peer.shard.range.cli())
    return peer.compute_ms_per_token


def check_positions(conv: Conv, seq: int, start: int, tokens: int, rollback: bool) -> None:
    """Check that a step of ``tokens`` positions from ``start`` follows the conversation.

    Raises:
        PositionError: it does not start where the last step ended (nor rolls back to below
            it, by fewer than :data:`meshinfer.wire.protocol.MAX_VERIFY_TOKENS`).
        CacheFull: it would pass the tokens the conversation reserved.
    """
    if start != conv.expected_start and not (rollback and start < conv.expected_start):
        raise PositionError(f"step {seq} starts at position {start}; conversation {conv.conv_id} "
                            f"expects position {conv.expected_start}")
    if rollback and conv.expected_start - start >= protocol.MAX_VERIFY_TOKENS:
        raise PositionError(f"step {seq} rolls back {conv.expected_start - start} positions; a rollback drops "
                            f"the rejected drafts of one step, fewer than {protocol.MAX_VERIFY_TOKENS}")
    if start + tokens > conv.reserved_tokens:
        raise CacheFull(f"step {seq} would grow the conversation to {start + tokens} tokens; "
                        f"it reserved {conv.reserved_tokens}")


def step_wants(f, seq: int, tokens: int) -> tuple[str, Any]:
    """``want`` and ``sampling`` of a step frame of ``tokens`` positions.

    Raises:
        ProtocolError: an unknown ``want``.
        InvalidInput: ``want="tokens"`` with too many positions, or with sampling.
    """
    want = f.str("want", "none")
    if want not in protocol.STEP_WANTS:
        raise ProtocolError(f"step {seq}: want {want[:40]!r} is not one of {', '.join(protocol.STEP_WANTS)}")
    if want == "tokens" and tokens > protocol.MAX_VERIFY_TOKENS:
        raise InvalidInput(f"step {seq}: want=tokens allows at most {protocol.MAX_VERIFY_TOKENS} tokens "
                           f"per step, got {tokens}")
    sampling = protocol.sampling_from_wire(f.get("sampling", dict, None), f"step {seq}")
    if want == "tokens" and sampling is not None:
        raise InvalidInput(f"step {seq}: want=tokens verifies greedy drafts; it cannot carry sampling")
    return want, sampling


def out_of_order(link: Link, conv: Conv, seq: int) -> bool:
    """Whether step ``seq`` on ``link`` is not above the last step ``conv`` took
    (``Conv.last_seq``, which starts below the floor its client signed into the open or reroute,
    ``Conv.min_seq``): the client's seqs only grow and hops pass them on in order, so such a
    step is an old one sent again, which would put a stale statement back. A step below the
    floor, from before the client's last open or reroute, is dropped without blame: a kept hop
    may still be finishing steps queued before a failover, and a new previous hop that sends an
    old step of the client on purpose (found by an attack run: the honest hop after it was
    blamed) gains nothing. Otherwise, from the previous hop, the client is told, naming that
    hop (with no ``seq``: the client skips errors of steps before the one it awaits, and this
    one is about no step it sent); from the client's own connection it is refused.

    Raises:
        ProtocolError: an old step on the conversation's own connection.
    """
    if seq > conv.last_seq:
        return False
    if link is conv.owner:
        raise ProtocolError(f"step {seq} is not above step {conv.last_seq}, the last this hop took")
    if seq < conv.min_seq:  # from before the client's last open or reroute: a kept previous hop
        log.info("conversation %s: step %d from before the reroute (seq %d on); dropped",  # may still
                 conv.conv_id[:12], seq, conv.min_seq)  # be finishing steps queued then: no blame
        return True
    exc = LyingPeer(f"previous hop {(conv.prev_id or '?')[:12]} sent step {seq} after step {conv.last_seq}",
                    suspect=conv.prev_id)
    log.warning("conversation %s: %s; dropped", conv.conv_id[:12], exc)
    conv.owner.post("error", conv=conv.conv_id, code=exc.code, message=str(exc), suspect=exc.suspect)
    return True


class Steps:
    """The step data path of ``peer``.

    Attributes:
        queued_bytes: bytes of the steps waiting in all conversations' queues (their ``x``),
            at most :data:`limits.MAX_QUEUED_BYTES`.
        queued_by_host: the same per client host, each at most its share
            (:data:`limits.QUEUED_BYTES_HOST_SHARE`).
    """

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.queued_bytes = 0
        self.queued_by_host: dict[str, int] = {}  # client host -> bytes of its conversations' queued steps

    async def on_step(self, link: Link, f) -> None:
        conv = self.peer.convs.get(f.str("conv"))
        seq = f.int("seq", lo=0, hi=protocol.MAX_SEQ)
        if conv is None:
            raise InvalidInput(f"step {seq}: conversation {f.str('conv')[:40]!r} is not open on this peer")
        allowed = link is conv.owner if conv.run.start == 0 else link.remote_id == conv.prev_id
        if not allowed:
            raise ProtocolError(f"step {seq}: this connection may not send steps for conversation {conv.conv_id}")
        if link is conv.owner and link.role != "client":  # a "peer" driving its own conversation is a client
            self.peer._charge(link, "step")
        start = f.int("start", lo=0, hi=self.peer.cfg.max_position_embeddings)
        x = await self.step_input(link, conv, f, seq)
        if x is None:
            return
        if out_of_order(link, conv, seq):
            return
        want, sampling = step_wants(f, seq, x.shape[1])
        rollback, replay = f.get("rollback", bool, False), f.get("replay", bool, False)
        digests = tensors.row_digests(x) if conv.run.start > 0 else b""
        header = convkeys.StepHeader(conv.conv_id, seq, start, x.shape[1], want, sampling, rollback, replay,
                                     payload_digest(link, conv, f, x, digests))
        csig = f.get("csig", bytes, b"")
        if link is conv.owner and not header.check(conv.client_key, csig):
            raise Unauthenticated(f"step {seq}: 'csig' is not the conversation key's signature of this step")
        if link is not conv.owner and not self.accept_from_previous_hop(link, conv, f, seq, start, x, digests,
                                                                        header):
            return
        if conv.run.start > 0 and not statements_fit(link, conv, seq, digests, checked_sig(link, conv, f)):
            return
        if replay and start + x.shape[1] <= conv.cache.length <= conv.expected_start:
            # failover replay of positions this hop kept: pass its logged output on, compute nothing
            self.enqueue(conv, QueuedStep(seq, start, want, [], time.perf_counter(), True, kept_tokens=x.shape[1],
                                          header=header, csig=csig))
            if conv.run.start > 0:  # a new previous hop's log must match what it sent now
                conv.keep_signed(seq, start, digests, checked_sig(link, conv, f), replay=True)
            conv.last_seq = seq
            return
        check_positions(conv, seq, start, x.shape[1], rollback)
        trace = protocol.trace_from_wire(f.get("trace", list, []), "step")
        self.enqueue(conv, QueuedStep(seq, start, want, trace, time.perf_counter(), replay, x=x, sampling=sampling,
                                      rollback=rollback, header=header, csig=csig))
        conv.expected_start, conv.last_seq = start + x.shape[1], seq
        if conv.run.start > 0:  # what the previous hop sent, for spot-checks of its log
            conv.keep_signed(seq, start, digests, checked_sig(link, conv, f))

    def accept_from_previous_hop(self, link: Link, conv: Conv, f, seq: int, start: int, x: torch.Tensor,
                                 digests: bytes, header: convkeys.StepHeader) -> bool:
        """Whether to take the hidden states ``x`` ``(1, T, C)`` of step ``seq`` from the previous
        hop: signed by it (``sig``: :func:`meshinfer.wire.discovery.sign_step` of ``digests`` by
        the key its link proved), asked for by the client (``csig``: the conversation key's
        signature of ``header``, so the previous hop changed none of ``want``, ``sampling``,
        ``rollback``, ``replay``, the count or the client's payload digest), then plausible
        (:func:`meshinfer.wire.plausible.check_values`).
        The caller keeps the signature (``Conv.keep_signed``) once the step is queued, as
        evidence of what that hop sent: a refused step must not displace those of steps taken.

        Otherwise the conversation's client is told, naming the sender as ``suspect``, and False.
        Implausible values of a signed step go with ``evidence`` (``start``, ``sig``, the
        ``hidden`` frame as received): the client repeats the check and blames this hop instead
        when the evidence does not hold, so a hop cannot frame its previous hop on its word."""
        sig = f.get("sig", bytes, b"")
        key = link.info.get("public_key")
        evidence = None
        try:
            if key is None or not discovery.check_step(key, sig, conv.conv_id, seq, start, digests):
                raise LyingPeer(f"previous hop {(conv.prev_id or '?')[:12]} sent step {seq} without a valid "
                                f"signature of its hidden states", suspect=conv.prev_id)
            if not header.check(conv.client_key, f.get("csig", bytes, b"")):
                raise LyingPeer(f"previous hop {(conv.prev_id or '?')[:12]} sent step {seq} with fields the client "
                                f"did not sign (want, sampling, rollback, replay, positions)", suspect=conv.prev_id)
            evidence = {"start": start, "sig": sig, "hidden": f.get("hidden", dict)}
            plausible.check_values(x, sender=conv.prev_id)
            return True
        except LyingPeer as exc:
            log.warning("conversation %s, step %d: %s", conv.conv_id[:12], seq, exc)
            # the previous hop's read loop must not wait on this client: post, never send
            conv.owner.post("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc), suspect=exc.suspect,
                            **({"evidence": evidence} if evidence is not None else {}))
            return False

    async def step_input(self, link: Link, conv: Conv, f, seq: int) -> torch.Tensor | None:
        """The input of a step: token ids ``(1, T)`` int64 on hop 0, else hidden states ``(1, T, C)``;
        None when the previous hop's failed :meth:`incoming_hidden` (the client was told).

        Raises:
            InvalidInput: bad token ids, or a client's hidden states of the wrong shape.
            ProtocolError: an unreadable tensor from the conversation's client.
        """
        if conv.run.start == 0:
            tokens = f.get("tokens", list)
            if not 0 < len(tokens) <= self.peer.settings.max_step_tokens or not all(
                    type(t) is int and 0 <= t < self.peer.cfg.vocab_size for t in tokens):
                raise InvalidInput(f"step {seq}: tokens must be 1-{self.peer.settings.max_step_tokens} ids in "
                                   f"[0, {self.peer.cfg.vocab_size})")
            return torch.tensor([tokens], dtype=torch.int64)  # (1, T)
        if link is conv.owner:  # no other client to tell: plain validation, errors to the sender
            x = tensors.tensor_from_wire(f.get("hidden", dict), width=self.peer.cfg.hidden_size,
                                         max_elements=self.peer.settings.max_step_tokens * self.peer.cfg.hidden_size)
            if x.dim() != 3 or x.shape[0] != 1:
                raise InvalidInput(f"step {seq}: hidden states must be (1, T, {self.peer.cfg.hidden_size})")
            return x
        return await self.incoming_hidden(conv, f, seq)

    async def incoming_hidden(self, conv: Conv, f, seq: int) -> torch.Tensor | None:
        """Hidden states ``(1, T, C)`` float32 of a step from the previous hop (their values and
        signature are checked by :meth:`accept_from_previous_hop`), or None when they do not
        decode or have another dtype or shape (:func:`meshinfer.wire.plausible.check_shape`):
        then the conversation's client is told, naming the sender as ``suspect``, and the step
        is dropped."""
        try:
            try:
                x = tensors.tensor_from_wire(f.get("hidden", dict),
                                              max_elements=self.peer.settings.max_step_tokens * self.peer.cfg.hidden_size)
            except ProtocolError as exc:
                raise LyingPeer(f"previous hop {(conv.prev_id or '?')[:12]} sent an unreadable tensor: {exc}",
                                suspect=conv.prev_id) from exc
            plausible.check_shape(x, width=self.peer.cfg.hidden_size, sender=conv.prev_id)
            return x
        except LyingPeer as exc:
            log.warning("conversation %s, step %d: %s", conv.conv_id[:12], seq, exc)
            # the previous hop's read loop must not wait on this client: post, never send
            conv.owner.post("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc), suspect=exc.suspect)
            return None

    def enqueue(self, conv: Conv, step: QueuedStep) -> None:
        """Queue a step for ``conv``'s worker. Its hidden states count against
        :data:`limits.MAX_QUEUED_BYTES` (all conversations) and against the share
        (:data:`limits.QUEUED_BYTES_HOST_SHARE`) of the conversation's client host until the
        worker takes it.

        Raises:
            CacheFull: the conversation has :data:`limits.MAX_QUEUED_STEPS` steps queued.
            RateLimited: the peer holds :data:`limits.MAX_QUEUED_BYTES` of queued hidden states,
                or the client host its share of them.
        """
        size, host = step.nbytes, client_host(conv.owner)
        held, host_limit = self.queued_by_host.get(host, 0), int(limits.MAX_QUEUED_BYTES * limits.QUEUED_BYTES_HOST_SHARE)
        if size and self.queued_bytes + size > limits.MAX_QUEUED_BYTES:
            raise RateLimited(f"peer {self.peer.peer_id[:12]} holds {self.queued_bytes} bytes of queued steps; "
                              f"{size} more would pass {limits.MAX_QUEUED_BYTES}")
        if size and held + size > host_limit:
            raise RateLimited(f"client {host} holds {held} bytes of queued steps on this peer; {size} more would "
                              f"pass its limit of {host_limit} ({limits.QUEUED_BYTES_HOST_SHARE:.0%} of "
                              f"{limits.MAX_QUEUED_BYTES})")
        try:
            conv.queue.put_nowait(replace(step, host=host))
        except asyncio.QueueFull:
            raise CacheFull(f"conversation {conv.conv_id} has {limits.MAX_QUEUED_STEPS} steps queued") from None
        self.queued_bytes += size
        self.queued_by_host[host] = held + size
        conv.last_active = time.monotonic()

    def _dequeued(self, step: QueuedStep) -> None:
        """``step`` left its queue: its bytes no longer count as queued."""
        self.queued_bytes -= step.nbytes
        left = self.queued_by_host.pop(step.host, 0) - step.nbytes
        if left > 0:
            self.queued_by_host[step.host] = left

    def discard_queued(self, conv: Conv) -> None:
        """Empty the queue of ``conv`` (closing): its steps no longer count as queued."""
        while not conv.queue.empty():
            self._dequeued(conv.queue.get_nowait())

    async def worker(self, conv: Conv) -> None:
        """Run the queued steps of ``conv`` in order, for as long as it is open; a step's
        :class:`MeshError` is reported to the conversation's client (``peer._report``)."""
        while True:
            step: QueuedStep = await conv.queue.get()
            self._dequeued(step)
            try:
                if step.x is None:  # a replayed step this hop holds: resend what it sent then
                    await self.resend(conv, step)
                else:
                    await self.run(conv, step)
            except MeshError as exc:
                await self.peer._report(conv, step.seq, exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("step %d of conversation %s failed", step.seq, conv.conv_id,
                              extra=context(conv=conv.conv_id, peer=self.peer.peer_id, seq=step.seq))
                await self.peer._report(conv, step.seq,
                                        MeshError(f"internal error on peer {self.peer.peer_id[:12]}: {exc}"))
            finally:
                conv.queue.task_done()

    async def resend(self, conv: Conv, step: QueuedStep) -> None:
        """A failover replay of positions this hop kept: send the next hop what this hop sent then."""
        if conv.next_id is not None:
            nxt = await self.peer.conns.link_to(conv.next_id, conv.next_addrs, conv.next_relays)
            hidden = tensors.tensor_to_wire(conv.sent.slice(step.start, step.start + step.kept_tokens))
            await nxt.send("step", conv=conv.conv_id, seq=step.seq, start=step.start, want=step.want, replay=True,
                           hidden=hidden, trace=[], sig=self.sign(conv, step.seq, step.start, hidden),
                           **client_fields(step))
            conv.next_link, conv.forwarded_seq = nxt, step.seq  # its closing is reported (Conversations.next_hop_lost)

    async def run(self, conv: Conv, step: QueuedStep) -> None:
        """Compute ``step`` in the scheduler's next pass that takes it, then forward its hidden
        states to the next hop or, on the last hop, send the client its token (unless ``want`` is none)."""
        t0 = time.perf_counter()
        seq, start, want, sampling = step.seq, step.start, step.want, step.sampling
        if conv.cache.length > start:  # rejected drafts of the previous step (speculation)
            await self.peer.executor.run(roll_back_to, conv, start)
        timing: dict = {}
        out = await self.peer.scheduler.submit(conv, step.x, start, want, sampling, timing=timing)
        self.peer.metrics.step(step.x.shape[1], time.perf_counter() - t0)
        if step.x.shape[1] == 1 and conv.run == self.peer.shard.range:  # a decode step: what a token costs here now
            # (ComputeCost). Only over the whole range the advert stands for: a conversation over
            # one of its layers (a client may open one) would count a tenth of the cost, and set the floor.
            self.peer.cost.observe(timing["pass_s"] * 1e3)
        hop = {"peer": self.peer.peer_id, "compute_ms": round((time.perf_counter() - t0) * 1e3, 3),
               "queue_ms": round((t0 - step.received_at) * 1e3, 3)}
        if conv.next_id is None:
            if want != "none":
                await conv.owner.send("token", conv=conv.conv_id, seq=seq, trace=step.trace + [hop],
                                      length=conv.cache.length, **last_hop_reply(out, want))
        else:
            nxt = await self.peer.conns.link_to(conv.next_id, conv.next_addrs, conv.next_relays)
            hidden = tensors.tensor_to_wire(out)
            await nxt.send("step", conv=conv.conv_id, seq=seq, start=start, want=want, replay=step.replay,
                           hidden=hidden, trace=step.trace + [hop], sig=self.sign(conv, seq, start, hidden),
                           **client_fields(step))
            conv.next_link, conv.forwarded_seq = nxt, seq  # its closing is reported (Conversations.next_hop_lost)

    def sign(self, conv: Conv, seq: int, start: int, hidden: dict) -> bytes:
        """This peer's signature of the hidden states ``(1, T, C)`` float32 it sends the next hop
        for step ``seq``, as encoded for the wire (``hidden``; :func:`meshinfer.wire.discovery.sign_step`;
        about 0.1 ms, and 1-2 ms of hashing for a 512-position prefill chunk)."""
        return discovery.sign_step(self.peer.key, conv.conv_id, seq, start, tensors.wire_row_digests(hidden))

    @staticmethod
    def logits_mode(want: str) -> str:
        """Which logits a step needs from the last layer (``Shard.forward``'s ``logits``):
        every position for a speculative verification step (``want="tokens"``), else the last."""
        return "all" if want == "tokens" else "last"

    def finish_step(self, conv: Conv, start: int, tokens: int, want: str, out: torch.Tensor, sampling=None):
        """On the device thread: what a step yields from its forward output ``out``.

        ``out`` is ``(1, T, C)`` hidden states, or ``(1, 1, V)`` float32 logits on the last hop.
        Returns the chosen token (last hop: :func:`meshinfer.engine.sampling.pick_token` of the last
        position's logits, argmax without ``sampling``, else a draw seeded by (seed, position)),
        or the float32 hidden states to send, logged for replay. Called for a step run alone
        and for each step of a batched pass alike.

        Raises:
            InvalidInput: NaN or inf in ``out``; the step's positions are dropped from the cache.
        """
        if not all_finite(out):
            conv.cache.truncate(start)
            raise InvalidInput(f"layers {conv.run.cli()} produced NaN or inf at positions "
                               f"{start}..{start + tokens - 1}")
        if conv.run.stop == self.peer.cfg.num_hidden_layers:
            if want == "tokens":
                return out[0].argmax(-1).tolist()  # (T,) ids: speculative verification
            return [pick_token(out[0, -1], sampling, position=start + tokens)]
        out = out.float().cpu()  # the wire form (float32), copied off the device on its own thread
        if conv.sent is not None:
            conv.sent.append(start, out)
        return out

    async def report(self, conv: Conv, seq: int, exc: MeshError) -> None:
        """Tell the client of ``conv`` that step ``seq`` failed with ``exc``; the next step must start at the cache length."""
        conv.expected_start = conv.cache.length
        self.peer.metrics.error(exc.code)
        log.warning("step %d of conversation %s failed: %s: %s", seq, conv.conv_id, exc.code, exc,
                    extra=context(conv=conv.conv_id, peer=self.peer.peer_id, seq=seq))
        try:
            await conv.owner.send("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc))
        except MeshError:
            pass

    async def on_error(self, link: Link, f) -> None:
        """An error from the next hop about a conversation: relay it to the conversation's client.

        Posted, never awaited: this runs in the next hop's read loop, which a client that does
        not read must not stall (:meth:`meshinfer.wire.transport.Link.post` cuts that client off instead).
        """
        conv = self.peer.convs.get(f.str("conv", "") or "")
        if conv is not None and link.remote_id is not None and link.remote_id == conv.next_id:
            conv.owner.post("error", conv=conv.conv_id, seq=f.get("seq", int, None),
                            code=f.str("code", "mesh_error"), message=f.str("message", ""))
        else:
            log.debug("error frame from %s: %s", link.name, f.str("message", ""))




def statements_fit(link: Link, conv: Conv, seq: int, digests: bytes, sig: bytes) -> bool:
    """Whether the statement of step ``seq`` (``digests``, ``sig``) fits ``conv``'s allowance
    (``Conv.statements_fit``). A client that pins more, by cutting long steps back to a
    position again and again, is refused the step: ``cache_full`` to the client (posted when
    the step came from the previous hop, which only passed it on).

    Raises:
        CacheFull: the step came on the conversation's own connection and does not fit.
    """
    if conv.statements_fit(digests, sig):
        return True
    exc = CacheFull(f"step {seq}: conversation {conv.conv_id} would hold more than its "
                    f"{conv.reserved_tokens * STATEMENT_BYTES_PER_TOKEN} bytes of signed statements "
                    f"({STATEMENT_BYTES_PER_TOKEN} a reserved token); it holds {conv.statement_bytes}")
    if link is conv.owner:
        raise exc
    conv.owner.post("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc))
    return False


def checked_sig(link: Link, conv: Conv, f) -> bytes:
    """The previous hop's ``sig`` of a step it sent (checked by ``accept_from_previous_hop``), or
    b"" for a step from the conversation's own connection, whose ``sig`` nobody checked: kept,
    any size, it was memory nobody counted (found by an attack run)."""
    return b"" if link is conv.owner else f.get("sig", bytes, b"")


def payload_digest(link: Link, conv: Conv, f, x: torch.Tensor, digests: bytes) -> bytes:
    """The digest of the client's payload of a step with input ``x``: computed from ``x`` when
    the client sent it (``link`` is the conversation's owner: token ids ``(1, T)``, or hidden
    states ``(1, T, C)`` whose row digests are ``digests``), else the ``pd`` the previous hop
    passed on (b"" when it is missing or not 32 bytes: the client's signature then fails)."""
    if link is conv.owner:
        return convkeys.tokens_digest(x[0].tolist()) if conv.run.start == 0 else convkeys.hidden_digest(digests)
    pd = f.get("pd", bytes, b"")
    return pd if len(pd) == convkeys.PAYLOAD_DIGEST_BYTES else b""


def client_fields(step: QueuedStep) -> dict:
    """The fields of ``step`` a hop passes on to its next hop as the client signed them:
    ``sampling`` and ``rollback`` (when set), ``pd`` and ``csig``."""
    header = step.header
    return {**({"sampling": header.sampling.to_wire()} if header.sampling else {}),
            **({"rollback": True} if header.rollback else {}), "pd": header.payload, "csig": step.csig}


def roll_back_to(conv: Conv, start: int) -> None:
    """Implicit rollback (speculative decoding): forget cached and logged positions ``>= start``.

    ``_on_step`` lets a step start below the hop's length only with ``rollback: true``; every
    other step starts at the cache length and this does nothing. Runs on the device thread,
    in step order, so it drops exactly the rejected drafts of the previous step.
    """
    if conv.cache.length > start:
        conv.cache.truncate(start)
        if conv.sent is not None:
            conv.sent.truncate(start)


def last_hop_reply(ids: list[int], want: str) -> dict:
    """The fields of the last hop's ``token`` reply for a step computed to argmax ``ids``.

    ``token`` is the last position's choice; with ``want="tokens"`` the reply also carries
    ``tokens``, the choice at every position of the step (speculative verification).
    """
    fields = {"token": ids[-1]}
    if want == "tokens":
        fields["tokens"] = ids
    return fields
