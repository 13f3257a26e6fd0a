"""Hostile HTTP clients against ``meshinfer serve``, and hostile peers against the newer peer
messages (``error.suspect``, ``verify``, ``sampling``) and the per-client limits.

Tiny random model only (tests/helpers/meshkit.py); each test names the attack it pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import aiohttp
import pytest
import torch

from helpers.meshkit import mesh, split
from meshinfer.wire import protocol
from meshinfer.app.api import ApiServer
from meshinfer.core.errors import LyingPeer
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.peer.node import ClientLimits
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.engine.sampling import pick_token
from meshinfer.text.prompt_bound import min_chat_tokens
from meshinfer.client.mesh import MeshClient
from helpers.hostile import Raw, new_key, rogue_advert

MESSAGES = [{"role": "user", "content": "a hostile world"}]


@contextlib.asynccontextmanager
async def api_over(tiny, bounds=(0, 2, 4), **options):
    path, digest, tok, _ = tiny
    async with mesh(split(lambda r: load_shard(path, r), list(bounds)), weights_hash=digest,
                    bundle=tok.to_bundle(), advert_ttl_s=30.0) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            server = ApiServer(client, host="127.0.0.1", port=0, **options)
            await server.start()
            try:
                yield peers, server
            finally:
                await server.close()


async def post(http, server, raw: bytes) -> tuple[int, dict]:
    async with http.post(f"{server.url}/chat/completions", data=raw,
                         headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


# --------------------------------------------------------------------------- HTTP API
def test_chat_encoding_is_linear_in_the_number_of_messages(tiny):
    """20,000 empty messages (a 600 KB body) took minutes: every control token was tested
    against every content span. Now one pass: well under a second per 20,000."""
    _, _, tok, _ = tiny
    t0 = time.perf_counter()
    ids = tok.encode_chat([{"role": "user", "content": ""}] * 20_000)
    assert time.perf_counter() - t0 < 5.0
    assert len(ids) > 20_000


async def test_a_huge_prompt_does_not_stall_other_requests(tiny):
    """Encoding a 4 MB prompt runs off the event loop: /v1/models answers meanwhile."""
    _, digest, _, _ = tiny
    body = json.dumps({"model": digest, "messages": [{"role": "user", "content": ""}] * 100_000}).encode()
    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        await post(http, server, json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 1}).encode())
        big = asyncio.ensure_future(post(http, server, body))
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        async with http.get(f"{server.url}/models") as r:
            assert r.status == 200
        waited = time.perf_counter() - t0
        status, answer = await big
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert waited < 1.5, f"/v1/models waited {waited:.1f} s behind one request's tokenization"


def test_the_prompt_bound_never_exceeds_the_tokens_of_a_prompt(tiny):
    """The bound that refuses a prompt before tokenizing is a lower bound: decomposed text that
    NFC composes, whitespace a template may trim, reasoning Qwen3's template drops, long pieces."""
    _, _, tok, _ = tiny
    assert tok.max_piece_chars == len("<|endoftext|>")
    for content in ("", "x" * 999, "<|im_start|>" * 80, " " * 500 + "a", "e\u0301" * 300, "\u00e9" * 300,
                    "\u1100\u1161\u11a8" * 100, "<|endoftext|>x" * 50):
        for role in ("user", "assistant"):
            messages = [{"role": role, "content": content}, {"role": "user", "content": "</think>" + content}]
            chars, at_least = min_chat_tokens(messages, tok.max_piece_chars)
            assert at_least <= len(tok.encode_chat(messages)), (content[:20], role)
            assert at_least * tok.max_piece_chars >= chars


