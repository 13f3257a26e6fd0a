"""``meshinfer bench``: measurements that compare setups side by side, in one run each.

Every suite starts real ``meshinfer join`` processes on loopback (as a user would), waits
until they are ready and gossiped, and drives them through :class:`~meshinfer.client.mesh.MeshClient`.

- ``splits`` (:func:`run_bench`): a single peer against 2- and 3-peer splits: median TTFT for a
  ~30-token prompt and median decode tokens/s (plain decoding, so the numbers measure the
  split, not the prompt's repetitiveness), after one warm-up conversation. Every setup runs at
  once (its own mesh, on its own ports) and the setups take turns, one conversation each, so
  that a machine whose speed drifts over minutes slows each turn's setups alike; the ratio to
  the first setup is the median of the turns' ratios.
- ``speculative`` (:func:`run_spec_bench`): plain decoding against prompt lookup and (with a
  draft model) draft-model speculation, on general chats (:data:`GENERAL_PROMPTS` or
  ``--prompts FILE``) and on a code edit (:data:`CODE_EDIT_MESSAGES`), over a 2-peer split with
  a ``meshinfer netsim`` proxy in front of every peer (so client -> hop 1, hop 1 -> hop 2 and
  hop 2 -> client each cross one) at each RTT asked for: decode tokens/s of each mode, its ratio
  to plain, the draft acceptance rate, decode steps, and whether the outputs are identical.
- ``ttft`` (:func:`run_ttft_bench`): per setup (1 and 2 peers), the time from ``join`` start to
  ready, the TTFT of the first conversation after ready (cold) against later ones (steady),
  and the TTFT of a ~1,000-token prompt (pipelined chunked prefill on a split).
- with ``--concurrency 1,4,16,32`` (:func:`run_concurrency_bench`): for each setup, N greedy
  conversations at once on the same route; aggregate tokens/s (the peers batch decode steps
  that arrive together, :mod:`meshinfer.peer.scheduler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

BENCH_MESSAGES = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]

#: A ~30-line function to reproduce with one change: the code-editing prompt of the speculative
#: benchmark and tests (prompt lookup drafts most of the answer from it).
CODE_EDIT_FUNCTION = """def summarize_orders(orders, tax_rate=0.2, currency="EUR"):
    \"\"\"Return totals per customer and the grand total of a list of orders.\"\"\"
    totals = {}
    count = 0
    for order in orders:
        customer = order.get("customer", "unknown")
        items = order.get("items", [])
        subtotal = 0.0
        for item in items:
            price = float(item.get("price", 0.0))
            quantity = int(item.get("quantity", 1))
            if quantity <= 0:
                continue
            subtotal += price * quantity
        discount = order.get("discount", 0.0)
        if discount:
            subtotal -= subtotal * discount
        tax = subtotal * tax_rate
        total = round(subtotal + tax, 2)
        totals[customer] = totals.get(customer, 0.0) + total
        count += 1
    grand_total = round(sum(totals.values()), 2)
    report = []
    for customer, amount in sorted(totals.items()):
        report.append(f"{customer}: {amount:.2f} {currency}")
    report.append(f"orders: {count}")
    report.append(f"grand total: {grand_total:.2f} {currency}")
    return totals, grand_total, "\\n".join(report)
