"""The OpenAI-compatible API (`meshinfer serve`) over live in-process meshes, driven by the official
`openai` client (and raw HTTP where the bytes on the wire matter)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import openai
import pytest
import torch

from helpers.meshkit import crash, mesh, split, start_peer, wait_for_tables
from helpers.api import STEADY_TTL_S, raw_post, served
from meshinfer.wire import protocol
from meshinfer.core.config import LayerRange
from meshinfer.app.api import model_id, parse_chat_request, ApiError
from meshinfer.core.errors import InvalidInput, ProtocolError
from meshinfer.engine.generate import load_shard
from meshinfer.app.reply import TextStream
from meshinfer.core.sampling_params import SamplingParams
from meshinfer.engine.sampling import pick_token
from meshinfer.client.mesh import MeshClient

MESSAGES = [{"role": "user", "content": "hello there, tiny model"}]


@contextlib.asynccontextmanager
async def tiny_api(tiny, bounds=(0, 2, 4), **options):
    path, digest, tok, _ = tiny
    async with mesh(split(lambda r: load_shard(path, r), bounds), weights_hash=digest, bundle=tok.to_bundle(),
                    advert_ttl_s=STEADY_TTL_S) as peers:
        async with served(peers, **options) as (server, api):
            yield peers, server, api


async def session_reply(peers, tok, messages, max_tokens):
    """The reference: the session path with the tokenizer's end-of-generation ids."""
    async with MeshClient(list(peers[0].addrs)) as client:
        route = await client.plan()
        ids = tok.encode_chat(messages)
        conv = client.conversation(route, max_tokens_total=len(ids) + max_tokens)
        try:
            out = await conv.generate(ids, max_tokens=max_tokens, eos_ids=tok.eos_ids)
        finally:
            await conv.close()
    return ids, out


async def streamed(api, **request):
    """(concatenated content, finish_reason, usage or None, chunks) of a streaming request."""
    stream = await api.chat.completions.create(stream=True, **request)
    text, finish, usage, chunks = "", None, None, []
    async for c in stream:
        chunks.append(c)
        if c.usage is not None:
            usage = c.usage
        for choice in c.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage, chunks


async def wait_no_conversations(peers, timeout_s=10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while any(p.convs for p in peers):
            await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- tiny model
async def test_greedy_text_and_usage_match_the_session_path(tiny):
    _, digest, tok, _ = tiny
    async with tiny_api(tiny) as (peers, server, api):
        ids, ref = await session_reply(peers, tok, MESSAGES, 10)
        got = await api.chat.completions.create(model=model_id(digest), messages=MESSAGES, max_tokens=10)
        text, finish, usage, chunks = await streamed(api, model=model_id(digest), messages=MESSAGES, max_tokens=10,
                                                     stream_options={"include_usage": True})
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-") and got.model == model_id(digest)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == tok.decode(ref.token_ids) == text
    assert got.choices[0].finish_reason == ref.finish_reason == finish
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(ref.token_ids))
    assert got.usage.total_tokens == len(ids) + len(ref.token_ids)
    assert usage is not None and usage.model_dump() == got.usage.model_dump()
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []


async def test_a_reply_says_which_hops_nobody_verified(tiny):
    """Two hops and no twin for either: the answer is marked unverified, in both modes."""
    _, digest, tok, _ = tiny
    async with tiny_api(tiny) as (peers, server, api):
        status, body = await raw_post(server, {"model": model_id(digest), "messages": MESSAGES, "max_tokens": 3})
        _, _, _, chunks = await streamed(api, model=model_id(digest), messages=MESSAGES, max_tokens=3)
    why = "no other peer serves these layers at f32 with these weights, so nothing can check them"
    assert status == 200 and body["meshinfer"]["detections"] == [] and body["meshinfer"]["unverified"] == [
        {"peer": peers[0].peer_id, "layers": "0-1", "reason": why},
        {"peer": peers[1].peer_id, "layers": "2-3", "reason": why}]
    final = chunks[-1]
    assert final.choices[0].finish_reason and final.model_extra["meshinfer"]["unverified"] == body["meshinfer"]["unverified"]


