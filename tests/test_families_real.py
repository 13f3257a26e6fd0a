"""The real Gemma 3 270M GGUF (``meshinfer pull gemma3-270m-q4_k_m``) against reference cases
written by transformers from the same file (tests/data/cases/README.md): teacher-forced top-8
logits, free-running greedy tokens, a chain of shards across sliding and full layers, step by
step. Token ids only: meshinfer does not read its SentencePiece tokenizer yet.
"""

from __future__ import annotations

import pytest
import torch

from helpers.hf_families import rel, run_chain
from helpers.realmodels import first_near_tie, load_cases, model_path
from meshinfer.core.config import LayerRange
from meshinfer.engine.generate import greedy_generate, load_shard

pytestmark = pytest.mark.realmodel
GEMMA3 = "gemma3-270m-q4_k_m"


@pytest.fixture(scope="module")
def gemma3():
    path = model_path(GEMMA3)
    return path, load_shard(path)


@pytest.mark.parametrize("case", sorted(load_cases(GEMMA3)))
def test_teacher_forced_top8_logits_and_greedy_tokens_match_reference(gemma3, case):
    _, shard = gemma3
    c = load_cases(GEMMA3)[case]
    logits = shard(torch.tensor([c["prompt_ids"] + c["greedy_ids"]]), 0, logits="all")[0]  # (T, V)
    P = len(c["prompt_ids"])
    for j, (ids, values) in enumerate(zip(c["top8_ids"], c["top8_logits"])):
        err = (logits[P - 1 + j, torch.tensor(ids)] - torch.tensor(values)).abs().max().item()
        assert err < 1e-2, f"{case} position {j}: top-8 logits differ by {err}"
    n = first_near_tie(c)
    assert greedy_generate(shard, c["prompt_ids"], max_tokens=n).token_ids == c["greedy_ids"][:n]


def test_shards_across_sliding_and_full_layers_equal_the_whole_model_step_by_step(gemma3):
    """Cuts at 5 and 12 (layer 5 is the first full-attention layer, 11 the second)."""
    path, whole = gemma3
    c = load_cases(GEMMA3)["prime"]
    prompt, follow = c["prompt_ids"], c["greedy_ids"][:6]
    want = run_chain([whole], prompt, follow)
    chain = [load_shard(path, LayerRange(a, b)) for a, b in ((0, 5), (5, 12), (12, 18))]
    assert rel(run_chain(chain, prompt, follow), want) < 1e-4
    full = whole(torch.tensor([prompt + follow]), 0, logits="all")[0]  # one pass: (P + 6, V)
    assert rel(want, full) < 1e-4
