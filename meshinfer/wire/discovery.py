"""Peer identity keys, signed adverts, handshake proofs and the gossiped peer table.

Each peer has an Ed25519 key (``cryptography``); its peer id is the first 16 bytes of the
SHA-256 of the raw public key, in hex. A peer signs its advert (:func:`sign_advert`), and
every receiver drops adverts whose signature or peer id does not match the key they carry
(:func:`verify_advert`), so nobody can speak for another peer id. The handshake proofs
(:func:`prove`, :func:`check_welcome`) bind a connection to a key; see docs/security.md.

Adverts spread by gossip: every
``gossip_interval_s`` a peer sends its own fresh advert plus every record it holds to each
peer it knows. A record lives ``ttl_s`` seconds after the origin last refreshed it: relays
forward the *remaining* TTL, never a fresh one, so a peer that dies disappears from every
table within ``ttl_s`` plus one gossip interval (documented in docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

from meshinfer.core.errors import ProtocolError, Unauthenticated
from meshinfer.wire.protocol import PeerAdvert

#: Seconds a record stays valid without a refresh. 5 gossip rounds: a peer survives a few
#: lost rounds, and a dead one is gone in about 12 s.
DEFAULT_TTL_S = 10.0
#: Seconds between gossip rounds (and RTT probes).
DEFAULT_GOSSIP_INTERVAL_S = 2.0
#: Longest ``ttl_s`` a merged advert keeps, seconds. ``ttl_s`` is not signed (relays rewrite
#: it), so a relay can keep a record of a dead peer alive for at most this long.
MAX_TTL_S = 60.0
#: Bytes of a handshake nonce (``hello`` and ``welcome`` each carry one).
NONCE_BYTES = 32

#: Domain labels: a signature made for one purpose never verifies for another.
ADVERT_LABEL = b"meshinfer-advert\0"
WELCOME_LABEL = b"meshinfer-welcome\0"
HELLO_LABEL = b"meshinfer-hello\0"
MESH_WELCOME_LABEL = b"welcome\0"
MESH_HELLO_LABEL = b"hello\0"
MESH_BOUND_LABEL = b"hello-addr\0"
STEP_LABEL = b"meshinfer-step\0"


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


#: Fewest bytes a mesh key file may hold (after surrounding whitespace is stripped).
MIN_MESH_KEY_BYTES = 16


def load_mesh_key(path: str | os.PathLike) -> bytes:
    """The shared key of a private mesh: the contents of ``path``, surrounding whitespace stripped.

    Make one with ``head -c 32 /dev/urandom | base64 > mesh.key`` and give every member a copy.

    Raises:
        OSError: the file cannot be read.
        ValueError: it holds fewer than :data:`MIN_MESH_KEY_BYTES` bytes.
    """
    p = Path(path).expanduser()
    key = p.read_bytes().strip()
    if len(key) < MIN_MESH_KEY_BYTES:
        raise ValueError(f"mesh key file {p} holds {len(key)} bytes; a mesh key needs at least "
                         f"{MIN_MESH_KEY_BYTES} (make one with: head -c 32 /dev/urandom | base64 > {p.name})")
    return key


def load_allowlist(path: str | os.PathLike) -> frozenset[str]:
    """Peer ids allowed in a mesh, from an ``--allow-keys`` file.

    One entry a line: a peer id (32 hex digits, as ``meshinfer id`` prints it) or a raw
    Ed25519 public key (64 hex digits, turned into its id). ``#`` starts a comment; blank
    lines are ignored.

    Raises:
        InvalidInput: an unreadable file, a line that is neither form (its number is named),
            or a file with no entry.
    """
    from meshinfer.core.errors import InvalidInput

    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"cannot read the allow-keys file {path}: {exc}") from None
    ids = set()
    for n, line in enumerate(text.splitlines(), 1):
        entry = line.split("#", 1)[0].strip().lower()
        if not entry:
            continue
        if len(entry) == 64 and all(c in "0123456789abcdef" for c in entry):
            ids.add(hashlib.sha256(bytes.fromhex(entry)).hexdigest()[:32])
        elif len(entry) == 32 and all(c in "0123456789abcdef" for c in entry):
            ids.add(entry)
        else:
            raise InvalidInput(f"{path}:{n}: {entry[:70]!r} is neither a peer id (32 hex digits) nor a public "
                               f"key (64 hex digits)")
    if not ids:
        raise InvalidInput(f"the allow-keys file {path} lists no peer; add peer ids (`meshinfer id`)")
    return frozenset(ids)


def not_allowed(peer_id: str) -> str:
    """The one-line refusal for a peer not on the ``--allow-keys`` list."""
    return f"peer {peer_id[:12]} is not on this mesh's --allow-keys list"


def peer_id_of(key) -> str:
    """Peer id of an Ed25519 private or public key: hex of SHA-256(raw public key)[:16]."""
    from cryptography.hazmat.primitives import serialization

    public = key.public_key() if hasattr(key, "public_key") else key
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:32]


def public_key_hex(key) -> str:
    """Hex of the raw 32-byte Ed25519 public key of a private or public key."""
    from cryptography.hazmat.primitives import serialization

    public = key.public_key() if hasattr(key, "public_key") else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def _public_key(hex_key: str):
    """The Ed25519 public key of ``hex_key``, or None when it is not 32 bytes of hex."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(hex_key))
    except ValueError:
        return None


