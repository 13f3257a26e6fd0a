"""GGUF reader: metadata, memory-mapped tensors, per-tensor dequantization.

The file layout (ggml ``docs/gguf.md``: header, key/value metadata, tensor infos, aligned data)
is parsed here, because ``gguf.GGUFReader`` builds a numpy view for every element of every
metadata array and takes ~13 s to open a model with a 152k-token vocabulary. Dequantization
uses ``gguf.quants`` and gguf's type constants (the reference code maintained with llama.cpp).

What a peer on the Internet needs on top: every read is bounds-checked against the file size
(a corrupt length or count raises :class:`WeightsError` naming the field and never allocates
more than the file holds), tensors are validated (type, shape, byte size, truncation, overlap),
and only the tensors of one layer range are dequantized.
"""

from __future__ import annotations

import logging
import os
import struct
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants

from meshinfer.core.config import LayerRange, ModelConfig
from meshinfer.core.errors import UnsupportedTensorType, WeightsError
from meshinfer.core.gguf_header import MIN_TENSOR_INFO_BYTES, Cursor, map_gguf, read_header

if TYPE_CHECKING:  # torch is imported when tensors are loaded: the tokenizer reads metadata only
    import torch

log = logging.getLogger(__name__)


#: Tensor data alignment in bytes when ``general.alignment`` is absent (GGUF_DEFAULT_ALIGNMENT).
DEFAULT_ALIGNMENT = 32

#: GGML_MAX_DIMS: a tensor has 1 to 4 dimensions.
MAX_DIMS = 4

#: Rows per ``gguf.quants.dequantize`` call. gguf holds a full-size list of results before
#: concatenating them, so one call on a 519 MiB embedding peaks at twice that; 4096 rows of
#: 896 floats are 14 MiB of temporaries.
DEQUANT_ROWS = 4096

#: Tensor types meshinfer dequantizes: F64 by numpy, the rest by ``gguf.quants.dequantize``.
SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
})

