"""Quantized precisions: the int8 projection modules, shards at those precisions, the
converted-tensor cache, and that a route never mixes kernel families."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers.meshkit import generate_through, mesh, start_peer, wait_for_tables
from meshinfer.core.config import PRECISION_NAMES, LayerRange
from meshinfer.core.errors import InvalidInput, NoRoute
from meshinfer.engine.generate import greedy_generate, load_shard, parse_precision
from meshinfer.engine.models.quant import DENSE_MIN_ROWS, Int8Embedding, Int8Linear, quantize_int8
from meshinfer.client.mesh import MeshClient
from meshinfer.engine.weights import converted

QUANTIZED = ["q8-bf16"]
#: Documented tolerance of a quantized module against ``bf16(x) @ dequantized(W).T`` in float32:
#: the kernels round their output to bfloat16 (8 significant bits, relative error 2**-9) and
#: may sum in another order; 1% of the largest output covers both with room to spare.
MODULE_TOLERANCE = 1e-2
MESSAGES = [{"role": "user", "content": "hello there, tiny model"}]


def reference_matmul(module, x: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.bfloat16).float() @ module.dequantized().T  # (B, T, N)
    return y + module.bias if module.bias is not None else y


@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_dequantize_then_matmul(bias):
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(48, 96, generator=g), torch.randn(2, 5, 96, generator=g)  # (N, K), (B, T, C)
    m = Int8Linear(96, 48, bias)
    m.set_float_weight(w)
    if bias:
        m.bias = torch.randn(48, generator=g)
    y = m(x)
    ref = reference_matmul(m, x)
    assert y.shape == (2, 5, 48) and y.dtype == torch.float32
    assert (y - ref).abs().max() <= MODULE_TOLERANCE * ref.abs().max()
    # quantization itself: each weight within half a step of its row's scale
    assert ((m.dequantized() - w).abs() <= m.scales.float()[:, None] * 0.5 + 1e-6).all()


def test_many_rows_take_the_dense_path_and_agree_with_the_kernel(monkeypatch):
    """From DENSE_MIN_ROWS rows on, the weight is dequantized to bf16 for one dense matmul
    (prefill); below, the kernel runs. Both agree within the module tolerance."""
    g = torch.Generator().manual_seed(7)
    m = Int8Linear(256, 128, True)
    m.set_float_weight(torch.randn(m.out_features, m.in_features, generator=g))
    if m.bias is not None:
        m.bias = torch.randn(m.out_features, generator=g)
    x = torch.randn(1, DENSE_MIN_ROWS, m.in_features, generator=g)  # (B, T, K)
    dense = m(x)
    kernels = []
    real = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *a: kernels.append(a[0].shape[0]) or real(*a))
    small = torch.cat([m(x[:, :DENSE_MIN_ROWS // 2]), m(x[:, DENSE_MIN_ROWS // 2:])], dim=1)  # below: kernels
    assert kernels == [DENSE_MIN_ROWS // 2] * 2
    kernels.clear()
    again = m(x)
    assert kernels == []
    assert torch.equal(again, dense)
    ref = reference_matmul(m, x)
    for y in (dense, small):
        assert y.shape == (1, DENSE_MIN_ROWS, m.out_features)
        assert (y - ref).abs().max() <= MODULE_TOLERANCE * ref.abs().max()


@pytest.mark.parametrize("native", [True, False], ids=["bf16-hardware", "no-bf16-hardware"])
def test_the_dense_path_runs_in_f32_where_the_cpu_has_no_bf16_matmul(native, monkeypatch):
    """Without bf16 hardware the dense path multiplies the same bf16 values in f32 (software bf16
    GEMM is 5x slower there); with it, one bf16 matmul. Both give the bf16 product: they differ
    only by summation order and the final rounding to bf16 (2^-8 relative)."""
    from meshinfer.engine.models import quant

    g = torch.Generator().manual_seed(5)
    m = Int8Linear(256, 96, False)
    m.set_float_weight(torch.randn(96, 256, generator=g))
    x = torch.randn(DENSE_MIN_ROWS, 256, generator=g)
    monkeypatch.setattr(quant, "native_bf16_matmul", lambda: native)
    y = m(x)
    xb, wb = x.bfloat16(), m.dense_weight(0, 96)  # the values both paths multiply
    f32_path = torch.nn.functional.linear(xb.float(), wb.float()).bfloat16().float()
    if native:
        assert torch.equal(y, torch.nn.functional.linear(xb, wb).float())
    else:
        assert torch.equal(y, f32_path)
    assert (y - f32_path).abs().max() <= 2 ** -7 * f32_path.abs().max()


def test_the_dense_path_dequantizes_a_large_weight_in_row_chunks(monkeypatch):
    """The output head (151,936 rows) must not be dequantized at once (272 MB in bf16)."""
    from meshinfer.engine.models import quant

    m = Int8Linear(128, 320, False)
    m.set_float_weight(torch.randn(320, 128, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(DENSE_MIN_ROWS, 128, generator=torch.Generator().manual_seed(4))
    whole = m(x)
    monkeypatch.setattr(quant, "QUANT_ROWS_PER_CHUNK", 128)  # 320 rows: chunks of 128, 128, 64
    spans = []
    real = m.dense_weight
    monkeypatch.setattr(m, "dense_weight", lambda a, b: spans.append((a, b)) or real(a, b))
    chunked = m(x)
    assert spans == [(0, 128), (128, 256), (256, 320)]
    assert (chunked - whole).abs().max() <= 1e-2 * whole.abs().max()


def test_int8_embedding_rows():
    w = torch.randn(10, 8)
    e = Int8Embedding(10, 8, torch.float32)
    e.set_float_weight(w)
    q, s = quantize_int8(w)
    ids = torch.tensor([[3, 0, 9]])
    assert torch.allclose(e(ids), (q.float() * s[:, None])[ids])


def test_unknown_precision_lists_every_choice():
    with pytest.raises(InvalidInput) as err:
        parse_precision("q3")
    assert str(err.value) == f"precision 'q3' is not one of {', '.join(PRECISION_NAMES)}"
    with pytest.raises(InvalidInput, match="precision 'q4-g32-bf16' is not one of"):
        parse_precision("q4-g32-bf16")  # removed on 2026-12-02 (gguf-a16 beat it on speed and fidelity)


def test_quantized_precision_is_cpu_only(tiny):
    with pytest.raises(InvalidInput, match="q8-bf16 uses CPU kernels"):
        load_shard(tiny[0], dtype="q8-bf16", device="meta")


def test_the_torch_free_list_of_cpu_only_precisions_is_the_quantized_ones():
    """``core.config.CPU_ONLY_PRECISIONS`` lets join and generate refuse --device cuda before
    torch loads; it must name exactly the precisions ``Precision.quantized`` says."""
    from meshinfer.core.config import CPU_ONLY_PRECISIONS

    assert {n for n in PRECISION_NAMES if parse_precision(n).quantized} == CPU_ONLY_PRECISIONS


def test_a_quantized_peer_on_cuda_is_refused_before_cuda_is_looked_at(tiny):
    """A CPU-only torch would otherwise answer 'install a CUDA build' first (a new user's run)."""
    import asyncio

    from meshinfer.peer.launch import launch_peer

    with pytest.raises(InvalidInput, match="gguf-a8 uses CPU kernels; use f32/bf16/f16 on cuda, or --device cpu"):
        asyncio.run(launch_peer(str(tiny[0]), None, device="cuda", dtype="gguf-a8"))


@pytest.mark.parametrize("precision", QUANTIZED)
def test_quantized_shards_chain_like_the_whole_model(tiny, precision):
    path, _, tok, _ = tiny
    whole = load_shard(path, dtype=precision)
    assert whole.dtype == torch.float32 and isinstance(whole.layers["0"].mlp.up_proj, Int8Linear)
    a, b = load_shard(path, LayerRange(0, 2), dtype=precision), load_shard(path, LayerRange(2, 4), dtype=precision)
    ids = torch.tensor([tok.encode_chat(MESSAGES)])  # (1, T)
    assert torch.equal(b(a(ids, 0), 0, logits="all"), whole(ids, 0, logits="all"))  # (1, T, V)


def test_conversion_cache_round_trips_and_rebuilds_a_corrupt_file(tiny, tmp_path, caplog):
    path, digest, _, _ = tiny
    first = load_shard(path, dtype="q8-bf16", cache_dir=tmp_path)
    files = sorted(p.name for p in (tmp_path / digest / "q8-bf16").iterdir())
    assert files == ["embed.safetensors", "head.safetensors"] + [f"layer-{i}.safetensors" for i in range(4)]
    layer1 = converted.unit_path(tmp_path, digest, "q8-bf16", "layer-1")
    written = layer1.stat().st_mtime_ns
    again = load_shard(path, dtype="q8-bf16", cache_dir=tmp_path)
    assert layer1.stat().st_mtime_ns == written  # read, not rewritten
    state = first.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in again.state_dict().items()) and again.state_dict().keys() == state.keys()
    # the kernels need aligned storage (views into the safetensors buffer crashed them)
    assert all(v.data_ptr() % 64 == 0 for v in again.state_dict().values())
    ids = torch.tensor([[5, 6, 7]])
    assert torch.equal(again(ids, 0), first(ids, 0))

    data = bytearray(layer1.read_bytes())
    data[-3] ^= 0xFF  # one byte of the last tensor's payload
    layer1.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="meshinfer.engine.weights.converted"):
        rebuilt = load_shard(path, dtype="q8-bf16", cache_dir=tmp_path)
    assert f"converted cache {layer1} is corrupt (digest mismatch); rebuilding" in caplog.text
    assert all(torch.equal(v, state[k]) for k, v in rebuilt.state_dict().items())
    assert converted.read_unit(layer1, converted.unit_meta(digest, "q8-bf16")) is not None  # rewritten


