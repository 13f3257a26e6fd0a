"""Hostile input against live tiny-model peers (127.0.0.1, port 0).

A peer must survive whatever one client or one rogue peer sends: it answers bad input with an
``error`` frame or closes that connection with a code, never allocates memory sized by a number
the remote sent, and keeps serving everyone else. After each attack the peer must still run a
normal conversation exactly (tokens equal to the whole model's greedy decode) with its KV memory,
conversations and tasks back at baseline.
"""

from __future__ import annotations

import asyncio
import threading
import contextlib
import itertools
import math
import random
import re
import socket
import time
import tracemalloc

import msgpack
import pytest
import torch
import websockets
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from helpers.convauth import authorize, conv_id, key_for
from helpers.hostile import (CONTEXT, MAX_STEP, NONCE, ROGUE_KEY, TASK_SLACK, VOCAB, WIDTH, Raw, assert_healthy,
                             converse, f32, hidden_after, last_token, new_key, pack, plant, raw_conversation,
                             rogue_advert, serving, settle, shrink_send_buffer, signed, small_socket)
from meshinfer.peer import limits as peer_module
from meshinfer.wire import convkeys, protocol, transport, tensors
from meshinfer.core.config import LayerRange
from meshinfer.wire.discovery import (HELLO_LABEL, address_scope, host_key, MAX_TTL_S, NONCE_BYTES, peer_id_of,
    verify_advert)
from meshinfer.core.errors import PeerUnavailable, ProtocolError
from meshinfer.engine.generate import load_shard
from meshinfer.peer.conversations import STATEMENT_BYTES_PER_TOKEN
from meshinfer.peer.node import ClientLimits
from meshinfer.peer.steps import ComputeCost


# --------------------------------------------------------------------------- fixtures and helpers
TINY_MODEL = {"context": CONTEXT}  # the options of conftest's `tiny`; the helpers live in tests/helpers/hostile.py


# --------------------------------------------------------------------------- frames and envelopes
ENVELOPES = [
    (b"\xc1", "protocol_error", "frame is not valid msgpack: it holds the reserved type byte 0xc1"),
    (b"", "protocol_error", "frame is not valid msgpack: it ends inside an object"),
    (b"\x81\xa1v", "protocol_error", "frame is not valid msgpack: it ends inside an object"),
    (b"\xdc\xff\xff" * 1000, "protocol_error", "frame is not valid msgpack: it ends inside an object"),
    (b"\x91" * 5000, "protocol_error", "frame is not valid msgpack: containers nest too deep"),
    (msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "ping", "x": [0] * 70_000}), "protocol_error",
     "frame is not valid msgpack: 70000 exceeds max_array_len(65536)"),
    (pack("ping") + b"\x00", "protocol_error", "frame is not valid msgpack: unpack(b) received extra data."),
    ("a text frame", "protocol_error", "frames must be binary msgpack, got a text frame"),
    (msgpack.packb([1, "v", "t"]), "protocol_error", "message: expected a map, got list"),
    (msgpack.packb(7), "protocol_error", "message: expected a map, got int"),
    (msgpack.packb({"t": "ping"}), "protocol_error", "message: field 'v' is missing"),
    (msgpack.packb({"v": protocol.PROTOCOL_VERSION}), "protocol_error", "message: field 't' is missing"),
    (msgpack.packb({"v": "1", "t": "ping"}), "protocol_error", "message: field 'v' has type str"),
    (msgpack.packb({"v": True, "t": "ping"}), "protocol_error", "message: field 'v' has type bool"),
    (msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": 5}), "protocol_error", "message: field 't' has type int"),
    (msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "rm -rf"}), "protocol_error", "unknown message type 'rm -rf'"),
    (msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "x" * 5000}), "protocol_error",
     "message: field 't' is longer than 4096 characters"),
    (msgpack.packb({1: 1, "v": protocol.PROTOCOL_VERSION, "t": "ping"}), "protocol_error",
     "frame is not valid msgpack: int is not allowed for map key when strict_map_key=True"),
    (b"\xd4\x01\x00", "protocol_error", "frame is not valid msgpack: 2 exceeds max_ext_len(0)"),
    (pack("welcome"), "protocol_error", "unexpected welcome"),
    (pack("peers", adverts=[]), "protocol_error", "a peer does not accept peers frames"),
    (pack("token", conv="c", seq=1, token=3), "protocol_error", "a peer does not accept token frames"),
    (pack("ping", id="seven"), "protocol_error", "ping: field 'id' has type str"),
    (pack("pong", re="seven"), "protocol_error", "pong: field 're' has type str"),
    (pack("gossip", adverts=[]), "protocol_error", "gossip is only accepted from peers"),
]


async def test_malformed_envelopes_get_exact_errors_and_keep_the_connection(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        for frame, code, message in ENVELOPES:
            assert await raw.frame_error(frame) == (code, message), frame
        assert (await raw.request("ping"))["t"] == "pong"


async def test_messages_before_hello_are_refused(tiny):
    async with raw_conversation(tiny, role=None) as (peers, raw):
        for msg_type in ("ping", "open", "step", "get_peers", "get_tokenizer", "gossip", "close"):
            assert await raw.error(msg_type, conv="c") == (
                "protocol_error", f"the first frame must be hello, got {msg_type}")
        assert await raw.error("hello", role="admin") == (
            "protocol_error", "hello: role 'admin' is not client or peer")
        assert await raw.error("hello", role=1) == ("protocol_error", "hello: field 'role' has type int")
        assert await raw.error("hello") == ("protocol_error", "hello: field 'role' is missing")
        assert (await raw.request("hello", role="client"))["t"] == "welcome"
        assert (await raw.request("ping"))["t"] == "pong"


async def test_second_hello_cannot_change_role_or_identity(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        peer = peers[0]
        ad = rogue_advert(peer.weights_hash)
        assert await raw.error("hello", role="peer", advert=ad) == (
            "protocol_error", "hello: this connection already said hello")
        assert await raw.error("gossip", adverts=[ad]) == ("protocol_error", "gossip is only accepted from peers")
        assert peer.table.get(ad["peer_id"]) is None and ad["peer_id"] not in peer.links


BAD_ADVERTS = [
    (dict(layers=[0, 9]), "advert: layers 0-8 exceed num_layers 4"),
    (dict(layers=[2, 1]), "advert: field 'layers' = [2, 1] is not a valid half-open layer range"),
    (dict(layers=[0, 1, 2]), "advert: field 'layers' must be [start, stop]"),
    (dict(num_layers=1 << 40), "advert: field 'num_layers' = 1099511627776 is outside [1, 65536]"),
    (dict(compute_ms_per_token=math.nan), "advert: field 'compute_ms_per_token' = nan is not a finite number "
                                          "in [0.0, inf]"),
    (dict(compute_ms_per_token=-math.inf), "advert: field 'compute_ms_per_token' = -inf is not a finite number "
                                           "in [0.0, inf]"),
    (dict(ttl_s=math.inf), "advert: field 'ttl_s' = inf is not a finite number in [0.0, 3600.0]"),
    (dict(ttl_s=1e300), "advert: field 'ttl_s' = 1e+300 is not a finite number in [0.0, 3600.0]"),
    (dict(free_kv_tokens=-1), "advert: field 'free_kv_tokens' = -1 is outside [0, 1099511627776]"),
    (dict(seq=(1 << 64) - 1), "advert: field 'seq' = 18446744073709551615 is outside [0, 4611686018427387904]"),
    (dict(rtts_ms={"x": math.nan}), "advert: field 'rtts_ms' must map peer ids to non-negative numbers"),
    (dict(rtts_ms={"x": True}), "advert: field 'rtts_ms' must map peer ids to non-negative numbers"),
    (dict(rtts_ms={"x" * 5000: 1.0}), "advert: field 'rtts_ms' must map peer ids to non-negative numbers"),
    (dict(state="evil"), "advert: state 'evil' is not one of joining, ready, draining"),
    (dict(addrs=["ws://x"] * 65), "advert: field 'addrs' must be a list of at most 64 strings"),
    (dict(addrs="ws://x"), "advert: field 'addrs' has type str"),
    (dict(addrs=[f"ws://127.0.0.1:{p}" for p in range(1, 6)]),
     "advert: field 'addrs' holds 5 addresses; at most 4 are allowed"),
    (dict(addrs=["http://127.0.0.1:8080/admin/delete?all=1"]),
     "advert: address 'http://127.0.0.1:8080/admin/delete?all=1' is not a ws:// or wss:// URL of at most "
     "256 characters"),
    (dict(addrs=["ws://" + "h" * 300]), f"advert: address {'ws://' + 'h' * 75!r} is not a ws:// or wss:// URL "
                                        f"of at most 256 characters"),
    (dict(peer_id=None), "advert: field 'peer_id' is missing"),
    (dict(peer_id=7), "advert: field 'peer_id' has type int"),
]


async def test_hello_as_peer_with_a_malformed_advert_is_refused(tiny):
    async with raw_conversation(tiny, role=None) as (peers, raw):
        peer = peers[0]
        assert await raw.error("hello", role="peer") == ("protocol_error", "hello: field 'advert' is missing")
        assert await raw.error("hello", role="peer", advert=[1]) == (
            "protocol_error", "hello: field 'advert' has type list")
        for changes, message in BAD_ADVERTS:
            assert await raw.error("hello", role="peer", advert=rogue_advert(peer.weights_hash, **changes)) \
                == ("protocol_error", message), changes
        assert await raw.error("ping") == ("protocol_error", "the first frame must be hello, got ping")
        assert len(peer.table) == 0 and not peer.links


def unbounded_gossip(monkeypatch) -> None:
    """Lift the per-connection gossip budgets: the test fills a table in a few frames."""
    monkeypatch.setattr(peer_module, "GOSSIP_VERIFIES_PER_S", 1e6)
    monkeypatch.setattr(peer_module, "MAX_GOSSIP_ADVERTS", 1024)


async def test_gossip_floods_and_bad_numbers_are_dropped(tiny, monkeypatch):
    unbounded_gossip(monkeypatch)  # every advert below is looked at
    async with serving(tiny) as peers:
        peer = peers[0]
        digest = peer.weights_hash
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(digest, ttl_s=30.0))
        try:
            await raw.send("gossip", adverts=list(range(10_000)))
            await raw.send("gossip", adverts=[rogue_advert(digest, key=new_key(), ttl_s=math.nan)
                                              for i in range(300)])
            good = rogue_advert(digest, key=new_key(), ttl_s=30.0)
            junk = [rogue_advert(digest, key=new_key(), compute_ms_per_token=math.inf),
                    rogue_advert(digest, key=new_key(), seq=1 << 63), rogue_advert(digest, key=new_key(), ttl_s=-1.0),
                    rogue_advert(digest, key=new_key(), rtts_ms={"e": -1.0}), {"peer_id": "f"}, None, "advert", good]
            await raw.send("gossip", adverts=junk)
            assert (await raw.request("ping"))["t"] == "pong"  # every gossip above has been handled
            assert sorted(a.peer_id for a in peer.table.adverts()) == sorted([good["peer_id"],
                                                                              rogue_advert(digest)["peer_id"]])
        finally:
            await raw.close()
        for ad in peer.table.adverts():
            peer.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)


async def test_rogue_peer_cannot_grow_the_peer_table_beyond_its_cap(tiny, monkeypatch):
    unbounded_gossip(monkeypatch)
    async with serving(tiny) as peers:
        peer = peers[0]
        digest = peer.weights_hash
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(digest, ttl_s=60.0))  # lives through a slow run
        try:
            for batch in range(8):  # 150 signed adverts (about 90 KB) fit one frame
                await raw.send("gossip", adverts=[rogue_advert(digest, key=new_key(), ttl_s=60.0)
                                                  for i in range(150)])
            big = rogue_advert(digest, key=new_key(), addrs=[f"ws://{i}" + "x" * 4000 for i in range(20)])
            await raw.send("gossip", adverts=[big])
            await raw.request("ping")
            assert len(peer.table) == peer_module.MAX_KNOWN_PEERS
            assert peer.table.get(big["peer_id"]) is None
            payload = peer._gossip_payload()
            assert payload[0]["peer_id"] == peer.peer_id
            assert protocol.wire_size(payload) <= peer_module.GOSSIP_BUDGET_BYTES < peer.max_frame_bytes
        finally:
            await raw.close()
        for ad in peer.table.adverts():
            peer.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)


async def test_silent_fake_peers_do_not_pile_up_gossip_tasks(tiny):
    silent = socket.socket()  # accepts TCP, never answers the websocket handshake
    silent.bind(("127.0.0.1", 0))
    silent.listen(1024)
    url = f"ws://127.0.0.1:{silent.getsockname()[1]}"
    try:
        async with serving(tiny) as peers:
            peer = peers[0]
            raw = await Raw.connect(peer, role="peer", advert=rogue_advert(peer.weights_hash))
            try:
                mute = [rogue_advert(peer.weights_hash, key=new_key(), addrs=[url], ttl_s=60.0) for i in range(100)]
                await raw.send("gossip", adverts=mute)
                await raw.request("ping")
                await asyncio.sleep(1.0)  # 10 gossip rounds of 0.1 s; each dial waits 5 s
                assert sum(1 for ad in peer.table.adverts() if ad.peer_id in {m["peer_id"] for m in mute}) == 100
                assert len(peer._tasks) <= peer.test_task_baseline + 101 + TASK_SLACK
            finally:
                await raw.close()
            for ad in peer.table.adverts():
                peer.table.remove(ad.peer_id)
            silent.close()  # pending dials fail now
            await asyncio.sleep(0.5)
            await assert_healthy(tiny, peers)
    finally:
        silent.close()


async def test_gossip_from_a_rogue_cannot_break_the_link_between_honest_peers(tiny):
    async with raw_conversation(tiny, (0, 2, 4), role="peer", advert=rogue_advert(tiny[1])) as (peers, raw):
        first, second = peers
        link = first.links[second.peer_id]
        for i in range(3):  # each about 75 KB: one fits a frame, three together do not
            await raw.send("gossip", adverts=[rogue_advert(first.weights_hash, key=new_key(), ttl_s=60.0,
                                                           rtts_ms={f"{j:064d}": 1.0 for j in range(1000)})])
        await raw.request("ping")
        await asyncio.sleep(0.5)  # 5 gossip rounds
        assert first.links.get(second.peer_id) is link and not link.closed.is_set()


