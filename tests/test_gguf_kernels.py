"""The gguf precisions' C kernels (``meshinfer/engine/kernels``): the weights they compute with
equal gguf-py's dequantization bit for bit, their products stay within each activation mode's
tolerance on odd shapes, a row's result does not depend on the rows beside it, the torch
fallback works without a compiler, and tiny quantized models load and decode at every mode."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as G, quants

from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.engine.kernels import blocks as kb, native
from meshinfer.engine.models.gguf_linear import DENSE_MIN_ROWS, GGUFLinear

#: The types the kernels compute from (F32 rows go through torch).
TYPES = ["F16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
#: Byte offsets of each block's float16 fields (ggml-common.h): set to finite values so that
#: random blocks decode to finite weights.
HALF_OFFSETS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}
#: Largest |kernel - float64 reference| / max |reference| per activation mode: float32
#: activations differ only by float32 summation order; int16 activations round each to
#: max|x| / 65534 of its 32-block (measured 2-5e-5 on the default model's tensors); int8 ones to
#: max|x| / 254 (measured 0.2-1%, llama.cpp's error).
TOLERANCE = {32: 1e-5, 16: 2e-4, 8: 3e-2}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """``n`` rows of ``k`` weights of random blocks ``(n, row_bytes)`` uint8, float16 fields finite."""
    rng = np.random.default_rng(seed)
    if type_name == "F16":
        vals = rng.standard_normal((n, k)).astype(np.float16)
        vals[0, :4] = [6e-8, -6e-8, 1e-5, 0]  # subnormals and zero: the C half_to_float's edge cases
        return vals.view(np.uint8)
    qk, nbytes = kb.BLOCK_SHAPE[kb.KERNEL_TYPES[type_name]]
    raw = rng.integers(0, 256, size=(n, k // qk, nbytes), dtype=np.uint8)
    for off in HALF_OFFSETS[type_name]:
        scale = rng.uniform(-0.02, 0.02, size=(n, k // qk)).astype(np.float16)
        raw[..., off:off + 2] = scale.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def blocks_of(type_name: str, n: int, k: int, seed: int = 0) -> kb.QuantBlocks:
    return kb.QuantBlocks(kb.KERNEL_TYPES[type_name], torch.from_numpy(random_blocks(type_name, n, k, seed)), k)


def width(type_name: str) -> int:
    """896 (the default model's width, 28 blocks of 32) for 32-weight blocks; 512 for 256-weight ones."""
    return 512 if type_name in ("Q4_K", "Q6_K") else 896


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    assert lib is not None, "the gguf kernels did not build (is there a C compiler?)"
    return lib


@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_weights_equal_gguf_dequantization_bit_for_bit(lib, type_name):
    n, k = 37, width(type_name)
    raw = random_blocks(type_name, n, k, seed=1)
    want = quants.dequantize(raw, G[type_name]).reshape(n, k)
    got = np.empty((n, k), np.float32)
    assert lib.mi_dequantize(kb.KERNEL_TYPES[type_name], raw.ctypes.data, n, k, got.ctypes.data, 2) == 0
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert torch.equal(kb.dequantize(blocks_of(type_name, n, k, seed=1)), torch.from_numpy(want))


@pytest.mark.parametrize("act_bits", [32, 16, 8])
@pytest.mark.parametrize("type_name", TYPES)
def test_products_are_within_the_activation_modes_tolerance(lib, type_name, act_bits):
    n, k = 37, width(type_name)  # 37 rows: not a multiple of the SIMD width or of a thread's chunk
    w = blocks_of(type_name, n, k, seed=2)
    ref_w = kb.dequantize(w).double()
    for m in (1, 3, 17):  # 17: more rows than one pass of the kernel takes (16)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got, want = kb.matmul(x, w, act_bits=act_bits), x.double() @ ref_w.T  # (m, n)
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err <= TOLERANCE[act_bits], f"{type_name} a{act_bits} m={m}: relative error {err:.2e}"


@pytest.mark.parametrize("act_bits", [32, 16, 8])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(lib, act_bits):
    """A verification step of k + 1 positions must compute each position as a one-position decode
    step would, or speculative and plain decoding could choose different tokens. One row runs
    its own loop for 32-weight blocks (scales formed 64 blocks at a time): 2,272 columns are two
    such runs, the second 7 blocks long (not a multiple of 8)."""
    shapes = [(t, width(t)) for t in ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")]
    for type_name, k in shapes + [("Q5_0", 2272), ("Q8_0", 2272), ("Q4_0", 2272)]:
        w = blocks_of(type_name, 64, k, seed=3)
        x = torch.randn(9, w.in_features, generator=torch.Generator().manual_seed(4))
        together = kb.matmul(x, w, act_bits=act_bits)  # (9, 64)
        for i in (0, 4, 8):
            assert torch.equal(kb.matmul(x[i:i + 1], w, act_bits=act_bits)[0], together[i]), (type_name, k, i)


@pytest.mark.parametrize("act_bits", [32, 16, 8])
def test_a_fused_product_equals_each_weights_own_product_bit_for_bit(lib, act_bits):
    """q, k and v (or gate and up) in one kernel call give what three calls give, biases
    included, at every row count (17: two passes of the kernel) and thread count."""
    ws = [blocks_of("Q5_0", 96, 512, seed=20), blocks_of("Q8_0", 40, 512, seed=21),
          blocks_of("Q4_K", 130, 512, seed=22)]  # 130 rows: over two threads' chunks, not a multiple
    biases = [torch.randn(96), None, torch.randn(130)]
    fused = kb.FusedProduct.make(ws, biases, act_bits)
    assert fused is not None
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for m in (1, 3, 17):
                x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
                got = fused(x)
                assert [tuple(y.shape) for y in got] == [(m, 96), (m, 40), (m, 130)]
                for y, w, b in zip(got, ws, biases):
                    want = kb.matmul(x, w, act_bits=act_bits)
                    assert torch.equal(y, want if b is None else want + b)
    finally:
        torch.set_num_threads(threads)


def test_weights_that_cannot_share_a_call_are_not_fused(lib):
    q5 = blocks_of("Q5_0", 32, 512, seed=23)
    assert kb.FusedProduct.make([q5, blocks_of("Q5_0", 32, 896, seed=24)], [None, None], 8) is None  # two K
    assert kb.FusedProduct.make([q5, blocks_of("F16", 32, 512, seed=25)], [None, None], 8) is None  # a8 and f32 activations
    assert kb.FusedProduct.make([q5, kb.QuantBlocks.from_float(torch.randn(32, 512))], [None, None], 32) is None
    assert kb.FusedProduct.make([q5], [torch.randn(31)], 32) is None  # a bias of the wrong length
    assert kb.FusedProduct.make([q5] * 5, [None] * 5, 32) is None  # more than the kernel takes
    assert kb.FusedProduct.make([q5, blocks_of("F16", 32, 512, seed=25)], [None, None], 32) is not None
    with pytest.raises(ValueError, match="float32"):
        kb.FusedProduct.make([q5], [None], 32)(torch.randn(2, 896))


def test_a_fused_product_reads_only_cpu_weights_it_keeps_alive(lib):
    """Only the first weight's device was checked: a second one elsewhere (here ``meta``) gave
    the kernel a pointer it cannot read (a segfault); and the product kept the QuantBlocks, not
    their bytes, so rebinding ``data`` freed the memory its prepared pointers read."""
    q5 = blocks_of("Q5_0", 32, 512, seed=26)
    elsewhere = kb.QuantBlocks(q5.qtype, q5.data.to("meta"), 512)
    assert kb.FusedProduct.make([q5, elsewhere], [None, None], 32) is None
    w = blocks_of("Q5_0", 32, 512, seed=27)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(27))
    want, fused = kb.matmul(x, w), kb.FusedProduct.make([w], [None], 32)
    w.data = torch.zeros(1, w.data.shape[1], dtype=torch.uint8)  # the old bytes' last holder is the product
    junk = [torch.full((32, w.data.shape[1]), 255, dtype=torch.uint8) for _ in range(50)]  # reuse freed memory
    assert torch.equal(fused(x)[0], want) and len(junk) == 50


def test_the_model_runs_q_k_v_and_gate_up_as_one_call_each(lib, monkeypatch):
    """A decode pass of a layer makes 4 kernel calls (qkv, o, gate-up, down), not 7; a prefill
    pass and other linears go module by module; a changed weight is seen."""
    from meshinfer.engine.models import gguf_linear
    lins = []
    for n, seed in ((64, 30), (32, 31), (32, 32)):
        lin = GGUFLinear(512, n, bias=True, act_bits=16)
        lin.set_blocks(blocks_of("Q5_0", n, 512, seed=seed))
        lin.bias = torch.randn(n)
        lins.append(lin)
    calls = []
    real = kb.FusedProduct.__call__
    monkeypatch.setattr(kb.FusedProduct, "__call__", lambda self, x: calls.append(len(self.out_features)) or real(self, x))
    x = torch.randn(1, 2, 512)
    got = gguf_linear.project_many(x, lins)
    assert calls == [3]
    for y, lin in zip(got, lins):
        assert torch.equal(y, lin(x))
    calls.clear()
    gguf_linear.project_many(torch.randn(1, DENSE_MIN_ROWS, 512), lins)  # prefill: dense, module by module
    assert calls == []
    lins[1].set_blocks(blocks_of("Q5_0", 32, 512, seed=33))
    assert torch.equal(gguf_linear.project_many(x, lins)[1], lins[1](x))
    plain = torch.nn.Linear(512, 8)
    assert torch.equal(gguf_linear.project_many(x, [lins[0], plain])[1], plain(x))


@pytest.mark.parametrize("bits", [8, 16])
def test_the_integer_kernels_round_activations_as_quantize_activations_does(lib, bits):
    """The kernel's integer product equals the float32 product of the rounded activations
    (``quantize_activations``) with the dequantized weight, up to float32 summation order: the
    kernel and the dense path round alike (halves, clamps, NaN-free subnormal blocks)."""
    w = blocks_of("Q8_0", 48, 896, seed=34)
    x = torch.randn(5, 896, generator=torch.Generator().manual_seed(35))
    x[1, :32] = 0.5 * torch.arange(32) / 31  # halves after scaling
    x[2, 32:64] = 1e-40  # a subnormal block
    want = kb.quantize_activations(x, bits).double() @ kb.dequantize(w).double().T
    got = kb.matmul(x, w, act_bits=bits).double()
    assert torch.allclose(got, want, rtol=0, atol=2e-6 * want.abs().max().item())


def test_a_linear_uses_the_dense_path_from_prefill_sizes_with_the_same_result(lib):
    lin = GGUFLinear(896, 40, bias=True)
    lin.set_blocks(blocks_of("Q5_0", 40, 896, seed=5))
    lin.bias = torch.randn(40)
    x = torch.randn(1, DENSE_MIN_ROWS + 3, 896)
    want = x @ lin.dequantized().T + lin.bias  # (1, T, 40)
    assert torch.allclose(lin(x), want, rtol=1e-5, atol=1e-5)  # dense path
    assert torch.allclose(lin(x[:, :5]), want[:, :5], rtol=1e-5, atol=1e-5)  # block kernel


@pytest.mark.parametrize("bits", [32, 8])
def test_the_dense_path_in_column_chunks_gives_one_matmuls_bits(lib, monkeypatch, bits):
    """``dequantize_chunks`` writes each chunk of dequantized rows into its columns of one
    output: one float32 matmul of the whole dequantized weight up to float32 summation order
    (torch's GEMM may take another kernel for a narrow chunk), for chunks that do not divide the
    rows; rounding its input in place (``overwrite_x``) gives the same bits."""
    monkeypatch.setattr(kb, "DEQUANT_CHUNK_BYTES", 7 * 4 * 896)  # 7 rows, or the least a chunk takes
    monkeypatch.setattr(kb, "DEQUANT_CHUNK_MIN_ROWS", 7)
    w = blocks_of("Q5_0", 40, 896, seed=36)
    x = torch.randn(DENSE_MIN_ROWS + 3, 896, generator=torch.Generator().manual_seed(37))
    rounded = kb.quantize_activations(x, bits) if bits != 32 else x
    want = torch.nn.functional.linear(rounded, kb.dequantize(w))
    assert [(i, j) for i, j, _ in kb.dense_row_chunks(w)][-2:] == [(28, 35), (35, 40)]
    got = kb.dequantize_chunks(x, w, act_bits=bits)
    assert torch.allclose(got, want, rtol=0, atol=TOLERANCE[32] * want.abs().max().item())
    spent = x.clone()
    assert torch.equal(kb.dequantize_chunks(spent, w, act_bits=bits, overwrite_x=True), got)
    assert torch.equal(spent, rounded)  # rounded where it lay: no second (M, K) copy
    assert kb.dequantize_chunks(x[:0], w, act_bits=bits).shape == (0, 40)


@pytest.mark.parametrize("bits", [32, 16, 8])
def test_a_prefill_swiglu_takes_the_up_projection_in_chunks_with_the_same_bits(lib, monkeypatch, bits):
    """``swiglu_product`` of a prefill-sized pass multiplies each chunk of the up projection
    into the gate's output as it comes: the bits of ``swiglu(gate(x), up(x))``, and the MLP's
    down projection, handed that spent product (``project_spent``), gives the bits it gives a
    product it must not touch."""
    from meshinfer.engine.models import gguf_linear
    from meshinfer.engine.models.common import swiglu

    monkeypatch.setattr(kb, "DEQUANT_CHUNK_BYTES", 24 * 4 * 896)  # 24 rows: 3 chunks of the 64
    monkeypatch.setattr(kb, "DEQUANT_CHUNK_MIN_ROWS", 24)
    gate, up, down = GGUFLinear(896, 64, bias=False, act_bits=bits), GGUFLinear(896, 64, bias=False, act_bits=bits), \
        GGUFLinear(64, 896, bias=False, act_bits=bits)
    gate.set_blocks(blocks_of("Q8_0", 64, 896, seed=38))
    up.set_blocks(blocks_of("Q5_0", 64, 896, seed=39))
    down.set_blocks(blocks_of("Q8_0", 896, 64, seed=40))
    for rows in (DENSE_MIN_ROWS + 5, 3):  # a prefill (chunked), a decode step (one kernel call)
        x = torch.randn(1, rows, 896, generator=torch.Generator().manual_seed(rows))
        want = swiglu(gate(x), up(x))
        got = gguf_linear.swiglu_product(x, gate, up)
        assert torch.equal(got, want)
        assert torch.equal(gguf_linear.project_spent(got, down), down(want))
    plain = torch.nn.Linear(64, 896, bias=False)
    assert torch.equal(gguf_linear.project_spent(want, plain), plain(want))


def test_float_rows_keep_any_weight_exactly():
    lin = GGUFLinear(30, 7, bias=False)  # 30 columns: no whole 32-block
    w = torch.randn(7, 30)
    lin.set_float_weight(w)
    assert torch.equal(lin.dequantized(), w)
    x = torch.randn(2, 30)
    assert torch.allclose(lin(x), x @ w.T, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_f32_kernel_equals_torch_for_every_row_count_it_takes(lib, threads):
    """``matmul_f32`` (the f32 precision's decode and verification products): 1 to
    ``F32_KERNEL_MAX_ROWS`` rows, row counts that are not multiples of the 8- and 4-row groups,
    within float32 summation order of ``F.linear``; a row's result is the same bits alone or
    batched with others; outside its range it declines (None) and the caller uses torch."""
    g = torch.Generator().manual_seed(threads)
    w = torch.randn(389, 904, generator=g)  # 389 rows: 8- and 4-row groups plus a tail
    x = torch.randn(kb.F32_KERNEL_MAX_ROWS, 904, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = kb.matmul_f32(x[5:6], w)
        for m in range(1, kb.F32_KERNEL_MAX_ROWS + 1):
            got, want = kb.matmul_f32(x[:m], w), torch.nn.functional.linear(x[:m], w)
            assert got.shape == (m, 389)
            assert ((got - want).abs().max() / want.abs().max()).item() <= TOLERANCE[32], m
            if m > 5:
                assert torch.equal(got[5], alone[0]), m
    finally:
        torch.set_num_threads(before)
    assert kb.matmul_f32(torch.randn(kb.F32_KERNEL_MAX_ROWS + 1, 904), w) is None
    assert kb.matmul_f32(torch.randn(2, 900), torch.randn(10, 900)) is None  # K not a multiple of 8
    assert kb.matmul_f32(x[:2].double(), w.double()) is None
    assert kb.matmul_f32(x[:2], w.t()) is None  # a strided weight


def test_the_f32_precision_uses_the_kernel_for_decode_steps_only(lib, monkeypatch):
    """``common.linear`` sends a few float32 rows through the kernel and a prefill chunk to torch."""
    from meshinfer.engine.models import common

    used = []
    real = kb.matmul_f32
    monkeypatch.setattr(common, "matmul_f32", lambda x, w: used.append(x.shape[0]) or real(x, w))
    w, b = torch.randn(64, 96), torch.randn(64)
    for rows in (1, 9, 64):
        x = torch.randn(1, rows, 96)
        got = common.linear(x, w, b)
        assert torch.allclose(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert used == [1, 9, 64]  # asked each time; it declines 64 rows
    assert kb.matmul_f32(torch.randn(64, 96), w) is None


@pytest.mark.parametrize("bits", [8, 16])
def test_activation_rounding_in_c_equals_the_torch_rounding(lib, bits, monkeypatch):
    """``quantize_activations`` (the dense path's rounding) runs in C (``mi_round_activations``)
    when the kernels are loaded; it gives the values the torch fallback gives, on ordinary rows
    and on blocks of zeros, subnormals, infinities and NaN."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(37, 4864, generator=g) * torch.logspace(-3, 3, 4864)
    x[0, :32] = 0.0
    x[1, :32] = 1e-40  # subnormal: 1 / scale overflows
    x[2, 5], x[3, 40], x[4, 70] = float("inf"), float("-inf"), float("nan")
    x[5, 96:128] = torch.tensor([3.5, -2.5] * 16)  # halves: away from zero
    got = kb.quantize_activations(x, bits)
    monkeypatch.setattr(native, "library", lambda: None)
    want = kb.quantize_activations(x, bits)
    assert torch.equal(got.isnan(), want.isnan())
    # equal values (the torch path keeps the sign of a negative that rounds to zero, -0.0: the
    # same value, and the integer kernels have no signed zero)
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
    assert got[4, 64:96].isnan().all() and not got[4, 96:].isnan().any()  # the NaN's block only
    assert lib.mi_round_activations(x.data_ptr(), 37, 4864, 4, got.data_ptr(), 1) == -1  # no 4-bit mode


def test_without_a_compiler_one_warning_and_the_torch_path(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MESHINFER_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="meshinfer.kernels"):
            assert native.library() is None
        assert [r.getMessage() for r in caplog.records] == [
            f"no C compiler ({tmp_path / 'no-such-cc'} not found): --dtype gguf computes through torch, much slower, "
            "and gguf-a16 / gguf-a8 cannot run"]
        w = blocks_of("Q4_K", 9, 512, seed=6)
        x = torch.randn(2, 512)
        assert torch.allclose(kb.matmul(x, w, act_bits=16), x @ kb.dequantize(w).T, rtol=1e-5, atol=1e-5)
    finally:
        native.library.cache_clear()


def test_a_compiler_that_fails_gives_one_warning_not_a_crash(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")  # exists, exits 1
    monkeypatch.setenv("MESHINFER_HOME", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="meshinfer.kernels"):
            assert native.library() is None
        assert len(caplog.records) == 1 and "could not build the gguf kernels" in caplog.records[0].getMessage()
        assert not list((tmp_path / "kernels").glob("*.so")), "a failed build must leave no library behind"
    finally:
        native.library.cache_clear()


def test_blocks_of_the_wrong_size_are_refused():
    with pytest.raises(ValueError, match="are not rows of 896 weights"):
        kb.QuantBlocks(kb.KERNEL_TYPES["Q8_0"], torch.zeros(4, 33, dtype=torch.uint8), 896)
    with pytest.raises(ValueError, match="GGML type 99"):
        kb.QuantBlocks(99, torch.zeros(4, 34, dtype=torch.uint8), 32)


# ------------------------------------------------------------------ tiny quantized models
def _quantized_tiny(tmp_path, arch: str):
    from helpers.tiny import write_quantized_tiny

    return write_quantized_tiny(tmp_path / f"tiny-{arch}-q.gguf", arch)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_a_quantized_tiny_model_at_gguf_computes_the_f32_model(tmp_path, lib, arch):
    """gguf keeps the file's blocks; f32 dequantizes them at load: the same weights, so the same
    logits up to float32 summation order and the same greedy tokens. The llama case checks that
    the blocks' rows are un-permuted like the float rows."""
    path = _quantized_tiny(tmp_path, arch)
    f32, exact = load_shard(path, dtype="f32"), load_shard(path, dtype="gguf")
    assert isinstance(exact.layers["0"].self_attn.q_proj, GGUFLinear)
    assert exact.layers["0"].self_attn.q_proj.qtype == kb.KERNEL_TYPES["Q8_0"]
    ids = torch.tensor([[5, 70, 200, 31, 9, 101, 44]])
    assert torch.allclose(exact(ids, 0, logits="all"), f32(ids, 0, logits="all"), rtol=1e-4, atol=1e-4)
    prompt = ids[0].tolist()
    want = greedy_generate(f32, prompt, max_tokens=12).token_ids
    assert greedy_generate(exact, prompt, max_tokens=12).token_ids == want


@pytest.mark.parametrize("precision,tol", [("gguf-a16", 1e-2), ("gguf-a8", 0.5)])
def test_integer_activation_modes_stay_close_to_f32(tmp_path, lib, precision, tol):
    path = _quantized_tiny(tmp_path, "qwen2")
    f32, fast = load_shard(path, dtype="f32"), load_shard(path, dtype=precision)
    ids = torch.tensor([[5, 70, 200, 31]])
    err = (fast(ids, 0, logits="all") - f32(ids, 0, logits="all")).abs().max().item()
    assert err <= tol, f"{precision}: logits {err:.3g} from f32"


def test_the_gguf_precision_refuses_a_model_that_is_not_a_gguf_file(tmp_path):
    from helpers.tiny import random_weights, tiny_config, write_hf_dir
    from meshinfer.core.errors import InvalidInput

    cfg = tiny_config("qwen2")
    d = write_hf_dir(tmp_path / "hf", cfg, random_weights(cfg))
    with pytest.raises(InvalidInput, match="precision gguf computes from a GGUF file's blocks"):
        load_shard(d, dtype="gguf")


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The library built without ``-march`` (x86-64's baseline: no AVX2, as on an Arm Mac or
    with a compiler that refuses the flag): its portable C path."""
    from helpers.portable import portable_library

    return portable_library(tmp_path_factory.mktemp("portable"))


def hostile_rows(m: int, k: int, seed: int) -> torch.Tensor:
    """``(m, k)`` float32 rows with what a peer may send in its hidden states: huge and tiny
    blocks, subnormals, zeros, an inf and a NaN (each in its own 32-block), and a block of
    half-integers."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, 32:64] *= 1e30
    x[0, 64:96] *= 1e-40  # subnormal: 1 / scale overflows
    x[0, 96:128] = 0
    if m > 1:
        x[1, 0:32] = torch.arange(32) - 15.5
        x[1, 40] = float("inf")
        x[1, 70] = float("nan")
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether float32 ``a`` and ``b`` hold the same bits, NaN matching any NaN (which NaN an
    operation returns depends on its operands' order in the instruction, not on the values)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


@pytest.mark.parametrize("type_name", TYPES)
def test_the_portable_c_path_gives_the_avx2_paths_bits(lib, portable, type_name):
    """Without AVX2 the kernels compute the same float32 operations in the same order (8 lanes
    of fused multiply-adds summed as hsum8 sums them, the same integer lane sums), so a peer on
    another CPU (an Arm Mac: NEON, no AVX2) gets the same kernel results at every gguf
    precision: every product, the rounded activations and the dequantized weights equal the
    AVX2 build's bit for bit, finite or not, one row or many."""
    n, k = 37, width(type_name)
    raw = random_blocks(type_name, n, k, seed=8)
    code = kb.KERNEL_TYPES[type_name]
    want = np.empty((n, k), np.float32)
    got = np.empty((n, k), np.float32)
    assert lib.mi_dequantize(code, raw.ctypes.data, n, k, want.ctypes.data, 1) == 0
    assert portable.mi_dequantize(code, raw.ctypes.data, n, k, got.ctypes.data, 1) == 0
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    kernels = {32: "mi_matmul", 16: "mi_matmul_q16", 8: "mi_matmul_q8"}
    for bits, name in kernels.items():
        if bits != 32 and not lib.mi_supports_q8(code):
            assert not portable.mi_supports_q8(code)
            continue
        for m in (1, 3, 17):
            x = hostile_rows(m, k, seed=m)
            y_avx, y_c = torch.full((m, n), 7.0), torch.full((m, n), 7.0)
            assert getattr(lib, name)(code, raw.ctypes.data, n, k, x.data_ptr(), m, y_avx.data_ptr(), 2) == 0
            assert getattr(portable, name)(code, raw.ctypes.data, n, k, x.data_ptr(), m, y_c.data_ptr(), 2) == 0
            assert same_bits(y_c, y_avx), f"{name}, {m} rows"
    for bits in (8, 16):
        x = hostile_rows(3, k, seed=4)
        r_avx, r_c = torch.empty_like(x), torch.empty_like(x)
        assert lib.mi_round_activations(x.data_ptr(), 3, k, bits, r_avx.data_ptr(), 1) == 0
        assert portable.mi_round_activations(x.data_ptr(), 3, k, bits, r_c.data_ptr(), 1) == 0
        assert same_bits(r_c, r_avx), bits
    w = torch.randn(37, k)  # float32 rows (the f32 precision, and types the block kernels do not take)
    for m in (1, 3, 17, 24):
        x = hostile_rows(m, k, seed=m)
        y_avx, y_c = torch.full((m, 37), 7.0), torch.full((m, 37), 7.0)
        assert lib.mi_matmul_f32(w.data_ptr(), 37, k, x.data_ptr(), m, y_avx.data_ptr(), 2) == 0
        assert portable.mi_matmul_f32(w.data_ptr(), 37, k, x.data_ptr(), m, y_c.data_ptr(), 2) == 0
        assert same_bits(y_c, y_avx), f"mi_matmul_f32, {m} rows"


@pytest.fixture(scope="module")
def vnni(tmp_path_factory):
    """The library built as a CPU with VNNI builds it, its two instructions emulated in C."""
    from helpers.portable import vnni_library

    return vnni_library(tmp_path_factory.mktemp("vnni"))


@pytest.mark.parametrize("type_name", [t for t in TYPES if t != "F16"])
def test_the_vnni_path_gives_the_avx2_paths_bits(lib, vnni, type_name):
    """On a CPU with AVX512-VNNI or AVX-VNNI, the int8 and int16 products sum their lanes with
    vpdpbusd / vpdpwssd instead of maddubs + madd: the same integers in every lane, so every
    product equals the AVX2 build's bit for bit, for one row (a decode step's loops) and many
    (a verification step's), with the hostile activations a peer may send and with Q8_0's -128
    weights (random blocks hold them: the one value whose |w| is 128)."""
    n, k = 37, width(type_name)
    raw = random_blocks(type_name, n, k, seed=9)
    code = kb.KERNEL_TYPES[type_name]
    assert lib.mi_supports_q8(code)
    for name in ("mi_matmul_q16", "mi_matmul_q8"):
        for m in (1, 3, 17):
            x = hostile_rows(m, k, seed=m)
            x[-1, -32:] = torch.tensor([-1.0, 1.0] * 16)  # a block of +-127 after rounding
            y_avx, y_vnni = torch.full((m, n), 7.0), torch.full((m, n), 7.0)
            assert getattr(lib, name)(code, raw.ctypes.data, n, k, x.data_ptr(), m, y_avx.data_ptr(), 2) == 0
            assert getattr(vnni, name)(code, raw.ctypes.data, n, k, x.data_ptr(), m, y_vnni.data_ptr(), 2) == 0
            assert same_bits(y_vnni, y_avx), f"{name}, {m} rows"
            assert y_avx.isfinite().any()


@pytest.mark.parametrize("march", ["icelake-server", "alderlake"])
def test_a_build_for_a_vnni_cpu_uses_the_vnni_instructions(tmp_path, march):
    """``-march=native`` on a CPU with AVX512-VNNI (as Ice Lake servers, ``icelake-server``) or
    AVX-VNNI (``alderlake``) builds the VNNI path: the compiler's assembly of the block kernels
    holds both instructions (this machine cannot run them; the test above checks their bits)."""
    import shutil
    import subprocess

    src = next(p for p in native.SOURCES if p.name == "gguf_blocks.c")
    flags = [f for f in native.CFLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    subprocess.run([shutil.which("cc"), *flags, f"-march={march}", "-S", str(src), "-o", str(tmp_path / "k.s")],
                   check=True, capture_output=True, timeout=native.BUILD_TIMEOUT_S)
    asm = (tmp_path / "k.s").read_text()
    assert "vpdpbusd" in asm and "vpdpwssd" in asm
    subprocess.run([shutil.which("cc"), *flags, "-march=haswell", "-S", str(src), "-o", str(tmp_path / "h.s")],
                   check=True, capture_output=True, timeout=native.BUILD_TIMEOUT_S)
    assert "vpdpbusd" not in (tmp_path / "h.s").read_text()  # AVX2 alone: maddubs + madd


def test_integer_activation_precisions_are_refused_without_their_kernels(tmp_path, monkeypatch):
    """Without the integer kernels gguf-a16 / gguf-a8 would multiply float32 activations and
    choose other tokens than their other peers: refused with the precision that does run; gguf
    itself falls back to the torch path with the same tokens."""
    from meshinfer.core.errors import InvalidInput

    path = _quantized_tiny(tmp_path, "qwen2")
    want = load_shard(path, dtype="gguf")(torch.tensor([[5, 70, 200]]), 0)
    monkeypatch.setenv("MESHINFER_NO_NATIVE", "1")
    native.library.cache_clear()
    try:
        for precision in ("gguf-a16", "gguf-a8"):
            with pytest.raises(InvalidInput, match=f"precision {precision} needs the gguf kernels' integer "
                                                   "dot products, and no C compiler built them; use --dtype gguf"):
                load_shard(path, dtype=precision)
        got = load_shard(path, dtype="gguf")(torch.tensor([[5, 70, 200]]), 0)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    finally:
        native.library.cache_clear()


def test_join_sizes_a_gguf_peer_by_memory():
    """``join`` without ``--layers`` sizes its range from free memory with bytes per weight by
    precision: the gguf precisions count at most Q8_0's 34 bytes per 32 weights."""
    from meshinfer.client.coverage import layers_that_fit
    from helpers.tiny import tiny_config

    cfg = tiny_config("qwen2", layers=4)
    for precision in ("gguf", "gguf-a16", "gguf-a8"):
        assert layers_that_fit(cfg, precision, 10 ** 9) >= 4
    assert layers_that_fit(cfg, "gguf-a16", 1) == 1


@pytest.mark.parametrize("refused", [("-fopenmp",), ("-fopenmp", "-march=native")])
def test_a_compiler_without_openmp_or_march_still_builds_the_kernels(monkeypatch, tmp_path, caplog, refused):
    """Apple's clang has no OpenMP: the kernels build without it (the block products then split
    their rows over POSIX threads), with one warning; a compiler that also refuses
    -march=native builds the portable path."""
    import shutil

    fake = tmp_path / "cc"
    checks = " ".join(f'[ "$a" = "{flag}" ] && exit 1;' for flag in refused)
    fake.write_text(f'#!/bin/sh\nfor a in "$@"; do {checks} done\nexec {shutil.which("cc")} "$@"\n')
    fake.chmod(0o755)
    full = native.library()  # what this CPU gets with every flag
    simd = full.mi_simd()
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("MESHINFER_HOME", str(tmp_path / "home"))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="meshinfer.kernels"):
            lib = native.library()
        assert lib is not None
        assert len(caplog.records) == 1 and "built without " + " ".join(refused) in caplog.records[0].getMessage()
        native.library.cache_clear()  # another process loading the built library: told again
        with caplog.at_level(logging.WARNING, logger="meshinfer.kernels"):
            assert native.library() is not None
        assert len(caplog.records) == 2 and caplog.records[0].getMessage() == caplog.records[1].getMessage()
        assert native.built_without(native.library_path(str(fake))) == refused
        assert lib.mi_simd() == (0 if "-march=native" in refused else simd)
        raw = random_blocks("Q5_0", 9, 64, seed=3)
        want = quants.dequantize(raw, G.Q5_0).reshape(9, 64).astype(np.float32)
        x, y = torch.randn(2, 64), torch.empty(2, 9)
        assert lib.mi_matmul(kb.KERNEL_TYPES["Q5_0"], raw.ctypes.data, 9, 64, x.data_ptr(), 2, y.data_ptr(), 2) == 0
        assert torch.allclose(y, x @ torch.from_numpy(want).T, rtol=1e-5, atol=1e-5)
        # 4096 x 8192 weights (gguf_blocks.c's POSIX_MIN_WEIGHTS) on 2 threads: without OpenMP
        # the rows go to POSIX threads, with the same bits
        n, k = 4096, 8192
        raw = random_blocks("Q5_0", n, k, seed=4)
        for m in (1, 3):
            x, y, ref = torch.randn(m, k), torch.empty(m, n), torch.empty(m, n)
            assert lib.mi_matmul_q8(kb.KERNEL_TYPES["Q5_0"], raw.ctypes.data, n, k, x.data_ptr(), m, y.data_ptr(), 2) == 0
            assert full.mi_matmul_q8(kb.KERNEL_TYPES["Q5_0"], raw.ctypes.data, n, k, x.data_ptr(), m, ref.data_ptr(),
                                     1) == 0
            if "-march=native" not in refused:
                assert torch.equal(y, ref)
            assert torch.allclose(y, ref, rtol=1e-2, atol=1e-2)
    finally:
        native.library.cache_clear()