"""
CODE_EDIT_MESSAGES = [{"role": "user", "content": (
    "Here is a Python function:\n\n```python\n" + CODE_EDIT_FUNCTION + "```\n\n"
    "Rewrite it with the variable `subtotal` renamed to `net`. Change nothing else and reply "
    "with the whole function in one code block.")}]


def even_splits(num_layers: int, n: int) -> list[tuple[int, int]]:
    """``n`` consecutive inclusive ranges covering ``num_layers`` layers as evenly as possible."""
    return [(i * num_layers // n, (i + 1) * num_layers // n - 1) for i in range(n)]


def _start_peers(model: str, splits: list[tuple[int, int]], base_port: int, dtype: str, logdir: Path, *,
                 public_ports: list[int] | None = None, ready_s: list[float] | None = None):
    """Start one ``meshinfer join`` per split; wait until all are ready.

    ``public_ports``: advertise ``ws://127.0.0.1:PORT`` (a proxy) instead of the listening port.
    ``ready_s``: filled with each peer's seconds from process start to its ready line (peers
    start together, so they share the CPU while loading).
    """
    procs = []
    t0 = time.monotonic()
    for i, (a, b) in enumerate(splits):
        cmd = [sys.executable, "-m", "meshinfer", "join", "--model", model, "--layers", f"{a}-{b}",
               "--listen", f"127.0.0.1:{base_port + i}", "--dtype", dtype, "--key", str(logdir / f"k{i}.pem")]
        if i:
            cmd += ["--peers", f"ws://127.0.0.1:{base_port}"]
        if public_ports:
            cmd += ["--public-addr", f"ws://127.0.0.1:{public_ports[i]}"]
        log = open(logdir / f"peer{i}.log", "w")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), logdir / f"peer{i}.log"))
    deadline = time.monotonic() + 600
    for proc, log in procs:
        while "ready:" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"peer failed to start:\n{log.read_text()[-2000:]}")
            time.sleep(0.1)
        if ready_s is not None:
            ready_s.append(round(time.monotonic() - t0, 2))
    return [p for p, _ in procs]


def _stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


async def _route(client, n_peers: int):
    """Plan until gossip has spread every advert and the route has ``n_peers`` hops."""
    from meshinfer.core.errors import NoRoute

    route = None
    for _ in range(100):
        try:
            route = await client.plan()
            if len(route.hops) == n_peers:
                return route
        except NoRoute:
            pass
        await asyncio.sleep(0.3)
    if route is None:
        raise RuntimeError(f"no route over {n_peers} peers formed")
    return route


async def _measure(urls: list[str], peer_counts: list[int], max_tokens: int, repeats: int) -> list[dict]:
    """One dict per setup (a mesh reached at ``urls[k]`` with ``peer_counts[k]`` peers): the
    setups take turns, one conversation each, warm-up turn first; each turn starts from the
    next setup. ``vs_first``: the median over turns of the setup's decode rate divided by the
    first setup's in the same turn."""
    from meshinfer.client.mesh import MeshClient

    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(MeshClient([url])) for url in urls]
        routes = [await _route(c, n) for c, n in zip(clients, peer_counts)]
        ids = (await clients[0].tokenizer(routes[0])).encode_chat(BENCH_MESSAGES)
        runs: list[list] = [[] for _ in urls]
        for i in range(repeats + 1):
            for k in [*range(i % len(urls), len(urls)), *range(i % len(urls))]:
                conv = clients[k].conversation(routes[k], max_tokens_total=len(ids) + max_tokens, speculate=False)
                out = await conv.generate(ids, max_tokens=max_tokens, eos_ids=())
                await conv.close()
                if i:  # the first turn is a warm-up
                    runs[k].append(out)
    rates = [[r.decode_tokens_per_s for r in rk] for rk in runs]
    return [{"route": route.describe(), "prompt_tokens": len(ids),
             "ttft_ms": statistics.median(r.ttft_ms for r in rk),
             "decode_tokens_per_s": statistics.median(rate), "decode_tokens_per_s_runs": rate,
             "vs_first": statistics.median(a / b for a, b in zip(rate, rates[0])), "hops": rk[-1].route}
            for route, rk, rate in zip(routes, runs, rates)]


def _start(model: str, n: int, base_port: int, dtype: str, tmp: str):
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(model)
    num_layers = open_weights(path).config.num_hidden_layers
    return _start_peers(str(path), even_splits(num_layers, n), base_port, dtype, Path(tmp))



