"""Single-process greedy generation: the baseline the mesh is measured against.

``load_shard`` turns a weights path into a :class:`~meshinfer.engine.models.llama.Shard`;
``greedy_generate`` runs prefill (in chunks) then decode with a per-conversation
:class:`~meshinfer.engine.kv_cache.KVCache`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Iterable, Sequence

import torch

from meshinfer.core.config import LayerRange, ModelConfig, check_cpu_only
from meshinfer.core.errors import InvalidInput
from meshinfer.core.generation import Generation, check_context
from meshinfer.engine.kernels.step_ops import argmax
from meshinfer.engine.kv_cache import KVCache
from meshinfer.engine.models.llama import Shard
from meshinfer.engine.models.quant import (Precision, parse_precision as _parse_precision,
    precision_names)
from meshinfer.engine.weights import WeightsSource, open_weights

log = logging.getLogger(__name__)

#: Prompt tokens per prefill step. Matches the mesh's chunking so the baseline and the mesh
#: compute in the same order; 512 tokens of f32 hidden states are 1.8 MB on the wire for C=896.
PREFILL_CHUNK = 512

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def parse_precision(name: str) -> Precision:
    """A ``--dtype`` value -> :class:`~meshinfer.engine.models.quant.Precision` (see that module's table).

    Raises:
        InvalidInput: an unknown name; the message lists every choice.
    """
    try:
        return _parse_precision(name)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def parse_dtype(name: str) -> Precision:
    """Alias of :func:`parse_precision` (``--dtype`` names a precision, not only a torch dtype)."""
    return parse_precision(name)


def check_precision_device(precision: Precision, device: str) -> None:
    """Refuse a quantized precision on a device other than the CPU, before any device is set up
    (so a user is not first told to install a CUDA build for a precision that cannot use it).

    Raises:
        InvalidInput: ``precision`` is quantized and ``device`` (``"cpu"``, ``"cuda:0"``, ...)
            is not the CPU.
    """
    check_cpu_only(precision.name, device)  # CPU_ONLY_PRECISIONS: the quantized ones (tests/test_quant.py)


def load_shard(weights: WeightsSource | str | os.PathLike, layers: LayerRange | None = None, *,
               dtype: torch.dtype | Precision | str = torch.float32, device: str = "cpu",
               cache_dir: str | os.PathLike | None = None) -> Shard:
    """Load layers ``layers`` (default: all) of a GGUF file or HF directory.

    The shard holds copies of the file's tensors, at every precision (the gguf precisions copy
    the file's blocks: ``GGUFFile.iter_shard_tensors``), so nothing written to the file later
    (in place, or truncating it: SIGBUS on a mapped page) reaches it.

    Args:
        dtype: a torch float dtype, or a precision (object or name, e.g. ``"q8-bf16"``).
        cache_dir: for a quantized precision, keep the converted tensors under this folder
            (see :mod:`meshinfer.engine.weights.converted`) and reuse them on the next load; None: no cache.

    Raises:
        WeightsError: unreadable or inconsistent weights.
        LayerRangeError: ``layers`` outside the model.
        InvalidInput: an unknown precision, or a quantized one on a device other than the CPU.
    """
    precision = _as_precision(dtype)
    check_precision_device(precision, str(torch.device(device)))
    src = weights if hasattr(weights, "iter_shard_tensors") else open_weights(weights)
    layers = layers or LayerRange(0, src.config.num_hidden_layers)
    layers.check_within(src.config.num_hidden_layers)
    if precision.weights == "gguf":
        if not hasattr(src, "dequantize"):
            raise InvalidInput(f"precision {precision.name} computes from a GGUF file's blocks; this model is "
                               f"not a GGUF file")
        _check_gguf_kernels(precision.name)
        return Shard.from_tensors(src.config, layers, src.iter_shard_tensors(layers, blocks=True),
                                  device=device, precision=precision)
    if precision.quantized and cache_dir is not None:
        return _load_via_cache(src, layers, precision, cache_dir)
    return Shard.from_tensors(src.config, layers, src.iter_shard_tensors(layers), device=device,
                              precision=precision)


def _check_gguf_kernels(name: str) -> None:
    """Refuse ``gguf-a16`` / ``gguf-a8`` where the integer-activation kernels are missing (no C
    compiler built them; on a CPU without AVX2 their portable C path runs, with the same bits):
    the fallback would multiply float32 activations and choose other tokens than the
    precision's other peers, which a route must not mix.

    Raises:
        InvalidInput: naming the precision that does run here.
    """
    from meshinfer.engine.kernels import native

    if name == "gguf":
        return
    lib = native.library()
    if lib is None:
        raise InvalidInput(f"precision {name} needs the gguf kernels' integer dot products, and no C compiler "
                           f"built them; use --dtype gguf (the same weights, float32 activations)")


def _load_via_cache(src: WeightsSource, layers: LayerRange, precision: Precision,
                    cache_dir: str | os.PathLike) -> Shard:
    """A CPU shard at a quantized ``precision``, from the converted cache when every unit the
    range needs is there and sound (see :mod:`meshinfer.engine.weights.converted`).

    Otherwise the shard is built from ``src`` layer by layer and every unit is (re)written.
    Peak memory: the finished shard plus one unit (hit) or one float32 tensor (rebuild).

    Raises:
        WeightsError: inconsistent source weights. (A cache that cannot be written is logged.)
    """
    from meshinfer.engine.models.quant import quantize_modules
    from meshinfer.engine.weights import converted
    from meshinfer.engine.weights.identity import weights_hash

    digest = weights_hash(src.path)
    meta = converted.unit_meta(digest, precision.name)
    units = converted.units_for(layers, src.config.num_hidden_layers)
    with torch.device("meta"):
        shard = Shard(src.config, layers)
        quantize_modules(shard, precision)
    expected = {k: (v.dtype, tuple(v.shape)) for k, v in shard.state_dict(keep_vars=True).items()}
    for unit in units:
        tensors = converted.read_unit(converted.unit_path(cache_dir, digest, precision.name, unit), meta)
        want = {k: v for k, v in expected.items() if converted.unit_of(k) == unit}
        if tensors is None or {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()} != want:
            break
        shard.load_state_dict(tensors, strict=False, assign=True)
    else:
        return shard.eval()
    shard = Shard.from_tensors(src.config, layers, src.iter_shard_tensors(layers), precision=precision)
    state = shard.state_dict()
    try:
        for unit in units:
            converted.write_unit(converted.unit_path(cache_dir, digest, precision.name, unit),
                                 {k: v for k, v in state.items() if converted.unit_of(k) == unit}, meta)
    except OSError as exc:  # a read-only or full disk costs the next start time, nothing else
        log.warning("could not write the converted cache under %s: %s", cache_dir, exc)
    return shard


def _as_precision(dtype: torch.dtype | Precision | str) -> Precision:
    if isinstance(dtype, Precision):
        return dtype
    if isinstance(dtype, str):
        return parse_precision(dtype)
    names = {v: k for k, v in DTYPES.items()}
    if dtype not in names:
        raise InvalidInput(f"dtype {dtype} is not one of {', '.join(precision_names())}")
    return Precision(names[dtype], dtype)


def new_cache(shard: Shard, run: LayerRange | None = None) -> KVCache:
    """An empty KV cache for ``run`` (default: all of ``shard``'s layers) in the shard's dtype."""
    cfg: ModelConfig = shard.cfg
    return KVCache(run or shard.range, cfg.num_key_value_heads, cfg.head_dim, dtype=shard.dtype,
                   device=shard.device, max_tokens=cfg.max_position_embeddings)


def greedy_generate(shard: Shard, prompt_ids: Sequence[int], *, max_tokens: int | None,
                    eos_ids: Iterable[int] = (),
                    on_token: Callable[[int], None] | None = None) -> Generation:
    """Greedy (argmax) decoding of the whole model in this process.

    Args:
        shard: a shard holding every layer.
        prompt_ids: the prompt's token ids.
        max_tokens: tokens to generate at most (None: up to the context).
        eos_ids: ids that end generation (not included in ``token_ids``).
        on_token: called with each generated id as soon as it is chosen.

    Returns:
        A :class:`Generation` (``text`` left empty: the caller owns the tokenizer).

    Raises:
        ContextOverflow, InvalidInput: see :func:`check_context` and ``Shard.forward``.
    """
    if not (shard.is_first and shard.is_last):
        raise InvalidInput(f"greedy_generate needs every layer; this shard holds {shard.range.cli()}")
    budget = check_context(len(prompt_ids), max_tokens, shard.cfg.max_position_embeddings)
    eos = set(eos_ids)
    out = Generation(prompt_ids=list(prompt_ids))
    cache = new_cache(shard)
    t0 = time.perf_counter()
    try:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.int64)  # (1, P)
        for s in range(0, ids.shape[1], PREFILL_CHUNK):
            logits = shard(ids[:, s:s + PREFILL_CHUNK], s, cache)  # (1, 1, V) on the last chunk
        token = argmax(logits[0, -1])  # an int: on a GPU this waits for the prefill's kernels
        out.ttft_ms = (time.perf_counter() - t0) * 1e3
        t1 = time.perf_counter()
        decode_steps = 0
        while out.accept(token, budget=budget, eos=eos, on_token=on_token):
            logits = shard(torch.tensor([[out.token_ids[-1]]]), cache.length, cache)  # (1, 1, V)
            token = argmax(logits[0, -1])
            decode_steps += 1
        out.set_decode_rate(decode_steps, time.perf_counter() - t1)
    finally:
        cache.free()
    return out