# --------------------------------------------------------------------------- conversations
OPEN_CASES = [
    (dict(conv=5), "protocol_error", "open: field 'conv' has type int"),
    (dict(conv=None), "protocol_error", "open: field 'conv' is missing"),
    (dict(conv="c" * 5000), "protocol_error", "open: field 'conv' is longer than 4096 characters"),
    (dict(layers=[0, 2, 4]), "protocol_error", "open: field 'layers' must be [start, stop]"),
    (dict(layers=[4, 0]), "protocol_error", "open: field 'layers' = [4, 0] is not a valid half-open layer range"),
    (dict(layers=[0, 1 << 40]), "protocol_error",
     "open: field 'layers' = [0, 1099511627776] is not a valid half-open layer range"),
    (dict(layers=[-1, 2]), "protocol_error", "open: field 'layers' = [-1, 2] is not a valid half-open layer range"),
    (dict(layers=[False, True]), "protocol_error", "open: field 'layers' must be [start, stop]"),
    (dict(layers=[0.0, 4.0]), "protocol_error", "open: field 'layers' must be [start, stop]"),
    (dict(layers="0-3"), "protocol_error", "open: field 'layers' has type str"),
    (dict(layers=[0, 5]), "bad_layer_range", "this peer serves layers 0-3, asked for 0-4"),
    (dict(max_tokens="8"), "protocol_error", "open: field 'max_tokens' has type str"),
    (dict(max_tokens=8.0), "protocol_error", "open: field 'max_tokens' has type float"),
    (dict(max_tokens=0), "protocol_error", "open: field 'max_tokens' = 0 is outside [1, 1099511627776]"),
    (dict(max_tokens=-5), "protocol_error", "open: field 'max_tokens' = -5 is outside [1, 1099511627776]"),
    (dict(max_tokens=(1 << 64) - 1), "protocol_error",
     "open: field 'max_tokens' = 18446744073709551615 is outside [1, 1099511627776]"),
    (dict(max_tokens=1 << 40), "context_overflow",
     "conversation asks for 1099511627776 tokens; the model's context is 256 tokens"),
    (dict(next={"peer_id": "x", "addrs": []}), "protocol_error",
     "open: 'next' must name the next hop unless this hop runs the last layer"),
    (dict(layers=[0, 2]), "protocol_error", "open: 'next' must name the next hop unless this hop runs the last layer"),
    (dict(layers=[0, 2], next={"peer_id": 5}), "protocol_error", "open.next: field 'peer_id' has type int"),
    (dict(layers=[0, 2], next={"peer_id": "x", "addrs": "ws://x"}), "protocol_error",
     "open.next: field 'addrs' has type str"),
    (dict(layers=[0, 2], next={"peer_id": "x", "addrs": ["ws://127.0.0.1:1"] * 5}), "protocol_error",
     "open.next: field 'addrs' holds 5 addresses; at most 4 are allowed"),
    (dict(layers=[0, 2], next={"peer_id": "x", "addrs": ["gopher://127.0.0.1:70/"]}), "protocol_error",
     "open.next: address 'gopher://127.0.0.1:70/' is not a ws:// or wss:// URL of at most 256 characters"),
    (dict(next="peer"), "protocol_error", "open: field 'next' has type str"),
    (dict(prev=7), "protocol_error", "open: field 'prev' has type int"),
    (dict(prev="someone"), "protocol_error", "open: 'prev' must name the previous hop unless this hop runs layer 0"),
    (dict(layers=[2, 4]), "protocol_error", "open: 'prev' must name the previous hop unless this hop runs layer 0"),
    # conversation keys (protocol 3): the id is the key's, and the key signs the open
    (dict(client_key=b"\0" * 31, n=1, client_sig=bytes(64)), "protocol_error",
     "open: field 'client_key' must be a 32-byte Ed25519 public key"),
    (dict(conv=conv_id("c"), client_key=key_for("c").public, client_sig=bytes(64)), "protocol_error",
     "open: field 'n' is missing"),
    (dict(conv=conv_id("c"), client_key=key_for("c").public, n=-1, client_sig=bytes(64)), "protocol_error",
     f"open: field 'n' = -1 is outside [0, {protocol.MAX_SEQ}]"),
    (dict(conv=conv_id("c"), client_key=key_for("another").public, n=1, client_sig=bytes(64)), "unauthenticated",
     f"open: conversation id {conv_id('c')!r} is not the id of its client_key"),
    (dict(conv=conv_id("c"), client_key=key_for("c").public, n=1, client_sig=bytes(64)), "protocol_error",
     "open: field 'min_seq' is missing"),
    (dict(conv=conv_id("c"), client_key=key_for("c").public, n=1, min_seq=0), "unauthenticated",
     "open: client_sig is not the conversation key's signature of the open"),
    (dict(conv=conv_id("c"), client_key=key_for("c").public, n=1, min_seq=0, client_sig=bytes(64)),
     "unauthenticated", "open: client_sig is not the conversation key's signature of the open"),
]


async def test_open_with_bad_fields_is_refused_and_allocates_nothing(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        peer = peers[0]
        for changes, code, message in OPEN_CASES:
            fields = {"conv": "c", "layers": [0, 4], "max_tokens": 8} | changes
            fields = {k: v for k, v in fields.items() if v is not None}
            assert await raw.error("open", **fields) == (code, message), changes
        assert not peer.convs and peer.free_kv_tokens == peer.capacity_tokens
        assert await raw.frame_error(pack("open", id="x", conv="c", layers=[0, 4], max_tokens=8)) == (
            "protocol_error", "open: field 'id' has type str")
        assert (await raw.request("open", conv="dup", layers=[0, 4], max_tokens=8))["t"] == "opened"
        assert await raw.error("open", conv="dup", layers=[0, 4], max_tokens=8) == (
            "protocol_error", f"open: conversation {conv_id('dup')!r} is already open")
        other = await Raw.connect(peer)
        try:
            assert await other.error("open", conv="dup", layers=[0, 4], max_tokens=8) == (
                "protocol_error", f"open: conversation {conv_id('dup')!r} is already open")
        finally:
            await other.close()
        assert peer.convs[conv_id("dup")].reserved_tokens == 8 and peer.kv_bytes_used == 0  # nothing allocated yet


async def test_open_beyond_the_kv_budget_is_refused(tiny):
    # one host may take it all here (kv_share=1.0): the per-host share has its own test
    async with serving(tiny, kv_budget_bytes=100 * (512 + STATEMENT_BYTES_PER_TOKEN), client_limits=ClientLimits(kv_share=1.0)) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer)
        try:
            assert peer.capacity_tokens == 100
            assert (await raw.request("open", conv="a", layers=[0, 4], max_tokens=60))["free_kv_tokens"] == 40
            assert await raw.error("open", conv="b", layers=[0, 4], max_tokens=41) == (
                "cache_full", "conversation needs 41 tokens of KV cache; this peer has 40 free of 100")
            await raw.send("close", conv="a")
            assert (await raw.request("open", conv="b", layers=[0, 4], max_tokens=100))["free_kv_tokens"] == 0
        finally:
            await raw.close()
        await settle(peers)
        assert peer.free_kv_tokens == 100


def step_cases():
    big = list(range(1, MAX_STEP + 2))
    bad_ids = "step 1: tokens must be 1-512 ids in [0, 260)"
    return [
        (dict(conv=5), "protocol_error", "step: field 'conv' has type int"),
        (dict(conv="nope"), "invalid_input", "step 1: conversation 'nope' is not open on this peer"),
        (dict(seq="1"), "protocol_error", "step: field 'seq' has type str"),
        (dict(seq=-1), "protocol_error", "step: field 'seq' = -1 is outside [0, 4611686018427387903]"),
        (dict(start=-1), "protocol_error", "step: field 'start' = -1 is outside [0, 256]"),
        (dict(start=1 << 40), "protocol_error", "step: field 'start' = 1099511627776 is outside [0, 256]"),
        (dict(start="0"), "protocol_error", "step: field 'start' has type str"),
        (dict(tokens={"0": 1}), "protocol_error", "step: field 'tokens' has type dict"),
        (dict(tokens=None), "protocol_error", "step: field 'tokens' is missing"),
        (dict(tokens=[VOCAB]), "invalid_input", bad_ids),
        (dict(tokens=[-1]), "invalid_input", bad_ids),
        (dict(tokens=[True]), "invalid_input", bad_ids),
        (dict(tokens=[1.0]), "invalid_input", bad_ids),
        (dict(tokens=["a"]), "invalid_input", bad_ids),
        (dict(tokens=[None]), "invalid_input", bad_ids),
        (dict(tokens=[[1]]), "invalid_input", bad_ids),
        (dict(tokens=[]), "invalid_input", bad_ids),
        (dict(tokens=[1 << 63]), "invalid_input", bad_ids),
        (dict(tokens=big), "invalid_input", bad_ids),
        (dict(want=1), "protocol_error", "step: field 'want' has type int"),
        (dict(want="everything"), "protocol_error", "step 1: want 'everything' is not one of none, token, tokens"),
        (dict(sampling="hot"), "protocol_error", "step: field 'sampling' has type str"),
        (dict(sampling={"temperature": 1, "top_p": 1}), "protocol_error", "step 1.sampling: field 'seed' is missing"),
        (dict(sampling={"temperature": math.inf, "top_p": 1, "seed": 0}), "protocol_error",
         "step 1.sampling: field 'temperature' = inf is not a finite number in [0.0, 100.0]"),
        (dict(sampling={"temperature": 1, "top_p": 1, "seed": 1 << 63}), "protocol_error",
         f"step 1.sampling: field 'seed' = {1 << 63} is outside [0, {(1 << 63) - 1}]"),
        (dict(trace={"peer": "x"}), "protocol_error", "step: field 'trace' has type dict"),
        (dict(trace=[b"junk"]), "protocol_error", "step.trace: expected a map, got bytes"),
        (dict(trace=[{"peer": "x" * 65, "compute_ms": 1, "queue_ms": 1}]), "protocol_error",
         "step.trace: field 'peer' is longer than 64 characters"),
        (dict(trace=[{"peer": "x", "compute_ms": math.nan, "queue_ms": 1}]), "protocol_error",
         "step.trace: field 'compute_ms' = nan is not a finite number in [0.0, inf]"),
        (dict(hidden=f32(torch.zeros(1, 1, WIDTH)), tokens=None), "protocol_error", "step: field 'tokens' is missing"),
        (dict(start=3), "bad_positions", f"step 1 starts at position 3; conversation {conv_id('s')} expects position 0"),
        (dict(start=3, rollback=True), "bad_positions",
         f"step 1 starts at position 3; conversation {conv_id('s')} expects position 0"),
        (dict(conv=conv_id("s"), csig=bytes(64)), "unauthenticated",
         "step 1: 'csig' is not the conversation key's signature of this step"),
        (dict(conv=conv_id("s"), csig=b"short"), "unauthenticated",
         "step 1: 'csig' is not the conversation key's signature of this step"),
        (dict(conv=conv_id("s"), csig="text"), "protocol_error", "step: field 'csig' has type str"),
        (dict(rollback="yes"), "protocol_error", "step: field 'rollback' has type str"),
        (dict(tokens=[1] * 17), "cache_full", "step 1 would grow the conversation to 17 tokens; it reserved 16"),
    ]