async def _concurrent(client, route, ids: list[int], n: int, max_tokens: int) -> dict:
    """``n`` conversations: each prefills (and takes its first token) in turn, then all decode
    ``max_tokens`` more together; the decode phase gives the aggregate rate. Prefills run one
    after another because N prefills at once queue on the first hop beyond the client's step
    deadline on a slow CPU (a prefill runs alone; see :mod:`meshinfer.peer.scheduler`). Decoding is
    plain (no speculation), so the rate measures batching, not the prompt's repetitiveness."""
    convs = [client.conversation(route, max_tokens_total=len(ids) + 1 + max_tokens, speculate=False)
             for _ in range(n)]
    try:
        t0 = time.perf_counter()
        firsts = [await c.generate(ids, max_tokens=1, eos_ids=()) for c in convs]
        t1 = time.perf_counter()
        outs = await asyncio.gather(*(c.generate(ids + f.token_ids, max_tokens=max_tokens, eos_ids=())
                                      for c, f in zip(convs, firsts)))
        t2 = time.perf_counter()
    finally:
        for c in convs:
            await c.close()
    decoded = sum(len(o.token_ids) for o in outs)
    return {"conversations": n, "tokens": n + decoded, "prefill_s": t1 - t0, "decode_s": t2 - t1,
            "aggregate_tokens_per_s": decoded / (t2 - t1),
            "end_to_end_tokens_per_s": (n + decoded) / (t2 - t0)}


async def _measure_concurrency(url: str, n_peers: int, counts: list[int], max_tokens: int,
                               progress=None) -> list[dict]:
    from meshinfer.client.mesh import MeshClient

    async with MeshClient([url]) as client:
        route = await _route(client, n_peers)
        ids = (await client.tokenizer(route)).encode_chat(BENCH_MESSAGES)
        await _concurrent(client, route, ids, 1, 4)  # warm-up
        rows = []
        for n in counts:
            r = await _concurrent(client, route, ids, n, max_tokens)
            rows.append(r | {"route": route.describe(), "prompt_tokens": len(ids), "peers": n_peers})
            if progress:
                progress(f"{n_peers} peer(s), {n} conversations: {r['aggregate_tokens_per_s']:.2f} tok/s "
                         f"aggregate decode, {r['end_to_end_tokens_per_s']:.2f} end to end")
        return rows


def run_concurrency_bench(*, model: str, splits: list[int], concurrency: list[int], max_tokens: int, dtype: str,
                          base_port: int, progress=None) -> tuple[str, list[dict]]:
    """Aggregate tokens/s of N simultaneous conversations on one route, for each setup.

    For each peer count in ``splits`` and each N in ``concurrency``, N greedy conversations on
    the same route each prefill the prompt and take their first token (one after another), then
    all decode ``max_tokens`` more tokens at once, plainly (no speculation).
    ``aggregate_tokens_per_s`` is the decode phase's tokens over its wall time;
    ``end_to_end_tokens_per_s`` counts every token (the first ones too) over both phases.

    Returns:
        ``(header, results)``: one dict per (setup, N) with ``peers`` and ``conversations``.

    Raises:
        RuntimeError: a peer failed to start.
    """
    from meshinfer.engine.weights.identity import weights_hash
    from meshinfer.engine.weights.registry import resolve_model

    results = []
    for n in splits:
        with tempfile.TemporaryDirectory() as tmp:
            procs = _start(model, n, base_port, dtype, tmp)
            try:
                rows = asyncio.run(_measure_concurrency(f"ws://127.0.0.1:{base_port}", n, concurrency, max_tokens,
                                                        progress))
            finally:
                _stop(procs)
        results.extend(rows)
    path = resolve_model(model)
    header = (f"model {path.name} (weights {weights_hash(path)[:12]}), {dtype}, CPU "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {max_tokens} new tokens "
              f"decoded per conversation after its first, all conversations together on one route")
    return header, results


