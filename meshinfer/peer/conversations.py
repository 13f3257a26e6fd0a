"""The conversations a peer holds: their state (:class:`Conv`), their control frames (open,
truncate, reroute, probe, close), idle expiry, and the KV budget they reserve.

A conversation reserves its ``max_tokens`` of KV when it opens, against the peer's budget and
its client host's share of it (:class:`meshinfer.peer.limits.ClientLimits`), and frees them
when it closes, its client disconnects, or it idles past ``idle_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from meshinfer.core.config import LayerRange
from meshinfer.core.errors import (CacheFull, ContextOverflow, InvalidInput, LayerRangeError, PeerUnavailable,
    ProtocolError, RateLimited, Unauthenticated)
from meshinfer.core.logs import context
from meshinfer.engine.kv_cache import HiddenLog, KVCache
from meshinfer.peer import limits
from meshinfer.peer.limits import client_host
from meshinfer.wire import convkeys, protocol, tensors
from meshinfer.wire.transport import Link

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer

#: a child of the node's logger: configuring ``meshinfer.peer.node`` configures all of a peer
log = logging.getLogger("meshinfer.peer.node.conversations")



#: Bytes of signed statements (``Conv.signed_at``) a conversation may hold per token it
#: reserved; counted in its KV reservation. A statement is ``(seq, start, digests, sig)``:
#: :data:`STATEMENT_OVERHEAD_BYTES` plus 16 bytes of digest per position of its step and a
#: 64-byte signature, shared by the step's positions while any of them is held. The worst an
#: honest client makes is a verification step of 32 positions of which one stays (the rest
#: rolled back): 16 x 32 + 64 + 264 = 840 bytes, plus the position's list slot (8), rounded up.
#: Until an attack run measured 669-746 bytes a position that way, this was 320 (a one-token
#: step's statement). A client that pins more (long steps cut to one position again and again)
#: is refused steps past its allowance (``Conv.statements_fit``).
STATEMENT_BYTES_PER_TOKEN = 880
#: Bytes of one statement beyond its digests and signature: the tuple, two ints and two bytes
#: headers (``sys.getsizeof`` on CPython 3.11-3.12: 194) and its entry in ``Conv._holders``
#: (about 60, measured with tracemalloc by an attack run), rounded up.
STATEMENT_OVERHEAD_BYTES = 264


@dataclass
class Conv:
    """One conversation on this peer."""

    conv_id: str
    run: LayerRange
    owner: Link
    prev_id: str | None
    next_id: str | None
    next_addrs: tuple[str, ...]
    reserved_tokens: int
    cache: KVCache
    sent: HiddenLog | None = None  # hidden states sent to the next hop, for replay
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(limits.MAX_QUEUED_STEPS))
    task: asyncio.Task | None = None
    last_active: float = field(default_factory=time.monotonic)
    expected_start: int = 0
    next_relays: tuple[str, ...] | None = None  # the next hop's relays from ``open`` (None: from its advert)
    next_link: Link | None = None  # the link the last step went to the next hop on, until it closes
    forwarded_seq: int | None = None  # the seq of that step
    #: per position this hop holds, the previous hop's signed statement of the step that last
    #: sent it: ``(seq, start, digests, sig)``, shared by the positions of one step; the digests
    #: of what this hop received (``received_digests``; docs/security.md, "Signed steps").
    signed_at: list = field(default_factory=list)
    last_seq: int = -1  # the seq of the last step taken (seqs only grow; from min_seq - 1 after an open)
    client_key: object = None  # the Ed25519 public key the conversation id is derived from
    open_n: int = 0  # the ``n`` of the open or reroute that set this hop up (only grows)
    min_seq: int = 0  # the lowest seq the client will send this hop now (signed in the open or reroute)
    statement_bytes: int = 0  # bytes the statements in signed_at hold (each counted once, and the list)
    _holders: dict = field(default_factory=dict)  # id(statement) -> positions of signed_at holding it

    def keep_signed(self, seq: int, start: int, digests: bytes, sig: bytes, *, replay: bool = False) -> None:
        """Keep the previous hop's signed statement of step ``seq``, positions ``[start, start +
        len(digests) / DIGEST_BYTES)``: a step drops every position from ``start`` on first, a
        failover ``replay`` of positions this hop kept replaces those positions only."""
        statement = (seq, start, digests, sig)
        n = len(digests) // tensors.DIGEST_BYTES
        self.drop_signed(start, start + n if replay else len(self.signed_at))
        before = len(self.signed_at)
        self.signed_at += [None] * (start - len(self.signed_at))  # positions nobody signed (none, in a route)
        self.signed_at[start:start + n] = [statement] * n
        self._holders[id(statement)] = n
        self.statement_bytes += _statement_nbytes(statement) + 8 * (len(self.signed_at) - before)

    def drop_signed(self, start: int, stop: int) -> None:
        """Stop holding the statements of positions ``[start, stop)``; when ``stop`` is the end,
        the positions go (a truncation)."""
        for statement in self.signed_at[start:stop]:
            if statement is not None:
                self._holders[id(statement)] -= 1
                if self._holders[id(statement)] == 0:
                    del self._holders[id(statement)]
                    self.statement_bytes -= _statement_nbytes(statement)
        if stop >= len(self.signed_at):
            self.statement_bytes -= 8 * max(0, len(self.signed_at) - start)
            del self.signed_at[start:]
        else:
            self.signed_at[start:stop] = [None] * (stop - start)

    def statements_fit(self, digests: bytes, sig: bytes) -> bool:
        """Whether a statement of ``digests`` and ``sig`` more stays within the conversation's
        allowance (:data:`STATEMENT_BYTES_PER_TOKEN` per reserved token), before the positions
        it replaces are let go (an upper bound)."""
        more = len(digests) + len(sig) + STATEMENT_OVERHEAD_BYTES + 8 * len(digests) // tensors.DIGEST_BYTES
        return self.statement_bytes + more <= self.reserved_tokens * STATEMENT_BYTES_PER_TOKEN

    def received_digests(self, start: int, stop: int) -> bytes:
        """The digests (:data:`~meshinfer.wire.tensors.DIGEST_BYTES` each) of the rows this hop
        received for positions ``[start, stop)``, up to the first it holds none for."""
        d, out = tensors.DIGEST_BYTES, []
        for statement in self.signed_at[start:stop]:
            if statement is None:
                break
            k = len(out) + start - statement[1]
            out.append(statement[2][k * d:(k + 1) * d])
        return b"".join(out)


def _statement_nbytes(statement: tuple) -> int:
    """Bytes a kept statement ``(seq, start, digests, sig)`` holds (:data:`STATEMENT_OVERHEAD_BYTES`
    beyond its digests and signature)."""
    return len(statement[2]) + len(statement[3]) + STATEMENT_OVERHEAD_BYTES


class Conversations:
    """The conversations of ``peer`` and the KV they reserve.

    Attributes:
        by_id: conversation id -> :class:`Conv` (``Peer.convs``).
        reserved_tokens: tokens of KV reserved by the open conversations, all together.
    """

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.by_id: dict[str, Conv] = {}
        self.reserved_tokens = 0

    # ------------------------------------------------------------------ accounting
    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token costs across the peer's layers: K and V, plus the float32 hidden
        state logged for replay when the peer is not the last hop, plus the previous hop's
        signed statement kept per position (:data:`STATEMENT_BYTES_PER_TOKEN`)."""
        shard, cfg = self.peer.shard, self.peer.cfg
        elem = torch.empty((), dtype=shard.dtype).element_size()
        kv = 2 * len(shard.range) * cfg.num_key_value_heads * cfg.head_dim * elem
        return kv + (0 if shard.is_last else 4 * cfg.hidden_size) + STATEMENT_BYTES_PER_TOKEN

    @property
    def capacity_tokens(self) -> int:
        """Tokens of KV the peer's budget holds in all."""
        return self.peer.kv_budget_bytes // self.kv_bytes_per_token

    @property
    def free_kv_tokens(self) -> int:
        """Tokens of KV not reserved by open conversations."""
        return max(0, self.capacity_tokens - self.reserved_tokens)

    def usage(self) -> tuple[int, int]:
        """(open conversations, bytes of KV and replay-log storage they hold now).

        Safe to call from another thread (the metrics server's): it reads one copy of the
        conversations, taken at once.
        """
        convs = list(self.by_id.values())  # one C-level copy: safe against the loop adding/removing
        return len(convs), sum(c.cache.nbytes + (c.sent.nbytes if c.sent else 0) + c.statement_bytes for c in convs)

    async def expire_idle(self, now: float) -> None:
        """Free conversations with no step for ``idle_timeout_s`` and nothing queued."""
        for conv in list(self.by_id.values()):
            if now - conv.last_active > self.peer.settings.idle_timeout_s and conv.queue.empty():
                log.info("conversation %s idle for %.0f s; freeing it", conv.conv_id, now - conv.last_active,
                         extra=context(conv=conv.conv_id, peer=self.peer.peer_id))
                await self.drop(conv.conv_id)

    # ------------------------------------------------------------------ control frames
    async def on_open(self, link: Link, f) -> None:
        """Open a conversation: reserve its ``max_tokens`` of KV and start its step worker.

        The open must be signed by the conversation's key (:meth:`client_auth`). A conversation
        of that id held on another connection is replaced when its connection has closed or
        when this open's ``n`` is higher (the client opening again after a failover; an old
        open replayed by whoever saw it has a lower or equal ``n`` and is refused)."""
        rid = f.get("id", int, None)
        conv_id = f.str("conv")
        run = f.layer_range("layers")
        tokens = f.int("max_tokens", lo=1, hi=1 << 40)
        prev_id, next_id, next_addrs, next_relays = self.neighbours(f, run)
        key, n, min_seq = self.client_auth(f, conv_id, run, tokens, prev_id, next_id, next_addrs, next_relays)
        held = self.by_id.get(conv_id)
        if held is not None and (held.owner.closed.is_set() or n > held.open_n):
            await self.drop(conv_id)  # its client's connection (a circuit) is gone, or its client opens anew
        if conv_id in self.by_id:
            raise ProtocolError(f"open: conversation {conv_id[:40]!r} is already open")
        if self.peer.state != protocol.READY:
            raise PeerUnavailable(f"peer {self.peer.peer_id[:12]} is {self.peer.state}")
        if run.start < self.peer.shard.range.start or run.stop > self.peer.shard.range.stop:
            raise LayerRangeError(f"this peer serves layers {self.peer.shard.range.cli()}, asked for {run.cli()}")
        if tokens > self.peer.cfg.max_position_embeddings:
            raise ContextOverflow(f"conversation asks for {tokens} tokens; the model's context is "
                                  f"{self.peer.cfg.max_position_embeddings} tokens")
        if sum(1 for c in self.by_id.values() if c.owner is link) >= limits.MAX_CONVERSATIONS_PER_LINK:
            raise CacheFull(f"this connection already holds {limits.MAX_CONVERSATIONS_PER_LINK} conversations")
        host, limit = client_host(link), self.peer.settings.client_limits.conversations
        if sum(1 for c in self.by_id.values() if client_host(c.owner) == host) >= limit:
            raise RateLimited(f"client {host} already holds {limit} conversations on this peer")
        if tokens > self.free_kv_tokens:
            raise CacheFull(f"conversation needs {tokens} tokens of KV cache; this peer has "
                            f"{self.free_kv_tokens} free of {self.capacity_tokens}")
        self.check_host_reservation(host, tokens)
        cache = KVCache(run, self.peer.cfg.num_key_value_heads, self.peer.cfg.head_dim, dtype=self.peer.shard.dtype,
                        device=self.peer.shard.device, max_tokens=tokens)
        conv = Conv(conv_id=conv_id, run=run, owner=link, prev_id=prev_id, next_id=next_id,
                    next_addrs=next_addrs, next_relays=next_relays, reserved_tokens=tokens, cache=cache,
                    sent=HiddenLog(self.peer.cfg.hidden_size, max_tokens=tokens) if next_id else None,
                    client_key=key, open_n=n, min_seq=min_seq, last_seq=min_seq - 1)
        self.by_id[conv_id] = conv
        self.reserved_tokens += tokens
        conv.task = self.peer._spawn(self.peer.steps.worker(conv), f"conv {conv_id[:12]}")
        log.info("opened conversation %s: layers %s, %d tokens reserved", conv_id, run.cli(), tokens,
                 extra=context(conv=conv_id, peer=self.peer.peer_id))
        await link.send("opened", re=rid, conv=conv_id, free_kv_tokens=self.free_kv_tokens)

    def client_auth(self, f, conv_id: str, run: LayerRange, tokens: int, prev_id: str | None, next_id: str | None,
                    next_addrs: tuple[str, ...], next_relays: tuple[str, ...] | None) -> tuple[object, int, int]:
        """The conversation's key, the ``n`` and the ``min_seq`` of an ``open``/``reroute``
        frame ``f`` whose other fields are parsed: ``client_key`` (32 bytes) must be the key
        ``conv_id`` is derived from (:func:`meshinfer.wire.convkeys.conv_id_of`) and
        ``client_sig`` its signature of the fields (:func:`meshinfer.wire.convkeys.open_message`).

        Raises:
            ProtocolError: a missing or malformed field.
            Unauthenticated: the id is not the key's, or the signature does not verify.
        """
        raw = f.get("client_key", bytes)
        n = f.int("n", lo=0, hi=protocol.MAX_SEQ)
        key = convkeys.public_key(raw)
        if key is None:
            raise ProtocolError(f"{f.what}: field 'client_key' must be a {convkeys.KEY_BYTES}-byte Ed25519 public key")
        if convkeys.conv_id_of(raw) != conv_id:
            raise Unauthenticated(f"{f.what}: conversation id {conv_id[:40]!r} is not the id of its client_key")
        min_seq = f.int("min_seq", lo=0, hi=protocol.MAX_SEQ)
        message = convkeys.open_message(f.what, self.peer.peer_id, conv_id, n, min_seq, [run.start, run.stop],
                                        tokens, prev_id, next_id, next_addrs, next_relays)
        if not convkeys.verifies(key, f.get("client_sig", bytes, b""), message):
            raise Unauthenticated(f"{f.what}: client_sig is not the conversation key's signature of the {f.what}")
        return key, n, min_seq

    def check_host_reservation(self, host: str, tokens: int) -> None:
        """Raise :class:`RateLimited` when ``host``'s open conversations plus ``tokens`` would
        reserve more than ``client_limits.kv_share`` of this peer's KV capacity."""
        limit = int(self.capacity_tokens * self.peer.settings.client_limits.kv_share)
        held = sum(c.reserved_tokens for c in self.by_id.values() if client_host(c.owner) == host)
        if held + tokens > limit:
            raise RateLimited(f"client {host} holds {held} tokens of KV cache on this peer; {tokens} more would "
                              f"pass its limit of {limit} ({self.peer.settings.client_limits.kv_share:.0%} of "
                              f"{self.capacity_tokens})")

    def neighbours(self, f, run: LayerRange) -> tuple[str | None, str | None, tuple[str, ...], tuple[str, ...] | None]:
        """``prev`` and ``next`` (id, addresses, relays or None) of an open/reroute frame,
        checked against the hop's position."""
        nxt = f.get("next", dict, None)
        nf = protocol.Fields(nxt, f"{f.what}.next") if nxt else None
        next_id = nf.str("peer_id") if nf else None
        next_addrs = protocol.check_addrs(nf.str_list("addrs"), f"{f.what}.next") if nf else ()
        has_relays = nf is not None and nf.get("relays", list, None) is not None
        next_relays = protocol.check_relays(nf.str_list("relays"), f"{f.what}.next") if has_relays else None
        if (run.stop < self.peer.cfg.num_hidden_layers) != (next_id is not None):
            raise ProtocolError(f"{f.what}: 'next' must name the next hop unless this hop runs the last layer")
        prev_id = f.str("prev", None)
        if (run.start > 0) != (prev_id is not None):
            raise ProtocolError(f"{f.what}: 'prev' must name the previous hop unless this hop runs layer 0")
        return prev_id, next_id, next_addrs, next_relays

    async def on_truncate(self, link: Link, f) -> None:
        conv = self.by_id.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("truncate: no such conversation on this connection")
        length = f.int("length", lo=0, hi=self.peer.cfg.max_position_embeddings)
        await conv.queue.join()
        await self.peer.executor.run(conv.cache.truncate, length)
        if conv.sent is not None:
            conv.sent.truncate(length)
        conv.drop_signed(length, len(conv.signed_at))
        conv.expected_start = length
        await link.send("truncated", re=f.get("id", int, None), conv=conv.conv_id, length=length)

    async def on_reroute(self, link: Link, f) -> None:
        """Failover: the client moved this kept hop's neighbours; its cache stays."""
        conv = self.by_id.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("reroute: no such conversation on this connection")
        if f.layer_range("layers") != conv.run:
            raise LayerRangeError(f"reroute: conversation {conv.conv_id} runs layers {conv.run.cli()} here")
        prev_id, next_id, next_addrs, next_relays = self.neighbours(f, conv.run)
        _, n, min_seq = self.client_auth(f, conv.conv_id, conv.run, f.int("max_tokens", lo=1, hi=1 << 40), prev_id,
                                         next_id, next_addrs, next_relays)
        if n <= conv.open_n:
            raise Unauthenticated(f"reroute: n = {n} is not above {conv.open_n}, the last open or reroute's")
        conv.open_n, conv.min_seq = n, max(conv.min_seq, min_seq)
        if prev_id != conv.prev_id:  # a new previous hop's seqs start at the client's floor (a kept one's
            conv.last_seq = conv.min_seq - 1  # late steps, below it, may still come: its count stands)
        conv.prev_id, conv.next_id, conv.next_addrs, conv.next_relays = prev_id, next_id, next_addrs, next_relays
        conv.next_link = None  # a link to the old next hop closing is no news for this conversation
        log.info("conversation %s rerouted (failover): previous hop %s, next hop %s", conv.conv_id,
                 (prev_id or "client")[:12], (next_id or "client")[:12],
                 extra=context(conv=conv.conv_id, peer=self.peer.peer_id))
        await link.send("rerouted", re=f.get("id", int, None), conv=conv.conv_id)

    async def on_probe(self, link: Link, f) -> None:
        """How many positions this hop holds for a conversation (failover finds stuck hops)."""
        conv = self.by_id.get(f.str("conv"))
        if conv is None or conv.owner is not link:
            raise InvalidInput("probe: no such conversation on this connection")
        await link.send("probed", re=f.get("id", int, None), conv=conv.conv_id, length=conv.cache.length,
                        queued=conv.queue.qsize())

    async def on_close(self, link: Link, f) -> None:
        conv = self.by_id.get(f.str("conv"))
        if conv is not None and conv.owner is link:
            log.info("closed conversation %s at %d tokens", conv.conv_id, conv.cache.length,
                     extra=context(conv=conv.conv_id, peer=self.peer.peer_id))
            await self.drop(conv.conv_id)

    def next_hop_lost(self, link: Link) -> None:
        """``link`` closed: tell the client of each conversation whose last step went to its next
        hop on it, at once, with an ``error`` of code ``peer_unavailable`` naming that hop (``peer``)
        and the relay the link ran through (``relay``, when it was a circuit), for the step sent
        (``seq``). The step may be lost with the link; the client fails over instead of waiting
        out its deadline, and blames the relay rather than either hop.

        Posted, never awaited: this runs when a link's read loop ends.
        """
        for conv in [c for c in self.by_id.values() if c.next_link is link]:
            conv.next_link = None
            relay = link.relay_id
            via = f" through relay {relay[:12]}" if relay else ""
            exc = PeerUnavailable(f"peer {self.peer.peer_id[:12]} lost its connection{via} to next hop "
                                  f"{(conv.next_id or '?')[:12]} after step {conv.forwarded_seq}",
                                  peer=conv.next_id, relay=relay)
            self.peer.metrics.error(exc.code)
            log.warning("conversation %s: %s", conv.conv_id, exc, extra=context(conv=conv.conv_id, peer=self.peer.peer_id))
            conv.owner.post("error", conv=conv.conv_id, seq=conv.forwarded_seq, code=exc.code, message=str(exc),
                            peer=exc.peer, **({"relay": relay} if relay else {}))

    async def drop(self, conv_id: str) -> None:
        conv = self.by_id.pop(conv_id, None)
        if conv is None:
            return
        self.reserved_tokens -= conv.reserved_tokens
        self.peer.scheduler.forget(conv)
        if conv.task is not None and conv.task is not asyncio.current_task():
            conv.task.cancel()
            await asyncio.gather(conv.task, return_exceptions=True)
        self.peer.steps.discard_queued(conv)  # steps it will never run no longer count as queued
        await self.peer.executor.run(conv.cache.free)
        if conv.sent is not None:
            conv.sent.free()
