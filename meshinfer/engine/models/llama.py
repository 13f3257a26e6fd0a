"""Llama-family decoder (Llama, SmolLM2, Qwen2) split into shards by layer range.

``Shard`` (embedding, a range of blocks, final norm and head; single and batched passes) serves
every family: it builds each layer with ``meshinfer.engine.models.families.make_block``; the other
families (``qwen3.py``, ``moe.py``, ``phi3.py``, ``gemma.py``) reuse this file's ``Attention``
(hooks: ``project``, ``attend``), ``MLP`` and ``Block``.

Module names follow the Hugging Face checkpoints (``layers.3.self_attn.q_proj.weight``),
with layer indices global to the whole model, so a shard over ``[12, 24)`` holds
``layers.12`` .. ``layers.23``. The caller passes the KV cache in; the model never owns it.
Pure torch: nothing here logs, prints, awaits or touches files.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from meshinfer.core.config import LayerRange, ModelConfig
from meshinfer.core.errors import InvalidInput, PositionError, StepAbandoned, WeightsError
from meshinfer.engine.models.common import (LayerCache, Linear, RMSNorm, apply_rope, causal_attention,
                                            rope_tables)
from meshinfer.engine.kernels.layer_step import F32Product, LayerStack, LayerStep
from meshinfer.engine.kernels.step_ops import ATTENTION_MAX_QUERIES, packed_pass
from meshinfer.engine.models.gguf_linear import GGUFLinear, project_many, project_spent, swiglu_product
from meshinfer.engine.models.quant import Precision, quantize_modules


#: The entries of a projection's or norm's parameters, buffers and attributes that its layer's
#: one-call step (:class:`LayerStep`) depends on (``Block._state``).
_WATCHED = ("weight", "bias", "blocks", "qtype", "act_bits", "eps")


class Attention(nn.Module):
    """Grouped-query self-attention with optional q/k/v bias (Qwen2) and RoPE."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        C, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = H, Hkv, D, cfg.sliding_window
        self.q_proj = Linear(C, H * D, bias=cfg.attention_bias)
        self.k_proj = Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.v_proj = Linear(C, Hkv * D, bias=cfg.attention_bias)
        self.o_proj = Linear(H * D, C, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``(B, T, C)`` -> q ``(B, H, T, D)``, k and v ``(B, Hkv, T, D)``, before RoPE."""
        B, T, _ = x.shape
        q, k, v = project_many(x, (self.q_proj, self.k_proj, self.v_proj))  # one kernel call at gguf*
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention of q ``(B, H, T, D)`` over k, v ``(B, Hkv, S, D)`` -> ``(B, H, T, D)``."""
        return causal_attention(q, k, v, start, window=self.window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                cache: LayerCache | None, layer: int) -> torch.Tensor:
        """``x`` ``(B, T, C)`` -> ``(B, T, C)``; ``cos/sin`` ``(T, R)``; ``start`` = first position."""
        B, T, _ = x.shape
        q, k, v = self.project(x)  # (B, H, T, D), (B, Hkv, T, D) x 2
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Hkv, S, D)
        y = self.attend(q, k, v, start)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def forward_ragged(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       segments: Sequence["Segment"], layer: int) -> torch.Tensor:
        """Several sequences packed along T: ``x`` ``(1, N, C)`` -> ``(1, N, C)``, ``N = sum(T_i)``.

        The projections run once over all ``N`` rows (each weight read once for the whole
        batch); attention runs per segment against that segment's own cache, so a sequence
        never sees another's keys. ``cos/sin`` ``(N, D)`` hold each row's own position.
        """
        _, N, _ = x.shape
        q, k, v = self.project(x)  # (1, H, N, D), (1, Hkv, N, D) x 2
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ys = []
        for seg in segments:
            rows = slice(seg.offset, seg.offset + seg.length)
            k_all, v_all = seg.cache.update(layer, k[:, :, rows], v[:, :, rows])  # (1, Hkv, S_i, D)
            ys.append(self.attend(q[:, :, rows], k_all, v_all, seg.start))  # (1, H, T_i, D)
        y = torch.cat(ys, dim=2) if len(ys) > 1 else ys[0]  # (1, H, N, D)
        return self.o_proj(y.transpose(1, 2).reshape(1, N, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``.

    ``intermediate_size`` defaults to the config's (one MoE expert passes its own width).
    """

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project_spent(swiglu_product(x, self.gate_proj, self.up_proj), self.down_proj)  # (B, T, C)


class Block(nn.Module):
    """One pre-norm decoder layer: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    Other families reuse it with their own attention (Qwen3: q/k norms) or feed-forward
    (a sparse mixture of experts): ``attention`` and ``mlp`` build those from the config.
    """

    def __init__(self, cfg: ModelConfig, *, attention: Callable[[ModelConfig], nn.Module] = Attention,
                 mlp: Callable[[ModelConfig], nn.Module] = MLP) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp(cfg)

    def forward(self, x, cos, sin, start, cache, layer):  # (B, T, C) -> (B, T, C)
        y = self._one_call(x, cos, sin, start, cache, layer)
        if y is not None:
            return y
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, start, cache, layer)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_ragged(self, x, cos, sin, segments, layer):  # (1, N, C) -> (1, N, C), see Attention
        h = x + self.self_attn.forward_ragged(self.input_layernorm(x), cos, sin, segments, layer)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _one_call(self, x, cos, sin, start, cache, layer) -> torch.Tensor | None:
        """The layer as one C call (``kernels.layer_step``, equal bit for bit to the path
        above) for a step of one sequence of a few positions (``LayerStep.max_rows``), float32
        on the CPU, at a gguf precision or f32, with a KV cache that has room; None otherwise."""
        if (x.dim() != 3 or x.shape[0] != 1 or x.dtype != torch.float32 or x.device.type != "cpu"
                or cos.dim() != 2 or not hasattr(cache, "storage")):
            return None
        step = self._layer_step()
        if step is None or not 1 <= x.shape[1] <= step.max_rows:
            return None
        kv = cache.storage(layer, x.shape[1])
        if kv is None or kv[0].dtype != torch.float32 or kv[0].shape[0] != 1:
            return None
        return step(x, cos, sin, start, *kv)

    def _products(self) -> tuple | None:
        """q/k/v, o, gate/up and down as one-call products: GGUF blocks sharing fused calls
        (``GGUFLinear.fused``) or float32 weights (``F32Product``); None for anything else."""
        attn, mlp = self.self_attn, self.mlp
        groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                  (mlp.down_proj,))
        mods = [m for g in groups for m in g]
        if all(isinstance(m, GGUFLinear) for m in mods):
            return tuple(g[0].fused(g[1:]) for g in groups)
        if all(type(m) is Linear for m in mods):
            return tuple(F32Product.make([m.weight for m in g], [m.bias for m in g]) for g in groups)
        return None

    def _state(self) -> list:
        """What this layer's :class:`LayerStep` depends on, as objects: the nine sub-modules it
        reads (norms and projections), then each one's :data:`_WATCHED` entries of its
        parameters, buffers and attributes (weight, bias, blocks, block type, activation bits,
        eps). Read straight from the modules' dictionaries, through dictionaries gathered once
        for these nine modules (again when one of them is replaced): nn.Module's attribute
        lookup made the check cost about 40 us a layer, and gathering the dictionaries each
        step another 35 us (0.85 ms a 24-layer step)."""
        attn, mlp = self._modules["self_attn"]._modules, self._modules["mlp"]._modules
        mods = [self._modules["input_layernorm"], self._modules["post_attention_layernorm"], attn["q_proj"],
                attn["k_proj"], attn["v_proj"], attn["o_proj"], mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]]
        where = self.__dict__.get("_watched")
        if where is None or not all(map(operator.is_, where[0], mods)):
            dicts = [d for m in mods for d in (m._parameters, m._buffers, m.__dict__) for _ in _WATCHED]
            where = self.__dict__["_watched"] = (mods, dicts, _WATCHED * (len(dicts) // len(_WATCHED)))
        return mods + list(map(dict.get, where[1], where[2]))

    def _layer_step(self) -> LayerStep | None:
        """This layer's prepared :class:`LayerStep`, or None where it does not apply: another
        family's attention or feed-forward, projections of another kind (``_products``), norms
        that are not float32. Made once, and again when a weight, bias or norm changes."""
        mods = self._modules
        if (type(mods["self_attn"]) is not Attention or type(mods["mlp"]) is not MLP
                or type(mods["input_layernorm"]) is not RMSNorm
                or type(mods["post_attention_layernorm"]) is not RMSNorm):
            return None
        state = self._state()
        kept = self.__dict__.get("_kept_step")
        if kept is not None and all(map(operator.is_, kept[0], state)):
            return kept[1]
        products, norms = self._products(), (self.input_layernorm.weight, self.post_attention_layernorm.weight)
        step = None
        if products is not None and all(p is not None for p in products) and all(
                n.dtype == torch.float32 and n.device.type == "cpu" and n.is_contiguous() for n in norms):
            attn = self.self_attn
            try:
                step = LayerStep(products, norms, self.input_layernorm.eps, heads=attn.n_heads,
                                 kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, window=attn.window or 0)
            except ValueError:
                step = None
        self.__dict__["_kept_step"] = (state, step)
        return step


def layers_in_one_call(shard: "Shard", h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                       cache: "LayerCache | None", run: LayerRange) -> torch.Tensor | None:
    """Layers ``run`` of ``shard`` over ``h`` ``(1, T, C)`` as one C call
    (``kernels.layer_step.LayerStack``, equal bit for bit to the layers called in turn), where
    every one of them would take its own one call (``Block._one_call``): a step of one sequence
    of a few positions, float32 on the CPU, with a KV cache that has room; None otherwise, and
    nothing is computed. The stack is made once and kept on the shard while its layers' steps
    stay the same objects."""
    if (h.dim() != 3 or h.shape[0] != 1 or h.shape[1] > ATTENTION_MAX_QUERIES or h.dtype != torch.float32
            or h.device.type != "cpu" or cos.dim() != 2 or not hasattr(cache, "storage") or run.stop <= run.start):
        return None  # (a prefill chunk longer than any step's kernels take: no layer is asked)
    blocks = shard.layers._modules
    steps = []
    for i in range(run.start, run.stop):
        block = blocks[str(i)]
        step = block._layer_step() if type(block) is Block else None
        if step is None:
            return None
        steps.append(step)
    kept = shard.__dict__.get("_kept_stack")
    if kept is None or len(kept.steps) != len(steps) or any(a is not b for a, b in zip(kept.steps, steps)):
        kept = shard.__dict__["_kept_stack"] = LayerStack(steps)
    if not 1 <= h.shape[1] <= kept.max_rows:
        return None
    kvs = [cache.storage(i, h.shape[1]) for i in range(run.start, run.stop)]
    return None if any(kv is None for kv in kvs) else kept(h, cos, sin, start, kvs)


@dataclass(frozen=True)
class Segment:
    """One sequence of a packed batch: rows ``[offset, offset + length)`` of the packed
    ``(1, N, C)`` tensor are its new tokens at positions ``start .. start + length - 1``."""

    offset: int
    length: int
    start: int
    cache: LayerCache


class Shard(nn.Module):
    """Decoder layers ``[layers.start, layers.stop)``, plus the embedding on the first shard
    and the final norm and output projection on the last.

    Args:
        cfg: the whole model's config.
        layers: the half-open range this shard holds.

    Raises:
        LayerRangeError: when ``layers`` is outside ``[0, cfg.num_hidden_layers)``.
    """

    def __init__(self, cfg: ModelConfig, layers: LayerRange) -> None:
        super().__init__()
        self.cfg = cfg
        self.range = layers.check_within(cfg.num_hidden_layers)
        self.is_first = layers.start == 0
        self.is_last = layers.stop == cfg.num_hidden_layers
        # _weight: no random init. On the meta device (from_tensors) nn.Embedding's normal_ goes
        # through torch._refs, which imports torch._dynamo: 40-50 MiB of a peer's memory for nothing
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)) if self.is_first else None
        from meshinfer.engine.models.families import make_block, make_final_norm

        self.layers = nn.ModuleDict({str(i): make_block(cfg, i) for i in range(layers.start, layers.stop)})
        self.norm = make_final_norm(cfg) if self.is_last else None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if self.is_last else None

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of hidden states and the KV cache (the norms' dtype; quantized projections
        keep their own int8 or GGUF block storage, see ``models/quant.py``)."""
        return next(iter(self.layers.values())).input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.layers.values())).input_layernorm.weight.device

    @classmethod
    def from_tensors(cls, cfg: ModelConfig, layers: LayerRange,
                     tensors: Iterable[tuple[str, torch.Tensor]], *,
                     dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                     precision: Precision | None = None) -> "Shard":
        """Build a shard on the meta device, then assign each tensor as it arrives.

        No weight exists twice in memory: each float32 tensor from the reader is cast (or, for a
        quantized ``precision``, quantized) and moved, then dropped (the gpt-fast pattern), so
        the peak is the finished shard plus one float32 tensor.

        Args:
            precision: the kernel family; None means float weights in ``dtype``.

        Raises:
            WeightsError: a tensor whose shape differs from the model's, an unexpected tensor,
                or a parameter no tensor filled.
        """
        precision = precision or Precision(str(dtype), dtype)
        with torch.device("meta"):
            shard = cls(cfg, layers)
            shapes = {name: tuple(p.shape) for name, p in shard.named_parameters()}
            quantize_modules(shard, precision)
        filled = set()
        for name, tensor in tensors:
            if name not in shapes:
                raise WeightsError(f"unexpected tensor {name!r} for layers {layers.cli()}")
            if tuple(tensor.shape) != shapes[name]:
                raise WeightsError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                   f"the model needs {shapes[name]}")
            owner_name, _, attr = name.rpartition(".")
            owner = shard.get_submodule(owner_name)
            if hasattr(tensor, "qtype"):  # the file's own blocks (GGUFFile, blocks=True)
                if hasattr(owner, "set_blocks"):
                    owner.set_blocks(tensor.to_device(device))
                    filled.add(name)
                    continue
                from meshinfer.engine.kernels.blocks import dequantize
                tensor = dequantize(tensor)
            if attr == "weight" and hasattr(owner, "set_float_weight"):
                owner.set_float_weight(tensor.to(device))  # quantized storage
            elif attr in owner._buffers:  # a quantized module's bias stays float32
                setattr(owner, attr, tensor.to(device=device, dtype=torch.float32).contiguous())
            else:
                value = tensor.to(device=device, dtype=precision.act_dtype).contiguous()
                setattr(owner, attr, nn.Parameter(value, requires_grad=False))
            filled.add(name)
        missing = sorted(set(shapes) - filled)
        if missing:
            raise WeightsError(f"tensors missing for layers {layers.cli()}: {', '.join(missing[:5])}"
                               + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        return shard.eval()

    def _check_input(self, x: torch.Tensor, run: LayerRange) -> None:
        if run.start == 0:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise InvalidInput(f"the first shard takes token ids (B, T) int64, got {tuple(x.shape)} {x.dtype}")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
                bad = int(x.max()) if int(x.max()) >= self.cfg.vocab_size else int(x.min())
                raise InvalidInput(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
        elif x.dim() != 3 or x.shape[-1] != self.cfg.hidden_size or not x.is_floating_point():
            raise InvalidInput(f"layers {run.cli()} take hidden states (B, T, {self.cfg.hidden_size}) float, "
                               f"got {tuple(x.shape)} {x.dtype}")
        if x.shape[1] == 0:
            raise InvalidInput("a step must carry at least one token")

    def check_step(self, x: torch.Tensor, start: int, cache: "LayerCache | None" = None,
                   run: LayerRange | None = None) -> LayerRange:
        """Check one step's input before any computation; return the layer range it runs.

        Args: as :meth:`forward`.

        Raises:
            InvalidInput: wrong input kind or shape, a token id outside the vocabulary.
            PositionError: ``start`` differs from the cache length, or exceeds the context.
            LayerRangeError: ``run`` is not within this shard.
        """
        run = run or self.range
        if run.start < self.range.start or run.stop > self.range.stop:
            from meshinfer.core.errors import LayerRangeError
            raise LayerRangeError(f"this shard holds layers {self.range.cli()}, asked for {run.cli()}")
        self._check_input(x, run)
        T = x.shape[1]
        if start < 0 or start + T > self.cfg.max_position_embeddings:
            raise PositionError(f"positions {start}..{start + T - 1} exceed the context of "
                                f"{self.cfg.max_position_embeddings} tokens")
        if cache is not None and getattr(cache, "length", start) != start:
            raise PositionError(f"step starts at position {start} but the cache holds {cache.length} tokens")
        return run

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start: int, cache: "LayerCache | None" = None, *,
                run: LayerRange | None = None, logits: str = "last",
                abandoned: Callable[[], bool] | None = None) -> torch.Tensor:
        """Run layers ``run`` (default: all of this shard's) over ``T`` new tokens.

        Args:
            x: token ids ``(B, T)`` int64 when ``run.start == 0``, else hidden states ``(B, T, C)``;
                on any device (moved to the shard's).
            start: position of the first new token. With a cache it must equal the cache's length.
            cache: the conversation's KV cache for these layers, or None for a stateless pass.
            run: a sub-range of this shard's layers to apply.
            logits: on the last layer, ``"last"`` returns ``(B, 1, V)``, ``"all"`` ``(B, T, V)``.
            abandoned: asked before each layer; True stops the pass (a long prefill chunk whose
                conversation ended need not run to its end: seconds per chunk at long context).

        Returns:
            Hidden states ``(B, T, C)`` in the compute dtype, or float32 logits when ``run``
            ends at the model's last layer.

        Raises:
            InvalidInput: wrong input kind or shape, a token id outside the vocabulary.
            PositionError: ``start`` differs from the cache length, or exceeds the context.
            LayerRangeError: ``run`` is not within this shard.
            StepAbandoned: ``abandoned()`` said so; the cache keeps its length, but the layers
                already run wrote past it (a sliding window's ring included): free it.
        """
        run = self.check_step(x, start, cache, run)
        T = x.shape[1]
        if cache is not None:
            cache.reserve(T)
        x = x.to(self.device)  # inputs may come from anywhere (the wire, a warm-up) on the CPU
        h = self._embed(x) if run.start == 0 else x.to(self.dtype)  # (B, T, C)
        positions = torch.arange(start, start + T, device=h.device)  # (T,)
        cos, sin = rope_tables(self.cfg, positions, start + T, h.dtype)  # (T, R)
        y = layers_in_one_call(self, h, cos, sin, start, cache, run)
        for i in range(run.start, run.stop) if y is None else ():
            if abandoned is not None and abandoned():
                raise StepAbandoned(f"the step at positions {start}..{start + T - 1} was abandoned before layer {i}")
            h = self.layers[str(i)](h, cos, sin, start, cache, i)
        h = h if y is None else y
        if cache is not None:
            cache.commit(T)
        if run.stop < self.cfg.num_hidden_layers:
            return h
        if logits == "last":
            h = h[:, -1:]  # (B, 1, C)
        return self._head(h)  # (B, T|1, V)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> embeddings ``(B, T, C)``, times ``cfg.embed_scale`` (Gemma)."""
        h = self.embed_tokens(ids)  # (B, T, C)
        if self.cfg.embed_scale != 1.0:
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)  # HF rounds the scale to the dtype
        return h

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states ``(B, T, C)`` -> float32 logits ``(B, T, V)``, soft-capped when the config says."""
        out = self.lm_head(self.norm(h)).float()  # (B, T, V)
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(out / cap) * cap if cap else out

    def _packed_rope(self, segments: Sequence[Segment], dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``(N, R)`` for the packed rows: each row at its own position; under LongRoPE,
        with the factors its own sequence's length picks."""
        spans = [torch.arange(s.start, s.start + s.length, device=device) for s in segments]
        if not self.cfg.rope_long_factor:
            return rope_tables(self.cfg, torch.cat(spans), 0, dtype)  # (N, R)
        tables = [rope_tables(self.cfg, p, s.start + s.length, dtype) for p, s in zip(spans, segments)]
        return torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])  # (N, R) x 2

    @torch.inference_mode()
    def forward_batch(self, xs: Sequence[torch.Tensor], starts: Sequence[int], caches: Sequence[LayerCache], *,
                      run: LayerRange | None = None, logits: str | Sequence[str] = "last") -> list[torch.Tensor]:
        """One step of each of ``B`` sequences in one pass, each with its own cache and position.

        The sequences are packed along T into one ``(1, N, C)`` tensor, ``N = sum(T_i)``, so
        every projection and the MLP run once for the batch (each weight read once, which is
        what decode on a memory-bound CPU pays for); attention runs per sequence over its own
        cache (ragged lengths, no padding, no mask across sequences). Row ``i`` of a matmul
        depends only on row ``i`` of its input, so the results equal ``B`` calls of
        :meth:`forward` up to the float rounding of the BLAS kernel chosen for ``N`` rows
        instead of 1 (measured: max abs difference about 1e-6 per layer in float32).

        Args:
            xs: ``B`` inputs, each token ids ``(1, T_i)`` int64 when ``run.start == 0``, else
                hidden states ``(1, T_i, C)``.
            starts: position of each sequence's first new token; must equal its cache length.
            caches: each sequence's KV cache for these layers (distinct objects).
            run: a sub-range of this shard's layers to apply, the same for every sequence.
            logits: on the last layer, ``"last"`` gives a sequence ``(1, 1, V)``, ``"all"``
                ``(1, T_i, V)``; one mode for every sequence, or one per sequence (a speculative
                verification step and a plain decode step share a pass).

        Returns:
            ``B`` tensors in input order: hidden states ``(1, T_i, C)`` in the compute dtype, or
            float32 logits when ``run`` ends at the model's last layer.

        Raises:
            InvalidInput, PositionError, LayerRangeError: as :meth:`forward`, for the first bad
                sequence, before any cache changes; CacheFull: a cache has no room.
            ValueError: ``xs``, ``starts``, ``caches`` (and per-sequence ``logits``) differ in
                length or are empty, a cache appears twice, or a logits mode is unknown.
        """
        run = run or self.range
        modes = self._check_batch(xs, starts, caches, run, logits)
        for x, cache in zip(xs, caches):
            cache.reserve(x.shape[1])
        segments, offset = [], 0
        for x, start, cache in zip(xs, starts, caches):
            segments.append(Segment(offset, x.shape[1], start, cache))
            offset += x.shape[1]
        device = self.device
        if run.start == 0:
            h = self._embed(torch.cat([x.to(device) for x in xs], dim=1))  # (1, N, C)
        else:
            h = torch.cat([x.to(device=device, dtype=self.dtype) for x in xs], dim=1)  # (1, N, C)
        cos, sin = self._packed_rope(segments, h.dtype, device)  # (N, R)
        with packed_pass():  # each row computed as it would be alone, whatever N strangers make
            for i in range(run.start, run.stop):
                h = self.layers[str(i)].forward_ragged(h, cos, sin, segments, i)
            for seg in segments:
                seg.cache.commit(seg.length)
            if run.stop < self.cfg.num_hidden_layers:
                return [h[:, s.offset:s.offset + s.length] for s in segments]  # B x (1, T_i, C)
            return self._batch_logits(h, segments, modes)

    def _check_batch(self, xs: Sequence[torch.Tensor], starts: Sequence[int], caches: Sequence[LayerCache],
                     run: LayerRange, logits: str | Sequence[str]) -> list[str]:
        """Validate :meth:`forward_batch`'s arguments before any cache changes; return one logits
        mode per sequence. Raises as :meth:`forward_batch` documents."""
        modes = [logits] * len(xs) if isinstance(logits, str) else list(logits)
        if not xs or not len(xs) == len(starts) == len(caches) == len(modes):
            raise ValueError(f"forward_batch needs as many inputs, starts, caches and logits modes (got {len(xs)}, "
                             f"{len(starts)}, {len(caches)}, {len(modes)}), at least one")
        if set(modes) - {"last", "all"}:
            raise ValueError(f"logits must be 'last' or 'all', got {sorted(set(modes) - {'last', 'all'})}")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("forward_batch: each sequence needs its own cache")
        for x, start, cache in zip(xs, starts, caches):
            self.check_step(x, start, cache, run)
            if x.shape[0] != 1:
                raise InvalidInput(f"forward_batch takes one sequence per input, got batch {x.shape[0]}")
        return modes

    def _batch_logits(self, h: torch.Tensor, segments: Sequence[Segment], modes: Sequence[str]) -> list[torch.Tensor]:
        """Float32 logits of the rows each packed sequence wants: its last (``"last"``) or all
        (``"all"``). ``h`` is ``(1, N, C)``; returns ``B`` tensors ``(1, 1 or T_i, V)``."""
        rows, spans = [], []  # the rows each sequence wants logits for, and where they land
        for seg, mode in zip(segments, modes):
            first = seg.offset if mode == "all" else seg.offset + seg.length - 1
            spans.append((len(rows), len(rows) + seg.offset + seg.length - first))
            rows.extend(range(first, seg.offset + seg.length))
        picked = h if len(rows) == h.shape[1] else h[:, torch.tensor(rows, device=h.device)]  # (1, R, C)
        out = self._head(picked)  # (1, R, V)
        return [out[:, a:b] for a, b in spans]  # B x (1, 1 or T_i, V)