def concurrency_table(results: list[dict]) -> str:
    """The results of :func:`run_concurrency_bench` as a markdown table, relative to 1 conversation."""
    base = {r["peers"]: r["aggregate_tokens_per_s"] for r in results if r["conversations"] == 1}

    def row(r: dict) -> str:
        one = base.get(r["peers"]) or 0.0
        rel = f"{r['aggregate_tokens_per_s'] / one:.2f}" if one else "-"
        return (f"| {r['peers']} | {r['conversations']} | {r['aggregate_tokens_per_s']:.2f} | {rel} | "
                f"{r['end_to_end_tokens_per_s']:.2f} | {r['prefill_s']:.1f} |")

    return _markdown("| peers | conversations | aggregate decode tok/s | vs 1 conversation | end-to-end tok/s | "
                     "prefill s |", "|---:|---:|---:|---:|---:|---:|", results, row)


def _markdown(head: str, align: str, rows: list[dict], row: Callable[[dict], str]) -> str:
    """A markdown table: its ``head`` and ``align`` lines, then ``row(r)`` for each of ``rows``."""
    return "\n".join([head, align, *(row(r) for r in rows)])


def markdown_table(results: list[dict]) -> str:
    """The results of :func:`run_bench` as a markdown table, relative to the first setup (the
    median of the turns' ratios, ``vs_first``)."""
    first = results[0]["peers"]
    return _markdown(f"| peers | route | prompt tokens | first token ms | decode tok/s | vs {first} peer(s), turn by turn |",
                     "|---:|---|---:|---:|---:|---:|", results,
                     lambda r: f"| {r['peers']} | {r['route']} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | "
                               f"{r['decode_tokens_per_s']:.2f} | {r['vs_first']:.2f} |")


def run_bench(*, model: str, splits: list[int], max_tokens: int, repeats: int, dtype: str, base_port: int,
              progress=None) -> tuple[str, list[dict]]:
    """Run the benchmark described in the module docstring.

    Args:
        model: path or known model name.
        splits: peer counts to measure, e.g. ``[1, 2, 3]``; every setup runs at once (its own
            mesh on ports ``base_port`` .. ``base_port + sum(splits) - 1``), so the machine needs
            the memory of all of them (1, 2 and 3 peers: three copies of the weights, about 8 GB
            for the default model at f32, from its 2.7 GB single peer).
        max_tokens: tokens generated per conversation.
        repeats: timed conversations per setup (after one warm-up).
        dtype: ``f32``, ``bf16`` or ``f16``.
        base_port: first loopback port used by the peers.
        progress: called with a one-line summary per setup, after the turns.

    Returns:
        ``(header, results)``: a one-line description of the run and one dict per setup.

    Raises:
        RuntimeError: a peer failed to start.
    """
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.identity import weights_hash
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(model)
    num_layers = open_weights(path).config.num_hidden_layers
    ports = [base_port + sum(splits[:k]) for k in range(len(splits))]  # each setup its own mesh
    procs: list = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for n, port in zip(splits, ports):
                logdir = Path(tmp) / f"{n}-peers-{port}"
                logdir.mkdir()
                procs += _start_peers(str(path), even_splits(num_layers, n), port, dtype, logdir)
            results = asyncio.run(_measure([f"ws://127.0.0.1:{p}" for p in ports], splits, max_tokens, repeats))
        finally:
            _stop(procs)
    for n, r in zip(splits, results):
        r["peers"] = n
        if progress:
            progress(f"{n} peer(s): TTFT {r['ttft_ms']:.0f} ms, {r['decode_tokens_per_s']:.2f} tok/s")
    header = (f"model {path.name} (weights {weights_hash(path)[:12]}), {dtype}, CPU "
              f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {repeats} runs after a "
              f"warm-up, taking turns, {max_tokens} new tokens")
    return header, results


