"""The C step operations (RMSNorm, RoPE, attention, SwiGLU) against their torch definitions.

``engine/kernels/step_ops.py`` claims: RoPE equal to torch's operations bit for bit; RMSNorm,
attention and SwiGLU equal up to summation order / exp's last bit; each row (query) computed
alone, so a verification step gives each position what a one-position step gives it; the
portable build (no AVX2) gives the AVX2 build's bits.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from meshinfer.engine.kernels import native, step_ops
from meshinfer.engine.models import common



def test_the_library_is_built():
    assert native.library() is not None, "the C kernels did not build: deploy/install.sh needs cc"


def torch_rope(x, cos, sin):
    """common.apply_rope's torch operations (the definition)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((torch_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = r // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def torch_attention(q, k, v, start, window=0):
    """Causal GQA attention with an explicit mask, through torch's SDPA."""
    T, S = q.shape[2], k.shape[2]
    qpos = start + torch.arange(T)[:, None]
    kpos = torch.arange(S)[None, :]
    mask = kpos <= qpos
    if window:
        mask &= kpos > qpos - window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("rotary", [64, 32])
def test_rope_equals_the_torch_operations_bit_for_bit(rotary):
    torch.manual_seed(0)
    B, T, H, D = 2, 5, 14, 64
    x = torch.randn(B, T, H, D).transpose(1, 2)  # (B, H, T, D), as the projections leave q
    cos, sin = common.rope_cos_sin(torch.arange(7, 7 + T), rotary, 1e6, torch.float32)
    got = step_ops.rope(x, cos, sin)
    assert got is not None and got.shape == (B, H, T, D)
    assert torch.equal(got, torch_rope(x, cos, sin))


def test_rope_declines_layouts_and_dtypes_it_does_not_take():
    x = torch.randn(1, 4, 3, 8)  # (B, H, T, D) contiguous: not a transposed (B, T, H, D)
    cos, sin = common.rope_cos_sin(torch.arange(3), 8, 1e4, torch.float32)
    assert step_ops.rope(x, cos, sin) is None
    assert step_ops.rope(x.transpose(1, 2).contiguous().transpose(1, 2).double(), cos.double(), sin.double()) is None
    # and common.apply_rope then computes it with torch
    assert torch.equal(common.apply_rope(x, cos, sin), torch_rope(x, cos, sin))


def test_rms_norm_matches_the_float32_formula():
    torch.manual_seed(1)
    x, w = torch.randn(3, 7, 896) * 5, torch.randn(896)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    got = step_ops.rms_norm(x, w, 1e-6)
    assert got is not None and got.shape == x.shape
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    assert step_ops.rms_norm(x.double(), w.double(), 1e-6) is None


@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("T", [1, 9])
def test_attention_matches_sdpa_over_cache_views(T, window):
    torch.manual_seed(2)
    B, H, Hkv, D, start = 2, 14, 2, 64, 23
    q = torch.randn(B, T, H, D).transpose(1, 2)
    cache_k, cache_v = torch.randn(B, Hkv, 64, D), torch.randn(B, Hkv, 64, D)  # capacity 64, as KVCache grows
    k, v = cache_k[:, :, :start + T], cache_v[:, :, :start + T]  # strided views
    got = step_ops.attention(q, k, v, start, window=window)
    assert got is not None and got.shape == (B, H, T, D)
    assert torch.allclose(got, torch_attention(q, k, v, start, window), rtol=1e-5, atol=1e-6)


def test_each_query_of_a_verification_step_equals_its_own_one_position_step():
    torch.manual_seed(3)
    B, H, Hkv, D, start, T = 1, 8, 2, 32, 40, 17
    q = torch.randn(B, T, H, D).transpose(1, 2)
    k, v = torch.randn(B, Hkv, start + T, D), torch.randn(B, Hkv, start + T, D)
    whole = step_ops.attention(q, k, v, start)
    for t in range(T):
        one = step_ops.attention(q[:, :, t:t + 1], k[:, :, :start + t + 1], v[:, :, :start + t + 1], start + t)
        assert torch.equal(one[:, :, 0], whole[:, :, t]), f"position {start + t}"