#: ``general.architecture`` values read here (llama.cpp's names). A ``llama`` file with
#: ``llama.expert_count`` > 0 is Mixtral (llama.cpp converts Mixtral as ``llama``).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "phi3", "gemma2", "gemma3")

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
}
_DENSE_FFN_NAMES = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_ROUTER_NAMES = {"ffn_gate_inp.weight": "mlp.gate.weight"}
# Qwen2-MoE's shared expert and its gate.
_SHARED_EXPERT_NAMES = {"ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                        "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                        "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                        "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# Merged expert tensors (E, out, in) -> the per-expert module name, ``{e}`` the expert index.
_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


# Phi-3: q, k, v in one tensor; llama.cpp's ``ffn_up`` holds gate and up fused (2F rows).
_PHI3_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_qkv.weight": "self_attn.qkv_proj.weight",
               "attn_output.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}


# Gemma 2: a norm after each sublayer; ``ffn_norm`` is the one before the MLP. Norm weights are
# stored as ``1 + w`` (llama.cpp's converter adds the 1), which is what ``GemmaRMSNorm`` holds.
_GEMMA2_NORM_NAMES = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                      "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


def _block_names(cfg: ModelConfig) -> dict[str, str]:
    """GGUF suffix -> module name for one block of ``cfg``'s family (experts excluded)."""
    if cfg.architecture == "phi3":
        return dict(_PHI3_NAMES)
    if cfg.architecture == "gemma2":
        return _BLOCK_NAMES | _GEMMA2_NORM_NAMES | _DENSE_FFN_NAMES
    if cfg.architecture == "gemma3":
        return _BLOCK_NAMES | _GEMMA2_NORM_NAMES | _QK_NORM_NAMES | _DENSE_FFN_NAMES
    names = dict(_BLOCK_NAMES)
    if cfg.architecture in ("qwen3", "qwen3moe"):
        names |= _QK_NORM_NAMES
    names |= _ROUTER_NAMES if cfg.is_moe else _DENSE_FFN_NAMES
    if cfg.shared_expert_intermediate_size:
        names |= _SHARED_EXPERT_NAMES
    return names

# ---------------------------------------------------------------------------------------------
# Header parsing (ggml docs/gguf.md), little-endian.


@dataclass(frozen=True)
class _TensorInfo:
    """One entry of the tensor-info section. ``dims`` in GGUF order: ``ne0`` (innermost) first."""

    name: str
    dims: tuple[int, ...]
    raw_type: int
    offset: int  # relative to the start of the data section


def _read_tensor_infos(cur: Cursor, n_tensors: int) -> list[_TensorInfo]:
    seen: set[str] = set()

    def read_info(i: int) -> _TensorInfo:
        name = cur.string(f"tensor #{i} name")
        if name in seen:
            raise cur.error(f"tensor {name!r}", "the name appears twice")
        seen.add(name)
        n_dims = cur.scalar(GGUFValueType.UINT32, f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.error(f"tensor {name!r} n_dims", f"{n_dims} is outside 1..{MAX_DIMS}")
        dims = struct.unpack(f"<{n_dims}Q", cur.take(8 * n_dims, f"tensor {name!r} dims"))
        raw_type = cur.scalar(GGUFValueType.UINT32, f"tensor {name!r} type")
        offset = cur.scalar(GGUFValueType.UINT64, f"tensor {name!r} offset")
        return _TensorInfo(name, dims, raw_type, offset)

    return cur.records(n_tensors, MIN_TENSOR_INFO_BYTES, "the tensor count", read_info)


def _alignment(meta: dict[str, Any], path: Path) -> int:
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise WeightsError(f"{path}: metadata field 'general.alignment' is {align!r}, "
                           "not a positive power of two")
    return align


@dataclass(frozen=True)
class _Tensor:
    """A validated tensor: its type, GGUF-order dims and absolute byte span in the file."""

    name: str
    qtype: GGMLQuantizationType
    dims: tuple[int, ...]
    start: int
    n_bytes: int

    @property
    def row_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return self.dims[0] // block * type_size


def _check_tensor(info: _TensorInfo, data_start: int, alignment: int, file_size: int,
                  path: Path) -> _Tensor:
    """Validate one tensor info: type, shape, alignment, bounds. Raises naming the tensor."""
    try:
        qtype = GGMLQuantizationType(info.raw_type)
    except ValueError:
        qtype = None
    if qtype is None or qtype.name not in SUPPORTED_TYPES:
        kind = qtype.name if qtype is not None else f"number {info.raw_type} (unknown to GGML)"
        raise UnsupportedTensorType(
            f"{path}: tensor {info.name!r} has type {kind}, which meshinfer cannot "
            f"dequantize; supported: {', '.join(sorted(SUPPORTED_TYPES))}")
    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = list(info.dims)
    if any(d <= 0 for d in shape) or shape[0] % block:
        raise WeightsError(f"{path}: tensor {info.name!r} has shape {shape}, which does not fit "
                           f"type {qtype.name} (rows must be a multiple of {block} values)")
    if info.offset % alignment:
        raise WeightsError(f"{path}: tensor {info.name!r} has data offset {info.offset}, which is "
                           f"not a multiple of the alignment {alignment}")
    n_bytes = int(np.prod(shape, dtype=object)) // block * type_size
    start = data_start + info.offset
    if start + n_bytes > file_size:
        raise WeightsError(f"{path}: tensor {info.name!r} of type {qtype.name} and shape {shape} "
                           f"needs {n_bytes} bytes and ends at byte {start + n_bytes}, past the end "
                           f"of the file ({file_size} bytes): the file is truncated")
    return _Tensor(info.name, qtype, info.dims, start, n_bytes)


def _check_overlaps(tensors: list[_Tensor], path: Path) -> None:
    spans = sorted((t.start, t.start + t.n_bytes, t.name) for t in tensors)
    for (_, end, name), (nstart, _, nname) in zip(spans, spans[1:]):
        if end > nstart:
            raise WeightsError(f"{path}: tensor {name!r} (ends at byte {end}) overlaps tensor "
                               f"{nname!r} (starts at byte {nstart}): its byte size does not match")


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

    Attributes:
        path: the file.
        file_size: its size in bytes.
        metadata: the key/value metadata (see :func:`read_gguf_metadata` for value types);
            ``Tokenizer.from_gguf`` accepts this object to avoid parsing the file twice.
        config: the model's :class:`ModelConfig`.

    Raises:
        WeightsError: wrong magic, a header that cannot be parsed (corrupt or truncated; the
            message names the field), a tensor that extends past the end of the file or
            overlaps the next one, a shape that does not fit the tensor's type, or missing
            metadata.
        UnsupportedTensorType: a tensor type outside :data:`SUPPORTED_TYPES`.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        t0 = time.perf_counter()
        try:
            # tensors are read from this file (os.pread), never through the map: a file cut
            # short under a load is then a WeightsError, not SIGBUS on a page past its new end
            self._file = open(self.path, "rb")
            weakref.finalize(self, self._file.close)
            self._buf = map_gguf(self.path, self._file)  # the header and metadata
        except OSError as exc:
            raise WeightsError(f"{self.path}: cannot read: {exc}") from exc
        self.file_size = len(self._buf)
        cur = Cursor(self._buf, self.path)
        n_tensors, self.metadata = read_header(cur)
        alignment = _alignment(self.metadata, self.path)
        infos = _read_tensor_infos(cur, n_tensors)
        data_start = -(-cur.pos // alignment) * alignment
        tensors = [_check_tensor(i, data_start, alignment, self.file_size, self.path) for i in infos]
        _check_overlaps(tensors, self.path)
        self._tensors = {t.name: t for t in tensors}
        self.config = self._read_config()
        log.debug("opened %s: %d tensors, %d metadata fields, %.2f s", self.path, len(tensors),
                  len(self.metadata), time.perf_counter() - t0)

    # ------------------------------------------------------------------ metadata
    def field(self, key: str, default: object = ...) -> object:
        """The value of metadata field ``key``: a scalar, a string or a list.

        Raises:
            WeightsError: when the field is missing and no default is given.
        """
        value = self.metadata.get(key, default)
        if value is ...:
            raise WeightsError(f"{self.path}: metadata field {key!r} is missing")
        return value.tolist() if isinstance(value, np.ndarray) else value

    def _read_config(self) -> ModelConfig:
        arch = self.field("general.architecture")
        if not isinstance(arch, str):
            raise WeightsError(f"{self.path}: metadata field 'general.architecture' is not a string")
        if arch not in GGUF_ARCHITECTURES:
            raise WeightsError(f"{self.path}: architecture {arch!r} is not supported; supported: "
                               f"{', '.join(GGUF_ARCHITECTURES)} (llama with experts: Mixtral)")

        def num(key: str, default: object = ...) -> object:
            value = self.field(f"{arch}.{key}", default)
            if not isinstance(value, (int, float)):
                raise WeightsError(f"{self.path}: metadata field '{arch}.{key}' must be a number, got {value!r}")
            return value

        embd = self._tensors.get("token_embd.weight")
        if embd is None:
            raise WeightsError(f"{self.path}: tensor 'token_embd.weight' is missing")
        vocab = int(num("vocab_size", embd.dims[1] if len(embd.dims) > 1 else 0))
        heads = int(num("attention.head_count"))
        experts = int(num("expert_count", 0))
        exps = self._tensors.get("blk.0.ffn_gate_exps.weight") or self._tensors.get("blk.0.ffn_gate.0.weight")
        cfg = ModelConfig(
            architecture="mixtral" if arch == "llama" and experts else arch,
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
            head_dim=int(num("attention.key_length", 0)),
            num_experts=experts,
            num_experts_per_tok=int(num("expert_used_count", 0)),
            moe_intermediate_size=int(num("expert_feed_forward_length", exps.dims[1] if exps else 0)),
            # llama.cpp renormalises the top k for every MoE architecture read here but qwen2moe
            norm_topk_prob=bool(self.field(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
            shared_expert_intermediate_size=int(num("expert_shared_feed_forward_length", 0)),
            **(self._phi3_fields(num) if arch == "phi3" else {}),
            **(self._gemma2_fields(num) if arch == "gemma2" else {}),
            **(self._gemma3_fields(num) if arch == "gemma3" else {}),
        )
        try:
            return cfg.validate()
        except ValueError as exc:
            raise WeightsError(f"{self.path}: {exc}") from exc

    def _phi3_fields(self, num: Callable[..., object]) -> dict[str, object]:
        """Phi-3's partial rotary, sliding window and LongRoPE (``rope_factors_long/short``
        tensors, ``rope.scaling.*``), as llama.cpp's converter writes them."""
        heads = int(num("attention.head_count"))
        head_dim = int(num("attention.key_length", 0)) or int(num("embedding_length")) // heads
        fields: dict[str, object] = {
            "partial_rotary_factor": int(num("rope.dimension_count", head_dim)) / head_dim,
            "sliding_window": int(num("attention.sliding_window", 0))}
        if "rope_factors_long.weight" in self._tensors:
            fields |= {"rope_long_factor": tuple(self.dequantize("rope_factors_long.weight").tolist()),
                       "rope_short_factor": tuple(self.dequantize("rope_factors_short.weight").tolist()),
                       "original_max_position_embeddings": int(num("rope.scaling.original_context_length")),
                       "rope_attention_factor": float(num("rope.scaling.attn_factor", 0.0))}
        return fields

    def _gemma2_fields(self, num: Callable[..., object]) -> dict[str, object]:
        """Gemma 2's window, soft-caps and alternating layers (llama.cpp: sliding on even layers;
        scales scores by ``key_length ** -0.5``; the 27B model's ``query_pre_attn_scalar`` is C/H
        instead, which a GGUF does not record)."""
        layers, heads = int(num("block_count")), int(num("attention.head_count"))
        head_dim = int(num("attention.key_length", 0)) or int(num("embedding_length")) // heads
        return {"sliding_window": int(num("attention.sliding_window", 0)), "query_pre_attn_scalar": float(head_dim),
                "attn_logit_softcapping": float(num("attn_logit_softcapping", 0.0)),
                "final_logit_softcapping": float(num("final_logit_softcapping", 0.0)),
                "layer_types": tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))}

    def _gemma3_fields(self, num: Callable[..., object]) -> dict[str, object]:
        """Gemma 3's window, five sliding layers to one full, RoPE bases (sliding:
        ``rope.freq_base_swa``, else llama.cpp's 10,000) and linear scaling of the full layers."""
        fields = self._gemma2_fields(num) | {"attn_logit_softcapping": 0.0, "final_logit_softcapping": 0.0}
        fields["layer_types"] = tuple("sliding_attention" if (i + 1) % 6 else "full_attention"
                                      for i in range(len(fields["layer_types"])))
        fields["rope_local_theta"] = float(num("rope.freq_base_swa", 10000.0))
        if self.field("gemma3.rope.scaling.type", "none") == "linear":
            fields["rope_linear_factor"] = float(num("rope.scaling.factor"))
        return fields

    # ------------------------------------------------------------------ tensors
    def tensor_names(self) -> list[str]:
        """All tensor names in file order."""
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The GGML type name of tensor ``name`` (read from the file, per tensor)."""
        return self._tensor(name).qtype.name

    def _tensor(self, name: str) -> _Tensor:
        t = self._tensors.get(name)
        if t is None:
            raise WeightsError(f"{self.path}: tensor {name!r} is missing")
        return t

    def dequantize(self, name: str) -> np.ndarray:
        """Dequantize tensor ``name`` to float32, shaped like a torch weight ``(out, in)``: a new
        array, read :data:`DEQUANT_ROWS` rows at a time (:meth:`_read`).

        Raises:
            WeightsError: when the tensor is missing, or the file no longer holds it whole.
        """
        t = self._tensor(name)
        rows = t.n_bytes // t.row_bytes
        out = np.empty((rows, t.dims[0]), dtype=np.float32)  # (rows, ne0)
        for r in range(0, rows, DEQUANT_ROWS):
            n = min(DEQUANT_ROWS, rows - r)
            chunk = self._read(t, t.start + r * t.row_bytes, n * t.row_bytes).reshape(n, t.row_bytes)
            if t.qtype == GGMLQuantizationType.F64:
                out[r:r + n] = chunk.view(np.float64)
            else:
                out[r:r + n] = quants.dequantize(chunk, t.qtype)
        return out.reshape(tuple(reversed(t.dims)))  # GGUF lists ne0 (innermost) first

    def iter_shard_tensors(self, layers: LayerRange, *, blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(module_name, float32 tensor)`` for the tensors a shard over ``layers`` needs.

        Only blocks ``[layers.start, layers.stop)`` are read; the token embedding only when
        ``layers.start == 0``; the final norm and output projection only when ``layers.stop == L``
        (falling back to the tied token embedding when the file has no ``output.weight``).
        Module names follow Hugging Face's (``layers.3.self_attn.q_proj.weight``).

        With ``blocks``, a 2-D tensor stored in a type the gguf kernels take
        (``kernels.blocks.KERNEL_TYPES``, float32 excepted) comes as ``QuantBlocks``: a copy of the
        file's bytes, rows permuted as the float tensor's would be (the ``gguf`` precision); a
        tensor named twice (a head tied to the token embedding) comes as one object.

        Every tensor is a copy in this process's memory, never a view of the file's memory map:
        nothing written to the file later (in place, or truncating it) reaches a loaded shard.
        Tensors are read with ``os.pread`` (:meth:`_read`), not through the map, so a file cut
        short during the load is a :class:`WeightsError`, and no page of the file is held in
        this process's memory besides the copies.
        """
        import torch

        cfg = self.config
        layers.check_within(cfg.num_hidden_layers)
        wanted: list[tuple[str, str]] = []
        if layers.start == 0:
            wanted.append(("token_embd.weight", "embed_tokens.weight"))
        names = _block_names(cfg)
        for i in range(layers.start, layers.stop):
            for suffix, module in names.items():
                gname = f"blk.{i}.{suffix}"
                if gname in self._tensors or not suffix.endswith(".bias"):
                    wanted.append((gname, f"layers.{i}.{module}"))
        if layers.stop == cfg.num_hidden_layers:
            wanted.append(("output_norm.weight", "norm.weight"))
            head = "output.weight" if "output.weight" in self._tensors else "token_embd.weight"
            wanted.append((head, "lm_head.weight"))
        copied: dict[str, object] = {}  # gguf name -> QuantBlocks already made (a tied head)
        for gname, module in wanted:
            if gname in copied:
                yield module, copied[gname]
                continue
            kept = self._blocks(gname) if blocks else None
            arr = self.dequantize(gname) if kept is None else kept
            if cfg.architecture in ("llama", "mixtral"):
                if ".attn_q." in gname:
                    arr = _reverse_llama_permute(arr, cfg.num_attention_heads)
                elif ".attn_k." in gname:
                    arr = _reverse_llama_permute(arr, cfg.num_key_value_heads)
            if module.endswith("shared_expert_gate.weight"):
                arr = arr.reshape(1, cfg.hidden_size)  # llama.cpp stores this row as (C,)
            if kept is None:
                yield module, torch.from_numpy(arr)
            else:
                from meshinfer.engine.kernels.blocks import blocks_from_file
                copied[gname] = blocks_from_file(arr, self.tensor_type(gname), self._tensor(gname).dims[0])
                yield module, copied[gname]
            if cfg.is_moe and module.endswith(".mlp.gate.weight"):  # the experts follow their router
                yield from self._iter_experts(gname.rsplit(".", 2)[0], module.rsplit(".", 3)[0])

    def _read(self, t: _Tensor, start: int, n: int) -> np.ndarray:
        """``n`` bytes of the file from byte ``start`` (within tensor ``t``), as a new uint8
        array, read with ``os.preadv`` (``os.pread`` where it is missing) from the file opened
        with the map, never through the map.

        Raises:
            WeightsError: the file ends before them (it was cut short after it was opened).
        """
        out = np.empty(n, dtype=np.uint8)
        got = 0
        while got < n:
            if hasattr(os, "preadv"):
                k = os.preadv(self._file.fileno(), [memoryview(out)[got:]], start + got)
            else:
                chunk = os.pread(self._file.fileno(), n - got, start + got)
                out[got:got + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                k = len(chunk)
            if k == 0:
                raise WeightsError(f"{self.path}: tensor {t.name!r} ends at byte {t.start + t.n_bytes}, but the file "
                                   f"now ends at byte {start + got}: it was changed while being read")
            got += k
        return out

    def _blocks(self, name: str) -> np.ndarray | None:
        """A copy of tensor ``name``'s bytes ``(rows, row_bytes)`` uint8 (:meth:`_read`) when it
        is 2-D and stored in a type the gguf kernels compute from; else None.

        Raises:
            WeightsError: the file no longer holds the tensor whole.
        """
        from meshinfer.engine.kernels.blocks import KERNEL_TYPES

        t = self._tensor(name)
        if len(t.dims) != 2 or t.qtype.name not in KERNEL_TYPES or t.qtype.name == "F32":
            return None
        return self._read(t, t.start, t.n_bytes).reshape(-1, t.row_bytes)

    def _iter_experts(self, block: str, layer: str) -> Iterator[tuple[str, torch.Tensor]]:
        """Split block ``blk.N``'s merged ``ffn_*_exps`` tensors ``(E, out, in)`` into per-expert
        ``(out, in)`` tensors named ``layers.N.mlp.experts.{e}.*_proj.weight``. Files written
        before llama.cpp merged experts hold one tensor per expert (``ffn_gate.{e}.weight``);
        those are read as they are.

        Raises:
            WeightsError: a merged tensor is missing or has a number of experts other than E.
        """
        import torch

        E = self.config.num_experts
        for suffix, module in _EXPERT_NAMES.items():
            legacy = suffix.replace("_exps.weight", ".{e}.weight")  # ffn_gate.{e}.weight
            if f"{block}.{suffix}" not in self._tensors and f"{block}.{legacy.format(e=0)}" in self._tensors:
                for e in range(E):
                    yield f"{layer}.{module.format(e=e)}", torch.from_numpy(self.dequantize(
                        f"{block}.{legacy.format(e=e)}"))
                continue
            arr = self.dequantize(f"{block}.{suffix}")  # (E, out, in)
            if arr.ndim != 3 or arr.shape[0] != E:
                raise WeightsError(f"{self.path}: tensor '{block}.{suffix}' has shape {list(arr.shape)}; "
                                   f"expected ({E}, out, in) for {E} experts")
            for e in range(E):
                yield f"{layer}.{module.format(e=e)}", torch.from_numpy(arr[e])
