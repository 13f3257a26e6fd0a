"""Peer identity keys and the gossiped peer table.

Each peer has an Ed25519 key (``cryptography``); its peer id is the first 16 bytes of the
SHA-256 of the raw public key, in hex. Adverts spread by gossip: every
``gossip_interval_s`` a peer sends its own fresh advert plus every record it holds to each
peer it knows. A record lives ``ttl_s`` seconds after the origin last refreshed it: relays
forward the *remaining* TTL, never a fresh one, so a peer that dies disappears from every
table within ``ttl_s`` plus one gossip interval (documented in docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from .protocol import PeerAdvert

#: Seconds a record stays valid without a refresh. 5 gossip rounds: a peer survives a few
#: lost rounds, and a dead one is gone in about 12 s.
DEFAULT_TTL_S = 10.0
#: Seconds between gossip rounds (and RTT probes).
DEFAULT_GOSSIP_INTERVAL_S = 2.0


def load_or_create_key(path: str | os.PathLike):
    """Load the peer's Ed25519 private key from ``path``, creating it (mode 0600) on first start.

    Raises:
        OSError: the key file cannot be read or written.
        ValueError: the file exists but is not a PEM Ed25519 private key.
    """
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    p = Path(path).expanduser()
    if p.exists():
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{p} holds a {type(key).__name__}, not an Ed25519 private key")
        return key
    p.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def peer_id_of(key) -> str:
    """Peer id of an Ed25519 private or public key: hex of SHA-256(raw public key)[:16]."""
    from cryptography.hazmat.primitives import serialization

    public = key.public_key() if hasattr(key, "public_key") else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


class PeerTable:
    """Adverts of the other peers, each with a local expiry time.

    Args:
        self_id: this peer's id (its own advert is never stored), or None on a client.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, self_id: str | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.self_id = self_id
        self._clock = clock
        self._records: dict[str, tuple[PeerAdvert, float]] = {}

    def merge(self, adverts: Iterable[PeerAdvert]) -> int:
        """Store adverts that are newer (larger ``seq``) than what is held; return how many."""
        now, taken = self._clock(), 0
        for ad in adverts:
            if ad.peer_id == self.self_id or ad.ttl_s <= 0:
                continue
            held = self._records.get(ad.peer_id)
            if held is None or ad.seq > held[0].seq:
                self._records[ad.peer_id] = (ad, now + ad.ttl_s)
                taken += 1
        return taken

    def expire(self) -> list[str]:
        """Drop records past their expiry; return the dropped peer ids."""
        now = self._clock()
        dead = [pid for pid, (_, until) in self._records.items() if until <= now]
        for pid in dead:
            del self._records[pid]
        return dead

    def remove(self, peer_id: str) -> None:
        """Forget ``peer_id`` (it said goodbye)."""
        self._records.pop(peer_id, None)

    def get(self, peer_id: str) -> PeerAdvert | None:
        """The live advert of ``peer_id``, or None."""
        self.expire()
        held = self._records.get(peer_id)
        return held[0] if held else None

    def adverts(self) -> list[PeerAdvert]:
        """Live adverts, each with ``ttl_s`` set to its remaining lifetime (what relays send)."""
        self.expire()
        now = self._clock()
        return [replace(ad, ttl_s=max(0.0, until - now)) for ad, until in self._records.values()]

    def __len__(self) -> int:
        self.expire()
        return len(self._records)
