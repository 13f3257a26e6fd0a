"""GGUF reader: metadata, memory-mapped tensors, per-tensor dequantization.

Parsing and dequantization are done by the ``gguf`` package (the reference
implementation maintained with llama.cpp). This module adds what a peer on the
Internet needs on top: strict validation (magic, truncation, tensor byte sizes,
overlaps, supported types) with errors that name the field or tensor, and loading
only the tensors of one layer range.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from ..config import LayerRange, ModelConfig
from ..errors import UnsupportedTensorType, WeightsError

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"

#: Tensor types meshinfer dequantizes (through ``gguf.quants.dequantize``).
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K",
})

# GGUF tensor name (without the "blk.N." prefix) -> module name inside a block.
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def _reverse_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the Q/K row permutation llama.cpp's converter applies to ``llama`` models.

    ``convert_hf_to_gguf.py`` (LlamaModel.permute) reorders rows so that GGML's
    interleaved RoPE matches Hugging Face's rotate-half RoPE; undoing it lets one
    RoPE implementation serve both formats. ``w``: ``(n_head * D, C)`` or ``(n_head * D,)``.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFFile:
    """A validated, memory-mapped GGUF file.

    Args:
        path: the ``.gguf`` file.

    Raises:
        WeightsError: wrong magic, a header that cannot be parsed (corrupt or truncated),
            a tensor that extends past the end of the file or overlaps the next one, a byte
            size that does not match the tensor's type and shape, or missing metadata.
        UnsupportedTensorType: a tensor type outside :data:`SUPPORTED_TYPES`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        import gguf  # deferred: importing gguf costs ~0.2 s

        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise WeightsError(f"{self.path}: cannot read: {exc}") from exc
        if magic != GGUF_MAGIC:
            raise WeightsError(f"{self.path}: wrong magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
        self.file_size = size
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except (ValueError, IndexError, KeyError, OverflowError, TypeError, MemoryError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{self.path}: corrupt or truncated GGUF header ({size} bytes): {exc}") from exc
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._validate_tensors()
        self.config = self._read_config()

    # ------------------------------------------------------------------ metadata
    def field(self, key: str, default: object = ...) -> object:
        """The value of metadata field ``key`` (scalars, strings, lists).

        Raises:
            WeightsError: when the field is missing and no default is given, or unreadable.
        """
        fld = self._reader.fields.get(key)
        if fld is None:
            if default is ...:
                raise WeightsError(f"{self.path}: metadata field {key!r} is missing")
            return default
        try:
            return fld.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{self.path}: metadata field {key!r} is unreadable: {exc}") from exc

    def _read_config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if not isinstance(arch, str):
            raise WeightsError(f"{self.path}: metadata field 'general.architecture' is not a string")

        def num(key: str, default: object = ...) -> object:
            value = self.field(f"{arch}.{key}", default)
            if isinstance(value, (list, str)):
                raise WeightsError(f"{self.path}: metadata field '{arch}.{key}' must be a number, got {value!r}")
            return value

        embd = self._tensors.get("token_embd.weight")
        if embd is None:
            raise WeightsError(f"{self.path}: tensor 'token_embd.weight' is missing")
        vocab = int(num("vocab_size", int(embd.shape[1]) if len(embd.shape) > 1 else 0))
        heads = int(num("attention.head_count"))
        cfg = ModelConfig(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=int(num("embedding_length")),
            intermediate_size=int(num("feed_forward_length")),
            num_hidden_layers=int(num("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(num("attention.head_count_kv", heads)),
            rms_norm_eps=float(num("attention.layer_norm_rms_epsilon")),
            rope_theta=float(num("rope.freq_base", 10000.0)),
            max_position_embeddings=int(num("context_length")),
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            tie_word_embeddings="output.weight" not in self._tensors,
        )
        try:
            return cfg.validate()
        except ValueError as exc:
            raise WeightsError(f"{self.path}: {exc}") from exc

    # ------------------------------------------------------------------ validation
    def _validate_tensors(self) -> None:
        from gguf import GGML_QUANT_SIZES

        spans = []
        for t in self._reader.tensors:
            qtype = t.tensor_type
            if qtype.name not in SUPPORTED_TYPES:
                raise UnsupportedTensorType(
                    f"{self.path}: tensor {t.name!r} has type {qtype.name}, which meshinfer cannot "
                    f"dequantize; supported: {', '.join(sorted(SUPPORTED_TYPES))}")
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = [int(d) for d in t.shape]
            if any(d <= 0 for d in shape) or shape[0] % block:
                raise WeightsError(f"{self.path}: tensor {t.name!r} has shape {shape}, which does not fit "
                                   f"type {qtype.name} (rows must be a multiple of {block} values)")
            expected = int(np.prod(shape)) // block * type_size
            start = int(t.data_offset)
            if int(t.n_bytes) != expected or t.data.nbytes != expected:
                raise WeightsError(f"{self.path}: tensor {t.name!r} of type {qtype.name} and shape {shape} "
                                   f"needs {expected} bytes, found {t.data.nbytes}")
            if start + expected > self.file_size:
                raise WeightsError(f"{self.path}: tensor {t.name!r} ends at byte {start + expected}, past the "
                                   f"end of the file ({self.file_size} bytes): the file is truncated")
            spans.append((start, start + expected, t.name))
        spans.sort()
        for (_, end, name), (nstart, _, nname) in zip(spans, spans[1:]):
            if end > nstart:
                raise WeightsError(f"{self.path}: tensor {name!r} (ends at byte {end}) overlaps tensor "
                                   f"{nname!r} (starts at byte {nstart}): its byte size does not match")

    # ------------------------------------------------------------------ tensors
    def tensor_names(self) -> list[str]:
        """All tensor names in file order."""
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor ``name`` (read from the file, per tensor)."""
        return self._tensors[name].tensor_type.name

    def dequantize(self, name: str) -> np.ndarray:
        """Dequantize tensor ``name`` to float32, shaped like a torch weight ``(out, in)``.

        Raises:
            WeightsError: when the tensor is missing.
        """
        from gguf import quants

        t = self._tensors.get(name)
        if t is None:
            raise WeightsError(f"{self.path}: tensor {name!r} is missing")
        arr = quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists ne0 (innermost) first
        arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            arr = arr.copy()
        return arr

    def iter_shard_tensors(self, layers: LayerRange) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(module_name, float32 tensor)`` for the tensors a shard over ``layers`` needs.

        Only blocks ``[layers.start, layers.stop)`` are read; the token embedding only when
        ``layers.start == 0``; the final norm and output projection only when ``layers.stop == L``
        (falling back to the tied token embedding when the file has no ``output.weight``).
        Module names follow Hugging Face's (``layers.3.self_attn.q_proj.weight``).
        """
        cfg = self.config
        layers.check_within(cfg.num_hidden_layers)
        wanted: list[tuple[str, str]] = []
        if layers.start == 0:
            wanted.append(("token_embd.weight", "embed_tokens.weight"))
        for i in range(layers.start, layers.stop):
            for suffix, module in _BLOCK_NAMES.items():
                gname = f"blk.{i}.{suffix}"
                if gname in self._tensors or not suffix.endswith(".bias"):
                    wanted.append((gname, f"layers.{i}.{module}"))
        if layers.stop == cfg.num_hidden_layers:
            wanted.append(("output_norm.weight", "norm.weight"))
            head = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
            wanted.append((head, "lm_head.weight"))
        for gname, module in wanted:
            arr = self.dequantize(gname)
            if cfg.architecture == "llama":
                if ".attn_q." in gname:
                    arr = _reverse_llama_permute(arr, cfg.num_attention_heads)
                elif ".attn_k." in gname:
                    arr = _reverse_llama_permute(arr, cfg.num_key_value_heads)
            yield module, torch.from_numpy(arr)