async def test_step_with_bad_fields_is_refused_and_the_conversation_continues(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        peer = peers[0]
        await raw.request("open", conv="s", layers=[0, 4], max_tokens=16)
        for changes, code, message in step_cases():
            fields = {"conv": "s", "seq": 1, "start": 0, "tokens": [1, 2, 3], "want": "token"} | changes
            fields = {k: v for k, v in fields.items() if v is not None}
            assert await raw.error("step", **fields) == (code, message), changes
        assert peer.convs[conv_id("s")].expected_start == 0 and peer.convs[conv_id("s")].cache.length == 0
        await raw.send("step", conv="s", seq=2, start=0, tokens=[5, 6, 7])
        assert await raw.error("step", conv="s", seq=3, start=1, tokens=[8]) == (
            "bad_positions", f"step 3 starts at position 1; conversation {conv_id('s')} expects position 3")
        assert await raw.error("step", conv="s", seq=4, start=4, tokens=[8]) == (
            "bad_positions", f"step 4 starts at position 4; conversation {conv_id('s')} expects position 3")
        await raw.send("step", conv="s", seq=5, start=3, tokens=[8, 9], want="token")
        reply = await raw.recv()
        assert (reply["t"], reply["seq"], reply["token"]) == ("token", 5, last_token(tiny, [5, 6, 7, 8, 9]))
        assert [h["peer"] for h in reply["trace"]] == [peer.peer_id]


def signed_step(key: convkeys.ConversationKey, seq: int, start: int, tokens: list[int], want: str = "token") -> dict:
    """The fields of a step of ``tokens`` signed by the conversation's ``key`` (its client)."""
    header = convkeys.StepHeader(key.conv_id, seq, start, len(tokens), want, None, False, False,
                                 convkeys.tokens_digest(tokens))
    return dict(conv=key.conv_id, seq=seq, start=start, tokens=tokens, want=want, **key.step_fields(header))


async def test_a_conversation_id_can_be_opened_only_by_its_client(tiny):
    """A hop (or a relay) that learns a conversation's id, and even the client's signed open,
    used to be able to open that id first on another peer, blocking the client's failover to it
    (a second open of an id is refused), and to collect that peer's signed output. Since
    protocol 3 the id is derived from a key only the client holds and every open is signed for
    the peer it goes to, with a number that grows (``n``): the stranger's own key gives another
    id, the client's open does not verify on another peer, a replay on the same peer is "already
    open", and an old open replayed after the client closed there holds the id only until the
    client opens it again (its ``n`` is higher); the stranger's steps are then refused."""
    async with serving(tiny) as [peer], serving(tiny) as [spare]:
        client, thief, near = await Raw.connect(peer), await Raw.connect(spare), await Raw.connect(peer)
        key = convkeys.ConversationKey()
        fields = dict(conv=key.conv_id, layers=[0, 4], max_tokens=16, prev=None, next=None)
        to_peer = fields | key.open_fields("open", peer.peer_id, 0, [0, 4], 16, None, None)
        try:
            assert (await client.request("open", **to_peer))["t"] == "opened"
            own = convkeys.ConversationKey()
            assert await thief.error("open", **fields | own.open_fields("open", spare.peer_id, 0, [0, 4], 16, None,
                                                                        None)) == (
                "unauthenticated", f"open: conversation id {key.conv_id!r} is not the id of its client_key")
            assert await thief.error("open", **to_peer) == (
                "unauthenticated", "open: client_sig is not the conversation key's signature of the open")
            assert await near.error("open", **to_peer) == (
                "protocol_error", f"open: conversation {key.conv_id!r} is already open")
            assert not spare.convs and key.conv_id in peer.convs
            # failover to the spare is not blocked
            to_spare = fields | key.open_fields("open", spare.peer_id, 0, [0, 4], 16, None, None)
            assert (await thief.request("open", **to_spare))["t"] == "opened"
            await thief.send("close", conv=key.conv_id)
            # an old open replayed after the client closed: held until the client opens again
            await client.send("close", conv=key.conv_id)
            assert (await client.request("ping"))["t"] == "pong"
            assert (await near.request("open", **to_peer))["t"] == "opened"
            again = fields | key.open_fields("open", peer.peer_id, 0, [0, 4], 16, None, None)
            assert (await client.request("open", **again))["t"] == "opened"
            assert await near.error("step", **signed_step(key, 1, 0, [5, 6])) == (
                "protocol_error", f"step 1: this connection may not send steps for conversation {key.conv_id}")
            await client.send("step", **signed_step(key, 2, 0, [5, 6]))
            reply = await client.recv()
            assert (reply["t"], reply["seq"], reply["token"]) == ("token", 2, last_token(tiny, [5, 6]))
            key.opens = 0  # a reroute signed with an old n (a replay): refused, the conversation stays
            assert await client.error("reroute", **fields | key.open_fields("reroute", peer.peer_id, 0, [0, 4], 16,
                                                                            None, None)) == (
                "unauthenticated", "reroute: n = 1 is not above 3, the last open or reroute's")
        finally:
            for raw in (client, thief, near):
                await raw.close()
        await assert_healthy(tiny, [peer])


async def test_a_step_from_the_conversations_own_connection_keeps_no_unchecked_signature(tiny):
    """Found by an attack run: a stranger (keys are free) opened a conversation past layer 0
    naming itself as previous hop and sent steps on that connection whose ``sig`` was 100 KB of
    junk; nothing checked it (only a previous hop's steps are checked) yet the hop kept it for
    each position, memory nobody counted. Now a step from the conversation's own connection
    keeps its digests and no signature, and its seqs must grow too."""
    async with raw_conversation(tiny, role="peer", advert=rogue_advert(tiny[1])) as (peers, raw):
        peer = peers[0]
        await raw.request("open", conv="junk", layers=[2, 4], max_tokens=16, prev=peer_id_of(ROGUE_KEY))
        for seq in (1, 2):
            await raw.send("step", conv="junk", seq=seq, start=seq - 1, hidden=f32(torch.randn(1, 1, WIDTH)),
                           sig=b"j" * 100_000)
        assert (await raw.request("ping"))["t"] == "pong"
        conv = peer.convs[conv_id("junk")]
        assert len(conv.signed_at) == 2 and all(st[3] == b"" and len(st[2]) == 16 for st in conv.signed_at)
        assert await raw.error("step", conv="junk", seq=2, start=2, hidden=f32(torch.randn(1, 1, WIDTH))) == (
            "protocol_error", "step 2 is not above step 2, the last this hop took")


async def test_other_connections_cannot_touch_a_conversation(tiny):
    async with serving(tiny) as peers:
        peer = peers[0]
        owner, thief = await Raw.connect(peer), await Raw.connect(peer)
        try:
            await owner.request("open", conv="mine", layers=[0, 4], max_tokens=32)
            await owner.send("step", conv="mine", seq=1, start=0, tokens=[10, 11])
            assert await thief.error("step", conv="mine", seq=2, start=2, tokens=[12]) == (
                "protocol_error", f"step 2: this connection may not send steps for conversation {conv_id('mine')}")
            assert await thief.error("truncate", conv="mine", length=0) == (
                "invalid_input", "truncate: no such conversation on this connection")
            await thief.send("close", conv="mine")
            assert (await thief.request("ping"))["t"] == "pong"  # the close has been handled
            assert conv_id("mine") in peer.convs
            await owner.send("step", conv="mine", seq=3, start=2, tokens=[12], want="token")
            reply = await owner.recv()
            assert (reply["t"], reply["seq"], reply["token"]) == ("token", 3, last_token(tiny, [10, 11, 12]))
        finally:
            await owner.close()
            await thief.close()
        await assert_healthy(tiny, peers)


async def test_truncate_beyond_the_length_or_negative_is_refused(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        await raw.request("open", conv="t", layers=[0, 4], max_tokens=32)
        await raw.send("step", conv="t", seq=1, start=0, tokens=[1, 2, 3])
        assert await raw.error("truncate", conv="t", length=50) == (
            "bad_positions", "cannot truncate to position 50: the cache holds 3 tokens")
        assert await raw.error("truncate", conv="t", length=-1) == (
            "protocol_error", "truncate: field 'length' = -1 is outside [0, 256]")
        assert await raw.error("truncate", conv="t", length="1") == (
            "protocol_error", "truncate: field 'length' has type str")
        assert await raw.error("truncate", conv="gone", length=0) == (
            "invalid_input", "truncate: no such conversation on this connection")
        assert (await raw.request("truncate", conv="t", length=1))["t"] == "truncated"
        await raw.send("step", conv="t", seq=2, start=1, tokens=[7, 8], want="token")
        reply = await raw.recv()
        assert (reply["t"], reply["token"]) == ("token", last_token(tiny, [1, 7, 8]))


# --------------------------------------------------------------------------- hidden-state tensors
def tensor_cases():
    h = torch.zeros(1, 1, WIDTH)
    data = f32(h)["data"]
    dims = "must have 1-4 positive dimensions"
    return [
        (dict(dtype="f64"), "protocol_error", "tensor: dtype 'f64' is not one of f32, bf16, f16"),
        (dict(dtype=4), "protocol_error", "tensor: field 'dtype' has type int"),
        (dict(data=data[:-1]), "protocol_error", "tensor: shape [1, 1, 32] of f32 needs 128 bytes, payload has 127"),
        (dict(data=data + b"\0" * 4), "protocol_error",
         "tensor: shape [1, 1, 32] of f32 needs 128 bytes, payload has 132"),
        (dict(data="text"), "protocol_error", "tensor: field 'data' has type str"),
        (dict(shape=[1, 0, WIDTH]), "protocol_error", f"tensor: shape [1, 0, 32] {dims}"),
        (dict(shape=[1, -1, WIDTH]), "protocol_error", f"tensor: shape [1, -1, 32] {dims}"),
        (dict(shape=[1, 1 << 40, WIDTH]), "protocol_error", f"tensor: shape [1, 1099511627776, 32] {dims}"),
        (dict(shape=[1, 1, 1, 1, WIDTH]), "protocol_error", f"tensor: shape [1, 1, 1, 1, 32] {dims}"),
        (dict(shape=[]), "protocol_error", f"tensor: shape [] {dims}"),
        (dict(shape=[1, "1", WIDTH]), "protocol_error", f"tensor: shape [1, '1', 32] {dims}"),
        (dict(shape=[1, 1.0, WIDTH]), "protocol_error", f"tensor: shape [1, 1.0, 32] {dims}"),
        (dict(shape=[1, True, WIDTH]), "protocol_error", f"tensor: shape [1, True, 32] {dims}"),
        (dict(shape=[16384, 16384, 16384, WIDTH]), "protocol_error",
         "tensor: 140737488355328 elements exceed the limit of 16384"),
        (dict(shape=[(1 << 64) - 1] * 3 + [WIDTH]), "protocol_error",
         f"tensor: shape [18446744073709551615, 18446744073709551615, 18446744073709551615, 32] {dims}"),
        (dict(shape=[1, 513, WIDTH]), "protocol_error", "tensor: 16416 elements exceed the limit of 16384"),
        (dict(shape=[1, 2, 16]), "protocol_error", "tensor: last dimension 16 differs from the hidden width 32"),
        (dict(shape=[1, WIDTH]), "invalid_input", "step 1: hidden states must be (1, T, 32)"),
        (dict(shape=[WIDTH]), "invalid_input", "step 1: hidden states must be (1, T, 32)"),
        (dict(shape=[1, 1, 1, WIDTH]), "invalid_input", "step 1: hidden states must be (1, T, 32)"),
        (dict(shape=[1, 1, WIDTH], data=None), "protocol_error", "tensor: field 'data' is missing"),
    ]


async def test_malformed_hidden_states_are_refused_before_allocation(tiny):
    async with raw_conversation(tiny, role="peer", advert=rogue_advert(tiny[1])) as (peers, raw):
        peer = peers[0]
        ad = rogue_advert(peer.weights_hash)
        await raw.request("open", conv="h", layers=[2, 4], max_tokens=16, prev=ad["peer_id"])
        for changes, code, message in tensor_cases():
            hidden = {k: v for k, v in (f32(torch.zeros(1, 1, WIDTH)) | changes).items() if v is not None}
            assert await raw.error("step", conv="h", seq=1, start=0, hidden=hidden) == (code, message), changes
        assert await raw.error("step", conv="h", seq=1, start=0, hidden=[1.0] * WIDTH) == (
            "protocol_error", "step: field 'hidden' has type list")
        assert await raw.error("step", conv="h", seq=1, start=0, tokens=[1]) == (
            "protocol_error", "step: field 'hidden' is missing")
        assert peer.kv_bytes_used == 0 and peer.convs[conv_id("h")].expected_start == 0
        ids = [3, 1, 4, 1, 5]
        await raw.send("step", conv="h", seq=2, start=0, hidden=f32(hidden_after(tiny, ids, 2)), want="token")
        reply = await raw.recv()
        assert (reply["t"], reply["token"]) == ("token", last_token(tiny, ids))


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
async def test_non_finite_hidden_states_are_an_error_never_a_token(tiny, dtype, bad):
    async with raw_conversation(tiny, role="peer", advert=rogue_advert(tiny[1])) as (peers, raw):
        peer = peers[0]
        ad = rogue_advert(peer.weights_hash)
        await raw.request("open", conv="n", layers=[2, 4], max_tokens=16, prev=ad["peer_id"])
        h = hidden_after(tiny, [7, 8, 9], 2).clone()
        h[0, 1, 5] = bad
        await raw.send("step", conv="n", seq=1, start=0, hidden=tensors.tensor_to_wire(h, dtype), want="token")
        reply = await raw.recv()
        assert (reply["t"], reply["code"], reply["seq"]) == ("error", "invalid_input", 1)
        assert reply["message"] == "layers 2-3 produced NaN or inf at positions 0..2"
        assert peer.convs[conv_id("n")].cache.length == 0 and peer.convs[conv_id("n")].expected_start == 0
        await raw.send("step", conv="n", seq=2, start=0, hidden=f32(hidden_after(tiny, [7, 8, 9], 2)),
                       want="token")
        reply = await raw.recv()
        assert (reply["t"], reply["seq"], reply["token"]) == ("token", 2, last_token(tiny, [7, 8, 9]))


# --------------------------------------------------------------------------- frame size and msgpack bombs
async def test_frame_over_the_limit_closes_with_1009(tiny):
    async with serving(tiny) as peers:
        peer = peers[0]
        assert peer.max_frame_bytes == MAX_STEP * WIDTH * 4 + peer_module.FRAME_OVERHEAD_BYTES
        raw = await Raw.connect(peer)
        await raw.send("ping", pad=b"\0" * peer.max_frame_bytes)
        assert await raw.closed_code() == 1009
        await assert_healthy(tiny, peers)


@pytest.mark.parametrize("frame", [b"\xdc\xff\xff" * 1024, b"\xdd\x00\x01\x00\x00" * 1024,
                                   b"\xde\x04\x00" * 1024, b"\x91" * 100_000,
                                   b"\x81\xa1v" + b"\xdc\xff\xff" * 1024],
                         ids=["array16", "array32", "map16", "deep", "in-map"])
def test_decoding_a_msgpack_bomb_allocates_nothing_sized_by_its_headers(frame):
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="frame is not valid msgpack"):
            protocol.decode(frame, max_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(frame) + (256 << 10)


async def test_msgpack_bombs_do_not_stall_the_peer(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        t0 = time.perf_counter()
        for _ in range(30):  # under the 64 malformed frames that close a connection
            assert await raw.frame_error(b"\xdc\xff\xff" * 1024) == (
                "protocol_error", "frame is not valid msgpack: it ends inside an object")
        assert time.perf_counter() - t0 < 1.5  # unfixed: about 0.1 s of decoder time each


async def test_64_malformed_frames_close_the_connection_with_1008(tiny):
    async with serving(tiny) as peers:
        raw = await Raw.connect(peers[0])
        for _ in range(64):
            await raw.ws.send(b"\xc1")
        assert await raw.closed_code() == 1008
        assert raw.ws.close_reason == "64 malformed frames"
        await assert_healthy(tiny, peers)


# --------------------------------------------------------------------------- connections and floods
async def test_connection_without_hello_is_closed_after_the_timeout(tiny, monkeypatch):
    monkeypatch.setattr(peer_module, "HELLO_TIMEOUT_S", 0.3)
    async with serving(tiny) as peers:
        t0 = time.perf_counter()
        raw = await Raw.connect(peers[0], role=None)
        assert await raw.closed_code() == 1008
        assert raw.ws.close_reason == "no hello" and time.perf_counter() - t0 < 3.0
        late = await Raw.connect(peers[0])  # one that says hello in time stays open
        await asyncio.sleep(0.5)
        assert (await late.request("ping"))["t"] == "pong"
        await late.close()
        await assert_healthy(tiny, peers)


async def test_open_flood_on_one_connection_is_capped(tiny):
    async with raw_conversation(tiny) as (peers, raw):
        peer = peers[0]
        for i in range(200):
            await raw.send("open", id=i + 1000, conv=f"o{i}", layers=[0, 4], max_tokens=4)
        replies = [await raw.recv() for _ in range(200)]
        assert sum(r["t"] == "opened" for r in replies) == peer_module.MAX_CONVERSATIONS_PER_LINK
        refused = {(r["code"], r["message"]) for r in replies if r["t"] == "error"}
        assert refused == {("cache_full", "this connection already holds 64 conversations")}
        assert len(peer.convs) == 64


async def test_two_hundred_connections_each_with_a_conversation(tiny):
    async with serving(tiny, client_limits=ClientLimits(conversations=1000)) as peers:
        peer = peers[0]
        raws = await asyncio.gather(*(Raw.connect(peer) for _ in range(200)))
        try:
            for i, raw in enumerate(raws):
                await raw.send("open", conv=f"m{i}", layers=[0, 4], max_tokens=8)
                await raw.send("step", conv=f"m{i}", seq=1, start=0, tokens=[i % VOCAB, 1], want="token")
            replies = await asyncio.gather(*(r.recv(timeout_s=30) for r in raws))
            assert all(r["t"] == "opened" for r in replies)
            tokens = await asyncio.gather(*(r.recv(timeout_s=30) for r in raws))
            assert [t["token"] for t in tokens[:3]] == [last_token(tiny, [i, 1]) for i in range(3)]
            assert len(peer.convs) == 200 and peer.kv_bytes_used > 0
            assert len(peer._tasks) == peer.test_task_baseline + 200  # one worker per conversation
        finally:
            for i, raw in enumerate(raws):
                if i % 2:
                    raw.ws.transport.abort()
                else:
                    await raw.ws.close()
            await asyncio.gather(*(r.reader for r in raws), return_exceptions=True)
        await assert_healthy(tiny, peers)


async def test_abrupt_disconnect_mid_step_frees_the_cache(tiny):
    async with serving(tiny) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer)
        await raw.request("open", conv="a", layers=[0, 4], max_tokens=CONTEXT)
        for i in range(8):
            await raw.send("step", conv="a", seq=i, start=i * 30, tokens=list(range(30)), want="token")
        raw.ws.transport.abort()
        await settle(peers)
        assert peer.kv_bytes_used == 0
        await assert_healthy(tiny, peers)


async def test_conversations_closed_while_batched_or_awaited_leave_nothing_behind(tiny):
    """Open, step, close: conversations closed while their step is pending or while a pass waits
    for them (the scheduler holds the coming ones) leave no cache, no scheduler entry, no task."""
    unlimited = ClientLimits(steps_per_s=1e6, bytes_per_s=1e12, frames_per_s=1e9)
    async with raw_conversation(tiny, client_limits=unlimited) as (peers, raw):
        peer = peers[0]
        for cycle in range(10):
            convs = [f"k{cycle}-{i}" for i in range(6)]
            for c in convs:
                assert (await raw.request("open", conv=c, layers=[0, 4], max_tokens=16))["t"] == "opened"
            for c in convs:
                await raw.send("step", conv=c, seq=0, start=0, tokens=[1, 2, 3], want="token")
            assert [(await raw.recv())["t"] for _ in convs] == ["token"] * len(convs)
            for i, c in enumerate(convs):  # half send one more step and close at once, half stop
                if i % 2:
                    await raw.send("step", conv=c, seq=1, start=3, tokens=[4], want="token")
                    await raw.send("close", conv=c)
            for c in convs[::2]:
                await raw.send("close", conv=c)
        await settle(peers)
        assert not peer.scheduler._coming and not peer.scheduler._pending
        assert peer.batch_stats.batched_passes > 0


async def test_client_that_never_reads_replies_does_not_stall_others(tiny):
    # the stall is under test here, not the per-host rate limit (both clients share 127.0.0.1)
    unlimited = ClientLimits(steps_per_s=1e6, bytes_per_s=1e12, frames_per_s=1e9)
    async with serving(tiny, client_limits=unlimited) as peers:
        peer = peers[0]
        ws = await websockets.connect(peer.addrs[0], sock=small_socket(peer.port), compression=None,
                                      ping_interval=None, max_queue=1)
        try:
            await ws.send(pack("hello", role="client"))
            for c in range(4):
                await ws.send(signed("open", peer.peer_id, conv=f"x{c}", layers=[0, 4], max_tokens=CONTEXT))
            with contextlib.suppress(asyncio.TimeoutError):  # the peer stops reading it: fine
                for i in range(CONTEXT):
                    for c in range(4):
                        await asyncio.wait_for(ws.send(signed("step", peer.peer_id, conv=f"x{c}", seq=i, start=i,
                                                              tokens=[i % VOCAB], want="token")), 2)
            assert len(peer.convs) == 4
            t0 = time.perf_counter()
            await converse(tiny, peers)
            assert time.perf_counter() - t0 < 10
        finally:
            ws.transport.abort()
        await assert_healthy(tiny, peers)


# --------------------------------------------------------------------------- a two-peer chain
async def open_chain(peers, conv: str, *, max_tokens: int = 64) -> tuple[Raw, Raw]:
    """Raw client connections to both hops of ``peers`` with ``conv`` open on each."""
    first, second = peers
    a, b = await Raw.connect(first), await Raw.connect(second)
    assert (await a.request("open", conv=conv, layers=[0, 2], max_tokens=max_tokens,
                            next={"peer_id": second.peer_id, "addrs": list(second.addrs)}))["t"] == "opened"
    assert (await b.request("open", conv=conv, layers=[2, 4], max_tokens=max_tokens,
                            prev=first.peer_id))["t"] == "opened"
    return a, b


async def test_trace_cannot_smuggle_bytes_to_the_next_hop(tiny):
    async with serving(tiny, (0, 2, 4)) as peers:
        first, second = peers
        link = first.links[second.peer_id]
        a, b = await open_chain(peers, "t", max_tokens=CONTEXT)
        try:
            ids = [i % VOCAB for i in range(200)]  # 25.6 KB of hidden states for the next hop, plus the pad
            stuffed = [{"peer": "me", "compute_ms": 1.0, "queue_ms": 0.0, "pad": b"\0" * 120_000}]
            await a.send("step", conv="t", seq=1, start=0, tokens=ids, want="token", trace=stuffed)
            reply = await b.recv(timeout_s=20)
            assert (reply["t"], reply["token"]) == ("token", last_token(tiny, ids))
            assert [sorted(h) for h in reply["trace"]] == [["compute_ms", "peer", "queue_ms"]] * 3
            assert [h["peer"] for h in reply["trace"]] == ["me", first.peer_id, second.peer_id]
            assert first.links.get(second.peer_id) is link and not link.closed.is_set()
        finally:
            await a.close()
            await b.close()
        await assert_healthy(tiny, peers)


async def test_later_hop_takes_steps_only_from_the_named_previous_peer(tiny):
    async with serving(tiny, (0, 2, 4)) as peers:
        first, second = peers
        client = await Raw.connect(second)
        try:
            assert await client.error("open", conv="p", layers=[2, 4], max_tokens=8) == (
                "protocol_error", "open: 'prev' must name the previous hop unless this hop runs layer 0")
            await client.request("open", conv="p", layers=[2, 4], max_tokens=8, prev=first.peer_id)
            assert await client.error("step", conv="p", seq=1, start=0, hidden=f32(torch.zeros(1, 1, WIDTH))) == (
                "protocol_error", f"step 1: this connection may not send steps for conversation {conv_id('p')}")
            assert second.convs[conv_id("p")].cache.length == 0
        finally:
            await client.close()
        await assert_healthy(tiny, peers)


async def test_rogue_cannot_speak_for_another_peer(tiny):
    async with serving(tiny, (0, 2, 4)) as peers:
        first, second = peers
        lie = rogue_advert(first.weights_hash, peer_id=second.peer_id, layers=[2, 4], addrs=[], seq=1 << 62,
                           ttl_s=3600.0)
        raw = await Raw.connect(first, role=None)
        try:
            assert await raw.error("hello", role="peer", nonce=NONCE, advert=lie) == (
                "unauthenticated", f"hello: the advert of peer {second.peer_id[:12]} does not verify against its "
                                   f"public key")
        finally:
            await raw.close()
        raw = await Raw.connect(first, role="peer", advert=rogue_advert(first.weights_hash))
        try:
            await raw.send("gossip", adverts=[lie])
            await raw.request("ping")
            assert first.table.get(second.peer_id).addrs == second.addrs
            assert first.links[second.peer_id].remote_id == second.peer_id
        finally:
            await raw.close()
        await assert_healthy(tiny, peers)


def forged(ad: dict) -> dict:
    """``ad`` with one bit of its signature flipped."""
    sig = bytearray.fromhex(ad["sig"])
    sig[0] ^= 1
    return ad | {"sig": sig.hex()}


BAD_SIGNATURES = {
    "forged signature": lambda d, k: forged(rogue_advert(d, key=k)),
    "no signature": lambda d, k: rogue_advert(d, key=k) | {"sig": "", "public_key": ""},
    "another peer's id": lambda d, k: rogue_advert(d, key=k, peer_id=peer_id_of(new_key())),
    "another peer's key": lambda d, k: rogue_advert(d, key=k) | {"public_key": rogue_advert(d)["public_key"]},
    "addrs changed after signing": lambda d, k: rogue_advert(d, key=k) | {"addrs": ["ws://evil:1"]},
    "seq changed after signing": lambda d, k: rogue_advert(d, key=k) | {"seq": 1 << 40},
    "layers changed after signing": lambda d, k: rogue_advert(d, key=k) | {"layers": [0, 4]},
    "rtts changed after signing": lambda d, k: rogue_advert(d, key=k) | {"rtts_ms": {"x": 0.0}},
}


@pytest.mark.parametrize("make", BAD_SIGNATURES.values(), ids=BAD_SIGNATURES.keys())
async def test_adverts_that_do_not_verify_are_dropped(tiny, make):
    async with serving(tiny) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(peer.weights_hash))
        try:
            bad, good = make(peer.weights_hash, new_key()), rogue_advert(peer.weights_hash, key=new_key(), ttl_s=5.0)
            await raw.send("gossip", adverts=[bad, good])
            await raw.request("ping")
            assert peer.table.get(bad["peer_id"]) is None
            assert peer.table.get(good["peer_id"]) is not None
        finally:
            await raw.close()


async def test_a_relay_cannot_keep_a_record_alive_beyond_the_ttl_cap(tiny):
    async with serving(tiny) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(peer.weights_hash))
        try:
            ad = rogue_advert(peer.weights_hash, key=new_key(), ttl_s=3600.0)
            await raw.send("gossip", adverts=[ad])
            await raw.request("ping")
            assert [a.ttl_s <= MAX_TTL_S for a in peer.table.adverts() if a.peer_id == ad["peer_id"]] == [True]
        finally:
            await raw.close()


async def test_a_dialer_that_cannot_prove_its_key_is_refused(tiny):
    async with raw_conversation(tiny, role=None) as (peers, raw):
        peer = peers[0]
        ad = rogue_advert(peer.weights_hash)
        welcome = await raw.request("hello", role="peer", nonce=NONCE, advert=ad)
        assert welcome["t"] == "welcome"
        wrong = new_key().sign(HELLO_LABEL + welcome["nonce"] + NONCE)
        assert await raw.error("auth", proof=wrong) == (
            "unauthenticated", f"auth: the proof does not match the key of peer {ad['peer_id'][:12]}")
        stale = ROGUE_KEY.sign(HELLO_LABEL + bytes(NONCE_BYTES) + NONCE)  # a proof for another welcome
        assert await raw.error("auth", proof=stale) == (
            "unauthenticated", f"auth: the proof does not match the key of peer {ad['peer_id'][:12]}")
        assert await raw.error("gossip", adverts=[ad]) == (
            "unauthenticated", "gossip: this peer has not proven its key; send auth after welcome")
        await raw.request("open", conv="u", layers=[2, 4], max_tokens=8, prev=ad["peer_id"])
        assert await raw.error("step", conv="u", seq=1, start=0, hidden=f32(torch.zeros(1, 1, WIDTH))) == (
            "protocol_error", f"step 1: this connection may not send steps for conversation {conv_id('u')}")
        assert ad["peer_id"] not in peer.links and peer.table.get(ad["peer_id"]) is None


async def test_unread_client_does_not_block_the_link_between_hops(tiny):
    async with serving(tiny, (0, 2, 4)) as peers:
        first, second = peers
        link = first.links[second.peer_id]
        ws = await websockets.connect(first.addrs[0], sock=small_socket(first.port), compression=None,
                                      ping_interval=None, max_queue=1)
        b = await Raw.connect(second, sock=small_socket(second.port), max_queue=1)
        try:
            await ws.send(pack("hello", role="client"))
            for c in range(8):
                await ws.send(signed("open", first.peer_id, conv=f"x{c}", layers=[0, 2], max_tokens=CONTEXT,
                                     next={"peer_id": second.peer_id, "addrs": list(second.addrs)}))
                await b.request("open", conv=f"x{c}", layers=[2, 4], max_tokens=CONTEXT, prev=first.peer_id)
            b.reader.cancel()  # b never reads its tokens either: the last hop's workers block on it
            with contextlib.suppress(asyncio.TimeoutError):
                for i in range(CONTEXT):
                    for c in range(8):
                        await asyncio.wait_for(ws.send(signed("step", first.peer_id, conv=f"x{c}", seq=i, start=i,
                                                              tokens=[i % VOCAB], want="token")), 2)
            t0 = time.perf_counter()
            await asyncio.wait_for(link.request("ping", timeout_s=5), 6)
            assert time.perf_counter() - t0 < 2
        finally:
            ws.transport.abort()
            b.ws.transport.abort()
        await assert_healthy(tiny, peers)


# --------------------------------------------------------------------------- seeded fuzzer
FUZZ_MESSAGES = 10_000  # frames the peer must have handled
FUZZ_FRAMES = 12_000  # frames generated: a batch cut short by a close loses its unanswered rest
FUZZ_CONNECTIONS = 4
FUZZ_BATCH = 8
ERROR_CODES = {"protocol_error", "version_mismatch", "invalid_input", "bad_positions", "context_overflow",
               "bad_layer_range", "cache_full", "peer_unavailable", "unauthenticated",
               "rate_limited"}  # get_tokenizer: at most 2 per connection
WEIRD = [None, True, False, 0, -1, 1, 7, 255, 1 << 31, (1 << 63) - 1, -(1 << 63), (1 << 64) - 1, 0.5, math.nan,
         math.inf, -math.inf, "", "f1", "token", "none", "f32", "x" * 5000, b"", b"\0" * 129, [], [0, 4], [4, 0],
         [0, 2, 4], [1] * 600, [[[[[]]]]], {}, {"a": 1}, {"peer_id": "p", "addrs": []}]


def fuzz_templates(digest: str, to: str) -> list[dict]:
    """Valid frames of every type a peer accepts (opens and steps signed for the peer ``to``),
    as maps to mutate."""
    ad = rogue_advert(digest, key=Ed25519PrivateKey.from_private_bytes(b"f" * 32), ttl_s=0.5)
    hidden = f32(torch.zeros(1, 2, WIDTH))
    return [{"t": "hello", "role": "client"}, {"t": "hello", "role": "peer", "advert": ad, "nonce": NONCE},
            {"t": "auth", "id": 10, "proof": bytes(64)},
            {"t": "ping", "id": 1}, {"t": "pong", "re": 1}, {"t": "get_peers", "id": 2},
            {"t": "get_tokenizer", "id": 3},
            *[{"t": t} | authorize(t, fields, to) for t, fields in [
                ("open", {"id": 4, "conv": "f1", "layers": [0, 4], "max_tokens": 8}),
                ("open", {"id": 5, "conv": "f2", "layers": [2, 4], "max_tokens": 8, "prev": ad["peer_id"]}),
                ("step", {"id": 6, "conv": "f1", "seq": 1, "start": 0, "tokens": [1, 2], "want": "token", "trace": []}),
                ("step", {"id": 7, "conv": "f2", "seq": 1, "start": 0, "hidden": hidden, "want": "token"}),
                ("step", {"id": 9, "conv": "f1", "seq": 2, "start": 0, "tokens": [1], "replay": True})]],
            {"t": "truncate", "id": 8, "conv": "f1", "length": 0}, {"t": "close", "conv": "f1"},
            {"t": "gossip", "adverts": [ad]}, {"t": "error", "code": "cache_full", "message": "m", "conv": "f1"}]


def mutate_value(rng: random.Random, value, depth: int = 0):
    """``value`` with one random change somewhere inside it."""
    if isinstance(value, dict) and value and depth < 4 and rng.random() < 0.5:
        key = rng.choice(list(value))
        return value | {key: mutate_value(rng, value[key], depth + 1)}
    if isinstance(value, list) and value and depth < 4 and rng.random() < 0.5:
        i = rng.randrange(len(value))
        return value[:i] + [mutate_value(rng, value[i], depth + 1)] + value[i + 1:]
    return rng.choice(WEIRD)


def fuzz_frame(rng: random.Random, templates: list[dict]) -> bytes | str:
    """One malformed frame: a valid one with fields deleted, swapped, added, or its bytes damaged."""
    msg = {"v": protocol.PROTOCOL_VERSION} | rng.choice(templates)
    kind = rng.randrange(9)
    if kind == 0:
        del msg[rng.choice(list(msg))]
    elif kind in (1, 2):
        msg = mutate_value(rng, msg)
    elif kind == 3:
        msg[rng.choice(["t", "x", "conv", "seq", "id", "re", "start", "tokens", "hidden"])] = rng.choice(WEIRD)
    elif kind == 4:
        msg["t"] = rng.choice(sorted(protocol.MESSAGE_TYPES) + ["", "HELLO", "step\0"])
    frame = msgpack.packb(msg, use_bin_type=True)
    if kind == 5:
        return frame[:rng.randrange(len(frame))]
    if kind == 6:
        damaged = bytearray(frame)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
        return bytes(damaged)
    if kind == 7:
        return rng.randbytes(rng.randrange(300))
    if kind == 8 and rng.random() < 0.2:
        return frame.decode("latin-1")  # a text frame
    return frame


async def fuzz_connection(peer, frames: list, stats: dict) -> None:
    """Send ``frames`` in batches without waiting for replies; reconnect whenever the peer closes.

    Each batch ends with a ping whose reply shows the peer handled the whole batch. In a batch
    cut short by a close, only the frames answered before the close are counted as handled.
    """
    i, barrier = 0, itertools.count(1_000_000)
    while i < len(frames):
        ws = await websockets.connect(peer.addrs[0], max_size=None, compression=None, ping_interval=None)
        if stats["connections"] % 8:  # most connections say hello first, so frames reach every handler
            await ws.send(pack("hello", role="client"))
        stats["connections"] += 1
        answered = 0
        try:
            while i < len(frames):
                batch = frames[i:i + FUZZ_BATCH]
                i += len(batch)
                for frame in batch:
                    await ws.send(frame)
                rid = next(barrier)
                await ws.send(pack("ping", id=rid))
                answered = 0
                while (msg := msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10))).get("re") != rid:
                    answered += 1
                    check_fuzz_reply(msg, stats)
                stats["handled"] += len(batch)
            await ws.close()
        except websockets.ConnectionClosed:
            stats["handled"] += answered
            if ws.close_code != 1000:
                stats["close_codes"].add(ws.close_code)


def check_fuzz_reply(msg: dict, stats: dict) -> None:
    stats["replies"] += 1
    if msg["t"] not in protocol.MESSAGE_TYPES or msg["t"] == "error" and (
            msg["code"] not in ERROR_CODES or msg["message"].startswith("internal error")):
        stats["bad_replies"].append(msg)


@pytest.mark.slow
async def test_seeded_fuzzer_leaves_the_peer_serving_at_baseline(tiny):
    rng = random.Random(1234)
    no_limits = ClientLimits(conversations=10_000, steps_per_s=1e6, bytes_per_s=1e12, frames_per_s=1e9)
    async with serving(tiny, client_limits=no_limits) as peers:  # robustness, not rate limits
        peer = peers[0]
        templates = fuzz_templates(peer.weights_hash, peer.peer_id)
        frames = [fuzz_frame(rng, templates) for _ in range(FUZZ_FRAMES)]
        stats = {"handled": 0, "replies": 0, "connections": 0, "bad_replies": [], "close_codes": set()}
        t0 = time.perf_counter()
        per = FUZZ_FRAMES // FUZZ_CONNECTIONS
        await asyncio.wait_for(asyncio.gather(*(fuzz_connection(peer, frames[k * per:(k + 1) * per], stats)
                                                for k in range(FUZZ_CONNECTIONS))), 120)
        elapsed = time.perf_counter() - t0
        assert stats["handled"] >= FUZZ_MESSAGES
        assert stats["bad_replies"] == []
        assert stats["close_codes"] <= {1008, 4002} and stats["connections"] > FUZZ_CONNECTIONS
        for ad in peer.table.adverts():
            peer.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)
        print(f"fuzz: {stats['handled']} frames handled over {stats['connections']} connections, "
              f"{stats['replies']} replies, "
              f"closes {sorted(stats['close_codes'])}, {elapsed:.1f} s")


