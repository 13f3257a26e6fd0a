"""Hugging Face model directories: ``config.json`` plus ``model.safetensors`` or a sharded index.

Tensors are read with the ``safetensors`` package, which memory-maps each file and
reads only the tensors asked for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator

import torch

from meshinfer.core.config import LayerRange, ModelConfig
from meshinfer.core.errors import WeightsError

#: config.json ``model_type`` -> ``ModelConfig.architecture``.
_ARCH_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama", "qwen3": "qwen3",
                       "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "mixtral", "phi3": "phi3",
                       "gemma2": "gemma2", "gemma3_text": "gemma3"}

# Mixtral checkpoint names -> the module names of ``meshinfer.engine.models.moe`` (Qwen3-MoE's).
_MIXTRAL_RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                    (".w2.", ".down_proj."))


def _module_name(arch: str, name: str) -> str:
    """A checkpoint tensor name inside a layer (``block_sparse_moe.experts.0.w1.weight``) -> the
    shard's module name (``mlp.experts.0.gate_proj.weight``)."""
    if arch == "mixtral":
        for old, new in _MIXTRAL_RENAMES:
            name = name.replace(old, new)
    return name


def _moe_fields(raw: dict, arch: str, path: Path) -> dict:
    """ModelConfig's MoE fields from a config.json; {} for a dense model.

    Raises:
        WeightsError: a Qwen3-MoE config with dense layers among the sparse ones
            (``mlp_only_layers``, ``decoder_sparse_step``), which meshinfer does not run.
    """
    if arch not in ("qwen3moe", "qwen2moe", "mixtral"):
        return {}
    if raw.get("mlp_only_layers") or int(raw.get("decoder_sparse_step") or 1) != 1:
        raise WeightsError(f"{path}/config.json: dense layers among the sparse ones (mlp_only_layers "
                           f"{raw.get('mlp_only_layers')}, decoder_sparse_step {raw.get('decoder_sparse_step')}) "
                           "are not supported; every layer must be sparse (decoder_sparse_step 1)")
    return {"num_experts": int(raw.get("num_experts") or raw.get("num_local_experts") or 0),
            "num_experts_per_tok": int(raw.get("num_experts_per_tok") or 0),
            "moe_intermediate_size": int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
            # HF's Qwen3MoeConfig and Qwen2MoeConfig default norm_topk_prob to False; Mixtral always renormalises
            "norm_topk_prob": arch == "mixtral" or bool(raw.get("norm_topk_prob", False)),
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0)}


def _phi3_fields(raw: dict, path: Path) -> dict:
    """Phi-3's partial rotary, sliding window and LongRoPE from a config.json (transformers 4:
    ``rope_scaling`` and top-level fields; transformers 5: ``rope_parameters``).

    Raises:
        WeightsError: a RoPE scaling type other than LongRoPE (``longrope``, ``su``).
    """
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    fields = {"partial_rotary_factor": float(rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor")
                                             or 1.0),
              "sliding_window": int(raw.get("sliding_window") or 0)}
    if kind == "default":
        return fields
    if kind not in ("longrope", "su"):
        raise WeightsError(f"{path}/config.json: RoPE scaling {kind!r} is not supported for phi3; "
                           "supported: longrope (su), or none")
    return fields | {"rope_long_factor": tuple(float(f) for f in rope["long_factor"]),
                     "rope_short_factor": tuple(float(f) for f in rope["short_factor"]),
                     "original_max_position_embeddings": int(rope.get("original_max_position_embeddings")
                                                             or raw["original_max_position_embeddings"]),
                     "rope_attention_factor": float(rope.get("attention_factor") or 0.0)}


def _gemma2_fields(raw: dict) -> dict:
    """Gemma 2's window, soft-caps, score scale and layer types from a config.json (layer types
    alternate, sliding first, when the file predates the field)."""
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {"sliding_window": int(raw.get("sliding_window") or 0),
            "attn_logit_softcapping": float(raw.get("attn_logit_softcapping") or 0.0),
            "final_logit_softcapping": float(raw.get("final_logit_softcapping") or 0.0),
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar") or 0.0),
            "layer_types": tuple(types)}


def _gemma3_fields(raw: dict, path: Path) -> dict:
    """Gemma 3's layer kinds (``layer_types``, else one full layer in ``sliding_window_pattern``,
    6) and RoPE: ``rope_parameters`` per layer kind (transformers 5), or ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` (transformers 4; defaults 1e6 and 1e4).

    Raises:
        WeightsError: a RoPE scaling of the full layers other than linear.
    """
    layers, every = int(raw["num_hidden_layers"]), int(raw.get("sliding_window_pattern") or 6)
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention"
                                       for i in range(layers)]
    params = raw.get("rope_parameters") or {}
    full = params.get("full_attention") or raw.get("rope_scaling") or {}
    local = params.get("sliding_attention") or {"rope_theta": raw.get("rope_local_base_freq", 1e4)}
    kind = full.get("rope_type") or full.get("type") or "default"
    if kind not in ("default", "linear"):
        raise WeightsError(f"{path}/config.json: RoPE scaling {kind!r} is not supported for gemma3; "
                           "supported: linear, or none")
    return _gemma2_fields(raw) | {"layer_types": tuple(types), "rope_local_theta": float(local["rope_theta"]),
                                  "rope_linear_factor": float(full.get("factor") or 1.0) if kind == "linear" else 1.0}


