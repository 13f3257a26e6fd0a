"""Each model family against transformers' own implementation, from GGUF and from a Hugging
Face directory: whole and split at every layer boundary, prefill and step by step (f32, within
1e-4 relative); bf16 and int8 close; batched passes equal single ones (MoE: each expert runs
once per batch); a 2-peer mesh gives generate's tokens; unsupported architectures refused at
load time with the supported list.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from meshinfer.core.config import SUPPORTED_ARCHITECTURES, LayerRange
from meshinfer.core.errors import WeightsError
from meshinfer.engine.generate import greedy_generate, load_shard, new_cache

from helpers import hf_families as hff  # needs transformers (the test extra)
from helpers.hf_families import rel, run_chain

PROMPT = [5, 17, 200, 33, 104, 101, 7, 128, 259]  # ends with a special token
FOLLOW = [44, 99, 3, 250, 101]  # teacher-forced continuation, fed one token per step
REL_TOL = 1e-4


@pytest.fixture(scope="module", params=hff.FAMILIES)
def family(request, tmp_path_factory):
    """(family, {"gguf": path, "hf": path}, transformers logits (T, V) of PROMPT + FOLLOW)."""
    model = hff.hf_model(request.param)
    d = tmp_path_factory.mktemp(request.param)
    paths = {"gguf": hff.write_gguf(model, request.param, d / "tiny.gguf"), "hf": hff.write_hf(model, d / "hf")}
    return request.param, paths, hff.hf_logits(model, PROMPT + FOLLOW)


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_whole_model_equals_transformers(family, fmt):
    name, paths, want = family
    shard = load_shard(paths[fmt])
    assert shard.cfg.architecture == name
    got = shard(torch.tensor([PROMPT + FOLLOW]), 0, logits="all")[0]
    assert rel(got, want) < REL_TOL


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_every_layer_boundary_prefill_then_steps_equals_transformers(family, fmt):
    """A chain of one-layer shards cuts at every boundary; prefill then one token per step."""
    _, paths, want = family
    L = load_shard(paths[fmt], LayerRange(0, 1)).cfg.num_hidden_layers
    for shards in ([load_shard(paths[fmt])], [load_shard(paths[fmt], LayerRange(i, i + 1)) for i in range(L)]):
        got = run_chain(shards, PROMPT, FOLLOW)
        assert rel(got, want) < REL_TOL, f"{len(shards)} shards"


def test_gguf_and_hf_directory_give_the_same_config(family):
    _, paths, _ = family
    a, b = (load_shard(paths[f], LayerRange(0, 1)).cfg for f in ("gguf", "hf"))
    floats = ("rms_norm_eps", "rope_attention_factor", "rope_long_factor", "rope_short_factor")
    for name in floats:  # GGUF stores them as float32
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-6), name
    assert replace(a, **{n: getattr(b, n) for n in floats}) == b


@pytest.mark.parametrize("precision,tol", [("bf16", 0.5), ("q8-bf16", 0.2)])
def test_low_precisions_run_and_stay_near_f32(family, precision, tol):
    """bf16 and int8 run for every family (the router stays float: it is not an nn.Linear).
    The bound is loose: 4 random layers amplify rounding, and a near-tie in a router may
    switch an expert; the greedy choice must still agree on most positions."""
    _, paths, _ = family
    ids = torch.tensor([PROMPT + FOLLOW])
    ref = load_shard(paths["gguf"])(ids, 0, logits="all")[0]
    low = load_shard(paths["gguf"], dtype=precision)
    got = low(ids, 0, logits="all")[0]
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert rel(got, ref) < tol
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_batched_pass_equals_single_passes(family):
    """Sequences at different positions (windows and caps included) in one ``forward_batch``."""
    _, paths, _ = family
    shard = load_shard(paths["gguf"])
    prompts = [PROMPT, FOLLOW, PROMPT + FOLLOW]
    single, batch = [new_cache(shard) for _ in prompts], [new_cache(shard) for _ in prompts]
    for ids, a, b in zip(prompts, single, batch):
        shard(torch.tensor([ids]), 0, a)
        shard(torch.tensor([ids]), 0, b)
    steps = [torch.tensor([[7]]), torch.tensor([[42, 43]]), torch.tensor([[259]])]
    out = shard.forward_batch(steps, [c.length for c in batch], batch, logits="all")
    for x, cache, got in zip(steps, single, out):
        assert rel(got, shard(x, cache.length, cache, logits="all")) < 1e-5


@pytest.mark.parametrize("moe", ["qwen3moe", "qwen2moe", "mixtral"])
def test_batched_pass_equals_single_passes_and_runs_each_expert_once(moe, tmp_path):
    """Three sequences at different positions in one ``forward_batch``: same logits as one
    ``forward`` each, and each chosen expert runs once per layer for the whole batch."""
    path = hff.write_gguf(hff.hf_model(moe, seed=1), moe, tmp_path / "moe.gguf")
    shard = load_shard(path)
    prompts = [PROMPT, FOLLOW, PROMPT[:3] + FOLLOW]
    single, batch = [new_cache(shard) for _ in prompts], [new_cache(shard) for _ in prompts]
    for ids, a, b in zip(prompts, single, batch):
        shard(torch.tensor([ids]), 0, a)
        shard(torch.tensor([ids]), 0, b)
    calls: list[int] = []
    hooks = [e.register_forward_hook(lambda m, i, o: calls.append(id(m)))
             for blk in shard.layers.values() for e in blk.mlp.experts]
    steps = [torch.tensor([[t]]) for t in (7, 42, 259)]
    try:
        out = shard.forward_batch(steps, [c.length for c in batch], batch)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(set(calls))  # grouped by expert: no expert ran twice in a layer
    for x, cache, got in zip(steps, single, out):
        want = shard(x, cache.length, cache)
        assert torch.allclose(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
        assert int(got.argmax()) == int(want.argmax())


def test_phi3_longrope_switches_to_the_long_factors_when_transformers_does(tmp_path):
    """Prefill under Phi-3's original context, then one token per step past it: each step's
    factors follow the sequence length, as transformers' incremental decoding with a cache;
    the whole sequence at once takes the long factors everywhere, as transformers' does."""
    model = hff.hf_model("phi3", seed=3)
    path = hff.write_gguf(model, "phi3", tmp_path / "phi3.gguf")
    ids = [(7 * i + 3) % 256 for i in range(hff.PHI3_ORIGINAL_CONTEXT + 8)]
    P = hff.PHI3_ORIGINAL_CONTEXT - 4
    with torch.no_grad():
        out = model(torch.tensor([ids[:P]]), use_cache=True)
        rows, past = [out.logits[0]], out.past_key_values
        for t in ids[P:]:
            out = model(torch.tensor([[t]]), cache=past, use_cache=True)
            rows.append(out.logits[0])
            past = out.past_key_values
    chain = [load_shard(path, LayerRange(0, 2)), load_shard(path, LayerRange(2, 4))]
    assert rel(run_chain(chain, ids[:P], ids[P:]), torch.cat(rows)) < REL_TOL
    whole = load_shard(path)(torch.tensor([ids]), 0, logits="all")[0]
    assert rel(whole, hff.hf_logits(model, ids)) < REL_TOL


