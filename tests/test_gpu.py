"""A CUDA peer picks the same greedy tokens as a CPU peer in float32 (issue 6, part 7).

Marked ``gpu`` and left out of the default run (``addopts = -m "not gpu"``: CI has no GPU).
On a machine with one:

    python -m pytest -q -m gpu tests/test_gpu.py

``MESHINFER_TEST_DEVICE`` names the device under test (default ``cuda``); with ``cpu`` the same
checks run against the CPU itself, which is how they are exercised where there is no GPU. A
missing device fails the run with the reason (it never skips).

Kernels differ between devices, so logits differ in the last bits; tokens are compared up to
the first position where the CPU's top-2 logits are closer than :data:`NEAR_TIE` (a near tie
may fairly go either way), and each test checks that enough positions were compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.meshkit import file_hash, mesh
from meshinfer.core.config import LayerRange
from meshinfer.core.errors import DeviceError
from meshinfer.engine.executor import parse_device
from meshinfer.engine.generate import load_shard, new_cache
from meshinfer.client.mesh import MeshClient
from helpers.realmodels import DEFAULT, SMOL, first_near_tie, full_tensors, load_cases, shard_of
from helpers.batching import compare_batched_with_single
from helpers.tiny import random_weights, tiny_config, write_gguf

DEVICE = os.environ.get("MESHINFER_TEST_DEVICE", "cuda")
#: Top-1 minus top-2 logit below which a position counts as a near tie: another kernel moves
#: float32 logits by about 1e-5 (batched against single passes, see tests/test_batching.py), so a
#: larger gap cannot flip; GPU kernels may round differently, hence 100x that.
NEAR_TIE = 1e-3
PROMPTS = [[1, 2, 3], [7] * 20, [40, 41, 42, 43, 44, 45], [100, 3, 100, 3, 9], [250, 251], [5, 17, 29, 31, 60, 61, 62]]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def device_present():
    try:
        parse_device(DEVICE)
    except DeviceError as exc:
        pytest.fail(f"{exc} (these tests need device {DEVICE!r}; MESHINFER_TEST_DEVICE=cpu runs them on the CPU)")


@torch.inference_mode()
def greedy_with_gaps(shard, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens and, per token, the gap between its logit and the runner-up's."""
    cache = new_cache(shard)
    logits = shard(torch.tensor([prompt]), 0, cache)  # (1, 1, V)
    tokens, gaps = [], []
    for _ in range(n):
        top = logits[0, -1].float().topk(2)
        tokens.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        logits = shard(torch.tensor([[tokens[-1]]]), cache.length, cache)
    return tokens, gaps


def until_near_tie(gaps: list[float]) -> int:
    return next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))


def test_whole_model_on_the_device_picks_the_cpu_tokens_tiny(tiny):
    path = tiny[0]
    cpu, dev = load_shard(path), load_shard(path, device=DEVICE)
    assert dev.device.type == torch.device(DEVICE).type
    compared = 0
    for prompt in PROMPTS:
        want, gaps = greedy_with_gaps(cpu, prompt, 16)
        got, _ = greedy_with_gaps(dev, prompt, 16)
        k = until_near_tie(gaps)
        assert got[:k] == want[:k], (prompt, k)
        compared += k
    assert compared >= 40, compared


def test_batched_decode_on_the_device_equals_single_steps_tiny(tiny):
    path = tiny[0]
    shards = [load_shard(path, LayerRange(0, 2), device=DEVICE), load_shard(path, LayerRange(2, 4), device=DEVICE)]
    assert compare_batched_with_single(shards, PROMPTS, steps=4) == 4 * len(PROMPTS)


@pytest.mark.parametrize("devices", [("cpu", DEVICE), (DEVICE, "cpu"), (DEVICE, DEVICE)],
                         ids=["cpu-then-device", "device-then-cpu", "device-only"])