def test_the_prompt_bound_normalizes_a_bounded_amount_of_text(tiny, monkeypatch):
    """NFC of a run of combining marks it must reorder costs time quadratic in the run, holding
    the GIL (240 KB froze serve for 16 s): the bound normalizes at most NFC_BUDGET_CHARS
    characters per prompt and counts the rest at NFC's largest shrink, still a lower bound."""
    import unicodedata

    from meshinfer.text import prompt_bound

    _, _, tok, _ = tiny
    normalized = []
    real = unicodedata.normalize
    monkeypatch.setattr(prompt_bound.unicodedata, "normalize",
                        lambda form, text: normalized.append(len(text)) or real(form, text))
    hostile = "a" + "\u0301\u0316" * 120_000
    messages = [{"role": "user", "content": hostile}, {"role": "user", "content": "e\u0301" * 3000},
                {"role": "user", "content": hostile[:5000]}]
    chars, at_least = prompt_bound.min_chat_tokens(messages, tok.max_piece_chars)
    assert sum(normalized) <= prompt_bound.NFC_BUDGET_CHARS and normalized == [6000]
    assert chars == -(-len(hostile) // prompt_bound.NFC_MAX_SHRINK) + 3000 + -(-5000 // prompt_bound.NFC_MAX_SHRINK)
    small = [{"role": "user", "content": hostile[:2001]}]  # within the budget: counted exactly
    assert prompt_bound.min_chat_tokens(small, tok.max_piece_chars)[1] <= len(tok.encode_chat(small))


class TokenizerCalls:
    """Counts renders and tokenizations (``Tokenizer._render``, ``Tokenizer._encode_pieces``);
    :attr:`entered` and :attr:`left` are set when a tokenization of a prompt holding ``mark``
    starts and ends."""

    def __init__(self, monkeypatch, mark: str | None = None) -> None:
        from meshinfer.text.tokenizer import Tokenizer

        self.renders = self.encodes = 0
        self.entered, self.left = threading.Event(), threading.Event()
        render, encode = Tokenizer._render, Tokenizer._encode_pieces

        def counted_render(tok, *args):
            self.renders += 1
            return render(tok, *args)

        def counted_encode(tok, pieces):
            self.encodes += 1
            marked = mark is not None and any(isinstance(p, str) and mark in p for p in pieces)
            if marked:
                self.entered.set()
            try:
                return encode(tok, pieces)
            finally:
                if marked:
                    self.left.set()

        monkeypatch.setattr(Tokenizer, "_render", counted_render)
        monkeypatch.setattr(Tokenizer, "_encode_pieces", counted_encode)


async def test_a_prompt_that_cannot_fit_is_refused_before_it_is_rendered_or_tokenized(tiny, monkeypatch):
    """A 4 MB prompt under the body limit was rendered and tokenized (seconds of a core) before
    the peers found it too long. No token of the tiny vocabulary spells more than 13 characters,
    so 4,000 characters are at least 308 tokens: over the 256-token context, refused at once."""
    _, digest, _, _ = tiny
    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        assert (await post(http, server, json.dumps({"model": digest, "messages": MESSAGES,
                                                     "max_tokens": 1}).encode()))[0] == 200
        calls = TokenizerCalls(monkeypatch)
        long = [{"role": "system", "content": "s" * 1000}, {"role": "user", "content": "x" * 3000}]
        answers = [await post(http, server, json.dumps({"model": digest, "messages": long, "max_tokens": 4,
                                                       "stream": stream}).encode()) for stream in (False, True)]
        assert (calls.renders, calls.encodes) == (0, 0)
        assert (await post(http, server, json.dumps({"model": digest, "messages": MESSAGES,
                                                     "max_tokens": 1}).encode()))[0] == 200
        assert calls.encodes >= 1  # the counters do see a tokenization
    for status, answer in answers:
        assert status == 400
        assert answer["error"] == {
            "message": "the prompt cannot fit the model's context of 256 tokens: its 4000 characters are at least "
                       "308 tokens (no token of this vocabulary spells more than 13 characters), and max_tokens is 4",
            "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}


async def test_a_hop_that_tells_a_tiny_context_cannot_make_serve_refuse_prompts(tiny):
    """A hop's welcome said ``context_tokens`` 1 (as a lying peer may): serve took the least over
    the route and refused every prompt routed through it. The largest told counts now."""
    _, digest, _, _ = tiny
    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        body = json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 2}).encode()
        assert (await post(http, server, body))[0] == 200
        links = [server.client.open_link(p.peer_id) for p in peers]
        assert all(link is not None and link.info["context_tokens"] == 256 for link in links)
        links[1].info["context_tokens"] = 1  # what that welcome leaves on the client's link
        status, answer = await post(http, server, body)
        assert status == 200, answer
        long = [{"role": "user", "content": "x" * 4000}]
        status, answer = await post(http, server, json.dumps({"model": digest, "messages": long,
                                                              "max_tokens": 4}).encode())
        assert status == 400 and "context of 256 tokens" in answer["error"]["message"]  # still refused early