# --------------------------------------------------------------------------- speculative
#: Ordinary chats for the speculative suite (issue 12): explanations, arithmetic, translation, a
#: script, a haiku... Answers that do not repeat their prompt, unlike :data:`CODE_EDIT_MESSAGES`.
GENERAL_PROMPTS = [[{"role": "user", "content": text}] for text in (
    "Explain in a short paragraph why the sky is blue.",
    "What is 17 multiplied by 23? Show the steps.",
    "Translate into French: 'The train leaves at eight tomorrow morning, so we should pack tonight.'",
    "Write a bash script that counts the lines of every .txt file in a directory.",
    "Write a haiku about autumn rain.",
    "Explain the difference between a list and a tuple in Python.",
    "Give three tips for a good night's sleep.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
)]
#: Decoding modes of the speculative suite, in the order each prompt runs them: plain decoding,
#: prompt lookup, the draft model (drafting ahead during steps as ``--draft-ahead`` says), and
#: the draft model never drafting ahead (``draft-serial``, to measure what drafting ahead gives).
SPEC_MODES = ("plain", "lookup", "draft", "draft-serial")
#: Modes run unless ``--modes`` says otherwise (the draft modes only with a draft model).
DEFAULT_SPEC_MODES = ("plain", "lookup", "draft")


def load_prompts(path: str | os.PathLike) -> list[list[dict]]:
    """A ``--prompts`` file: a JSON list of OpenAI-style message lists.

    Raises:
        ValueError: unreadable, not JSON, or not a non-empty list of non-empty lists of
            ``{"role": str, "content": str}``; the message names the first bad entry.
    """
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--prompts {path}: {exc}") from exc
    if not isinstance(data, list) or not data:
        raise ValueError(f"--prompts {path}: expected a non-empty JSON list of message lists")
    for i, msgs in enumerate(data):
        ok = isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)
        if not ok:
            raise ValueError(f"--prompts {path}: entry {i} is not a non-empty list of {{role, content}} messages")
    return data


def _decode_s(out) -> float:
    """Wall seconds of a generation's decode steps (tokens after the first over their rate)."""
    n = len(out.token_ids) - 1 + (out.finish_reason == "stop")  # an EOS was decoded, not kept
    return n / out.decode_tokens_per_s if out.decode_tokens_per_s else 0.0


async def _spec_run(client, route, tok, prompts: list, *, max_tokens: int, context: int, draft_tokens: int,
                    modes: Sequence[str], draft) -> dict:
    """Every prompt once in each mode (modes alternate per prompt); {mode: [ChatResult, ...]}."""
    opts = {"plain": dict(speculate=False, draft_model=None), "lookup": dict(draft_model=None),
            "draft": dict(draft_model=draft), "draft-serial": dict(draft_model=draft, draft_ahead=False)}
    runs: dict = {m: [] for m in modes}
    for messages in prompts:
        ids = tok.encode_chat(messages)
        ids = ids[max(0, len(ids) - (context - max_tokens - 1)):]  # cut to fit only tiny test models
        for mode in modes:
            conv = client.conversation(route, max_tokens_total=len(ids) + max_tokens, draft_tokens=draft_tokens,
                                       **opts[mode])
            try:
                runs[mode].append(await conv.generate(ids, max_tokens=max_tokens, eos_ids=tok.eos_ids))
            finally:
                await conv.close()
    return runs


