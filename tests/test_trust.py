"""Identity and private meshes: welcome proofs a client checks, and the shared mesh key."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import msgpack
import pytest
import websockets

from helpers.meshkit import generate_through, mesh, split, start_peer
from meshinfer.wire import convkeys, discovery, protocol
from meshinfer.core.errors import Unauthenticated
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.peer.node import PRIVATE_MESH
from meshinfer.client.mesh import MeshClient

MESSAGES = [{"role": "user", "content": "a private word"}]
KEY = b"correct horse battery staple 32b"


def private_mesh(tiny, bounds=(0, 2, 4), key=KEY):
    path, digest, tok, _ = tiny
    return mesh(split(lambda r: load_shard(path, r), list(bounds)), weights_hash=digest, bundle=tok.to_bundle(),
                mesh_key=key)


async def frames(url: str, *msgs: dict) -> list[dict]:
    """Send ``msgs`` on one raw connection; the reply to each."""
    async with websockets.connect(url, compression=None) as ws:
        out = []
        for i, m in enumerate(msgs):
            await ws.send(msgpack.packb({"v": protocol.PROTOCOL_VERSION, "id": i, **m}, use_bin_type=True))
            out.append(msgpack.unpackb(await ws.recv()))
        return out


async def welcome_for(peer, nonce: bytes) -> protocol.Fields:
    [reply] = await frames(peer.addrs[0], {"t": "hello", "role": "client", "nonce": nonce})
    return protocol.Fields(reply, "welcome")


async def test_a_welcome_proves_the_peer_key_for_this_hello_only(tiny):
    path, digest, tok, _ = tiny
    peer = await start_peer(load_shard(path), weights_hash=digest)
    try:
        nonce = discovery.new_nonce()
        advert, _ = discovery.check_welcome(await welcome_for(peer, nonce), nonce, expect_id=peer.peer_id)
        assert advert.peer_id == peer.peer_id
        replayed = await welcome_for(peer, discovery.new_nonce())  # what an impostor could have recorded
        with pytest.raises(Unauthenticated, match=f"peer {peer.peer_id[:12]} could not prove it holds its key"):
            discovery.check_welcome(replayed, nonce)
        with pytest.raises(Unauthenticated, match=f"answered as peer {peer.peer_id[:12]}, not 0000"):
            discovery.check_welcome(await welcome_for(peer, nonce), nonce, expect_id="0" * 32)
    finally:
        await peer.close()


async def test_the_client_ignores_adverts_that_do_not_verify(tiny):
    path, digest, _, _ = tiny
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest) as [first, second]:
        honest = first.table.get(second.peer_id)
        first.table.remove(second.peer_id)
        first.table.merge([replace(honest, addrs=("ws://evil:1",), seq=honest.seq + 1000)])  # bypasses the peer's check
        async with MeshClient(list(first.addrs)) as client:
            assert [ad.peer_id for ad in await client.refresh()] == [first.peer_id]


async def test_private_mesh_with_the_key_equals_greedy_generate(tiny):
    _, _, tok, whole = tiny
    async with private_mesh(tiny) as peers:
        assert all(p.table.get(q.peer_id) for p in peers for q in peers if q is not p)  # peers gossip with the key
        route, ids, out = await generate_through(peers, tok, MESSAGES, mesh_key=KEY)
    assert len(route.hops) == 2
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=8, eos_ids=()).token_ids


async def test_private_mesh_refuses_a_client_without_the_key(tiny):
    async with private_mesh(tiny) as peers:
        url = peers[0].addrs[0]
        with pytest.raises(Unauthenticated, match=f"no bootstrap peer answered: {url}: this mesh is private: "
                                                  f"pass its key with --mesh-key-file"):
            await MeshClient([url]).refresh()
        with pytest.raises(Unauthenticated, match=f"{peers[0].peer_id[:12]} does not hold this mesh key"):
            await MeshClient([url], mesh_key=b"w" * 32).refresh()
        replies = await frames(url, {"t": "hello", "role": "client"}, {"t": "get_peers"},
                               {"t": "open", "conv": "c", "layers": [0, 2], "max_tokens": 8},
                               {"t": "auth", "mac": b"\0" * 32}, {"t": "ping"})
        assert replies[0]["t"] == "welcome" and replies[0]["private"] is True
        refused = ("error", "unauthenticated", PRIVATE_MESH)
        assert [(r["t"], r["code"], r["message"]) for r in replies[1:]] == [refused] * 4
        assert not any(p.convs for p in peers)


async def test_a_peer_without_the_key_cannot_join_a_private_mesh(tiny):
    path, digest, _, _ = tiny
    async with private_mesh(tiny, bounds=(0, 4)) as [member]:
        outsider = await start_peer(load_shard(path), weights_hash=digest, bootstrap=member.addrs)
        try:
            await asyncio.sleep(0.5)  # 5 gossip rounds
            assert len(outsider.table) == 0 and len(member.table) == 0 and not member.links
        finally:
            await outsider.close()


def test_mesh_key_file_must_hold_enough_bytes(tmp_path):
    (tmp_path / "short.key").write_text("tiny\n")
    with pytest.raises(ValueError, match="holds 4 bytes; a mesh key needs at least 16"):
        discovery.load_mesh_key(tmp_path / "short.key")
    (tmp_path / "ok.key").write_text(KEY.decode() + "\n")
    assert discovery.load_mesh_key(tmp_path / "ok.key") == KEY


def test_mesh_key_file_option_and_environment(monkeypatch):
    from meshinfer.app.cli import build_parser

    assert build_parser().parse_args(["status", "--mesh-key-file", "m.key"]).mesh_key_file == "m.key"
    monkeypatch.setenv("MESHINFER_MESH_KEY_FILE", "/keys/mesh.key")
    assert [build_parser().parse_args([cmd]).mesh_key_file for cmd in ("join", "chat", "status")] == \
        ["/keys/mesh.key"] * 3


async def test_a_welcome_shows_a_stranger_nothing_about_other_users(tiny):
    async with private_mesh(tiny, bounds=(0, 4)) as [peer]:
        async with MeshClient(list(peer.addrs), mesh_key=KEY) as member:
            conv = member.conversation(await member.plan(), max_tokens_total=64)
            await conv.open()  # a member's reservation: 64 tokens
            try:
                assert peer.free_kv_tokens == peer.capacity_tokens - 64
                welcome = (await frames(peer.addrs[0], {"t": "hello", "role": "client",
                                                        "nonce": discovery.new_nonce()}))[0]
                assert (welcome["advert"]["free_kv_tokens"], welcome["advert"]["rtts_ms"]) == (0, {})
                assert discovery.verify_advert(protocol.PeerAdvert.from_wire(welcome["advert"]))
                [listed] = [a for a in await member.refresh() if a.peer_id == peer.peer_id]
                assert listed.free_kv_tokens == peer.capacity_tokens - 64  # members see it after auth
            finally:
                await conv.close()


@contextlib.asynccontextmanager
async def relay_to(url: str):
    """An outsider's websocket relay on loopback that forwards every frame to ``url`` and back;
    yields (its URL, the types of the frames the peer sent through it)."""
    seen: list[str] = []

    async def pipe(src, dst, record: bool) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in src:
                if record:
                    seen.append(msgpack.unpackb(frame)["t"])
                await dst.send(frame)

    async def handler(ws) -> None:
        async with websockets.connect(url, compression=None) as up:
            pipes = [asyncio.ensure_future(pipe(ws, up, False)), asyncio.ensure_future(pipe(up, ws, True))]
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)

    async with websockets.serve(handler, "127.0.0.1", 0, compression=None) as server:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


async def test_a_member_does_not_give_its_proof_to_a_relay(tiny):
    async with private_mesh(tiny, bounds=(0, 4)) as [peer]:
        async with relay_to(peer.addrs[0]) as (url, seen):
            with pytest.raises(Unauthenticated) as caught:
                await MeshClient([url], mesh_key=KEY).refresh()
            assert str(caught.value) == (
                f"no bootstrap peer answered: {url}: peer {peer.peer_id[:12]} does not list {url} among its "
                f"addresses ({peer.addrs[0]}): a relay may be in between; dial an address it advertises (its "
                f"--public-addr)")
            assert seen == ["welcome"]  # no auth went through: never "authed"


async def test_a_relayed_or_unbound_proof_is_refused_over_ws(tiny):
    async with private_mesh(tiny, bounds=(0, 4)) as [peer]:
        for addr in ("ws://127.0.0.1:1", None):  # a member's proof for a relay's address; an unbound one
            async with websockets.connect(peer.addrs[0], compression=None) as ws:
                hello_nonce = discovery.new_nonce()
                await ws.send(msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "hello", "role": "client", "nonce": hello_nonce}))
                welcome_nonce = msgpack.unpackb(await ws.recv())["nonce"]
                auth = discovery.auth_macs(KEY, welcome_nonce, hello_nonce, addr or "")
                if addr is None:
                    del auth["addr"], auth["bound_mac"]
                await ws.send(msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "auth", **auth}))
                reply = msgpack.unpackb(await ws.recv())
                assert (reply["t"], reply["code"]) == ("error", "unauthenticated")
                assert reply["message"] == (
                    f"auth: the mesh-key proof was made for ws://127.0.0.1:1, not for this peer ({peer.addrs[0]}): "
                    f"a relay is in between" if addr else
                    "auth: over ws:// a private mesh needs a proof bound to the address dialed (field 'addr'); "
                    "update meshinfer, or serve wss://")
        assert not peer.convs and not peer.links


def test_a_signed_step_verifies_only_for_its_own_fields_and_key():
    """``sign_step`` covers the conversation, seq, start and every position's digest: a statement
    moved to another of them, or checked against another key, does not verify."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    public = discovery.public_key_hex(key)
    digests = bytes(range(32))  # two positions
    sig = discovery.sign_step(key, "conv-1", 7, 40, digests)
    assert len(sig) == 64 and discovery.check_step(public, sig, "conv-1", 7, 40, digests)
    for changed in (("conv-2", 7, 40, digests), ("conv-1", 8, 40, digests), ("conv-1", 7, 41, digests),
                    ("conv-1", 7, 40, digests[:16]), ("conv-1", 7, 40, bytes(32)), ("conv-1\0", 7, 40, digests)):
        assert not discovery.check_step(public, sig, *changed), changed
    assert not discovery.check_step(discovery.public_key_hex(other), sig, "conv-1", 7, 40, digests)
    assert not discovery.check_step(public, bytes(64), "conv-1", 7, 40, digests)
    assert not discovery.check_step(public, b"", "conv-1", 7, 40, digests)