def test_attention_declines_long_passes_and_bad_sizes():
    q = torch.randn(1, 2, step_ops.ATTENTION_MAX_QUERIES + 1, 8)
    k = v = torch.randn(1, 2, q.shape[2], 8)
    assert step_ops.attention(q, k, v, 0) is None  # a prefill: torch's SDPA
    q1 = torch.randn(1, 2, 1, 8)
    assert step_ops.attention(q1, k, v, 0) is None  # S != start + T
    assert step_ops.attention(torch.randn(1, 3, 1, 8), k[:, :, :1], v[:, :, :1], 0) is None  # 3 heads over 2
    # causal_attention still answers through torch
    assert torch.allclose(common.causal_attention(q, k, v, 0), torch_attention(q, k, v, 0), atol=1e-6)


def test_a_nan_query_gives_nan_for_that_query_only():
    q = torch.randn(1, 2, 3, 8)
    q[0, 1, 2, 0] = float("nan")
    k = v = torch.randn(1, 2, 3, 8)
    out = step_ops.attention(q, k, v, 0)
    assert out[0, 1, 2].isnan().all()
    out[0, 1, 2] = 0
    assert not out.isnan().any()


def test_swiglu_matches_silu_times_up():
    torch.manual_seed(4)
    g, u = torch.randn(3, 4864) * 4, torch.randn(3, 4864)
    got = step_ops.swiglu(g, u)
    assert got is not None
    assert torch.allclose(got, F.silu(g) * u, rtol=1e-6, atol=1e-7)
    too_many = step_ops.SWIGLU_MAX_ROWS + 1
    assert step_ops.swiglu(torch.randn(too_many, 8), torch.randn(too_many, 8)) is None
    assert torch.allclose(common.swiglu(g.view(1, 3, -1), u.view(1, 3, -1)), (F.silu(g) * u).view(1, 3, -1),
                          rtol=1e-6, atol=1e-7)


def test_the_portable_build_computes_the_same_bits(tmp_path):
    """Built without ``-march`` (no AVX2: an Arm Mac, or a compiler that refuses the flag), the
    step operations take their scalar paths, which mirror the AVX2 ones (8 lanes of fmaf summed
    in the same order): RMSNorm, RoPE, attention and SwiGLU give the AVX2 build's bits, and
    argmax its index."""
    import ctypes

    from helpers.portable import portable_library

    lib, plib = native.library(), portable_library(tmp_path)
    torch.manual_seed(5)
    x, w = torch.randn(2, 3, 64) * 3, torch.randn(64)
    ys = []
    for kernels in (lib, plib):
        ys.append(torch.empty_like(x))
        assert kernels.mi_rmsnorm(x.data_ptr(), 6, 64, w.data_ptr(), ctypes.c_float(1e-6), ys[-1].data_ptr()) == 0
    assert torch.equal(ys[0], ys[1])
    assert torch.allclose(ys[1], step_ops.rms_norm(x, w, 1e-6), rtol=1e-6, atol=1e-6)
    q = torch.randn(1, 3, 4, 16)  # (B, T, H, D) contiguous
    cos, sin = common.rope_cos_sin(torch.arange(3), 16, 1e4, torch.float32)
    r = torch.empty_like(q)
    assert plib.mi_rope(q.data_ptr(), 3, 4, 16, 3, cos.data_ptr(), sin.data_ptr(), 16, r.data_ptr()) == 0
    assert torch.equal(r.transpose(1, 2), torch_rope(q.transpose(1, 2), cos, sin))
    qh = q.transpose(1, 2)  # (1, 4, 3, 16)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in (qh, k, v)]
    atts = []
    for kernels in (lib, plib):
        atts.append(torch.empty(1, 4, 3, 16))
        assert kernels.mi_attention(qh.data_ptr(), strides[0], k.data_ptr(), strides[1], v.data_ptr(), strides[2],
                                    1, 4, 2, 3, 40, 16, 37, 0, ctypes.c_float(0.25), atts[-1].data_ptr(), 1) == 0
    assert torch.equal(atts[0], atts[1])
    assert torch.allclose(atts[1], torch_attention(qh, k, v, 37), rtol=1e-5, atol=1e-6)
    g, u = torch.randn(3, 4864) * 4, torch.randn(3, 4864)
    outs = []
    for kernels in (lib, plib):
        outs.append(torch.empty_like(g))
        kernels.mi_swiglu(g.data_ptr(), u.data_ptr(), g.numel(), outs[-1].data_ptr())
    assert torch.equal(outs[0], outs[1])
    for values in (torch.randn(1001), torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([3.0, -1.0, 3.0])):
        want = int(values.argmax())  # argmax: the same index without AVX2 (its scalar tail only)
        assert lib.mi_argmax(values.data_ptr(), values.numel()) == plib.mi_argmax(values.data_ptr(), values.numel()) == want