async def test_models_are_listed_by_their_stable_id(tiny):
    _, digest, _, _ = tiny
    async with tiny_api(tiny) as (peers, server, api):
        listed = await api.models.list()
        one = await api.models.retrieve(f"sha256-{digest[:16]}")
        by_hash = await api.models.retrieve(digest)
    assert [m.id for m in listed.data] == [f"sha256-{digest[:16]}"]
    assert one.id == by_hash.id == f"sha256-{digest[:16]}" and one.owned_by == "meshinfer"
    assert one.model_extra["meshinfer"]["complete_route"] is True and one.model_extra["meshinfer"]["peers"] == 2


async def test_unknown_model_is_404_in_openai_format(tiny):
    async with tiny_api(tiny) as (peers, server, api):
        with pytest.raises(openai.NotFoundError) as info:
            await api.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await api.models.retrieve("gpt-4o")
    assert info.value.status_code == 404 and info.value.code == "model_not_found"
    assert info.value.body["param"] == "model" and "GET /v1/models" in info.value.body["message"]


async def test_stop_sequences_end_the_text_in_both_modes(tiny):
    _, digest, tok, _ = tiny
    async with tiny_api(tiny) as (peers, server, api):
        full = (await api.chat.completions.create(model=digest, messages=MESSAGES, max_tokens=24)
                ).choices[0].message.content
        stop = full[6:9]
        expected = full[:full.find(stop)]
        got = await api.chat.completions.create(model=digest, messages=MESSAGES, max_tokens=24,
                                                stop=[stop, "\x00never"])
        text, finish, _, _ = await streamed(api, model=digest, messages=MESSAGES, max_tokens=24, stop=stop)
    assert len(full) > 9
    assert got.choices[0].message.content == expected == text
    assert got.choices[0].finish_reason == finish == "stop"
    assert got.usage.completion_tokens < 24


async def test_seed_reproduces_sampling_and_temperature_departs_from_greedy(tiny):
    _, digest, _, _ = tiny
    ask = dict(model=digest, messages=MESSAGES, max_tokens=12)
    async with tiny_api(tiny) as (peers, server, api):
        greedy = (await api.chat.completions.create(**ask)).choices[0].message.content
        a = (await api.chat.completions.create(temperature=1.0, seed=7, **ask)).choices[0].message.content
        b, _, _, _ = await streamed(api, temperature=1.0, seed=7, **ask)
        others = [(await api.chat.completions.create(temperature=1.5, seed=s, **ask)).choices[0].message.content
                  for s in range(3)]
        zero = (await api.chat.completions.create(temperature=0, seed=3, **ask)).choices[0].message.content
    assert a == b
    assert any(o != greedy for o in others) and len(set(others)) > 1
    assert zero == greedy


