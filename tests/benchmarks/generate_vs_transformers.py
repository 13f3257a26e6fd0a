"""Single-process decode speed: `meshinfer generate` against Hugging Face transformers.

Both run the same GGUF file (transformers dequantizes it on load), the same chat prompt,
greedy decoding, the same thread count, f32 and bf16, each in a fresh process after one
warm-up generation, alternating A B A B. Prints a markdown table of medians.

    pip install transformers accelerate     # benchmark-only dependencies
    python tests/benchmarks/generate_vs_transformers.py [--threads 2] [--tokens 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROMPT = "Write a Python function that checks whether a number is prime."

HF_SCRIPT = r'''
import json, resource, sys, time, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
path, dtype, threads, tokens, prompt = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(threads)
torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch_dtype).eval()
ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
with torch.inference_mode():
    model.generate(ids[:, :16], max_new_tokens=2, do_sample=False)      # warm-up
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, do_sample=False)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    total = time.perf_counter() - t0
n = out.shape[1] - ids.shape[1]
print(json.dumps({"ttft_ms": ttft * 1e3, "decode_tokens_per_s": (n - 1) / max(total - ttft, 1e-9),
                  "prompt_tokens": ids.shape[1], "token_ids": out[0, ids.shape[1]:].tolist(),
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
'''

MESH_SCRIPT = r'''
import json, resource, sys
from meshinfer.app.cli import main
import io, contextlib
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    main(sys.argv[1:])
d = json.loads(buf.getvalue().strip().splitlines()[-1])
d["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(d))
'''


def run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct-q4_k_m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtypes", default="f32,bf16")
    args = ap.parse_args()
    from meshinfer.engine.weights.registry import resolve_model

    path = str(resolve_model(args.model))
    rows = []
    for dtype in args.dtypes.split(","):
        results: dict[str, list[dict]] = {"meshinfer": [], "transformers": []}
        for _ in range(args.runs):
            results["meshinfer"].append(run([sys.executable, "-c", MESH_SCRIPT, "generate", "--model", path, "-p",
                                             PROMPT, "--max-tokens", str(args.tokens), "--dtype", dtype,
                                             "--threads", str(args.threads), "--json"]))
            results["transformers"].append(run([sys.executable, "-c", HF_SCRIPT, path, dtype, str(args.threads),
                                                str(args.tokens), PROMPT]))
        for engine, rs in results.items():
            rows.append((engine, dtype, statistics.median(r["decode_tokens_per_s"] for r in rs),
                         statistics.median(r["ttft_ms"] for r in rs), max(r["peak_rss_mib"] for r in rs),
                         rs[0]["token_ids"][:8]))
            print(rows[-1], file=sys.stderr)
    print(f"| engine | dtype | decode tok/s | TTFT ms ({PROMPT[:20]}..., chat template) | peak RSS MiB |")
    print("|---|---|---:|---:|---:|")
    for engine, dtype, tps, ttft, rss, _ in rows:
        print(f"| {engine} | {dtype} | {tps:.2f} | {ttft:.0f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
