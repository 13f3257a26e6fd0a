"""Client side of the mesh: discovery, RTT probes, route planning and conversations.

The client dials every hop of its route (to open the conversation there and to receive
errors), sends token ids to the first hop only, and receives the chosen token from the
last hop. It never sends or receives hidden states.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .errors import (ContextOverflow, IncompatiblePeer, InvalidInput, MeshError, NoRoute, PeerUnavailable,
                     ProtocolError)
from .generate import check_context
from .protocol import PeerAdvert
from .routing import Route, plan_route
from .tokenizer import Tokenizer
from .transport import Link, dial, remote_error

log = logging.getLogger(__name__)

#: Largest frame a client accepts, bytes: the tokenizer bundle of a 150k-token vocabulary
#: is about 10 MB; nothing else a peer sends is larger than a few KB.
CLIENT_MAX_FRAME_BYTES = 64 << 20
#: RTT probes per peer; the median is used.
RTT_PROBES = 3


@dataclass
class HopStats:
    """Per-hop timing of a generation, milliseconds per decode token."""

    peer_id: str
    address: str
    layers: str
    device: str
    precision: str
    compute_ms_per_token: float = 0.0
    network_ms_per_token: float = 0.0


@dataclass
class ChatResult:
    """What ``meshinfer chat --json`` prints."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"
    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    route: list[dict] = field(default_factory=list)


