"""Exactness on the real models: reference cases, splits, step-by-step decode, a long prompt."""

from __future__ import annotations

import pytest
import torch

from meshinfer.engine.generate import greedy_generate, new_cache
from meshinfer.engine.models.llama import Shard
from helpers.realmodels import DEFAULT, SMOL, first_near_tie, full_tensors, load_cases, shard_of

pytestmark = pytest.mark.realmodel


def case_params():
    return [(m, c) for m in (DEFAULT, SMOL) for c in load_cases(m)]


@pytest.mark.parametrize("model,case", case_params())
def test_teacher_forced_top8_logits_match_reference(model, case):
    c = load_cases(model)[case]
    shard = shard_of(model, 0, full_tensors(model)[0].num_hidden_layers)
    ids = torch.tensor([c["prompt_ids"] + c["greedy_ids"]])
    logits = shard(ids, 0, logits="all")[0]  # (T, V)
    P = len(c["prompt_ids"])
    for j, (top_ids, top_logits) in enumerate(zip(c["top8_ids"], c["top8_logits"])):
        got = logits[P - 1 + j, torch.tensor(top_ids)]
        err = (got - torch.tensor(top_logits)).abs().max().item()
        assert err < 1e-2, f"{model}/{case} position {j}: top-8 logits differ by {err}"


@pytest.mark.parametrize("model,case", case_params())
def test_free_running_greedy_matches_reference(model, case):
    c = load_cases(model)[case]
    shard = shard_of(model, 0, full_tensors(model)[0].num_hidden_layers)
    n = first_near_tie(c)
    out = greedy_generate(shard, c["prompt_ids"], max_tokens=len(c["greedy_ids"]), eos_ids=())
    assert out.token_ids[:n] == c["greedy_ids"][:n]


def decode_through(shards: list[Shard], prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Prefill then greedy decode through a chain of shards; return prefill logits and tokens."""
    caches = [new_cache(s) for s in shards]

    def chain(x, start):
        for s, cache in zip(shards, caches):
            x = s(x, start, cache, logits="all")
        return x

    prefill = chain(torch.tensor([prompt]), 0)[0]  # (T, V)
    tokens = [int(prefill[-1].argmax())]
    for _ in range(steps):
        logits = chain(torch.tensor([[tokens[-1]]]), caches[0].length)
        tokens.append(int(logits[0, -1].argmax()))
    return prefill, tokens


@pytest.mark.parametrize("cuts", [[12], [8, 16], list(range(1, 24))], ids=["2-shards", "3-shards", "24-shards"])
def test_splits_equal_whole_model(cuts):
    cfg, _ = full_tensors(DEFAULT)
    prompt = load_cases(DEFAULT)["prime"]["prompt_ids"]
    whole_logits, whole_tokens = decode_through([shard_of(DEFAULT, 0, 24)], prompt, 6)
    bounds = [0, *cuts, cfg.num_hidden_layers]
    shards = [shard_of(DEFAULT, a, b) for a, b in zip(bounds, bounds[1:])]
    split_logits, split_tokens = decode_through(shards, prompt, 6)
    rel = ((split_logits - whole_logits).abs().max() / whole_logits.abs().max()).item()
    assert rel < 1e-4, f"split prefill logits differ by {rel} relative"
    assert split_tokens == whole_tokens


def test_step_by_step_decode_equals_full_forward():
    shard = shard_of(SMOL, 0, 30)
    ids = load_cases(SMOL)["prime"]["prompt_ids"]
    full = shard(torch.tensor([ids]), 0, logits="all")[0]  # (T, V)
    cache = new_cache(shard)
    steps = torch.stack([shard(torch.tensor([[t]]), i, cache)[0, -1] for i, t in enumerate(ids)])
    rel = ((steps - full).abs().max() / full.abs().max()).item()
    assert rel < 1e-4, f"step-by-step logits differ by {rel} relative"


def test_long_prompt_prefills_in_chunks():
    shard = shard_of(DEFAULT, 0, 24)
    prompt = (load_cases(DEFAULT)["prime"]["prompt_ids"][:-5] * 100)[:3000]
    out = greedy_generate(shard, prompt, max_tokens=2)
    assert len(out.prompt_ids) == 3000
    assert len(out.token_ids) + (out.finish_reason == "stop") >= 1
    assert all(0 <= t < shard.cfg.vocab_size for t in out.token_ids)


def test_a_verification_step_gives_the_logits_of_one_position_at_a_time():
    """A step of several positions runs the float projections and the output head through the
    C kernel for a few rows (``common.linear``); its logits at each position equal those of feeding the
    positions one by one, within 1e-4 and with the same argmax."""
    c = next(iter(load_cases(DEFAULT).values()))
    shard = shard_of(DEFAULT, 0, full_tensors(DEFAULT)[0].num_hidden_layers)
    prompt, step = c["prompt_ids"], c["greedy_ids"][:9]
    cache = new_cache(shard)
    shard(torch.tensor([prompt]), 0, cache)
    together = shard(torch.tensor([step]), len(prompt), cache, logits="all")[0]  # (9, V)
    cache = new_cache(shard)
    shard(torch.tensor([prompt]), 0, cache)
    for j, token in enumerate(step):
        alone = shard(torch.tensor([[token]]), len(prompt) + j, cache)[0, -1]  # (V,)
        assert (alone - together[j]).abs().max() <= 1e-4 * alone.abs().max()
        assert int(alone.argmax()) == int(together[j].argmax())


@pytest.mark.parametrize("rows", [1, 2, 9, 64, 65])
def test_linear_equals_torchs_linear(rows, monkeypatch):
    """Without the C kernel (``matmul_f32`` declining), ``common.linear`` takes the transposed
    form for 2-64 rows and a large weight, else ``F.linear``; either way it equals ``F.linear``
    up to summation order."""
    from meshinfer.engine.models import common
    from meshinfer.engine.models.common import Linear, linear

    monkeypatch.setattr(common, "matmul_f32", lambda x, w: None)

    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(300, 96, generator=g), torch.randn(300, generator=g), torch.randn(1, rows, 96, generator=g)
    monkeypatch.setattr(common, "TRANSPOSED_MIN_WEIGHT", w.numel())  # this small weight counts as large
    calls = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(common.F, "linear", lambda *a: calls.append(1) or real(*a))
    want = real(x, w, b)
    got = linear(x, w, b)
    assert (len(calls) == 0) == (2 <= rows <= common.TRANSPOSED_MAX_ROWS)
    assert got.shape == (1, rows, 300) and got.is_contiguous()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    m = Linear(96, 300)
    m.load_state_dict({"weight": w, "bias": b})  # the same state dict as nn.Linear
    assert torch.equal(m(x), got)