async def test_a_small_request_completes_while_a_large_admitted_prompt_is_tokenized(tmp_path, monkeypatch):
    """A 4 MB prompt the bound admits (the model's context is 2**20 tokens here) is rendered and
    tokenized in a worker thread that lets go of the GIL (``encode_batch``): a small chat from
    another address, sent once that tokenization has started, is answered before it ends (the
    peers then refuse the large one: 4 million tokens). With ``encode`` in the thread, which
    holds the GIL, or the tokenization on the loop, the small chat waited for all of it."""
    from helpers.meshkit import tiny_model

    tiny = tiny_model(tmp_path, context=1 << 20)
    digest = tiny[1]
    small = json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 2}).encode()
    large = json.dumps({"model": digest, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "held " * ((4 << 20) // 5 - 40)}]}).encode()
    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        other = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
        async with other:
            assert (await post(other, server, small))[0] == 200
            calls = TokenizerCalls(monkeypatch, mark="held held")
            big = asyncio.ensure_future(post(http, server, large))
            assert await asyncio.to_thread(calls.entered.wait, 60.0)
            status, _ = await asyncio.wait_for(post(other, server, small), 120.0)
            answered_first = not calls.left.is_set()
        big_status, answer = await asyncio.wait_for(big, 120.0)
    assert status == 200 and answered_first
    assert (big_status, answer["error"]["code"]) == (400, "context_length_exceeded")


@pytest.mark.parametrize("name, raw", [
    ("lone surrogate in content", b'{"model": "M", "messages": [{"role": "user", "content": "\\ud800x"}]}'),
    ("lone surrogate in a text part",
     b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'),
    ("nested arrays", b"[" * 100_000 + b"]" * 100_000),
    ("nested objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
])
async def test_malformed_text_and_deep_nesting_are_400_not_500(tiny, name, raw, caplog):
    """A lone surrogate reached the tokenizer (UnicodeEncodeError) and deep nesting hit
    RecursionError in json.loads: both were 500 with a traceback logged per request."""
    _, digest, _, _ = tiny
    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        status, body = await post(http, server, raw.replace(b'"M"', json.dumps(digest).encode()))
        ok, _ = await post(http, server, json.dumps({"model": digest, "messages": MESSAGES,
                                                     "max_tokens": 1}).encode())
    assert status == 400, (name, body)
    assert body["error"]["type"] == "invalid_request_error"
    assert ok == 200
    assert not [r for r in caplog.records if r.levelname == "ERROR" and r.name == "meshinfer.app.api"]


async def test_a_runaway_chat_template_from_the_mesh_costs_serve_one_deadline_per_request(tiny):
    """Issue 17: a chat template of nested 100000 x 100000 loops, served by the mesh's peers,
    made every `serve` completion time out with a core at 100%, for good. `serve` renders a
    template from the network in a sandbox child with a deadline: the request fails with a clear
    400 after about that deadline, `/v1/models` answers meanwhile, and the next request is
    refused the same way instead of queueing behind the first."""
    from meshinfer.text.template_sandbox import RENDER_BASE_S

    path, digest, tok, _ = tiny
    runaway = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
    bundle = tok.to_bundle() | {"chat_template": runaway}
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest, bundle=bundle,
                    advert_ttl_s=30.0) as peers, MeshClient(list(peers[0].addrs)) as client:
        server = ApiServer(client, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with aiohttp.ClientSession() as http:
                body = json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 1}).encode()
                for _ in range(2):
                    t0 = time.monotonic()
                    job = asyncio.ensure_future(post(http, server, body))
                    await asyncio.sleep(0.5)
                    t1 = time.monotonic()
                    async with http.get(f"{server.url}/models") as r:
                        assert r.status == 200
                    assert time.monotonic() - t1 < 1.5
                    status, answer = await job
                    assert status == 400 and "chat template did not finish within" in answer["error"]["message"], answer
                    assert time.monotonic() - t0 < RENDER_BASE_S + 10
        finally:
            await server.close()


def test_a_tiny_temperature_samples_the_argmax_not_garbage():
    """temperature 1e-300 passes every check (API: (0, 2]; wire: [0, 100]) but logits / T
    overflowed float32 to inf, softmax gave NaN, and the draw returned the last vocabulary id
    whatever the logits. The limit of T -> 0 is the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(260) * 3
    best = int(logits.argmax())
    assert best != 259
    for t in (1e-300, 1e-45, 1e-40):
        for seed in range(4):
            assert pick_token(logits, SamplingParams(temperature=t, top_p=1.0, seed=seed), position=5) == best
            assert pick_token(logits, SamplingParams(temperature=t, top_p=0.3, seed=seed), position=5) == best
    assert protocol.sampling_from_wire({"temperature": 1e-300, "top_p": 1.0, "seed": 0}, "step") is not None


async def test_models_path_traversal_and_odd_ids_are_404(tiny):
    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        for path in ("/v1/models/..%2F..%2Fetc%2Fpasswd", "/v1/models/%00", "/v1/models/%ED%A0%80",
                     "/v1/models/../../etc/passwd"):
            async with http.get(f"http://127.0.0.1:{server.port}{path}") as r:
                body = await r.json()
                assert r.status == 404 and body["error"]["code"] in ("model_not_found", "not_found"), path


# --------------------------------------------------------------------------- lying-peer reports
async def test_a_hop_cannot_frame_a_hop_it_does_not_receive_from(tiny):
    """Route 0-1, 1-2, 2-4: the last hop sends ``error{code: lying_peer, suspect: hop 0}``.
    Only hop 1 receives hop 0's hidden states, so only it can have seen them fail the cheap
    checks; the client believed any hop of the route and banned the honest first hop (one
    forged frame per step bans up to three honest peers). The accuser is the one to exclude."""
    path, digest, tok, whole = tiny
    shards = split(lambda r: load_shard(path, r), [0, 1, 2, 4]) + [load_shard(path, protocol.LayerRange(2, 4))]
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), advert_ttl_s=30.0) as peers:
        async with MeshClient(list(peers[0].addrs), spot_check_rate=0.0) as client:
            route = await client.plan()
            first, liar = route.hops[0].peer_id, route.hops[-1].peer_id
            bad = next(p for p in peers if p.peer_id == liar)

            def forge(*args):  # in place of Peer._finish_step, on the device thread
                raise LyingPeer("previous hop sent NaN hidden states", suspect=first)

            async def report(conv, seq, exc):
                await conv.owner.send("error", conv=conv.conv_id, seq=seq, code=exc.code, message=str(exc),
                                      suspect=getattr(exc, "suspect", None))

            bad._finish_step, bad._report = forge, report
            ids = tok.encode_chat(MESSAGES)
            conv = client.conversation(route, max_tokens_total=len(ids) + 8)
            try:
                out = await conv.generate(ids, max_tokens=8, eos_ids=())
            finally:
                await conv.close()
            banned = client.backed_off()
    assert first not in banned
    assert liar in banned
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=8, eos_ids=()).token_ids


# --------------------------------------------------------------------------- per-client limits
async def test_hello_as_a_peer_does_not_escape_the_per_client_limits(tiny):
    """Per-host limits applied to ``role: client`` links only: a rogue that says hello as a
    peer with a fresh key (free in an open mesh) opened conversations and sent steps and
    verifies without any limit."""
    path, digest, tok, _ = tiny
    limits = ClientLimits(conversations=2, steps_per_s=5.0, bytes_per_s=1e9)
    async with mesh([load_shard(path)], weights_hash=digest, bundle=tok.to_bundle(),
                    client_limits=limits) as peers:
        peer = peers[0]
        key = new_key()
        raw = await Raw.connect(peer, role="peer", advert=rogue_advert(digest, key=key), key=key)
        try:
            opened = [(await raw.request("open", conv=f"c{i}", layers=[0, 4], max_tokens=32))["t"]
                      for i in range(4)]
            assert opened[:2] == ["opened", "opened"] and opened[2:] == ["error", "error"], opened
            verifies = [await raw.request("verify", layers=[0, 4], tokens=[1, 2, 3], check=0) for _ in range(15)]
            assert any(v["t"] == "error" and v["code"] == "rate_limited" for v in verifies)
        finally:
            await raw.close()


# --------------------------------------------------------------------------- verify
class SlowVerify:
    """A shard whose whole-prefix passes (``logits="all"``: only a verify asks for them) take 0.3 s."""

    def __init__(self, shard) -> None:
        self._shard = shard

    def __getattr__(self, name):
        return getattr(self._shard, name)

    def __call__(self, x, start, cache=None, *, run=None, logits="last", abandoned=None):
        if logits == "all":
            time.sleep(0.3)
        return self._shard(x, start, cache, run=run, logits=logits, abandoned=abandoned)


@pytest.mark.slow
async def test_a_verify_flood_from_one_host_does_not_starve_other_spot_checks(tiny):
    """A peer ran one verify at a time for everyone and refused the others: a host sending
    verifies back to back (a liar keeping its only checker busy) made every honest spot-check
    of that peer's layers come back rate_limited, i.e. skipped. One verify per host at a time."""
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path), load_shard(path)], weights_hash=digest, bundle=tok.to_bundle(),
                    advert_ttl_s=30.0) as (a, b):
        b.shard = SlowVerify(b.shard)
        flooder = await Raw.connect(b, local_addr=("127.0.0.2", 0))
        for k in range(40):
            await flooder.send("verify", id=k + 1, layers=[0, 4], tokens=[1] * 20, check=0)
        try:
            await asyncio.sleep(0.1)
            async with MeshClient(list(a.addrs), spot_check_rate=1.0) as client:
                route = await client.plan(exclude=frozenset({b.peer_id}))
                ids = tok.encode_chat(MESSAGES)
                conv = client.conversation(route, max_tokens_total=len(ids) + 3)
                try:
                    await conv.generate(ids, max_tokens=3, eos_ids=())
                finally:
                    await conv.close()
        finally:
            await flooder.close()
    assert conv.audit.checks >= 1


