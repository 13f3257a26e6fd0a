"""Decode-size matmul kernels on the default model's real shapes, and the f32 bandwidth bound.

For each projection shape of Qwen2.5-0.5B (q/o 896x896, k/v 128x896, gate/up 4864x896,
down 896x4864, output head 151936x896) it times ``x (1, K) @ W.T`` with every candidate kernel:
f32 and bf16 ``torch.matmul``, int8 ``torch._weight_int8pack_mm`` with f32 and bf16 activations
(the int4 kernel was dropped with the q4-gG-bf16 precisions on 2026-12-02).
Each figure is the best of ``--runs`` calls (the minimum is the least disturbed by other
processes on a shared machine). Then it measures read bandwidth (``torch.sum`` over 1 GiB,
best of 8) and prints the f32 decode bound: weight bytes read per token / bandwidth.

    python tests/benchmarks/quant_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {"q_proj/o_proj": (896, 896), "k_proj/v_proj": (128, 896), "gate/up": (4864, 896),
          "down": (896, 4864), "head": (151936, 896)}
#: Per layer: q, k, v, o, gate, up, down; times 24 layers; plus the head (tied embedding).
LAYER_MATS = [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896), (4864, 896), (896, 4864)]


def best_ms(fn, runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def kernels(N: int, K: int) -> dict:
    w, x = torch.randn(N, K), torch.randn(1, K)
    xb = x.bfloat16()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-8)
    w8 = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    out = {"f32": lambda: x @ w.T, "bf16": (lambda wb: lambda: xb @ wb.T)(w.bfloat16()),
           "int8 a32": lambda: torch._weight_int8pack_mm(x, w8, scale),
           "int8 abf16": (lambda sb: lambda: torch._weight_int8pack_mm(xb, w8, sb))(scale.bfloat16())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = {}
    for name, (N, K) in SHAPES.items():
        rows[name] = {k: best_ms(f, max(3, args.runs // 6) if N > 100_000 else args.runs)
                      for k, f in kernels(N, K).items()}
    cols = list(next(iter(rows.values())))
    print(f"best-of-runs ms per call, x (1, K), {args.threads} threads\n")
    print("| matrix (N x K) | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, r in rows.items():
        N, K = SHAPES[name]
        print(f"| {name} {N}x{K} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    per_token = {c: 24 * sum(rows[n][c] for n in ("q_proj/o_proj", "k_proj/v_proj", "gate/up", "down"))
                 + 24 * (rows["q_proj/o_proj"][c] + rows["k_proj/v_proj"][c] + rows["gate/up"][c])
                 + rows["head"][c] for c in cols}
    print("\nmatmul ms per decode token (24 layers + head), matmuls only:")
    print(" | ".join(f"{c}: {v:.1f}" for c, v in per_token.items()))
    x = torch.ones(256 * 1024 * 1024)  # 1 GiB of f32
    bw = x.numel() * 4 / (best_ms(x.sum, 8) / 1e3)
    f32_bytes = 4 * (24 * sum(n * k for n, k in LAYER_MATS) + 151936 * 896)
    print(f"\nread bandwidth {bw / 1e9:.1f} GB/s (torch.sum over 1 GiB, best of 8); f32 weights read per token "
          f"{f32_bytes / 1e9:.2f} GB; f32 decode bound {bw / f32_bytes:.1f} tok/s")


if __name__ == "__main__":
    main()