def test_swiglu_takes_every_pass_below_the_dense_path():
    """So that a batched pass's rows get their solo bits wherever the products do."""
    from meshinfer.engine.models.gguf_linear import DENSE_MIN_ROWS
    assert step_ops.SWIGLU_MAX_ROWS == DENSE_MIN_ROWS - 1


def test_a_packed_pass_takes_swiglu_in_c_at_any_row_count():
    rows = step_ops.SWIGLU_MAX_ROWS + 40
    g, u = torch.randn(rows, 64), torch.randn(rows, 64)
    assert step_ops.swiglu(g, u) is None and not step_ops.in_packed_pass()
    with step_ops.packed_pass():
        assert step_ops.in_packed_pass()
        got = step_ops.swiglu(g, u)
    assert not step_ops.in_packed_pass()
    assert got is not None and torch.equal(got[3:4], step_ops.swiglu(g[3:4], u[3:4]))  # a row's own bits


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [0, 151935, 77777])
def test_all_finite_finds_one_bad_value_anywhere_in_a_step_of_logits(bad, where):
    x = torch.randn(1, 1, 151936)
    assert step_ops.all_finite(x)
    x[0, 0, where] = bad
    assert not step_ops.all_finite(x)
    assert not step_ops.all_finite(x[0, 0, ::7])  # a strided view (each `where` is a multiple of 7)


def test_all_finite_takes_the_float32_extremes_and_other_dtypes():
    assert step_ops.all_finite(torch.tensor([3.4028235e38, -3.4028235e38, 1e-45, -0.0]))
    assert not step_ops.all_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64))  # torch's path
    assert step_ops.all_finite(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert step_ops.all_finite(torch.empty(0))


@pytest.mark.parametrize("seed", range(4))
def test_argmax_equals_torch_argmax_on_a_step_of_logits(seed):
    x = torch.randn(151936, generator=torch.Generator().manual_seed(seed))
    assert step_ops.argmax(x) == int(x.argmax())
    x[[5, 90000, 151935]] = x.max() + 1  # ties: the lowest index
    assert step_ops.argmax(x) == 5 == int(x.argmax())
    assert step_ops.argmax(x[::3]) == int(x[::3].argmax())  # a strided view


def test_argmax_follows_torch_on_nan_infinities_and_other_dtypes():
    cases = [
        [1.0, float("nan"), 3.0, float("nan")],  # the first NaN wins, as torch orders NaN above all
        [float("-inf"), float("-inf")],
        [-1.0, float("inf"), float("inf")],
        [-0.0, 0.0],  # equal: the first
        [7.0],
    ]
    for values in cases:
        x = torch.tensor(values)
        assert step_ops.argmax(x) == int(x.argmax()), values
    for dtype in (torch.bfloat16, torch.float64):  # torch's path
        x = torch.tensor([1.0, 4.0, 4.0, 2.0], dtype=dtype)
        assert step_ops.argmax(x) == 1
    for bad in (torch.empty(0), torch.zeros(2, 3)):
        with pytest.raises(ValueError):
            step_ops.argmax(bad)


def test_swiglu_over_its_gate_gives_the_same_bits():
    """A prefill's MLP computes SwiGLU in its gate's memory (``overwrite_gate``): the same values
    as the out-of-place product, in the gate tensor itself; a step of a few rows still takes C."""
    rows = step_ops.SWIGLU_MAX_ROWS + 40  # torch's path
    g, u = torch.randn(rows, 4864) * 4, torch.randn(rows, 4864)
    want = common.swiglu(g, u)
    gate = g.clone()
    got = common.swiglu(gate, u, overwrite_gate=True)
    assert torch.equal(got, want) and got.data_ptr() == gate.data_ptr()
    few = g[:3].clone()
    assert torch.equal(common.swiglu(few, u[:3], overwrite_gate=True), common.swiglu(g[:3], u[:3]))