def test_a_hop_signs_the_digests_of_the_bytes_it_sends():
    """``wire_row_digests`` (what a hop signs, from the wire bytes) equals ``row_digests`` of the
    decoded tensor (what the next hop checks)."""
    import torch

    from meshinfer.wire import tensors

    x = torch.randn(1, 5, 24)
    wire = tensors.tensor_to_wire(x)
    assert tensors.wire_row_digests(wire) == tensors.row_digests(tensors.tensor_from_wire(wire, max_elements=x.numel()))
    assert len(tensors.wire_row_digests(wire)) == 5 * tensors.DIGEST_BYTES


def test_a_client_step_signature_covers_every_field_of_the_step_and_only_its_key():
    """``convkeys.StepHeader``: the client's signature of a step verifies for that header only:
    each field changed (a hop adding sampling, dropping ``want``, moving a position, claiming a
    rollback or replay, changing the tokens) makes it fail, and so does another key."""
    key, other = convkeys.ConversationKey(), convkeys.ConversationKey()
    header = convkeys.StepHeader(key.conv_id, 7, 40, 3, "token", None, False, False, convkeys.tokens_digest([1, 2, 3]))
    fields = key.step_fields(header)
    assert fields["pd"] == header.payload and header.check(convkeys.public_key(key.public), fields["csig"])
    changes = [dict(conv_id=other.conv_id), dict(seq=8), dict(start=41), dict(count=4), dict(want="none"),
               dict(want="tokens"), dict(sampling=SamplingParams(temperature=0.7)), dict(rollback=True),
               dict(replay=True), dict(payload=convkeys.tokens_digest([1, 2, 4]))]
    for change in changes:
        assert not replace(header, **change).check(convkeys.public_key(key.public), fields["csig"]), change
    assert not header.check(convkeys.public_key(other.public), fields["csig"])
    assert not header.check(convkeys.public_key(key.public), b"")
    assert convkeys.public_key(b"\0" * 31) is None and key.conv_id == convkeys.conv_id_of(key.public)


