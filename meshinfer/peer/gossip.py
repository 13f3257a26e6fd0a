"""Gossip: a peer's table of adverts, kept fresh by rounds of exchange with every known peer.

Each round dials the bootstrap addresses not yet known, measures each known peer's RTT with a
ping, and sends it this peer's advert and a random share of the table (:meth:`Gossip.payload`).
Incoming adverts are rate-limited per connection and checked (size, signature, ``--allow-keys``)
before they reach the table (:meth:`Gossip.merge`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from meshinfer.core.errors import LayerRangeError, MeshError, PeerUnavailable, ProtocolError, Unauthenticated
from meshinfer.peer import limits
from meshinfer.peer.limits import Bucket
from meshinfer.wire import protocol
from meshinfer.wire.protocol import PeerAdvert
from meshinfer.wire.transport import Link

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer

#: a child of the node's logger: configuring ``meshinfer.peer.node`` configures all of a peer
log = logging.getLogger("meshinfer.peer.node.gossip")


class Gossip:
    """The gossip of ``peer``: its table (``peer.table``) and RTTs (``peer.rtts_ms``) are kept here.

    Attributes:
        in_flight: peer ids with a gossip exchange in flight (one at a time per peer).
        bootstrap_errors: bootstrap URL -> the last reason it failed.
    """

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.in_flight: set[str] = set()
        self.bootstrap_errors: dict[str, str] = {}

    async def on_get_peers(self, link: Link, f) -> None:
        ads = [self.peer.advert()] + self.peer.table.adverts()
        await link.send("peers", re=f.get("id", int, None), adverts=[a.to_wire() for a in ads])

    async def on_gossip(self, link: Link, f) -> None:
        if link.role != "peer":
            raise ProtocolError("gossip is only accepted from peers")
        if link.remote_id is None:
            raise Unauthenticated("gossip: this peer has not proven its key; send auth after welcome")
        frames = link.info.setdefault("gossips", Bucket(limits.GOSSIP_FRAMES_PER_S, 2 * limits.GOSSIP_FRAMES_PER_S))
        if not frames.take(1):
            log.debug("dropping a gossip frame from %s: over %g a second", link.remote_id[:12], limits.GOSSIP_FRAMES_PER_S)
            return
        budget = link.info.setdefault("verifies", Bucket(limits.GOSSIP_VERIFIES_PER_S, 2 * limits.GOSSIP_VERIFIES_PER_S))
        known = self.peer.table.seqs()
        ads, seen = [], set()
        for d in f.get("adverts", list)[:limits.MAX_GOSSIP_ADVERTS]:
            peer_id = d.get("peer_id") if isinstance(d, dict) else None
            peer_id = peer_id if isinstance(peer_id, str) else None  # a malformed one fails in from_wire
            if peer_id in seen or (peer_id is not None and _not_newer(d, known)):
                continue  # a second copy, or one the table would not take: not worth parsing
            if not budget.take(1):
                log.debug("dropping gossip of %s unread: over %g adverts/s", link.remote_id[:12], limits.GOSSIP_VERIFIES_PER_S)
                break
            if peer_id is not None:
                seen.add(peer_id)
            try:
                ads.append(PeerAdvert.from_wire(d))
            except (ProtocolError, LayerRangeError) as exc:
                log.debug("dropping a malformed advert from %s: %s", link.remote_id, exc)
        self.merge(ads)

    def merge(self, ads: list[PeerAdvert], *, proven: bool = False) -> None:
        """Merge adverts into the table, dropping oversized or unsigned ones.

        ``proven``: their peers just proved their keys in a handshake with this peer. Once the
        table holds :data:`MAX_KNOWN_PEERS`, only such a peer gets in, in place of the unproven
        record closest to expiry that has no link and no conversation here. Adverts that could
        not get in, or are not newer than the record held, are dropped before their signature is
        checked.
        """
        known = self.peer.table.seqs()
        full = len(known) >= limits.MAX_KNOWN_PEERS
        keep = []
        for ad in ads:
            if full and not proven and ad.peer_id not in known:
                continue  # it could not get in: skip the signature check
            if ad.seq <= known.get(ad.peer_id, -1) and not proven:
                continue  # not newer than what is held: the table would not take it
            size = protocol.wire_size(ad.to_wire())
            if size > limits.MAX_ADVERT_BYTES:
                log.debug("dropping the advert of %s: %d bytes, over %d", ad.peer_id[:12], size, limits.MAX_ADVERT_BYTES)
                continue
            if not limits.verify_advert(ad):
                log.debug("dropping an advert for %s: its signature does not verify", ad.peer_id[:12])
                continue
            if not self.allowed(ad.peer_id):
                log.debug("dropping the advert of %s: not on --allow-keys", ad.peer_id[:12])
                continue
            keep.append(ad)
        busy = {c.next_id for c in self.peer.convs.values()} | {c.prev_id for c in self.peer.convs.values()}
        self.peer.table.merge(keep, proven=proven, protected=(set(self.peer.links) | busy) - {None})

    def allowed(self, peer_id: str) -> bool:
        """Whether ``peer_id`` may take part in this peer's mesh (``--allow-keys``)."""
        allow = self.peer.settings.allow_ids
        return allow is None or peer_id == self.peer.peer_id or peer_id in allow

    async def loop(self) -> None:
        while True:
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gossip round failed")
            await asyncio.sleep(self.peer.settings.gossip_interval_s)

    async def round(self) -> None:
        self.peer._seq += 1
        targets = {ad.peer_id: ad.addrs for ad in self.peer.table.adverts()}
        dialed = await asyncio.gather(*(self.bootstrap(url) for url in self.peer.settings.bootstrap
                                        if not any(url in a for a in targets.values())),
                                      return_exceptions=True)
        del dialed
        payload = self.payload()
        for peer_id, addrs in {ad.peer_id: ad.addrs for ad in self.peer.table.adverts()}.items():
            if peer_id not in self.in_flight:  # one exchange per peer: a silent one must not pile up tasks
                self.in_flight.add(peer_id)
                self.peer._spawn(self.gossip_to(peer_id, addrs, payload), f"gossip {peer_id[:12]}")
        for gone in set(self.peer.rtts_ms) - {a.peer_id for a in self.peer.table.adverts()}:
            del self.peer.rtts_ms[gone]

    def payload(self) -> list[dict]:
        """This peer's advert, then known ones in random order, within :data:`GOSSIP_BUDGET_BYTES`."""
        others = self.peer.table.adverts()
        random.shuffle(others)  # a table too large for one round still spreads over several
        payload, size = [], 0
        for ad in [self.peer.advert()] + others:
            wire = ad.to_wire()
            n = protocol.wire_size(wire)
            if size + n <= limits.GOSSIP_BUDGET_BYTES:
                payload.append(wire)
                size += n
        return payload

    async def bootstrap(self, url: str) -> None:
        """Dial a bootstrap address (retried every gossip round until its peer is known).

        A failure is logged as a warning when its reason is new (a wrong scheme or a host that
        is down would otherwise leave a peer that looks ready but never joins), and at debug
        level while the same reason repeats; reaching it after a failure is logged too.
        """
        try:
            await self.peer._dial_any((url,), expect_id=None)
        except PeerUnavailable as exc:
            reason = str(exc)
            if self.bootstrap_errors.get(url) != reason:
                log.warning("cannot join the mesh through %s yet (retrying every %g s): %s", url,
                            self.peer.settings.gossip_interval_s, reason)
            else:
                log.debug("bootstrap %s: %s", url, reason)
            self.bootstrap_errors[url] = reason
        else:
            if self.bootstrap_errors.pop(url, None) is not None:
                log.info("reached bootstrap peer %s", url)

    async def gossip_to(self, peer_id: str, addrs: tuple[str, ...], payload: list) -> None:
        try:
            if not addrs and peer_id not in self.peer.links:
                return  # a peer nobody can dial gossips over the links it opens; no circuit for gossip
            link = await self.peer.conns.link_to(peer_id, addrs, ())
            t0 = time.perf_counter()
            await link.request("ping", timeout_s=self.peer.settings.request_timeout_s)
            self.peer.rtts_ms[peer_id] = round((time.perf_counter() - t0) * 1e3, 3)
            await link.send("gossip", adverts=payload)
        except MeshError as exc:
            log.debug("gossip to %s failed: %s", peer_id[:12], exc)
        finally:
            self.in_flight.discard(peer_id)



def _not_newer(d: dict, known: dict[str, int]) -> bool:
    """Whether the raw advert ``d`` names a peer in ``known`` (peer id -> seq held) with a seq
    no larger than the one held."""
    held, seq = known.get(d.get("peer_id")), d.get("seq")
    return held is not None and type(seq) is int and seq <= held