def test_phi3_batched_pass_takes_each_sequences_own_longrope_factors(tmp_path):
    """One sequence past the original context and one under it share a batched pass; each gets
    the logits a pass of its own gives."""
    shard = load_shard(hff.write_gguf(hff.hf_model("phi3", seed=4), "phi3", tmp_path / "phi3.gguf"))
    prompts = [[(5 * i + 1) % 256 for i in range(hff.PHI3_ORIGINAL_CONTEXT + 3)], PROMPT]
    single, batch = [new_cache(shard) for _ in prompts], [new_cache(shard) for _ in prompts]
    for ids, a, b in zip(prompts, single, batch):
        shard(torch.tensor([ids]), 0, a)
        shard(torch.tensor([ids]), 0, b)
    steps = [torch.tensor([[9, 10]]), torch.tensor([[11]])]
    out = shard.forward_batch(steps, [c.length for c in batch], batch, logits="all")
    for x, cache, got in zip(steps, single, out):
        want = shard(x, cache.length, cache, logits="all")
        assert rel(got, want) < 1e-5


async def test_two_peers_split_mid_model_give_the_tokens_of_generate(family):
    """Every family's GGUF in a real 2-peer mesh (the synthetic tokenizer and ChatML template)."""
    from helpers.meshkit import file_hash, generate_through, mesh
    from meshinfer.text.tokenizer import Tokenizer

    _, paths, _ = family
    path, tok = paths["gguf"], Tokenizer.from_gguf(paths["gguf"])
    whole = load_shard(path)
    L = whole.cfg.num_hidden_layers
    shards = [load_shard(path, LayerRange(0, L // 2)), load_shard(path, LayerRange(L // 2, L))]
    async with mesh(shards, weights_hash=file_hash(path), bundle=tok.to_bundle()) as peers:
        _, ids, out = await generate_through(peers, tok, [{"role": "user", "content": "hello families"}],
                                             max_tokens=12, max_tokens_total=60)
    assert out.token_ids == greedy_generate(whole, ids, max_tokens=12).token_ids


def test_mixtral_gguf_with_one_tensor_per_expert_loads_the_same_model(tmp_path):
    model = hff.hf_model("mixtral", seed=5)
    merged = load_shard(hff.write_gguf(model, "mixtral", tmp_path / "merged.gguf"))
    legacy = load_shard(hff.write_gguf(model, "mixtral", tmp_path / "legacy.gguf", legacy_experts=True))
    assert legacy.cfg == merged.cfg
    assert all(torch.equal(a, b) for a, b in zip(legacy.state_dict().values(), merged.state_dict().values()))


def test_unsupported_gguf_architecture_is_refused_naming_it_and_the_supported(tmp_path):
    import gguf

    wr = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "falcon")
    wr.add_block_count(2)
    wr.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(WeightsError, match=r"architecture 'falcon' is not supported; supported: llama, qwen2, "
                                           r"qwen3, qwen3moe, qwen2moe, phi3, gemma2, gemma3 \(llama with experts: "
                                           r"Mixtral\)"):
        load_shard(tmp_path / "g.gguf")


def test_unsupported_config_json_model_type_is_refused_naming_it_and_the_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 32}))
    with pytest.raises(WeightsError, match=r"model_type 'falcon' is not supported; supported: gemma2, gemma3_text, "
                                           r"llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe"):
        load_shard(tmp_path)