async def test_per_client_limits_refuse_clearly_and_others_go_on(tiny):
    limits = ClientLimits(conversations=3, steps_per_s=5.0, bytes_per_s=1e9)
    async with serving(tiny, client_limits=limits) as peers:
        peer = peers[0]
        raws = [await Raw.connect(peer) for _ in range(2)]
        try:
            for i in range(4):  # 3 conversations from this host, over two connections
                await raws[i % 2].send("open", id=i + 1, conv=f"c{i}", layers=[0, 4], max_tokens=64)
            replies = [await raws[i % 2].recv() for i in range(4)]
            assert [r["t"] for r in replies] == ["opened", "opened", "opened", "error"]
            assert (replies[3]["code"], replies[3]["message"]) == (
                "rate_limited", "client 127.0.0.1 already holds 3 conversations on this peer")
            for k in range(12):  # bursts of 2 s at 5 steps/s: the 11th step in a row is refused
                await raws[0].send("step", conv="c0", seq=k + 1, start=k, tokens=[k % VOCAB], want="none")
            errors = [r for r in [await raws[0].recv(timeout_s=5) for _ in range(2)] if r["t"] == "error"]
            assert errors and errors[0]["code"] == "rate_limited"
            assert errors[0]["message"] == "client 127.0.0.1 sends more than 5 steps/s"
            other = await Raw.connect(peer, local_addr=("127.0.0.2", 0))  # another host is served
            reply = await other.request("open", conv="other", layers=[0, 4], max_tokens=8)
            assert reply["t"] == "opened"
            await other.close()
        finally:
            for raw in raws:
                await raw.close()
        await asyncio.sleep(2.5)  # the bucket refills: the limited host is served again
        await assert_healthy(tiny, peers)


async def test_one_host_cannot_reserve_more_than_its_share_of_the_kv_cache(tiny):
    """54 conversations of the whole context, no steps: the host gets half the capacity, and
    another host still opens conversations."""
    async with raw_conversation(tiny, kv_budget_bytes=1000 * (512 + STATEMENT_BYTES_PER_TOKEN)) as (peers, raw):  # 1,000 tokens; 500 for one host
        peer = peers[0]
        replies = [await raw.request("open", conv=f"c{i}", layers=[0, 4], max_tokens=200) for i in range(3)]
        assert [r["t"] for r in replies] == ["opened", "opened", "error"]
        assert (replies[2]["code"], replies[2]["message"]) == (
            "rate_limited", "client 127.0.0.1 holds 400 tokens of KV cache on this peer; 200 more would pass "
                            "its limit of 500 (50% of 1000)")
        other = await Raw.connect(peer, local_addr=("127.0.0.2", 0))
        assert (await other.request("open", conv="o", layers=[0, 4], max_tokens=200))["t"] == "opened"
        await other.close()


async def test_a_rollback_deeper_than_one_steps_drafts_is_refused(tiny):
    """Replaying a 64-token chunk with rollback: true made every victim wait; a rollback may
    only drop the rejected drafts of one step."""
    async with raw_conversation(tiny) as (peers, raw):
        await raw.request("open", conv="r", layers=[0, 4], max_tokens=200)
        await raw.send("step", conv="r", seq=1, start=0, tokens=list(range(1, 65)), want="none")
        assert await raw.error("step", conv="r", seq=2, start=0, tokens=list(range(1, 65)), want="token",
                               rollback=True) == (
            "bad_positions", "step 2 rolls back 64 positions; a rollback drops the rejected drafts of one step, "
                             "fewer than 32")
        await raw.send("step", conv="r", seq=3, start=40, tokens=[1], want="token", rollback=True)
        reply = await raw.recv(timeout_s=10)
        assert reply["t"] == "token" and reply["length"] == 41  # 24 positions back: drafts, allowed


async def test_queued_hidden_states_are_bounded_over_all_conversations(tiny, monkeypatch):
    """A previous hop that fills every conversation's queue gets rate_limited once the peer holds
    MAX_QUEUED_BYTES of queued steps, and the count returns to 0 when they are gone."""
    monkeypatch.setattr(peer_module, "MAX_QUEUED_BYTES", 3 * 8 * 8)  # three steps of 8 int64 token ids
    monkeypatch.setattr(peer_module, "QUEUED_BYTES_HOST_SHARE", 1.0)  # the pool itself (a host's share: below)
    async with serving(tiny) as peers:
        peer = peers[0]
        gate = threading.Event()
        peer.executor.submit(gate.wait, 30)  # the device is busy: steps stay queued
        raw = await Raw.connect(peer)
        try:
            await raw.request("open", conv="q", layers=[0, 4], max_tokens=200)
            await raw.send("step", conv="q", seq=1, start=0, tokens=list(range(1, 9)), want="none")
            await asyncio.sleep(0.2)  # the worker took step 1 and waits for the device
            for k in (2, 3, 4):
                await raw.send("step", conv="q", seq=k, start=8 * (k - 1), tokens=[1] * 8, want="none")
            code, message = await raw.error("step", conv="q", seq=5, start=32, tokens=[1] * 8, want="none")
            assert code == "rate_limited" and message.endswith("bytes of queued steps; 64 more would pass 192")
            assert peer._queued_bytes == 192
        finally:
            gate.set()
            await raw.close()
        await settle(peers)
        assert peer._queued_bytes == 0
        monkeypatch.undo()  # the usual limit for the health check's prompt
        await assert_healthy(tiny, peers)


async def test_one_host_holds_at_most_its_share_of_queued_steps_and_another_is_served(tiny, monkeypatch):
    """Found by an attack run: the queued-bytes pool was one for all hosts, so one host's queued
    steps (a client's, or a rogue previous hop's relayed ones: charged to the conversation's
    client host) got every other host's steps refused. One host now holds at most
    QUEUED_BYTES_HOST_SHARE of the pool; a client on another address is served meanwhile."""
    monkeypatch.setattr(peer_module, "MAX_QUEUED_BYTES", 4 * 8 * 8)  # four steps of 8 int64 token ids
    async with serving(tiny) as peers:
        peer = peers[0]
        gate = threading.Event()
        peer.executor.submit(gate.wait, 30)  # the device is busy: steps stay queued
        attacker = await Raw.connect(peer)
        victim = await Raw.connect(peer, local_addr=("127.0.0.2", 0))
        try:
            await attacker.request("open", conv="a", layers=[0, 4], max_tokens=200)
            await attacker.send("step", conv="a", seq=1, start=0, tokens=list(range(1, 9)), want="none")
            await asyncio.sleep(0.2)  # the worker took step 1 and waits for the device
            for k in (2, 3):
                await attacker.send("step", conv="a", seq=k, start=8 * (k - 1), tokens=[1] * 8, want="none")
            code, message = await attacker.error("step", conv="a", seq=4, start=24, tokens=[1] * 8, want="none")
            assert code == "rate_limited" and message == (
                "client 127.0.0.1 holds 128 bytes of queued steps on this peer; 64 more would pass its limit of "
                "128 (50% of 256)")
            assert peer.steps.queued_by_host == {"127.0.0.1": 128}
            await victim.request("open", conv="v", layers=[0, 4], max_tokens=200)
            await victim.send("step", conv="v", seq=1, start=0, tokens=list(range(1, 9)), want="none")
            await victim.send("step", conv="v", seq=2, start=8, tokens=[1] * 8, want="token")
            await asyncio.sleep(0.2)
            gate.set()
            reply = await victim.recv(timeout_s=10)
            assert reply["t"] == "token" and reply["length"] == 16, reply
        finally:
            gate.set()
            await attacker.close()
            await victim.close()
        await settle(peers)
        assert peer._queued_bytes == 0 and peer.steps.queued_by_host == {}


@pytest.mark.slow
@pytest.mark.parametrize("role", ["client", "peer"])
async def test_unread_client_of_relayed_errors_does_not_freeze_the_link_between_hops(tiny, monkeypatch, role):
    # The client opens conversations on the first hop only, so the second hop answers every step
    # with an error that the first hop relays to this client, which never reads. As "peer", it
    # says hello with a throwaway key it proves (the issue's second variant).
    monkeypatch.setattr(transport, "SEND_TIMEOUT_S", 5.0)
    limits = ClientLimits(conversations=64, steps_per_s=1e6, bytes_per_s=1e12, frames_per_s=1e9)
    async with serving(tiny, (0, 2, 4), client_limits=limits) as peers:
        first, second = peers
        link = first.links[second.peer_id]
        ws = await websockets.connect(first.addrs[0], sock=small_socket(first.port), compression=None,
                                      ping_interval=None, max_queue=1)
        convs = [f"{c:02d}" + "x" * 62 for c in range(16)]  # 64 characters: echoed in each error
        try:
            if role == "client":
                await ws.send(pack("hello", role="client"))
            else:
                key, raw = new_key(), Raw(ws, first.peer_id)
                welcome = await raw.request("hello", role="peer", nonce=NONCE, advert=rogue_advert(first.weights_hash, key=key))
                assert (await raw.request("auth", proof=key.sign(HELLO_LABEL + welcome["nonce"] + NONCE)))["t"] == "authed"
                raw.reader.cancel()  # from now on nobody reads this socket
            shrink_send_buffer(first, ws.local_address[1])
            for conv in convs:
                await ws.send(signed("open", first.peer_id, conv=conv, layers=[0, 2], max_tokens=CONTEXT,
                                     next={"peer_id": second.peer_id, "addrs": list(second.addrs)}))
            with contextlib.suppress(asyncio.TimeoutError, websockets.ConnectionClosed):  # stalled or cut off
                for i in range(CONTEXT):
                    for conv in convs:
                        await asyncio.wait_for(ws.send(signed("step", first.peer_id, conv=conv, seq=i, start=i,
                                                              tokens=[i % VOCAB], want="token")), 2)
            t0 = time.perf_counter()
            await asyncio.wait_for(link.request("ping", timeout_s=5), 6)
            assert time.perf_counter() - t0 < 2
            t0 = time.perf_counter()
            await converse(tiny, peers)
            assert time.perf_counter() - t0 < 10
            port = ws.local_address[1]
            async with asyncio.timeout(4 * transport.SEND_TIMEOUT_S):  # the slow reader is cut off
                while any(lk.ws.remote_address[1] == port for lk in first._all_links):
                    await asyncio.sleep(0.05)
        finally:
            ws.transport.abort()
        await assert_healthy(tiny, peers)


# --------------------------------------------------------------------------- adverts as weapons
@contextlib.asynccontextmanager
async def counting_service():
    """A loopback TCP service that answers every connection with an HTTP 404, as a service an
    attacker points the mesh at would; yields (its ws:// base URL, the list of connections made)."""
    hits: list[float] = []

    async def answer(reader, writer) -> None:
        hits.append(time.monotonic())
        writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    try:
        yield f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}", hits
    finally:
        server.close()
        await server.wait_closed()


async def test_gossiped_addresses_are_dialed_at_a_bounded_rate(tiny):
    async with serving(tiny) as peers, counting_service() as (url, hits):
        peer = peers[0]
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(peer.weights_hash))
        try:
            t0 = time.monotonic()
            await raw.send("gossip", adverts=[rogue_advert(peer.weights_hash, key=new_key(), ttl_s=60.0,
                                                           addrs=[f"{url}/admin/delete?id={i}"]) for i in range(100)])
            await raw.request("ping")
            await asyncio.sleep(2.0)  # 20 gossip rounds of 0.1 s, each of which used to dial all 100
            elapsed = time.monotonic() - t0
            assert 0 < len(hits) <= peer_module.MAX_DIALS_PER_S * (2 + elapsed)  # a burst of 2 s, then the rate
        finally:
            await raw.close()
        for ad in peer.table.adverts():
            peer.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)


async def test_next_hop_addresses_of_an_open_are_dialed_once_per_backoff(tiny, monkeypatch):
    monkeypatch.setattr(peer_module, "DIAL_BACKOFF_S", 60.0)  # longer than the test: no second dial
    async with serving(tiny, (0, 2, 4)) as peers, counting_service() as (url, hits):
        first = peers[0]
        fake = peer_id_of(new_key())
        raw = await Raw.connect(first)
        try:
            addrs = [f"{url}/admin/delete?id={i}" for i in range(4)]
            assert (await raw.request("open", conv="ssrf", layers=[0, 2], max_tokens=16,
                                      next={"peer_id": fake, "addrs": addrs}))["t"] == "opened"
            for i in range(3):
                await raw.send("step", conv="ssrf", seq=i, start=i, tokens=[i], want="token")
            errors = [await raw.recv(timeout_s=10) for _ in range(3)]
            assert [(e["t"], e["code"], e["seq"]) for e in errors] == [("error", "peer_unavailable", i) for i in range(3)]
            assert errors[0]["message"].startswith(f"cannot reach peer {fake[:12]}: cannot reach {url}/admin/delete?id=")
            for e in errors[1:]:
                assert re.fullmatch(rf"peer {fake[:12]} failed 1 dial\(s\) in a row; next try in \d+\.\d s",
                                    e["message"]), e["message"]
            assert len(hits) == 4
        finally:
            await raw.close()
        await assert_healthy(tiny, peers)


@pytest.mark.parametrize("url, scope", [
    ("ws://127.0.0.1:1", "loopback"), ("wss://localhost.", "loopback"), ("wss://a.localhost", "loopback"),
    ("ws://[::1]:1", "loopback"), ("ws://[::ffff:127.0.0.1]:1", "loopback"),
    # found by an attack run: spellings the resolver reads as loopback, and the unspecified address
    ("wss://127.1", "loopback"), ("wss://2130706433", "loopback"), ("wss://0x7f000001", "loopback"),
    ("wss://017700000001", "loopback"), ("wss://0", "loopback"), ("ws://0.0.0.0:1", "loopback"),
    ("ws://[::]:1", "loopback"), ("ws://[::ffff:0.0.0.0]:1", "loopback"),
    ("ws://10.1.2.3", "private"), ("ws://[fd00::1]:1", "private"), ("ws://169.254.169.254/x", "link-local"),
    ("ws://100.64.0.1", "private"), ("ws://vm:80", "private"), ("wss://printer.local", "private"),
    ("wss://8.8.8.8", "public"), ("ws://[2001:4860::8888]:1", "public"), ("wss://example.com", "name"),
])
def test_address_scopes(url, scope):
    assert address_scope(url) == scope


async def test_a_client_on_the_internet_dials_no_loopback_address_from_an_advert():
    """The attack run noted that `serve` and `chat` dialed any address an advert listed. A client
    dials a loopback or private address only when one of its --peers addresses is in that scope."""
    from types import SimpleNamespace

    from meshinfer.client.mesh import MeshClient

    async with counting_service() as (url, hits):
        fake = SimpleNamespace(peer_id=peer_id_of(new_key()), relays=(), addrs=(f"{url}/admin", "wss://127.1/x"))
        client = MeshClient(["wss://peer.example.com:7700"])
        with pytest.raises(PeerUnavailable, match="not dialed; a loopback address, and no --peers address"):
            await client.link(fake)
        assert hits == []
        local = MeshClient([f"{url}/bootstrap"])  # a client of a local mesh still dials them
        with pytest.raises(PeerUnavailable, match="HTTP 404|404"):
            await local.link(SimpleNamespace(peer_id=fake.peer_id, relays=(), addrs=(f"{url}/admin",)))
        assert len(hits) == 1