async def test_bad_requests_are_400_and_the_server_keeps_serving(tiny):
    _, digest, _, _ = tiny
    async with tiny_api(tiny) as (peers, server, api):
        cases = {
            "bad json": (None, b"{not json"),
            "no messages": ({"model": digest}, None),
            "zero max_tokens": ({"model": digest, "messages": MESSAGES, "max_tokens": 0}, None),
            "temperature text": ({"model": digest, "messages": MESSAGES, "temperature": "hot"}, None),
            "n=2": ({"model": digest, "messages": MESSAGES, "n": 2}, None),
            "five stops": ({"model": digest, "messages": MESSAGES, "stop": list("abcde")}, None),
            "bad role": ({"model": digest, "messages": [{"role": "robot", "content": "x"}]}, None),
            "image part": ({"model": digest, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, None),
            "body is a list": ([1, 2], None),
        }
        answers = {name: await raw_post(server, body, raw=raw) for name, (body, raw) in cases.items()}
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(model=digest, messages=MESSAGES, top_p=0)
        ok = await api.chat.completions.create(model=digest, messages=MESSAGES, max_tokens=3)
    for name, (status, body) in answers.items():
        assert status == 400, name
        assert set(body["error"]) == {"message", "type", "param", "code"}, name
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"], name
    assert answers["bad json"][1]["error"]["code"] == "invalid_json"
    assert answers["zero max_tokens"][1]["error"]["param"] == "max_tokens"
    assert answers["n=2"][1]["error"]["code"] == "unsupported_parameter"
    assert info.value.body["param"] == "top_p"
    assert ok.usage.completion_tokens >= 1


async def test_prompt_longer_than_the_context_is_400_context_length_exceeded(tiny):
    _, digest, _, _ = tiny  # the tiny model's context is 256 tokens, one token per byte
    async with tiny_api(tiny) as (peers, server, api):
        long = [{"role": "user", "content": "x" * 400}]
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(model=digest, messages=long, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as streaming:  # refused before the stream starts
            await api.chat.completions.create(model=digest, messages=long, max_tokens=4, stream=True)
        assert (await api.chat.completions.create(model=digest, messages=MESSAGES, max_tokens=2)).choices
        await wait_no_conversations(peers)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"
    assert streaming.value.code == "context_length_exceeded"
    assert "max_tokens (4)" in info.value.body["message"] and "context is 256 tokens" in info.value.body["message"]


async def test_no_complete_route_is_503_and_listed_as_incomplete(tiny):
    path, digest, tok, _ = tiny
    async with mesh([load_shard(path, LayerRange(0, 2))], weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with served(peers) as (server, api):
            listed = await api.models.list()
            with pytest.raises(openai.InternalServerError) as info:
                await api.chat.completions.create(model=digest, messages=MESSAGES, max_tokens=2)
    assert listed.data[0].model_extra["meshinfer"]["complete_route"] is False
    assert info.value.status_code == 503 and info.value.code == "no_route"
    assert "layers 2-3" in info.value.body["message"]


async def test_api_key_is_required_when_set(tiny):
    _, digest, _, _ = tiny
    async with tiny_api(tiny, api_key="s3cret") as (peers, server, api):
        with pytest.raises(openai.AuthenticationError) as info:
            await api.models.list()
        keyed = openai.AsyncOpenAI(base_url=server.url, api_key="s3cret", max_retries=0)
        try:
            listed = await keyed.models.list()
        finally:
            await keyed.close()
    assert info.value.code == "invalid_api_key" and len(listed.data) == 1


async def test_client_that_disconnects_mid_stream_leaves_no_conversation(tiny, monkeypatch):
    _, digest, _, _ = tiny
    async with tiny_api(tiny) as (peers, server, api):
        last = peers[-1]
        steps = []
        finish = last._finish_step

        def slow(conv, start, *rest):  # about 40 ms a step, so the reply is still running
            steps.append(start)
            time.sleep(0.04)
            return finish(conv, start, *rest)

        monkeypatch.setattr(last, "_finish_step", slow)
        body = {"model": digest, "messages": MESSAGES, "max_tokens": 150, "stream": True}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/chat/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: ") and b'"content": ""' not in line:
                        break  # the first chunk with text: then hang up
        await wait_no_conversations(peers)
        ran = len(steps)
        await asyncio.sleep(0.3)
        after = await api.chat.completions.create(model=digest, messages=MESSAGES, max_tokens=2)
    assert ran < 100 and len(steps) <= ran + 3  # generation stopped: no 150 steps
    assert after.choices[0].message.content is not None


async def test_sampled_reply_survives_failover_of_the_last_hop(tiny):
    """The replacement last hop draws the same tokens: each draw is seeded by (seed, position)."""
    path, digest, tok, _ = tiny
    opts = dict(advert_ttl_s=STEADY_TTL_S)
    first = await start_peer(load_shard(path, LayerRange(0, 2)), weights_hash=digest, bundle=tok.to_bundle(), **opts)
    lasts = [await start_peer(load_shard(path, LayerRange(2, 4)), weights_hash=digest, bootstrap=first.addrs, **opts)
             for _ in range(2)]
    sampling, ids = SamplingParams(temperature=1.5, seed=11), tok.encode_chat(MESSAGES)
    try:
        await wait_for_tables([first, *lasts])
        async with MeshClient(list(first.addrs)) as client:
            async def run(crash_after: int | None):
                conv = client.conversation(await client.plan(), max_tokens_total=len(ids) + 30)
                victim = next(p for p in lasts if p.peer_id == conv.route.hops[-1].peer_id)

                def on_token(_):
                    if len(conv.cached) - len(ids) == crash_after:
                        asyncio.ensure_future(crash(victim))
                try:
                    return await conv.generate(ids, max_tokens=30, eos_ids=(), on_token=on_token, sampling=sampling)
                finally:
                    await conv.close()

            reference = await run(None)
            greedy = await client.conversation(await client.plan(), max_tokens_total=len(ids) + 30).generate(
                ids, max_tokens=30, eos_ids=())
            survived = await run(9)
    finally:
        for p in (first, *lasts):
            await p.close()
            p.executor.close()
    assert survived.token_ids == reference.token_ids != greedy.token_ids
    assert len(survived.failovers) == 1


# --------------------------------------------------------------------------- units
def test_text_stream_holds_back_a_possible_stop_sequence(tiny):
    tok = tiny[2]
    stream = TextStream(tok, stop=["STOP"])
    pieces = [stream.push(t) for t in tok.encode("abc STOx STOP tail")]
    assert "".join(pieces) == "abc STOx " and stream.stopped and stream.finish() == ""
    assert all("STOP" not in "".join(pieces[:i + 1]) for i in range(len(pieces)))
    assert pieces[4:8] == ["", "", "", "STOx"]  # "S", "ST", "STO" held back until "x" ruled STOP out
    free = TextStream(tok, stop=["xyz"])
    assert "".join(free.push(t) for t in tok.encode("ab xy")) == "ab " and free.finish() == "xy"


def test_text_stream_emits_whole_characters_only(tiny):
    tok = tiny[2]
    stream = TextStream(tok)
    pieces = [stream.push(t) for t in tok.encode("é🦀!")]  # 2 + 4 + 1 bytes, one token per byte
    assert pieces == ["", "é", "", "", "", "🦀", "!"] and stream.finish() == ""


def test_pick_token_greedy_is_argmax_and_sampling_depends_only_on_seed_and_position():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))
    assert pick_token(logits, None, position=5) == int(logits.argmax())
    assert pick_token(logits, SamplingParams(temperature=0.0, seed=9), position=5) == int(logits.argmax())
    hot = SamplingParams(temperature=2.0, seed=9)
    draws = [pick_token(logits, hot, position=p) for p in range(40)]
    assert draws == [pick_token(logits.clone(), hot, position=p) for p in range(40)]
    assert len(set(draws)) > 5
    assert pick_token(logits, SamplingParams(temperature=2.0, top_p=1e-6, seed=9), position=3) == int(logits.argmax())


def test_sampling_fields_are_validated():
    assert protocol.sampling_from_wire(None, "step 1") is None
    got = protocol.sampling_from_wire({"temperature": 0.5, "top_p": 0.9, "seed": 4, "new": 1}, "step 1")
    assert got == SamplingParams(temperature=0.5, top_p=0.9, seed=4)
    for bad, text in [({"temperature": -1, "top_p": 1, "seed": 0}, "'temperature' = -1"),
                      ({"temperature": 1, "top_p": 0, "seed": 0}, "'top_p' = 0.0 must be above 0"),
                      ({"temperature": 1, "top_p": 1, "seed": -2}, "'seed' = -2"),
                      ({"temperature": 1, "top_p": 1}, "'seed' is missing"), ("hot", "expected a map")]:
        with pytest.raises(ProtocolError, match=text):
            protocol.sampling_from_wire(bad, "step 1")
    with pytest.raises(InvalidInput, match="top_p 1.5"):
        SamplingParams(temperature=1.0, top_p=1.5)


def test_parse_chat_request_reads_openai_fields():
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 5, "temperature": 0.7,
        "seed": -1, "stop": "END", "stream": True, "stream_options": {"include_usage": True}, "user": "x"})
    assert req.messages[0] == {"role": "system", "content": "be brief"}
    assert req.max_tokens == 5 and req.stop == ("END",) and req.stream and req.include_usage
    assert req.sampling == SamplingParams(temperature=0.7, top_p=1.0, seed=(-1) % (1 << 63))
    assert parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}).sampling is None
    with pytest.raises(ApiError, match="'temperature' must be a number in \\[0, 2\\]"):
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3})


