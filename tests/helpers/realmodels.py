"""The two real models, dequantized once per test session, and their reference cases."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from meshinfer.core.config import LayerRange
from meshinfer.engine.models.llama import Shard
from meshinfer.engine.models.quant import parse_precision
from meshinfer.engine.weights import open_weights

#: Reference cases (token ids from an independent float32 implementation; tests/data/cases/README.md),
#: kept in the repository so that no test reads outside it.
CASES = Path(__file__).resolve().parent.parent / "data" / "cases"
DEFAULT = "qwen2.5-coder-0.5b-instruct-q4_k_m"
SMOL = "smollm2-135m-instruct-q4_1"


#: The test being set up or run (tests/conftest.py sets it), or None outside a test.
running_test = None


def require_realmodel_marker(name: str) -> None:
    """Fail the running test unless it is marked ``realmodel``: the fast tier
    (``-m "not realmodel"``) must load no real model, so every test that does carries the marker."""
    if running_test is not None and running_test.get_closest_marker("realmodel") is None:
        pytest.fail(f"{running_test.nodeid} loads the real model {name} but is not marked realmodel; "
                    f"add @pytest.mark.realmodel (or pytestmark) so that -m 'not realmodel' leaves it out")


def model_path(name: str) -> Path:
    """Path of the real GGUF model ``name``, fetched with ``meshinfer pull`` when missing.

    Uses ``$MESHINFER_HOME`` (default ``~/.cache/meshinfer``). Fails the test (never skips)
    when the model cannot be fetched and verified, or when the test is not marked ``realmodel``.
    """
    require_realmodel_marker(name)
    from meshinfer.core.errors import MeshError
    from meshinfer.engine.weights.registry import pull

    try:
        return pull(name, progress=False)
    except MeshError as exc:
        pytest.fail(f"model {name} is not available ({exc}); run `meshinfer pull {name}`")


def full_tensors(name: str) -> tuple:
    """(config, {module name: f32 tensor}) of the whole model, dequantized once per session."""
    require_realmodel_marker(name)
    return _full_tensors(name)


@lru_cache(maxsize=2)
def _full_tensors(name: str) -> tuple:
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
