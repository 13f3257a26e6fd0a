"""The client's connections to peers: dialing (directly, or through a relay), the handshake,
the link table, and which open conversations each link's frames go to."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from meshinfer.client.reports import UNKNOWN_HOST
from meshinfer.core.errors import MeshError, PeerUnavailable, Unauthenticated
from meshinfer.wire import discovery
from meshinfer.wire.protocol import PeerAdvert
from meshinfer.wire.transport import Link, circuit_link, dial, first_success, name_scopes

if TYPE_CHECKING:
    from meshinfer.client.conversation import Conversation
    from meshinfer.client.routing import Route

log = logging.getLogger(__name__)

#: Largest frame a client accepts, bytes: the tokenizer bundle of a 150k-token vocabulary
#: is about 10 MB; nothing else a peer sends is larger than a few KB.
CLIENT_MAX_FRAME_BYTES = 64 << 20
#: Seconds a client waits for one address to accept and answer its hello (all of a peer's
#: addresses are dialed at once): an advert of addresses that never answer costs this, once.
DIAL_TIMEOUT_S = 5.0
#: Most connections a client keeps to peers that no open conversation routes through (the
#: nearest by RTT are kept; the others are closed after each refresh and probe). Links to peers
#: gone from the table are closed too, so peers that come and go (rotating fake identities)
#: cannot pile up a long-lived client's sockets (``serve``) to its open-file limit.
MAX_IDLE_LINKS = 32
#: Seconds a pruned link may take to close before its socket is aborted.
LINK_CLOSE_TIMEOUT_S = 1.0
#: Seconds the scopes of the client's own DNS names (``--peers``) are kept before a new lookup.
NAME_SCOPES_TTL_S = 60.0


async def _shut(link: Link) -> None:
    """Close ``link``, aborting it when the remote does not finish the close within
    :data:`LINK_CLOSE_TIMEOUT_S` (a fake peer may never answer)."""
    try:
        await asyncio.wait_for(link.close(), LINK_CLOSE_TIMEOUT_S)
    except asyncio.TimeoutError:
        link.ws.transport.abort()


class MeshLinks:
    """The connection half of :class:`~meshinfer.client.mesh.MeshClient`: one link per peer id,
    dialed on demand, and the open conversations that the links' frames are routed to.

    It has no constructor of its own: :class:`~meshinfer.client.mesh.MeshClient` sets the
    fields it uses (``_links``, ``_convs``, ``table``, ``rtts_ms``, the dial options) and its
    :meth:`backed_off`.
    """

    _links: dict[str, Link]
    _convs: dict[str, "Conversation"]
    #: The scopes the DNS names among ``bootstrap`` give (``transport.name_scopes``): one lookup
    #: for all callers, made on a dial of an advert's address, and again after
    #: :data:`NAME_SCOPES_TTL_S`; (the lookup, when it started).
    _bootstrap_name_scopes: "tuple[asyncio.Task, float] | None" = None

    async def close(self) -> None:
        """Close every conversation and connection. Safe to call twice."""
        for conv in list(self._convs.values()):
            await conv.close()
        for link in list(self._links.values()):
            await link.close()
            if getattr(link, "reader", None):
                await asyncio.gather(link.reader, return_exceptions=True)
        self._links.clear()

    # ------------------------------------------------------------------ conversations
    def attach(self, conv: "Conversation") -> None:
        """Route the ``token`` and ``error`` frames of ``conv`` (by its ``conv_id``) to its inbox,
        and wake it when a link of its route closes; :meth:`close` closes it too."""
        self._convs[conv.conv_id] = conv

    def detach(self, conv_id: str) -> None:
        """Stop routing frames to conversation ``conv_id`` (a no-op when it is not attached)."""
        self._convs.pop(conv_id, None)

    def open_link(self, peer_id: str) -> Link | None:
        """The open connection to ``peer_id``, or None when there is none (nothing is dialed)."""
        link = self._links.get(peer_id)
        return link if link is not None and not link.closed.is_set() else None

    def context_tokens(self, route: "Route") -> int | None:
        """The model's context, tokens, as the hops of ``route`` said in their ``welcome``
        (``context_tokens``): the largest of them, or None when no open link to a hop says
        (peers older than the field).

        The largest, not the least: the hops run one weights file, so they share one context, and
        the value only lets a caller refuse prompts early (:func:`~meshinfer.app.reply.check_prompt_fits`).
        A hop that told a smaller one (1, say) would otherwise make every prompt refused on routes
        through it; with the largest, a liar can only make the early check weaker. Each hop still
        refuses an ``open`` beyond its own context."""
        told = [link.info.get("context_tokens") for link in map(self.open_link, route.peer_ids) if link is not None]
        return max((n for n in told if n is not None), default=None)

    def address(self, peer: PeerAdvert) -> str:
        """Where this client reaches ``peer``: ``relay://RELAY-ID`` through a relay, else its
        first address ("" when it lists none)."""
        link = self._links.get(peer.peer_id)
        if link is not None and link.relay_id is not None:
            return f"relay://{link.relay_id}"
        return (peer.addrs or ("",))[0]

    # ------------------------------------------------------------------ connections
    async def _on_message(self, link: Link, msg_type: str, f) -> None:
        conv = self._convs.get(f.str("conv", "") or "")
        if conv is not None and msg_type in ("token", "error"):
            if link.remote_id in conv.route.peer_ids:  # only the route's hops speak for it (see _await_token)
                conv.hear(link, msg_type, f, link.last_frame_bytes)
        elif msg_type == "error":
            log.warning("error from %s: %s", link.name, f.str("message", ""))
        elif msg_type == "ping":
            await link.send("pong", re=f.get("id", int, None))

    async def _hello(self, url: str, scopes: set[str] | None = None) -> tuple[Link, PeerAdvert, int]:
        """Dial ``url`` (at an address in ``scopes``, ``transport.dial``) and shake hands."""
        link = await dial(url, max_bytes=CLIENT_MAX_FRAME_BYTES, on_message=self._on_message,
                          open_timeout_s=self.dial_timeout_s, insecure=self.insecure,
                          tls_ca=self.tls_ca, scopes=scopes)
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
            link.info["context_tokens"] = f.int("context_tokens", lo=1, hi=1 << 40, default=None)
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

    async def _hello_as(self, url: str, peer_id: str, scopes: set[str]) -> Link:
        """:meth:`_hello` to ``url`` (an advert's address, dialed at an address in ``scopes``),
        which must answer as ``peer_id`` (else ``PeerUnavailable``)."""
        link, advert, _ = await self._hello(url, scopes)
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

        A loopback or private address (``discovery.address_scope``) is dialed only when one of
        this client's bootstrap addresses (``--peers``) is in the same scope: a `serve` on the
        Internet cannot be pointed at services on its own machine or network by adverts.

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
            if self._bootstrap_name_scopes is None or (self._bootstrap_name_scopes[0].done() and time.monotonic()
                                                       - self._bootstrap_name_scopes[1] > NAME_SCOPES_TTL_S):
                self._bootstrap_name_scopes = (asyncio.ensure_future(name_scopes(self.bootstrap)), time.monotonic())
            scopes, allowed = {url: discovery.address_scope(url) for url in peer.addrs}, \
                discovery.dialable_scopes(self.bootstrap) | await asyncio.shield(self._bootstrap_name_scopes[0])
            refused = [url for url, scope in scopes.items() if scope not in allowed]
            errors += [f"{url}: not dialed; a {scopes[url]} address, and no --peers address is in that scope"
                       for url in refused]
            try:
                link = await first_success([self._hello_as(url, peer.peer_id, allowed) for url in peer.addrs
                                            if url not in refused], discard=lambda lk: lk.close())
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
                sock = carrier.open_circuit(peer.peer_id, public_key=peer.public_key, max_bytes=CLIENT_MAX_FRAME_BYTES)
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

    def host(self, peer_id: str) -> str:
        """Where hop ``peer_id`` runs, as far as this client can tell: ``discovery.host_key`` of
        the address its open direct connection reaches (an IPv4 address, an IPv6 /64), else
        ``reports.UNKNOWN_HOST`` (through a relay, or no open link), which all such hops share."""
        link = self.open_link(peer_id)
        address = getattr(link.ws, "remote_address", None) if link is not None and link.relay_id is None else None
        if not address:
            return UNKNOWN_HOST
        return discovery.host_key(str(address[0]))

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
                conv.hear(None, "closed", peer_id)

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

