"""The two real models, dequantized once per test session, and their reference cases."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from conftest import model_path
from meshinfer.core.config import LayerRange
from meshinfer.engine.models.llama import Shard
from meshinfer.engine.models.quant import parse_precision
from meshinfer.engine.weights import open_weights

#: Reference cases (token ids from an independent float32 implementation; tests/data/cases/README.md),
#: kept in the repository so that no test reads outside it.
CASES = Path(__file__).resolve().parent / "data" / "cases"
DEFAULT = "qwen2.5-coder-0.5b-instruct-q4_k_m"
SMOL = "smollm2-135m-instruct-q4_1"


@lru_cache(maxsize=2)
def full_tensors(name: str) -> tuple:
    """(config, {module name: f32 tensor}) of the whole model, dequantized once per session."""
    src = open_weights(model_path(name))
    everything = LayerRange(0, src.config.num_hidden_layers)
    return src.config, dict(src.iter_shard_tensors(everything))


def shard_of(name: str, start: int, stop: int, precision: str = "f32", device: str = "cpu") -> Shard:
    """A shard built from the cached tensors: exactly the tensors a real load would read,
    at ``precision`` (see ``meshinfer.engine.models.quant``), on ``device``."""
    cfg, tensors = full_tensors(name)
    layers = LayerRange(start, stop)
    wanted = [(n, t) for n, t in tensors.items()
              if (n.startswith("layers.") and int(n.split(".")[1]) in layers)
              or (n == "embed_tokens.weight" and start == 0)
              or (n in ("norm.weight", "lm_head.weight") and stop == cfg.num_hidden_layers)]
    return Shard.from_tensors(cfg, layers, wanted, precision=parse_precision(precision), device=device)


def load_cases(name: str) -> dict:
    """The reference cases of model ``name`` from ``tests/data/cases``."""
    return json.loads((CASES / f"{name}.json").read_text())


def first_near_tie(c: dict) -> int:
    """Index of the first generated position whose reference top-1/top-2 gap is < 0.02."""
    for j, top in enumerate(c["top8_logits"]):
        if top[0] - top[1] < 0.02:
            return j
    return len(c["greedy_ids"])
