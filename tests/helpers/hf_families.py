"""Tiny random models of each family built with transformers' own classes, written as a
Hugging Face directory (``save_pretrained``) and as a GGUF the way llama.cpp's converter
writes them (tensor names, metadata, Llama's q/k permutation, merged expert tensors).

transformers is a test-only dependency (docs/dependencies.md), imported only by the functions
that build models (it is in the test extra, so a missing one fails the tests that need it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from helpers.tiny import MERGED, SPECIALS, _permute, add_model_metadata, add_tokenizer_metadata

VOCAB = 256 + len(MERGED) + len(SPECIALS)
FAMILIES = ("qwen3", "qwen3moe", "qwen2moe", "mixtral", "phi3", "gemma2", "gemma3")
#: Phi-3's LongRoPE switches to the long factors past this many tokens (the tests cross it).
PHI3_ORIGINAL_CONTEXT = 16
#: Shared tiny widths: 4 layers, C=32, H=4, Hkv=2; Qwen3 families set D=16 apart from C/H=8.
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512,
              rope_theta=10000.0)


def hf_model(family: str, seed: int = 0):
    """A float32 transformers ``*ForCausalLM`` of ``family`` with large random weights (norm
    weights near 1, so the q/k norms and routing matter), in eval mode with eager attention."""
    import transformers as tf

    if family == "qwen3":
        cfg = tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    elif family == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, head_dim=16, moe_intermediate_size=16, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                mlp_only_layers=[], tie_word_embeddings=False)
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2moe":  # q/k/v bias, 6 experts of width 16 (top 2, not renormalised), shared of 24
        cfg = tf.Qwen2MoeConfig(**COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True,
                                decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False)
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
        cls = tf.MixtralForCausalLM
    elif family == "phi3":  # LongRoPE, partial rotary (4 of 8 dims) and a 6-token sliding window
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3], "long_factor": [2.0, 5.0],
                "original_max_position_embeddings": PHI3_ORIGINAL_CONTEXT}
        cfg = tf.Phi3Config(**(COMMON | {"max_position_embeddings": 64}), original_max_position_embeddings=
                            PHI3_ORIGINAL_CONTEXT, rope_parameters=rope, sliding_window=6, pad_token_id=0,
                            bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
        cls = tf.Phi3ForCausalLM
    elif family == "gemma2":  # small caps so that tanh bites; a 4-token window on even layers
        cfg = tf.Gemma2Config(**COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pad_token_id=0,
                              bos_token_id=None, eos_token_id=None, tie_word_embeddings=True)
        cls = tf.Gemma2ForCausalLM
    elif family == "gemma3":  # 6 layers: 5 sliding (base 1e4), 1 full (base 1e3, linear x2)
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        cfg = tf.Gemma3TextConfig(**(COMMON | {"num_hidden_layers": 6}), head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=4, rope_parameters=rope, pad_token_id=0, bos_token_id=None,
                                  eos_token_id=None, tie_word_embeddings=True)
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                scale = 1.0 if "embed_tokens" in name else 0.2
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest reference magnitude."""
    return ((got - want).abs().max() / want.abs().max()).item()


def run_chain(shards, ids: list[int], follow: list[int]) -> torch.Tensor:
    """Prefill ``ids`` through a chain of meshinfer shards, then feed ``follow`` one token per
    step; float32 logits ``(len(ids) + len(follow), V)``."""
    from meshinfer.engine.generate import new_cache

    caches = [new_cache(s) for s in shards]

    def step(x: torch.Tensor, start: int) -> torch.Tensor:
        for s, cache in zip(shards, caches):
            x = s(x, start, cache, logits="all")
        return x[0]

    rows = [step(torch.tensor([ids]), 0)]
    rows += [step(torch.tensor([[t]]), len(ids) + j) for j, t in enumerate(follow)]
    return torch.cat(rows)


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits ``(T, V)`` for one sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def write_hf(model, path: Path) -> Path:
    """``save_pretrained`` (config.json + model.safetensors in the checkpoint's own names)."""
    model.save_pretrained(str(path))
    return path