def test_an_open_signature_is_for_one_peer_one_kind_and_one_n():
    """``convkeys.open_message``: the client's signature of an open does not verify for another
    peer, as a reroute, with another ``n`` or ``min_seq``, or with any other field changed."""
    key = convkeys.ConversationKey()
    nxt = {"peer_id": "b" * 32, "addrs": ["ws://127.0.0.1:1"]}
    sig = key.open_fields("open", "a" * 32, 5, [0, 2], 64, None, nxt)["client_sig"]
    args = dict(kind="open", to="a" * 32, conv_id=key.conv_id, n=1, min_seq=5, layers=[0, 2], max_tokens=64, prev=None,
                next_id=nxt["peer_id"], next_addrs=nxt["addrs"], next_relays=None)
    public = convkeys.public_key(key.public)
    assert convkeys.verifies(public, sig, convkeys.open_message(**args))
    for change in [dict(kind="reroute"), dict(to="c" * 32), dict(n=2), dict(min_seq=4), dict(layers=[0, 3]),
                   dict(max_tokens=65),
                   dict(prev="p"), dict(next_id="c" * 32), dict(next_addrs=["ws://10.0.0.1:1"]),
                   dict(next_relays=[])]:
        assert not convkeys.verifies(public, sig, convkeys.open_message(**args | change)), change