def resolving(monkeypatch, names: dict[str, object]) -> None:
    """Make the system resolver answer each of ``names`` (host -> an IP address, a list of them,
    or a ``threading.Event`` to block on until set, then fail), as a DNS server an attacker
    controls would (rebinding: a public-looking name that points home; a server that never
    answers)."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        answer = names.get(host)
        if answer is None:
            return real(host, port, *args, **kwargs)
        if isinstance(answer, threading.Event):
            answer.wait(30)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port or 0))
                for a in ([answer] if isinstance(answer, str) else answer)]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


async def test_a_name_that_resolves_to_loopback_is_no_way_around_the_scopes(tiny, monkeypatch):
    """The scopes checked the name as written, so a DNS name of an attacker's that resolves to
    127.0.0.1 (or an /etc/hosts entry with a dot) reached services on the peer's own machine. A
    learnt name is now resolved first and dialed at an address that was checked; what it resolved
    to stays out of the error (which reaches whoever named the address: an oracle of internal DNS)."""
    from types import SimpleNamespace

    from meshinfer.client.mesh import MeshClient

    async with serving(tiny) as peers, counting_service() as (url, hits):
        port = url.rsplit(":", 1)[1]
        resolving(monkeypatch, {"home.attacker.example": "127.0.0.1", "lan.attacker.example": "10.0.0.7",
                                "v6.attacker.example": "::1", "nat64.attacker.example": "64:ff9b::7f00:1",
                                "both.attacker.example": ["10.0.0.7", "127.0.0.1"]})
        peer, fake = peers[0], peer_id_of(new_key())
        real, peer.addrs = peer.addrs, ("wss://peer.example.com:7700",)  # as if it listened on the Internet
        try:
            for name in ("home", "lan", "v6", "nat64", "both"):
                with pytest.raises(PeerUnavailable, match=f"{name}.attacker.example resolves to no address") as info:
                    await peer.conns.dial_one(f"wss://{name}.attacker.example:{port}/admin", fake)
                assert "127.0.0.1" not in str(info.value) and "10.0.0.7" not in str(info.value)
        finally:
            peer.addrs = real
        advert = SimpleNamespace(peer_id=fake, relays=(), addrs=(f"ws://home.attacker.example:{port}/admin",))
        with pytest.raises(PeerUnavailable, match="resolves to no address this node dials"):
            await MeshClient(["wss://peer.example.com:7700"], insecure=True).link(advert)
        assert hits == []
        with pytest.raises(PeerUnavailable, match="404"):  # a client of a local mesh dials it, at the address checked
            await MeshClient(peer.addrs, insecure=True).link(advert)
        assert len(hits) == 1


async def test_a_learnt_name_is_dialed_at_each_of_its_addresses_in_turn(tiny, monkeypatch):
    """Found by an attack run: only the first address of a name was tried, so a dual-stack name
    whose IPv6 address refuses (a peer bound to 0.0.0.0) could no longer be reached."""
    async with serving(tiny, (0, 2, 4)) as peers:
        port = peers[1].addrs[0].rsplit(":", 1)[1]
        resolving(monkeypatch, {"dual.example.com": ["::1", "127.0.0.1"]})
        monkeypatch.setattr(peers[0].settings, "insecure", True)
        link = await peers[0].conns.dial_one(f"ws://dual.example.com:{port}", peers[1].peer_id)
        assert link.remote_id == peers[1].peer_id


async def test_names_whose_resolution_hangs_do_not_hold_up_dials_of_addresses(tiny, monkeypatch):
    """Found by an attack run: every learnt address went through the event loop's default
    executor to be resolved, IP literals too, so 8 names whose DNS never answers (one gossip
    round) took all its threads and an honest peer's ``ws://127.0.0.1`` dial timed out. Names are
    resolved on a small pool of their own, addresses not at all; a hanging name costs its dial
    timeout and no more."""
    from meshinfer.wire.transport import dial

    stuck = threading.Event()
    async with serving(tiny, (0, 2, 4)) as peers:
        resolving(monkeypatch, {f"hang{i}.attacker.example": stuck for i in range(8)})
        from meshinfer.wire import transport
        try:
            same = [asyncio.ensure_future(dial("ws://hang0.attacker.example:80", max_bytes=1 << 20, on_message=None,
                                               open_timeout_s=1.0, insecure=True, scopes={"public", "name"}))
                    for _ in range(20)]
            await asyncio.sleep(0.1)
            assert len(transport._lookups) == 1  # one thread for a name, however many dials wait on it
            await asyncio.gather(*same, return_exceptions=True)
            hanging = [asyncio.ensure_future(dial(f"ws://hang{i}.attacker.example:80", max_bytes=1 << 20,
                                                  on_message=None, open_timeout_s=1.0, insecure=True,
                                                  scopes={"public", "name"})) for i in range(8)]
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            honest = await dial(peers[1].addrs[0], max_bytes=1 << 20, on_message=None, open_timeout_s=1.0,
                                scopes={"public", "name", "loopback"})
            assert time.monotonic() - t0 < 0.9
            await honest.close()
            t0 = time.monotonic()
            results = await asyncio.gather(*hanging, return_exceptions=True)
            assert all(isinstance(r, PeerUnavailable) for r in results), results
            assert time.monotonic() - t0 < 1.5
            fine = await asyncio.wait_for(asyncio.to_thread(lambda: 42), 1.0)  # the default executor is free
            assert fine == 42
        finally:
            stuck.set()


async def test_a_dial_that_gives_up_leaves_a_shared_lookup_to_the_others(monkeypatch):
    """An attack run: two dials waiting on one lookup of a name, the lookup queued behind names
    that hang; the first dial's timeout cancelled the lookup, and the second raised
    CancelledError, which killed a hop's conversation worker and a client's plan."""
    from meshinfer.wire import transport

    stuck = threading.Event()
    resolving(monkeypatch, {**{f"hang{i}.attacker.example": stuck for i in range(transport.RESOLVER_THREADS)},
                            "shared.example.com": stuck})
    try:
        hanging = [asyncio.ensure_future(transport.dial_targets(f"ws://hang{i}.attacker.example:80", {"public"}))
                   for i in range(transport.RESOLVER_THREADS)]
        await asyncio.sleep(0.1)  # every resolver thread now waits on a hanging name
        impatient = asyncio.ensure_future(asyncio.wait_for(
            transport.dial_targets("ws://shared.example.com:80", {"public"}), 0.2))
        patient = asyncio.ensure_future(transport.dial_targets("ws://SHARED.example.com.:81", {"public"}))
        await asyncio.sleep(0.1)
        assert len(transport._lookups) == transport.RESOLVER_THREADS + 1  # one lookup for both spellings and ports
        with pytest.raises(asyncio.TimeoutError):
            await impatient
        assert not patient.done()
        stuck.set()
        with pytest.raises(PeerUnavailable, match="resolves to no address"):
            await patient
        await asyncio.gather(*hanging, return_exceptions=True)
    finally:
        stuck.set()


async def test_a_deaf_peer_costs_a_dial_one_dial_timeout_and_a_short_close():
    """An attack run: a peer that completes the upgrade and then reads nothing made a failed
    hello cost the dial timeout plus websockets' 10 s close timeout, on every plan."""
    from types import SimpleNamespace

    from meshinfer.client.mesh import MeshClient
    from meshinfer.wire.transport import DIAL_CLOSE_TIMEOUT_S

    done = asyncio.Event()

    async def deaf(ws) -> None:
        ws.transport.pause_reading()
        await done.wait()
        ws.transport.abort()

    async with websockets.serve(deaf, "127.0.0.1", 0) as server:
        url = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        advert = SimpleNamespace(peer_id=peer_id_of(new_key()), relays=(), addrs=(url,))
        client = MeshClient([url], dial_timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable):
            await client.link(advert)
        assert time.monotonic() - t0 < 1.0 + DIAL_CLOSE_TIMEOUT_S + 1.0
        await client.close()
        done.set()


async def test_a_peer_whose_dns_is_down_at_start_gets_its_scope_when_it_comes_back(tiny, monkeypatch):
    """An attack run: a peer's own names were resolved once, at start; a DNS down then left a LAN
    peer named by DNS without private scope for good."""
    from meshinfer.peer import limits

    monkeypatch.setattr(limits, "OWN_NAMES_EVERY_S", 0.1)
    down = threading.Event()  # set: the lookup fails at once
    down.set()
    names = {"me.corp.example": down}
    resolving(monkeypatch, names)
    async with serving(tiny) as peers:
        peer = peers[0]
        real, peer.addrs = peer.addrs, ("ws://me.corp.example:7700",)
        task = asyncio.ensure_future(peer.conns.keep_own_names_resolved())
        try:
            await asyncio.sleep(0.3)
            assert "private" not in peer.conns.learnt_scopes
            names["me.corp.example"] = "10.0.0.2"  # the DNS is back
            await asyncio.sleep(0.5)
            assert "private" in peer.conns.learnt_scopes
        finally:
            task.cancel()
            peer.addrs = real
            peer.conns.own_name_scopes = set()


def test_a_fallback_answer_adds_to_the_table_and_cannot_empty_it():
    """An attack run: with the bootstrap down, one fake known peer answering `get_peers` with
    nothing emptied the client's table, and every later plan failed."""
    import dataclasses

    from meshinfer.client.mesh import MeshClient
    from meshinfer.wire.protocol import PeerAdvert

    a, b = (PeerAdvert.from_wire(rogue_advert("00" * 32, key=new_key())) for _ in range(2))
    client = MeshClient(["ws://127.0.0.1:1"])
    client._prune_links = lambda: asyncio.sleep(0)
    old = {a.peer_id: a, b.peer_id: b}
    asyncio.run(client._adopt([], keep=old))
    assert set(client.table) == {a.peer_id, b.peer_id}
    newer, older = dataclasses.replace(b, seq=b.seq + 1), dataclasses.replace(b, seq=b.seq - 1)
    asyncio.run(client._adopt([newer], keep=old))
    assert client.table[b.peer_id] is newer
    asyncio.run(client._adopt([older], keep=old))
    assert client.table[b.peer_id] is b


async def test_a_node_named_by_dns_on_a_lan_dials_the_names_it_learns_there(tiny, monkeypatch):
    """Names count by what they resolve to, so a mesh whose members are named by DNS on a LAN or a
    VPN (names resolving to 10/8 or 100.64/10) would refuse each other's names. A node's own
    names are resolved too: one that resolves to private addresses only gives private scope."""
    from types import SimpleNamespace

    from meshinfer.client.mesh import MeshClient

    async with serving(tiny) as peers, counting_service() as (url, hits):
        port = url.rsplit(":", 1)[1]
        resolving(monkeypatch, {"me.corp.example": "10.0.0.2", "other.corp.example": "127.0.0.1"})
        peer, fake = peers[0], peer_id_of(new_key())
        real, peer.addrs = peer.addrs, ("ws://me.corp.example:7700",)
        try:
            await peer.conns.resolve_own_names()
            assert peer.conns.learnt_scopes == {"public", "name", "private"}
        finally:
            peer.addrs = real
            peer.conns.own_name_scopes = set()
        advert = SimpleNamespace(peer_id=fake, relays=(), addrs=(f"ws://other.corp.example:{port}/admin",))
        with pytest.raises(PeerUnavailable, match="resolves to no address this node dials"):
            await MeshClient(["ws://me.corp.example:7700"], insecure=True).link(advert)
        assert hits == []
        with pytest.raises(PeerUnavailable, match="resolves to no address this node dials"):
            await MeshClient([f"ws://other.corp.example:{port}"], insecure=True).link(advert)  # names give no loopback
        assert hits == []


async def test_own_names_never_open_loopback_or_link_local_and_private_only_when_wholly_private(tiny, monkeypatch):
    """An attack run: own names gave the scopes of every address they resolved to, so a --peers
    name with one loopback address among public ones (or 169.254.169.254, the cloud metadata
    service), or a machine's own name at Debian's 127.0.1.1, opened the node's own services to
    gossiped adverts. A name gives private scope only when all its addresses are private, and
    never loopback or link-local; a learnt link-local address is dialed by nobody without one."""
    from types import SimpleNamespace

    from meshinfer.client.mesh import MeshClient
    from meshinfer.wire.transport import name_scopes

    resolving(monkeypatch, {"boot.example.com": ["93.184.215.14", "127.0.0.1"], "meta.example.com":
                            ["93.184.215.14", "169.254.169.254"], "node1.example.com": "127.0.1.1",
                            "vm": "127.0.0.1", "lan.corp.example": ["10.0.0.5", "10.0.0.6"],
                            "mixed.corp.example": ["10.0.0.5", "93.184.215.14"]})
    for name in ("boot.example.com", "meta.example.com", "node1.example.com", "vm", "mixed.corp.example"):
        assert await name_scopes([f"wss://{name}:7700"]) == set(), name
    assert await name_scopes(["wss://lan.corp.example:7700", "ws://x.example.com:1/#bad"]) == {"private"}
    assert address_scope("ws://169.254.169.254/latest/meta-data/") == "link-local"
    async with serving(tiny) as peers, counting_service() as (url, hits):
        port = url.rsplit(":", 1)[1]
        here = SimpleNamespace(peer_id=peer_id_of(new_key()), relays=(), addrs=(f"ws://127.0.0.1:{port}/admin",))
        with pytest.raises(PeerUnavailable, match="not dialed; a loopback address"):
            await MeshClient(["wss://boot.example.com:7700"], insecure=True).link(here)
        with pytest.raises(PeerUnavailable, match="not dialed; a loopback address"):
            await MeshClient([f"ws://vm:{port}"], insecure=True).link(here)  # use 127.0.0.1 or localhost
        assert hits == []
        peer = peers[0]
        real, peer.addrs = peer.addrs, ("wss://10.0.0.9:7700",)  # a peer on a private network
        try:
            assert "private" in peer.conns.learnt_scopes and "link-local" not in peer.conns.learnt_scopes
            with pytest.raises(PeerUnavailable, match="a link-local address learnt from another peer"):
                await peer.conns.dial_one("ws://169.254.169.254/latest/meta-data/", peer_id_of(new_key()))
        finally:
            peer.addrs = real


async def test_a_dial_tries_few_addresses_and_stops_at_the_first_server_that_answers(tiny, monkeypatch):
    """An attack run: a name of 100 addresses made one dial 100 upgrade requests (gossip of 8
    adverts: 2,540 in 3 s), and the errors listed what each address answered. A dial tries at
    most MAX_ADDRESSES_PER_DIAL addresses, goes on only past addresses where nothing listens,
    and an error of a learnt name names no address."""
    from meshinfer.wire import transport

    async with serving(tiny) as peers, counting_service() as (url, hits):
        port = url.rsplit(":", 1)[1]
        resolving(monkeypatch, {"many.example.com": [f"127.0.0.{i}" for i in range(1, 101)]})
        peer = peers[0]
        monkeypatch.setattr(peer.settings, "insecure", True)
        with pytest.raises(PeerUnavailable, match="404") as info:
            await peer.conns.dial_one(f"ws://many.example.com:{port}/admin", peer_id_of(new_key()))
        assert len(hits) == 1 and "127.0.0" not in str(info.value)
        down = socket.socket()
        down.bind(("127.0.0.1", 0))
        closed = down.getsockname()[1]
        down.close()
        with pytest.raises(PeerUnavailable) as info:
            await peer.conns.dial_one(f"ws://many.example.com:{closed}/admin", peer_id_of(new_key()))
        assert str(info.value).count("Connection refused") == transport.MAX_ADDRESSES_PER_DIAL, info.value
        assert "127.0.0" not in str(info.value)


