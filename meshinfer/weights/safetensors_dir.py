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

from ..config import LayerRange, ModelConfig
from ..errors import WeightsError

_ARCH_BY_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "mistral": "llama"}


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
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
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
        """Yield ``(module_name, float32 tensor)`` for a shard over ``layers``; see ``GGUFFile``."""
        cfg = self.config
        layers.check_within(cfg.num_hidden_layers)
        if layers.start == 0:
            yield "embed_tokens.weight", self._load("model.embed_tokens.weight")
        for i in range(layers.start, layers.stop):
            prefix = f"model.layers.{i}."
            for name in sorted(n for n in self._where if n.startswith(prefix)):
                if "rotary_emb" in name:
                    continue
                yield f"layers.{i}.{name[len(prefix):]}", self._load(name)
        if layers.stop == cfg.num_hidden_layers:
            yield "norm.weight", self._load("model.norm.weight")
            head = "lm_head.weight" if "lm_head.weight" in self._where else "model.embed_tokens.weight"
            yield "lm_head.weight", self._load(head)
