"""The latency/bandwidth proxy: added RTT and throughput on loopback, and a mesh through it."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshinfer.app.netsim import NetSim


async def echo_server():
    async def echo(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


async def min_rtt_ms(port: int, samples: int = 7) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    best = float("inf")
    for _ in range(samples):
        t0 = time.perf_counter()
        writer.write(b"x" * 64)
        await writer.drain()
        await reader.readexactly(64)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    writer.close()
    return best


@pytest.mark.parametrize("rtt_ms", [20.0, 100.0])
async def test_added_rtt_within_ten_percent(rtt_ms):
    server = await echo_server()
    port = server.sockets[0].getsockname()[1]
    sim = await NetSim("127.0.0.1", port, rtt_ms=rtt_ms).start()
    try:
        added = await min_rtt_ms(sim.port) - await min_rtt_ms(port)
        assert rtt_ms <= added + 0.5 and added <= rtt_ms * 1.1, f"added {added:.1f} ms for {rtt_ms} ms"
    finally:
        await sim.close()
        await sim.close()
        server.close()


async def test_bandwidth_cap_paces_bytes():
    server = await echo_server()
    port = server.sockets[0].getsockname()[1]
    sim = await NetSim("127.0.0.1", port, bandwidth_bytes_per_s=1_000_000).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
        payload = b"y" * 300_000
        t0 = time.perf_counter()
        writer.write(payload)
        await writer.drain()
        assert await reader.readexactly(len(payload)) == payload
        elapsed = time.perf_counter() - t0
        assert elapsed >= 0.3, f"300 kB crossed a 1 MB/s link twice in {elapsed:.2f} s"
        writer.close()
    finally:
        await sim.close()
        server.close()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rtt_ms must be >= 0"):
        NetSim("127.0.0.1", 1, rtt_ms=-1)


async def test_a_conversation_through_the_proxy(tmp_path):
    from helpers.meshkit import file_hash, mesh
    from meshinfer.core.config import LayerRange
    from meshinfer.engine.generate import greedy_generate, load_shard
    from meshinfer.client.mesh import MeshClient
    from meshinfer.text.tokenizer import Tokenizer
    from helpers.tiny import random_weights, tiny_config, write_gguf

    cfg = tiny_config("qwen2", context=128)
    path = write_gguf(tmp_path / "t.gguf", cfg, random_weights(cfg))
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode_chat([{"role": "user", "content": "via the proxy"}])
    async with mesh([load_shard(path, LayerRange(0, 4))], weights_hash=file_hash(path),
                    bundle=tok.to_bundle(), public_addrs=()) as peers:
        peer_port = int(peers[0].addrs[0].rsplit(":", 1)[1])
        sim = await NetSim("127.0.0.1", peer_port, rtt_ms=40).start()
        try:
            async with MeshClient([f"ws://127.0.0.1:{sim.port}"]) as client:
                await client.refresh()
                rtt = await client.measure_rtts()
                assert rtt[peers[0].peer_id] >= 40  # the client's connection runs through the proxy
                route = await client.plan()
                conv = client.conversation(route, max_tokens_total=len(ids) + 4)
                out = await conv.generate(ids, max_tokens=4, eos_ids=())
                await conv.close()
        finally:
            await sim.close()
    assert out.token_ids == greedy_generate(load_shard(path), ids, max_tokens=4).token_ids
