"""The tiny Qwen3-MoE GGUF in a real in-process mesh: 2 peers give the tokens of single-process
``generate``, alone and batched; hidden states travel as float32; speculative decoding and
failover are unchanged. Last, the same through the command line: two ``join`` processes and
``chat`` against ``generate``.
"""

from __future__ import annotations


import pytest

from helpers.meshkit import AlwaysDraft, file_hash, generate_through, generate_through_a_middle_crash, mesh, split
from meshinfer.wire import protocol, tensors
from meshinfer.core.config import LayerRange
from meshinfer.wire.discovery import verify_advert
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.client.mesh import MeshClient
from meshinfer.text.tokenizer import Tokenizer

from helpers import hf_families as hff  # noqa: E402  (needs transformers)
from helpers.batching import PROMPTS, UNLIMITED, alone_then_together  # noqa: E402

REPEAT = [{"role": "user", "content": "abc abc abc abc abc abc abc abc"}]
STORY = [{"role": "user", "content": "tell me a long story about experts and routers"}]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(gguf path, weights hash, tokenizer, whole-model shard) of a tiny random Qwen3-MoE."""
    path = hff.write_gguf(hff.hf_model("qwen3moe", seed=2), "qwen3moe", tmp_path_factory.mktemp("moe") / "moe.gguf")
    return path, file_hash(path), Tokenizer.from_gguf(path), load_shard(path)


async def test_two_peers_give_the_tokens_of_generate_with_float32_hidden_states(moe, monkeypatch):
    path, digest, tok, whole = moe
    wire_dtypes = []
    real = tensors.tensor_to_wire

    def spy(t, dtype="f32"):
        out = real(t, dtype)
        wire_dtypes.append(out["dtype"])
        return out

    monkeypatch.setattr(tensors, "tensor_to_wire", spy)
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        assert [p.cfg.architecture for p in peers] == ["qwen3moe", "qwen3moe"]
        for p in peers:  # adverts carry resident and active weights, signed
            ad = protocol.PeerAdvert.from_wire(p.advert().to_wire())
            assert (ad.params, ad.active_params) == p.cfg.parameter_counts(p.shard.range)
            assert 0 < ad.active_params < ad.params and verify_advert(ad)
        route, ids, out = await generate_through(peers, tok, STORY, max_tokens=24)
    assert [h.layers for h in route.hops] == [LayerRange(0, 2), LayerRange(2, 4)]
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=24).token_ids
    assert wire_dtypes and set(wire_dtypes) == {"f32"}  # expert routing sees the exact activations


async def test_concurrent_conversations_batch_and_give_the_tokens_each_gives_alone(moe):
    path, digest, tok, _ = moe
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle(), client_limits=UNLIMITED) as peers:
        alone, together, batched = await alone_then_together(peers, tok, PROMPTS[:6], max_tokens=10,
                                                             stagger_s=0.005)
    assert together == alone and all(len(t) == 10 for t in alone)
    assert all(b > 0 for b in batched), batched  # both hops ran batched passes
    assert all(p.batch_stats.fallbacks == 0 for p in peers)


async def test_speculative_decoding_equals_plain_greedy(moe):
    path, digest, tok, whole = moe
    async with mesh(split(lambda r: load_shard(path, r), [0, 2, 4]), weights_hash=digest,
                    bundle=tok.to_bundle()) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            ids = tok.encode_chat(REPEAT)
            conv = client.conversation(route, max_tokens_total=len(ids) + 40, draft_tokens=6)
            conv.policy = AlwaysDraft()  # on loopback the measured policy may rightly not draft
            try:
                out = await conv.generate(ids, max_tokens=40, eos_ids=())
            finally:
                await conv.close()
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=40).token_ids
    assert out.speculative["steps"] > 0 and out.speculative["proposed"] > 0


async def test_failover_of_the_middle_hop_replays_and_matches_generate(moe):
    path, digest, tok, whole = moe
    ids = tok.encode_chat(STORY)
    out, mid = await generate_through_a_middle_crash(path, digest, tok.to_bundle(), ids, 30)
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=30).token_ids
    assert [f["failed"] for f in out.failovers] == [[mid.peer_id]]


@pytest.mark.slow
def test_cli_chat_over_two_joined_peers_equals_cli_generate(moe, tmp_path):
    """The user's path: ``meshinfer join`` twice (layers 0-1 and 2-3), then ``chat``; its tokens
    equal ``meshinfer generate`` on the same MoE GGUF."""
    import json
    import os
    import re
    import subprocess
    import sys

    path = str(moe[0])
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path))

    def join(layers: str, *bootstrap: str) -> tuple[subprocess.Popen, str]:
        log = tmp_path / f"join-{layers}.log"  # a file, not a pipe nobody drains
        proc = subprocess.Popen([sys.executable, "-m", "meshinfer", "join", "--model", path, "--layers", layers,
                                 "--listen", "127.0.0.1:0", "--key", str(tmp_path / f"{layers}.pem"),
                                 *(("--peers", *bootstrap) if bootstrap else ())],
                                stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
        line = proc.stdout.readline()
        m = re.search(r"ready: peer \w+ serving layers [\d-]+ of 4 at (ws://127\.0\.0\.1:\d+)", line)
        assert m, line + log.read_text()
        return proc, m.group(1)

    def cli(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "meshinfer", *args, "-p", "hello experts", "--max-tokens", "8",
                              "--json"], capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    procs = []
    try:
        first, url = join("0-1")
        procs.append(first)
        procs.append(join("2-3", url)[0])
        for _ in range(5):  # the second peer's advert reaches the first when it bootstraps, or one gossip later
            status = subprocess.run([sys.executable, "-m", "meshinfer", "status", "--peers", url, "--require-route"],
                                    capture_output=True, text=True, timeout=60, env=env)
            if status.returncode == 0:
                break
        assert status.returncode == 0, status.stdout + status.stderr
        chat = cli("chat", "--peers", url)
        generate = cli("generate", "--model", path)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [h["layers"] for h in chat["route"]] == ["0-1", "2-3"]
    assert chat["token_ids"] == generate["token_ids"] and len(chat["token_ids"]) > 0