def test_deprecated_function_call_is_refused_not_dropped():
    """Tool calls are read (tests/test_tools.py); their deprecated form is refused, never dropped."""
    call = {"name": "get_weather", "arguments": "{}"}
    with pytest.raises(ApiError) as info:
        parse_chat_request({"model": "m", "messages": [{"role": "user", "content": "weather?"},
                                                       {"role": "assistant", "content": None, "function_call": call}]})
    assert info.value.status == 400 and info.value.code == "unsupported_parameter"
    assert info.value.message == ("messages[1].function_call is the deprecated form of tool calls, which meshinfer "
                                  "does not read; send tool_calls (see docs/api.md)")
    ok = parse_chat_request({"model": "m", "messages": [{"role": "assistant", "content": "x", "tool_calls": []}]})
    assert ok.messages == [{"role": "assistant", "content": "x"}] and ok.tool_field is None


# --------------------------------------------------------------------------- the real default model
EMOJI = [{"role": "user", "content": "Repeat exactly, nothing else: 🦀🪐🧬"}]  # rare emoji: several tokens each


@pytest.fixture(scope="module")
def default_model():
    from helpers.realmodels import model_path
    from helpers.meshkit import file_hash
    from meshinfer.text.tokenizer import Tokenizer
    from helpers.realmodels import DEFAULT

    path = model_path(DEFAULT)
    return file_hash(path), Tokenizer.from_gguf(path)


