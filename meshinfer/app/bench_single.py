"""``meshinfer bench --single``: one machine, whole model, meshinfer at each precision against
llama.cpp (llama-cpp-python) and Hugging Face transformers, in one run.

Every engine runs in a fresh process on the same GGUF file, with the same thread count and the
same prompt token ids (no chat template, so every engine sees identical input):

* a 30-token prompt, then ``tokens`` greedy tokens: time to first token (TTFT) and decode tok/s
  (tokens after the first divided by the time after the first);
* a 1,000-token prompt and one token: TTFT.

The fidelity runs below decode too (each chat's ``tokens`` greedy tokens), and the table's decode
speed is the **median over those chats** (``decode_tok_s_median``; each chat's rate in
``chat_decode_tok_s``), with its ratio to llama.cpp's: on a shared machine a single run's rate
moved by 20-30% from one run to the next, which a median over 8 absorbs. ``decode_tok_s`` is the
30-token prompt's single run.

Each worker first runs one short warm-up generation that covers the prefill and decode shapes.
Peak RSS is the worker's ``ru_maxrss``, read before the fidelity runs below. For meshinfer the table also reports the load time
(weights to ready shard) and, separately, ``join``-to-``ready`` of a real ``meshinfer join``
process, cold (empty converted cache) and cached (second start).

llama.cpp runs with the interpreter given by ``--llama-python`` (default: ``$MESHINFER_LLAMA_PYTHON``,
else ``.venv-llama/bin/python``, which ``deploy/install-llama-cpp.sh`` builds) because
llama-cpp-python lives in its own environment;
an engine that is not installed gets a row saying so instead of numbers.

Fidelity, next to the speed of every row, is measured against meshinfer at f32 on the
:data:`~meshinfer.app.bench.GENERAL_PROMPTS` chats rendered with the model's chat template by
:mod:`meshinfer.text` (the same ids for every engine), ``tokens`` greedy tokens each, with no stop
at an end-of-turn token so every engine produces the same number of positions. The f32 worker
runs first (also when f32 is not asked for: then it is only the reference); its tokens go to every
other worker, which returns its own greedy tokens and its argmax at each of those positions when
fed the prompt plus f32's tokens in one pass. The parent then computes:

* ``fidelity_greedy``: the mean over prompts of :func:`prefix_agreement` (the share of positions
  that agree with f32 before the first divergence);
* ``fidelity_top1``: the mean over prompts of :func:`top1_agreement` (teacher-forced top-1),
  ``None`` with ``fidelity_top1_error`` when the engine gave no logits.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from meshinfer.app.bench import GENERAL_PROMPTS

#: Default interpreter that has ``llama_cpp``: the venv ``deploy/install-llama-cpp.sh`` builds.
DEFAULT_LLAMA_PYTHON = ".venv-llama/bin/python"
#: Code the prompts are cut from; repeated to reach 1,000 tokens.
PROMPT_TEXT = ("Write a Python function that checks whether a number is prime, then explain it.\n"
               "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n"
               "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n"
               "            return False\n    return True\n")
#: Seconds one worker may run before it is killed.
WORKER_TIMEOUT_S = 1800

MESH_WORKER = r'''
import json, resource, sys, time, torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from meshinfer.engine.generate import greedy_generate, load_shard
t0 = time.perf_counter()
shard = load_shard(spec["model"], dtype=spec["dtype"], cache_dir=spec["cache_dir"])
out = {"load_s": time.perf_counter() - t0}
if spec["speed"]:
    greedy_generate(shard, spec["warm"], max_tokens=3)
    short = greedy_generate(shard, spec["p30"], max_tokens=spec["tokens"])
    long = greedy_generate(shard, spec["p1000"], max_tokens=1)
    out.update(ttft30_ms=short.ttft_ms, decode_tok_s=short.decode_tokens_per_s, ttft1000_ms=long.ttft_ms,
               token_ids=short.token_ids, peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
chats = spec["chats"]
runs = [greedy_generate(shard, p, max_tokens=spec["tokens"]) for p in chats]
out["fidelity_tokens"] = [r.token_ids for r in runs]
out["chat_decode_tok_s"] = [r.decode_tokens_per_s for r in runs]
refs = out["fidelity_tokens"] if spec["reference"] else spec["refs"]
if refs is not None:
    out["fidelity_argmax"] = [shard(torch.tensor([p + r]), 0, logits="all")[0, len(p) - 1:len(p) - 1 + len(r)]
                              .argmax(-1).tolist() for p, r in zip(chats, refs)]  # (T, V) -> (len(r),)
print(json.dumps(out))
'''

LLAMA_WORKER = r'''
import json, resource, sys, time
spec = json.loads(sys.argv[1])
from llama_cpp import Llama
t0 = time.perf_counter()
llm = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
            n_ctx=2048, n_batch=512, verbose=False)
load_s = time.perf_counter() - t0
def run(ids, n):
    llm.reset()
    out, t0 = [], time.perf_counter()
    for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        if not out:
            ttft, t1 = time.perf_counter() - t0, time.perf_counter()
        out.append(tok)
        if len(out) == n:
            break
    return out, ttft * 1e3, (len(out) - 1) / max(time.perf_counter() - t1, 1e-9)
run(spec["warm"], 3)
toks, ttft30, rate = run(spec["p30"], spec["tokens"])
_, ttft1000, _ = run(spec["p1000"], 1)
out = {"load_s": load_s, "ttft30_ms": ttft30, "decode_tok_s": rate, "ttft1000_ms": ttft1000,
       "token_ids": toks, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
chats, refs = spec["chats"], spec["refs"]
runs = [run(p, spec["tokens"]) for p in chats]
out["fidelity_tokens"] = [r[0] for r in runs]
out["chat_decode_tok_s"] = [r[2] for r in runs]
if refs is not None:
    del llm  # scores for every position need a context built with logits_all=True
    try:
        tf = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                   n_ctx=max(len(p) + len(r) for p, r in zip(chats, refs)) + 8, n_batch=512,
                   logits_all=True, verbose=False)
        out["fidelity_argmax"] = []
        for p, r in zip(chats, refs):
            tf.reset()
            tf.eval(p + r)
            out["fidelity_argmax"].append(tf.scores[len(p) - 1:len(p) - 1 + len(r)].argmax(-1).tolist())
    except Exception as exc:
        out.pop("fidelity_argmax", None)
        out["fidelity_argmax_error"] = f"{type(exc).__name__}: {exc}"[:200]
print(json.dumps(out))
'''

HF_WORKER = r'''
import json, resource, sys, time, torch
from pathlib import Path
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from transformers import AutoModelForCausalLM
path = Path(spec["model"])
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
load_s = time.perf_counter() - t0
def run(ids, n):
    ids = torch.tensor([ids])
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t0
    if n == 1:
        return [], ttft * 1e3, 0.0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    total = time.perf_counter() - t0
    return out[0, ids.shape[1]:].tolist(), ttft * 1e3, (n - 1) / max(total - ttft, 1e-9)
rates = []
def greedy(ids, n):  # argmax at every step, no end-of-turn stop and no EOS suppression
    step = model(torch.tensor([ids]), use_cache=True)
    toks, t0 = [int(step.logits[0, -1].argmax())], time.perf_counter()
    while len(toks) < n:
        step = model(torch.tensor([toks[-1:]]), past_key_values=step.past_key_values, use_cache=True)
        toks.append(int(step.logits[0, -1].argmax()))
    rates.append((n - 1) / max(time.perf_counter() - t0, 1e-9))
    return toks
with torch.inference_mode():
    run(spec["warm"], 3)
    toks, ttft30, rate = run(spec["p30"], spec["tokens"])
    _, ttft1000, _ = run(spec["p1000"], 1)
    out = {"load_s": load_s, "ttft30_ms": ttft30, "decode_tok_s": rate, "ttft1000_ms": ttft1000,
           "token_ids": toks, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    chats, refs = spec["chats"], spec["refs"]
    out["fidelity_tokens"] = [greedy(p, spec["tokens"]) for p in chats]
    out["chat_decode_tok_s"] = rates
    if refs is not None:
        out["fidelity_argmax"] = [model(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) - 1 + len(r)]
                                  .argmax(-1).tolist() for p, r in zip(chats, refs)]  # (T, V) -> (len(r),)
print(json.dumps(out))
'''


def prompt_ids(path: Path) -> dict:
    """Token ids of the 30- and 1,000-token prompts (and a short warm-up) for the model at ``path``,
    and under ``chats`` one list per :data:`~meshinfer.app.bench.GENERAL_PROMPTS` chat, rendered
    with the model's chat template (with the assistant's opening): the fidelity prompts."""
    from meshinfer.text.tokenizer import Tokenizer
    from meshinfer.engine.weights import open_weights

    src = open_weights(path)
    tok = Tokenizer.from_gguf(src) if path.is_file() else Tokenizer.from_hf_dir(path)
    ids = tok.encode(PROMPT_TEXT)
    long = (ids * (1000 // len(ids) + 1))[:1000]
    return {"p30": long[:30], "p1000": long, "warm": long[40:560],
            "chats": [tok.encode_chat(messages) for messages in GENERAL_PROMPTS]}


def prefix_agreement(ref: Sequence[int], got: Sequence[int]) -> float:
    """Greedy agreement of one prompt: the share of ``ref``'s positions that ``got`` matches
    before the first divergence.

    Args:
        ref: the reference's (meshinfer f32's) greedy token ids.
        got: another engine's greedy token ids for the same prompt; positions past its end count
            as divergent.

    Returns:
        ``k / len(ref)`` in [0, 1], where ``got[:k] == ref[:k]`` and ``got[k] != ref[k]``.

    Raises:
        ValueError: ``ref`` is empty.
    """
    if not ref:
        raise ValueError("prefix_agreement needs at least one reference token")
    k = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        k += 1
    return k / len(ref)


def top1_agreement(ref: Sequence[int], argmax: Sequence[int]) -> float:
    """Teacher-forced top-1 agreement of one prompt: the share of positions ``i`` where
    ``argmax[i] == ref[i]``.

    Args:
        ref: the reference's (meshinfer f32's) greedy token ids.
        argmax: another engine's argmax at each of those positions when fed the prompt plus ``ref``
            in one pass (so a divergence does not carry over to later positions); missing
            positions count as disagreeing.

    Raises:
        ValueError: ``ref`` is empty.
    """
    if not ref:
        raise ValueError("top1_agreement needs at least one reference token")
    return sum(a == b for a, b in zip(ref, argmax)) / len(ref)


def add_fidelity(row: dict, refs: list[list[int]] | None, why_none: str = "") -> None:
    """Set ``row``'s ``fidelity_greedy`` and ``fidelity_top1`` (means over prompts of
    :func:`prefix_agreement` and :func:`top1_agreement` against ``refs``), in place.

    A value that cannot be computed is ``None``, with the reason in ``fidelity_greedy_error`` /
    ``fidelity_top1_error``: no reference (``refs`` is None; ``why_none`` says why), or the engine
    returned no argmaxes (its ``fidelity_argmax_error`` says why). A row with ``error`` is left alone.
    """
    if "error" in row:
        return
    if refs is None:
        row.update(fidelity_greedy=None, fidelity_top1=None,
                   fidelity_greedy_error=why_none, fidelity_top1_error=why_none)
        return
    got = row["fidelity_tokens"]
    row["fidelity_greedy"] = sum(prefix_agreement(r, g) for r, g in zip(refs, got)) / len(refs)
    if "fidelity_argmax" in row:
        row["fidelity_top1"] = sum(top1_agreement(r, a) for r, a in zip(refs, row["fidelity_argmax"])) / len(refs)
    else:
        row["fidelity_top1"] = None
        row["fidelity_top1_error"] = row.get("fidelity_argmax_error", "the engine returned no logits")


def _worker(python: str, script: str, spec: dict) -> dict:
    out = subprocess.run([python, "-c", script, json.dumps(spec)], capture_output=True, text=True,
                         timeout=WORKER_TIMEOUT_S)
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["exit %d" % out.returncode])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def join_to_ready_s(model: Path, dtype: str, home: Path, threads: int) -> float:
    """Seconds from starting ``meshinfer join`` to its ``ready:`` line, with ``MESHINFER_HOME=home``.

    Raises:
        RuntimeError: the peer exited or took longer than :data:`WORKER_TIMEOUT_S`.
    """
    log_path = home / f"join-{dtype}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "meshinfer", "join", "--model", str(model), "--dtype", dtype, "--listen",
           "127.0.0.1:0", "--key", str(home / "peer.key"), "--threads", str(threads)]
    env = dict(os.environ, MESHINFER_HOME=str(home))
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while "ready:" not in log_path.read_text():
                if proc.poll() is not None or time.perf_counter() - t0 > WORKER_TIMEOUT_S:
                    raise RuntimeError(f"join failed:\n{log_path.read_text()[-2000:]}")
                time.sleep(0.1)
            return time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(30)


def _progress_line(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items()
                       if k not in ("token_ids", "fidelity_tokens", "fidelity_argmax", "chat_decode_tok_s")})


def _mesh_rows(spec: dict, dtypes: list[str], tmp: str, *, join_times: bool,
               progress) -> tuple[list[dict], list[list[int]] | None, str]:
    """meshinfer's rows, in ``dtypes`` order, with fidelity; f32 runs first (only as the fidelity
    reference when it is not in ``dtypes``). Returns the rows, f32's greedy tokens per chat prompt
    (None when the f32 worker failed) and, then, why."""
    rows, refs, why = {}, None, ""
    for dtype in dict.fromkeys(["f32", *dtypes]):
        measured = dtype in dtypes
        row = {"engine": "meshinfer", "precision": dtype,
               **_worker(sys.executable, MESH_WORKER, {**spec, "dtype": dtype, "cache_dir": f"{tmp}/converted",
                                                       "speed": measured, "reference": dtype == "f32",
                                                       "refs": refs})}
        if dtype == "f32":
            refs = row.get("fidelity_tokens")
            why = f"the f32 reference failed: {row['error']}" if "error" in row else ""
        add_fidelity(row, refs, why)
        add_decode_median(row)
        if join_times and measured and "error" not in row:
            home = Path(tmp) / f"home-{dtype}"
            home.mkdir()
            row["join_cold_s"] = join_to_ready_s(Path(spec["model"]), dtype, home, spec["threads"])
            row["join_cached_s"] = join_to_ready_s(Path(spec["model"]), dtype, home, spec["threads"])
        if measured:
            rows[dtype] = row
            if progress:
                progress(_progress_line(row))
    return [rows[d] for d in dtypes], refs, why


def run_single(*, model: str, dtypes: list[str], tokens: int, threads: int, llama_python: str | None,
               transformers: bool = True, join_times: bool = True, progress=None) -> list[dict]:
    """Run every engine once (see the module docstring); one result dict per row.

    A row has ``engine``, ``precision`` and either ``error`` or the measured fields: ``load_s``,
    ``ttft30_ms``, ``decode_tok_s``, ``decode_tok_s_median`` (:func:`add_decode_median`) with the
    ``chat_decode_tok_s`` it comes from, ``ttft1000_ms``, ``peak_rss_mib``, for meshinfer
    ``join_cold_s`` / ``join_cached_s``, and the fidelity (:func:`add_fidelity`) with the lists it
    comes from: ``fidelity_tokens`` (greedy ids per chat prompt) and ``fidelity_argmax``
    (teacher-forced argmaxes per chat prompt). ``tokens`` is the number of greedy tokens of both
    the speed run and each fidelity prompt.
    """
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(model)
    spec = {"model": str(path), "threads": threads, "tokens": tokens, **prompt_ids(path)}
    with tempfile.TemporaryDirectory(prefix="meshinfer-bench-") as tmp:
        rows, refs, why = _mesh_rows(spec, dtypes, tmp, join_times=join_times, progress=progress)
    python = llama_python or os.environ.get("MESHINFER_LLAMA_PYTHON") or DEFAULT_LLAMA_PYTHON
    engines = [("llama.cpp", python, LLAMA_WORKER, "gguf as stored")]
    if transformers:
        engines.append(("transformers", sys.executable, HF_WORKER, "f32"))
    for name, py, script, precision in engines:
        if not Path(py).exists():
            row = {"engine": name, "precision": precision,
                   "error": f"{py} does not exist (bash deploy/install-llama-cpp.sh builds it, or pass --llama-python)"
                   if name == "llama.cpp" else f"{py} does not exist"}
        else:
            row = {"engine": name, "precision": precision, **_worker(py, script, {**spec, "refs": refs})}
        add_fidelity(row, refs, why)
        add_decode_median(row)
        rows.append(row)
        if progress:
            progress(_progress_line(row))
    return rows


def add_decode_median(row: dict) -> None:
    """Set ``row``'s ``decode_tok_s_median``: the median of its ``chat_decode_tok_s`` (the
    fidelity chats' decode rates), or its single ``decode_tok_s`` without them; in place. A row
    with ``error`` is left alone."""
    if "error" not in row:
        row["decode_tok_s_median"] = statistics.median(row.get("chat_decode_tok_s") or [row["decode_tok_s"]])


def _fidelity_cell(row: dict, key: str) -> str:
    value = row.get(key)
    return f"{value:.2f}" if value is not None else f"- ({row.get(key + '_error', 'not computed')})"


def single_table(rows: list[dict], *, tokens: int, threads: int) -> str:
    """:func:`run_single`'s rows as a markdown table, with a note on how fidelity was measured."""
    llama = next((r.get("decode_tok_s_median") for r in rows if r["engine"] == "llama.cpp" and "error" not in r), None)
    lines = [f"| engine | precision | decode tok/s (median of {len(GENERAL_PROMPTS)} chats x {tokens} tokens) | "
             f"vs llama.cpp | greedy agreement with f32 | "
             f"teacher-forced top-1 | TTFT ms, 30-token prompt | TTFT ms, 1000-token prompt | peak RSS MiB | "
             f"load s | join→ready s cold / cached |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['precision']} | not measured: {r['error']} | | | | | | | | |")
            continue
        rate = r.get("decode_tok_s_median", r["decode_tok_s"])
        ratio = f"{rate / llama:.2f}" if llama else "-"
        join = f"{r['join_cold_s']:.1f} / {r['join_cached_s']:.1f}" if "join_cold_s" in r else "-"
        lines.append(f"| {r['engine']} | {r['precision']} | {rate:.1f} | {ratio} | "
                     f"{_fidelity_cell(r, 'fidelity_greedy')} | {_fidelity_cell(r, 'fidelity_top1')} | "
                     f"{r['ttft30_ms']:.0f} | {r['ttft1000_ms']:.0f} | {r['peak_rss_mib']:.0f} | {r['load_s']:.1f} | "
                     f"{join} |")
    note = (f"\n\n{threads} thread{'s' if threads != 1 else ''} per engine, one process each after a warm-up; decode speed is the median "
            f"of the fidelity chats' decodes. Fidelity: {len(GENERAL_PROMPTS)} "
            f"built-in chat prompts x {tokens} greedy tokens against meshinfer f32 (greedy: mean share of "
            f"positions before the first divergence; teacher-forced: share of top-1 equal to f32's tokens).")
    if not any(r["engine"] == "meshinfer" and r["precision"] == "f32" for r in rows):
        note += " f32 is not in --dtypes: it ran only as the fidelity reference."
    return "\n".join(lines) + note
