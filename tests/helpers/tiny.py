"""Tiny random Llama-family models, written as GGUF (with the ``gguf`` writer) and as
Hugging Face safetensors directories, with a working byte-level tokenizer and ChatML template.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from meshinfer.core.config import ModelConfig

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGED = ["he"]  # one BPE merge ("h e"), so the merge table is not empty


def tiny_config(arch: str = "qwen2", *, layers: int = 4, context: int = 512) -> ModelConfig:
    """A 4-layer, 32-wide model whose vocabulary is 256 byte tokens, one merge and 3 specials."""
    return ModelConfig(architecture=arch, vocab_size=256 + len(MERGED) + len(SPECIALS), hidden_size=32,
                       intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                       max_position_embeddings=context, attention_bias=arch == "qwen2",
                       tie_word_embeddings=arch == "llama")


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors (``model.layers.0.self_attn.q_proj.weight`` ...)."""
    g = torch.Generator().manual_seed(seed)
    C, F, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def r(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": r(cfg.vocab_size, C, scale=1.0), "model.norm.weight": 1 + r(C, scale=0.1)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = r(cfg.vocab_size, C)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(C, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + r(C, scale=0.1),
              p + "self_attn.q_proj.weight": r(H * D, C), p + "self_attn.k_proj.weight": r(Hkv * D, C),
              p + "self_attn.v_proj.weight": r(Hkv * D, C), p + "self_attn.o_proj.weight": r(C, H * D),
              p + "mlp.gate_proj.weight": r(F, C), p + "mlp.up_proj.weight": r(F, C),
              p + "mlp.down_proj.weight": r(C, F)}
        if cfg.attention_bias:
            w |= {p + "self_attn.q_proj.bias": r(H * D), p + "self_attn.k_proj.bias": r(Hkv * D),
                  p + "self_attn.v_proj.bias": r(Hkv * D)}
    return w


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order (Radford et al. 2019, encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    mapping, n = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + n)
            n += 1
    return [mapping[b] for b in range(256)]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter Q/K permutation (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        i, rest = hf[len("model.layers."):].split(".", 1)
        return f"blk.{i}.{_GGUF_BLOCK[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def add_model_metadata(wr, cfg: ModelConfig) -> None:
    """The ``{arch}.*`` hyper-parameters of ``cfg`` on a ``gguf.GGUFWriter``."""
    wr.add_block_count(cfg.num_hidden_layers)
    wr.add_context_length(cfg.max_position_embeddings)
    wr.add_embedding_length(cfg.hidden_size)
    wr.add_feed_forward_length(cfg.intermediate_size)
    wr.add_head_count(cfg.num_attention_heads)
    wr.add_head_count_kv(cfg.num_key_value_heads)
    wr.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def write_gguf(path: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor], *,
               merged: tuple[str, str] = ("h", "e"), quantize=None) -> Path:
    """Write ``weights`` as an F32 GGUF with tokenizer metadata, the way llama.cpp would.

    ``merged``: the one BPE merge, whose token takes id 256 (another one gives a vocabulary of the
    same size that maps id 256 to another piece). ``quantize``: None, or a function of the HF
    tensor name giving a ``gguf.GGMLQuantizationType`` (or None) to store that 2-D tensor in,
    quantized by ``gguf.quants.quantize``."""
    import gguf

    wr = gguf.GGUFWriter(str(path), cfg.architecture)
    add_model_metadata(wr, cfg)
    wr.add_rope_freq_base(cfg.rope_theta)
    add_tokenizer_metadata(wr, merged)
    for name, t in weights.items():
        arr = t.numpy().astype(np.float32)
        if cfg.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = _permute(arr, cfg.num_attention_heads)
        elif cfg.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = _permute(arr, cfg.num_key_value_heads)
        qtype = quantize(name) if quantize is not None and arr.ndim == 2 else None
        if qtype is None:
            wr.add_tensor(gguf_name(name), arr)
        else:
            wr.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def add_tokenizer_metadata(wr, merged: tuple[str, str] = ("h", "e")) -> None:
    """The synthetic byte-level BPE tokenizer and ChatML template on a ``gguf.GGUFWriter``
    (``merged``: its one BPE merge, see :func:`write_gguf`)."""
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("qwen2")
    wr.add_token_list(byte_tokens() + ["".join(merged)] + SPECIALS)
    wr.add_token_types([1] * (256 + len(MERGED)) + [3] * len(SPECIALS))
    wr.add_token_merges([" ".join(merged)])
    wr.add_bos_token_id(256 + len(MERGED) + 1)  # <|im_start|>
    wr.add_eos_token_id(256 + len(MERGED) + 2)  # <|im_end|>
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHATML)


def write_hf_dir(path: Path, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, shards: int = 1) -> Path:
    """Write ``config.json`` + safetensors (one file, or ``shards`` files with an index)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": cfg.architecture, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings}))
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in part}, str(path / fname))
        weight_map |= {n: fname for n in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def write_quantized_tiny(path: Path, arch: str = "qwen2", **types) -> Path:
    """A tiny model (:func:`tiny_config`) whose projections are Q8_0, Q5_0, Q4_0 and Q4_1 (the
    types gguf-py can write), written to ``path`` the way llama.cpp would (for llama: Q/K rows
    permuted). ``types`` overrides a projection's type (``down_proj=G.Q5_1``), or leaves it
    float32 (``k_proj=None``)."""
    from gguf import GGMLQuantizationType as G

    cfg = tiny_config(arch)
    kinds = {"q_proj": G.Q8_0, "k_proj": G.Q5_0, "v_proj": G.Q4_0, "o_proj": G.Q4_1, "gate_proj": G.Q5_0,
             "up_proj": G.Q8_0, "down_proj": G.Q4_1, "embed_tokens": G.Q8_0, "lm_head": G.Q8_0} | types

    def quantize(name: str):
        return next((q for part, q in kinds.items() if f"{part}.weight" in name), None)
    return write_gguf(path, cfg, random_weights(cfg, seed=7), quantize=quantize)
