"""The client's view of the mesh: discovery, RTT probes, the peer table, failure backoff,
route planning, and the conversations it opens (:class:`MeshClient`).

The client dials every hop of its route (to open the conversation there and to receive
errors), sends token ids to the first hop only, and receives the chosen token from the
last hop. It never sends or receives hidden states.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from typing import Sequence

from meshinfer.client import spotcheck, tokenizer_trust
from meshinfer.client.conversation import Conversation
from meshinfer.client.draft import DraftModel, Drafter
from meshinfer.client.links import DIAL_TIMEOUT_S, MeshLinks
from meshinfer.client.reports import ReportLedger
from meshinfer.client.routing import Route, plan_route
from meshinfer.client.speculative import DraftPolicy
from meshinfer.core.errors import InvalidInput, MeshError, NoRoute, PeerUnavailable, Unauthenticated
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.wire import discovery
from meshinfer.wire.protocol import PeerAdvert
from meshinfer.wire.transport import Link

log = logging.getLogger(__name__)

#: RTT probes per peer; the median is used.
RTT_PROBES = 3
#: Tokenizers a client keeps (one per weights hash and tokenizer hash; up to 64 MiB each, the
#: oldest dropped first): peers that advertise many models cannot grow a long-running `serve`.
MAX_TOKENIZERS = 8

#: Peers of the table that :meth:`MeshClient.refresh` asks at once when no bootstrap peer answers.
FALLBACK_PEERS = 8
#: Unreachable peers a no-route error names, with why (the rest are counted).
MAX_UNREACHABLE_NOTES = 3
#: Failure backoff of a peer: 5 s after its first failure, doubling up to 5 minutes.
BASE_BACKOFF_S, MAX_BACKOFF_S = 5.0, 300.0


class MeshClient(MeshLinks):
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
                 draft_model: DraftModel | None = None, draft_ahead: bool | str = "auto") -> None:
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
        self.unreachable: dict[str, str] = {}  # peer id -> why the last probe failed
        self._links: dict[str, Link] = {}
        self._convs: dict[str, "Conversation"] = {}
        self._tokenizers: dict[tuple[str, str], Tokenizer] = {}  # (weights hash, tokenizer hash) ->
        self._failed: dict[str, tuple[float, int]] = {}  # peer id -> (excluded until, failures)
        self.reports = ReportLedger()  # hops' reports no probe bore out, over all conversations (client.failover)
        self.accusations = ReportLedger()  # hops' accusations of their previous hop with no evidence
        self._policies: dict[tuple, DraftPolicy] = {}  # (route's peers, drafter) -> its draft policy

    async def __aenter__(self) -> "MeshClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ------------------------------------------------------------------ backoff
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
        """Fetch the peer table from the first bootstrap peer that answers (``--peers``, one
        after the other), else from a peer learnt before: up to :data:`FALLBACK_PEERS` of them,
        the nearest first, asked at once (each at its addresses in this client's scopes or
        through its relays, ``MeshLinks.link``), the first table that arrives kept. So when the
        bootstrap peers are down, adverts cannot point the client at services on its own
        machine, and silent peers cost one dial timeout, not one each.

        Adverts whose signature does not verify are ignored.

        Raises:
            PeerUnavailable: no bootstrap peer answered.
            Unauthenticated: no peer answered, and some refused this client (a private mesh
                without its key) or could not prove their keys.
        """
        errors, refused = [], False
        for url in dict.fromkeys(self.bootstrap):
            try:
                link, advert, _ = await self._hello(url)
            except MeshError as exc:
                errors.append(str(exc))
                refused |= isinstance(exc, Unauthenticated)
                continue
            try:
                signed = await self._get_peers(link, url)
            except MeshError as exc:
                errors.append(str(exc))
                await link.close()
                continue
            old = self._links.get(advert.peer_id)
            if old is None or old.closed.is_set():
                self._links[advert.peer_id] = link
            else:
                await link.close()
            return await self._adopt(signed)
        signed, refused_known = await self._ask_known_peers(errors)
        if signed is not None:  # added to what the client knew: one answer cannot empty or eclipse the table
            return await self._adopt(signed, keep=self.table)
        raise (Unauthenticated if refused or refused_known else PeerUnavailable)(
            "no bootstrap peer answered: " + "; ".join(errors))

    async def _get_peers(self, link: Link, name: str) -> list[PeerAdvert]:
        """The signed adverts ``link``'s peer lists (``get_peers``).

        Raises:
            PeerUnavailable: no answer, or a malformed one, naming ``name``.
        """
        try:
            _, f = await link.request("get_peers", timeout_s=self.request_timeout_s)
            return [ad for ad in map(PeerAdvert.from_wire, f.get("adverts", list)) if discovery.verify_advert(ad)]
        except MeshError as exc:
            raise PeerUnavailable(f"{name}: {exc}") from exc

    async def _ask_known_peers(self, errors: list[str]) -> tuple[list[PeerAdvert] | None, bool]:
        """``get_peers`` of up to :data:`FALLBACK_PEERS` peers of the table (nearest first, not
        backed off) at once, within ``2 * dial_timeout_s`` in all: (the first answer or None,
        whether a peer refused this client); each failure is added to ``errors`` and backs the
        peer off (``mark_failed``), so peers that never answer cannot keep the next refresh
        from asking others."""
        known = sorted((p for p in self.table.values() if p.peer_id not in self.backed_off()),
                       key=lambda p: self.rtts_ms.get(p.peer_id, math.inf))[:FALLBACK_PEERS]

        async def ask(peer: PeerAdvert) -> list[PeerAdvert]:
            try:
                return await self._get_peers(await self.link(peer), f"peer {peer.peer_id[:12]}")
            except MeshError:
                self.mark_failed(peer.peer_id)
                raise

        tasks, refused = [asyncio.ensure_future(ask(p)) for p in known], False
        try:
            async with asyncio.timeout(2 * self.dial_timeout_s):
                for done in asyncio.as_completed(tasks):
                    try:
                        return await done, refused
                    except MeshError as exc:
                        errors.append(str(exc))
                        refused |= isinstance(exc, Unauthenticated)
            return None, refused
        except TimeoutError:
            errors.append(f"{sum(not t.done() for t in tasks)} known peer(s) did not answer within "
                          f"{2 * self.dial_timeout_s:g} s")
            for peer, task in zip(known, tasks):
                if not task.done():
                    self.mark_failed(peer.peer_id)
            return None, refused
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _adopt(self, signed: list[PeerAdvert], keep: dict[str, PeerAdvert] | None = None) -> list[PeerAdvert]:
        """Make ``signed`` (verified adverts, over those of ``keep``) the table, less peers off
        ``allow_ids``; returns it. An advert of ``keep`` is replaced only by a newer one of the
        same peer (``seq``)."""
        ads = [ad for ad in signed if self.allow_ids is None or ad.peer_id in self.allow_ids]
        table = dict(keep or {})
        for ad in ads:
            if ad.peer_id not in table or ad.seq >= table[ad.peer_id].seq:
                table[ad.peer_id] = ad
        self.table = table
        ads = list(table.values())
        self.not_allowed = frozenset(ad.peer_id for ad in signed) - set(self.table)
        await self._prune_links()
        return ads

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
                self.unreachable.pop(peer.peer_id, None)
            except MeshError as exc:
                log.info("peer %s unreachable: %s", peer.peer_id[:12], exc)
                self.rtts_ms.pop(peer.peer_id, None)
                self.unreachable[peer.peer_id] = str(exc)

        peers = list(self.table.values()) if peers is None else list(peers)
        await asyncio.gather(*(probe(p) for p in peers))
        await self._prune_links()
        return dict(self.rtts_ms)

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
            notes = [f"peer {pid[:12]} (layers {self.table[pid].layers.cli()}) is ready but unreachable from "
                     f"this client: {self.unreachable.get(pid, 'no answer')[:300]}"
                     for pid in sorted(unreachable)[:MAX_UNREACHABLE_NOTES]]
            if len(unreachable) > MAX_UNREACHABLE_NOTES:
                notes.append(f"{len(unreachable) - MAX_UNREACHABLE_NOTES} more unreachable peer(s)")
            if self.not_allowed:
                notes.append(f"{len(self.not_allowed)} more peer(s) in the mesh are not in --allow-keys")
            if not notes:
                raise
            raise NoRoute("; ".join([str(exc), *notes])) from exc

    async def tokenizer(self, route: Route) -> Tokenizer:
        """The route's tokenizer and chat template, checked before use.

        The bundle must hash (:func:`~meshinfer.text.tokenizer.bundle_sha256`) to the
        ``tokenizer_sha256`` that most peers of the route's weights advertise in their signed
        adverts (:func:`~meshinfer.client.tokenizer_trust.agreed_tokenizer`), so one peer cannot
        swap words or the system prompt for everyone. It is fetched from the first hop, else from other peers advertising it;
        a peer whose bundle does not hash to its own advert is banned. Peers that advertise
        none (older versions) are taken at their word, as before. The template renders in a
        child process with time and memory limits (:mod:`meshinfer.text.template_sandbox`).

        Raises:
            IncompatiblePeer: the peers of these weights disagree with no majority, or no peer
                sent a bundle of the agreed hash (or of these weights).
            IncompatibleDraft: this client's draft model has another vocabulary.
        """
        weights_hash = route.compat_key[0]
        agreed = tokenizer_trust.agreed_tokenizer(self.table, weights_hash)
        key = (weights_hash, agreed)
        if key not in self._tokenizers:
            first = route.hops[0].peer
            sources = [first] + sorted((p for p in self.table.values() if p.weights_hash == weights_hash
                                        and p.tokenizer_sha256 == agreed and p.peer_id != first.peer_id),
                                       key=lambda p: self.rtts_ms.get(p.peer_id, math.inf))
            tok = await tokenizer_trust.fetch_tokenizer(self, sources[:tokenizer_trust.TOKENIZER_SOURCES],
                                                        weights_hash, agreed)
            while len(self._tokenizers) >= MAX_TOKENIZERS:  # peers advertising many models cannot grow it
                del self._tokenizers[next(iter(self._tokenizers))]
            self._tokenizers[key] = tok
        if self.draft_model is not None:
            self.draft_model.check_vocabulary(self._tokenizers[key])
        return self._tokenizers[key]

    def draft_policy(self, route: Route, drafter: Drafter, *, ahead: bool | str = False) -> DraftPolicy:
        """The draft-length policy of ``drafter``'s kind on ``route``, shared by this client's
        conversations: step times and draft costs belong to the route and the machine, and
        acceptance to the drafter, so a new conversation starts from what earlier ones measured.
        Conversations with another ``ahead`` (their ``draft_ahead`` setting) get another policy:
        drafting during steps changes the step times (a draft model sharing the hops' CPU)."""
        key = (route.peer_ids, drafter.name, ahead)
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

