"""``meshinfer bench --single``: one machine, whole model, meshinfer at each precision against
llama.cpp (llama-cpp-python) and Hugging Face transformers, in one run.

Every engine runs in its own process on the same GGUF file, with the same thread count and the
same prompt token ids (no chat template, so every engine sees identical input). Each worker
loads its model and times these while the workers started before it wait idle:

* a 30-token prompt, then ``tokens`` greedy tokens: time to first token (TTFT) and decode tok/s
  (tokens after the first divided by the time after the first);
* a 1,000-token prompt and one token: TTFT.

The fidelity runs below decode too (each chat's ``tokens`` greedy tokens), and the table's decode
speed is the **median over those chats** (``decode_tok_s_median``; each chat's rate in
``chat_decode_tok_s``). The engines **take turns** on the chats: every engine decodes chat 0,
then every engine chat 1, and so on (each chat starting from the next engine), so that each
chat's rates are taken within a minute or two of each other. The ratio to llama.cpp
(``vs_llama``) is the median over chats of the two engines' rates on the same chat. Why: this
project's 2-core test machine changed speed by 20-40% over minutes, and when each engine ran
all its chats in one block, an engine's ratio to llama.cpp moved with the minutes it happened to
get (gguf-a8 at 1.03x in one run and 0.79x four hours later, with no code change in its step:
docs/benchmarks.md). ``decode_tok_s`` is the 30-token prompt's single run, timed alone.

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
starts first (also when f32 is not asked for: then it is only the reference); after the chats its
tokens go to every worker, which returns its argmax at each of those positions when fed the
prompt plus f32's tokens in one pass. The parent then computes:

* ``fidelity_greedy``: the mean over prompts of :func:`prefix_agreement` (the share of positions
  that agree with f32 before the first divergence);
* ``fidelity_top1``: the mean over prompts of :func:`top1_agreement` (teacher-forced top-1),
  ``None`` with ``fidelity_top1_error`` when the engine gave no logits.

``--device cuda`` (or ``cuda:N``, ``mps``) runs meshinfer's ``--dtypes`` and transformers on that
device, and the f32 reference stays on the CPU: the GPU rows' fidelity is then how far the
GPU's kernels move the tokens. Their table has a peak device memory column
(``torch.cuda.max_memory_allocated``). llama.cpp runs where its build runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from meshinfer.app.bench import GENERAL_PROMPTS
from meshinfer.core.config import check_cpu_only
from meshinfer.core.errors import InvalidInput

#: Default interpreter that has ``llama_cpp``: the venv ``deploy/install-llama-cpp.sh`` builds.
DEFAULT_LLAMA_PYTHON = ".venv-llama/bin/python"
#: Code the prompts are cut from; repeated to reach 1,000 tokens.
PROMPT_TEXT = ("Write a Python function that checks whether a number is prime, then explain it.\n"
               "def is_prime(n: int) -> bool:\n    if n < 2:\n        return False\n"
               "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n"
               "            return False\n    return True\n")
#: Seconds one worker may run before it is killed.
WORKER_TIMEOUT_S = 1800

#: The request loop every worker ends in (prepended to each script): it prints its first
#: results, then answers the parent's requests on stdin, one JSON line each, until EOF (the
#: parent closes stdin) or a request it does not know: ``{"chat": i}`` greedy-decodes chat prompt i (its tokens, decode rate
#: and start time), ``{"argmax": refs}`` the teacher-forced argmaxes (the last request: llama.cpp
#: drops its decode context for one with every position's logits). Answers start with
#: :data:`ANSWER_MARK`, so a library's stray print on stdout is not taken for one.
ANSWER_MARK = "@@meshinfer-bench "
SERVE = f"ANSWER_MARK = {ANSWER_MARK!r}\n" + r'''
import json, sys, time
def serve(first, chat, argmax):
    def answer(obj):
        print(ANSWER_MARK + json.dumps(obj), flush=True)
    answer(first)
    for line in sys.stdin:
        req = json.loads(line)
        if "chat" in req:
            started = time.time()
            toks, rate = chat(spec["chats"][req["chat"]])
            answer({"tokens": toks, "rate": rate, "started": started})
        elif "argmax" in req:
            try:
                answer({"fidelity_argmax": argmax(req["argmax"])})
            except Exception as exc:
                answer({"fidelity_argmax_error": f"{type(exc).__name__}: {exc}"[:200]})
        else:
            return
'''

MESH_WORKER = r'''
import json, resource, sys, time, torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from meshinfer.engine.generate import greedy_generate, load_shard
t0 = time.perf_counter()
shard = load_shard(spec["model"], dtype=spec["dtype"], device=spec["device"], cache_dir=spec["cache_dir"])
out = {"load_s": time.perf_counter() - t0}
def peak_device_mib():
    return torch.cuda.max_memory_allocated(shard.device) / 2**20 if shard.device.type == "cuda" else None
if spec["speed"]:
    greedy_generate(shard, spec["warm"], max_tokens=3)
    short = greedy_generate(shard, spec["p30"], max_tokens=spec["tokens"])
    long = greedy_generate(shard, spec["p1000"], max_tokens=1)
    out.update(ttft30_ms=short.ttft_ms, decode_tok_s=short.decode_tokens_per_s, ttft1000_ms=long.ttft_ms,
               token_ids=short.token_ids, peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
               peak_device_mib=peak_device_mib())
def chat(p):
    r = greedy_generate(shard, p, max_tokens=spec["tokens"])
    return r.token_ids, r.decode_tokens_per_s
def argmax(refs):
    return [shard(torch.tensor([p + r]), 0, logits="all")[0, len(p) - 1:len(p) - 1 + len(r)]
            .argmax(-1).tolist() for p, r in zip(spec["chats"], refs)]  # (T, V) -> (len(r),)
serve(out, chat, argmax)
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
def chat(p):
    toks, _, rate = run(p, spec["tokens"])
    return toks, rate
def argmax(refs):
    global llm
    del llm  # scores for every position need a context built with logits_all=True (the last request)
    chats = spec["chats"]
    tf = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
               n_ctx=max(len(p) + len(r) for p, r in zip(chats, refs)) + 8, n_batch=512,
               logits_all=True, verbose=False)
    found = []
    for p, r in zip(chats, refs):
        tf.reset()
        tf.eval(p + r)
        found.append(tf.scores[len(p) - 1:len(p) - 1 + len(r)].argmax(-1).tolist())
    return found
serve(out, chat, argmax)
'''

HF_WORKER = r'''
import json, resource, sys, time, torch
from pathlib import Path
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from transformers import AutoModelForCausalLM
path = Path(spec["model"])
t0 = time.perf_counter()
dev = torch.device(spec["device"])
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval().to(dev)
load_s = time.perf_counter() - t0
def sync():  # generate() may return before the device is done
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        torch.mps.synchronize()
def run(ids, n):
    ids = torch.tensor([ids], device=dev)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    sync()
    ttft = time.perf_counter() - t0
    if n == 1:
        return [], ttft * 1e3, 0.0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sync()
    total = time.perf_counter() - t0
    return out[0, ids.shape[1]:].tolist(), ttft * 1e3, (n - 1) / max(total - ttft, 1e-9)
def chat(ids):  # argmax at every step, no end-of-turn stop and no EOS suppression
    n = spec["tokens"]
    step = model(torch.tensor([ids], device=dev), use_cache=True)
    toks, t0 = [int(step.logits[0, -1].argmax())], time.perf_counter()
    while len(toks) < n:
        step = model(torch.tensor([toks[-1:]], device=dev), past_key_values=step.past_key_values, use_cache=True)
        toks.append(int(step.logits[0, -1].argmax()))
    return toks, (n - 1) / max(time.perf_counter() - t0, 1e-9)
def argmax(refs):
    return [model(torch.tensor([p + r], device=dev)).logits[0, len(p) - 1:len(p) - 1 + len(r)]
            .argmax(-1).tolist() for p, r in zip(spec["chats"], refs)]  # (T, V) -> (len(r),)
with torch.inference_mode():
    run(spec["warm"], 3)
    toks, ttft30, rate = run(spec["p30"], spec["tokens"])
    _, ttft1000, _ = run(spec["p1000"], 1)
    out = {"load_s": load_s, "ttft30_ms": ttft30, "decode_tok_s": rate, "ttft1000_ms": ttft1000,
           "token_ids": toks, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "peak_device_mib": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None}
    serve(out, chat, argmax)
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


class WorkerFailed(RuntimeError):
    """An engine's worker process died, or did not answer within :data:`WORKER_TIMEOUT_S`."""


