"""Quantized precisions from the command line: ``generate --dtype``, and ``bench --single``."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from meshinfer.app.bench import GENERAL_PROMPTS
from meshinfer.app.bench_single import (MESH_WORKER, _engines, add_decode_median, add_fidelity,
                                        prefix_agreement, prompt_ids, single_table, top1_agreement)
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
                    "--dtype", "q8-bf16", home=tmp_path)
    assert out.returncode == 0, out.stderr
    tok = Tokenizer.from_gguf(tiny_gguf)
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    want = greedy_generate(load_shard(tiny_gguf, dtype="q8-bf16"), ids, max_tokens=6, eos_ids=tok.eos_ids)
    assert json.loads(out.stdout)["token_ids"] == want.token_ids
    assert len(list((tmp_path / "converted").rglob("*.safetensors"))) == 6  # embed, 4 layers, head


def test_unknown_dtype_lists_the_choices(tiny_gguf, tmp_path):
    out = meshinfer("generate", "--model", str(tiny_gguf), "-p", "hello", "--dtype", "q3", home=tmp_path)
    assert out.returncode == 2
    assert "invalid choice: 'q3' (choose from " + ", ".join(f"'{n}'" for n in PRECISION_NAMES) + ")" in out.stderr


def test_prefix_agreement_counts_up_to_the_first_divergence():
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert prefix_agreement([1, 2, 3, 4], [9, 2, 3, 4]) == 0.0  # diverges at once: later matches do not count
    assert prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert prefix_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # missing positions diverge
    with pytest.raises(ValueError, match="at least one reference token"):
        prefix_agreement([], [1])


def test_top1_agreement_counts_every_matching_position():
    assert top1_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert top1_agreement([1, 2, 3, 4], [9, 2, 3, 4]) == 0.75  # teacher-forced: one miss costs one position
    assert top1_agreement([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0
    assert top1_agreement([1, 2, 3, 4], [1]) == 0.25
    with pytest.raises(ValueError, match="at least one reference token"):
        top1_agreement([], [])


def test_add_fidelity_averages_over_prompts_and_says_why_a_value_is_missing():
    refs = [[1, 2, 3, 4], [5, 6]]
    row = {"fidelity_tokens": [[1, 2, 9, 9], [5, 6]], "fidelity_argmax": [[1, 2, 9, 4], [0, 6]]}
    add_fidelity(row, refs)
    assert row["fidelity_greedy"] == (0.5 + 1.0) / 2 and row["fidelity_top1"] == (0.75 + 0.5) / 2
    no_logits = {"fidelity_tokens": [[1, 2, 3, 4], [5, 6]], "fidelity_argmax_error": "TypeError: no logits_all"}
    add_fidelity(no_logits, refs)
    assert no_logits["fidelity_greedy"] == 1.0 and no_logits["fidelity_top1"] is None
    no_ref = {"fidelity_tokens": [[1]]}
    add_fidelity(no_ref, None, "the f32 reference failed: boom")
    assert no_ref["fidelity_greedy"] is None and no_ref["fidelity_greedy_error"] == "the f32 reference failed: boom"
    llama = {"engine": "llama.cpp", "precision": "gguf as stored", "decode_tok_s": 1.0,
             "chat_decode_tok_s": [9.0, 4.0, 2.0, 30.0], "ttft30_ms": 1, "ttft1000_ms": 1, "peak_rss_mib": 1,
             "load_s": 1, **no_logits}
    mesh = {**llama, "engine": "meshinfer", "precision": "gguf", "chat_decode_tok_s": [2.0, 3.0, 1.0]}
    for row in (llama, mesh):
        add_decode_median(row)
    assert llama["decode_tok_s_median"] == 6.5 and mesh["decode_tok_s_median"] == 2.0
    table = single_table([mesh, llama], tokens=4, threads=1)
    assert "| llama.cpp | gguf as stored | 6.5 | 1.00 | 1.00 | - (TypeError: no logits_all) |" in table
    assert "| meshinfer | gguf | 2.0 | 0.31 | 1.00 |" in table
    assert "f32 is not in --dtypes: it ran only as the fidelity reference." in table


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
    assert 0 <= mesh["fidelity_greedy"] <= 1 and 0 <= mesh["fidelity_top1"] <= 1  # against f32 run as reference only
    assert llama == {"engine": "llama.cpp", "precision": "gguf as stored",
                     "error": f"{tmp_path / 'no-python'} does not exist (bash deploy/install-llama-cpp.sh builds "
                              "it, or pass --llama-python)"}
    assert "| meshinfer | q8-bf16 |" in out.stdout and "| llama.cpp | gguf as stored | not measured:" in out.stdout
    assert "f32 is not in --dtypes: it ran only as the fidelity reference." in out.stdout


@pytest.mark.slow
def test_bench_single_fidelity_is_computed_against_f32(tiny_gguf, tmp_path):
    report = tmp_path / "single.json"
    out = meshinfer("bench", "--single", "--model", str(tiny_gguf), "--dtypes", "f32,q8-bf16", "--threads", "1",
                    "--max-tokens", "5", "--llama-python", str(tmp_path / "no-python"), "--no-transformers",
                    "--no-join", "--out", str(report), home=tmp_path)
    assert out.returncode == 0, out.stderr
    f32, q8, _ = json.loads(report.read_text())
    refs = f32["fidelity_tokens"]
    assert len(refs) == len(GENERAL_PROMPTS) >= 8 and all(len(r) == 5 for r in refs)
    assert f32["fidelity_greedy"] == 1.0
    assert f32["fidelity_top1"] == sum(map(top1_agreement, refs, f32["fidelity_argmax"])) / len(refs)
    assert q8["fidelity_greedy"] == sum(map(prefix_agreement, refs, q8["fidelity_tokens"])) / len(refs)
    assert q8["fidelity_top1"] == sum(map(top1_agreement, refs, q8["fidelity_argmax"])) / len(refs)
    assert 0 <= q8["fidelity_greedy"] <= 1 and 0 <= q8["fidelity_top1"] <= 1
    assert len(f32["chat_decode_tok_s"]) == len(GENERAL_PROMPTS) and min(f32["chat_decode_tok_s"]) > 0
    assert f32["decode_tok_s_median"] == statistics.median(f32["chat_decode_tok_s"])
    assert f"| meshinfer | f32 | {f32['decode_tok_s_median']:.1f} | - | 1.00 | {f32['fidelity_top1']:.2f} |" in out.stdout
    assert "ran only as the fidelity reference" not in out.stdout


FAKE_LLAMA_CPP = '''
import os, sys, time
import numpy as np

calls = 0

class Llama:
    """Enough of llama_cpp.Llama for the bench's worker: a made-up greedy sequence per prompt."""
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_batch, verbose=False, logits_all=False):
        self.logits_all = logits_all
    def reset(self):
        pass
    def generate(self, ids, top_k, temp, reset):
        global calls
        calls += 1
        if str(calls) == os.environ.get("FAKE_LLAMA_DIES_AT"):
            print("fake llama died on purpose", file=sys.stderr, flush=True)
            os._exit(3)
        t = sum(ids) % 50
        while True:
            time.sleep(0.002)
            yield t
            t = (7 * t + 1) % 50
    def eval(self, ids):
        assert self.logits_all
        self.scores = np.zeros((len(ids), 64), dtype=np.float32)
