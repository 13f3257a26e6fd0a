"""Relaying: circuits that let clients and peers reach a peer nobody can dial, and the
reachability check that tells a peer whether it is one.

A peer that finds itself unreachable (:meth:`Relay.check_reachability`) lists as its relays
some peers it dialed itself (:meth:`Relay.relays`); a relay forwards the frames of each circuit
opened through it between the opener's link and the hidden peer's (:attr:`Relay.forwards`),
and the hidden peer serves each circuit like a connection (:meth:`Relay.accept_circuit`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from meshinfer.core.errors import MeshError, PeerUnavailable, ProtocolError, RateLimited, Unauthenticated
from meshinfer.peer import limits
from meshinfer.peer.limits import client_host
from meshinfer.wire import protocol
from meshinfer.wire.circuit_seal import CircuitSeal
from meshinfer.wire.transport import RELAY_OVERHEAD_BYTES, CircuitSocket, Link, first_success

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer

#: a child of the node's logger: configuring ``meshinfer.peer.node`` configures all of a peer
log = logging.getLogger("meshinfer.peer.node.relay")


class Relay:
    """The circuits ``peer`` forwards as a relay, and its own reachability.

    Attributes:
        forwards: (opener link, circ) -> (hidden peer's link, circ) of each circuit forwarded.
        backwards: the reverse map.
    """

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.forwards: dict[tuple[Link, int], tuple[Link, int]] = {}
        self.backwards: dict[tuple[Link, int], tuple[Link, int]] = {}

    def relays(self) -> tuple[str, ...]:
        """Peer ids this peer lists as its relays: empty unless it is unreachable; else the
        dialable, unrelayed peers it holds a link to that it opened itself (its NAT keeps
        those open), at most :data:`meshinfer.wire.protocol.MAX_RELAYS`, bootstrap peers first."""
        if self.peer.reachable is not False:
            return ()
        out = []
        for peer_id, link in self.peer.links.items():
            ad = self.peer.table.get(peer_id)
            if link.closed.is_set() or link.relay_id is not None or not link.info.get("dialed"):
                continue
            if ad is not None and ad.addrs and not ad.relays:
                out.append((not link.info.get("bootstrap"), peer_id))
        return tuple(pid for _, pid in sorted(out)[:protocol.MAX_RELAYS])

    async def on_relay(self, link: Link, f) -> None:
        """A circuit frame toward a hidden peer: forward it (this peer is its relay; the frame
        names ``to``), or, without ``to``, the first frame of a circuit to this peer."""
        circ = f.int("circ", lo=0, hi=1 << 62)
        data = f.get("data", bytes)
        to = f.str("to", None)
        if to is None:
            try:
                self.accept_circuit(link, circ, data, host=f.str("host", "?")[:64])
            except MeshError as exc:
                link.post("relay_close", circ=circ, back=True, message=str(exc)[:200], cut=False)
                raise
            return
        dest = self.forwards.get((link, circ))
        if dest is None:
            try:
                dest = self.open_forward(link, circ, to)
            except MeshError as exc:
                link.post("relay_close", circ=circ, back=True, message=str(exc), cut=False)
                raise
        if too_big(dest[0], data):
            self.end_forward(link, circ, f"a {len(data)}-byte circuit frame is larger than peer {to[:12]} takes")
        elif not dest[0].post("relay", circ=dest[1], data=data, host=client_host(link), cut=False):
            self.end_forward(link, circ, f"peer {to[:12]} does not read fast enough")

    def open_forward(self, link: Link, circ: int, to: str) -> tuple[Link, int]:
        """Start forwarding circuit ``circ`` of ``link`` to peer ``to``, a peer that lists this one as
        its relay and holds a link it opened here.

        Raises:
            Unauthenticated: ``link`` has not said hello.
            PeerUnavailable: ``to`` has no such link here, or does not list this peer as a relay.
            RateLimited: too many circuits from ``link`` or to ``to``.
        """
        target = self.peer.links.get(to)
        advert = self.peer.table.get(to)
        if target is None or target.closed.is_set() or target.relay_id is not None or target is link:
            raise PeerUnavailable(f"relay {self.peer.peer_id[:12]} holds no link from peer {to[:12]}")
        if advert is None or self.peer.peer_id not in advert.relays:
            raise PeerUnavailable(f"peer {to[:12]} does not list {self.peer.peer_id[:12]} among its relays")
        if sum(1 for lk, _ in self.forwards if lk is link) >= limits.MAX_CIRCUITS_PER_LINK:
            raise RateLimited(f"this connection already has {limits.MAX_CIRCUITS_PER_LINK} circuits through this relay")
        host = client_host(link)
        held = sum(1 for (opener, _), (dest, _) in self.forwards.items() if dest is target and client_host(opener) == host)
        if held >= limits.MAX_CIRCUITS_PER_HOST_TO_PEER:
            raise RateLimited(f"client {host} already has {limits.MAX_CIRCUITS_PER_HOST_TO_PEER} circuits to peer "
                              f"{to[:12]} through this relay")
        if sum(1 for lk, _ in self.backwards if lk is target) >= limits.MAX_CIRCUITS_PER_PEER:
            raise RateLimited(f"peer {to[:12]} already has {limits.MAX_CIRCUITS_PER_PEER} circuits through this relay")
        dest = (target, target.next_circuit_id())
        self.forwards[(link, circ)] = dest
        self.backwards[dest] = (link, circ)
        return dest

    async def on_relay_back(self, link: Link, f) -> None:
        """A circuit frame from a hidden peer back toward the circuit's opener: forward it."""
        circ = f.int("circ", lo=0, hi=1 << 62)
        data = f.get("data", bytes)
        src = self.backwards.get((link, circ))
        if src is None:
            return  # a circuit that ended meanwhile
        if too_big(src[0], data):
            self.end_forward(*src, f"a {len(data)}-byte circuit frame is larger than the opener takes")
        elif not src[0].post("relay_back", circ=src[1], data=data, cut=False):
            self.end_forward(*src, f"the opener of circuit {src[1]} does not read fast enough")

    async def on_relay_close(self, link: Link, f) -> None:
        """One end closed a circuit this peer forwards: tell the other end."""
        circ = f.int("circ", lo=0, hi=1 << 62)
        if f.get("back", bool, False):
            src = self.backwards.get((link, circ))
            if src is not None:
                self.end_forward(*src, f.str("message", "closed by the peer"))
        elif (link, circ) in self.forwards:
            self.end_forward(link, circ, "closed by its opener")

    def end_forward(self, link: Link, circ: int, reason: str) -> None:
        """Stop forwarding circuit ``circ`` of opener ``link``; tell both ends (best effort)."""
        dest = self.forwards.pop((link, circ), None)
        if dest is None:
            return
        self.backwards.pop(dest, None)
        log.debug("circuit %d ends: %s", circ, reason)
        link.post("relay_close", circ=circ, back=True, message=reason[:200], cut=False)
        dest[0].post("relay_close", circ=dest[1], back=False, cut=False)

    def drop_forwards(self, link: Link) -> None:
        """``link`` closed: end every circuit forwarded from or to it."""
        for opener, circ in [k for k, v in self.forwards.items() if k[0] is link or v[0] is link]:
            self.end_forward(opener, circ, "a link of the relay closed")

    def accept_circuit(self, carrier: Link, circ: int, data: bytes, *, host: str) -> None:
        """The first frame of a circuit a relay opened to this peer: serve it like a connection.

        Raises:
            ProtocolError: ``carrier`` is not a link to one of this peer's relays.
            RateLimited: the relay already carries :data:`MAX_CIRCUITS_PER_PEER` circuits here.
        """
        if carrier.relay_id is not None or carrier.remote_id is None or carrier.remote_id not in self.relays():
            raise ProtocolError(f"relay: peer {(carrier.remote_id or '?')[:12]} is not a relay of this peer")
        if sum(1 for side, _ in carrier.circuits if side == "in") >= limits.MAX_CIRCUITS_PER_PEER:
            carrier.post("relay_close", circ=circ, back=True, message="too many circuits", cut=False)
            raise RateLimited(f"relay {carrier.remote_id[:12]} already carries {limits.MAX_CIRCUITS_PER_PEER} circuits")
        limit = carrier.info.get("max_frame_bytes")
        sock = CircuitSocket(carrier, circ, side="in", seal=CircuitSeal(sign_key=self.peer.key),
                             max_bytes=self.peer.max_frame_bytes,
                             max_send_bytes=None if limit is None else limit - RELAY_OVERHEAD_BYTES,
                             remote_address=(f"{host} via {carrier.remote_id[:12]}", 0))
        carrier.circuits[("in", circ)] = sock
        link = Link(sock, max_bytes=self.peer.max_frame_bytes, on_message=self.peer._on_message,
                    name=f"circuit {circ} through {carrier.remote_id[:12]}")
        self.peer._spawn(self.peer.conns.serve_link(link), f"circuit {circ}")
        sock.feed(data)

    async def check_reachability(self) -> None:
        """Ask a bootstrap peer to dial this peer's addresses back (Petals' reachability check):
        :attr:`reachable` becomes True or False; it stays None when no peer can be asked."""
        for _ in range(30):
            link = next((lk for lk in self.peer.links.values() if lk.info.get("bootstrap") and not lk.closed.is_set()),
                        None)
            if link is not None:
                break
            await asyncio.sleep(self.peer.settings.gossip_interval_s)
        else:
            log.info("reachability not checked: no bootstrap peer answered")
            return
        try:
            _, f = await link.request("dial_back", timeout_s=limits.DIAL_BACK_TIMEOUT_S)
        except MeshError as exc:
            log.info("reachability not checked: %s", exc)
            return
        self.peer.reachable = f.get("ok", bool)
        if self.peer.reachable:
            self.peer.reachability_note = f"peer {link.remote_id[:12]} dialed {f.str('addr', '?')} back"
            log.info("reachable: %s", self.peer.reachability_note)
        else:
            self.peer.reachability_note = f"peer {link.remote_id[:12]} could not dial it back: {f.str('reason', '?')}"
            log.warning("unreachable at %s (%s); clients will reach this peer through relays %s",
                        ", ".join(self.peer.addrs), self.peer.reachability_note, ", ".join(r[:12] for r in self.relays()))
        self.peer._seq += 1

    async def on_dial_back(self, link: Link, f) -> None:
        """Reachability check for a peer with a proven link: dial the addresses of its signed
        advert (at the rate of learnt addresses) and say whether it answered as itself."""
        if link.role != "peer" or link.remote_id is None:
            raise Unauthenticated("dial_back: only a peer that proved its key may ask")
        if link.info.get("dialing_back"):
            raise RateLimited("dial_back: one at a time")
        advert = self.peer.table.get(link.remote_id)
        link.info["dialing_back"] = True
        self.peer._spawn(self.dial_back(link, advert.addrs if advert else (), f.get("id", int, None)), "dial back")

    async def dial_back(self, link: Link, addrs: tuple[str, ...], rid: int | None) -> None:
        try:
            test = await first_success([self.peer.conns.dial_one(url, link.remote_id) for url in addrs],
                                       discard=lambda lk: lk.close())
        except PeerUnavailable as exc:
            link.post("dialed_back", re=rid, ok=False, reason=str(exc)[:500] if addrs else "it advertises no address")
        else:
            await test.close()
            link.post("dialed_back", re=rid, ok=True, addr=test.name)
        finally:
            link.info["dialing_back"] = False


def too_big(link: Link, data: bytes) -> bool:
    """Whether a circuit frame ``data`` forwarded on ``link`` would pass the largest frame its
    far end said it takes (``max_frame_bytes`` in its hello; unknown: no check). Forwarded, it
    closed that end's whole connection to this relay, every circuit on it (found by an attack
    run: one stranger's frame cut a hidden peer off); now only the circuit ends."""
    limit = link.info.get("max_frame_bytes")
    return limit is not None and len(data) + RELAY_OVERHEAD_BYTES > limit