async def test_a_client_whose_bootstrap_is_down_asks_known_peers_within_its_scopes_at_once():
    """Found by an attack run: when no --peers address answered, `refresh` fell back to every
    address of every advert it held, with no scope check and one after the other, so adverts
    sent `GET /api/v1/shutdown` with the attacker's credentials to a service on the client's
    machine (200 requests a refresh from 50 adverts), and 12 silent addresses cost 12 dial
    timeouts. Known peers are now asked as `link` dials them, up to FALLBACK_PEERS at once,
    within twice the dial timeout."""
    from types import SimpleNamespace

    from meshinfer.client.mesh import FALLBACK_PEERS, MeshClient

    async with counting_service() as (url, hits):
        client = MeshClient(["wss://peer.example.invalid:7700"], dial_timeout_s=1.0)
        fakes = [SimpleNamespace(peer_id=peer_id_of(new_key()), relays=(),
                                 addrs=(f"ws://admin:admin@127.0.0.1:{url.rsplit(':', 1)[1]}/api/v1/shutdown?i={i}",))
                 for i in range(3)]
        client.table = {f.peer_id: f for f in fakes}
        with pytest.raises(PeerUnavailable, match="not dialed; a loopback address"):
            await client.refresh()
        assert hits == []
    with silent_addresses(2 * FALLBACK_PEERS) as addrs:
        down = socket.socket()
        down.bind(("127.0.0.1", 0))
        bootstrap = f"ws://127.0.0.1:{down.getsockname()[1]}"
        down.close()  # nothing listens there: the bootstrap is down
        client = MeshClient([bootstrap], dial_timeout_s=1.0)
        client.table = {f.peer_id: f for f in (SimpleNamespace(peer_id=peer_id_of(new_key()), relays=(), addrs=(a,))
                                               for a in addrs)}
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="no bootstrap peer answered"):
            await client.refresh()
        assert time.monotonic() - t0 < 3.0  # one dial timeout, not 8 or 16
        # peers that did not answer are backed off, so the next refresh asks others (an attack
        # run kept 8 fakes nearest and the honest peers behind them were never asked)
        assert len(client.backed_off()) == FALLBACK_PEERS
        with pytest.raises(PeerUnavailable, match="no bootstrap peer answered"):
            await client.refresh()
        assert len(client.backed_off()) == 2 * FALLBACK_PEERS
        await client.close()


async def test_a_redirect_to_another_host_or_port_is_not_followed():
    """websockets follows up to 10 redirects of the upgrade, to any host: a peer address (public,
    so allowed) answering ``302 Location: ws://127.0.0.1:PORT/admin`` sent the node to a service
    on its own machine whatever the scopes said."""
    from meshinfer.client.mesh import MeshClient

    async with counting_service() as (victim, hits):
        async def redirect(reader, writer) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(f"HTTP/1.1 302 Found\r\nLocation: {victim}/admin/delete?id=1\r\n"
                         f"Content-Length: 0\r\n\r\n".encode())
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(redirect, "127.0.0.1", 0)
        try:
            here = f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            with pytest.raises(PeerUnavailable, match="redirect"):
                await MeshClient([here]).refresh()
            assert hits == []
        finally:
            server.close()
            await server.wait_closed()


def test_a_peer_bound_to_every_interface_takes_no_scope_from_its_stand_in_address():
    """Found by an attack run: a peer listening on 0.0.0.0 without --public-addr advertises
    ws://127.0.0.1:PORT as a stand-in, which gave a peer on the Internet loopback scope."""
    from types import SimpleNamespace

    from meshinfer.peer.connections import Connections

    def scopes(host, public=(), bootstrap=()):
        settings = SimpleNamespace(host=host, public_addrs=public, bootstrap=bootstrap)
        return Connections(SimpleNamespace(addrs=("ws://127.0.0.1:7700",), settings=settings)).learnt_scopes

    assert scopes("0.0.0.0") == {"public", "name"}
    assert scopes("127.0.0.1") == {"public", "name", "loopback"}
    assert scopes("0.0.0.0", bootstrap=("ws://10.0.0.2:7700",)) == {"public", "name", "private"}


async def test_a_peer_on_the_internet_dials_no_loopback_or_private_address_learnt_from_others(tiny):
    """The attack run's SSRF was only rate-limited: `open.next` and gossip could still point a
    peer at any service on its own machine or network. A peer whose own addresses (advertised,
    bootstrap) are public dials no loopback or private address learnt from others; the service
    sees no request. (On loopback, as in the test above, loopback addresses stay dialable.)"""
    async with serving(tiny, (0, 2, 4)) as peers, counting_service() as (url, hits):
        peer = peers[0]
        fake = peer_id_of(new_key())
        raw = await Raw.connect(peer)
        real, peer.addrs = peer.addrs, ("wss://peer.example.com:7700",)  # as if it listened on the Internet
        try:
            targets = [f"{url}/admin/delete?id=0", "ws://10.0.0.7:8080/x", "ws://[::ffff:127.0.0.1]:8080/y"]
            reply = await raw.request("open", conv="ssrf", layers=[0, 2], max_tokens=16,
                                      next={"peer_id": fake, "addrs": targets})
            assert reply["t"] == "opened", reply
            assert peer.conns.learnt_scopes == {"public", "name"}
            await raw.send("step", conv="ssrf", seq=0, start=0, tokens=[1], want="token")
            error = await raw.recv(timeout_s=10)
            assert error["code"] == "peer_unavailable" and "learnt from another peer" in error["message"], error
            with pytest.raises(Exception, match="a loopback address learnt from another peer, and this peer has no"):
                await peer.conns.dial_one(targets[0], fake)
            with pytest.raises(Exception, match="a private address learnt from another peer"):
                await peer.conns.dial_one(targets[1], fake)
            with pytest.raises(Exception, match="a loopback address"):
                await peer.conns.dial_one(targets[2], fake)
            assert hits == []
        finally:
            peer.addrs = real
            await raw.close()