class MeshClient:
    """Find peers, measure them, plan routes and open conversations.

    Args:
        bootstrap: peer URLs (``ws://host:port``) to learn the mesh from.
        request_timeout_s: deadline of control requests, seconds.
    """

    def __init__(self, bootstrap: Sequence[str], *, request_timeout_s: float = 10.0) -> None:
        if not bootstrap:
            raise InvalidInput("no peers to contact: pass --peers ws://HOST:PORT")
        self.bootstrap = list(bootstrap)
        self.request_timeout_s = request_timeout_s
        self.table: dict[str, PeerAdvert] = {}
        self.rtts_ms: dict[str, float] = {}
        self._links: dict[str, Link] = {}
        self._convs: dict[str, "Conversation"] = {}
        self._tokenizers: dict[str, Tokenizer] = {}

    async def __aenter__(self) -> "MeshClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every conversation and connection. Safe to call twice."""
        for conv in list(self._convs.values()):
            await conv.close()
        for link in list(self._links.values()):
            await link.close()
            if getattr(link, "reader", None):
                await asyncio.gather(link.reader, return_exceptions=True)
        self._links.clear()

    # ------------------------------------------------------------------ connections
    async def _on_message(self, link: Link, msg_type: str, f) -> None:
        conv = self._convs.get(f.str("conv", "") or "")
        if conv is not None and msg_type in ("token", "error"):
            conv.inbox.put_nowait((link, msg_type, f))
        elif msg_type == "error":
            log.warning("error from %s: %s", link.name, f.str("message", ""))
        elif msg_type == "ping":
            await link.send("pong", re=f.get("id", int, None))

    async def _hello(self, url: str) -> tuple[Link, PeerAdvert, int]:
        link = await dial(url, max_bytes=CLIENT_MAX_FRAME_BYTES, on_message=self._on_message,
                          open_timeout_s=self.request_timeout_s)
        try:
            _, f = await link.request("hello", timeout_s=self.request_timeout_s, role="client")
            advert = PeerAdvert.from_wire(f.get("advert", dict))
            link.info["max_step_tokens"] = f.int("max_step_tokens", lo=1, hi=1 << 20)
        except MeshError:
            await link.close()
            raise
        link.remote_id, link.role = advert.peer_id, "peer"
        return link, advert, link.info["max_step_tokens"]

    async def link(self, peer: PeerAdvert) -> Link:
        """An open connection to ``peer``, dialing its addresses if needed.

        Raises:
            PeerUnavailable: no address answers, or the answering peer has another id.
        """
        link = self._links.get(peer.peer_id)
        if link is not None and not link.closed.is_set():
            return link
        errors = []
        for url in peer.addrs:
            try:
                link, advert, _ = await self._hello(url)
            except MeshError as exc:
                errors.append(str(exc))
                continue
            if advert.peer_id != peer.peer_id:
                await link.close()
                errors.append(f"{url} answered as peer {advert.peer_id[:12]}")
                continue
            self._links[peer.peer_id] = link
            return link
        raise PeerUnavailable(f"cannot reach peer {peer.peer_id[:12]}: " + "; ".join(errors or ["no address"]))

    # ------------------------------------------------------------------ discovery
    async def refresh(self) -> list[PeerAdvert]:
        """Fetch the peer table from the first bootstrap peer that answers.

        Raises:
            PeerUnavailable: no bootstrap peer answered.
        """
        errors = []
        for url in self.bootstrap:
            try:
                link, advert, _ = await self._hello(url)
            except MeshError as exc:
                errors.append(str(exc))
                continue
            try:
                _, f = await link.request("get_peers", timeout_s=self.request_timeout_s)
                ads = [PeerAdvert.from_wire(d) for d in f.get("adverts", list)]
            except MeshError as exc:
                errors.append(f"{url}: {exc}")
                await link.close()
                continue
            old = self._links.get(advert.peer_id)
            if old is None or old.closed.is_set():
                self._links[advert.peer_id] = link
            else:
                await link.close()
            self.table = {ad.peer_id: ad for ad in ads}
            return ads
        raise PeerUnavailable("no bootstrap peer answered: " + "; ".join(errors))

    async def measure_rtts(self, peers: Sequence[PeerAdvert] | None = None) -> dict[str, float]:
        """Ping each peer :data:`RTT_PROBES` times; store and return the median RTT in ms."""
        async def probe(peer: PeerAdvert) -> None:
            try:
                link = await self.link(peer)
                samples = []
                for _ in range(RTT_PROBES):
                    t0 = time.perf_counter()
                    await link.request("ping", timeout_s=self.request_timeout_s)
                    samples.append((time.perf_counter() - t0) * 1e3)
                self.rtts_ms[peer.peer_id] = statistics.median(samples)
            except MeshError as exc:
                log.info("peer %s unreachable: %s", peer.peer_id[:12], exc)
                self.rtts_ms.pop(peer.peer_id, None)

        peers = list(self.table.values()) if peers is None else list(peers)
        await asyncio.gather(*(probe(p) for p in peers))
        return dict(self.rtts_ms)

    async def plan(self, *, exclude: frozenset[str] = frozenset(), min_free_kv_tokens: int = 0,
                   compat_key=None) -> Route:
        """Refresh the table, probe RTTs and plan the fastest complete route.

        Unreachable peers are excluded. Raises :class:`NoRoute` naming what is missing.
        """
        await self.refresh()
        await self.measure_rtts()
        reachable = [p for p in self.table.values() if p.peer_id in self.rtts_ms]
        unreachable = set(self.table) - set(self.rtts_ms)
        return plan_route(reachable, client_rtts_ms=self.rtts_ms, compat_key=compat_key,
                          exclude=frozenset(exclude) | unreachable, min_free_kv_tokens=min_free_kv_tokens)

    async def tokenizer(self, route: Route) -> Tokenizer:
        """The route's tokenizer, fetched from its first hop and checked against its weights hash.

        Raises:
            IncompatiblePeer: the peer's tokenizer belongs to other weights.
        """
        weights_hash = route.compat_key[0]
        if weights_hash not in self._tokenizers:
            link = await self.link(route.hops[0].peer)
            _, f = await link.request("get_tokenizer", timeout_s=max(30.0, self.request_timeout_s))
            got = f.str("weights_hash")
            if got != weights_hash:
                raise IncompatiblePeer(f"peer {route.hops[0].peer_id[:12]} sent the tokenizer of weights "
                                       f"{got[:12]}, the route uses {weights_hash[:12]}")
            self._tokenizers[weights_hash] = Tokenizer.from_bundle(f.get("bundle", dict))
        return self._tokenizers[weights_hash]

    def conversation(self, route: Route, *, max_tokens_total: int) -> "Conversation":
        """A new conversation over ``route`` holding at most ``max_tokens_total`` tokens."""
        return Conversation(self, route, max_tokens_total=max_tokens_total)


