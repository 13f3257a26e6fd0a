"""Encrypted links: wss:// with certificates pinned by peer id, and the plain-ws policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat

import pytest

from helpers.meshkit import start_peer, wait_for_tables
from meshinfer.wire import tensors, tls
from meshinfer.core.errors import InvalidInput, PeerUnavailable, Unauthenticated
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient

MESSAGES = [{"role": "user", "content": "a secret word"}]


TINY_MODEL = {"seed": 5}  # the seed of the tiny model's weights


@pytest.fixture
def certs(tmp_path):
    """Two self-signed (cert, key) pairs."""
    return [tls.self_signed(tmp_path / f"peer{i}", f"peer{i}") for i in range(2)]


class Recorder:
    """A TCP relay to ``port`` on loopback that keeps every byte it forwards (both ways).

    ``ssl_context``: terminate TLS with this server context and dial the target over TLS
    (a man in the middle with its own certificate).
    """

    def __init__(self, port: int, *, ssl_context=None) -> None:
        self.port, self.ssl_context, self.seen = port, ssl_context, bytearray()
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0, ssl=self.ssl_context)
        scheme = "wss" if self.ssl_context else "ws"
        return f"{scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader, writer) -> None:
        upstream = tls.client_context() if self.ssl_context else None
        r2, w2 = await asyncio.open_connection("127.0.0.1", self.port, ssl=upstream)
        for a, b in ((reader, w2), (r2, writer)):
            t = asyncio.get_running_loop().create_task(self._pump(a, b))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pump(self, reader, writer) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while chunk := await reader.read(65536):
                self.seen += chunk
                writer.write(chunk)
                await writer.drain()
        writer.close()


async def tls_peer(tiny, rng, cert_key, **settings):
    path, digest, tok, _ = tiny
    cert, key = cert_key
    return await start_peer(load_shard(path, rng), weights_hash=digest, bundle=tok.to_bundle(),
                            tls_cert=str(cert), tls_key=str(key), **settings)


async def generate(bootstrap: str, tok, n: int = 8):
    async with MeshClient([bootstrap]) as client:
        route = await client.plan()
        conv = client.conversation(route, max_tokens_total=96)
        try:
            out = await conv.generate(tok.encode_chat(MESSAGES), max_tokens=n, eos_ids=())
        finally:
            await conv.close()
    return route, out


async def test_two_peers_over_wss_equal_greedy_generate(tiny, certs):
    from meshinfer.core.config import LayerRange

    _, _, tok, whole = tiny
    second = await tls_peer(tiny, LayerRange(2, 4), certs[1])
    first = await tls_peer(tiny, LayerRange(0, 2), certs[0], bootstrap=second.addrs)
    try:
        await wait_for_tables([first, second])
        assert first.addrs[0].startswith("wss://")
        assert first.table.get(second.peer_id).tls_fingerprint == tls.cert_fingerprint(certs[1][0])
        route, out = await generate(first.addrs[0], tok)
    finally:
        await first.close()
        await second.close()
    assert len(route.hops) == 2
    ids = tok.encode_chat(MESSAGES)
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=8, eos_ids=()).token_ids


@pytest.mark.slow
@pytest.mark.parametrize("use_tls", [False, True], ids=["ws", "wss"])
async def test_hidden_states_are_not_in_clear_over_wss(tiny, certs, monkeypatch, use_tls):
    """Hop 1 reaches hop 2 through a relay that records the bytes: a slice of the float32
    hidden states hop 1 sent is visible over ws:// and not over wss://."""
    from meshinfer.core.config import LayerRange

    path, digest, tok, _ = tiny
    sent: list[bytes] = []
    to_wire = tensors.tensor_to_wire

    def spy(t, dtype="f32"):
        wire = to_wire(t, dtype)
        sent.append(wire["data"])
        return wire

    monkeypatch.setattr(tensors, "tensor_to_wire", spy)
    opts = {}
    if use_tls:
        opts = dict(tls_cert=str(certs[0][0]), tls_key=str(certs[0][1]))
    # hop 2 dials hop 1 through the relay, and hop 1 reuses that connection for its steps: it
    # sends as the server side, whose websocket frames are not masked
    first = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle(),
                             **opts)
    second = None
    try:
        recorder = Recorder(first.port)
        async with recorder as relay_url:
            if use_tls:  # the relay passes TLS through untouched
                relay_url = relay_url.replace("ws://", "wss://")
            second = await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest,
                                      bootstrap=(relay_url,))
            await wait_for_tables([first, second])
            await generate(first.addrs[0], tok, n=4)
            assert first.links[second.peer_id].name.startswith("(")  # the accepted (relayed) connection
            assert sent, "hop 1 sent no hidden states"
            prefill = max(sent, key=len)
            needle = prefill[len(prefill) // 2:][:64]
            assert len(needle) == 64
            assert (needle in recorder.seen) is not use_tls
    finally:
        if second is not None:
            await second.close()
        await first.close()


async def test_a_peer_whose_certificate_is_not_the_signed_one_is_refused(tiny, certs):
    from meshinfer.core.config import LayerRange

    peer = await tls_peer(tiny, LayerRange(0, 4), certs[0])
    try:
        real = peer.tls_fingerprint
        peer.tls_fingerprint = tls.cert_fingerprint(certs[1][0])  # advertises (and signs) another cert
        url = peer.addrs[0]
        with pytest.raises(Unauthenticated, match=f"{url}: peer {peer.peer_id[:12]} signed TLS certificate "
                                                  f"{peer.tls_fingerprint[:16]} but the connection presented "
                                                  f"{real[:16]}: a relay or an impostor is in between"):
            await MeshClient([url]).refresh()
    finally:
        await peer.close()


async def test_a_relay_with_its_own_certificate_is_refused(tiny, certs):
    from meshinfer.core.config import LayerRange

    peer = await tls_peer(tiny, LayerRange(0, 4), certs[0])
    mitm = Recorder(peer.port, ssl_context=tls.server_context(*certs[1]))
    try:
        async with mitm as relay_url:
            with pytest.raises(Unauthenticated, match=f"peer {peer.peer_id[:12]} signed TLS certificate "
                                                      f"{peer.tls_fingerprint[:16]} but the connection presented "
                                                      f"{tls.cert_fingerprint(certs[1][0])[:16]}"):
                await MeshClient([relay_url]).refresh()
            async with MeshClient([peer.addrs[0]]) as client:  # the direct link is fine
                assert [a.peer_id for a in await client.refresh()] == [peer.peer_id]
    finally:
        await peer.close()


def ca_signed(tmp_path, host: str) -> tuple[str, str, str]:
    """(CA cert, leaf cert, leaf key) PEM paths: a CA and a certificate it signed for IP ``host``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test CA")).issuer_name(name("test CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    leaf = (x509.CertificateBuilder().subject_name(name(host)).issuer_name(ca.subject)
            .public_key(leaf_key.public_key()).serial_number(2).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = [tmp_path / "ca.pem", tmp_path / "leaf.pem", tmp_path / "leaf.key"]
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(leaf_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                serialization.NoEncryption()))
    return tuple(map(str, paths))


async def test_a_ca_signed_certificate_is_checked_against_tls_ca(tiny, certs, tmp_path):
    from meshinfer.core.config import LayerRange

    ca, cert, key = ca_signed(tmp_path, "127.0.0.1")
    peer = await tls_peer(tiny, LayerRange(0, 4), (cert, key))
    other = await tls_peer(tiny, LayerRange(0, 4), certs[0])  # self-signed: not from that CA
    try:
        async with MeshClient([peer.addrs[0]], tls_ca=ca) as client:
            assert [a.peer_id for a in await client.refresh()] == [peer.peer_id]
        with pytest.raises(PeerUnavailable, match=f"cannot reach {other.addrs[0]}: .*certificate verify failed"):
            await MeshClient([other.addrs[0]], tls_ca=ca).refresh()
    finally:
        await peer.close()
        await other.close()


def test_self_signed_certificate_is_kept_and_its_key_private(tmp_path):
    cert, key = tls.self_signed(tmp_path / "peer.key", "abc")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert tls.self_signed(tmp_path / "peer.key", "abc") == (cert, key)
    assert tls.cert_fingerprint(cert) == tls.cert_fingerprint(cert) and len(tls.cert_fingerprint(cert)) == 64


def test_plain_ws_is_for_loopback_unless_insecure():
    for url in ("ws://127.0.0.1:7700", "ws://localhost:1", "ws://[::1]:7700", "wss://10.0.0.5:7700"):
        tls.check_plain_url(url, insecure=False)
    with pytest.raises(InvalidInput, match="ws://10.0.0.5:7700 is plain ws:// to another machine: frames would "
                                           "travel unencrypted; use a wss:// peer or pass --insecure"):
        tls.check_plain_url("ws://10.0.0.5:7700", insecure=False)
    tls.check_plain_url("ws://10.0.0.5:7700", insecure=True)
    with pytest.raises(InvalidInput, match="refusing to listen on 0.0.0.0 without TLS"):
        tls.check_listen("0.0.0.0", tls=False, insecure=False)
    tls.check_listen("0.0.0.0", tls=True, insecure=False)
    tls.check_listen("0.0.0.0", tls=False, insecure=True)
