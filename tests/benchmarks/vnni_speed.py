"""Whole decode steps with the VNNI path against the same CPU's AVX2 path, taking turns.

On a CPU with AVX512-VNNI or AVX-VNNI, builds the gguf kernels twice on this machine: with
``-march=native`` (the VNNI instructions, as a peer builds them) and with ``-march=native
-mno-avx512vnni -mno-avxvnni`` (the AVX2 path's ``maddubs`` + ``madd``). Then times whole decode
steps of a whole-model shard, the two libraries taking turns round by round, checks that both
give the same logits bit for bit, and prints each library's median step and the per-round ratios.

    python tests/benchmarks/vnni_speed.py MODEL [--dtype gguf-a8] [--threads 2] [--rounds 8]

MODEL: a GGUF path or known name (``meshinfer pull``). Exits 2, saying why, on a CPU without
VNNI (the two builds would be the same) or without a C compiler.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshinfer.engine.generate import load_shard, new_cache
from meshinfer.engine.kernels import native
from meshinfer.engine.weights.registry import resolve_model

#: Decode steps per round and library (each round starts from the same 40-token prefill).
STEPS = 32
PROMPT_TOKENS = 40


def two_libraries(directory: Path) -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(the VNNI build, the AVX2 build) of the kernels, compiled here with :data:`native.CFLAGS`.

    Raises:
        OSError: no C compiler (``$CC``, else ``cc``), or ``directory`` cannot be written.
        subprocess.CalledProcessError: the compiler refused the flags.
    """
    cc = native._compiler()
    if cc is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'} not found)")
    libs = []
    for name, extra in (("vnni", []), ("avx2", ["-mno-avx512vnni", "-mno-avxvnni"])):
        out = directory / f"{name}.so"
        native.build(cc, out, [*native.CFLAGS, *extra])
        libs.append(native.bind(ctypes.CDLL(str(out))))
    return libs[0], libs[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="gguf-a8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            vnni, avx2 = two_libraries(Path(tmp))
        except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:  # no compiler, or it refused the flags
            print(f"cannot build the two libraries: {exc}", file=sys.stderr)
            return 2
        if not vnni.mi_vnni() or avx2.mi_vnni():
            print(f"this CPU's native build has mi_vnni()={vnni.mi_vnni()}: no VNNI path to compare", file=sys.stderr)
            return 2
        current = {"lib": vnni}
        native.library = lambda: current["lib"]  # every kernel call asks native.library() for the library
        shard = load_shard(resolve_model(args.model, pull_missing=False, progress=False), dtype=args.dtype)
        ids = torch.randint(0, shard.cfg.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
        steps: dict[str, list[float]] = {"vnni": [], "avx2": []}
        last: dict[str, list[torch.Tensor]] = {"vnni": [], "avx2": []}
        with torch.inference_mode():
            cache = new_cache(shard)
            shard(ids, 0, cache)
            for r in range(args.rounds):
                for name in (("vnni", "avx2") if r % 2 == 0 else ("avx2", "vnni")):
                    current["lib"] = vnni if name == "vnni" else avx2
                    token, times = torch.tensor([[17]]), []
                    for s in range(STEPS):
                        t0 = time.perf_counter()
                        logits = shard(token, PROMPT_TOKENS + s, cache)  # (1, 1, V)
                        times.append(time.perf_counter() - t0)
                        token = logits[0, -1].argmax().view(1, 1)
                    cache.truncate(PROMPT_TOKENS)
                    steps[name].append(statistics.median(times))
                    last[name].append(logits.clone())
    same = all(torch.equal(a, b) for a, b in zip(last["vnni"], last["avx2"]))
    ratios = [b / a for a, b in zip(steps["vnni"], steps["avx2"])]  # > 1: the VNNI build is faster
    print(f"{Path(args.model).name}, {args.dtype}, {args.threads} threads, {args.rounds} rounds x {STEPS} steps")
    for name, values in steps.items():
        print(f"{name}: median step {statistics.median(values) * 1e3:.2f} ms")
    print(f"speed-up of VNNI (avx2 step / vnni step): median {statistics.median(ratios):.3f}, rounds "
          + " ".join(f"{x:.2f}" for x in ratios))
    print("same logits bit for bit:", same)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