def _spec_rows(rtt: float, prompt_set: str, route, runs: dict) -> list[dict]:
    """One row per mode: aggregate decode tokens/s over the set, its ratio to plain, acceptance,
    decode steps, the median time to first token (ms), and whether every prompt's tokens equal
    plain decoding's."""
    def rate(outs) -> float:
        secs = sum(_decode_s(o) for o in outs)
        return sum(len(o.token_ids) - 1 + (o.finish_reason == "stop") for o in outs) / secs if secs else 0.0

    plain = rate(runs["plain"])
    rows = []
    for mode, outs in runs.items():
        proposed = sum(o.speculative.get("proposed", 0) for o in outs)
        accepted = sum(o.speculative.get("accepted", 0) for o in outs)
        steps = sum(o.speculative.get("steps", 0) + o.speculative.get("plain_steps", 0) if o.speculative
                    else len(o.token_ids) - 1 + (o.finish_reason == "stop") for o in outs)
        rows.append({"rtt_ms": rtt, "prompts": prompt_set, "mode": mode, "route": route.describe(),
                     "conversations": len(outs), "new_tokens": sum(len(o.token_ids) for o in outs),
                     "tokens_per_s": rate(outs), "vs_plain": rate(outs) / plain if plain else 0.0,
                     "acceptance": accepted / proposed if proposed else 0.0, "proposed": proposed,
                     "verify_steps": sum(o.speculative.get("steps", 0) for o in outs), "decode_steps": steps,
                     "ttft_ms_median": statistics.median(o.ttft_ms for o in outs) if outs else 0.0,
                     "identical": all(a.token_ids == b.token_ids for a, b in zip(runs["plain"], outs))})
    return rows


async def _spec_measure(base_port: int, proxy_ports: list[int], rtts_ms: list[float], *, prompt_sets: dict,
                        max_tokens: int, repeats: int, draft_tokens: int, context: int, draft, progress,
                        modes: Sequence[str], draft_ahead) -> list[dict]:
    from meshinfer.app.netsim import NetSim
    from meshinfer.client.mesh import MeshClient

    modes = [m for m in modes if not m.startswith("draft") or draft is not None]
    proxies = [await NetSim("127.0.0.1", base_port + i, port=p).start() for i, p in enumerate(proxy_ports)]
    try:
        async with MeshClient([f"ws://127.0.0.1:{proxy_ports[0]}"], draft_model=draft,
                              draft_ahead=draft_ahead) as client:
            route = await _route(client, len(proxy_ports))
            tok = await client.tokenizer(route)
            rows = []
            for rtt in rtts_ms:
                for proxy in proxies:
                    proxy.one_way_s = rtt / 2e3
                await _spec_run(client, route, tok, [BENCH_MESSAGES], max_tokens=4, context=context,  # warm-up
                                draft_tokens=draft_tokens, modes=modes, draft=draft)
                for name, prompts in prompt_sets.items():
                    runs: dict = {m: [] for m in modes}
                    for _ in range(repeats):
                        got = await _spec_run(client, route, tok, prompts, max_tokens=max_tokens, context=context,
                                              draft_tokens=draft_tokens, modes=modes, draft=draft)
                        for m in modes:
                            runs[m] += got[m]
                    rows += _spec_rows(rtt, name, route, runs)
                    if progress:
                        progress(f"RTT {rtt:g} ms, {name}: " + ", ".join(
                            f"{r['mode']} {r['tokens_per_s']:.2f} tok/s (x{r['vs_plain']:.2f})"
                            for r in rows[-len(modes):]))
            return rows
    finally:
        for proxy in proxies:
            await proxy.close()