def _gguf_arch(family: str) -> str:
    return "llama" if family == "mixtral" else family  # llama.cpp converts Mixtral as llama


_GEMMA2_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                 "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                 "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
          "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight"}


def _gguf_tensors(family: str, model) -> dict[str, np.ndarray]:
    """llama.cpp-named float32 arrays from the transformers model's own parameters.

    transformers 5 keeps experts merged (``mlp.experts.gate_up_proj`` ``(E, 2F, C)``,
    ``down_proj`` ``(E, C, F)``), which is GGUF's layout once gate and up are split.
    """
    cfg = model.config
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        arr = p.detach().float().numpy()
        if family in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp's Gemma converter stores 1 + w
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out["output.weight"] = arr
            continue
        top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
        if name in top:
            out[top[name]] = arr
            continue
        i, rest = name[len("model.layers."):].split(".", 1)
        if family == "mixtral" and rest.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
            arr = _permute(arr, heads)
        if rest == "mlp.experts.gate_up_proj":
            F = arr.shape[1] // 2
            out[f"blk.{i}.ffn_gate_exps.weight"], out[f"blk.{i}.ffn_up_exps.weight"] = arr[:, :F], arr[:, F:]
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{i}.ffn_down_exps.weight"] = arr
        elif rest == "mlp.shared_expert_gate.weight":
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = arr.reshape(-1)  # llama.cpp: (C,)
        else:
            gemma = family in ("gemma2", "gemma3")
            out[f"blk.{i}.{(_GEMMA2_NAMES if gemma else {}).get(rest) or _NAMES[rest]}"] = arr
    return out


def write_gguf(model, family: str, path: Path, *, legacy_experts: bool = False) -> Path:
    """An F32 GGUF of ``model`` with llama.cpp's names and metadata and the tiny tokenizer;
    ``legacy_experts``: one tensor per expert (``ffn_gate.{e}.weight``), as llama.cpp wrote
    Mixtral before it merged them."""
    import gguf

    cfg = model.config
    wr = gguf.GGUFWriter(str(path), _gguf_arch(family))
    add_model_metadata(wr, cfg)  # a transformers config has the same field names
    wr.add_rope_freq_base(1000.0 if family == "gemma3" else 10000.0)
    wr.add_vocab_size(cfg.vocab_size)
    if family == "gemma2":
        wr.add_sliding_window(cfg.sliding_window)
        wr.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        wr.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if family == "gemma3":
        import gguf as g

        wr.add_sliding_window(cfg.sliding_window)
        wr.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        wr.add_rope_scaling_type(g.RopeScalingType.LINEAR)
        wr.add_rope_scaling_factor(cfg.rope_parameters["full_attention"]["factor"])
    if family in ("qwen3", "qwen3moe", "gemma2", "gemma3"):
        wr.add_key_length(cfg.head_dim)
        wr.add_value_length(cfg.head_dim)
    if family in ("qwen3moe", "qwen2moe", "mixtral"):
        wr.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
        wr.add_expert_used_count(cfg.num_experts_per_tok)
    if family in ("qwen3moe", "qwen2moe"):
        wr.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2moe":
        wr.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if family == "phi3":
        _add_phi3_metadata(wr, cfg)
    add_tokenizer_metadata(wr)
    for name, arr in _gguf_tensors(family, model).items():
        if legacy_experts and name.endswith("_exps.weight"):
            for e in range(arr.shape[0]):
                wr.add_tensor(name.replace("_exps.weight", f".{e}.weight"),
                              np.ascontiguousarray(arr[e], dtype=np.float32))
            continue
        wr.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _add_phi3_metadata(wr, cfg) -> None:
    """What llama.cpp's ``Phi3MiniModel`` writes: rotary dims, sliding window, LongRoPE."""
    import math

    rope = cfg.rope_parameters
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    original = rope["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / original
    wr.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    wr.add_sliding_window(cfg.sliding_window or 0)
    wr.add_rope_scaling_orig_ctx_len(original)
    wr.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    wr.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
    wr.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
