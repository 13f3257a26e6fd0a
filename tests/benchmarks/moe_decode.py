"""Decode speed of a sparse MoE against dense models of the same active and resident size.

Random-weight models built in memory (no files): a Qwen3-MoE with E experts of width Fm,
top-k routing, and Qwen3 dense models with F = k * Fm (same parameters per token) and
F = E * Fm (same resident parameters); plus a Llama model of the same widths, the row to
compare before and after a change to the shared decoder (run this file with PYTHONPATH
pointing at the other checkout, ``--families llama``). Greedy decode in one process; the best
decode tok/s of ``--runs`` runs after a warm-up (on a shared machine the best run is the one
least disturbed by other work; medians moved by 30% between identical runs).

    python tests/benchmarks/moe_decode.py [--families moe,dense-active,dense-resident,llama]
        [--tokens 64] [--runs 3] [--threads 2] [--dtype f32]
"""

from __future__ import annotations

import argparse
import torch

from meshinfer.core.config import LayerRange, ModelConfig
from meshinfer.engine.generate import greedy_generate
from meshinfer.engine.models.llama import Shard

#: The widths every model shares: C=512, 8 layers, H=8, Hkv=4, D=64; MoE: E=8, k=2, Fm=256.
WIDTHS = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=1024,
              attention_bias=False, tie_word_embeddings=False)
E, K, FM = 8, 2, 256


def config(family: str) -> ModelConfig:
    if family == "llama":
        return ModelConfig(architecture="llama", intermediate_size=K * FM, **WIDTHS)
    if family == "moe":
        return ModelConfig(architecture="qwen3moe", intermediate_size=K * FM, num_experts=E,
                           num_experts_per_tok=K, moe_intermediate_size=FM, **WIDTHS)
    width = {"dense-active": K * FM, "dense-resident": E * FM}[family]
    return ModelConfig(architecture="qwen3", intermediate_size=width, **WIDTHS)


def random_shard(cfg: ModelConfig, dtype: str) -> Shard:
    """Every layer of ``cfg`` with random weights (norm weights near 1)."""
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Shard(cfg, LayerRange(0, cfg.num_hidden_layers)).named_parameters()}
    g = torch.Generator().manual_seed(0)
    tensors = ((n, (1 + 0.1 * torch.randn(s, generator=g)) if "norm" in n else 0.05 * torch.randn(s, generator=g))
               for n, s in shapes.items())
    return Shard.from_tensors(cfg, LayerRange(0, cfg.num_hidden_layers), tensors,
                              dtype={"f32": torch.float32, "bf16": torch.bfloat16}[dtype])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="moe,dense-active,dense-resident,llama")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompt = list(range(10, 51))  # 41 tokens, as the other benchmarks
    print("| model | resident params | active params / token | decode tok/s (best of runs) |")
    print("|---|---:|---:|---:|")
    for family in args.families.split(","):
        shard = random_shard(config(family), args.dtype)
        resident = sum(p.numel() for p in shard.parameters())
        per_expert = 3 * WIDTHS["hidden_size"] * FM  # parameter_counts is newer than the llama row's checkout
        active = resident - shard.cfg.num_hidden_layers * (E - K) * per_expert * (family == "moe")
        greedy_generate(shard, prompt, max_tokens=8)  # warm-up
        rates = [greedy_generate(shard, prompt, max_tokens=args.tokens).decode_tokens_per_s
                 for _ in range(args.runs)]
        print(f"| {family} | {resident / 1e6:.1f} M | {active / 1e6:.1f} M | {max(rates):.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
