"""Quantized precisions from the command line: ``generate --dtype``, and ``bench --single``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from meshinfer.core.config import PRECISION_NAMES
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.text.tokenizer import Tokenizer
from helpers.tiny import random_weights, tiny_config, write_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("benchsingle")
    cfg = tiny_config("qwen2", context=2048)  # the benchmark's long prompt is 1,000 tokens
    return write_gguf(d / "tiny.gguf", cfg, random_weights(cfg, seed=5))


def meshinfer(*args: str, home, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, MESHINFER_HOME=str(home))
    return subprocess.run([sys.executable, "-m", "meshinfer", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_generate_at_a_quantized_precision(tiny_gguf, tmp_path):
    out = meshinfer("generate", "--model", str(tiny_gguf), "-p", "hello", "--max-tokens", "6", "--json",
                    "--dtype", "q4-g32-bf16", home=tmp_path)
    assert out.returncode == 0, out.stderr
    tok = Tokenizer.from_gguf(tiny_gguf)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    want = greedy_generate(load_shard(tiny_gguf, dtype="q4-g32-bf16"), ids, max_tokens=6, eos_ids=tok.eos_ids)
    assert json.loads(out.stdout)["token_ids"] == want.token_ids
    assert len(list((tmp_path / "converted").rglob("*.safetensors"))) == 6  # embed, 4 layers, head


def test_unknown_dtype_lists_the_choices(tiny_gguf, tmp_path):
    out = meshinfer("generate", "--model", str(tiny_gguf), "-p", "hello", "--dtype", "q3", home=tmp_path)
    assert out.returncode == 2
    assert "invalid choice: 'q3' (choose from " + ", ".join(f"'{n}'" for n in PRECISION_NAMES) + ")" in out.stderr


@pytest.mark.slow
def test_bench_single_reports_every_engine(tiny_gguf, tmp_path):
    report = tmp_path / "single.json"
    out = meshinfer("bench", "--single", "--model", str(tiny_gguf), "--dtypes", "q8-bf16", "--threads", "1",
                    "--max-tokens", "4", "--llama-python", str(tmp_path / "no-python"), "--no-transformers",
                    "--out", str(report), home=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = json.loads(report.read_text())
    mesh, llama = rows
    assert mesh["engine"] == "meshinfer" and mesh["precision"] == "q8-bf16"
    assert mesh["decode_tok_s"] > 0 and mesh["ttft1000_ms"] > 0 and mesh["peak_rss_mib"] > 0
    assert 0 < mesh["join_cached_s"] and 0 < mesh["join_cold_s"] and len(mesh["token_ids"]) == 4
    assert llama == {"engine": "llama.cpp", "precision": "gguf as stored",
                     "error": f"{tmp_path / 'no-python'} does not exist"}
    assert "| meshinfer | q8-bf16 |" in out.stdout and "| llama.cpp | gguf as stored | not measured:" in out.stdout