class _Worker:
    """One engine's worker process (:data:`SERVE` at the end of its script), kept alive between
    requests, so that the engines' chats can take turns (:func:`run_single`)."""

    def __init__(self, python: str, script: str, spec: dict) -> None:
        self._err = tempfile.TemporaryFile(mode="w+")  # a file: a full pipe would stop a chatty worker
        self._proc = subprocess.Popen([python, "-c", SERVE + script, json.dumps(spec)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._err, text=True)
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.startswith(ANSWER_MARK):
                self._answers.put(json.loads(line[len(ANSWER_MARK):]))
        self._answers.put(None)  # end of output: the worker exited

    def answer(self, request: dict | None = None) -> dict:
        """Send ``request`` (None: only wait for the worker's first results) and return its answer.

        Raises:
            WorkerFailed: the worker exited (the message is the last line of its stderr) or took
                longer than :data:`WORKER_TIMEOUT_S`.
        """
        if request is not None:
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
            except OSError:
                pass  # it exited: the answer below says why
        try:
            got = self._answers.get(timeout=WORKER_TIMEOUT_S)
        except queue.Empty:
            self.close()
            raise WorkerFailed(f"no answer within {WORKER_TIMEOUT_S} s") from None
        if got is None:
            self._proc.wait()
            self._err.seek(0)
            raise WorkerFailed((self._err.read().strip().splitlines() or ["exit %d" % self._proc.returncode])[-1][:200])
        return got

    def close(self) -> None:
        """End the worker (EOF on its stdin, then a kill after 30 s)."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._err.close()


def join_to_ready_s(model: Path, dtype: str, home: Path, threads: int, device: str = "cpu") -> float:
    """Seconds from starting ``meshinfer join`` (on ``device``) to its ``ready:`` line, with
    ``MESHINFER_HOME=home``.

    Raises:
        RuntimeError: the peer exited or took longer than :data:`WORKER_TIMEOUT_S`.
    """
    log_path = home / f"join-{dtype}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "meshinfer", "join", "--model", str(model), "--dtype", dtype, "--listen",
           "127.0.0.1:0", "--key", str(home / "peer.key"), "--threads", str(threads), "--device", device]
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
                       if k not in ("token_ids", "fidelity_tokens", "fidelity_argmax", "chat_decode_tok_s",
                                    "chat_started")})


def _engines(spec: dict, dtypes: list[str], llama_python: str | None, transformers: bool,
             device: str = "cpu") -> list[tuple[dict, str | None, str, dict]]:
    """Every row to measure, as (row, python or None with the reason in ``row["error"]``,
    worker script, worker spec): meshinfer's f32 on the CPU first (only the fidelity reference
    when it is not in ``dtypes`` or ``device`` is not the CPU), the ``dtypes`` on ``device``,
    llama.cpp (its own build's device), transformers (on ``device``)."""
    reference = ({"engine": "meshinfer", "precision": "f32", "device": "cpu"}, sys.executable, MESH_WORKER,
                 {**spec, "dtype": "f32", "device": "cpu", "speed": device == "cpu" and "f32" in dtypes})
    out = [reference]
    for d in dtypes:
        if device == "cpu" and d == "f32":
            continue  # the reference row
        row = {"engine": "meshinfer", "precision": d, "device": device}
        try:
            check_cpu_only(d, device)
        except InvalidInput as exc:
            row["error"] = str(exc)
        out.append((row, sys.executable if "error" not in row else None, MESH_WORKER,
                    {**spec, "dtype": d, "device": device, "speed": True}))
    python = llama_python or os.environ.get("MESHINFER_LLAMA_PYTHON") or DEFAULT_LLAMA_PYTHON
    others = [("llama.cpp", python, LLAMA_WORKER, "gguf as stored")]
    if transformers:
        others.append(("transformers", sys.executable, HF_WORKER, "f32"))
    for name, py, script, precision in others:
        row: dict = {"engine": name, "precision": precision}
        if not Path(py).exists():
            row["error"] = (f"{py} does not exist (bash deploy/install-llama-cpp.sh builds it, or pass --llama-python)"
                            if name == "llama.cpp" else f"{py} does not exist")
        if name == "transformers":
            row["device"] = device
        out.append((row, py if "error" not in row else None, script, {**spec, "device": device}))
    return out


def _take_turns(live: list[tuple[dict, _Worker]], chats: int) -> None:
    """Decode chat 0 with every engine, then chat 1, and so on, each chat starting from the next
    engine in turn; each row gets ``fidelity_tokens``, ``chat_decode_tok_s`` and ``chat_started``
    (Unix seconds). A worker that fails leaves its row with ``error`` and drops out."""
    for i in range(chats):
        for row, worker in live[i % len(live):] + live[:i % len(live)]:
            if "error" in row:
                continue
            try:
                got = worker.answer({"chat": i})
            except WorkerFailed as exc:
                row["error"] = str(exc)
                continue
            row.setdefault("fidelity_tokens", []).append(got["tokens"])
            row.setdefault("chat_decode_tok_s", []).append(got["rate"])
            row.setdefault("chat_started", []).append(got["started"])


def _first_results(row: dict, worker: _Worker, join: tuple[Path, Path, int] | None, progress) -> None:
    """Wait for ``worker``'s load and speed runs into ``row``; then, for meshinfer with
    ``join`` = (model, scratch folder, threads), time a real ``join`` to ready, cold and cached.
    A worker that fails leaves ``row`` its ``error``."""
    try:
        row.update(worker.answer())
    except WorkerFailed as exc:
        row["error"] = str(exc)
        return
    if progress:
        progress("loaded, speed runs done (chats next): " + _progress_line(row))
    if join is not None and row["engine"] == "meshinfer":
        model, tmp, threads = join
        home = tmp / f"home-{row['precision']}-{row['device']}"
        home.mkdir()
        row["join_cold_s"] = join_to_ready_s(model, row["precision"], home, threads, row["device"])
        row["join_cached_s"] = join_to_ready_s(model, row["precision"], home, threads, row["device"])


def _teacher_forced(live: list[tuple[dict, _Worker]], refs: list[list[int]]) -> None:
    """Each live row's ``fidelity_argmax`` for f32's tokens ``refs`` (or ``fidelity_argmax_error``)."""
    for row, worker in live:
        if "error" not in row:
            try:
                row.update(worker.answer({"argmax": refs}))
            except WorkerFailed as exc:
                row["fidelity_argmax_error"] = str(exc)


def run_single(*, model: str, dtypes: list[str], tokens: int, threads: int, llama_python: str | None,
               transformers: bool = True, join_times: bool = True, device: str = "cpu",
               progress=None) -> list[dict]:
    """Run every engine (see the module docstring); one result dict per row, in ``dtypes`` order,
    then llama.cpp and transformers.

    ``device`` (cpu, cuda, cuda:N, mps) is where meshinfer's ``dtypes`` and transformers run;
    the fidelity reference is meshinfer f32 on the CPU (module docstring). A CPU-only precision
    on another device gets a row with its error.

    Each engine's worker loads its model and times its speed runs while the workers before it
    wait idle; then the engines **take turns** on the fidelity chats (:func:`_take_turns`), so
    that every engine decodes chat i within the same minute or two: a machine whose speed
    drifts by 20-40% over minutes (docs/benchmarks.md) slows every engine's chat i alike, and
    ``vs_llama`` (:func:`add_paired_ratio`) compares the engines chat by chat.

    A row has ``engine``, ``precision`` and either ``error`` or the measured fields: ``load_s``,
    ``ttft30_ms``, ``decode_tok_s``, ``decode_tok_s_median`` (:func:`add_decode_median`) with the
    ``chat_decode_tok_s`` it comes from, ``vs_llama``, ``ttft1000_ms``, ``peak_rss_mib``, for
    meshinfer ``join_cold_s`` / ``join_cached_s``, and the fidelity (:func:`add_fidelity`) with
    the lists it comes from: ``fidelity_tokens`` (greedy ids per chat prompt) and
    ``fidelity_argmax`` (teacher-forced argmaxes per chat prompt); ``device`` for meshinfer and
    transformers, and ``peak_device_mib`` (``torch.cuda.max_memory_allocated``; None off CUDA).
    ``tokens`` is the number of greedy tokens of both the speed run and each fidelity prompt.
    Every engine is loaded at once during the chats: the sum of their memory (about 11 GB for
    the default model with every precision, llama.cpp and transformers).
    """
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(model)
    spec = {"model": str(path), "threads": threads, "tokens": tokens, **prompt_ids(path)}
    live: list[tuple[dict, _Worker]] = []
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="meshinfer-bench-") as tmp:
        spec["cache_dir"] = f"{tmp}/converted"
        try:
            for row, python, script, wspec in _engines(spec, dtypes, llama_python, transformers, device):
                rows.append(row)
                if python is not None:
                    live.append((row, _Worker(python, script, wspec)))
                    join = (path, Path(tmp), threads) if join_times and wspec.get("speed") else None
                    _first_results(*live[-1], join, progress)
            _take_turns(live, len(spec["chats"]))
            f32 = rows[0]
            refs = f32.get("fidelity_tokens") if "error" not in f32 else None
            why = f"the f32 reference failed: {f32['error']}" if "error" in f32 else ""
            if refs is not None:
                _teacher_forced(live, refs)
        finally:
            for _, worker in live:
                worker.close()
    rows = _summarize(rows, refs, why, dtypes, device)
    if progress:
        for row in rows:
            progress(_progress_line(row))
    return rows


