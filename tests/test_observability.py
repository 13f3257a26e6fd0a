"""Prometheus metrics and JSON logs of live tiny-model peers (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers.convauth import authorize
from helpers.meshkit import mesh, split, start_peer
from meshinfer.wire import discovery
from meshinfer.core.errors import InvalidInput, PositionError
from meshinfer.engine.generate import load_shard
from meshinfer.core.logs import JsonFormatter, configure, context
from meshinfer.client.mesh import MeshClient
from meshinfer.wire.transport import dial

MESSAGES = [{"role": "user", "content": "count my steps"}]
MAX_TOKENS = 6


async def scrape(port: int, host: str = "127.0.0.1") -> dict[tuple[str, tuple], float]:
    """``/metrics`` of the server on ``host``:``port`` as {(sample name, sorted labels): value}."""
    def get() -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            assert r.status == 200
            return r.read().decode()

    text = await asyncio.to_thread(get)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def converse(peers, tok, *, gauge_port: int):
    """Run one conversation; returns (prompt ids, the open-conversations gauge mid-way, result)."""
    async with MeshClient(list(peers[0].addrs)) as client:
        route = await client.plan()
        conv = client.conversation(route, max_tokens_total=96)
        ids = tok.encode_chat(MESSAGES)
        try:
            out = await conv.generate(ids, max_tokens=MAX_TOKENS, eos_ids=())
            mid = await scrape(gauge_port)
        finally:
            await conv.close()
    return ids, mid, out, conv.conv_id


async def test_metrics_count_steps_tokens_conversations_and_errors(tiny):
    path, digest, tok, _ = tiny
    shards = split(lambda r: load_shard(path, r), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), metrics_port=0) as peers:
        ports = [p.metrics.port for p in peers]
        assert all(ports) and len(set(ports)) == 2
        before = [await scrape(port) for port in ports]
        assert before[0][("meshinfer_conversations", ())] == 0
        assert before[0][("meshinfer_peer_info", tuple(sorted(dict(
            peer_id=peers[0].peer_id, layers="0-1", device="cpu", precision="f32", weights=digest[:12],
            architecture="qwen2").items())))] == 1
        ids, mid, out, conv_id = await converse(peers, tok, gauge_port=ports[1])
        assert len(out.token_ids) == MAX_TOKENS
        assert mid[("meshinfer_conversations", ())] == 1
        assert mid[("meshinfer_kv_used_bytes", ())] > 0
        assert mid[("meshinfer_kv_free_bytes", ())] < before[1][("meshinfer_kv_free_bytes", ())]
        await asyncio.sleep(0.2)  # the close frames reach both hops
        after = [await scrape(port) for port in ports]
        for b, a in zip(before, after):
            # the first token comes from the prefill; each further one from a one-token decode step
            assert delta(b, a, "meshinfer_steps_total", kind="decode") == MAX_TOKENS - 1
            assert delta(b, a, "meshinfer_tokens_total", kind="decode") == MAX_TOKENS - 1
            assert delta(b, a, "meshinfer_tokens_total", kind="prefill") == len(ids)
            assert delta(b, a, "meshinfer_step_seconds_count", kind="decode") == MAX_TOKENS - 1
            assert delta(b, a, "meshinfer_step_seconds_count", kind="prefill") == \
                delta(b, a, "meshinfer_steps_total", kind="prefill") >= 1
            assert delta(b, a, "meshinfer_link_bytes_total", direction="in") > 0
            assert a[("meshinfer_conversations", ())] == 0
            assert a[("meshinfer_kv_used_bytes", ())] == 0
            assert a[("meshinfer_kv_free_bytes", ())] == b[("meshinfer_kv_free_bytes", ())]
            assert 0 < a[("meshinfer_kv_free_bytes", ())] <= a[("meshinfer_kv_budget_bytes", ())]

        link = await dial(peers[0].addrs[0], max_bytes=1 << 20, on_message=lambda *a: asyncio.sleep(0))
        try:
            await link.request("hello", timeout_s=5, role="client", nonce=discovery.new_nonce())
            with pytest.raises(InvalidInput):
                await link.request("step", timeout_s=5, conv="nope", seq=1, start=0, tokens=[1])
            await link.request("open", timeout_s=5, **authorize("open", dict(
                conv="c", layers=[0, 2], max_tokens=16,
                next={"peer_id": peers[1].peer_id, "addrs": list(peers[1].addrs)}), peers[0].peer_id))
            with pytest.raises(PositionError):
                await link.request("step", timeout_s=5, **authorize("step", dict(conv="c", seq=1, start=3, tokens=[1]),
                                                                   peers[0].peer_id))
        finally:
            await link.close()
        errors = await scrape(ports[0])
        assert delta(after[0], errors, "meshinfer_errors_total", code="invalid_input") == 1
        assert delta(after[0], errors, "meshinfer_errors_total", code="bad_positions") == 1
    for port in ports:  # the metrics server stops with its peer
        with pytest.raises(OSError):
            await scrape(port)


async def test_metrics_are_off_unless_a_port_is_given_and_per_peer(tiny):
    path, digest, tok, whole = tiny
    a = await start_peer(whole, weights_hash=digest)
    b = await start_peer(whole, weights_hash=digest)
    try:
        assert a.metrics.port is None and a.metrics._server is None
        a.metrics.step(3, 0.01)
        assert a.metrics.registry.get_sample_value("meshinfer_tokens_total", {"kind": "prefill"}) == 3
        assert b.metrics.registry.get_sample_value("meshinfer_tokens_total", {"kind": "prefill"}) == 0
    finally:
        await a.close()
        await b.close()


async def test_metrics_listen_on_metrics_host_when_given(tiny):
    path, digest, tok, whole = tiny
    peer = await start_peer(whole, weights_hash=digest, metrics_port=0, metrics_host="127.0.0.2")
    try:
        assert ("meshinfer_conversations", ()) in await scrape(peer.metrics.port, "127.0.0.2")
        with pytest.raises(OSError):  # not on the peer's own host, 127.0.0.1
            await scrape(peer.metrics.port)
    finally:
        await peer.close()


async def test_peer_logs_in_json_carry_the_conversation_id(tiny):
    path, digest, tok, _ = tiny
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("meshinfer.peer.node")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        shards = split(lambda r: load_shard(path, r), [0, 2, 4])
        async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle()) as peers:
            _, _, _, conv_id = await converse_plain(peers, tok)
            await asyncio.sleep(0.2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert lines and all({"ts", "level", "logger", "message"} <= set(x) for x in lines)
    about = [x for x in lines if x.get("conv") == conv_id]
    assert {x["peer"] for x in about} == {p.peer_id for p in peers}
    opened = [x for x in about if x["message"].startswith("opened conversation")]
    closed = [x for x in about if x["message"].startswith("closed conversation")]
    assert len(opened) == 2 and len(closed) == 2
    assert all(conv_id in x["message"] and x["level"] == "INFO" for x in opened + closed)


async def converse_plain(peers, tok):
    async with MeshClient(list(peers[0].addrs)) as client:
        route = await client.plan()
        conv = client.conversation(route, max_tokens_total=96)
        try:
            out = await conv.generate(tok.encode_chat(MESSAGES), max_tokens=2, eos_ids=())
        finally:
            await conv.close()
    return route, None, out, conv.conv_id


def test_json_formatter_writes_one_object_per_record_with_context_and_traceback():
    stream = io.StringIO()
    configure(logging.INFO, "json", stream=stream)
    log = logging.getLogger("meshinfer.test")
    try:
        log.info("step %d of %s", 3, "c1", extra=context(conv="c1", peer="p1", seq=3))
        log.warning('quote " and newline\nin a message')
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed", extra=context(conv="c2"))
    finally:
        configure(logging.WARNING, "text")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(x["level"], x["message"]) for x in lines] == [
        ("INFO", "step 3 of c1"), ("WARNING", 'quote " and newline\nin a message'), ("ERROR", "failed")]
    assert (lines[0]["conv"], lines[0]["peer"], lines[0]["seq"], lines[0]["logger"]) == ("c1", "p1", 3, "meshinfer.test")
    assert "conv" not in lines[1] and lines[2]["conv"] == "c2" and "ValueError: boom" in lines[2]["exc"]
    assert lines[0]["ts"].endswith("Z") and lines[0]["ts"][10] == "T"
    with pytest.raises(ValueError, match="log format 'xml' is not one of text, json"):
        configure(logging.INFO, "xml")
