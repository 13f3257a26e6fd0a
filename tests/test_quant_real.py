"""Quantized precisions on the real default model: agreement with the f32 reference cases and
exact chaining of shards. The measured agreement is recorded in docs/performance.md."""

from __future__ import annotations

import pytest
import torch

from meshinfer.engine.generate import greedy_generate
from helpers.realmodels import DEFAULT, full_tensors, load_cases, shard_of

pytestmark = pytest.mark.realmodel

#: Least fraction of teacher-forced positions whose q8 top-1 must equal the reference greedy token
#: (measured: 62 of 63 positions over the default model's three cases, docs/performance.md).
Q8_TEACHER_FORCED_TOP1 = 0.95


@pytest.fixture(scope="module")
def q8():
    return shard_of(DEFAULT, 0, full_tensors(DEFAULT)[0].num_hidden_layers, "q8-bf16")


def test_q8_teacher_forced_top1_agrees_with_reference(q8):
    agree = total = 0
    for c in load_cases(DEFAULT).values():
        P, n = len(c["prompt_ids"]), len(c["greedy_ids"])
        logits = q8(torch.tensor([c["prompt_ids"] + c["greedy_ids"]]), 0, logits="all")[0]  # (T, V)
        top1 = logits[P - 1:P - 1 + n].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(top1, c["greedy_ids"]))
        total += n
    assert agree / total >= Q8_TEACHER_FORCED_TOP1, f"q8 top-1 agrees on {agree} of {total} positions"


#: Largest |q8 logit - reference logit| allowed over the reference's top-8 ids at every
#: teacher-forced position. Measured: 0.31 at most (Intel Xeon, 2 threads, 63 positions x 8 ids);
#: the bound leaves 3x room for other CPUs, whose int8 kernels (AVX512-VNNI, AMX, NEON dot
#: products) quantize activations and accumulate in other orders. Greedy equality, even up to a
#: near-tie, is not asserted for a quantized precision: one changed choice changes every token after it.
Q8_LOGIT_TOLERANCE = 1.0


@pytest.mark.parametrize("case", list(load_cases(DEFAULT)))
def test_q8_teacher_forced_logits_within_tolerance_of_reference(q8, case):
    c = load_cases(DEFAULT)[case]
    P, n = len(c["prompt_ids"]), len(c["greedy_ids"])
    logits = q8(torch.tensor([c["prompt_ids"] + c["greedy_ids"]]), 0, logits="all")[0]  # (T, V)
    for j in range(n):
        row, ids, ref = logits[P - 1 + j], c["top8_ids"][j], torch.tensor(c["top8_logits"][j])
        err = (row[ids] - ref).abs().max().item()
        assert err <= Q8_LOGIT_TOLERANCE, f"position {j}: a top-8 logit is {err:.3f} off the reference"
        choice = int(row.argmax())  # a different choice only where the reference itself is close
        assert choice in ids and ref[0] - ref[ids.index(choice)] <= 2 * Q8_LOGIT_TOLERANCE, (
            f"position {j}: q8 chose {choice}, the reference {c['greedy_ids'][j]}")


@pytest.mark.parametrize("precision", ["q8-bf16", "gguf-a16"])
def test_quantized_split_equals_whole_model_at_that_precision(q8, precision):
    L = full_tensors(DEFAULT)[0].num_hidden_layers
    whole = q8 if precision == "q8-bf16" else shard_of(DEFAULT, 0, L, precision)
    a, b = shard_of(DEFAULT, 0, 12, precision), shard_of(DEFAULT, 12, L, precision)
    c = load_cases(DEFAULT)["prime"]
    ids = torch.tensor([c["prompt_ids"]])  # (1, P)
    assert torch.equal(b(a(ids, 0), 0, logits="all"), whole(ids, 0, logits="all"))  # (1, P, V)
    assert greedy_generate(whole, c["prompt_ids"], max_tokens=8).token_ids == \
        _chain_greedy(a, b, c["prompt_ids"], 8)


def _chain_greedy(a, b, prompt: list[int], steps: int) -> list[int]:
    from meshinfer.engine.generate import new_cache

    ca, cb = new_cache(a), new_cache(b)
    logits = b(a(torch.tensor([prompt]), 0, ca), 0, cb)  # (1, 1, V)
    tokens = [int(logits[0, -1].argmax())]
    while len(tokens) < steps:
        logits = b(a(torch.tensor([[tokens[-1]]]), ca.length, ca), cb.length, cb)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens
