"""A Llama-family layer as one C call (``kernels.layer_step``): the same bits as the layer run
operation by operation, for decode and verification steps, at every gguf precision and f32;
used only where it applies, and the caller's input is left alone."""

from __future__ import annotations

import pytest
import torch

from meshinfer.engine.generate import load_shard, new_cache
from meshinfer.engine.kernels import layer_step, native, step_ops
from meshinfer.engine.kernels import blocks as kb
from meshinfer.engine.kernels.blocks import F32_KERNEL_MAX_ROWS
from meshinfer.engine.kv_cache import KVCache
from meshinfer.engine.models import llama


def quantized_tiny(tmp_path, arch: str):
    """A tiny model (4 layers, 32 wide) whose projections are Q8_0, Q5_0, Q4_0 and Q4_1."""
    from helpers.tiny import write_quantized_tiny

    return write_quantized_tiny(tmp_path / f"tiny-{arch}.gguf", arch)


def steps(shard):
    """A 40-token prefill (too long for one call: operation by operation), four decode steps and
    a 5-position verification step; every output and the final KV cache."""
    cache = new_cache(shard)
    outs = [shard(torch.arange(3, 43).unsqueeze(0), 0, cache, logits="all")]
    for t in range(4):
        outs.append(shard(torch.tensor([[60 + t]]), cache.length, cache))
    outs.append(shard(torch.tensor([[7, 8, 9, 10, 11]]), cache.length, cache, logits="all"))
    return outs, cache


def counting(monkeypatch, cls) -> list:
    """Wrap ``cls.__call__`` so that each call appends whether it returned a result."""
    taken, real = [], cls.__call__
    monkeypatch.setattr(cls, "__call__", lambda self, *a: (lambda y: taken.append(y is not None) or y)(real(self, *a)))
    return taken


def same_cache(a: KVCache, b: KVCache, layers: int) -> bool:
    n = a.length
    return n == b.length and all(torch.equal(x[:, :, :n], y[:, :, :n]) for layer in range(layers)
                                 for x, y in zip(a.storage(layer, 0), b.storage(layer, 0)))


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("precision", ["gguf", "gguf-a16", "gguf-a8", "f32"])
def test_one_call_equals_the_layer_operation_by_operation(tmp_path, monkeypatch, arch, precision):
    """All layers as one call (LayerStack), each layer as one call (LayerStep) and each layer
    operation by operation: the same logits and KV cache, bit for bit."""
    assert native.library() is not None, "the C kernels did not build"
    shard = load_shard(quantized_tiny(tmp_path, arch), dtype=precision)
    stacks, layers = counting(monkeypatch, layer_step.LayerStack), counting(monkeypatch, layer_step.LayerStep)
    stacked, stacked_cache = steps(shard)
    assert stacks == [True] * 5 and layers == []  # the 4 decode + 1 verification steps, all layers in one call each
    monkeypatch.setattr(llama, "layers_in_one_call", lambda *a: None)
    fast, fast_cache = steps(shard)
    assert layers == [True] * (5 * len(shard.layers))
    monkeypatch.setattr(llama.Block, "_one_call", lambda self, *a: None)
    slow, slow_cache = steps(shard)
    for a, b, c in zip(stacked, fast, slow):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert same_cache(stacked_cache, slow_cache, 4) and same_cache(fast_cache, slow_cache, 4)


@pytest.mark.parametrize("precision", ["gguf-a8", "f32"])
def test_the_stack_gives_the_same_bits_on_any_thread_count(tmp_path, precision):
    """Each product row and each query is computed by one thread alone, whichever thread takes
    it: one, two and three threads give the same logits and KV cache."""
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype=precision)
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            runs.append(steps(shard))
    finally:
        torch.set_num_threads(before)
    (want, want_cache), *others = runs
    for got, got_cache in others:
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and same_cache(got_cache, want_cache, 4)


def test_the_input_hidden_states_are_not_changed(tmp_path):
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="gguf-a16")
    cache = new_cache(shard)
    shard(torch.arange(3, 10).unsqueeze(0), 0, cache)
    block = shard.layers["0"]
    x = torch.randn(1, 1, 32)
    before = x.clone()
    cos, sin = llama.rope_tables(shard.cfg, torch.tensor([7]), 8, torch.float32)
    cache.reserve(1)
    y = block(x, cos, sin, 7, cache, 0)
    assert torch.equal(x, before) and not torch.equal(y, x)