'''


def _bench_with_fake_llama(tiny_gguf, tmp_path, **env_extra):
    (tmp_path / "fake" / "llama_cpp").mkdir(parents=True)
    (tmp_path / "fake" / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    report = tmp_path / "single.json"
    env = dict(os.environ, MESHINFER_HOME=str(tmp_path), **env_extra,
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "fake"), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "meshinfer", "bench", "--single", "--model", str(tiny_gguf),
                          "--dtypes", "gguf,f32", "--threads", "1", "--max-tokens", "4", "--llama-python",
                          sys.executable, "--no-transformers", "--no-join", "--out", str(report)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr
    return out, json.loads(report.read_text())


@pytest.mark.slow
def test_a_worker_that_dies_between_chats_leaves_its_row_an_error(tiny_gguf, tmp_path):
    """llama.cpp's worker exits during its 5th generation (warm-up, 30 tokens, 1,000 tokens,
    chat 0, chat 1): its row says why, and meshinfer's rows finish every chat, with no ratio."""
    out, rows = _bench_with_fake_llama(tiny_gguf, tmp_path, FAKE_LLAMA_DIES_AT="5")
    gguf, f32, llama = rows
    assert llama["error"] == "fake llama died on purpose"
    assert "| llama.cpp | gguf as stored | not measured: fake llama died on purpose |" in out.stdout
    for r in (gguf, f32):
        assert len(r["chat_decode_tok_s"]) == len(GENERAL_PROMPTS) and r["vs_llama"] is None
        assert 0 <= r["fidelity_greedy"] <= 1 and r["fidelity_top1"] is not None


@pytest.mark.slow
def test_bench_single_engines_take_turns_on_the_chats(tiny_gguf, tmp_path):
    """Every engine decodes chat i before any decodes chat i + 1, and vs_llama is the median of
    the chat-by-chat ratios (a stand-in llama_cpp module plays llama.cpp)."""
    out, rows = _bench_with_fake_llama(tiny_gguf, tmp_path)
    assert [(r["engine"], r["precision"]) for r in rows] == [("meshinfer", "gguf"), ("meshinfer", "f32"),
                                                             ("llama.cpp", "gguf as stored")]
    n = len(GENERAL_PROMPTS)
    assert all("error" not in r and len(r["chat_started"]) == n for r in rows), rows
    for i in range(n - 1):  # turns: the last start of chat i comes before the first start of chat i + 1
        assert max(r["chat_started"][i] for r in rows) < min(r["chat_started"][i + 1] for r in rows)
    llama = rows[2]
    assert llama["vs_llama"] == 1.0
    for r in rows[:2]:
        assert r["vs_llama"] == statistics.median(a / b for a, b in zip(r["chat_decode_tok_s"],
                                                                        llama["chat_decode_tok_s"]))
        assert f"| meshinfer | {r['precision']} | {r['decode_tok_s_median']:.1f} | {r['vs_llama']:.2f} |" in out.stdout
    expected = []
    for ids in prompt_ids(tiny_gguf)["chats"]:  # the stand-in's sequence for each chat, in chat order
        t = [sum(ids) % 50]
        while len(t) < 4:
            t.append((7 * t[-1] + 1) % 50)
        expected.append(t)
    assert llama["fidelity_tokens"] == expected
    refs = rows[1]["fidelity_tokens"]
    assert llama["fidelity_top1"] == sum(map(top1_agreement, refs, [[0] * 4] * n)) / n  # its argmax is token 0


def test_on_a_device_every_row_runs_there_and_the_reference_stays_on_the_cpu():
    spec = {"model": "m.gguf", "threads": 1}
    rows = _engines(spec, ["f32", "bf16", "gguf"], "/no/such/python", True, device="cuda")
    found = [(row, python is not None, wspec.get("device"), wspec.get("speed")) for row, python, _, wspec in rows]
    reference, f32, bf16, gguf, llama, hf = found
    assert reference == ({"engine": "meshinfer", "precision": "f32", "device": "cpu"}, True, "cpu", False)
    assert f32 == ({"engine": "meshinfer", "precision": "f32", "device": "cuda"}, True, "cuda", True)
    assert bf16[0]["device"] == "cuda" and bf16[1:] == (True, "cuda", True)
    assert gguf[1] is False and "uses CPU kernels" in gguf[0]["error"]  # never started
    assert llama[1] is False and "error" in llama[0]
    assert hf[0] == {"engine": "transformers", "precision": "f32", "device": "cuda"} and hf[2] == "cuda"
    assert all(script == MESH_WORKER for _, _, script, _ in rows[:4])


def test_on_the_cpu_the_f32_row_is_the_reference_itself():
    rows = _engines({"model": "m.gguf"}, ["q8-bf16", "f32"], "/no/such/python", False)
    assert [(r["precision"], r["device"], w["speed"]) for r, _, _, w in rows if r["engine"] == "meshinfer"] == [
        ("f32", "cpu", True), ("q8-bf16", "cpu", True)]
    rows = _engines({"model": "m.gguf"}, ["q8-bf16"], "/no/such/python", False)
    assert [(r["precision"], w["speed"]) for r, _, _, w in rows if r["engine"] == "meshinfer"] == [
        ("f32", False), ("q8-bf16", True)]


def _measured(precision: str, device: str, **extra) -> dict:
    return {"engine": "meshinfer", "precision": precision, "device": device, "decode_tok_s": 50.0,
            "decode_tok_s_median": 51.0, "vs_llama": None, "fidelity_greedy": 1.0, "fidelity_top1": 0.98,
            "ttft30_ms": 12.0, "ttft1000_ms": 40.0, "peak_rss_mib": 900.0, "load_s": 2.0, **extra}


def test_a_device_table_names_each_rows_device_and_its_memory():
    rows = [_measured("f32", "cuda", peak_device_mib=612.4),
            {"engine": "meshinfer", "precision": "gguf", "device": "cuda", "error": "uses CPU kernels"},
            {"engine": "llama.cpp", "precision": "gguf as stored", "error": "not installed"},
            _measured("f32", "cuda", engine="transformers", peak_device_mib=None)]
    table = single_table(rows, tokens=64, threads=4)
    lines = table.splitlines()
    assert "| precision (device) |" in lines[0] and "| peak device MiB |" in lines[0]
    assert lines[1].count("|") == lines[0].count("|")
    assert "| meshinfer | f32 (cuda) | 51.0 | - | 1.00 | 0.98 | 12 | 40 | 900 | 612 | 2.0 | - |" in table
    assert "| transformers | f32 (cuda) | 51.0 |" in table and "| 900 | - | 2.0 |" in table
    assert "| meshinfer | gguf (cuda) | not measured: uses CPU kernels |" in table
    assert all(line.count("|") == lines[0].count("|") for line in lines[2:6])
    assert "meshinfer f32 on the CPU ran only as the fidelity reference." in table
    cpu = single_table([_measured("f32", "cpu")], tokens=64, threads=4)
    assert "(device)" not in cpu and "peak device MiB" not in cpu and "| meshinfer | f32 | 51.0 |" in cpu


def test_bench_refuses_an_unknown_device(tmp_path):
    out = meshinfer("bench", "--single", "--device", "tpu", "--model", "nothing.gguf", home=tmp_path, timeout=120)
    assert out.returncode != 0 and "device 'tpu' is not one of cpu, cuda, cuda:N, mps" in out.stderr
    out = meshinfer("bench", "--device", "cuda:x", "--model", "nothing.gguf", home=tmp_path, timeout=120)
    assert out.returncode != 0 and "device 'cuda:x' is not one of cpu, cuda, cuda:N, mps" in out.stderr
    out = meshinfer("bench", "--device", "cuda", "--dtype", "gguf-a8", "--model", "nothing.gguf", home=tmp_path,
                    timeout=120)
    assert out.returncode != 0 and "precision gguf-a8 uses CPU kernels" in out.stderr
