"""The default model on a loopback mesh, driven through the real `meshinfer chat --json` command."""

from __future__ import annotations

import asyncio

import pytest

from helpers.meshkit import chat_json, file_hash, mesh
from helpers.realmodels import DEFAULT, first_near_tie, load_cases, model_path, shard_of
from meshinfer.client.mesh import MeshClient
from meshinfer.text.tokenizer import Tokenizer

pytestmark = pytest.mark.realmodel


def until_eos(ids: list[int], eos_ids) -> tuple[list[int], bool]:
    """The reference ids before the first end-of-generation id, and whether there was one."""
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i], True
    return ids, False


@pytest.fixture(scope="module")
def default_model():
    path = model_path(DEFAULT)
    return file_hash(path), Tokenizer.from_gguf(path).to_bundle()


@pytest.mark.parametrize("bounds", [[0, 12, 24], [0, 8, 16, 24]], ids=["2-peers", "3-peers"])
async def test_chat_json_matches_reference_cases(default_model, bounds, tmp_path):
    digest, bundle = default_model
    shards = [shard_of(DEFAULT, a, b) for a, b in zip(bounds, bounds[1:])]
    async with mesh(shards, weights_hash=digest, bundle=bundle) as peers:
        for name, case in load_cases(DEFAULT).items():
            got = await chat_json(peers[0].addrs[0], case["messages"], tmp_path)
            assert got["prompt_ids"] == case["prompt_ids"], name
            expected, stopped = until_eos(case["greedy_ids"][:first_near_tie(case)], bundle["eos_ids"])
            assert got["token_ids"][:len(expected)] == expected, name
            if stopped:  # the reference ended before any near-tie: so must we
                assert got["finish_reason"] == "stop" and len(got["token_ids"]) == len(expected), name
            assert [h["layers"] for h in got["route"]] == [f"{a}-{b - 1}" for a, b in zip(bounds, bounds[1:])]
            assert got["ttft_ms"] > 0 and got["decode_tokens_per_s"] > 0
            assert all(h["compute_ms_per_token"] > 0 and h["precision"] == "f32" for h in got["route"])


async def test_same_peers_serve_conversations_in_a_row_and_at_once(default_model):
    digest, bundle = default_model
    tok = Tokenizer.from_bundle(bundle)
    cases = list(load_cases(DEFAULT).values())
    async with mesh([shard_of(DEFAULT, 0, 12), shard_of(DEFAULT, 12, 24)], weights_hash=digest,
                    bundle=bundle) as peers:
        baseline = [(p.kv_bytes_used, p.free_kv_tokens) for p in peers]
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()

            async def one(case):
                conv = client.conversation(route, max_tokens_total=len(case["prompt_ids"]) + 8)
                try:
                    out = await conv.generate(case["prompt_ids"], max_tokens=8, eos_ids=tok.eos_ids)
                finally:
                    await conv.close()
                expected, _ = until_eos(case["greedy_ids"][:min(8, first_near_tie(case))], tok.eos_ids)
                assert out.token_ids[:len(expected)] == expected

            for i in range(5):
                await one(cases[i % len(cases)])
            await asyncio.gather(*(one(cases[i % len(cases)]) for i in range(4)))
        await asyncio.sleep(0.2)
        assert [(p.kv_bytes_used, p.free_kv_tokens) for p in peers] == baseline