def test_the_layer_runs_operation_by_operation_where_one_call_does_not_apply(tmp_path, monkeypatch):
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="gguf-a8")
    calls = []
    for cls in (layer_step.LayerStep, layer_step.LayerStack):
        monkeypatch.setattr(cls, "__call__", lambda self, *a: calls.append(type(self).__name__))
    cache = new_cache(shard)
    shard(torch.arange(3, 43).unsqueeze(0), 0, cache)  # 40 positions: longer than one call takes
    shard(torch.tensor([[5]]), cache.length, None)  # no cache
    two = KVCache(shard.range, 2, 8, batch=2)
    shard(torch.tensor([[5], [6]]), 0, two)  # two sequences in one cache
    assert calls == []
    bf16 = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="bf16")  # bfloat16 hidden states
    bf16(torch.tensor([[5]]), 0, new_cache(bf16))
    assert calls == []
    f32 = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="f32")
    f32(torch.arange(3, 3 + F32_KERNEL_MAX_ROWS + 1).unsqueeze(0), 0, new_cache(f32))  # past the f32 kernel's rows
    assert calls == []
    f32(torch.arange(3, 3 + F32_KERNEL_MAX_ROWS).unsqueeze(0), 0, new_cache(f32))
    # every layer as one call; the patched call gave nothing back, so each layer as one call then
    assert calls == ["LayerStack"] + ["LayerStep"] * len(f32.layers)


def test_cache_storage_is_offered_only_with_room():
    cache = KVCache(llama.LayerRange(0, 2), 2, 8, max_tokens=512)
    assert cache.storage(0, 1) is None  # nothing reserved yet
    cache.reserve(3)
    k, v = cache.storage(1, 3)
    assert k.shape == v.shape == (1, 2, cache.capacity, 8)
    assert cache.storage(1, cache.capacity + 1) is None
    assert cache.storage(5, 1) is None  # a layer it does not hold


def test_a_layer_whose_sizes_do_not_fit_is_refused(tmp_path):
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="gguf")
    block = shard.layers["0"]
    attn, mlp = block.self_attn, block.mlp
    products = (attn.q_proj.fused((attn.k_proj, attn.v_proj)), attn.o_proj.fused(),
                mlp.gate_proj.fused((mlp.up_proj,)), mlp.down_proj.fused())
    norms = (block.input_layernorm.weight, block.post_attention_layernorm.weight)
    with pytest.raises(ValueError, match="do not fit"):
        layer_step.LayerStep(products, norms, 1e-6, heads=2, kv_heads=2, head_dim=8)  # 4 heads in the file
    with pytest.raises(ValueError, match="do not fit"):
        layer_step.LayerStep(products[::-1], norms, 1e-6, heads=4, kv_heads=2, head_dim=8)


def test_a_changed_weight_or_norm_is_seen(tmp_path, monkeypatch):
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="gguf-a16")
    steps(shard)  # the layers' one-call steps are made and kept
    block = shard.layers["1"]
    down = block.mlp.down_proj
    down.set_blocks(kb.QuantBlocks(down.qtype, torch.flip(down.blocks, [0]).contiguous(), down.in_features))
    block.input_layernorm.weight = torch.nn.Parameter(block.input_layernorm.weight * 2, requires_grad=False)
    block.self_attn.q_proj.bias = block.self_attn.q_proj.bias + 1
    fast, _ = steps(shard)
    monkeypatch.setattr(llama.Block, "_one_call", lambda self, *a: None)
    monkeypatch.setattr(llama, "layers_in_one_call", lambda *a: None)
    slow, _ = steps(shard)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_tensors_of_other_sizes_are_not_given_to_the_kernel(tmp_path):
    """The kernel reads cos/sin and writes the cache by the layer's sizes: a table of another
    length, a cache of other heads or width, or a non-contiguous cache gets None (torch then)."""
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="gguf-a8")
    step = shard.layers["0"]._layer_step()
    assert step is not None
    x = torch.randn(1, 2, 32)
    cos, sin = llama.rope_tables(shard.cfg, torch.tensor([4, 5]), 6, torch.float32)
    k, v = torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)
    assert step(x, cos, sin, 4, k, v) is not None
    assert step(x, cos[:1], sin[:1], 4, k, v) is None
    assert step(x, cos, sin, 4, torch.zeros(1, 1, 16, 8), torch.zeros(1, 1, 16, 8)) is None
    assert step(x, cos, sin, 4, torch.zeros(1, 2, 16, 4), torch.zeros(1, 2, 16, 4)) is None
    wide = torch.zeros(1, 2, 16, 16)
    assert step(x, cos, sin, 4, wide[..., :8], wide[..., 8:]) is None
    assert step(x, cos, sin, 15, k, v) is None  # positions 15, 16: past the capacity of 16
    assert step(torch.randn(1, 2, 16), cos, sin, 4, k, v) is None  # 16 wide for a 32-wide layer: once a heap overflow
    assert step(x, cos.double(), sin.double(), 4, k, v) is None



