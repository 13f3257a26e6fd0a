"""Model configuration and layer ranges.

``ModelConfig`` uses the Hugging Face field names (``hidden_size``,
``num_key_value_heads``, ``rope_theta`` ...) whichever file format it was read from.
``LayerRange`` is the one type for a span of decoder layers: half-open ``[start, stop)``
inside the code, inclusive ``a-b`` on the command line.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from meshinfer.core.errors import DeviceError, InvalidInput, LayerRangeError

#: Architectures meshinfer runs, and the one file under ``meshinfer/models/`` that implements each
#: (``meshinfer.engine.models.families``): Llama-style (``llama``, SmolLM2 and Mistral too; ``qwen2``),
#: Qwen3 dense (``qwen3``: q/k RMSNorm), sparse mixture-of-experts (``qwen3moe``, ``mixtral``,
#: ``qwen2moe``: a gated shared expert too),
#: Phi-3 (``phi3``: fused projections, LongRoPE, sliding window), Gemma 2 and 3 (``gemma2``,
#: ``gemma3``: extra norms, soft-capping, sliding-window layers, Gemma 3's two RoPE bases).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "mixtral", "phi3", "gemma2", "gemma3")
#: Architectures whose feed-forward is a sparse mixture of experts (``meshinfer.engine.models.moe``).
MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "mixtral")
#: Compute precisions (``--dtype`` values and advertised identities); each is one kernel family,
#: defined in ``meshinfer.engine.models.quant``. Kept here, free of torch, for the CLI's choices.
PRECISION_NAMES = ("f32", "bf16", "f16", "q8-bf16", "gguf", "gguf-a16", "gguf-a8")
#: The precisions whose kernels run on the CPU only (``Precision.quantized``).
CPU_ONLY_PRECISIONS = frozenset({"q8-bf16", "gguf", "gguf-a16", "gguf-a8"})
#: A device spec ``--device`` takes.
DEVICE_SPEC = re.compile(r"cpu|mps|cuda(:\d+)?")


def check_device_args(precision: str, device: str) -> None:
    """The checks of ``--dtype`` and ``--device`` that need neither torch nor a device: the
    device spec is one of cpu, cuda, cuda:N, mps, and a CPU-only precision is on the CPU (so a
    user is not first told to install a CUDA build for a precision that cannot use it).

    Raises:
        DeviceError: a malformed device spec.
        InvalidInput: a precision of :data:`CPU_ONLY_PRECISIONS` on another device.
    """
    check_device_spec(device)
    check_cpu_only(precision, device)


def check_device_spec(device: str) -> None:
    """Raises DeviceError unless ``device`` is one of cpu, cuda, cuda:N, mps."""
    if not DEVICE_SPEC.fullmatch(device or ""):
        raise DeviceError(f"device {device!r} is not one of cpu, cuda, cuda:N, mps")


def check_cpu_only(precision: str, device: str) -> None:
    """Raises InvalidInput when ``precision`` is one of :data:`CPU_ONLY_PRECISIONS` and
    ``device`` (``"cpu"``, ``"cuda:0"``, ...; empty means the CPU) is not the CPU."""
    if precision in CPU_ONLY_PRECISIONS and (device or "cpu").split(":")[0] != "cpu":
        raise InvalidInput(f"precision {precision} uses CPU kernels; use f32/bf16/f16 on {device}, or --device cpu")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of one of :data:`SUPPORTED_ARCHITECTURES`.

    Attributes:
        architecture: one of :data:`SUPPORTED_ARCHITECTURES` (GGUF ``general.architecture``,
            except that a GGUF ``llama`` with experts is ``"mixtral"``).
        vocab_size: V, rows of the token embedding.
        hidden_size: C, width of the residual stream.
        intermediate_size: width of the dense SwiGLU MLP (unused by the MoE layers).
        num_hidden_layers: number of decoder blocks L.
        num_attention_heads: H, query heads.
        num_key_value_heads: Hkv, key/value heads (grouped-query attention when < H).
        rms_norm_eps: epsilon inside RMSNorm (Zhang & Sennrich 2019).
        rope_theta: RoPE base frequency (Su et al. 2021, "RoFormer").
        max_position_embeddings: context length in tokens.
        attention_bias: True when q/k/v projections carry a bias (Qwen2).
        tie_word_embeddings: True when the output projection reuses the token embedding.
        head_dim: D, width of one attention head. 0 (the default) derives it as
            ``hidden_size // num_attention_heads``; Qwen3 sets it apart (0.6B: C=1024, H=16, D=128).
        num_experts: E, experts per MoE layer (HF ``num_experts`` / ``num_local_experts``); 0 = dense.
        num_experts_per_tok: k, experts each token is routed to (top-k of the router).
        moe_intermediate_size: width of one expert's SwiGLU MLP (Mixtral: ``intermediate_size``).
        norm_topk_prob: renormalise the top-k router probabilities to sum to 1 (Mixtral always;
            Qwen3-MoE when its config says so, as llama.cpp assumes).
        shared_expert_intermediate_size: 0, or the width of a shared expert every token also
            runs, scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE).
        partial_rotary_factor: share of D that RoPE rotates (Phi-4-mini: 0.75; 1.0 elsewhere).
        sliding_window: 0, or the keys a query sees, itself included (Phi-3: 2047).
        rope_short_factor, rope_long_factor: LongRoPE per-frequency divisors ``(R/2,)`` below
            and above ``original_max_position_embeddings`` tokens (Phi-3 128k); empty: plain RoPE.
        original_max_position_embeddings: the pre-training context LongRoPE extends.
        rope_attention_factor: LongRoPE's cos/sin scale. 0 (the default) derives HF's
            ``sqrt(1 + ln(s) / ln(original))`` with ``s = max_position / original`` (1 if s <= 1).
        layer_types: per layer, ``"sliding_attention"`` or ``"full_attention"`` (Gemma 2: they
            alternate); empty: ``sliding_window`` (if any) applies to every layer.
        query_pre_attn_scalar: attention scores are scaled by its ``-1/2`` power; 0 = ``head_dim``.
        attn_logit_softcapping, final_logit_softcapping: 0, or ``cap`` in ``cap * tanh(x / cap)``
            applied to attention scores / output logits (Gemma 2: 50 and 30).
        rope_local_theta: 0, or the RoPE base of the sliding-window layers, ``rope_theta`` being
            the full layers' (Gemma 3: 10,000 and 1,000,000; HF ``rope_local_base_freq``).
        rope_linear_factor: linear RoPE scaling of the full layers: positions divided by it
            (Gemma 3 4B and up: 8); 1 = none.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    tie_word_embeddings: bool
    head_dim: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    partial_rotary_factor: float = 1.0
    sliding_window: int = 0
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    original_max_position_embeddings: int = 0
    rope_attention_factor: float = 0.0
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    rope_local_theta: float = 0.0
    rope_linear_factor: float = 1.0

    def __post_init__(self) -> None:  # the derived fields, computed here only
        heads = self.num_attention_heads
        if self.head_dim == 0 and isinstance(heads, int) and heads > 0 and self.hidden_size % heads == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // heads)
        if self.rope_attention_factor == 0.0:
            factor = self.max_position_embeddings / (self.original_max_position_embeddings or 1)
            scale = 1.0
            if self.rope_long_factor and factor > 1.0:
                scale = math.sqrt(1 + math.log(factor) / math.log(self.original_max_position_embeddings))
            object.__setattr__(self, "rope_attention_factor", scale)

    @property
    def embed_scale(self) -> float:
        """Factor on the token embeddings: ``sqrt(C)`` for Gemma (HF ``ScaledWordEmbedding``), else 1."""
        return math.sqrt(self.hidden_size) if self.architecture in ("gemma2", "gemma3") else 1.0

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: full attention); see ``layer_types``."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @property
    def rotary_dim(self) -> int:
        """R, the leading dims of each head that RoPE rotates: ``int(D * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        """True when the feed-forward layers are sparse mixtures of experts."""
        return self.architecture in MOE_ARCHITECTURES

    @property
    def kv_bytes_per_token_per_layer_f32(self) -> int:
        """Bytes one token's K and V take in one layer at float32: ``2 * Hkv * D * 4``."""
        return 2 * self.num_key_value_heads * self.head_dim * 4

    def parameter_counts(self, layers: "LayerRange") -> tuple[int, int]:
        """(resident, active per token) weights of a shard over ``layers``, in elements.

        Resident counts every weight the shard holds, whatever its precision; active counts
        those one token reads: all of a dense shard, and only the router plus ``k`` of the
        ``E`` experts of each MoE layer. The embedding counts on the first shard and the final
        norm and output projection on the last (tied or not, the last shard holds its own copy).
        """
        C, H, Hkv, D, V = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim, \
            self.vocab_size
        attn = 2 * C * H * D + 2 * C * Hkv * D + 2 * C  # q, o, k, v, the two block norms
        attn += 2 * C * (self.architecture in ("gemma2", "gemma3"))  # Gemma: a norm after each sublayer too
        attn += (H * D + 2 * Hkv * D) * self.attention_bias
        attn += 2 * D * (self.architecture in ("qwen3", "qwen3moe", "gemma3"))  # q/k norms
        if self.is_moe:
            expert = 3 * C * self.moe_intermediate_size
            shared = 3 * C * self.shared_expert_intermediate_size + C * bool(self.shared_expert_intermediate_size)
            resident = attn + self.num_experts * (C + expert) + shared  # router row + expert, per expert
            active = attn + self.num_experts * C + self.num_experts_per_tok * expert + shared
        else:
            resident = active = attn + 3 * C * self.intermediate_size
        ends = V * C * (layers.start == 0) + (C + V * C) * (layers.stop == self.num_hidden_layers)
        return len(layers) * resident + ends, len(layers) * active + ends

    def validate(self) -> "ModelConfig":
        """Check internal consistency; raise ``ValueError`` naming the field at fault."""
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config field {name} must be a positive integer, got {value!r}")
        if self.head_dim == 0:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                             f"{self.num_attention_heads}; give head_dim explicitly")
        if not isinstance(self.head_dim, int) or self.head_dim < 0 or self.head_dim % 2:
            raise ValueError(f"model config field head_dim must be a positive even integer (RoPE rotates pairs), "
                             f"got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.is_moe:
            self._validate_moe()
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives {self.rotary_dim} rotary dims "
                             f"of head_dim {self.head_dim}; it must be a positive even number")
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers or
                                 set(self.layer_types) - {"sliding_attention", "full_attention"}):
            raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                             f"{self.num_hidden_layers} layers, got {list(self.layer_types)}")
        half = self.rotary_dim // 2
        if self.rope_long_factor and not (len(self.rope_long_factor) == len(self.rope_short_factor) == half
                                          and self.original_max_position_embeddings > 0):
            raise ValueError(f"LongRoPE needs long and short factors of {half} values each (rotary dims / 2) and "
                             f"original_max_position_embeddings; got {len(self.rope_long_factor)}, "
                             f"{len(self.rope_short_factor)}, {self.original_max_position_embeddings}")
        return self

    def _validate_moe(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.architecture} model config field {name} must be a positive integer, "
                                 f"got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}")


