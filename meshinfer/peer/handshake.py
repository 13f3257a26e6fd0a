"""The handshake of a connection, both sides, and what a new connection asks for first.

The dialer sends ``hello`` (its advert and a nonce), checks the ``welcome``'s proofs (its key,
the TLS certificate it pinned, the mesh key of a private mesh) and answers with ``auth``; the
accepting side checks that ``auth`` (:meth:`Handshake.on_auth`), and only then counts the
connection as the proven peer's. See :mod:`meshinfer.wire.discovery` for the proofs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import msgpack

from meshinfer.core.errors import InvalidInput, ProtocolError, RateLimited, Unauthenticated
from meshinfer.peer import limits
from meshinfer.peer.limits import Bucket, client_host
from meshinfer.wire import discovery
from meshinfer.wire.discovery import sign_advert
from meshinfer.wire.protocol import MIN_TOKENIZER_PART_BYTES, TOKENIZER_PART_MARGIN_BYTES, PeerAdvert
from meshinfer.wire.transport import Link

if TYPE_CHECKING:  # pragma: no cover
    from meshinfer.peer.node import Peer


class Handshake:
    """Both sides of ``peer``'s handshake; it keeps no state of its own (a link's ``info`` holds
    the nonces and the claimed advert between ``hello`` and ``auth``)."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    async def greet(self, link: Link, expect_id: str | None) -> PeerAdvert:
        """Dialer side: hello, check the welcome's proofs, answer with ``auth``; the remote's advert.

        Raises:
            Unauthenticated: the remote could not prove its key (or the mesh key), or is not
                ``expect_id``; or it refused this peer's proofs.
            ProtocolError, PeerUnavailable: a malformed welcome, a closed or silent connection.
        """
        timeout_s, mesh_key = self.peer.settings.request_timeout_s, self.peer.settings.mesh_key
        hello_nonce = discovery.new_nonce()
        relayed = link.relay_id is not None
        _, f = await link.request("hello", timeout_s=timeout_s, role="peer", nonce=hello_nonce,
                                  advert=self.peer.advert().to_wire(), max_frame_bytes=self.peer.max_frame_bytes)
        remote, welcome_nonce = discovery.check_welcome(f, hello_nonce, expect_id=expect_id, mesh_key=mesh_key,
                                                        tls_fingerprint=link.tls_fingerprint, dialed_url=link.name,
                                                        relayed=relayed)
        link.info["max_frame_bytes"] = f.int("max_frame_bytes", lo=1024, hi=1 << 40, default=None)
        if not self.peer.gossip.allowed(remote.peer_id):
            raise Unauthenticated(discovery.not_allowed(remote.peer_id))
        auth = {"proof": discovery.prove(self.peer.key, discovery.HELLO_LABEL, welcome_nonce, hello_nonce)}
        if mesh_key is not None:
            auth.update(discovery.auth_macs(mesh_key, welcome_nonce, hello_nonce, link.name))
        await link.request("auth", timeout_s=timeout_s, **auth)
        return remote

    async def on_hello(self, link: Link, f) -> None:
        if link.role is not None:
            raise ProtocolError("hello: this connection already said hello")
        role = f.str("role")
        if role not in ("client", "peer"):
            raise ProtocolError(f"hello: role {role!r} is not client or peer")
        claimed = PeerAdvert.from_wire(f.get("advert", dict)) if role == "peer" else None
        hello_nonce = discovery.read_nonce(f, "hello", None if role == "client" else ...) or b""
        if claimed is not None and not limits.verify_advert(claimed):
            raise Unauthenticated(f"hello: the advert of peer {claimed.peer_id[:12]} does not verify against "
                                  f"its public key")
        if claimed is not None and not self.peer.gossip.allowed(claimed.peer_id):
            raise Unauthenticated(discovery.not_allowed(claimed.peer_id))
        welcome_nonce = discovery.new_nonce()
        link.role = role
        link.info.update(hello_nonce=hello_nonce, welcome_nonce=welcome_nonce, claimed=claimed,
                         max_frame_bytes=f.int("max_frame_bytes", lo=1024, hi=1 << 40, default=None))
        extra = {}
        if self.peer.settings.mesh_key is not None:
            extra["mac"] = discovery.mesh_mac(self.peer.settings.mesh_key, discovery.MESH_WELCOME_LABEL, hello_nonce,
                                              welcome_nonce)
        await link.send("welcome", re=f.get("id", int, None), advert=self.welcome_advert().to_wire(), nonce=welcome_nonce,
                        proof=discovery.welcome_proof(self.peer.key, hello_nonce, welcome_nonce,
                                                      "" if link.relay_id else self.peer.tls_fingerprint),
                        private=self.peer.settings.mesh_key is not None, max_step_tokens=self.peer.settings.max_step_tokens,
                        max_frame_bytes=self.peer.max_frame_bytes,
                        context_tokens=self.peer.cfg.max_position_embeddings, **extra)

    async def on_auth(self, link: Link, f) -> None:
        """Accepting side: check the dialer's proofs; a peer's connection counts as that peer's only now."""
        if link.info.get("authed"):
            raise ProtocolError("auth: this connection is already authenticated")
        hello_nonce, welcome_nonce = link.info["hello_nonce"], link.info["welcome_nonce"]
        if self.peer.settings.mesh_key is not None:
            self.check_mesh_proof(link, f, hello_nonce, welcome_nonce)
        claimed = link.info["claimed"]
        if claimed is not None:
            if not discovery.check_proof(claimed.public_key, f.get("proof", bytes), discovery.HELLO_LABEL,
                                         welcome_nonce, hello_nonce):
                raise Unauthenticated(f"auth: the proof does not match the key of peer {claimed.peer_id[:12]}")
            link.remote_id = claimed.peer_id
            link.info["public_key"] = claimed.public_key  # what its signed steps are checked against
            self.peer.gossip.merge([claimed], proven=True)
            self.peer.links.setdefault(claimed.peer_id, link)
        link.info["authed"] = True
        await link.send("authed", re=f.get("id", int, None))

    def check_mesh_proof(self, link: Link, f, hello_nonce: bytes, welcome_nonce: bytes) -> None:
        """Check the mesh-key proof of an ``auth``, bound to this connection.

        With ``addr``, ``bound_mac`` must cover it and it must be an address of this peer (one
        it advertises, or the one this connection reached): a member's proof relayed by an
        outsider names the outsider's address. Without it (a peer older than the bound proof)
        the plain ``mac`` is accepted only over TLS, whose pinning already keeps relays out.

        Raises:
            Unauthenticated: a wrong MAC (:data:`PRIVATE_MESH`), a proof made for another address,
                or an unbound proof over plain ws.
        """
        key, addr = self.peer.settings.mesh_key, f.str("addr", None)
        if addr is None:
            if not discovery.check_mac(key, f.get("mac", bytes, b""), discovery.MESH_HELLO_LABEL, welcome_nonce,
                                       hello_nonce):
                raise Unauthenticated(limits.PRIVATE_MESH)
            if not self.peer.tls_fingerprint or link.relay_id:
                raise Unauthenticated("auth: over ws:// a private mesh needs a proof bound to the address dialed "
                                      "(field 'addr'); update meshinfer, or serve wss://")
            return
        if not discovery.check_mac(key, f.get("bound_mac", bytes, b""), discovery.MESH_BOUND_LABEL, welcome_nonce,
                                   hello_nonce + addr.encode()):
            raise Unauthenticated(limits.PRIVATE_MESH)
        if link.relay_id is not None:  # a circuit: the proof must name the relay it came through
            if addr != f"relay://{link.relay_id}":
                raise Unauthenticated(f"auth: the mesh-key proof was made for {addr[:100]}, not for a circuit "
                                      f"through relay {link.relay_id[:12]}")
            return
        host, port = link.ws.local_address[:2]
        scheme = "wss" if self.peer.tls_fingerprint else "ws"
        here = {discovery.endpoint(a) for a in self.peer.addrs} | {discovery.endpoint(f"{scheme}://{_url_host(host)}:{port}")}
        if discovery.endpoint(addr) not in here:
            raise Unauthenticated(f"auth: the mesh-key proof was made for {addr[:100]}, not for this peer "
                                  f"({', '.join(self.peer.addrs)}): a relay is in between")

    def welcome_advert(self) -> PeerAdvert:
        """This peer's advert for a ``welcome``. In a private mesh, where nobody has proven the
        key yet, it shows nothing about other users: no free KV tokens (their reservations) and
        no RTTs; it is one ``seq`` older than :meth:`advert`, so the full advert replaces it."""
        if self.peer.settings.mesh_key is None:
            return self.peer.advert()
        return sign_advert(replace(self.peer.advert(), free_kv_tokens=0, rtts_ms={}, seq=self.peer._seq - 1), self.peer.key)

    async def on_welcome(self, link: Link, f) -> None:
        raise ProtocolError("unexpected welcome")

    async def on_authed(self, link: Link, f) -> None:
        raise ProtocolError("unexpected authed")

    def tokenizer_bucket(self, host: str) -> Bucket:
        """The ``get_tokenizer`` budget of client ``host``, beside each connection's: a connection,
        or a circuit through a relay, is one hello away, and an attack run took 170 bundles,
        486 MiB, out of a hidden peer in 5 s by opening circuits; at most
        :data:`limits.MAX_TOKENIZER_HOSTS` hosts are remembered, the oldest forgotten first."""
        buckets = self.peer.tokenizer_buckets
        if host not in buckets:
            while len(buckets) >= limits.MAX_TOKENIZER_HOSTS:
                del buckets[next(iter(buckets))]
            buckets[host] = Bucket(1 / limits.TOKENIZER_HOST_EVERY_S, limits.TOKENIZER_HOST_BURST)
        return buckets[host]

    async def on_get_tokenizer(self, link: Link, f) -> None:
        """The tokenizer bundle, at most :data:`TOKENIZER_BURST` per connection, then one per
        :data:`TOKENIZER_EVERY_S` seconds, and :data:`TOKENIZER_HOST_BURST` per client host, then
        one per :data:`TOKENIZER_HOST_EVERY_S` (``rate_limited``). Over a relay circuit whose frames
        cannot hold the whole bundle (the default model's is 5.4 MB; a relay forwards what a
        512-token step needs, 1.9 MB), it goes in parts (:func:`tokenizer_part`), each charged
        as its share of a bundle."""
        if self.peer.tokenizer_bundle is None:
            raise InvalidInput("this peer has no tokenizer")
        if self.peer.tokenizer_wire is None:
            self.peer.tokenizer_wire = msgpack.packb(self.peer.tokenizer_bundle, use_bin_type=True)
        data, part = self.peer.tokenizer_wire, f.int("part", lo=0, hi=1 << 20, default=0)
        fields = tokenizer_part(data, part, getattr(link.ws, "max_send_bytes", None))
        share = len(fields["chunk"]) / len(data) if "chunk" in fields else 1.0
        bucket = link.info.setdefault("tokenizers", Bucket(1 / limits.TOKENIZER_EVERY_S, limits.TOKENIZER_BURST))
        host = self.tokenizer_bucket(client_host(link))
        if not bucket.take(share):
            raise RateLimited(f"get_tokenizer: at most {limits.TOKENIZER_BURST} per connection, then one every "
                              f"{limits.TOKENIZER_EVERY_S:g} s; keep the bundle you have")
        if not host.take(share):
            raise RateLimited(f"get_tokenizer: at most {limits.TOKENIZER_HOST_BURST} from one client host, then "
                              f"one every {limits.TOKENIZER_HOST_EVERY_S:g} s; keep the bundle you have")
        if "chunk" not in fields:
            fields = {"bundle": self.peer.tokenizer_bundle}
        await link.send("tokenizer", re=f.get("id", int, None), weights_hash=self.peer.weights_hash, **fields)


def tokenizer_part(data: bytes, part: int, max_frame_bytes: int | None) -> dict:
    """The fields of a ``tokenizer`` reply carrying part ``part`` of the msgpack-encoded bundle
    ``data`` in frames of at most ``max_frame_bytes`` (None: no limit): ``{}`` when the whole
    bundle fits (the caller sends it as ``bundle``), else ``chunk`` (bytes), ``part`` and
    ``parts``; parts are ``max_frame_bytes - TOKENIZER_PART_MARGIN_BYTES`` bytes, at least
    :data:`MIN_TOKENIZER_PART_BYTES`.

    Raises:
        InvalidInput: ``part`` is past the last.
    """
    if max_frame_bytes is None or len(data) + TOKENIZER_PART_MARGIN_BYTES <= max_frame_bytes:
        return {}
    size = max(MIN_TOKENIZER_PART_BYTES, max_frame_bytes - TOKENIZER_PART_MARGIN_BYTES)
    parts = -(-len(data) // size)
    if part >= parts:
        raise InvalidInput(f"get_tokenizer: part {part} is past the last ({parts - 1})")
    return {"chunk": data[part * size:(part + 1) * size], "part": part, "parts": parts}


def _url_host(host: str) -> str:
    """``host`` as it stands in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
