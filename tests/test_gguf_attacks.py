"""Attacks on the gguf precisions (docs/security.md, attack table): hostile activation values at
the C kernels (NaN, inf, 1e38, subnormal blocks, zeros) stay in their own row and never reach
C's undefined float-to-int conversion; a conversation's result does not depend on how many rows
other conversations pack into its pass (the dense path rounds activations as the kernels do);
a live gguf-a8 peer refuses non-finite hidden states and keeps serving."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from gguf import GGMLQuantizationType as G

from helpers.batching import new_cache
from helpers.hostile import Raw, f32, rogue_advert
from helpers.meshkit import file_hash, generate_through, mesh, split
from meshinfer.engine.generate import greedy_generate, load_shard
from meshinfer.engine.kernels import blocks as kb, native
from meshinfer.engine.models.gguf_linear import DENSE_MIN_ROWS, GGUFLinear
from meshinfer.wire import tensors
from test_gguf_kernels import blocks_of, width

#: Types with an integer-activation kernel (F16 and F32 rows multiply float32 activations).
INT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"]
#: Largest relative difference between a row computed alone (block kernel) and packed with
#: other rows into a dense pass: float32 summation order only (measured about 3e-7; the int8
#: kernel against float32 activations differs by about 5e-3).
PACKED_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def lib():
    lib = native.library()
    assert lib is not None, "the gguf kernels did not build (is there a C compiler?)"
    return lib


def hostile_rows(k: int) -> dict[str, torch.Tensor]:
    """One ``(1, k)`` row per hostile pattern; every other column 0 (so a 0 * inf NaN appears)."""
    rows = {}
    for name, val in [("nan", math.nan), ("inf", math.inf), ("-inf", -math.inf), ("1e38", 1e38),
                      ("subnormal", 1e-40), ("zeros", 0.0)]:
        r = torch.full((1, k), val)
        r[0, 1::2] = 0.0
        rows[name] = r
    mixed = torch.randn(1, k) * 1e3  # a plausible hidden row: one block subnormal, the rest large
    mixed[0, 32:64] = torch.randn(32) * 1e-40
    rows["mixed"] = mixed
    return rows


@pytest.mark.parametrize("act_bits", [32, 16, 8])
@pytest.mark.parametrize("type_name", INT_TYPES)
def test_hostile_activation_values_stay_in_their_own_row(lib, type_name, act_bits):
    """Packed next to a victim row, a hostile row leaves the victim's result bit for bit as
    alone; NaN or inf in gives a non-finite result (the step is then refused, never a token)
    at every activation mode, where the integer modes used to turn NaN into a finite 0."""
    k = width(type_name)
    w = blocks_of(type_name, 48, k, seed=11)
    victim = torch.randn(1, k, generator=torch.Generator().manual_seed(12))
    alone = kb.matmul(victim, w, act_bits=act_bits)[0]
    for name, row in hostile_rows(k).items():
        for x, at in ((torch.cat([row, victim]), 1), (torch.cat([victim, row, row]), 0)):
            y = kb.matmul(x, w, act_bits=act_bits)
            assert torch.equal(y[at], alone), f"{name}: the victim's row changed"
        got = kb.matmul(row, w, act_bits=act_bits)[0]
        if name in ("nan", "inf", "-inf"):
            assert not bool(torch.isfinite(got).all()), f"{name} in, finite out"
        elif name in ("subnormal", "zeros"):
            assert bool(torch.isfinite(got).all()) and float(got.abs().max()) < 1e-30, name
        elif name == "mixed":
            want = row.double() @ kb.dequantize(w).double().T
            err = float((got.double() - want[0]).abs().max() / want.abs().max())
            assert err <= {32: 1e-5, 16: 2e-4, 8: 3e-2}[act_bits], f"mixed row: relative error {err:.2e}"


@pytest.mark.parametrize("bits", [16, 8])
def test_quantized_activations_round_as_the_kernels_do(lib, bits):
    """The dense path's rounding (``quantize_activations``) against the kernel's, through
    the product: equal up to float32 summation order, with ties (x = 0.5 dx), subnormal blocks
    and zero blocks among the values."""
    w = blocks_of("Q8_0", 40, 896, seed=13)
    x = torch.randn(5, 896, generator=torch.Generator().manual_seed(14))
    lim = 127.0 if bits == 8 else 32767.0
    x[0, :32] = torch.arange(32) * 0.5 / lim  # amax 15.5 / lim: ties at every odd multiple
    x[1, 32:64] = 1e-40
    x[2, 64:96] = 0.0
    dense = kb.quantize_activations(x, bits) @ kb.dequantize(w).T
    kernel = kb.matmul(x, w, act_bits=bits)
    assert torch.allclose(kernel, dense, rtol=1e-5, atol=1e-5 * float(dense.abs().max()))


@pytest.mark.parametrize("act_bits", [32, 16, 8])
@pytest.mark.parametrize("type_name", INT_TYPES)
def test_a_rows_result_does_not_depend_on_how_many_rows_share_its_pass(lib, type_name, act_bits):
    """Other conversations' steps packed into one batched pass decide whether it reaches
    DENSE_MIN_ROWS rows (the dense path); a victim's decode row must come out the same either
    way (before: float32 activations on the dense path, so at gguf-a8 a stranger's 47 rows
    moved the victim's logits by about 0.5%)."""
    k = width(type_name)
    lin = GGUFLinear(k, 64, bias=False, act_bits=act_bits)
    lin.set_blocks(blocks_of(type_name, 64, k, seed=15))
    g = torch.Generator().manual_seed(16)
    victim = torch.randn(1, k, generator=g)
    others = torch.randn(DENSE_MIN_ROWS - 1, k, generator=g) * 1e3
    alone, packed = lin(victim)[0], lin(torch.cat([victim, others]))[0]
    err = float((alone - packed).abs().max() / alone.abs().max())
    assert err <= PACKED_REL_TOL, f"{type_name} a{act_bits}: the victim's row moved by {err:.2e}"


def test_blocks_that_are_not_one_contiguous_buffer_are_refused():
    """The kernels read N * row_bytes bytes from the first: an expanded (stride 0) view of one
    row would make them read memory the tensor does not own."""
    row = torch.zeros(1, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="are not rows of 32 weights"):
        kb.QuantBlocks(kb.KERNEL_TYPES["Q8_0"], row.expand(1000, 34), 32)
    with pytest.raises(ValueError, match="are not rows of 32 weights"):
        kb.QuantBlocks(kb.KERNEL_TYPES["Q8_0"], torch.zeros(8, 68, dtype=torch.uint8)[:, ::2], 32)


def test_dequantizing_past_the_last_row_gives_the_rows_there_are(lib):
    w = blocks_of("Q8_0", 5, 64, seed=17)
    assert torch.equal(kb.dequantize(w, 3, 1000), kb.dequantize(w)[3:])
    assert kb.dequantize(w, 7, 9).shape == (0, 64)


def test_a_broken_library_at_the_cache_path_is_built_again(monkeypatch, tmp_path, lib):
    """A short or garbage file where the library belongs (a crash after an unsynced rename, or a
    stray write) is rebuilt on load, not kept as a reason to compute through torch forever."""
    monkeypatch.setenv("MESHINFER_HOME", str(tmp_path))
    path = native.library_path(native._compiler())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF" + b"\0" * 60)  # an ELF header cut short
    native.library.cache_clear()
    try:
        rebuilt = native.library()
        assert rebuilt is not None and rebuilt.mi_supports(kb.KERNEL_TYPES["Q8_0"]) == 1
        assert path.stat().st_size > 1000
        assert not [p for p in path.parent.iterdir() if p != path], "a temporary file was left behind"
    finally:
        native.library.cache_clear()


# ------------------------------------------------------------------ tiny quantized models
def _quantized_tiny(directory):
    from helpers.tiny import random_weights, tiny_config, write_gguf

    cfg = tiny_config("qwen2")
    kinds = {"q_proj": G.Q8_0, "k_proj": G.Q5_0, "v_proj": G.Q4_0, "o_proj": G.Q4_1, "gate_proj": G.Q5_0,
             "up_proj": G.Q8_0, "down_proj": G.Q4_1, "embed_tokens": G.Q8_0, "lm_head": G.Q8_0}

    def quantize(name: str):
        return next((q for part, q in kinds.items() if f"{part}.weight" in name), None)
    return write_gguf(directory / "tiny-q.gguf", cfg, random_weights(cfg, seed=7), quantize=quantize)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return _quantized_tiny(tmp_path_factory.mktemp("tiny-q"))


@pytest.mark.parametrize("precision", ["gguf-a16", "gguf-a8"])
def test_a_victims_logits_do_not_depend_on_strangers_packed_into_its_pass(lib, quantized, precision):
    """A real shard at an integer-activation precision: one victim decode step batched with six
    strangers' 8-token steps (49 rows, the dense path) gives the victim the logits and the
    token of the same step run alone (the block kernel)."""
    shard = load_shard(quantized, dtype=precision)
    prompts = [[5, 70, 200, 31]] + [[i + 1] * 9 for i in range(6)]
    caches = [new_cache(shard, shard.range) for _ in prompts]
    for p, c in zip(prompts, caches):
        shard(torch.tensor([p]), 0, c)
    batch = copy.deepcopy(caches)
    alone = shard(torch.tensor([[9]]), caches[0].length, caches[0], logits="last")[0, -1]
    steps = [[9]] + [[(13 * i + j) % 250 for j in range(8)] for i in range(6)]
    assert sum(map(len, steps)) >= DENSE_MIN_ROWS
    packed = shard.forward_batch([torch.tensor([s]) for s in steps], [c.length for c in batch], batch)[0][0, -1]
    err = float((alone - packed).abs().max() / alone.abs().max())
    assert err <= 1e-4, f"{precision}: the victim's logits moved by {err:.2e} next to strangers"
    assert int(alone.argmax()) == int(packed.argmax())


@pytest.mark.parametrize("bad", [math.nan, math.inf, 1e38, 1e-40], ids=["nan", "inf", "1e38", "subnormal"])
async def test_a_gguf_a8_peer_answers_hostile_hidden_states_and_keeps_serving(lib, quantized, bad):
    """A stranger that opened a conversation at layers 2-4 of a gguf-a8 peer sends it hidden
    states holding NaN / inf (refused: the output is non-finite, never a token), 1e38 or
    subnormals (its own conversation's garbage: an answer, no crash, no undefined conversion);
    then the same conversation works and an honest conversation through the mesh gets the
    whole gguf-a8 model's tokens."""
    from meshinfer.text.tokenizer import Tokenizer

    digest, tok = file_hash(quantized), Tokenizer.from_gguf(quantized)
    shards = split(lambda r: load_shard(quantized, r, dtype="gguf-a8"), [0, 2, 4])
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), precision="gguf-a8") as peers:
        peer = peers[1]
        ad = rogue_advert(digest)
        raw = await Raw.connect(peer, role="peer", advert=ad)
        try:
            await raw.request("open", conv="x", layers=[2, 4], max_tokens=16, prev=ad["peer_id"])
            h = torch.randn(1, 3, shards[0].cfg.hidden_size)
            h[0, 1, 5:] = bad
            await raw.send("step", conv="x", seq=1, start=0, hidden=tensors.tensor_to_wire(h, "f32"), want="token")
            reply = await raw.recv()
            if math.isfinite(bad):
                assert (reply["t"], reply["seq"]) == ("token", 1), reply
            else:
                assert (reply["t"], reply["seq"], reply["code"]) == ("error", 1, "invalid_input"), reply
                await raw.send("step", conv="x", seq=2, start=0, hidden=f32(torch.randn(1, 3, h.shape[2])), want="token")
                assert (await raw.recv())["t"] == "token"
        finally:
            await raw.close()
        _, ids, out = await generate_through(peers, tok, [{"role": "user", "content": "hi"}], request_timeout_s=10.0)
        whole = load_shard(quantized, dtype="gguf-a8")
        assert out.token_ids == greedy_generate(whole, ids, max_tokens=8, eos_ids=()).token_ids
