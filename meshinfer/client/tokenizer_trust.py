"""Which tokenizer bundle a client trusts for a route: the one most peers of the weights
advertise, fetched from peers that advertise it and checked against its hash."""

from __future__ import annotations

import collections
import logging
from typing import Sequence

from meshinfer.core.errors import IncompatiblePeer, MeshError
from meshinfer.text.bundle import bundle_sha256
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.wire.protocol import PeerAdvert

log = logging.getLogger(__name__)

#: Peers asked for the tokenizer before giving up: the route's first hop, then the nearest
#: others that advertise the agreed tokenizer.
TOKENIZER_SOURCES = 3


def agreed_tokenizer(table: dict[str, PeerAdvert], weights_hash: str) -> str:
    """The ``tokenizer_sha256`` advertised by the most peers of ``weights_hash`` in ``table``
    (peer id -> advert; "" when none advertises one).

    Raises:
        IncompatiblePeer: two or more hashes tie for the most peers.
    """
    votes = collections.Counter(p.tokenizer_sha256 for p in table.values()
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


async def fetch_tokenizer(client, sources: Sequence[PeerAdvert], weights_hash: str, agreed: str) -> Tokenizer:
    """The first bundle from ``sources`` that belongs to ``weights_hash`` and hashes to
    ``agreed`` (any bundle of those weights when ``agreed`` is ""), fetched over ``client``
    (a :class:`~meshinfer.client.mesh.MeshClient`), which bans a source that sent another.

    Raises:
        IncompatiblePeer: no source sent such a bundle (each source's reason is named).
    """
    reasons = []
    for peer in sources:
        if agreed and peer.tokenizer_sha256 != agreed:
            reasons.append(f"peer {peer.peer_id[:12]} advertises tokenizer {peer.tokenizer_sha256[:12] or '(none)'}")
            continue
        try:
            link = await client.link(peer)
            _, f = await link.request("get_tokenizer", timeout_s=max(30.0, client.request_timeout_s))
            got, bundle = f.str("weights_hash"), f.get("bundle", dict)
            digest = bundle_sha256(bundle)
        except MeshError as exc:
            reasons.append(f"peer {peer.peer_id[:12]}: {exc}")
            continue
        if got != weights_hash or (agreed and digest != agreed):
            why = (f"sent the tokenizer of weights {got[:12]}" if got != weights_hash else
                   f"sent a tokenizer hashing to {digest[:12]}, not the {agreed[:12]} it advertises")
            client.ban(peer.peer_id, why)
            reasons.append(f"peer {peer.peer_id[:12]} {why}")
            continue
        return Tokenizer.from_bundle(bundle)
    raise IncompatiblePeer(f"no peer sent a trustworthy tokenizer for weights {weights_hash[:12]}: "
                           + "; ".join(reasons))