async def raw_stream(server, body) -> list[bytes]:
    """The ``data:`` lines of a streaming request, as the bytes that came over the socket."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/chat/completions", json=dict(body, stream=True)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            return [line.rstrip(b"\n") for line in [ln async for ln in r.content] if line.startswith(b"data: ")]


@pytest.mark.realmodel
async def test_real_model_two_peers_match_chat_and_stream_whole_utf8_characters(default_model, tmp_path):
    from meshinfer.text.stream import StreamDecoder
    from helpers.realmodels import DEFAULT, load_cases, shard_of
    from helpers.meshkit import chat_json

    digest, tok = default_model
    case = next(iter(load_cases(DEFAULT).values()))
    async with mesh([shard_of(DEFAULT, 0, 12), shard_of(DEFAULT, 12, 24)], weights_hash=digest,
                    bundle=tok.to_bundle(), advert_ttl_s=STEADY_TTL_S) as peers:
        _, ref = await session_reply(peers, tok, case["messages"], 8)
        _, emoji_ref = await session_reply(peers, tok, EMOJI, 8)
        chat = await chat_json(peers[0].addrs[0], case["messages"], tmp_path, max_tokens=8)
        async with served(peers) as (server, api):
            got = await api.chat.completions.create(model=DEFAULT, messages=case["messages"], max_tokens=8)
            text, finish, _, _ = await streamed(api, model=DEFAULT, messages=case["messages"], max_tokens=8)
            lines = await raw_stream(server, {"model": DEFAULT, "messages": EMOJI, "max_tokens": 8})
    assert got.choices[0].message.content == tok.decode(ref.token_ids) == chat["text"] == text
    assert got.choices[0].finish_reason == ref.finish_reason == finish
    assert got.usage.completion_tokens == len(ref.token_ids) == len(chat["token_ids"])
    decoder = StreamDecoder(tok)
    assert "" in [decoder.push(t) for t in emoji_ref.token_ids]  # some token ends inside a character
    assert lines[-1] == b"data: [DONE]"
    pieces = [c["delta"].get("content") or "" for line in lines[:-1]
              for c in json.loads(line[len(b"data: "):].decode("utf-8", errors="strict"))["choices"]]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(emoji_ref.token_ids)
    assert any(ord(ch) > 0xFFFF for ch in "".join(pieces))  # astral characters: 4 UTF-8 bytes each


def test_cli_refuses_bad_serve_and_sampling_flags_in_one_line(capsys):
    from meshinfer.app.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert capsys.readouterr().err.strip() == "error: --port 70000 is not a TCP port"
    assert main(["chat", "-p", "hi", "--temperature", "-1", "--peers", "ws://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.strip() == "error: temperature -1.0 must be in [0, 100]"