def test_conversion_cache_is_keyed_by_layer_units(tiny, tmp_path):
    path, digest, tok, whole = tiny
    load_shard(path, LayerRange(2, 4), dtype="q8-bf16", cache_dir=tmp_path)
    names = sorted(p.name for p in (tmp_path / digest / "q8-bf16").iterdir())
    assert names == ["head.safetensors", "layer-2.safetensors", "layer-3.safetensors"]
    truncated = converted.unit_path(tmp_path, digest, "q8-bf16", "head")
    truncated.write_bytes(truncated.read_bytes()[:100])
    assert converted.read_unit(truncated, converted.unit_meta(digest, "q8-bf16")) is None


async def test_a_route_never_mixes_kernel_families(tiny):
    path, digest, tok, _ = tiny
    bundle = tok.to_bundle()
    first = await start_peer(load_shard(path, LayerRange(0, 2), dtype="q8-bf16"), weights_hash=digest,
                             precision="q8-bf16", bundle=bundle)
    other = await start_peer(load_shard(path, LayerRange(2, 4), dtype="gguf-a16"), weights_hash=digest,
                             precision="gguf-a16", bootstrap=first.addrs)
    try:
        await wait_for_tables([first, other])
        async with MeshClient(list(first.addrs)) as client:
            with pytest.raises(NoRoute) as err:
                await client.plan()
        assert "q8-bf16" in str(err.value) and "gguf-a16" in str(err.value)
        same = await start_peer(load_shard(path, LayerRange(2, 4), dtype="q8-bf16"), weights_hash=digest,
                                precision="q8-bf16", bootstrap=first.addrs)
        try:
            await wait_for_tables([first, other, same])
            route, ids, out = await generate_through([first], tok, MESSAGES)
            assert route.peer_ids == (first.peer_id, same.peer_id)
            want = greedy_generate(load_shard(path, dtype="q8-bf16"), ids, max_tokens=8).token_ids
            assert out.token_ids == want
        finally:
            await same.close()
    finally:
        await other.close()
        await first.close()


