"""A peer's connections: listening, admitting, dialing (with backoff), reuse and tracking.

A connection is reused whichever side opened it: :meth:`Connections.link_to` returns any open
link to a peer id before it dials one, and a peer nobody can dial is reached through a circuit
of one of its relays. Every link is tracked from its upgrade (or dial) until its socket closes,
and its conversations and forwarded circuits end with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import websockets

from meshinfer.core.errors import InvalidInput, MeshError, PeerUnavailable
from meshinfer.core.logs import context
from meshinfer.peer import limits
from meshinfer.peer.limits import Bucket
from meshinfer.wire import discovery
from meshinfer.wire.transport import Link, circuit_link, dial, first_success, name_scopes

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer

#: a child of the node's logger: configuring ``meshinfer.peer.node`` configures all of a peer
log = logging.getLogger("meshinfer.peer.node.connections")


class Connections:
    """The links of ``peer``.

    Attributes:
        by_peer: remote peer id -> link, whichever side dialed (``Peer.links``).
        all: every open link: accepted, dialed, or a circuit.
        dialing: peer id -> the dial in flight (a second caller waits on it).
        dial_failures: peer id -> (no dial before, failures in a row), see :meth:`dial_failed`.
        dial_bucket: token bucket of dials of learnt addresses (:data:`limits.MAX_DIALS_PER_S`).
        host_connections: remote IP -> accepted connections open (from the upgrade on).
    """

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.by_peer: dict[str, Link] = {}
        self.all: set[Link] = set()
        self.dialing: dict[str, asyncio.Future] = {}
        self.dial_failures: dict[str, tuple[float, int]] = {}
        self.dial_bucket = Bucket(limits.MAX_DIALS_PER_S, 2 * limits.MAX_DIALS_PER_S)
        self.host_connections: dict[str, int] = {}
        self.own_name_scopes: set[str] = set()  # the scope this peer's own DNS names give (resolve_own_names)

    def own_addrs(self) -> tuple[str, ...]:
        """This peer's own addresses: what it advertises (not the 127.0.0.1 stand-in of a peer
        bound to every interface without ``--public-addr``) and its bootstrap."""
        s = self.peer.settings
        bound_all = s.host in ("0.0.0.0", "::", "") and not s.public_addrs  # advertises 127.0.0.1 as a stand-in
        return (*(() if bound_all else self.peer.addrs), *s.public_addrs, *s.bootstrap)

    async def resolve_own_names(self) -> None:
        """Resolve the DNS names among :meth:`own_addrs` (``transport.name_scopes``: private scope
        from names that resolve to private addresses only): a peer named on a LAN or VPN dials
        the names of that network it learns."""
        self.own_name_scopes = await name_scopes(self.own_addrs())

    async def keep_own_names_resolved(self) -> None:
        """:meth:`resolve_own_names` now and every :data:`limits.OWN_NAMES_EVERY_S` while the
        peer has names of its own (a DNS that is down at start-up must not leave a LAN peer
        without its scope for good)."""
        while True:
            await self.resolve_own_names()
            if all(discovery.ip_literal(discovery.endpoint(u)[1]) is not None or discovery.endpoint(u)[1] == "loopback"
                   for u in self.own_addrs()):
                return
            await asyncio.sleep(limits.OWN_NAMES_EVERY_S)

    @property
    def learnt_scopes(self) -> set[str]:
        """The scopes (``discovery.address_scope``) of addresses learnt from others that this peer
        dials: public addresses and DNS names always; loopback and private ones only when an
        address of its own (what it advertises, its bootstrap) is in the same scope. So a peer on
        the Internet cannot be made to dial services on its own machine or network (an attack
        run sent a service on loopback `GET /admin/delete?...` requests through `open.next`). An
        own DNS name gives private scope when all its addresses are private, and never loopback
        or link-local (:meth:`resolve_own_names`)."""
        return discovery.dialable_scopes(self.own_addrs()) | self.own_name_scopes

    async def listen(self, ssl_context, scheme: str) -> None:
        """Accept connections on ``host:port``; set the peer's ``addrs`` (``public_addrs``, else the bound
        address), ``port`` and ``_server`` (closed by ``Peer.close``)."""
        s = self.peer.settings
        server = await websockets.serve(self.accept, s.host, s.port, max_size=self.peer.max_frame_bytes,
                                        ssl=ssl_context, ping_interval=20, ping_timeout=20, compression=None,
                                        open_timeout=limits.HANDSHAKE_TIMEOUT_S, process_request=self.admit)
        self.peer._server = server
        port = server.sockets[0].getsockname()[1]
        host = s.host if s.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if host != s.host and not s.public_addrs:
            log.warning("listening on all interfaces without --public-addr: other machines cannot dial the "
                        "advertised %s; pass --public-addr %s://THIS-HOST:%d", host, scheme, port)
        self.peer.addrs = tuple(s.public_addrs) or (f"{scheme}://{host}:{port}",)
        self.peer.port = port

    def admit(self, ws, request):
        """Answer the upgrade with HTTP 503 when the remote host already holds
        ``client_limits.connections`` connections; else count this one until its socket closes."""
        host = discovery.host_key(str(ws.remote_address[0])) if ws.remote_address else "?"
        limit, held = self.peer.settings.client_limits.connections, self.host_connections.get(host, 0)
        if held >= limit:
            self.peer.metrics.error("too_many_connections")
            return ws.respond(503, f"{host} already holds {limit} connections to this peer, the most one host "
                                   f"may hold; close some and retry\n")
        self.host_connections[host] = held + 1
        ws.connection_lost_waiter.add_done_callback(lambda _f: self.release_host(host))
        return None

    def release_host(self, host: str) -> None:
        left = self.host_connections.pop(host, 1) - 1
        if left > 0:
            self.host_connections[host] = left

    async def accept(self, ws) -> None:
        link = Link(ws, max_bytes=self.peer.max_frame_bytes, on_message=self.peer._on_message,
                    name=f"{ws.remote_address}")
        await self.serve_link(link)

    async def serve_link(self, link: Link) -> None:
        link.meter, link.admit = self.peer.metrics, self.peer.budgets.admit
        self.all.add(link)
        hello_timer = asyncio.get_running_loop().call_later(
            limits.HELLO_TIMEOUT_S, lambda: link.role is None and self.peer._spawn(link.close(1008, "no hello"), "close"))
        try:
            await link.run()
        finally:
            hello_timer.cancel()
            self.forget(link)
            for conv in [c for c in self.peer.convs.values() if c.owner is link]:
                log.info("client of conversation %s disconnected; freeing it", conv.conv_id,
                         extra=context(conv=conv.conv_id, peer=self.peer.peer_id))
                await self.peer.conversations.drop(conv.conv_id)

    async def link_to(self, peer_id: str, addrs: tuple[str, ...], relays: tuple[str, ...] | None = None) -> Link:
        """An open link to ``peer_id``: reuse any connection, else dial ``addrs``, else open a
        circuit through one of ``relays`` (None: those its advert in the table lists; ``()``: none).

        Raises:
            PeerUnavailable: no connection exists, no address answers and no relay reaches it.
        """
        link = self.by_peer.get(peer_id)
        if link is not None and not link.closed.is_set():
            return link
        if peer_id in self.dialing:
            return await asyncio.shield(self.dialing[peer_id])
        until, failures = self.dial_failures.get(peer_id, (0.0, 0))
        if until > time.monotonic():
            raise PeerUnavailable(f"peer {peer_id[:12]} failed {failures} dial(s) in a row; next try in "
                                  f"{until - time.monotonic():.1f} s")
        if relays is None:
            known = self.peer.table.get(peer_id)
            relays = known.relays if known is not None else ()
        fut = asyncio.get_running_loop().create_future()
        self.dialing[peer_id] = fut
        try:
            link = await self.reach(peer_id, addrs, relays)
            self.dial_failures.pop(peer_id, None)
            fut.set_result(link)
            return link
        except BaseException as exc:
            if isinstance(exc, PeerUnavailable):
                self.dial_failed(peer_id)
            fut.set_exception(exc if isinstance(exc, Exception) else PeerUnavailable("dial cancelled"))
            fut.exception()  # mark retrieved
            raise
        finally:
            del self.dialing[peer_id]

    async def reach(self, peer_id: str, addrs: tuple[str, ...], relays: tuple[str, ...]) -> Link:
        """Dial ``addrs``; for a peer with ``relays`` (nobody can dial it), first a circuit through the
        first of them that reaches ``peer_id``, then its addresses.

        Raises:
            PeerUnavailable: naming each address's and relay's failure.
        """
        if not relays:
            return await self.peer._dial_any(addrs, expect_id=peer_id)
        errors = []
        for relay_id in relays:  # it says nobody can dial it: its relays first, its addresses last
            relay = self.peer.table.get(relay_id)
            try:
                if relay_id in (self.peer.peer_id, peer_id) or relay is None:
                    raise PeerUnavailable("not a peer this one knows")
                carrier = await self.link_to(relay_id, relay.addrs, ())
                if carrier.relay_id is not None:
                    raise PeerUnavailable("it is reached through a relay itself")
                return await self.circuit_to(carrier, peer_id)
            except PeerUnavailable as exc:
                errors.append(f"through relay {relay_id[:12]}: {exc}")
        if addrs:
            try:
                return await self.peer._dial_any(addrs, expect_id=peer_id)
            except PeerUnavailable as exc:
                errors.append(str(exc))
        raise PeerUnavailable(f"cannot reach peer {peer_id[:12]}: " + "; ".join(errors))

    async def circuit_to(self, carrier: Link, peer_id: str) -> Link:
        """A link to ``peer_id`` over a circuit through ``carrier`` (a link to one of its relays),
        after the same handshake as a dialed link: the relay cannot answer for the peer.

        Raises:
            PeerUnavailable: the relay refused, or the handshake failed.
        """
        advert = self.peer.table.get(peer_id)
        if advert is None:
            raise PeerUnavailable(f"no advert of peer {peer_id[:12]}: its key, which seals the circuit, is unknown")
        sock = carrier.open_circuit(peer_id, public_key=advert.public_key, max_bytes=self.peer.max_frame_bytes)
        link = circuit_link(sock, on_message=self.peer._on_message, name=f"relay://{carrier.remote_id}")
        link = await self.shake(link, peer_id)
        self.peer.gossip.merge([link.info.pop("advert")], proven=True)
        self.by_peer.setdefault(peer_id, link)
        log.info("reached peer %s through relay %s", peer_id[:12], (carrier.remote_id or "?")[:12])
        return link

    def dial_failed(self, peer_id: str) -> None:
        """Back off dialing ``peer_id``: :data:`DIAL_BACKOFF_S` doubled per failure in a row."""
        _, failures = self.dial_failures.pop(peer_id, (0.0, 0))
        if len(self.dial_failures) >= limits.MAX_DIAL_FAILURES:
            del self.dial_failures[next(iter(self.dial_failures))]
        backoff_s = min(limits.MAX_DIAL_BACKOFF_S, limits.DIAL_BACKOFF_S * 2 ** failures)
        self.dial_failures[peer_id] = (time.monotonic() + backoff_s, failures + 1)

    async def dial_any(self, addrs: tuple[str, ...], expect_id: str | None) -> Link:
        """Dial ``addrs`` at once and shake hands; the first link that proves ``expect_id`` (any
        peer for a bootstrap address, ``expect_id`` None). The others are closed.

        Raises:
            PeerUnavailable: no address answered, each error named.
        """
        try:
            link = await first_success([self.dial_one(url, expect_id) for url in addrs],
                                       discard=lambda lk: lk.close())
        except PeerUnavailable as exc:
            if expect_id is None:  # a bootstrap address: each error already names its URL
                raise
            raise PeerUnavailable(f"cannot reach peer {expect_id[:12]}: {exc}") from None
        self.peer.gossip.merge([link.info.pop("advert")], proven=True)
        self.by_peer.setdefault(link.remote_id, link)
        return link

    async def dial_one(self, url: str, expect_id: str | None) -> Link:
        """Dial ``url`` and shake hands; the link holds the remote's advert in ``info["advert"]``.

        An address learnt from others (``expect_id`` given) takes a token of the peer's dial
        bucket (:data:`MAX_DIALS_PER_S`); bootstrap addresses do not.

        Raises:
            PeerUnavailable: not dialed (no token), unreachable, or the handshake failed.
        """
        if expect_id is not None and (scope := discovery.address_scope(url)) not in self.learnt_scopes:
            raise PeerUnavailable(f"{url}: not dialed; a {scope} address learnt from another peer, and this peer "
                                  f"has no {scope} address of its own (a peer on that network: pass --public-addr "
                                  f"with this machine's address there)")
        if expect_id is not None and not self.dial_bucket.take(1):
            raise PeerUnavailable(f"{url}: not dialed; this peer dials at most {limits.MAX_DIALS_PER_S:g} learnt "
                                  f"addresses a second")
        try:
            link = await dial(url, max_bytes=self.peer.max_frame_bytes, on_message=self.peer._on_message,
                              insecure=self.peer.settings.insecure, tls_ca=self.peer.settings.tls_ca,
                              scopes=None if expect_id is None else self.learnt_scopes)
        except InvalidInput as exc:
            raise PeerUnavailable(str(exc)) from exc
        link.info.update(dialed=True, bootstrap=url in self.peer.settings.bootstrap)
        return await self.shake(link, expect_id)

    async def shake(self, link: Link, expect_id: str | None) -> Link:
        """Track a new outgoing ``link`` (dialed, or a circuit) and shake hands on it; the link
        holds the remote's advert in ``info["advert"]``. It is closed when the handshake fails.

        Raises:
            PeerUnavailable: the handshake failed, naming the link.
        """
        link.meter, link.admit = self.peer.metrics, self.peer.budgets.admit
        self.all.add(link)
        link.reader.add_done_callback(lambda _t, lk=link: self.forget(lk))
        try:
            remote = await self.peer.handshake.greet(link, expect_id)
        except BaseException as exc:
            await link.close()
            if isinstance(exc, MeshError):
                raise PeerUnavailable(f"{link.name}: {exc}") from exc
            raise
        link.remote_id, link.role = remote.peer_id, "peer"
        link.info.update(authed=True, advert=remote, public_key=remote.public_key)
        return link

    def forget(self, link: Link) -> None:
        """``link`` closed: stop tracking it, end the circuits forwarded over it, and tell the
        clients of conversations whose next hop it reached (``Conversations.next_hop_lost``)."""
        self.all.discard(link)
        self.peer.relay.drop_forwards(link)
        self.peer.conversations.next_hop_lost(link)
        if link.remote_id and self.by_peer.get(link.remote_id) is link:
            del self.by_peer[link.remote_id]

    def close_idle(self, now: float) -> None:
        """Close connections silent for :data:`IDLE_LINK_TIMEOUT_S` that hold no conversation and
        are not a peer that proved its key (peers gossip every few seconds)."""
        owners = {c.owner for c in self.peer.convs.values()}
        for link in list(self.all):
            proven_peer = link.role == "peer" and link.remote_id is not None
            if link.role is None or proven_peer or link in owners or now - link.last_frame_at < limits.IDLE_LINK_TIMEOUT_S:
                continue  # before hello: HELLO_TIMEOUT_S closes it
            log.info("closing %s: no frame for %.0f s and no conversation", link.name, now - link.last_frame_at)
            link.last_frame_at = now  # one close each
            self.peer._spawn(link.close(1000, "idle"), "close idle")
