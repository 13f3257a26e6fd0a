"""In-process meshes for tests: real peers on port 0, a tiny random model or cached real shards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from meshinfer.core.config import LayerRange
from meshinfer.engine.executor import DeviceExecutor
from meshinfer.engine.models.llama import Shard
from meshinfer.peer.node import Peer, PeerSettings

FAST = dict(gossip_interval_s=0.1, advert_ttl_s=1.0, request_timeout_s=5.0)


async def start_peer(shard: Shard, *, weights_hash: str, precision: str = "f32", bundle: dict | None = None,
                     bootstrap: Sequence[str] = (), device: str = "cpu", key=None, **settings) -> Peer:
    """A started peer serving ``shard`` (already on ``device``) on 127.0.0.1:0 with fast gossip,
    with ``key`` (default: a fresh one)."""
    opts = dict(FAST) | settings
    peer = Peer(shard, DeviceExecutor(device), key=key or Ed25519PrivateKey.generate(),
                weights_hash=weights_hash, precision=precision, tokenizer_bundle=bundle,
                settings=PeerSettings(bootstrap=tuple(bootstrap), **opts))
    peer.owns_executor = True
    await peer.start(warmup=True)
    return peer


async def wait_for_tables(peers: Sequence[Peer], *, timeout_s: float = 10.0) -> None:
    """Wait until every peer's table lists every other peer."""
    want = len(peers) - 1
    async with asyncio.timeout(timeout_s):
        while not all(len(p.table) >= want for p in peers):
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def mesh(shards: Sequence[Shard], *, weights_hash: str, bundle: dict | None = None,
               devices: Sequence[str] | None = None, **settings):
    """Start one peer per shard (on ``devices[i]``, default the CPU), the first as bootstrap for
    the others; close them all after."""
    peers: list[Peer] = []
    devices = list(devices or ["cpu"] * len(shards))
    try:
        first = await start_peer(shards[0], weights_hash=weights_hash, bundle=bundle, device=devices[0], **settings)
        peers.append(first)
        for s, d in zip(shards[1:], devices[1:]):
            peers.append(await start_peer(s, weights_hash=weights_hash, bundle=bundle,
                                          bootstrap=first.addrs, device=d, **settings))
        await wait_for_tables(peers)
        yield peers
    finally:
        for p in peers:
            await p.close()


class AlwaysDraft:
    """A draft policy (``Conversation.policy``) that drafts all it may each step. Tests of exact
    verification use it: on a tiny model over loopback the real policy
    (:class:`meshinfer.client.speculative.DraftPolicy`) may rightly find that drafting does not pay."""

    def choose(self, limit: int) -> int:
        return limit

    def record_step(self, *args) -> None:
        pass

    record_drafts = record_draft_cost = record_yield = new_text = record_step


def split(shard_factory, bounds: Sequence[int]) -> list[Shard]:
    """Shards over consecutive ``bounds`` (e.g. ``[0, 2, 4]``) built by ``shard_factory(LayerRange)``."""
    return [shard_factory(LayerRange(a, b)) for a, b in zip(bounds, bounds[1:])]


def file_hash(path: Path) -> str:
    from meshinfer.engine.weights.identity import weights_hash

    return weights_hash(path)


async def crash(peer: Peer) -> None:
    """Kill ``peer`` as a power cut would: no goodbye frames, sockets dropped, server gone."""
    peer._closing = True
    if peer._server is not None:
        peer._server.close()
    for link in list(peer._all_links):
        link.ws.transport.abort()
    for task in list(peer._tasks):
        task.cancel()
    await asyncio.gather(*peer._tasks, return_exceptions=True)


def tiny_model(directory: Path, *, context: int = 256, seed: int = 0) -> tuple:
    """(gguf path, weights hash, tokenizer, whole-model shard) of a tiny random qwen2 model."""
    from meshinfer.engine.generate import load_shard
    from meshinfer.text.tokenizer import Tokenizer
    from helpers.tiny import random_weights, tiny_config, write_gguf

    cfg = tiny_config("qwen2", context=context)
    path = write_gguf(directory / "tiny.gguf", cfg, random_weights(cfg, seed=seed))
    return path, file_hash(path), Tokenizer.from_gguf(path), load_shard(path)


async def generate_through(peers: Sequence[Peer], tok, messages: list, *, max_tokens: int = 8,
                           max_tokens_total: int = 96, deadline_floor_s: float | None = None,
                           **client_options) -> tuple:
    """One greedy conversation through the mesh of ``peers``; returns (route, prompt ids, result).
    ``deadline_floor_s``: the conversation's (None: the default)."""
    from meshinfer.client.mesh import MeshClient

    async with MeshClient(list(peers[0].addrs), **client_options) as client:
        route = await client.plan()
        options = {} if deadline_floor_s is None else {"deadline_floor_s": deadline_floor_s}
        conv = client.conversation(route, max_tokens_total=max_tokens_total, **options)
        ids = tok.encode_chat(messages)
        try:
            out = await conv.generate(ids, max_tokens=max_tokens, eos_ids=())
        finally:
            await conv.close()
    return route, ids, out


async def generate_through_a_middle_crash(path: Path, digest: str, bundle: dict, ids: list[int], n_tokens: int,
                                          bounds: Sequence[int] = (0, 1, 3, 4), policy=None):
    """Generate ``n_tokens`` greedily over hops ``bounds`` (plus a standby for the middle range)
    while the middle hop crashes after 10 tokens; (result, the crashed peer). The deadline floor
    is generous, so only the crash, never a slow step on a loaded machine, causes a failover.
    ``policy``: the conversation's draft policy (e.g. :class:`AlwaysDraft`), None for the client's."""
    from meshinfer.engine.generate import load_shard
    from meshinfer.client.mesh import MeshClient

    a, b, c, d = bounds
    first = await start_peer(load_shard(path, LayerRange(a, b)), weights_hash=digest, bundle=bundle)
    rest = [await start_peer(load_shard(path, r), weights_hash=digest, bootstrap=first.addrs)
            for r in (LayerRange(b, c), LayerRange(b, c), LayerRange(c, d))]
    try:
        await wait_for_tables([first, *rest])
        async with MeshClient(list(first.addrs)) as client:
            route = await client.plan()
            mid = next(p for p in rest[:2] if p.peer_id == route.hops[1].peer_id)
            conv = client.conversation(route, max_tokens_total=len(ids) + n_tokens, deadline_floor_s=10.0)
            if policy is not None:
                conv.policy = policy

            def on_token(_):
                if len(conv.cached) - len(ids) >= 9 and not mid._closing:
                    asyncio.ensure_future(crash(mid))

            out = await conv.generate(ids, max_tokens=n_tokens, eos_ids=(), on_token=on_token)
            await conv.close()
    finally:
        for p in (first, *rest):
            await p.close()
    return out, mid


async def chat_json(url: str, messages: list, tmp_path, max_tokens: int = 32) -> dict:
    """Run ``meshinfer chat --json`` as a user would and parse its one JSON object."""
    file = tmp_path / f"messages-{abs(hash(json.dumps(messages)))}.json"
    file.write_text(json.dumps(messages))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshinfer", "chat", "--peers", url, "--messages", str(file),
        "--max-tokens", str(max_tokens), "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 600)
    assert proc.returncode == 0, err.decode()
    return json.loads(out.decode().strip().splitlines()[-1])