def _summarize(rows: list[dict], refs: list[list[int]] | None, why: str, dtypes: list[str],
               device: str) -> list[dict]:
    """Each row's fidelity, decode median and ratio to llama.cpp; returns the rows to report:
    meshinfer's ``dtypes`` on ``device`` in that order (not the CPU f32 reference, unless it is
    one of them), then the other engines."""
    llama = next((r for r in rows if r["engine"] == "llama.cpp"), None)
    for row in rows:
        add_fidelity(row, refs, why)
        add_decode_median(row)
        add_paired_ratio(row, llama)
    mesh = {r["precision"]: r for r in rows if r["engine"] == "meshinfer" and r["device"] == device}
    return [mesh[d] for d in dtypes] + [r for r in rows if r["engine"] != "meshinfer"]


def add_paired_ratio(row: dict, llama: dict | None) -> None:
    """Set ``row``'s ``vs_llama``: the median over chats of its decode rate on chat i divided by
    llama.cpp's on chat i (the chats the two decoded turn about, :func:`run_single`); None without
    a llama.cpp row with as many chats. In place; a row with ``error`` is left alone."""
    if "error" in row:
        return
    mine, theirs = row.get("chat_decode_tok_s"), (llama or {}).get("chat_decode_tok_s")
    if not mine or not theirs or len(mine) != len(theirs) or "error" in llama:
        row["vs_llama"] = None
        return
    row["vs_llama"] = statistics.median(a / b for a, b in zip(mine, theirs))


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
    on_device = any(r.get("device", "cpu") != "cpu" for r in rows)
    lines = [f"| engine | precision{' (device)' if on_device else ''} | decode tok/s (median of {len(GENERAL_PROMPTS)} chats x {tokens} tokens) | "
             f"vs llama.cpp | greedy agreement with f32 | "
             f"teacher-forced top-1 | TTFT ms, 30-token prompt | TTFT ms, 1000-token prompt | peak RSS MiB | "
             f"{'peak device MiB | ' if on_device else ''}load s | join→ready s cold / cached |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if on_device else "")]
    for r in rows:
        precision = f"{r['precision']} ({r['device']})" if on_device and "device" in r else r["precision"]
        if "error" in r:
            lines.append(f"| {r['engine']} | {precision} | not measured: {r['error']} | | | | | | | | |"
                         + (" |" if on_device else ""))
            continue
        rate = r.get("decode_tok_s_median", r["decode_tok_s"])
        paired = r.get("vs_llama")
        ratio = f"{paired:.2f}" if paired is not None else (f"{rate / llama:.2f}" if llama else "-")
        join = f"{r['join_cold_s']:.1f} / {r['join_cached_s']:.1f}" if "join_cold_s" in r else "-"
        device_mib = r.get("peak_device_mib")
        device_cell = (f"{device_mib:.0f} | " if device_mib is not None else "- | ") if on_device else ""
        lines.append(f"| {r['engine']} | {precision} | {rate:.1f} | {ratio} | "
                     f"{_fidelity_cell(r, 'fidelity_greedy')} | {_fidelity_cell(r, 'fidelity_top1')} | "
                     f"{r['ttft30_ms']:.0f} | {r['ttft1000_ms']:.0f} | {r['peak_rss_mib']:.0f} | {device_cell}"
                     f"{r['load_s']:.1f} | {join} |")
    note = (f"\n\n{threads} thread{'s' if threads != 1 else ''} per engine, one process each after a warm-up; decode speed is the median "
            f"of the fidelity chats' decodes, which the engines took turns on; vs llama.cpp is the median over "
            f"chats of the two engines' rates on the same chat. Fidelity: {len(GENERAL_PROMPTS)} "
            f"built-in chat prompts x {tokens} greedy tokens against meshinfer f32 on the CPU (greedy: mean share of "
            f"positions before the first divergence; teacher-forced: share of top-1 equal to f32's tokens).")
    if on_device:
        note += " meshinfer f32 on the CPU ran only as the fidelity reference."
    elif not any(r["engine"] == "meshinfer" and r["precision"] == "f32" for r in rows):
        note += " f32 is not in --dtypes: it ran only as the fidelity reference."
    return "\n".join(lines) + note