def _verifies(public, sig: bytes, message: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        public.verify(sig, message)
        return True
    except InvalidSignature:
        return False


def sign_advert(advert: PeerAdvert, key) -> PeerAdvert:
    """``advert`` with ``public_key`` and ``sig`` set: signed by ``key`` over every field but
    ``sig`` and ``ttl_s`` (:meth:`PeerAdvert.signed_bytes`)."""
    advert = replace(advert, public_key=public_key_hex(key), sig="")
    return replace(advert, sig=key.sign(ADVERT_LABEL + advert.signed_bytes()).hex())


def verify_advert(advert: PeerAdvert) -> bool:
    """True when ``advert.peer_id`` is the id of ``advert.public_key`` and ``sig`` verifies."""
    public = _public_key(advert.public_key)
    if public is None or peer_id_of(public) != advert.peer_id:
        return False
    try:
        sig = bytes.fromhex(advert.sig)
    except ValueError:
        return False
    return _verifies(public, sig, ADVERT_LABEL + advert.signed_bytes())


def prove(key, label: bytes, first: bytes, second: bytes) -> bytes:
    """Ed25519 signature of ``label + first + second`` (a handshake proof)."""
    return key.sign(label + first + second)


def check_proof(public_key: str, proof: bytes, label: bytes, first: bytes, second: bytes) -> bool:
    """True when ``proof`` is the signature of ``label + first + second`` by ``public_key`` (hex)."""
    public = _public_key(public_key)
    return public is not None and _verifies(public, proof, label + first + second)


def _step_head(conv_id: str, seq: int, start: int) -> bytes:
    """The signed fields before the digests: the conversation id (length-prefixed, so no id can
    pass for another's), then seq and start (big-endian, 8 bytes each)."""
    cid = conv_id.encode()
    return struct.pack(">I", len(cid)) + cid + struct.pack(">QQ", seq, start)


def sign_step(key, conv_id: str, seq: int, start: int, digests: bytes) -> bytes:
    """A hop's Ed25519 signature (64 bytes) of the hidden states it sends its next hop for step
    ``seq`` of conversation ``conv_id``: positions from ``start``, one
    :func:`meshinfer.wire.tensors.row_digests` digest each (``digests``). The next hop keeps it,
    so that it can later prove what it received, and the sender cannot deny it
    (docs/security.md, "Signed steps")."""
    return prove(key, STEP_LABEL, _step_head(conv_id, seq, start), digests)


def check_step(public_key: str, sig: bytes, conv_id: str, seq: int, start: int, digests: bytes) -> bool:
    """True when ``sig`` is :func:`sign_step` of these fields by ``public_key`` (hex)."""
    return check_proof(public_key, sig, STEP_LABEL, _step_head(conv_id, seq, start), digests)


def mesh_mac(mesh_key: bytes, label: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 of ``label + first + second`` under the private mesh's shared key."""
    return hmac.new(mesh_key, label + first + second, hashlib.sha256).digest()


def check_mac(mesh_key: bytes, mac: bytes, label: bytes, first: bytes, second: bytes) -> bool:
    """True when ``mac`` is :func:`mesh_mac` of the same input (compared in constant time)."""
    return hmac.compare_digest(mac, mesh_mac(mesh_key, label, first, second))


def endpoint(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a ws:// or wss:// URL; every loopback host is ``"loopback"``, and
    a missing port is the scheme's default (80, 443). A URL that does not parse gives ("", "", 0)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme.lower(), (parts.hostname or "").lower(), parts.port
    except ValueError:
        return ("", "", 0)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return (scheme, "loopback" if loopback else host, port or (443 if scheme == "wss" else 80))


#: Host names that mean this machine or its own network whatever a resolver says (RFC 6761
#: reserves ``localhost`` and its subdomains; the others are common /etc/hosts and LAN names).
LOOPBACK_NAMES, LOCAL_SUFFIXES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"), (
    ".localhost", ".local", ".lan", ".internal", ".home.arpa", ".localdomain")


def address_scope(url: str) -> str:
    """Where a ws:// or wss:// URL's host lies: ``"loopback"`` (127.0.0.0/8, ::1, the unspecified
    0.0.0.0 and ::, which reach this machine, and :data:`LOOPBACK_NAMES`), ``"link-local"``
    (169.254.0.0/16, fe80::/10: the cloud metadata service 169.254.169.254 lives there),
    ``"private"`` (RFC 1918, RFC 4193 unique-local, carrier-grade NAT 100.64.0.0/10, single-label
    names and :data:`LOCAL_SUFFIXES`), ``"public"`` (any other IP address) or ``"name"`` (another
    DNS name: where it points is not known without resolving it). An IPv4 address in any spelling the
    system resolver takes (``127.1``, ``2130706433``, ``0x7f000001``) counts as that address.

    A ``"name"`` is dialed at one of the addresses it resolves to, and only when that address's
    own scope is allowed (``transport.dial``'s ``scopes``), so a name that resolves to loopback
    (DNS rebinding, an /etc/hosts entry) is no way around the scopes."""
    return host_scope(endpoint(url)[1])


def host_scope(host: str) -> str:
    """:func:`address_scope` of a bare host name or IP address (IPv6 with or without brackets,
    with or without a ``%zone``), as ``getaddrinfo`` gives them."""
    if host == "loopback":
        return "loopback"
    bare = host.strip("[]").rstrip(".").lower()
    if bare in LOOPBACK_NAMES or bare.endswith(".localhost"):
        return "loopback"
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        ip = _inet_aton(bare)
        if ip is None:
            return "private" if "." not in bare or bare.endswith(LOCAL_SUFFIXES) else "name"
    if ip.is_loopback or ip.is_unspecified:
        return "loopback"
    if ip.version == 6 and ip in _NAT64_LOCAL:
        return "private"
    ip = _embedded_ipv4(ip) or ip
    if ip.is_loopback or ip.is_unspecified:
        return "loopback"
    shared = ip.version == 4 and ip in ipaddress.ip_network("100.64.0.0/10")
    if ip.is_link_local:
        return "link-local"
    odd = ip.is_multicast or ip.is_reserved or (ip.version == 6 and ip.is_site_local)  # never a peer on the Internet
    return "private" if ip.is_private or shared or odd else "public"


#: IPv6 prefixes that carry an IPv4 address in their last 32 bits: IPv4-mapped, SIIT
#: (RFC 6052/7915 ``::ffff:0:0/96``), NAT64's well-known prefix (RFC 6052, ``64:ff9b::/96``:
#: on an IPv6-only host with DNS64/NAT64 it reaches the IPv4 network it names) and the
#: deprecated IPv4-compatible ``::/96``. 6to4 (``2002::/16``) embeds one after its first 16 bits.
_V4_IN_LAST_32 = tuple(ipaddress.ip_network(n) for n in ("::ffff:0:0/96", "::ffff:0:0:0/96", "64:ff9b::/96", "::/96"))
#: NAT64's local-use prefix (RFC 8215): where it leads is the operator's choice.
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


def _embedded_ipv4(ip) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (:data:`_V4_IN_LAST_32`, 6to4), else None."""
    if ip.version != 6:
        return None
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _V4_IN_LAST_32):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def ip_literal(host: str) -> str | None:
    """``host`` (a URL's host, IPv6 with or without brackets) as the IP address it spells, in
    standard form (``127.1`` and ``0x7f000001`` give ``127.0.0.1``; a ``%zone`` is kept), or
    None for a DNS name."""
    bare = host.strip("[]")
    try:
        return str(ipaddress.ip_address(bare))
    except ValueError:
        ip = _inet_aton(bare.rstrip(".").lower())
        return None if ip is None else str(ip)


def dialable_scopes(own: Iterable[str]) -> set[str]:
    """The scopes (:func:`address_scope`) of addresses learnt from others that a node whose own
    addresses are ``own`` (URLs) dials: public addresses and DNS names always, loopback,
    link-local and private ones only when one of its own is in the same scope (own DNS names:
    ``transport.name_scopes``)."""
    return {"public", "name"} | {address_scope(url) for url in own}


def _inet_aton(host: str) -> ipaddress.IPv4Address | None:
    """``host`` read as the C resolver reads an IPv4 address (``inet_aton``: 1 to 4 parts, decimal,
    octal or hex), or None when it is not one."""
    import socket

    if not host or not all(c in "0123456789abcdefx." for c in host) or not host[0].isdigit():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def auth_macs(mesh_key: bytes, welcome_nonce: bytes, hello_nonce: bytes, addr: str) -> dict:
    """The private-mesh fields of an ``auth``: ``mac`` (both nonces; for peers older than the
    bound proof), ``addr`` (the URL this side dialed) and ``bound_mac``, which covers ``addr``
    too, so that a relay's proof names the relay's address, not the peer's."""
    return {"mac": mesh_mac(mesh_key, MESH_HELLO_LABEL, welcome_nonce, hello_nonce), "addr": addr,
            "bound_mac": mesh_mac(mesh_key, MESH_BOUND_LABEL, welcome_nonce, hello_nonce + addr.encode())}


def new_nonce() -> bytes:
    """A fresh random handshake nonce of :data:`NONCE_BYTES` bytes."""
    return os.urandom(NONCE_BYTES)


def read_nonce(f, what: str, default=...) -> bytes | None:
    """The ``nonce`` field of a hello or welcome; exactly :data:`NONCE_BYTES` bytes."""
    nonce = f.get("nonce", bytes, default)
    if nonce is not None and len(nonce) != NONCE_BYTES:
        raise ProtocolError(f"{what}: field 'nonce' must be {NONCE_BYTES} bytes, got {len(nonce)}")
    return nonce


def welcome_proof(key, hello_nonce: bytes, welcome_nonce: bytes, tls_fingerprint: str = "") -> bytes:
    """The welcome's proof: signs both nonces and the fingerprint of the TLS certificate the
    peer serves ("" over plain ws), so a relay with its own certificate cannot forward it."""
    return prove(key, WELCOME_LABEL, hello_nonce, welcome_nonce + bytes.fromhex(tls_fingerprint))


def check_welcome(f, hello_nonce: bytes, *, expect_id: str | None = None, mesh_key: bytes | None = None,
                  tls_fingerprint: str = "", dialed_url: str | None = None,
                  relayed: bool = False) -> tuple[PeerAdvert, bytes]:
    """Check a ``welcome`` answering a hello that carried ``hello_nonce``.

    ``tls_fingerprint`` is the SHA-256 (hex) of the certificate the dialer saw in its TLS
    handshake ("" over plain ws): it must equal the advert's ``tls_fingerprint`` and be
    covered by the proof (:func:`welcome_proof`). In a private mesh over plain ws,
    ``dialed_url`` (the URL dialed) must be one of the advert's addresses (same scheme, host
    and port; any loopback host matches another): otherwise the connection may run through a
    relay, which must not get this side's proof of the mesh key.

    ``relayed``: the welcome came through a circuit (a relay the dialer chose, listed in the
    peer's signed advert). There is no TLS end to end: the peer signs its proof with an empty
    fingerprint (``tls_fingerprint`` must be ""), whatever certificate it serves when dialed,
    and the mesh-key MAC binds the relay instead of an address (``relay://RELAY-ID``).

    Returns:
        (the answering peer's advert, its welcome nonce).

    Raises:
        ProtocolError: a missing or mistyped field.
        Unauthenticated: the advert's signature, the proof of its key or the mesh-key MAC does
            not verify, the peer is not ``expect_id``, the TLS certificate is not the one the
            peer signed, or (private mesh, plain ws) it does not list ``dialed_url``.
    """
    advert = PeerAdvert.from_wire(f.get("advert", dict))
    welcome_nonce = read_nonce(f, "welcome")
    proof = f.get("proof", bytes)
    if not verify_advert(advert):
        raise Unauthenticated(f"peer {advert.peer_id[:12]} sent an advert whose signature does not verify")
    if expect_id is not None and advert.peer_id != expect_id:
        raise Unauthenticated(f"answered as peer {advert.peer_id[:12]}, not {expect_id[:12]}")
    if not relayed and tls_fingerprint != advert.tls_fingerprint:
        raise Unauthenticated(f"peer {advert.peer_id[:12]} signed TLS certificate "
                              f"{advert.tls_fingerprint[:16] or '(none)'} but the connection presented "
                              f"{tls_fingerprint[:16] or '(none)'}: a relay or an impostor is in between")
    if not check_proof(advert.public_key, proof, WELCOME_LABEL, hello_nonce,
                       welcome_nonce + bytes.fromhex(tls_fingerprint)):
        raise Unauthenticated(f"peer {advert.peer_id[:12]} could not prove it holds its key")
    if mesh_key is not None:
        if not check_mac(mesh_key, f.get("mac", bytes, b""), MESH_WELCOME_LABEL, hello_nonce, welcome_nonce):
            raise Unauthenticated(f"peer {advert.peer_id[:12]} does not hold this mesh key")
        if not relayed and not tls_fingerprint and dialed_url is not None and \
                endpoint(dialed_url) not in {endpoint(a) for a in advert.addrs}:
            raise Unauthenticated(f"peer {advert.peer_id[:12]} does not list {dialed_url[:100]} among its addresses "
                                  f"({', '.join(advert.addrs) or 'none'}): a relay may be in between; dial an "
                                  f"address it advertises (its --public-addr)")
    return advert, welcome_nonce


def first_seq() -> int:
    """The ``seq`` a peer's first advert carries: the wall clock in microseconds.

    A peer counts up from it by one per advert, so every advert of a restarted peer is newer
    than every advert of its previous run (as long as its clock did not go back and it sent
    fewer than a million adverts a second): a replayed old advert never replaces a new one.
    """
    return time.time_ns() // 1000


class PeerTable:
    """Adverts of the other peers, each with a local expiry time.

    Args:
        self_id: this peer's id (its own advert is never stored), or None on a client.
        capacity: most records held, or None for no limit. When full, a new peer is taken
            only when it proved its key to this peer directly: it replaces the record closest
            to expiry among the unproven ones that are not ``protected`` (see :meth:`merge`).
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, self_id: str | None = None, *, capacity: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.self_id = self_id
        self.capacity = capacity
        self._clock = clock
        self._records: dict[str, tuple[PeerAdvert, float]] = {}
        self._proven: set[str] = set()  # ids whose key was proven in a handshake with this peer

    def merge(self, adverts: Iterable[PeerAdvert], *, proven: bool = False,
              protected: Iterable[str] = ()) -> int:
        """Store adverts that are newer (larger ``seq``) than what is held; return how many.

        A record lives at most :data:`MAX_TTL_S` seconds whatever ``ttl_s`` it arrives with.
        ``proven``: the adverts' peers proved their keys in a handshake with this peer; when
        the table is full such a peer evicts the record closest to expiry whose id is not in
        ``protected`` (peers with a link or a conversation here), an unproven one first, and an
        unproven new peer is dropped. So keys that cost an attacker nothing cannot push out the
        peers it talks to, nor keep out a peer that proves its key.
        """
        self.expire()
        now, taken, keep = self._clock(), 0, frozenset(protected)
        for ad in adverts:
            if ad.peer_id == self.self_id or ad.ttl_s <= 0:
                continue
            held = self._records.get(ad.peer_id)
            if held is None and self.capacity is not None and len(self._records) >= self.capacity:
                if not proven or not self._evict(keep):
                    continue
            if proven:
                self._proven.add(ad.peer_id)
            if held is None or ad.seq > held[0].seq:
                self._records[ad.peer_id] = (ad, now + min(ad.ttl_s, MAX_TTL_S))
                taken += 1
        return taken

    def _evict(self, protected: frozenset[str]) -> bool:
        """Drop the unprotected record closest to expiry, an unproven one first; False when every
        record is protected. A proven record is evictable too: keys are free, and an attack run
        filled the table with identities that each proved its key once and hung up, which kept
        out every peer that joined later for as long as they came back each minute."""
        victims = [(pid in self._proven, until, pid) for pid, (_, until) in self._records.items()
                   if pid not in protected]
        if not victims:
            return False
        self.remove(min(victims)[2])
        return True

    def proven(self, peer_id: str) -> bool:
        """Whether ``peer_id`` proved its key to this peer directly while its record lives."""
        return peer_id in self._proven

    def expire(self) -> list[str]:
        """Drop records past their expiry; return the dropped peer ids."""
        now = self._clock()
        dead = [pid for pid, (_, until) in self._records.items() if until <= now]
        for pid in dead:
            self.remove(pid)
        return dead

    def remove(self, peer_id: str) -> None:
        """Forget ``peer_id`` (it said goodbye)."""
        self._records.pop(peer_id, None)
        self._proven.discard(peer_id)

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

    def seqs(self) -> dict[str, int]:
        """``seq`` of each live record by peer id (cheaper than :meth:`adverts`)."""
        self.expire()
        return {pid: ad.seq for pid, (ad, _) in self._records.items()}

    def __len__(self) -> int:
        self.expire()
        return len(self._records)


#: Prefix length that counts as one host for IPv6: a /64 is what one subscriber line or one cloud
#: machine usually gets (RFC 6177 recommends at least a /64 per site), so an attacker holds 2^64
#: addresses of it and per-address caps would not bind.
IPV6_HOST_PREFIX = 64


def host_key(address: str) -> str:
    """The key per-host limits count under: an IPv4 address as it is (an IPv4-mapped IPv6
    address as its IPv4 address), an IPv6 address as its /:data:`IPV6_HOST_PREFIX` network
    (``"2001:db8:1:2::/64"``), anything else (a relayed link's label, ``"?"``) as given."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # a zone id ("fe80::1%eth0") is not an address
    except ValueError:
        return address
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    if ip.version == 6:
        return str(ipaddress.ip_network(f"{ip}/{IPV6_HOST_PREFIX}", strict=False))
    return str(ip)
