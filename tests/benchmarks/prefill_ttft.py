"""Time a 1,000-token prefill at several precisions, alternated in one process:

    python tests/benchmarks/prefill_ttft.py [--model PATH] [--dtypes q8-bf16,gguf,gguf-a16,gguf-a8]
                                            [--threads 2] [--runs 3] [--tokens 1000]

Each precision's shard is loaded once; then each run prefills the same random token ids through
each shard in turn, in chunks of ``generate.PREFILL_CHUNK`` as a peer does, and the median and
lowest seconds are printed. ``bench --single`` measures each engine's 1,000-token TTFT once, in
its own process, minutes apart; on a machine whose speed moves by 20-30% between minutes, this
is the comparison to trust (issue 13: a gguf precision's prefill at least as fast as q8-bf16's).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from meshinfer.engine.generate import PREFILL_CHUNK, load_shard, new_cache
    from meshinfer.engine.weights.registry import DEFAULT_MODEL, resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a GGUF file or a known model name (default: %(default)s)")
    ap.add_argument("--dtypes", default="q8-bf16,gguf,gguf-a16,gguf-a8", help="precisions (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="prefills of each precision (default: %(default)s)")
    ap.add_argument("--tokens", type=int, default=1000, help="prompt tokens (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(resolve_model(args.model))
    shards = {d: load_shard(path, dtype=d) for d in args.dtypes.split(",")}
    ids = torch.randint(100, 20000, (1, args.tokens), generator=torch.Generator().manual_seed(0))

    def prefill(shard) -> float:
        cache = new_cache(shard)
        t0 = time.perf_counter()
        for s in range(0, args.tokens, PREFILL_CHUNK):
            shard(ids[:, s:s + PREFILL_CHUNK], s, cache)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {d: [] for d in shards}
    for _ in range(args.runs):
        for d, shard in shards.items():
            times[d].append(prefill(shard))
    for d, v in times.items():
        print(f"{d}: {args.tokens}-token prefill, {args.threads} thread(s): median {statistics.median(v):.2f} s "
              f"(lowest {min(v):.2f}, {len(v)} runs)")


if __name__ == "__main__":
    main()