async def test_quantized_mesh_equals_single_process(tiny):
    path, digest, tok, _ = tiny
    shards = [load_shard(path, r, dtype="q8-bf16") for r in (LayerRange(0, 2), LayerRange(2, 4))]
    async with mesh(shards, weights_hash=digest, bundle=tok.to_bundle(), precision="q8-bf16") as peers:
        route, ids, out = await generate_through(peers, tok, MESSAGES)
    assert all(h.peer.precision == "q8-bf16" for h in route.hops)
    assert out.token_ids == greedy_generate(load_shard(path, dtype="q8-bf16"), ids, max_tokens=8).token_ids


@pytest.mark.parametrize("make", [lambda: Int8Linear(64, 160, False), lambda: Int8Embedding(160, 64, torch.float32)],
                         ids=["int8", "embedding"])
def test_quantizing_in_row_chunks_equals_quantizing_at_once(make, monkeypatch):
    from meshinfer.engine.models import quant

    w = torch.randn(160, 64)
    whole = make()
    whole.set_float_weight(w)
    monkeypatch.setattr(quant, "QUANT_ROWS_PER_CHUNK", 64)  # 160 rows: chunks of 64, 64, 32
    chunked = make()
    chunked.set_float_weight(w)
    assert whole.state_dict().keys() == chunked.state_dict().keys()
    assert all(torch.equal(v, chunked.state_dict()[k]) for k, v in whole.state_dict().items())