def test_qwen3_moe_with_dense_layers_among_the_sparse_is_refused(tmp_path):
    hff.write_hf(hff.hf_model("qwen3moe"), tmp_path / "hf")  # a Qwen3-MoE config field
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"mlp_only_layers": [1]}))
    with pytest.raises(WeightsError, match=r"mlp_only_layers \[1\].*every layer must be sparse"):
        load_shard(tmp_path)


def test_supported_architectures_each_have_a_block_builder():
    from meshinfer.engine.models.families import BLOCKS

    assert tuple(BLOCKS) == SUPPORTED_ARCHITECTURES


def test_parameter_counts_match_the_shard_and_count_k_of_e_experts_as_active(family):
    name, paths, _ = family
    for layers in (LayerRange(0, 1), LayerRange(1, 3), LayerRange(3, 4), LayerRange(0, 4)):
        shard = load_shard(paths["gguf"], layers)
        resident, active = shard.cfg.parameter_counts(layers)
        assert resident == sum(p.numel() for p in shard.parameters())
        if not shard.cfg.is_moe:
            assert active == resident
            continue
        blk = next(iter(shard.layers.values()))
        idle = len(blk.mlp.experts) - shard.cfg.num_experts_per_tok
        assert active == resident - len(layers) * idle * sum(p.numel() for p in blk.mlp.experts[0].parameters())