class Conversation:
    """One conversation over a route: prefill, decode, multi-turn reuse of the hops' KV caches.

    Args:
        client: the :class:`MeshClient`.
        route: the planned route.
        max_tokens_total: context reserved on every hop, tokens (prompt + generated, all turns).
        step_timeout_s: deadline for one step's token, seconds.
    """

    def __init__(self, client: MeshClient, route: Route, *, max_tokens_total: int,
                 step_timeout_s: float = 120.0) -> None:
        import uuid

        self.client, self.route = client, route
        self.conv_id = uuid.uuid4().hex
        self.max_tokens_total = max_tokens_total
        self.step_timeout_s = step_timeout_s
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.cached: list[int] = []  # token ids whose KV the hops hold, in order
        self.max_step_tokens = 512
        self._seq = 0
        self._open = False
        self._compute_ms: dict[str, list[float]] = {}
        self._step_ms: list[float] = []

    async def open(self) -> None:
        """Open the conversation on every hop (reserving KV), in order.

        Raises:
            CacheFull: a hop has no room; PeerUnavailable: a hop is unreachable.
        """
        hops = self.route.hops
        self.client._convs[self.conv_id] = self
        try:
            for i, hop in enumerate(hops):
                link = await self.client.link(hop.peer)
                self.max_step_tokens = min(self.max_step_tokens, link.info.get("max_step_tokens", 512))
                nxt = hops[i + 1] if i + 1 < len(hops) else None
                await link.request(
                    "open", timeout_s=self.client.request_timeout_s, conv=self.conv_id,
                    layers=[hop.layers.start, hop.layers.stop], max_tokens=self.max_tokens_total,
                    prev=hops[i - 1].peer_id if i else None,
                    next={"peer_id": nxt.peer_id, "addrs": list(nxt.peer.addrs)} if nxt else None)
            self._open = True
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Free the conversation on every hop. Safe to call twice."""
        self.client._convs.pop(self.conv_id, None)
        if not self._open and not self.cached:
            pass
        self._open = False
        for hop in self.route.hops:
            link = self.client._links.get(hop.peer_id)
            if link is not None and not link.closed.is_set():
                try:
                    await link.send("close", conv=self.conv_id)
                except MeshError:
                    pass

    async def _truncate(self, length: int) -> None:
        for hop in self.route.hops:
            link = await self.client.link(hop.peer)
            await link.request("truncate", timeout_s=self.step_timeout_s, conv=self.conv_id, length=length)
        del self.cached[length:]

    async def _send_tokens(self, tokens: Sequence[int], *, want_token: bool) -> int:
        self._seq += 1
        first = self.client._links[self.route.hops[0].peer_id]
        await first.send("step", conv=self.conv_id, seq=self._seq, start=len(self.cached), tokens=list(tokens),
                         want="token" if want_token else "none")
        self.cached.extend(tokens)
        return self._seq

    async def _await_token(self, seq: int) -> tuple[int, list]:
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                link, msg_type, f = await asyncio.wait_for(self.inbox.get(), max(remaining, 0.001))
            except asyncio.TimeoutError:
                raise PeerUnavailable(f"no token for step {seq} within {self.step_timeout_s:.0f} s") from None
            if msg_type == "error":
                raise remote_error(f)
            if f.int("seq", lo=0, hi=1 << 62) != seq:
                continue
            if link.remote_id != self.route.hops[-1].peer_id:
                raise ProtocolError(f"token for step {seq} came from {link.remote_id}, not the last hop")
            token = f.int("token", lo=0, hi=1 << 31)
            return token, f.get("trace", list, [])

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int | None, eos_ids=(),
                       on_token: Callable[[int], None] | None = None) -> ChatResult:
        """Greedy generation continuing this conversation.

        ``prompt_ids`` is the whole conversation so far (rendered by the chat template); the
        longest prefix the hops already cache is reused, the rest is prefilled in chunks of at
        most the hops' ``max_step_tokens``, sent back to back so hops work in a pipeline.

        Raises:
            ContextOverflow: prompt + ``max_tokens`` exceed the conversation's reserved context.
            MeshError: a hop reported an error (its code and message are kept).
        """
        prompt_ids = list(prompt_ids)
        budget = check_context(len(prompt_ids), max_tokens, self.max_tokens_total,
                               what="the conversation's reserved context")
        if not self._open:
            await self.open()
        result = ChatResult(prompt_ids=prompt_ids)
        keep = 0
        while keep < min(len(self.cached), len(prompt_ids) - 1) and self.cached[keep] == prompt_ids[keep]:
            keep += 1
        if keep < len(self.cached):
            await self._truncate(keep)
        t0 = time.perf_counter()
        rest = prompt_ids[keep:]
        seqs = []
        for i in range(0, len(rest), self.max_step_tokens):
            chunk = rest[i:i + self.max_step_tokens]
            seqs.append(await self._send_tokens(chunk, want_token=i + self.max_step_tokens >= len(rest)))
        token, _ = await self._await_token(seqs[-1])
        result.ttft_ms = (time.perf_counter() - t0) * 1e3
        eos = set(eos_ids)
        t1 = time.perf_counter()
        decode_steps = 0
        while True:
            if token in eos:
                result.finish_reason = "stop"
                break
            result.token_ids.append(token)
            if on_token:
                on_token(token)
            if len(result.token_ids) >= budget:
                break
            ts = time.perf_counter()
            seq = await self._send_tokens([token], want_token=True)
            token, trace = await self._await_token(seq)
            self._record(trace, (time.perf_counter() - ts) * 1e3)
            decode_steps += 1
        elapsed = time.perf_counter() - t1
        result.decode_tokens_per_s = decode_steps / elapsed if decode_steps and elapsed > 0 else 0.0
        result.route = self.hop_stats()
        return result

    def _record(self, trace: list, step_ms: float) -> None:
        self._step_ms.append(step_ms)
        for entry in trace[:64]:
            if isinstance(entry, dict) and isinstance(entry.get("peer"), str):
                ms = entry.get("compute_ms", 0.0)
                self._compute_ms.setdefault(entry["peer"], []).append(float(ms) if isinstance(ms, (int, float)) else 0.0)

    def hop_stats(self) -> list[dict]:
        """Per-hop compute ms/token (from the hops' traces) and network ms/token.

        Network time is the client-measured step time minus all hops' compute, split across
        the links into each hop in proportion to their measured RTTs (client->hop 1 and the
        way back count for the first and last hop). See docs/architecture.md.
        """
        hops = self.route.hops
        compute = [statistics.fmean(self._compute_ms.get(h.peer_id) or [0.0]) for h in hops]
        step = statistics.fmean(self._step_ms) if self._step_ms else 0.0
        network = max(0.0, step - sum(compute))
        weights = []
        for i, h in enumerate(hops):
            w = self.client.rtts_ms.get(h.peer_id, 1.0) / 2 if i == 0 else \
                (hops[i - 1].peer.rtts_ms.get(h.peer_id) or h.peer.rtts_ms.get(hops[i - 1].peer_id) or 1.0) / 2
            if i == len(hops) - 1:
                w += self.client.rtts_ms.get(h.peer_id, 1.0) / 2
            weights.append(max(w, 1e-3))
        total = sum(weights)
        return [HopStats(peer_id=h.peer_id, address=(h.peer.addrs or ("",))[0], layers=h.layers.cli(),
                         device=h.peer.device, precision=h.peer.precision,
                         compute_ms_per_token=round(c, 3),
                         network_ms_per_token=round(network * w / total, 3)).__dict__
                for h, c, w in zip(hops, compute, weights)]


__all__ = ["MeshClient", "Conversation", "ChatResult", "HopStats", "NoRoute", "ContextOverflow"]