@contextlib.contextmanager
def silent_addresses(n: int):
    """``n`` ws:// URLs of one loopback listener that accepts TCP and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        yield [f"ws://127.0.0.1:{silent.getsockname()[1]}/{i}" for i in range(n)]
    finally:
        silent.close()


async def test_a_peer_of_silent_addresses_costs_planning_one_dial_timeout(tiny):
    from meshinfer.client.mesh import MeshClient

    dial_timeout_s = 3.0
    with silent_addresses(4) as addrs:
        async with serving(tiny) as peers:
            peer = peers[0]
            raw = await plant(peer, [rogue_advert(peer.weights_hash, key=new_key(), addrs=addrs, ttl_s=60.0,
                                                  layers=[0, 4])])
            try:
                async with MeshClient(peer.addrs, dial_timeout_s=dial_timeout_s) as client:
                    t0 = time.perf_counter()
                    route = await client.plan()
                    assert time.perf_counter() - t0 < 3 * dial_timeout_s  # one after the other: 4 timeouts or more
                    assert route.peer_ids == (peer.peer_id,)
            finally:
                await raw.close()
            for ad in peer.table.adverts():
                peer.table.remove(ad.peer_id)
            await assert_healthy(tiny, peers)


async def test_listing_models_never_waits_for_a_route_being_planned(tiny):
    from meshinfer.app.api import MeshModels
    from meshinfer.client.mesh import MeshClient

    with silent_addresses(1) as addrs:
        async with serving(tiny) as peers:
            peer = peers[0]
            raw = await plant(peer, [rogue_advert(peer.weights_hash, key=new_key(), addrs=addrs, ttl_s=60.0,
                                                  layers=[0, 4])])
            try:
                async with MeshClient(peer.addrs, dial_timeout_s=30.0, request_timeout_s=30.0) as client:
                    models = MeshModels(client, route_ttl_s=0.0)
                    planning = asyncio.get_running_loop().create_task(models.route(peer.weights_hash))
                    try:
                        listed = await asyncio.wait_for(models.models(), 10.0)  # the plan waits 30 s on a dial
                        assert [m["meshinfer"]["weights_hash"] for m in listed] == [peer.weights_hash]
                        assert not planning.done()
                    finally:
                        planning.cancel()
                        await asyncio.gather(planning, return_exceptions=True)
            finally:
                await raw.close()
            for ad in peer.table.adverts():
                peer.table.remove(ad.peer_id)
            await assert_healthy(tiny, peers)


async def test_a_replayed_advert_of_a_restarted_peer_never_replaces_its_new_one(tiny):
    from helpers.meshkit import start_peer

    path, digest, tok, _ = tiny
    key = new_key()
    async with serving(tiny) as peers:
        peer = peers[0]
        before = await start_peer(load_shard(path, LayerRange(0, 4)), weights_hash=digest, key=key,
                                  bootstrap=peer.addrs)
        before._seq += 10_000  # it ran for a while: 10,000 adverts (5.5 hours of gossip every 2 s)
        old = before.advert().to_wire()  # what an attacker recorded before the restart
        await before.close()
        after = await start_peer(load_shard(path, LayerRange(0, 4)), weights_hash=digest, key=key,
                                 bootstrap=peer.addrs)
        try:
            async with asyncio.timeout(5.0):  # the restarted peer, on a new port, is listed
                while (ad := peer.table.get(after.peer_id)) is None or ad.addrs != after.addrs:
                    await asyncio.sleep(0.02)
            raw = await plant(peer, [old | {"ttl_s": 60.0}])
            await raw.close()
            assert peer.table.get(after.peer_id).addrs == after.addrs != tuple(old["addrs"])
        finally:
            await after.close()
        peer.table.remove(after.peer_id)
        await assert_healthy(tiny, peers)


async def test_a_full_table_takes_a_peer_that_proves_its_key(tiny, monkeypatch):
    unbounded_gossip(monkeypatch)
    from helpers.meshkit import start_peer

    path, digest, tok, _ = tiny
    async with serving(tiny) as peers:
        peer = peers[0]
        fakes = [rogue_advert(digest, key=new_key(), ttl_s=60.0) for i in range(300)]
        raw = await plant(peer, fakes[:150])
        try:
            await raw.send("gossip", adverts=fakes[150:])
            await raw.request("ping")
            assert len(peer.table) == peer_module.MAX_KNOWN_PEERS
            honest = await start_peer(load_shard(path, LayerRange(0, 4)), weights_hash=digest, bootstrap=peer.addrs)
            try:
                async with asyncio.timeout(5.0):  # it dialed and proved its key: it gets in
                    while peer.table.get(honest.peer_id) is None:
                        await asyncio.sleep(0.02)
                assert len(peer.table) == peer_module.MAX_KNOWN_PEERS
                await raw.send("gossip", adverts=[rogue_advert(digest, key=new_key(), ttl_s=60.0) for i in range(50)])
                await raw.request("ping")  # fresh fakes cannot push it out
                assert peer.table.get(honest.peer_id) is not None
            finally:
                await honest.close()
        finally:
            await raw.close()
        for ad in peer.table.adverts():
            peer.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)


async def test_identities_that_proved_their_keys_and_left_cannot_keep_a_newcomer_out(tiny):
    """Found by an attack run: a full table evicted only unproven records, so 256 fresh keys that
    each said hello as a peer, proved its key and hung up filled it for a minute (and again each
    minute), and an honest peer that joined meanwhile was never listed. A record with no link and
    no conversation is evictable once proven too; one with a link is not."""
    from helpers.meshkit import start_peer

    path, digest, tok, _ = tiny
    async with serving(tiny) as peers:
        peer = peers[0]
        for _ in range(peer_module.MAX_KNOWN_PEERS):
            key = new_key()
            raw = await Raw.connect(peer, role="peer", key=key, advert=rogue_advert(digest, key=key, ttl_s=60.0))
            await raw.close()  # the record stays, proven; its link is gone
        assert len(peer.table) == peer_module.MAX_KNOWN_PEERS
        held_key = new_key()  # a proven identity that keeps its link is never evicted for a newcomer
        held = await Raw.connect(peer, role="peer", key=held_key, advert=rogue_advert(digest, key=held_key, ttl_s=60.0))
        honest = await start_peer(load_shard(path, LayerRange(0, 4)), weights_hash=digest, bootstrap=peer.addrs)
        try:
            async with asyncio.timeout(5.0):
                while peer.table.get(honest.peer_id) is None:
                    await asyncio.sleep(0.02)
            assert len(peer.table) == peer_module.MAX_KNOWN_PEERS
            assert peer.table.get(peer_id_of(held_key)) is not None
        finally:
            await honest.close()
            await held.close()
        for ad in peer.table.adverts():
            peer.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)


# --------------------------------------------------------------------------- resources nobody counted
async def test_get_tokenizer_is_rate_limited_per_client_host_over_its_connections(tiny, monkeypatch):
    """An attack run took 170 bundles out of a hidden peer in 5 s by opening a fresh connection
    for every two. One client host gets TOKENIZER_HOST_BURST over all its connections, then one
    every TOKENIZER_HOST_EVERY_S; another host is served meanwhile."""
    monkeypatch.setattr(peer_module, "TOKENIZER_HOST_BURST", 3)
    monkeypatch.setattr(peer_module, "TOKENIZER_HOST_EVERY_S", 3600.0)
    async with serving(tiny) as peers:
        peer = peers[0]
        conns = [await Raw.connect(peer) for _ in range(2)]
        other = await Raw.connect(peer, local_addr=("127.0.0.2", 0))
        try:
            for raw in (conns[0], conns[0], conns[1]):  # 2 per connection, 3 for the host
                assert (await raw.request("get_tokenizer"))["t"] == "tokenizer"
            assert await conns[1].error("get_tokenizer") == (
                "rate_limited", "get_tokenizer: at most 3 from one client host, then one every 3600 s; "
                                "keep the bundle you have")
            assert (await other.request("get_tokenizer"))["t"] == "tokenizer"
        finally:
            for raw in (*conns, other):
                await raw.close()


async def test_get_tokenizer_is_rate_limited_per_connection(tiny):
    async with serving(tiny) as peers:
        peer = peers[0]
        raw, other = await Raw.connect(peer), await Raw.connect(peer)
        try:
            for _ in range(peer_module.TOKENIZER_BURST):
                assert (await raw.request("get_tokenizer"))["t"] == "tokenizer"
            assert await raw.error("get_tokenizer") == (
                "rate_limited", "get_tokenizer: at most 2 per connection, then one every 30 s; keep the bundle you have")
            assert (await other.request("get_tokenizer"))["t"] == "tokenizer"  # another connection is served
        finally:
            await raw.close()
            await other.close()
        await assert_healthy(tiny, peers)


async def test_an_idle_connection_that_holds_nothing_is_closed(tiny, monkeypatch):
    monkeypatch.setattr(peer_module, "IDLE_LINK_TIMEOUT_S", 1.0)
    async with serving(tiny) as peers:
        peer = peers[0]
        idle, holder = await Raw.connect(peer), await Raw.connect(peer)
        try:
            assert (await holder.request("open", conv="kept", layers=[0, 4], max_tokens=8))["t"] == "opened"
            assert await idle.closed_code(timeout_s=10.0) == 1000
            assert idle.ws.close_reason == "idle"
            await asyncio.sleep(2 * peer_module.IDLE_LINK_TIMEOUT_S)  # longer only makes this stricter
            assert not holder.reader.done() and conv_id("kept") in peer.convs  # it holds a conversation: kept open
        finally:
            await idle.close()
            await holder.close()
        await assert_healthy(tiny, peers)


# --------------------------------------------------------------------------- connections and gossip work per host
async def test_connections_from_one_host_are_capped_and_other_hosts_are_served(tiny):
    limits = ClientLimits(connections=4)
    async with serving(tiny, client_limits=limits) as peers:
        peer = peers[0]
        mine = [await Raw.connect(peer, local_addr=("127.0.0.2", 0)) for _ in range(4)]
        try:
            with pytest.raises(websockets.InvalidStatus) as refused:
                await Raw.connect(peer, local_addr=("127.0.0.2", 0))
            assert refused.value.response.status_code == 503
            assert refused.value.response.body.decode() == (
                "127.0.0.2 already holds 4 connections to this peer, the most one host may hold; close some and retry\n")
            assert (await mine[0].request("ping"))["t"] == "pong"  # the ones held are still served
            await converse(tiny, peers)  # and so is another host (127.0.0.1)
            await mine.pop().close()
            async with asyncio.timeout(10.0):  # a closed connection frees its place
                while peer._host_connections.get("127.0.0.2", 0) > 3:
                    await asyncio.sleep(0.02)
            mine.append(await Raw.connect(peer, local_addr=("127.0.0.2", 0)))
        finally:
            for raw in mine:
                await raw.close()
        async with asyncio.timeout(10.0):
            while "127.0.0.2" in peer._host_connections:
                await asyncio.sleep(0.02)
        await assert_healthy(tiny, peers)


def test_one_ipv6_slash_64_is_one_host_for_the_caps():
    """Per-host caps count an IPv6 client by its /64 (one subscriber or machine holds all of it),
    an IPv4-mapped address by its IPv4 address, and leave labels that are not addresses alone."""
    assert host_key("2001:db8:1:2:3:4:5:6") == host_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert host_key("2001:db8:1:3::1") == "2001:db8:1:3::/64"
    assert host_key("::ffff:10.0.0.7") == host_key("10.0.0.7") == "10.0.0.7"
    assert host_key("fe80::1%eth0") == "fe80::/64"
    assert host_key("127.0.0.1 via 0a1b2c3d4e5f") == "127.0.0.1 via 0a1b2c3d4e5f" and host_key("?") == "?"


class _Upgrade:
    """What ``Connections.admit`` reads of a websocket upgrade from ``addr``."""

    def __init__(self, addr: str) -> None:
        self.remote_address = (addr, 40000, 0, 0)
        self.connection_lost_waiter = asyncio.get_running_loop().create_future()

    def respond(self, status: int, body: str) -> tuple[int, str]:
        return status, body


async def test_connections_from_many_addresses_of_one_ipv6_slash_64_share_one_cap(tiny):
    async with serving(tiny, client_limits=ClientLimits(connections=2)) as peers:
        conns = peers[0].conns
        held = [_Upgrade("2001:db8:1:2::1"), _Upgrade("2001:db8:1:2::2")]
        assert [conns.admit(u, None) for u in held] == [None, None]
        assert conns.admit(_Upgrade("2001:db8:1:2:ffff::9"), None) == (
            503, "2001:db8:1:2::/64 already holds 2 connections to this peer, the most one host may hold; "
                 "close some and retry\n")
        other = _Upgrade("2001:db8:1:3::1")  # another /64 is another host
        assert conns.admit(other, None) is None
        for u in (*held, other):
            u.connection_lost_waiter.set_result(None)
        await asyncio.sleep(0)
        assert "2001:db8:1:2::/64" not in conns.host_connections and "2001:db8:1:3::/64" not in conns.host_connections


async def test_a_connection_that_never_finishes_its_upgrade_headers_is_dropped(tiny, monkeypatch):
    monkeypatch.setattr(peer_module, "HANDSHAKE_TIMEOUT_S", 1.0)
    async with serving(tiny) as peers:
        peer = peers[0]
        port = int(peer.addrs[0].rsplit(":", 1)[1])
        slow = []
        for _ in range(20):  # slowloris: a request line and one header, then silence
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append((reader, writer))
        try:
            await converse(tiny, peers)  # served meanwhile
            async with asyncio.timeout(30.0):  # 1 s each, however loaded the machine is
                for reader, _ in slow:
                    assert await reader.read() == b""  # closed without a response
        finally:
            for _, writer in slow:
                writer.close()
        await assert_healthy(tiny, peers)


def gossip_flood_frames(digest: str, n_frames: int, max_bytes: int, n_keys: int = 64) -> list[bytes]:
    """Gossip frames as large as ``max_bytes`` allows (about 1,024 adverts on the default model, 300
    on the tiny one): signed adverts of ``n_keys`` fake peers, over and over, each frame's newer than
    the last, so that every one needs a parse and a signature check unless the peer knows better."""
    keys = [new_key() for _ in range(n_keys)]
    per_frame = (max_bytes - 1024) // len(msgpack.packb(rogue_advert(digest, seq=1_000, ttl_s=60.0)))
    frames = []
    for i in range(n_frames):
        ads = [rogue_advert(digest, key=key, seq=1_000 + i, ttl_s=60.0) for key in keys]
        frames.append(pack("gossip", adverts=(ads * per_frame)[:per_frame]))
    return frames


async def timed_converse(tiny, peers) -> float:
    t0 = time.perf_counter()
    await converse(tiny, peers)
    return time.perf_counter() - t0


async def test_a_flood_of_large_gossip_frames_costs_a_bounded_share_of_the_peer(tiny, monkeypatch):
    checks = []  # signature checks of adverts, counted (the CPU a frame costs, whatever the machine's speed)
    monkeypatch.setattr(peer_module, "verify_advert", lambda ad: checks.append(ad) or verify_advert(ad))
    max_frame_bytes = MAX_STEP * WIDTH * 4 + peer_module.FRAME_OVERHEAD_BYTES
    frames = gossip_flood_frames(tiny[1], 40, max_frame_bytes)  # 8 s of it; made before peers run (a slow loop)
    async with serving(tiny, bounds=(0, 2, 4), advert_ttl_s=10.0) as peers:  # the default TTL: a slow round is no outage
        assert peers[0].max_frame_bytes == max_frame_bytes
        normal = min([await timed_converse(tiny, peers) for _ in range(3)])
        raws = [await plant(p, []) for p in peers]
        stop = asyncio.Event()

        async def flood(raw: Raw) -> int:
            sent = 0
            while not stop.is_set():  # 5 frames a second, each about 300 signed adverts
                await raw.ws.send(frames[sent % len(frames)])
                sent += 1
                await asyncio.sleep(0.2)
            return sent

        checks.clear()
        t0 = time.perf_counter()
        floods = [asyncio.get_running_loop().create_task(flood(raw)) for raw in raws]
        try:
            await asyncio.sleep(1.0)
            attacked = max([await timed_converse(tiny, peers) for _ in range(3)])
        finally:
            stop.set()
            sent = await asyncio.gather(*floods)
            for raw in raws:
                await raw.close()
        seconds = time.perf_counter() - t0
        print(f"normal {normal:.3f} s, under attack {attacked:.3f} s, {sum(sent)} frames, {len(checks)} checks")
        assert attacked < 10 * normal + 5.0  # it took a minute (or timed out) before
        budget = len(raws) * peer_module.GOSSIP_VERIFIES_PER_S * (seconds + 2)  # + the bursts
        assert len(checks) <= 2 * budget, (len(checks), budget)  # honest gossip is checked too; 300 a frame before
        for p in peers:
            for ad in p.table.adverts():
                if ad.peer_id not in {q.peer_id for q in peers}:
                    p.table.remove(ad.peer_id)
        await assert_healthy(tiny, peers)


@pytest.mark.parametrize("kind", ["frames", "bytes"])
async def test_a_flood_over_a_hosts_budget_is_dropped_before_it_is_decoded(tiny, monkeypatch, kind):
    """A flood of frames from one client host was decoded (msgpack, milliseconds per 100 KB)
    before the per-host limit could drop it. Now the host's frame and byte budgets are spent on a
    frame's size alone: past them the frames are dropped unread (``protocol.decode`` never sees
    them), the sender is told at most once a second, another host is served during the flood, and
    once the budget refills the same connection and an honest client are served again."""
    marker, decoded = b"FLOODMARK", []
    real_decode = protocol.decode

    def counting_decode(frame, **kw):
        if marker in bytes(frame):
            decoded.append(len(frame))
        return real_decode(frame, **kw)

    monkeypatch.setattr(protocol, "decode", counting_decode)
    if kind == "frames":  # 3,000 frames of 1 KB at 100 frames/s (bursts of 200)
        cl, n, pad, rate = ClientLimits(frames_per_s=100.0), 3000, marker * 100, 100.0
        told = "client 127.0.0.1 sends more than 100 frames/s; frames over it are dropped unread"
    else:  # 200 frames of 100 KB at 1 MiB/s (bursts of 2 MiB)
        cl, n, pad, rate = ClientLimits(bytes_per_s=float(2 ** 20)), 200, marker * 10_000, float(2 ** 20)
        told = "client 127.0.0.1 sends more than 1048576 bytes/s; frames over it are dropped unread"
    async with serving(tiny, client_limits=cl) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer)
        link = next(lk for lk in peer._all_links if lk.role == "client")
        try:
            t0 = time.monotonic()
            for _ in range(n):
                await raw.send("ping", pad=pad)
            other = await Raw.connect(peer, local_addr=("127.0.0.2", 0))  # another host: its own budget
            assert (await other.request("ping"))["t"] == "pong"
            await other.close()
            async with asyncio.timeout(30):
                while len(decoded) + link.dropped_frames < n:
                    await asyncio.sleep(0.01)
            elapsed_s = time.monotonic() - t0
            spent = len(decoded) if kind == "frames" else sum(decoded)
            assert spent <= 2 * rate + rate * elapsed_s  # the burst, and what refilled during the flood
            assert link.dropped_frames == n - len(decoded) > 0
            await asyncio.sleep(2.5)  # the budget refills (bursts of 2 s), and the replies have arrived
            replies = []
            while not raw.inbox.empty():
                replies.append(raw.inbox.get_nowait())
            notices = [r for r in replies if r["t"] == "error"]
            assert notices and [(r["code"], r["message"], "re" in r) for r in notices] == [
                ("rate_limited", told, False)] * len(notices)
            assert len(notices) <= elapsed_s / peer_module.DROP_NOTICE_EVERY_S + 1
            assert (await raw.request("ping"))["t"] == "pong"  # the same connection is served again
        finally:
            await raw.close()
        await assert_healthy(tiny, peers)


def flood_decodes(monkeypatch) -> list[int]:
    """The sizes of the frames holding ``FLOODMARK`` that ``protocol.decode`` is asked to decode
    (filled as they are)."""
    decoded = []
    real_decode = protocol.decode

    def counting_decode(frame, **kw):
        if b"FLOODMARK" in bytes(frame):
            decoded.append(len(frame))
        return real_decode(frame, **kw)

    monkeypatch.setattr(protocol, "decode", counting_decode)
    return decoded


async def test_peer_links_have_byte_budgets_of_their_own(tiny, monkeypatch):
    """A connection that says it is a peer spends its own byte budget (``PEER_LINK_BYTES_PER_S``)
    before its frames are decoded: 100 KB frames past 1 MiB/s are dropped unread and the sender
    is told why. The budget is the link's own, not its host's: another peer identity on the same
    address (a peer behind the same NAT) is served in full during the flood, and the flooder
    again once its budget refills."""
    decoded = flood_decodes(monkeypatch)
    monkeypatch.setattr(peer_module, "PEER_LINK_BYTES_PER_S", float(1 << 20))
    neighbour_key = Ed25519PrivateKey.from_private_bytes(bytes([7] * 32))
    async with serving(tiny) as peers:
        peer = peers[0]
        flooder = await Raw.connect(peer, role="peer", advert=rogue_advert(tiny[1]))
        neighbour = await Raw.connect(peer, role="peer", advert=rogue_advert(tiny[1], key=neighbour_key),
                                      key=neighbour_key)
        try:
            t0 = time.monotonic()
            for i in range(100):
                await flooder.send("ping", pad="FLOODMARK" + "x" * 100_000)
                if i % 10 == 0:
                    await neighbour.send("ping", pad="FLOODMARK")
            links = {lk.remote_id: lk for lk in peer._all_links if lk.role == "peer"}
            flood_link, quiet_link = links[peer_id_of(ROGUE_KEY)], links[peer_id_of(neighbour_key)]
            async with asyncio.timeout(30):
                while len(decoded) + flood_link.dropped_frames < 110:
                    await asyncio.sleep(0.01)
            big = [n for n in decoded if n > 100_000]
            assert 0 < len(big) <= (2 + time.monotonic() - t0) * (1 << 20) / 100_000 + 1
            assert flood_link.dropped_frames == 100 - len(big) > 0
            assert len(decoded) - len(big) == 10 and quiet_link.dropped_frames == 0  # the neighbour: all read
            async with asyncio.timeout(5):
                while (notice := await flooder.recv()).get("code") != "rate_limited":
                    pass
            assert "bytes/s" in notice["message"]
            await asyncio.sleep(2.5)  # the budget refills
            assert (await flooder.request("ping"))["t"] == "pong"
        finally:
            await flooder.close()
            await neighbour.close()
        await assert_healthy(tiny, peers)


async def test_a_flood_on_a_peer_link_is_dropped_before_it_is_decoded(tiny, monkeypatch):
    """A connection that says it is a peer (keys are free) has no host budget, since a previous
    hop relays every client's steps; its own frame budget (``PEER_LINK_FRAMES_PER_S``) is still
    spent before decoding, and frames past it are dropped unread."""
    decoded = flood_decodes(monkeypatch)
    monkeypatch.setattr(peer_module, "PEER_LINK_FRAMES_PER_S", 50.0)
    async with serving(tiny) as peers:
        peer = peers[0]
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(tiny[1]))
        link = next(lk for lk in peer._all_links if lk.role == "peer" and lk.remote_id == peer_id_of(ROGUE_KEY))
        try:
            t0 = time.monotonic()
            for _ in range(1000):
                await raw.send("ping", pad="FLOODMARK")
            async with asyncio.timeout(30):
                while len(decoded) + link.dropped_frames < 1000:
                    await asyncio.sleep(0.01)
            assert len(decoded) <= 100 + 50 * (time.monotonic() - t0) and link.dropped_frames > 0
            await asyncio.sleep(2.5)
            assert (await raw.request("ping"))["t"] == "pong"
        finally:
            await raw.close()
        await assert_healthy(tiny, peers)


async def test_a_decode_step_queued_behind_other_work_does_not_inflate_the_advert(tiny):
    """A client that queues its decode steps behind other work on the peer's device thread (its
    own prefill, a verify; here a gate held 2 s) made the peer advertise that wait as its ms
    per token (0.2 of it per step, nearly all of it after ten), so routes avoided an honest peer
    for as long as no other decode step came. Only the step's own pass counts
    (``steps.COMPUTE_EWMA_WEIGHT``)."""
    async with raw_conversation(tiny) as (peers, raw):
        peer = peers[0]
        peer.compute_ms_per_token = 1.0
        await raw.request("open", conv="w", layers=[0, 4], max_tokens=200)
        gate = threading.Event()
        peer.executor.submit(gate.wait, 30)  # the device thread is busy for 2 s
        asyncio.get_running_loop().call_later(2.0, gate.set)
        await raw.send("step", conv="w", seq=1, start=0, tokens=[1], want="token")
        reply = await raw.recv(timeout_s=10)
        assert reply["t"] == "token" and gate.is_set()
        # the tiny model's one-position pass takes about a millisecond; the wait was 2,000 ms
        assert 0 <= peer.compute_ms_per_token < 50, peer.compute_ms_per_token


async def test_decode_steps_over_part_of_a_peers_layers_do_not_set_its_advert(tiny):
    """The advert is what a token costs on the peer's whole range, and it relaxes toward the
    lowest value it has held (``steps.ComputeCost``). A client (or a rogue previous hop) that
    opened a conversation over one of the peer's layers made every one-position pass count as
    the whole range: 30 such steps on a 24-layer peer took its advert from 40 ms to 1.1 ms, and
    that became its floor, so after any later burst it sank back there within minutes and
    routes crowded onto it. Only steps over the whole range are measured."""
    async with raw_conversation(tiny, role="peer", advert=rogue_advert(tiny[1])) as (peers, raw):
        peer = peers[0]
        peer.cost = ComputeCost()
        peer.compute_ms_per_token = 1e3  # the value and the floor: it stays 1e3 until a step is measured
        await raw.request("open", conv="part", layers=[3, 4], max_tokens=16, prev=peer_id_of(ROGUE_KEY))
        for i in range(5):
            await raw.send("step", conv="part", seq=i + 1, start=i, hidden=f32(torch.zeros(1, 1, WIDTH)), want="token")
            assert (await raw.recv())["t"] == "token"
        assert peer.compute_ms_per_token == 1e3
        await raw.request("open", conv="whole", layers=[0, 4], max_tokens=16)
        await raw.send("step", conv="whole", seq=1, start=0, tokens=[1], want="token")
        assert (await raw.recv())["t"] == "token"
        assert peer.compute_ms_per_token < 1e3  # the tiny model's pass takes about a millisecond
        for conv in ("part", "whole"):
            await raw.send("close", conv=conv)