async def test_one_client_address_gets_429_beyond_its_requests_in_flight(tiny):
    """Each chat request holds a conversation on every hop; one HTTP user could take all 64 a peer
    allows the server's host. Beyond ``max_requests_per_client`` in flight: 429, the rest go on."""
    _, digest, _, _ = tiny
    body = json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 2}).encode()
    async with api_over(tiny, max_requests_per_client=2) as (peers, server), aiohttp.ClientSession() as http:
        gate = threading.Event()
        peers[0].executor.submit(gate.wait, 30)  # the first hop's device is busy: requests stay in flight
        try:
            running = [asyncio.ensure_future(post(http, server, body)) for _ in range(2)]
            await asyncio.sleep(0.5)
            async with http.post(f"{server.url}/chat/completions", data=body) as r:
                status, answer, retry = r.status, await r.json(), r.headers.get("Retry-After")
        finally:
            gate.set()
        assert (status, answer["error"]["code"], retry) == (429, "too_many_requests", "1")
        assert answer["error"]["message"] == ("127.0.0.1 already has 2 requests in flight, the most one client "
                                              "may have; retry when one finishes")
        assert [s for s, _ in await asyncio.gather(*running)] == [200, 200]
        assert (await post(http, server, body))[0] == 200
        assert server._in_flight == {}
    with pytest.raises(ValueError, match="max_requests_per_client must be 0 .no limit. or more, got -1"):
        ApiServer(None, max_requests_per_client=-1)