def _rope_theta(raw: dict) -> float:
    """``rope_theta``, top-level (transformers 4) or under ``rope_parameters`` (transformers 5;
    Gemma 3: its ``full_attention`` entry)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    params = params.get("full_attention", params)  # one dict per layer kind (Gemma 3): the full layers'
    return float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)


class SafetensorsDir:
    """A Hugging Face model directory.

    Args:
        path: directory holding ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` with its shards.

    Raises:
        WeightsError: missing or malformed ``config.json`` / index, a shard file that is
            missing or not valid safetensors, or an unsupported ``model_type``.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.config = self._read_config()
        self._where = self._read_index()

    def _read_json(self, name: str) -> dict:
        file = self.path / name
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise WeightsError(f"{self.path}: {name} is missing") from exc
        except (OSError, ValueError) as exc:
            raise WeightsError(f"{file}: not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise WeightsError(f"{file}: expected a JSON object")
        return data

    def _read_config(self) -> ModelConfig:
        raw = self._read_json("config.json")
        model_type = raw.get("model_type")
        arch = _ARCH_BY_MODEL_TYPE.get(model_type)
        if arch is None:
            raise WeightsError(f"{self.path}/config.json: model_type {model_type!r} is not supported; "
                               f"supported: {', '.join(sorted(_ARCH_BY_MODEL_TYPE))}")
        try:
            heads = int(raw["num_attention_heads"])
            cfg = ModelConfig(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                attention_bias=bool(raw.get("qkv_bias", True) if arch == "qwen2moe"
                                    else raw.get("attention_bias", arch == "qwen2")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                head_dim=int(raw.get("head_dim") or 0),
                **_moe_fields(raw, arch, self.path),
                **(_phi3_fields(raw, self.path) if arch == "phi3" else {}),
                **(_gemma2_fields(raw) if arch == "gemma2" else {}),
                **(_gemma3_fields(raw, self.path) if arch == "gemma3" else {}),
            )
            return cfg.validate()
        except KeyError as exc:
            raise WeightsError(f"{self.path}/config.json: field {exc.args[0]!r} is missing") from exc
        except (TypeError, ValueError) as exc:
            raise WeightsError(f"{self.path}/config.json: {exc}") from exc

    def _read_index(self) -> dict[str, Path]:
        """Map every tensor name to the file holding it."""
        from safetensors import safe_open

        if (self.path / "model.safetensors.index.json").exists():
            weight_map = self._read_json("model.safetensors.index.json").get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightsError(f"{self.path}/model.safetensors.index.json: 'weight_map' is missing")
            files = {name: self.path / str(f) for name, f in weight_map.items()}
        else:
            single = self.path / "model.safetensors"
            try:
                with safe_open(single, framework="pt") as f:
                    files = {name: single for name in f.keys()}
            except FileNotFoundError as exc:
                raise WeightsError(f"{self.path}: neither model.safetensors nor "
                                   f"model.safetensors.index.json exists") from exc
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise WeightsError(f"{single}: not a valid safetensors file: {exc}") from exc
        for file in set(files.values()):
            if file.resolve().parent != self.path.resolve() or not file.is_file():
                raise WeightsError(f"{self.path}: shard file {file.name!r} named by the index is missing")
        return files

    def _load(self, hf_name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._where.get(hf_name)
        if file is None:
            raise WeightsError(f"{self.path}: tensor {hf_name!r} is missing")
        try:
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(hf_name).to(torch.float32)
        except Exception as exc:
            raise WeightsError(f"{file}: cannot read tensor {hf_name!r}: {exc}") from exc

    def iter_shard_tensors(self, layers: LayerRange) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(module_name, float32 tensor)`` for a shard over ``layers``; see ``GGUFFile``.

        Gemma's norm weights ``w`` come out as ``1 + w``, the scale ``GemmaRMSNorm`` holds.
        """
        for name, tensor in self._iter_tensors(layers):
            if self.config.architecture in ("gemma2", "gemma3") and name.endswith("norm.weight"):
                tensor = tensor + 1.0
            yield name, tensor

    def _iter_tensors(self, layers: LayerRange) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        layers.check_within(cfg.num_hidden_layers)
        if layers.start == 0:
            yield "embed_tokens.weight", self._load("model.embed_tokens.weight")
        for i in range(layers.start, layers.stop):
            prefix = f"model.layers.{i}."
            for name in sorted(n for n in self._where if n.startswith(prefix)):
                if "rotary_emb" in name:
                    continue
                yield f"layers.{i}.{_module_name(cfg.architecture, name[len(prefix):])}", self._load(name)
        if layers.stop == cfg.num_hidden_layers:
            yield "norm.weight", self._load("model.norm.weight")
            head = "lm_head.weight" if "lm_head.weight" in self._where else "model.embed_tokens.weight"
            yield "lm_head.weight", self._load(head)