def run_spec_bench(*, model: str, rtts_ms: list[float], max_tokens: int, repeats: int, dtype: str, base_port: int,
                   draft_tokens: int, peers: int = 2, prompts: list | None = None, draft_model: str | None = None,
                   draft_dtype: str = "auto", draft_device: str = "cpu", draft_threads: int | None = 1,
                   modes: Sequence[str] = DEFAULT_SPEC_MODES, draft_ahead: bool | str = "auto",
                   progress=None) -> tuple[str, list[dict]]:
    """Plain, prompt-lookup and draft-model decoding through netsim proxies (module docstring).

    Each RTT runs a warm-up, then ``repeats`` passes over the general prompts (``prompts``, default
    :data:`GENERAL_PROMPTS`) and over the code edit, each prompt in every mode in turn.
    ``modes``: a subset of :data:`SPEC_MODES` ("plain" is always run: the other rows are ratios
    to it); ``draft_ahead`` is the "draft" mode's (see :class:`~meshinfer.client.conversation.Conversation`).

    Returns:
        ``(header, rows)``: one row per (RTT, prompt set, mode), see :func:`spec_table`.

    Raises:
        RuntimeError: a peer failed to start. ModelNotFound, WeightsError, IncompatibleDraft: the
        draft model (loaded before any peer starts). ValueError: an unknown mode.
    """
    unknown = sorted(set(modes) - set(SPEC_MODES))
    if unknown:
        raise ValueError(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(SPEC_MODES)}")
    modes = ["plain", *(m for m in SPEC_MODES if m in modes and m != "plain")]
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.registry import meshinfer_home, resolve_model

    path = resolve_model(model)
    cfg = open_weights(path).config
    draft = None
    if draft_model is not None:
        from meshinfer.client.draft import load_draft_model

        draft = load_draft_model(draft_model, device=draft_device, dtype=draft_dtype,
                                 cache_dir=meshinfer_home() / "converted", threads=draft_threads)
    prompt_sets = {"general": prompts or GENERAL_PROMPTS, "code edit": [CODE_EDIT_MESSAGES]}
    proxy_ports = [base_port + 50 + i for i in range(peers)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = _start_peers(str(path), even_splits(cfg.num_hidden_layers, peers), base_port, dtype, Path(tmp),
                                 public_ports=proxy_ports)
            try:
                rows = asyncio.run(_spec_measure(base_port, proxy_ports, rtts_ms, prompt_sets=prompt_sets,
                                                 max_tokens=max_tokens, repeats=repeats, draft_tokens=draft_tokens,
                                                 context=cfg.max_position_embeddings, draft=draft, progress=progress,
                                                 modes=modes, draft_ahead=draft_ahead))
            finally:
                _stop(procs)
    finally:
        if draft is not None:
            draft.close()
    drafting = (f"draft model {draft.name} at {draft.precision} on {draft_device} ({draft_threads or 'default'} "
                f"thread(s)), draft ahead {draft_ahead}"
                if draft else "no draft model")
    header = (f"speculative decoding: model {path.name}, {dtype}, {peers} peers on loopback, a netsim proxy in "
              f"front of each peer; {len(prompt_sets['general'])} general prompts and the code edit, {max_tokens} "
              f"new tokens each, --draft-tokens {draft_tokens}, {drafting}, {repeats} pass(es) after a warm-up; "
              f"CPU {_cpu_model()}, {os.cpu_count()} cores")
    return header, rows


def _cpu_model() -> str:
    """The CPU's model name (``lscpu``'s), or the platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def spec_table(rows: list[dict]) -> str:
    """The rows of :func:`run_spec_bench` as a markdown table: decode tokens/s over each prompt
    set, the ratio to plain decoding at the same RTT, draft acceptance, decode steps (verification
    steps in brackets), the median time to first token, and whether every prompt's tokens equal
    plain decoding's."""
    def row(r: dict) -> str:
        acc = f"{r['acceptance']:.2f}" if r["proposed"] else "-"
        return (f"| {r['rtt_ms']:g} | {r['prompts']} | {r['mode']} | {r['tokens_per_s']:.2f} | "
                f"{r['vs_plain']:.2f} | {acc} | {r['decode_steps']} ({r['verify_steps']}) | "
                f"{r['ttft_ms_median']:.0f} | {r['identical']} |")

    return _markdown("| RTT ms | prompts | mode | tok/s | vs plain | acceptance | steps (verify) | TTFT ms | identical |",
                     "|---:|---|---|---:|---:|---:|---:|---:|---|", rows, row)


# --------------------------------------------------------------------------- TTFT
def long_prompt(tok, n_tokens: int) -> list[int]:
    """A chat prompt of exactly ``n_tokens`` ids: the code-edit text repeated, cut to length."""
    text = CODE_EDIT_FUNCTION
    while len(tok.encode_chat([{"role": "user", "content": text}])) < n_tokens:
        text += "\n" + CODE_EDIT_FUNCTION
    return tok.encode_chat([{"role": "user", "content": text}])[:n_tokens]


async def _ttft_measure(url: str, n_peers: int, long_tokens: int, repeats: int) -> dict:
    from meshinfer.client.mesh import MeshClient

    async def ttft(client, route, ids) -> float:
        conv = client.conversation(route, max_tokens_total=len(ids) + 1, speculate=False)
        out = await conv.generate(ids, max_tokens=1, eos_ids=())
        await conv.close()
        return out.ttft_ms

    async with MeshClient([url]) as client:
        route = await _route(client, n_peers)
        tok = await client.tokenizer(route)
        short = tok.encode_chat(BENCH_MESSAGES)
        cold = await ttft(client, route, short)  # the first conversation after ready
        steady = [await ttft(client, route, short) for _ in range(repeats)]
        long_ids = long_prompt(tok, min(long_tokens, route.hops[0].peer.free_kv_tokens - 1))
        long = [await ttft(client, route, long_ids) for _ in range(repeats)]
        return {"route": route.describe(), "short_prompt_tokens": len(short), "cold_ttft_ms": cold,
                "steady_ttft_ms": statistics.median(steady), "long_prompt_tokens": len(long_ids),
                "long_ttft_ms": statistics.median(long)}


def run_ttft_bench(*, model: str, splits: list[int], long_tokens: int, repeats: int, dtype: str, base_port: int,
                   progress=None) -> tuple[str, list[dict]]:
    """Join-to-ready time, cold against steady TTFT, and long-prompt TTFT per setup (module docstring).

    Raises:
        RuntimeError: a peer failed to start.
    """
    from meshinfer.engine.weights import open_weights
    from meshinfer.engine.weights.registry import resolve_model

    path = resolve_model(model)
    cfg = open_weights(path).config
    long_tokens = min(long_tokens, cfg.max_position_embeddings - 2)
    rows = []
    for n in splits:
        ready: list[float] = []
        with tempfile.TemporaryDirectory() as tmp:
            procs = _start_peers(str(path), even_splits(cfg.num_hidden_layers, n), base_port, dtype, Path(tmp),
                                 ready_s=ready)
            try:
                r = asyncio.run(_ttft_measure(f"ws://127.0.0.1:{base_port}", n, long_tokens, repeats))
            finally:
                _stop(procs)
        r |= {"peers": n, "join_to_ready_s": max(ready)}
        rows.append(r)
        if progress:
            progress(f"{n} peer(s): ready in {r['join_to_ready_s']:.1f} s, cold TTFT {r['cold_ttft_ms']:.0f} ms, "
                     f"steady {r['steady_ttft_ms']:.0f} ms, {r['long_prompt_tokens']}-token TTFT "
                     f"{r['long_ttft_ms']:.0f} ms")
    header = (f"TTFT: model {path.name}, {dtype}, loopback, peers started together, median of {repeats} "
              f"steady runs; cold = the first conversation after every peer printed ready (peers warm up "
              f"before announcing)")
    return header, rows


def ttft_table(rows: list[dict]) -> str:
    """The rows of :func:`run_ttft_bench` as a markdown table, long-prompt TTFT relative to the first row."""
    base = rows[0]["long_ttft_ms"] or 1.0
    return _markdown("| peers | join to ready s | cold TTFT ms | steady TTFT ms | long prompt tokens | long TTFT ms | "
                     "vs first |", "|---:|---:|---:|---:|---:|---:|---:|", rows,
                     lambda r: f"| {r['peers']} | {r['join_to_ready_s']:.1f} | {r['cold_ttft_ms']:.0f} | "
                               f"{r['steady_ttft_ms']:.0f} | {r['long_prompt_tokens']} | {r['long_ttft_ms']:.0f} | "
                               f"{r['long_ttft_ms'] / base:.2f} |")