def test_a_layer_of_no_key_value_heads_is_refused_not_divided_by(tmp_path):
    """An attack run: LayerStep with kv_heads=0 reached the C modulo and killed the process."""
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="f32")
    block = shard.layers["0"]
    products = block._products()
    norms = (block.input_layernorm.weight, block.post_attention_layernorm.weight)
    with pytest.raises(ValueError, match="0 key/value heads"):
        layer_step.LayerStep(products, norms, 1e-6, heads=4, kv_heads=0, head_dim=8)
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 0, 1, 8)
    assert step_ops.attention(q, k, k, 0) is None


@pytest.mark.parametrize("rows", ["kernel types", "float32 rows"])
@pytest.mark.parametrize("precision", ["gguf", "gguf-a16", "gguf-a8"])
def test_a_peer_without_avx2_gets_the_same_bits(tmp_path, monkeypatch, precision, rows):
    """The whole model on the kernels' portable C path (built without ``-march``: no AVX2, as on
    an Arm Mac) gives the AVX2 build's logits and KV cache bit for bit: a prefill operation by
    operation, another past the dense path's row count, decode steps and a verification step
    as one call each (with this machine's torch for the rest: rotary tables, the dense path).
    "float32 rows": a k_proj left float32 and a down_proj in Q5_1, a type the kernels do not
    take (kept as float32 rows); their products went through mi_matmul_f32 on AVX2 and torch
    without it, other bits (found by a fuzzing run)."""
    from helpers.portable import portable_library

    portable = portable_library(tmp_path)
    if rows == "kernel types":
        path = quantized_tiny(tmp_path, "llama")
    else:
        from gguf import GGMLQuantizationType as G
        from helpers.tiny import write_quantized_tiny

        path = write_quantized_tiny(tmp_path / "rows.gguf", "llama", k_proj=None, down_proj=G.Q5_1)

    def run():
        shard = load_shard(path, dtype=precision)
        outs, cache = steps(shard)
        long = shard(torch.arange(100, 164).unsqueeze(0), 0, new_cache(shard), logits="all")  # 64 rows: dense
        return outs + [long], cache

    want, want_cache = run()
    monkeypatch.setattr(native, "library", lambda: portable)
    taken = counting(monkeypatch, layer_step.LayerStack)
    got, got_cache = run()
    if rows == "kernel types":  # (float32 rows keep a layer operation by operation on every build)
        assert taken and all(taken)  # the one-call layer stack ran on the portable build
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    n = got_cache.length
    assert n == want_cache.length
    for layer in range(4):
        assert all(torch.equal(a[:, :, :n], b[:, :, :n])
                   for a, b in zip(got_cache.storage(layer, 0), want_cache.storage(layer, 0)))


def test_a_stack_is_not_given_caches_of_other_sizes(tmp_path):
    """mi_layers_step writes every layer's cache by one capacity: caches of two capacities, a
    cache too few or of another layout, or inputs of another size get None, and nothing is run."""
    shard = load_shard(quantized_tiny(tmp_path, "qwen2"), dtype="gguf-a8")
    stack = layer_step.LayerStack([shard.layers[str(i)]._layer_step() for i in range(4)])
    x = torch.randn(1, 2, 32)
    cos, sin = llama.rope_tables(shard.cfg, torch.tensor([4, 5]), 6, torch.float32)
    kvs = [(torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)) for _ in range(4)]
    assert stack(x, cos, sin, 4, kvs) is not None
    assert all(k[:, :, 4:6].abs().sum() > 0 for k, _ in kvs)  # each layer wrote its keys
    fresh = [(torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8)) for _ in range(4)]
    for bad in (fresh[:3], fresh[:3] + [(torch.zeros(1, 2, 32, 8), torch.zeros(1, 2, 32, 8))],
                fresh[:3] + [(torch.zeros(1, 2, 16, 16)[..., :8], torch.zeros(1, 2, 16, 8))]):
        assert stack(x, cos, sin, 4, bad) is None
    assert stack(torch.randn(1, 2, 16), cos, sin, 4, fresh) is None
    assert stack(x, cos, sin, 15, fresh) is None  # positions 15, 16: past the capacity of 16
    assert all(k.abs().sum() == 0 and v.abs().sum() == 0 for k, v in fresh)
    with pytest.raises(ValueError, match="one hidden width"):
        layer_step.LayerStack([])
