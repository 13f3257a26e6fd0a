"""Which tokenizer bundle a client trusts for a route: the one most peers of the weights
advertise, fetched from peers that advertise it and checked against its hash."""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Sequence

from meshinfer.core.errors import IncompatiblePeer, MeshError, PeerUnavailable, ProtocolError
from meshinfer.text.bundle import bundle_sha256
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.wire import protocol
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


#: Most bytes of a tokenizer bundle the client takes in parts (the largest real ones are a few MB).
MAX_TOKENIZER_BYTES = 64 << 20


async def _get_tokenizer(link, timeout_s: float) -> tuple[str, dict]:
    """(weights hash, bundle) from the peer at ``link``: one ``tokenizer`` reply, or, over a
    relay whose frames cannot hold the bundle, its parts in order (``chunk``, ``part`` of
    ``parts``: the msgpack-encoded bundle), joined and decoded with the frame decoder's limits,
    all within ``timeout_s``.

    Raises:
        ProtocolError: parts out of order, of other weights, smaller than the peers send (but
            the last), more than :data:`MAX_TOKENIZER_BYTES` in all, or joined parts that do not
            decode to a map (an attack run found a crash, 16x memory, and hours of CPU there).
        PeerUnavailable: the parts took longer than ``timeout_s``.
    """
    try:
        got, chunks = await asyncio.wait_for(_tokenizer_parts(link, timeout_s), timeout_s)
    except asyncio.TimeoutError:
        raise PeerUnavailable(f"the tokenizer's parts took longer than {timeout_s:g} s") from None
    if isinstance(chunks, dict):
        return got, chunks
    data = b"".join(chunks)
    try:
        bundle = protocol.unpack(data, max_bytes=len(data))
    except ProtocolError as exc:
        raise ProtocolError(f"tokenizer parts do not decode: {exc}") from exc
    if not isinstance(bundle, dict):
        raise ProtocolError("tokenizer parts do not decode to a map")
    return got, bundle


async def _tokenizer_parts(link, timeout_s: float) -> tuple[str, dict | list[bytes]]:
    """(weights hash, the whole bundle or its parts in order) for :func:`_get_tokenizer`."""
    _, f = await link.request("get_tokenizer", timeout_s=timeout_s)
    got = f.str("weights_hash")
    if f.get("chunk", bytes, None) is None:
        return got, f.get("bundle", dict)
    parts = f.int("parts", lo=1, hi=MAX_TOKENIZER_BYTES // protocol.MIN_TOKENIZER_PART_BYTES + 1)
    chunks = [f.get("chunk", bytes)]
    total = len(chunks[0])
    while len(chunks) < parts:
        if len(chunks[-1]) < protocol.MIN_TOKENIZER_PART_BYTES:
            raise ProtocolError(f"tokenizer part {len(chunks) - 1} is smaller than the peers send")
        _, f = await link.request("get_tokenizer", timeout_s=timeout_s, part=len(chunks))
        if f.int("part", lo=0, hi=parts) != len(chunks) or f.str("weights_hash") != got:
            raise ProtocolError("tokenizer parts out of order, or of other weights")
        chunks.append(f.get("chunk", bytes))
        total += len(chunks[-1])
        if total > MAX_TOKENIZER_BYTES:
            raise ProtocolError(f"tokenizer bundle larger than {MAX_TOKENIZER_BYTES} bytes")
    return got, chunks


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
            got, bundle = await _get_tokenizer(link, max(30.0, client.request_timeout_s))
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

