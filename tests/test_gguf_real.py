"""The gguf precisions on the real models: the f32 reference cases, exact chaining of shards, and
the integer-activation modes' agreement (docs/performance.md, "The file's own blocks")."""

from __future__ import annotations

import pytest
import torch

from meshinfer.engine.generate import greedy_generate, load_shard
from helpers.realmodels import DEFAULT, SMOL, first_near_tie, load_cases, model_path, require_realmodel_marker

pytestmark = pytest.mark.realmodel


def _shard(name: str, precision: str, start: int = 0, stop: int | None = None):
    from meshinfer.core.config import LayerRange
    from meshinfer.engine.weights import open_weights

    require_realmodel_marker(name)
    src = open_weights(model_path(name))
    return load_shard(src, LayerRange(start, stop or src.config.num_hidden_layers), dtype=precision)


@pytest.mark.parametrize("name", [DEFAULT, SMOL])
def test_gguf_matches_the_reference_cases(name):
    """Exact weights and float32 activations: the independent float32 reference's top-8 logits
    within 1e-2 at every teacher-forced position and its greedy tokens up to the first near-tie,
    as f32 itself (tests/test_model_reference.py)."""
    shard = _shard(name, "gguf")
    for case, c in load_cases(name).items():
        P = len(c["prompt_ids"])
        logits = shard(torch.tensor([c["prompt_ids"] + c["greedy_ids"]]), 0, logits="all")[0]  # (T, V)
        for j, (ids, ref) in enumerate(zip(c["top8_ids"], c["top8_logits"])):
            err = (logits[P - 1 + j, torch.tensor(ids)] - torch.tensor(ref)).abs().max().item()
            assert err < 1e-2, f"{name}/{case} position {j}: top-8 logits differ by {err}"
        n = first_near_tie(c)
        out = greedy_generate(shard, c["prompt_ids"], max_tokens=len(c["greedy_ids"]), eos_ids=())
        assert out.token_ids[:n] == c["greedy_ids"][:n], f"{name}/{case}"


#: Largest |logit - reference| over the reference's top 8 at each teacher-forced position.
#: Measured on the default model's 3 cases (63 positions): gguf under 5e-5, gguf-a16 0.0007,
#: gguf-a8 0.20, and top-1 equal to the reference at all 63 in every mode (2026-12-02, AMD EPYC,
#: AVX2). The bounds leave room for other CPUs' summation orders (the portable C path).
A16_LOGIT_TOLERANCE, A8_LOGIT_TOLERANCE = 0.02, 1.0


@pytest.mark.parametrize("precision,tol", [("gguf-a16", A16_LOGIT_TOLERANCE), ("gguf-a8", A8_LOGIT_TOLERANCE)])
def test_integer_activation_modes_stay_within_tolerance_of_the_reference(precision, tol):
    shard = _shard(DEFAULT, precision)
    agree = total = 0
    for case, c in load_cases(DEFAULT).items():
        P, n = len(c["prompt_ids"]), len(c["greedy_ids"])
        logits = shard(torch.tensor([c["prompt_ids"] + c["greedy_ids"]]), 0, logits="all")[0]  # (T, V)
        for j in range(n):
            ids, ref = c["top8_ids"][j], torch.tensor(c["top8_logits"][j])
            err = (logits[P - 1 + j, torch.tensor(ids)] - ref).abs().max().item()
            assert err <= tol, f"{precision} {case} position {j}: a top-8 logit is {err:.3f} off the reference"
        top1 = logits[P - 1:P - 1 + n].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(top1, c["greedy_ids"]))
        total += n
    assert agree / total >= 0.95, f"{precision}: top-1 agrees on {agree} of {total} positions"


def test_a_gguf_split_equals_the_whole_model_exactly():
    """Two shards at gguf-a16 chained give the whole shard's logits bit for bit (each row is
    computed on its own), so a mesh of them chooses what one process chooses."""
    whole = _shard(DEFAULT, "gguf-a16")
    L = whole.cfg.num_hidden_layers
    a, b = _shard(DEFAULT, "gguf-a16", 0, L // 2), _shard(DEFAULT, "gguf-a16", L // 2, L)
    ids = torch.tensor([load_cases(DEFAULT)["prime"]["prompt_ids"]])  # (1, P)
    assert torch.equal(b(a(ids, 0), 0, logits="all"), whole(ids, 0, logits="all"))
    step = torch.tensor([[42]])
    from meshinfer.engine.generate import new_cache
    ca, cb, cw = new_cache(a), new_cache(b), new_cache(whole)
    b(a(ids, 0, ca), 0, cb), whole(ids, 0, cw)
    assert torch.equal(b(a(step, ca.length, ca), cb.length, cb), whole(step, cw.length, cw))  # a decode step


@pytest.mark.parametrize("stranger_rows", [10, 24, 40, 120])
def test_a_step_batched_with_a_strangers_rows_gets_its_solo_bits_on_the_real_model(stranger_rows):
    """An attack run: a 23-position step of the default model at gguf-a8, packed with 10 or 24 rows
    of another conversation (33 or 47 rows), got other logits and a different token than alone,
    because SwiGLU switched from C to torch at 33 rows; with 40 or 120 rows (the dense path, from
    48) the logits moved by up to 2.5e-2. A packed pass now computes every row as alone."""
    import copy

    from meshinfer.engine.generate import new_cache

    shard = _shard(DEFAULT, "gguf-a8")
    victim, stranger = new_cache(shard), new_cache(shard)
    shard(torch.arange(1000, 1030).unsqueeze(0), 0, victim)
    shard(torch.arange(2000, 2030).unsqueeze(0), 0, stranger)
    alone = copy.deepcopy(victim)
    x, y = torch.arange(3000, 3023).unsqueeze(0), torch.arange(4000, 4000 + stranger_rows).unsqueeze(0)
    want = shard(x, 30, alone, logits="all")
    got = shard.forward_batch([x, y], [30, 30], [victim, stranger], logits="all")[0]
    assert torch.equal(got, want)


def test_a_peer_without_avx2_chooses_the_same_bits_on_the_real_model(tmp_path, monkeypatch):
    """The default model at gguf-a8 on the kernels' portable C path (built without ``-march``,
    as on an Arm Mac's baseline) gives the AVX2 build's prefill and decode logits bit for bit
    (with this machine's torch for the rest: docs/performance.md, "On other CPUs")."""
    from helpers.portable import portable_library
    from meshinfer.engine.generate import new_cache
    from meshinfer.engine.kernels import native

    portable = portable_library(tmp_path)
    shard = _shard(DEFAULT, "gguf-a8")
    ids = torch.tensor([load_cases(DEFAULT)["prime"]["prompt_ids"]])  # (1, P)

    def run():
        cache = new_cache(shard)
        outs = [shard(ids, 0, cache)]
        for token in (42, 7, 1000):
            outs.append(shard(torch.tensor([[token]]), cache.length, cache))
        return outs

    want = run()
    monkeypatch.setattr(native, "library", lambda: portable)
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