def test_an_unwritable_conversion_cache_only_costs_time(tiny, tmp_path, caplog):
    path, _, _, _ = tiny
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING, logger="meshinfer.engine.generate"):
        shard = load_shard(path, dtype="q8-bf16", cache_dir=blocker)
    assert "could not write the converted cache under" in caplog.text
    assert torch.equal(shard(torch.tensor([[1, 2, 3]]), 0), load_shard(path, dtype="q8-bf16")(torch.tensor([[1, 2, 3]]), 0))


@pytest.mark.parametrize("long", [False, True], ids=["short", "dense-prefill"])
@pytest.mark.parametrize("precision", QUANTIZED)
def test_spot_check_tolerance_covers_one_shot_vs_token_by_token(tiny, precision, long):
    """A hop's output must not depend on how its positions were split into steps beyond the
    spot-check tolerance; a long prompt (DENSE_MIN_ROWS tokens or more) prefills through the
    dense bf16 path, its decode steps through the kernels."""
    from meshinfer.client.spotcheck import TOLERANCE
    from meshinfer.engine.generate import new_cache

    path, _, tok, _ = tiny
    a = load_shard(path, LayerRange(0, 2), dtype=precision)
    ids = tok.encode_chat(MESSAGES)
    ids = torch.tensor([(ids * (DENSE_MIN_ROWS // len(ids) + 1))[:DENSE_MIN_ROWS + 8] if long else ids])  # (1, T)
    one_shot = a(ids, 0)  # (1, T, C)
    cache = new_cache(a)
    steps = torch.cat([a(ids[:, t:t + 1], t, cache) for t in range(ids.shape[1])], dim=1)  # (1, T, C)
    err = ((steps - one_shot).norm() / one_shot.norm()).item()
    # the dense path rounds the dequantized weights to bf16: measured 6e-3 to 9e-3 here (random
    # weights), 2.4e-3 (q8) on a 12-layer hop of the default model
    margin = 5 if long else 10
    assert err < TOLERANCE[precision] / margin, f"{precision}: one-shot vs token-by-token relative L2 {err:.2e}"