async def test_a_route_across_devices_picks_the_cpu_tokens_tiny(tiny, devices):
    path, digest, tok, _ = tiny
    cpu = load_shard(path)
    shards = [load_shard(path, r, device=d) for r, d in zip([LayerRange(0, 2), LayerRange(2, 4)], devices)]
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), devices=devices) as peers:
        assert [torch.device(p.advert().device).type for p in peers] == [torch.device(d).type for d in devices]
        compared = 0
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            assert [h.layers for h in route.hops] == [LayerRange(0, 2), LayerRange(2, 4)]
            for prompt in PROMPTS:
                want, gaps = greedy_with_gaps(cpu, prompt, 12)
                conv = client.conversation(route, max_tokens_total=len(prompt) + 12, speculate=False)
                try:
                    got = (await conv.generate(prompt, max_tokens=12, eos_ids=())).token_ids
                finally:
                    await conv.close()
                k = until_near_tie(gaps)
                assert got[:k] == want[:k], (prompt, k)
                compared += k
        assert compared >= 30, compared


@pytest.mark.realmodel
@pytest.mark.parametrize("name", [DEFAULT, SMOL])
def test_reference_cases_on_the_device(name):
    """The independent float32 reference's greedy tokens, up to each case's first near tie."""
    layers = full_tensors(name)[0].num_hidden_layers
    shard = shard_of(name, 0, layers, device=DEVICE)
    compared = 0
    for case in load_cases(name).values():
        got, _ = greedy_with_gaps(shard, case["prompt_ids"], len(case["greedy_ids"]))
        k = first_near_tie(case)
        assert got[:k] == case["greedy_ids"][:k]
        compared += k
    assert compared >= 20, compared


@pytest.mark.realmodel
@pytest.mark.parametrize("name", [DEFAULT, SMOL])
async def test_a_cpu_and_device_route_gives_the_reference_tokens(name):
    from helpers.realmodels import model_path
    from meshinfer.text.tokenizer import Tokenizer

    path = model_path(name)
    layers = full_tensors(name)[0].num_hidden_layers
    shards = [shard_of(name, 0, layers // 2), shard_of(name, layers // 2, layers, device=DEVICE)]
    bundle = Tokenizer.from_gguf(path).to_bundle()
    async with mesh(shards, weights_hash=file_hash(path), bundle=bundle, devices=["cpu", DEVICE]) as peers:
        async with MeshClient(list(peers[0].addrs)) as client:
            route = await client.plan()
            compared = 0
            for case in load_cases(name).values():
                k = first_near_tie(case)
                conv = client.conversation(route, max_tokens_total=len(case["prompt_ids"]) + k, speculate=False)
                try:
                    got = (await conv.generate(case["prompt_ids"], max_tokens=k, eos_ids=())).token_ids
                finally:
                    await conv.close()
                assert got == case["greedy_ids"][:k]
                compared += k
            assert compared >= 20, compared


def test_bench_single_runs_the_precisions_on_the_device_against_the_cpu_reference_tiny(tmp_path):
    """``bench --single --device``: the f32 and bf16 rows ran on the device, their fidelity is
    against f32 on the CPU, and a CUDA row reports its peak device memory."""
    cfg = tiny_config("qwen2", context=2048)  # the benchmark's long prompt is 1,000 tokens
    model = write_gguf(tmp_path / "tiny.gguf", cfg, random_weights(cfg, seed=5))
    report = tmp_path / "single.json"
    out = subprocess.run([sys.executable, "-m", "meshinfer", "bench", "--single", "--device", DEVICE,
                          "--model", str(model), "--dtypes", "f32,bf16", "--threads", "1", "--max-tokens", "6",
                          "--llama-python", str(tmp_path / "none"), "--no-transformers", "--no-join",
                          "--out", str(report)], capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, MESHINFER_HOME=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    f32, bf16, _llama = json.loads(report.read_text())
    assert (f32["precision"], f32["device"], bf16["precision"], bf16["device"]) == ("f32", DEVICE, "bf16", DEVICE)
    assert f32["decode_tok_s"] > 0 and bf16["decode_tok_s"] > 0
    assert f32["fidelity_top1"] >= 0.9, f32  # the device's f32 kernels move logits by ~1e-5
    assert 0 <= bf16["fidelity_greedy"] <= 1 and 0 <= bf16["fidelity_top1"] <= 1
    if torch.device(DEVICE).type == "cuda":
        assert f32["peak_device_mib"] > 0 and "| f32 (cuda" in out.stdout
    else:
        assert f32["peak_device_mib"] is None and f32["fidelity_greedy"] == 1.0  # the reference itself