# --------------------------------------------------------------------------- connections, headers and bodies per address
async def http_exchange(port: int, request: bytes, *, local: str = "127.0.0.1") -> bytes:
    """Send ``request`` on a fresh connection from ``local``; everything the server answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0))
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), 30.0)
    finally:
        writer.close()


async def test_connections_from_one_address_are_capped_and_others_are_served(tiny):
    async with api_over(tiny, max_connections_per_client=3) as (peers, server):
        held = [await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
                for _ in range(3)]
        try:
            answer = await http_exchange(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", local="127.0.0.2")
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in head
            assert json.loads(body)["error"] == {
                "message": "127.0.0.2 already holds 3 connections to this server, the most one client may hold; "
                           "close some and retry",
                "type": "server_error", "param": None, "code": "too_many_connections"}
            async with aiohttp.ClientSession() as http, http.get(f"{server.url}/models") as r:
                assert r.status == 200  # another address is served
        finally:
            for _, writer in held:
                writer.close()
        async with asyncio.timeout(10.0):  # closed connections free their places
            while server._connections.get("127.0.0.2"):
                await asyncio.sleep(0.02)
        answer = await http_exchange(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                     local="127.0.0.2")
        assert answer.startswith(b"HTTP/1.1 200 ")


async def test_a_connection_that_never_finishes_its_headers_is_closed(tiny, monkeypatch):
    from meshinfer.app import api

    monkeypatch.setattr(api, "HEADERS_TIMEOUT_S", 1.0)
    async with api_over(tiny) as (peers, server):
        slow = []
        for _ in range(20):  # slowloris: a request line and one header, then silence
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append((reader, writer))
        try:
            async with aiohttp.ClientSession() as http, http.get(f"{server.url}/models") as r:
                assert r.status == 200  # served meanwhile
            async with asyncio.timeout(30.0):  # 1 s each, however loaded the machine is
                for reader, _ in slow:
                    assert await reader.read() == b""  # closed without an answer
        finally:
            for _, writer in slow:
                writer.close()
        assert server._connections == {}


async def test_a_body_over_the_limit_is_413_naming_the_limit(tiny):
    from meshinfer.app.api import MAX_BODY_BYTES

    async with api_over(tiny) as (peers, server), aiohttp.ClientSession() as http:
        status, answer = await post(http, server, b" " * (MAX_BODY_BYTES + 1))
    assert (status, answer["error"]["code"]) == (413, "request_too_large")
    assert answer["error"]["message"] == "the request body is over the limit of 4194304 bytes (4 MiB)"


SERVE_SCRIPT = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from helpers.meshkit import mesh, split, tiny_model
from meshinfer.app.api import ApiServer
from meshinfer.engine.generate import load_shard
from meshinfer.client.mesh import MeshClient

async def main():
    path, digest, tok, _ = tiny_model(__import__("pathlib").Path({directory!r}), context=1 << 20)
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle(), advert_ttl_s=30.0) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            server = ApiServer(client, host="127.0.0.1", port=0)
            await server.start()
            print(server.port, digest, flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
            await server.close()

asyncio.run(main())
"""


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads RSS from /proc")
async def test_big_prompts_in_flight_from_one_address_neither_stall_others_nor_keep_memory(tmp_path):
    """8 x 4 MB prompts from one address: others waited 31-44 s, and serve grew from 314 MB to
    3.1 GB that it never gave back. Now one address has one such body in flight (429 for the rest).
    The model's context is 2**20 tokens here, so that these prompts pass the bound of
    ``check_prompt_fits`` and are tokenized (then refused by the peers), as in the attack."""
    import os
    import subprocess
    import sys

    script = SERVE_SCRIPT.format(tests=os.path.dirname(__file__), directory=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120.0)
        port, digest = int(line.split()[0]), line.split()[1]
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        small = json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 2}).encode()
        big = json.dumps({"model": digest, "max_tokens": 2, "messages": [
            {"role": "user", "content": "word " * ((4 << 20) // 5 - 40)}]}).encode()
        assert len(big) <= 4 << 20
        # each request on its own session and connection, from the address given
        async def chat(body: bytes, local: str = "127.0.0.1") -> tuple[int, float]:
            t0 = time.perf_counter()
            conn = aiohttp.TCPConnector(local_addr=(local, 0), force_close=True)
            async with aiohttp.ClientSession(connector=conn) as one, one.post(url, data=body) as r:
                await r.read()
                return r.status, time.perf_counter() - t0

        assert (await chat(small))[0] == 200
        normal = min([(await chat(small))[1] for _ in range(3)])
        one_big = (await chat(big, "127.0.0.3"))[1]  # what one such prompt costs serve, alone
        before = rss_bytes(proc.pid)
        attack = [asyncio.ensure_future(chat(big, "127.0.0.2")) for _ in range(8)]
        await asyncio.sleep(0.5)
        status, victim = await chat(small)
        statuses = sorted(s for s, _ in await asyncio.gather(*attack))
        await asyncio.sleep(1.0)
        after = rss_bytes(proc.pid)
        print(f"normal {normal:.2f} s, one big {one_big:.2f} s, victim {victim:.2f} s; attack {statuses}; "
              f"RSS {before >> 20} -> {after >> 20} MB")
        # the victim may wait for the one big prompt admitted (two, to allow for noise), not for 8
        assert status == 200 and victim < 2 * one_big + 10 * normal + 5.0
        assert statuses.count(429) >= 6  # one body of 4 MB in flight per address
        assert after - before < 512 << 20
    finally:
        proc.stdin.close()
        try:
            proc.wait(30.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def fake_peers(digest: str, n: int):
    """A websocket server answering as ``n`` signed identities at once, one per path: it passes
    the client's handshake and answers pings, and does nothing else. Yields (adverts, the open
    connections that said hello as a client)."""
    import msgpack
    import websockets

    from meshinfer.wire.discovery import new_nonce, welcome_proof
    from helpers.hostile import pack

    keys, ads, clients = [new_key() for _ in range(n)], {}, set()

    async def answer(ws) -> None:
        try:
            await converse(ws)
        finally:
            clients.discard(ws)

    async def converse(ws) -> None:
        key = keys[int(ws.request.path.strip("/"))]
        async for frame in ws:
            msg = msgpack.unpackb(frame)
            if msg.get("t") == "hello":
                if msg.get("role") == "client":
                    clients.add(ws)
                nonce = new_nonce()
                await ws.send(pack("welcome", re=msg.get("id"), advert=ads[int(ws.request.path.strip("/"))],
                                   nonce=nonce, proof=welcome_proof(key, msg["nonce"], nonce), private=False,
                                   max_step_tokens=512, max_frame_bytes=1 << 20))
            elif msg.get("t") == "ping":
                await ws.send(pack("pong", re=msg.get("id")))

    async with websockets.serve(answer, "127.0.0.1", 0, compression=None) as server:
        port = server.sockets[0].getsockname()[1]
        for i, key in enumerate(keys):  # another model: probed by every plan, never on a route
            ads[i] = rogue_advert("0" * 64, key=key, addrs=[f"ws://127.0.0.1:{port}/{i}"], ttl_s=1.0, seq=i + 1)
        yield list(ads.values()), clients


@pytest.mark.slow
async def test_serve_closes_links_to_peers_that_come_and_go(tiny):
    """Rotating fake identities kept connected: serve's client leaked a connection per probed peer
    (open files 16 -> 1,023), then answered 503 for good. Now links to peers gone from the table
    are closed, and at most ``MAX_IDLE_LINKS`` links that carry no conversation are kept."""
    from meshinfer.client.links import MAX_IDLE_LINKS
    from helpers.hostile import plant

    _, digest, _, _ = tiny
    body = json.dumps({"model": digest, "messages": MESSAGES, "max_tokens": 2}).encode()
    async with api_over(tiny, route_ttl_s=0.0) as (peers, server), aiohttp.ClientSession() as http:
        most_links = most_sockets = 0
        for wave in range(4):  # 4 waves of 40 identities, each living about a second
            async with fake_peers(digest, 40) as (ads, clients):
                raw = await plant(peers[0], ads)
                assert (await post(http, server, body))[0] == 200
                most_links = max(most_links, len(server.client._links))
                most_sockets = max(most_sockets, len(clients))
                await raw.close()
                await asyncio.sleep(1.5)  # they expire from the peer's table
                assert (await post(http, server, body))[0] == 200
                assert set(server.client._links) <= {p.peer_id for p in peers}  # links to the gone ones are closed
        assert most_links <= MAX_IDLE_LINKS + len(peers), most_links
        assert most_sockets <= MAX_IDLE_LINKS, most_sockets