_CLI_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$|^\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class LayerRange:
    """A half-open span ``[start, stop)`` of decoder layers.

    Raises:
        LayerRangeError: when ``start < 0`` or ``stop <= start``.
    """

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or not isinstance(self.stop, int):
            raise LayerRangeError(f"layer range bounds must be integers, got {self.start!r}, {self.stop!r}")
        if self.start < 0:
            raise LayerRangeError(f"layer range starts at {self.start}; layers are numbered from 0")
        if self.stop <= self.start:
            raise LayerRangeError(f"layer range [{self.start}, {self.stop}) is empty")

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        """Parse the inclusive CLI form ``"0-11"`` (or ``"5"``) into ``[0, 12)``.

        Raises:
            LayerRangeError: on malformed text or an empty range such as ``"11-3"``.
        """
        m = _CLI_RANGE.match(text or "")
        if not m:
            raise LayerRangeError(f"layer range {text!r} is not of the form FIRST-LAST, e.g. 0-11")
        if m.group(3) is not None:
            first = last = int(m.group(3))
        else:
            first, last = int(m.group(1)), int(m.group(2))
        if last < first:
            raise LayerRangeError(f"layer range {text!r} is empty: last layer {last} < first layer {first}")
        return cls(first, last + 1)

    def check_within(self, num_layers: int) -> "LayerRange":
        """Raise :class:`LayerRangeError` unless ``stop <= num_layers``; return self."""
        if self.stop > num_layers:
            raise LayerRangeError(
                f"layer range {self.cli()} is outside the model: it has {num_layers} layers "
                f"(0-{num_layers - 1})")
        return self

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.stop

    def cli(self) -> str:
        """Inclusive CLI form, e.g. ``"0-11"`` for ``[0, 12)``."""
        return f"{self.start}-{self.stop - 1}"

    def __str__(self) -> str:
        return self.cli()
