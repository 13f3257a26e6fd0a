"""``meshinfer bench --single``: one machine, whole model, meshinfer at each precision against
llama.cpp (llama-cpp-python) and Hugging Face transformers, in one run.

Every engine runs in a fresh process on the same GGUF file, with the same thread count and the
same prompt token ids (no chat template, so every engine sees identical input):

* a 30-token prompt, then ``tokens`` greedy tokens: time to first token (TTFT) and decode tok/s
  (tokens after the first divided by the time after the first);
* a 1,000-token prompt and one token: TTFT.

Each worker first runs one short warm-up generation that covers the prefill and decode shapes.
Peak RSS is the worker's ``ru_maxrss``. For meshinfer the table also reports the load time
(weights to ready shard) and, separately, ``join``-to-``ready`` of a real ``meshinfer join``
process, cold (empty converted cache) and cached (second start).

llama.cpp runs with the interpreter given by ``--llama-python`` (default: ``$MESHINFER_LLAMA_PYTHON``,
else ``.venv-llama/bin/python``, which ``deploy/install-llama-cpp.sh`` builds) because
llama-cpp-python lives in its own environment;
an engine that is not installed gets a row saying so instead of numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
load_s = time.perf_counter() - t0
greedy_generate(shard, spec["warm"], max_tokens=3)
short = greedy_generate(shard, spec["p30"], max_tokens=spec["tokens"])
long = greedy_generate(shard, spec["p1000"], max_tokens=1)
print(json.dumps({"load_s": load_s, "ttft30_ms": short.ttft_ms, "decode_tok_s": short.decode_tokens_per_s,
                  "ttft1000_ms": long.ttft_ms, "token_ids": short.token_ids,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
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
print(json.dumps({"load_s": load_s, "ttft30_ms": ttft30, "decode_tok_s": rate, "ttft1000_ms": ttft1000,
                  "token_ids": toks, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
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
with torch.inference_mode():
    run(spec["warm"], 3)
    toks, ttft30, rate = run(spec["p30"], spec["tokens"])
    _, ttft1000, _ = run(spec["p1000"], 1)
print(json.dumps({"load_s": load_s, "ttft30_ms": ttft30, "decode_tok_s": rate, "ttft1000_ms": ttft1000,
                  "token_ids": toks, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''


def prompt_ids(path: Path) -> dict[str, list[int]]:
    """Token ids of the 30- and 1,000-token prompts (and a short warm-up) for the model at ``path``."""
    from meshinfer.text.tokenizer import Tokenizer
    from meshinfer.engine.weights import open_weights

    src = open_weights(path)
    tok = Tokenizer.from_gguf(src) if path.is_file() else Tokenizer.from_hf_dir(path)
    ids = tok.encode(PROMPT_TEXT)
    long = (ids * (1000 // len(ids) + 1))[:1000]
    return {"p30": long[:30], "p1000": long, "warm": long[40:560]}


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


def run_single(*, model: str, dtypes: list[str], tokens: int, threads: int, llama_python: str | None,
               transformers: bool = True, join_times: bool = True, progress=None) -> list[dict]:
    """Run every engine once (see the module docstring); one result dict per row.

    A row has ``engine``, ``precision`` and either the measured fields (``load_s``, ``ttft30_ms``,
    ``decode_tok_s``, ``ttft1000_ms``, ``peak_rss_mib``, and for meshinfer ``join_cold_s`` /
    ``join_cached_s``) or ``error``.
    """
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(model)
    spec = {"model": str(path), "threads": threads, "tokens": tokens, **prompt_ids(path)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="meshinfer-bench-") as tmp:
        for dtype in dtypes:
            row = {"engine": "meshinfer", "precision": dtype,
                   **_worker(sys.executable, MESH_WORKER, {**spec, "dtype": dtype, "cache_dir": f"{tmp}/converted"})}
            if join_times and "error" not in row:
                home = Path(tmp) / f"home-{dtype}"
                home.mkdir()
                row["join_cold_s"] = join_to_ready_s(path, dtype, home, threads)
                row["join_cached_s"] = join_to_ready_s(path, dtype, home, threads)
            rows.append(row)
            if progress:
                progress(json.dumps({k: v for k, v in row.items() if k != "token_ids"}))
    python = llama_python or os.environ.get("MESHINFER_LLAMA_PYTHON") or DEFAULT_LLAMA_PYTHON
    engines = [("llama.cpp", python, LLAMA_WORKER, "gguf as stored")]
    if transformers:
        engines.append(("transformers", sys.executable, HF_WORKER, "f32"))
    for name, py, script, precision in engines:
        if not Path(py).exists():
            row = {"engine": name, "precision": precision, "error": f"{py} does not exist"}
        else:
            row = {"engine": name, "precision": precision, **_worker(py, script, spec)}
        rows.append(row)
        if progress:
            progress(json.dumps({k: v for k, v in row.items() if k != "token_ids"}))
    return rows


def single_table(rows: list[dict], *, tokens: int, threads: int) -> str:
    """:func:`run_single`'s rows as a markdown table."""
    lines = [f"| engine | precision | decode tok/s ({tokens} tokens) | TTFT ms, 30-token prompt | "
             f"TTFT ms, 1000-token prompt | peak RSS MiB | load s | join→ready s cold / cached |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['engine']} | {r['precision']} | not measured: {r['error']} | | | | | |")
            continue
        join = f"{r['join_cold_s']:.1f} / {r['join_cached_s']:.1f}" if "join_cold_s" in r else "-"
        lines.append(f"| {r['engine']} | {r['precision']} | {r['decode_tok_s']:.1f} | {r['ttft30_ms']:.0f} | "
                     f"{r['ttft1000_ms']:.0f} | {r['peak_rss_mib']:.0f} | {r['load_s']:.1f} | {join} |")
    return "\n".join(lines) + f"\n\n{threads} threads per engine; one run each after a warm-up."
