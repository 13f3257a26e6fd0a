"""``--allow-keys``: peers not on the list cannot join, gossip into or be routed through a mesh."""

from __future__ import annotations

import asyncio
import json

import pytest

from helpers.meshkit import generate_through, start_peer, wait_for_tables
from meshinfer.wire import discovery
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import InvalidInput, NoRoute, PeerUnavailable, Unauthenticated
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient

MESSAGES = [{"role": "user", "content": "who may join?"}]


async def three_peers(tiny, *, allow_first: bool):
    """first 0-1 (optionally allowing only itself and ``member``), member 2-3, outsider 2-3.

    The outsider bootstraps from the member, which has no list, so it learns the outsider and
    gossips its advert to the first peer.
    """
    path, digest, tok, _ = tiny
    shard = lambda a, b: load_shard(path, LayerRange(a, b))  # noqa: E731
    first = await start_peer(shard(0, 2), weights_hash=digest, bundle=tok.to_bundle())
    member = await start_peer(shard(2, 4), weights_hash=digest)
    if allow_first:
        first.settings.allow_ids = frozenset({first.peer_id, member.peer_id})
    member.settings.bootstrap = tuple(first.addrs)
    outsider = await start_peer(shard(2, 4), weights_hash=digest, bootstrap=member.addrs)
    return first, member, outsider


def test_allowlist_file_format(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    other = "0123456789abcdef0123456789ABCDEF"
    f = tmp_path / "allowed.txt"
    f.write_text(f"# our mesh\n\n{discovery.public_key_hex(key)}  # alice, by public key\n{other}\n")
    assert discovery.load_allowlist(f) == {discovery.peer_id_of(key), other.lower()}
    f.write_text("# nobody\n")
    with pytest.raises(InvalidInput, match="lists no peer"):
        discovery.load_allowlist(f)
    f.write_text(f"{other}\nnot-a-key\n")
    with pytest.raises(InvalidInput, match=r"allowed.txt:2: 'not-a-key' is neither a peer id"):
        discovery.load_allowlist(f)


async def test_a_peer_not_on_the_list_cannot_join_nor_gossip_in(tiny):
    first, member, outsider = await three_peers(tiny, allow_first=True)
    try:
        await wait_for_tables([first, member])
        await asyncio.sleep(0.5)  # 5 gossip rounds: the member relays the outsider's advert
        assert outsider.peer_id in {a.peer_id for a in member.table.adverts()}
        assert {a.peer_id for a in first.table.adverts()} == {member.peer_id}
        with pytest.raises(PeerUnavailable, match=f"peer {outsider.peer_id[:12]} is not on this mesh's "
                                                  f"--allow-keys list"):
            await outsider._dial_any(first.addrs, expect_id=None)
        assert outsider.peer_id not in first.links
    finally:
        for p in (first, member, outsider):
            await p.close()


async def test_the_client_routes_only_through_listed_peers(tiny):
    path, digest, tok, whole = tiny
    first, member, outsider = await three_peers(tiny, allow_first=False)
    try:
        await wait_for_tables([first, member, outsider])
        listed = frozenset({first.peer_id, member.peer_id})
        async with MeshClient(list(first.addrs), allow_ids=listed) as client:
            assert {p.peer_id for p in await client.refresh()} == listed
            route = await client.plan()
            assert route.peer_ids == (first.peer_id, member.peer_id)
            with pytest.raises(PeerUnavailable, match="is not on this mesh's --allow-keys list"):
                await client.link(outsider.advert())
        async with MeshClient(list(first.addrs), allow_ids=frozenset({first.peer_id})) as client:
            with pytest.raises(NoRoute, match=r"layers 2-3 .*; 2 more peer\(s\) in the mesh are not in --allow-keys$"):
                await client.plan()
        async with MeshClient(list(outsider.addrs), allow_ids=listed) as client:
            with pytest.raises(Unauthenticated, match="is not on this mesh's --allow-keys list"):
                await client.refresh()
        ids = tok.encode_chat(MESSAGES)
        _, _, out = await generate_through([first], tok, MESSAGES, allow_ids=listed)
        assert out.token_ids == greedy_generate(whole, ids, max_tokens=8).token_ids
    finally:
        for p in (first, member, outsider):
            await p.close()


async def test_with_the_list_on_every_peer_the_mesh_works(tiny):
    path, digest, tok, whole = tiny
    first, member, outsider = await three_peers(tiny, allow_first=True)
    member.settings.allow_ids = first.settings.allow_ids
    await outsider.close()
    try:
        await wait_for_tables([first, member])
        _, ids, out = await generate_through([first], tok, MESSAGES, allow_ids=first.settings.allow_ids)
        assert out.token_ids == greedy_generate(whole, ids, max_tokens=8).token_ids
    finally:
        for p in (first, member):
            await p.close()


def test_allow_keys_option_environment_and_id_command(tmp_path, monkeypatch, capsys):
    from meshinfer.app.cli import build_parser, main

    monkeypatch.setenv("MESHINFER_ALLOW_KEYS", "/keys/allowed.txt")
    assert [build_parser().parse_args([cmd]).allow_keys for cmd in ("join", "chat", "status", "serve")] == \
        ["/keys/allowed.txt"] * 4
    key_file = tmp_path / "peer.key"
    assert main(["id", "--key", str(key_file)]) == 2
    assert f"no key at {key_file}" in capsys.readouterr().err
    assert main(["id", "--key", str(key_file), "--create", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    key = discovery.load_or_create_key(key_file)
    assert shown["peer_id"] == discovery.peer_id_of(key) and shown["public_key"] == discovery.public_key_hex(key)
    (tmp_path / "allowed.txt").write_text(shown["public_key"] + "\n")
    assert discovery.load_allowlist(tmp_path / "allowed.txt") == {shown["peer_id"]}
