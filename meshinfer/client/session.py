"""Client side of the mesh: discovery, RTT probes, route planning and conversations.

The client dials every hop of its route (to open the conversation there and to receive
errors), sends token ids to the first hop only, and receives the chosen token from the
last hop. It never sends or receives hidden states.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from meshinfer.client import spotcheck
from meshinfer.wire import discovery
from meshinfer.core.errors import (CacheFull, IncompatiblePeer, InvalidInput, LyingPeer, MeshError,
    NoRoute, PeerUnavailable, ProtocolError, Unauthenticated)
from meshinfer.client.draft import DraftModel, Drafter, PromptLookup
from meshinfer.core.generation import Generation, check_context
from meshinfer.wire.protocol import MAX_VERIFY_TOKENS, PeerAdvert
from meshinfer.client.routing import Route, plan_route
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.client.speculative import (DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS, DraftPolicy,
    SpecStats, accept)
from meshinfer.text.tokenizer import Tokenizer, bundle_sha256
from meshinfer.wire.transport import Link, circuit_link, dial, first_success, remote_error

log = logging.getLogger(__name__)

#: Largest frame a client accepts, bytes: the tokenizer bundle of a 150k-token vocabulary
#: is about 10 MB; nothing else a peer sends is larger than a few KB.
CLIENT_MAX_FRAME_BYTES = 64 << 20
#: Seconds a client waits for one address to accept and answer its hello (all of a peer's
#: addresses are dialed at once): an advert of addresses that never answer costs this, once.
DIAL_TIMEOUT_S = 5.0
#: RTT probes per peer; the median is used.
RTT_PROBES = 3
#: Most connections a client keeps to peers that no open conversation routes through (the
#: nearest by RTT are kept; the others are closed after each refresh and probe). Links to peers
#: gone from the table are closed too, so peers that come and go (rotating fake identities)
#: cannot pile up a long-lived client's sockets (``serve``) to its open-file limit.
MAX_IDLE_LINKS = 32
#: Seconds a pruned link may take to close before its socket is aborted.
LINK_CLOSE_TIMEOUT_S = 1.0
#: Failure backoff of a peer: 5 s after its first failure, doubling up to 5 minutes.
BASE_BACKOFF_S, MAX_BACKOFF_S = 5.0, 300.0
#: A step's deadline: this floor plus DEADLINE_FACTOR x the route's estimated time for the
#: step's tokens (decode estimate x tokens), so a 3,000-token prefill gets proportionally longer.
DEADLINE_FLOOR_S, DEADLINE_FACTOR = 10.0, 4.0
#: Failovers tried for one step before the error reaches the caller.
MAX_FAILOVERS = 3
#: Least network time per step, ms (the planner's estimate less compute), for "auto" to draft
#: ahead during steps: on loopback (a few ms) the drafting would take CPU from the hops instead.
AHEAD_MIN_NETWORK_MS = 20.0
#: Error codes that mean "this route is broken", answered by failover; others are the caller's.
FAILOVER_CODES = frozenset({"peer_unavailable"})
#: Lying hops excluded during one step before the error reaches the caller.
MAX_DETECTIONS = 3
#: Peers asked for the tokenizer before giving up: the route's first hop, then the nearest
#: others that advertise the agreed tokenizer.
TOKENIZER_SOURCES = 3


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
class ChatResult(Generation):
    """What ``meshinfer chat --json`` prints: a :class:`Generation` plus the route, failovers and
    lying hops detected (``detections``: peer, reason, tokens kept after the rollback), hops
    whose output nothing verified (``unverified``: peer, layers, reason) and
    speculation counters (``{proposed, accepted, steps, draft_tokens, acceptance}``; empty when off)."""

    route: list[dict] = field(default_factory=list)
    failovers: list[dict] = field(default_factory=list)
    detections: list[dict] = field(default_factory=list)
    unverified: list[dict] = field(default_factory=list)
    speculative: dict = field(default_factory=dict)


async def _shut(link: Link) -> None:
    """Close ``link``, aborting it when the remote does not finish the close within
    :data:`LINK_CLOSE_TIMEOUT_S` (a fake peer may never answer)."""
    try:
        await asyncio.wait_for(link.close(), LINK_CLOSE_TIMEOUT_S)
    except asyncio.TimeoutError:
        link.ws.transport.abort()


class MeshClient:
    """Find peers, measure them, plan routes and open conversations.

    Args:
        bootstrap: peer URLs (``wss://host:port``, or ``ws://`` on loopback) to learn the mesh from.
        request_timeout_s: deadline of control requests, seconds.
        mesh_key: the shared key of a private mesh, or None.
        insecure: allow plain ``ws://`` to non-loopback peers (otherwise refused; ``wss://``
            peers are pinned to the certificate fingerprint in their signed advert).
        tls_ca: PEM file of CA certificates ``wss://`` peers' certificates must also chain to.
        allow_ids: peer ids this client may talk to and route through (``--allow-keys``), or
            None for any; other peers are refused at the handshake and left out of the table.
        spot_check_rate: the default ``spot_check_rate`` of this client's conversations
            (``--spot-check-rate``; see :class:`Conversation`).
        dial_timeout_s: how long one address may take to accept and answer the hello, seconds
            (:data:`DIAL_TIMEOUT_S`, at most ``request_timeout_s``).
        draft_model: a :class:`~meshinfer.client.draft.DraftModel` the conversations draft with
            (``--draft-model``) instead of prompt lookup, or None. Every route's tokenizer is
            checked against it (:meth:`tokenizer`) before a conversation opens on the route.
        draft_ahead: the default ``draft_ahead`` of this client's conversations
            (``--draft-ahead``; see :class:`Conversation`).
    """

    def __init__(self, bootstrap: Sequence[str], *, request_timeout_s: float = 10.0,
                 mesh_key: bytes | None = None, insecure: bool = False, tls_ca: str | None = None,
                 allow_ids: frozenset[str] | None = None,
                 spot_check_rate: float = spotcheck.DEFAULT_SPOT_CHECK_RATE, dial_timeout_s: float = DIAL_TIMEOUT_S,
                 draft_model: DraftModel | None = None, draft_ahead: bool | str = False) -> None:
        if not bootstrap:
            raise InvalidInput("no peers to contact: pass --peers ws://HOST:PORT")
        self.bootstrap = list(bootstrap)
        self.request_timeout_s = request_timeout_s
        self.dial_timeout_s = min(dial_timeout_s, request_timeout_s)
        self.mesh_key = mesh_key
        self.insecure, self.tls_ca = insecure, tls_ca
        self.allow_ids = allow_ids
        self.not_allowed: frozenset[str] = frozenset()  # signed adverts left out by allow_ids, last refresh
        self.spot_check_rate = spot_check_rate
        self.draft_model, self.draft_ahead = draft_model, draft_ahead
        self.table: dict[str, PeerAdvert] = {}
        self.rtts_ms: dict[str, float] = {}
        self._links: dict[str, Link] = {}
        self._convs: dict[str, "Conversation"] = {}
        self._tokenizers: dict[tuple[str, str], Tokenizer] = {}  # (weights hash, tokenizer hash) ->
        self._failed: dict[str, tuple[float, int]] = {}  # peer id -> (excluded until, failures)
        self._policies: dict[tuple, DraftPolicy] = {}  # (route's peers, drafter) -> its draft policy

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
                          open_timeout_s=self.dial_timeout_s, insecure=self.insecure,
                          tls_ca=self.tls_ca)
        return await self._greet(link, url)

    async def _greet(self, link: Link, url: str) -> tuple[Link, PeerAdvert, int]:
        """Shake hands on a new ``link`` (dialed at ``url``, or a circuit named ``relay://RELAY-ID``);
        it is closed when the handshake fails."""
        relayed = link.relay_id is not None
        try:
            nonce = discovery.new_nonce()
            _, f = await link.request("hello", timeout_s=self.dial_timeout_s, role="client", nonce=nonce)
            try:
                advert, welcome_nonce = discovery.check_welcome(f, nonce, mesh_key=self.mesh_key,
                                                                tls_fingerprint=link.tls_fingerprint, dialed_url=url,
                                                                relayed=relayed)
            except Unauthenticated as exc:
                raise Unauthenticated(f"{url}: {exc}") from exc
            if self.allow_ids is not None and advert.peer_id not in self.allow_ids:
                raise Unauthenticated(f"{url}: {discovery.not_allowed(advert.peer_id)}")
            link.info["max_step_tokens"] = f.int("max_step_tokens", lo=1, hi=1 << 20)
            link.info["max_frame_bytes"] = f.int("max_frame_bytes", lo=1024, hi=1 << 40, default=None)
            if self.mesh_key is not None:
                await link.request("auth", timeout_s=self.request_timeout_s,
                                   **discovery.auth_macs(self.mesh_key, welcome_nonce, nonce, url))
            elif f.get("private", bool, False):
                raise Unauthenticated(f"{url}: this mesh is private: pass its key with --mesh-key-file "
                                      f"(or MESHINFER_MESH_KEY_FILE)")
        except BaseException:
            await link.close()
            raise
        link.remote_id, link.role = advert.peer_id, "peer"
        return link, advert, link.info["max_step_tokens"]

    async def _hello_as(self, url: str, peer_id: str) -> Link:
        """:meth:`_hello` to ``url``, which must answer as ``peer_id`` (else ``PeerUnavailable``)."""
        link, advert, _ = await self._hello(url)
        if advert.peer_id != peer_id:
            await link.close()
            raise PeerUnavailable(f"{url} answered as peer {advert.peer_id[:12]}")
        return link

    async def link(self, peer: PeerAdvert, *, direct: bool = False) -> Link:
        """An open connection to ``peer``, dialing all its addresses at once if needed (each
        within ``dial_timeout_s``; the first that answers as ``peer`` wins, the others are closed),
        or, for a peer that lists relays (nobody can dial it), unless ``direct``, first a circuit
        through the first of its relays that reaches it (relays inside their failure backoff are
        skipped).

        Raises:
            PeerUnavailable: no address or relay answers, or the answering peer has another id.
        """
        link = self._links.get(peer.peer_id)
        if link is not None and not link.closed.is_set():
            return link
        errors: list[str] = []
        link = None
        if peer.relays and not direct:  # it says nobody can dial it: its relays first, its addresses last
            try:
                link = await self._through_relays(peer, errors)
            except PeerUnavailable:
                if not peer.addrs:
                    raise
        if link is None:
            try:
                link = await first_success([self._hello_as(url, peer.peer_id) for url in peer.addrs],
                                           discard=lambda lk: lk.close())
            except PeerUnavailable as exc:
                raise PeerUnavailable(f"cannot reach peer {peer.peer_id[:12]}: "
                                      + "; ".join(errors + [str(exc)])) from None
        old = self._links.get(peer.peer_id)
        if old is not None and not old.closed.is_set():  # another task dialed it meanwhile
            await link.close()
            return old
        self._links[peer.peer_id] = link
        link.reader.add_done_callback(lambda _t, pid=peer.peer_id: self._link_closed(pid))
        return link

    async def _through_relays(self, peer: PeerAdvert, errors: list[str]) -> Link:
        """A circuit to ``peer`` through the first of its relays (not backed off) that reaches it;
        the handshake runs end to end, so a relay cannot answer for the peer.

        Raises:
            PeerUnavailable: naming each relay's failure (and ``errors`` before them).
        """
        for relay_id in peer.relays:
            relay = self.table.get(relay_id)
            try:
                if relay is None or relay_id in self.backed_off() or relay_id == peer.peer_id:
                    raise PeerUnavailable("unknown or backed off")
                carrier = await self.link(relay, direct=True)
                sock = carrier.open_circuit(peer.peer_id, max_bytes=CLIENT_MAX_FRAME_BYTES)
                link, advert, _ = await self._greet(circuit_link(sock, on_message=self._on_message,
                                                                 name=f"relay://{relay_id}"), f"relay://{relay_id}")
                if advert.peer_id != peer.peer_id:
                    await link.close()
                    raise PeerUnavailable(f"answered as peer {advert.peer_id[:12]}")
                link.remote_id, link.role = advert.peer_id, "peer"
                return link
            except MeshError as exc:
                errors.append(f"through relay {relay_id[:12]}: {exc}")
        raise PeerUnavailable(f"cannot reach peer {peer.peer_id[:12]}: " + "; ".join(errors))

    def culprit(self, peer_id: str) -> str:
        """Whom to blame when the connection to hop ``peer_id`` failed: the relay it ran
        through when that relay's own connection closed (the hop may be fine), else the hop."""
        link = self._links.get(peer_id)
        relay = link.relay_id if link is not None else None
        carrier = self._links.get(relay) if relay else None
        if relay is not None and (carrier is None or carrier.closed.is_set()):
            return relay
        return peer_id

    def _link_closed(self, peer_id: str) -> None:
        """Wake every conversation routed through ``peer_id``: its connection is gone."""
        for conv in self._convs.values():
            if peer_id in conv.route.peer_ids:
                conv.inbox.put_nowait((None, "closed", peer_id))

    def mark_failed(self, peer_id: str) -> float:
        """Exclude ``peer_id`` from routes for a while; return the backoff in seconds.

        The backoff doubles with each failure: 5, 10, 20 ... up to :data:`MAX_BACKOFF_S`.
        """
        until, count = self._failed.get(peer_id, (0.0, 0))
        backoff = min(MAX_BACKOFF_S, BASE_BACKOFF_S * 2 ** count)
        self._failed[peer_id] = (max(until, time.monotonic() + backoff), count + 1)  # a ban stays a ban
        return backoff

    def ban(self, peer_id: str, reason: str) -> None:
        """Exclude ``peer_id`` from every route of this client for good (a lying peer)."""
        self._failed[peer_id] = (math.inf, self._failed.get(peer_id, (0.0, 0))[1] + 1)
        log.warning("excluding peer %s for the rest of this session: %s", peer_id[:12], reason)

    def backed_off(self) -> frozenset[str]:
        """Peers still inside their failure backoff."""
        now = time.monotonic()
        return frozenset(pid for pid, (until, _) in self._failed.items() if until > now)

    # ------------------------------------------------------------------ discovery
    async def refresh(self) -> list[PeerAdvert]:
        """Fetch the peer table from the first bootstrap peer that answers.

        Adverts whose signature does not verify are ignored.

        Raises:
            PeerUnavailable: no bootstrap peer answered.
            Unauthenticated: no peer answered, and some refused this client (a private mesh
                without its key) or could not prove their keys.
        """
        errors, refused = [], False
        known = [a for p in self.table.values() if p.peer_id not in self.backed_off() for a in p.addrs]
        for url in dict.fromkeys(self.bootstrap + known):  # bootstrap first, then peers we learnt
            try:
                link, advert, _ = await self._hello(url)
            except MeshError as exc:
                errors.append(str(exc))
                refused |= isinstance(exc, Unauthenticated)
                continue
            try:
                _, f = await link.request("get_peers", timeout_s=self.request_timeout_s)
                signed = [ad for ad in map(PeerAdvert.from_wire, f.get("adverts", list)) if discovery.verify_advert(ad)]
                ads = [ad for ad in signed if self.allow_ids is None or ad.peer_id in self.allow_ids]
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
            self.not_allowed = frozenset(ad.peer_id for ad in signed) - set(self.table)
            await self._prune_links()
            return ads
        raise (Unauthenticated if refused else PeerUnavailable)("no bootstrap peer answered: " + "; ".join(errors))

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
        await self._prune_links()
        return dict(self.rtts_ms)

    async def _prune_links(self) -> None:
        """Close links that no open conversation routes through to peers gone from the table,
        then all but the :data:`MAX_IDLE_LINKS` nearest (by RTT) of the rest; forget RTTs of
        peers gone from the table. Cancelling it may leave a link half closed."""
        busy = {pid for conv in self._convs.values() for pid in conv.route.peer_ids}
        idle = [pid for pid in self._links if pid not in busy]
        gone = [pid for pid in idle if pid not in self.table]
        kept = sorted((pid for pid in idle if pid in self.table), key=lambda pid: self.rtts_ms.get(pid, math.inf))
        await asyncio.gather(*(_shut(self._links.pop(pid)) for pid in gone + kept[MAX_IDLE_LINKS:]))
        for pid in set(self.rtts_ms) - set(self.table):
            del self.rtts_ms[pid]

    async def plan(self, *, exclude: frozenset[str] = frozenset(), min_free_kv_tokens: int = 0,
                   compat_key=None) -> Route:
        """Refresh the table, probe RTTs and plan the fastest complete route.

        Unreachable peers and peers inside their failure backoff are excluded. With
        spot-checks on (``spot_check_rate`` > 0), a route whose every hop another peer can
        check is preferred (peers on ``allow_ids`` need none; see ``routing.plan_route``).
        Raises :class:`NoRoute` naming what is missing.
        """
        await self.refresh()
        await self.measure_rtts()
        reachable = [p for p in self.table.values() if p.peer_id in self.rtts_ms]
        unreachable = set(self.table) - set(self.rtts_ms)
        try:
            return plan_route(reachable, client_rtts_ms=self.rtts_ms, compat_key=compat_key,
                              exclude=frozenset(exclude) | unreachable | self.backed_off(),
                              min_free_kv_tokens=min_free_kv_tokens, checkable=self.spot_check_rate > 0,
                              trusted=self.allow_ids or frozenset())
        except NoRoute as exc:
            if not self.not_allowed:
                raise
            raise NoRoute(f"{exc}; {len(self.not_allowed)} more peer(s) in the mesh are not in "
                          f"--allow-keys") from exc

    async def tokenizer(self, route: Route) -> Tokenizer:
        """The route's tokenizer and chat template, checked before use.

        The bundle must hash (:func:`~meshinfer.text.tokenizer.bundle_sha256`) to the
        ``tokenizer_sha256`` that most peers of the route's weights advertise in their signed
        adverts (:meth:`_agreed_tokenizer`), so one peer cannot swap words or the system prompt
        for everyone. It is fetched from the first hop, else from other peers advertising it;
        a peer whose bundle does not hash to its own advert is banned. Peers that advertise
        none (older versions) are taken at their word, as before. The template renders in a
        child process with time and memory limits (:mod:`meshinfer.text.template_sandbox`).

        Raises:
            IncompatiblePeer: the peers of these weights disagree with no majority, or no peer
                sent a bundle of the agreed hash (or of these weights).
            IncompatibleDraft: this client's draft model has another vocabulary.
        """
        weights_hash = route.compat_key[0]
        agreed = self._agreed_tokenizer(weights_hash)
        key = (weights_hash, agreed)
        if key not in self._tokenizers:
            first = route.hops[0].peer
            sources = [first] + sorted((p for p in self.table.values() if p.weights_hash == weights_hash
                                        and p.tokenizer_sha256 == agreed and p.peer_id != first.peer_id),
                                       key=lambda p: self.rtts_ms.get(p.peer_id, math.inf))
            self._tokenizers[key] = await self._fetch_tokenizer(sources[:TOKENIZER_SOURCES], weights_hash, agreed)
        if self.draft_model is not None:
            self.draft_model.check_vocabulary(self._tokenizers[key])
        return self._tokenizers[key]

    def _agreed_tokenizer(self, weights_hash: str) -> str:
        """The ``tokenizer_sha256`` advertised by the most peers of ``weights_hash`` ("" when
        none advertises one).

        Raises:
            IncompatiblePeer: two or more hashes tie for the most peers.
        """
        votes = collections.Counter(p.tokenizer_sha256 for p in self.table.values()
                                    if p.weights_hash == weights_hash and p.tokenizer_sha256)
        if not votes:
            return ""
        (best, n), *rest = votes.most_common()
        if rest and rest[0][1] == n:
            raise IncompatiblePeer(f"the peers of weights {weights_hash[:12]} disagree on the tokenizer: "
                                   + ", ".join(f"{c} advertise {h[:12]}" for h, c in votes.most_common())
                                   + "; no majority to trust")
        if rest:
            log.warning("peers of weights %s advertise %d other tokenizer(s); using %s (%d of %d peers)",
                        weights_hash[:12], len(rest), best[:12], n, sum(votes.values()))
        return best

    async def _fetch_tokenizer(self, sources: Sequence[PeerAdvert], weights_hash: str, agreed: str) -> Tokenizer:
        """The first bundle from ``sources`` that belongs to ``weights_hash`` and hashes to
        ``agreed`` (any bundle of those weights when ``agreed`` is "")."""
        reasons = []
        for peer in sources:
            if agreed and peer.tokenizer_sha256 != agreed:
                reasons.append(f"peer {peer.peer_id[:12]} advertises tokenizer {peer.tokenizer_sha256[:12] or '(none)'}")
                continue
            try:
                link = await self.link(peer)
                _, f = await link.request("get_tokenizer", timeout_s=max(30.0, self.request_timeout_s))
                got, bundle = f.str("weights_hash"), f.get("bundle", dict)
                digest = bundle_sha256(bundle)
            except MeshError as exc:
                reasons.append(f"peer {peer.peer_id[:12]}: {exc}")
                continue
            if got != weights_hash or (agreed and digest != agreed):
                why = (f"sent the tokenizer of weights {got[:12]}" if got != weights_hash else
                       f"sent a tokenizer hashing to {digest[:12]}, not the {agreed[:12]} it advertises")
                self.ban(peer.peer_id, why)
                reasons.append(f"peer {peer.peer_id[:12]} {why}")
                continue
            return Tokenizer.from_bundle(bundle)
        raise IncompatiblePeer(f"no peer sent a trustworthy tokenizer for weights {weights_hash[:12]}: "
                               + "; ".join(reasons))

    def draft_policy(self, route: Route, drafter: Drafter) -> DraftPolicy:
        """The draft-length policy of ``drafter``'s kind on ``route``, shared by this client's
        conversations: step times and draft costs belong to the route and the machine, and
        acceptance to the drafter, so a new conversation starts from what earlier ones measured."""
        key = (route.peer_ids, drafter.name)
        if key not in self._policies:
            self._policies[key] = DraftPolicy.for_route(route, prior_acceptance=drafter.prior_acceptance,
                                                        prior_draft_ms=drafter.prior_draft_ms)
        return self._policies[key]

    def conversation(self, route: Route, *, max_tokens_total: int, **options) -> "Conversation":
        """A new conversation over ``route`` holding at most ``max_tokens_total`` tokens.

        ``options`` go to :class:`Conversation` (``deadline_floor_s``, ``spot_check_rate``
        (default: this client's), ``spot_check_seed``, ``speculate``, ``draft_tokens``,
        ``draft_model`` and ``draft_ahead`` (default: this client's)).
        """
        options.setdefault("spot_check_rate", self.spot_check_rate)
        options.setdefault("draft_model", self.draft_model)
        options.setdefault("draft_ahead", self.draft_ahead)
        return Conversation(self, route, max_tokens_total=max_tokens_total, **options)


def _address(client: MeshClient, peer: PeerAdvert) -> str:
    """Where the client reaches ``peer``: ``relay://RELAY-ID`` through a relay, else its first address."""
    link = client._links.get(peer.peer_id)
    if link is not None and link.relay_id is not None:
        return f"relay://{link.relay_id}"
    return (peer.addrs or ("",))[0]


def _next_hop(hop) -> dict:
    """The ``next`` field of an ``open``/``reroute`` naming ``hop`` (its relays only when it has some,
    so frames to reachable hops keep their old bytes)."""
    out = {"peer_id": hop.peer_id, "addrs": list(hop.peer.addrs)}
    if hop.peer.relays:
        out["relays"] = list(hop.peer.relays)
    return out


class Conversation:
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
            or "auto": when the route's round trip holds a draft pass, see :meth:`_ahead_pays`).
            Off by default: on the 2-core benchmark machine it measured no faster than drafting
            after each step (docs/benchmarks.md).

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
                 draft_ahead: bool | str = False) -> None:
        import uuid

        if not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidInput(f"draft_tokens must be 1-{MAX_DRAFT_TOKENS}, got {draft_tokens}")
        if draft_ahead not in (True, False, "auto"):
            raise InvalidInput(f"draft_ahead must be True, False or 'auto', got {draft_ahead!r}")
        self.speculate, self.draft_tokens, self.draft_ahead = speculate, draft_tokens, draft_ahead

        self.client, self.route = client, route
        self.conv_id = uuid.uuid4().hex
        self.max_tokens_total = max_tokens_total
        self.deadline_floor_s = deadline_floor_s
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.cached: list[int] = []  # token ids sent to the route, in order
        self.confirmed = 0  # tokens every hop is known to hold (a token came back after them)
        self._held = 0  # positions the hops may hold: more than cached after rejected drafts
        self.draft_model = draft_model
        self.drafter: Drafter | None = None  # made on the first speculative generate
        self.policy: DraftPolicy | None = None  # chooses each step's draft length
        self._warm: asyncio.Future | None = None  # the drafter's prefill of a generate() in progress
        self.max_step_tokens = 512
        self.failovers: list[dict] = []
        self._seq = 0
        self._min_seq = 0  # replies to steps before this one are stale
        self._open = False
        self._compute_ms: dict[str, list[float]] = {}
        self._step_ms: list[float] = []
        self._opening = 0
        self._opened: set[str] = set()  # peers that may hold this conversation (opened, not closed since)
        self.sampling: SamplingParams | None = None  # set by generate(); None: greedy
        self.audit = spotcheck.Auditor(rate=spot_check_rate, seed=spot_check_seed)
        self.detections: list[dict] = []
        self._reply_length: int | None = None  # positions the last hop said it holds after a step

    # ------------------------------------------------------------------ hops
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
        await link.request(
            "reroute" if reroute else "open", timeout_s=self.client.request_timeout_s, conv=self.conv_id,
            layers=[hop.layers.start, hop.layers.stop], max_tokens=self.max_tokens_total,
            prev=hops[i - 1].peer_id if i else None,
            next=_next_hop(nxt) if nxt else None)
        self._opened.add(hop.peer_id)

    async def open(self) -> None:
        """Open the conversation on every hop (reserving KV), in order.

        Raises:
            CacheFull: a hop has no room; PeerUnavailable: a hop is unreachable.
        """
        if self.draft_model is not None:  # refuse another vocabulary before any hop reserves room
            await self.client.tokenizer(self.route)
        self.client._convs[self.conv_id] = self
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
        self.client._convs.pop(self.conv_id, None)
        self._open = False
        drafter, self.drafter = self.drafter, None
        if drafter is not None:
            await drafter.close()
        await self._close_on(self.route.hops)

    async def _close_on(self, hops) -> None:
        for hop in hops:
            self._opened.discard(hop.peer_id)
            link = self.client._links.get(hop.peer_id)
            if link is not None and not link.closed.is_set():
                try:
                    await link.send("close", conv=self.conv_id)
                except MeshError:
                    pass

    async def _truncate(self, length: int, hops=None) -> None:
        for hop in hops if hops is not None else self.route.hops:
            link = await self.client.link(hop.peer)
            await link.request("truncate", timeout_s=self.client.request_timeout_s, conv=self.conv_id,
                               length=length)
        del self.cached[length:]
        self.confirmed = min(self.confirmed, length)
        self.audit.truncate(length)
        self._held = length

    # ------------------------------------------------------------------ steps
    async def _send(self, tokens: Sequence[int], start: int, *, want: str, replay: bool = False) -> int:
        self._seq += 1
        first = await self.client.link(self.route.hops[0].peer)
        extra = {"sampling": self.sampling.to_wire()} if want == "token" and self.sampling else {}
        if start < self._held and not replay:
            extra["rollback"] = True  # hops drop the rejected drafts of the step before
        await first.send("step", conv=self.conv_id, seq=self._seq, start=start, tokens=list(tokens),
                         want=want, replay=replay, **extra)
        self._held = start + len(tokens)
        return self._seq

    def _deadline_s(self, n_tokens: int) -> float:
        return self.deadline_floor_s + DEADLINE_FACTOR * self.route.estimated_ms_per_token / 1e3 * n_tokens

    async def _await_token(self, seq: int, timeout_s: float, n_tokens: int | None = None) -> tuple[list[int], list]:
        """The chosen ids of step ``seq`` (``n_tokens`` of them for want="tokens", else one) and its trace."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                link, msg_type, f = await asyncio.wait_for(self.inbox.get(), max(remaining, 0.001))
            except asyncio.TimeoutError:
                raise PeerUnavailable(f"no token for step {seq} within {timeout_s:.1f} s") from None
            if msg_type == "closed":
                if f in self.route.peer_ids:
                    raise PeerUnavailable(f"the connection to hop {f[:12]} closed")
                continue
            msg_seq = f.get("seq", int, None)
            if msg_seq is not None and msg_seq < self._min_seq:
                continue  # a late reply from before a failover
            if msg_type == "error":
                raise self._credible(remote_error(f), link)
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

    def _credible(self, exc: MeshError, link: Link) -> MeshError:
        """``exc`` when it is not a :class:`LyingPeer` or its ``suspect`` is the hop just before
        the reporting one (the only hop whose hidden states the reporter checks); otherwise a
        :class:`LyingPeer` naming the reporter, which accused a hop it cannot have checked."""
        if not isinstance(exc, LyingPeer) or exc.suspect is None:
            return exc
        hops = self.route.hops
        if any(a.peer_id == exc.suspect and b.peer_id == link.remote_id for a, b in zip(hops, hops[1:])):
            return exc
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
                self.cached.extend(tokens)
                ids, trace = await self._await_token(seq, self._deadline_s(len(tokens)),
                                                     len(tokens) if want == "tokens" else None)
                self.confirmed = len(self.cached)
                return ids, trace
            except MeshError as exc:
                del self.cached[start:]
                if getattr(exc, "code", None) not in FAILOVER_CODES or attempt == MAX_FAILOVERS:
                    raise
                await self._failover(exc, in_flight=start + len(tokens))
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ failover
    async def _probe(self, hop) -> int | None:
        """Positions ``hop`` holds for this conversation, or None when it does not answer."""
        link = self.client._links.get(hop.peer_id)
        if link is None or link.closed.is_set():
            return None
        try:
            _, f = await link.request("probe", timeout_s=min(2.0, self.client.request_timeout_s),
                                      conv=self.conv_id)
            return f.int("length", lo=0, hi=1 << 40)
        except MeshError:
            return None

    async def _find_failed(self, in_flight: int) -> set[str]:
        lengths = await asyncio.gather(*(self._probe(h) for h in self.route.hops))
        failed = {h.peer_id for h, n in zip(self.route.hops, lengths) if n is None}
        if not failed:  # everyone answers: the first hop that has not finished the step is stuck
            # (!=, not <: a hop that never got a step after rejected drafts still holds them, maybe
            # more positions than the step would leave; a hop that finished holds exactly in_flight)
            stuck = next((h for h, n in zip(self.route.hops, lengths) if n != in_flight), None)
            if stuck is not None:
                failed.add(stuck.peer_id)
        return failed

    async def _failover(self, exc: MeshError, *, in_flight: int, failed: set[str] | None = None) -> None:
        """Replace failed hops (found by probing unless given), keep the others' caches, replay
        the confirmed tokens."""
        t0 = time.perf_counter()
        failed = failed if failed is not None else await self._find_failed(in_flight)
        for pid in failed:  # a hop behind a dead relay is fine: the relay is backed off, the hop reopened
            self.client.mark_failed(self.client.culprit(pid))
        log.warning("conversation %s: %s; failing over from %s", self.conv_id[:12], exc,
                    ", ".join(p[:12] for p in failed) or "an unknown hop")
        old = self.route
        try:
            new = await asyncio.wait_for(self.client.plan(compat_key=old.compat_key),
                                         self.client.request_timeout_s * 3)
        except asyncio.TimeoutError:
            raise PeerUnavailable("no new route found in time after a hop failed") from exc
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

    # ------------------------------------------------------------------ generation
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
                del self.cached[keep:]
                self.confirmed = min(self.confirmed, keep)
                await self._failover(exc, in_flight=keep)
        t0 = time.perf_counter()
        eos = set(eos_ids)  # speculation verifies greedy choices: sampled generation decodes plainly
        spec = self._start_speculation() if self.speculate and self.sampling is None else None
        # the drafter reads the prompt while the mesh does, and while plain steps run if it is slower
        self._warm = asyncio.ensure_future(self.drafter.prefill(prompt_ids)) if spec else None
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
            self._record(trace, (time.perf_counter() - ts) * 1e3, len(ids))
        result.set_decode_rate(taken - 1, time.perf_counter() - t1)

    def _start_speculation(self) -> SpecStats:
        """Counters for one generation; the drafter and policy are made once per conversation."""
        if self.drafter is None:
            self.drafter = self.draft_model.drafter() if self.draft_model is not None else PromptLookup()
        if self.policy is None:
            self.policy = self.client.draft_policy(self.route, self.drafter)
        return SpecStats(draft_tokens=self.draft_tokens, drafter=self.drafter.name)

    def unverified_hops(self) -> list[dict]:
        """Hops of the current route whose output no spot-check has verified, each with why:
        ``{"peer", "layers", "reason"}`` (no other peer serves its layers, spot-checks are off,
        sampled tokens, or not checked yet). Peers on the client's ``allow_ids`` are trusted."""
        out = []
        trusted = self.client.allow_ids or frozenset()
        for i, hop in enumerate(self.route.hops):
            if hop.peer_id in trusted or self.audit.mark(hop) > 0:
                continue
            disputed = self.audit.disputed_by(hop.peer_id, self.client.backed_off())
            if disputed:
                why = f"peer {disputed[0][:12]} disagrees with its output and no third peer can settle it"
            elif not spotcheck.alternates(self.client, self.route, hop):
                why = "no other peer serves these layers, so nothing can check them"
            elif self.audit.rate <= 0:
                why = "spot-checks are off"
            elif i == len(self.route.hops) - 1 and self.sampling is not None:
                why = "sampled tokens are not checked"
            else:
                why = "not checked yet"
            out.append({"peer": hop.peer_id, "layers": hop.layers.cli(), "reason": why})
        return out

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
        if self._ahead_pays():  # draft the next step's tokens while the mesh answers this one
            self.drafter.draft_ahead(history + drafts, self.draft_tokens + 1)
        if not drafts:
            spec.plain_steps += 1
            out, trace = await self._timed_step(history[-1:], result)
        else:
            try:
                out, trace = await self._timed_step([history[-1], *drafts], result, drafts=drafts)
            except ProtocolError as exc:  # a hop that predates speculative decoding: go on without it
                if "want" not in str(exc):
                    raise
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
                    del self.cached[start + len(ids):]  # rejected drafts (the hops roll them back later)
                    self.confirmed = len(self.cached)
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
            suspect = await spotcheck.find_length_liar(self, held)
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
        """Ban the liar, roll back to its last verified position, fail over; return the tokens to
        send next (``sent`` is every token the route was given, the failed step's included)."""
        hop = next(h for h in self.route.hops if h.peer_id == exc.suspect)
        verified, n_prompt = self.audit.mark(hop), len(result.prompt_ids)
        self.client.ban(exc.suspect, str(exc))
        trusted = min(len(sent), max(n_prompt, verified + 1))  # tokens chosen from verified output, or given
        keep = min(verified, trusted - 1, self.confirmed)  # positions the hops keep
        del self.cached[keep:]
        self.confirmed = keep
        self.audit.truncate(keep)
        await self._failover(exc, in_flight=keep, failed={exc.suspect})
        del result.token_ids[max(0, trusted - n_prompt):]
        self.detections.append({"peer": exc.suspect, "layers": hop.layers.cli(), "reason": str(exc),
                                "kept_tokens": trusted, "dropped_tokens": len(sent) - trusted})
        return sent[keep:trusted]

    def _record(self, trace: list, step_ms: float, n_tokens: int = 1) -> None:
        """Keep a decode step's wall ms and each hop's compute ms, per token the step produced."""
        self._step_ms.append(step_ms / n_tokens)
        for entry in trace[:64]:
            if isinstance(entry, dict) and isinstance(entry.get("peer"), str):
                ms = entry.get("compute_ms", 0.0)
                ms = float(ms) if isinstance(ms, (int, float)) else 0.0
                self._compute_ms.setdefault(entry["peer"], []).append(ms / n_tokens)

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
        return [HopStats(peer_id=h.peer_id, address=_address(self.client, h.peer), layers=h.layers.cli(),
                         device=h.peer.device, precision=h.peer.precision,
                         compute_ms_per_token=round(c, 3),
                         network_ms_per_token=round(network * w / total, 3)).__dict__
                for h, c, w in zip(hops, compute, weights)]

