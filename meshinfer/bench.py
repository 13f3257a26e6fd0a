"""``meshinfer bench``: a single peer against 2- and 3-peer splits on loopback, in one run.

Each setup starts real ``meshinfer join`` processes on loopback (as a user would), waits
until they are ready and gossiped, then runs the same greedy conversation ``repeats`` times
through :class:`~meshinfer.session.MeshClient` after one warm-up conversation. It reports
the median first-token latency (TTFT) for a ~30-token prompt and the median decode tokens/s.
"""

from __future__ import annotations

import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


def even_splits(num_layers: int, n: int) -> list[tuple[int, int]]:
    """``n`` consecutive inclusive ranges covering ``num_layers`` layers as evenly as possible."""
    return [(i * num_layers // n, (i + 1) * num_layers // n - 1) for i in range(n)]


def _start_peers(model: str, splits: list[tuple[int, int]], base_port: int, dtype: str, logdir: Path):
    procs = []
    for i, (a, b) in enumerate(splits):
        cmd = [sys.executable, "-m", "meshinfer", "join", "--model", model, "--layers", f"{a}-{b}",
               "--listen", f"127.0.0.1:{base_port + i}", "--dtype", dtype, "--key", str(logdir / f"k{i}.pem")]
        if i:
            cmd += ["--peers", f"ws://127.0.0.1:{base_port}"]
        log = open(logdir / f"peer{i}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), logdir / f"peer{i}.log"))
    deadline = time.monotonic() + 600
    for proc, log in procs:
        while "ready:" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"peer failed to start:\n{log.read_text()[-2000:]}")
            time.sleep(0.3)
    return [p for p, _ in procs]


async def _measure(url: str, n_peers: int, max_tokens: int, repeats: int) -> dict:
    from .errors import NoRoute
    from .session import MeshClient

    async with MeshClient([url]) as client:
        for _ in range(100):  # gossip needs a moment to spread every advert
            try:
                route = await client.plan()
                if len(route.hops) == n_peers:
                    break
            except NoRoute:
                pass
            await asyncio.sleep(0.3)
        tok = await client.tokenizer(route)
        ids = tok.encode_chat(BENCH_MESSAGES)
        runs = []
        for i in range(repeats + 1):
            conv = client.conversation(route, max_tokens_total=len(ids) + max_tokens)
            out = await conv.generate(ids, max_tokens=max_tokens, eos_ids=())
            await conv.close()
            if i:  # the first conversation is a warm-up
                runs.append(out)
        return {"route": route.describe(), "prompt_tokens": len(ids),
                "ttft_ms": statistics.median(r.ttft_ms for r in runs),
                "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
                "hops": runs[-1].route}


def run_bench(*, model: str, splits: list[int], max_tokens: int, repeats: int, dtype: str, base_port: int,
              progress=None) -> tuple[str, list[dict]]:
    """Run the benchmark described in the module docstring.

    Args:
        model: path or known model name.
        splits: peer counts to measure, e.g. ``[1, 2, 3]``.
        max_tokens: tokens generated per conversation.
        repeats: timed conversations per setup (after one warm-up).
        dtype: ``f32``, ``bf16`` or ``f16``.
        base_port: first loopback port used by the peers.
        progress: called with a one-line summary after each setup.

    Returns:
        ``(header, results)``: a one-line description of the run and one dict per setup.

    Raises:
        RuntimeError: a peer failed to start.
    """
    from .weights import open_weights
    from .weights.identity import weights_hash
    from .weights.registry import resolve_model

    path = resolve_model(model)
    num_layers = open_weights(path).config.num_hidden_layers
    results = []
    for n in splits:
        with tempfile.TemporaryDirectory() as tmp:
            procs = _start_peers(str(path), even_splits(num_layers, n), base_port, dtype, Path(tmp))
            try:
                r = asyncio.run(_measure(f"ws://127.0.0.1:{base_port}", n, max_tokens, repeats))
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(30)
        r["peers"] = n
        results.append(r)
        if progress:
            progress(f"{n} peer(s): TTFT {r['ttft_ms']:.0f} ms, {r['decode_tokens_per_s']:.2f} tok/s")
    header = (f"model {path.name} (weights {weights_hash(path)[:12]}), {dtype}, CPU "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {repeats} runs after a "
              f"warm-up, {max_tokens} new tokens")
    return header, results


def markdown_table(results: list[dict]) -> str:
    """The results of :func:`run_bench` as a markdown table, relative to the first setup."""
    base = results[0]["decode_tokens_per_s"] or 1.0
    lines = ["| peers | route | prompt tokens | first token ms | decode tok/s | vs 1 peer |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['peers']} | {r['route']} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | "
                     f"{r['decode_tokens_per_s']:.2f} | {r['decode_tokens_per_s'] / base:.2f} |")
    return "\n".join(lines)
