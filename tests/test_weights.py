"""Weights readers, tensor types, shard loading, bad files, model input errors and the KV cache.

Everything runs on tiny random models (``tests/helpers/tiny.py``) and hand-built GGUF files. Byte
positions for patching corrupt files come from ``gguf.GGUFReader``, an implementation
independent of ``meshinfer.engine.weights.gguf_file``.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from meshinfer.core.config import LayerRange
from meshinfer.core.errors import (CacheFull, InvalidInput, LayerRangeError, PositionError,
    UnsupportedTensorType, WeightsError)
from meshinfer.engine.generate import load_shard, new_cache
from meshinfer.engine.kv_cache import GROW_TOKENS, KVCache
from meshinfer.text.tokenizer import Tokenizer
from meshinfer.engine.weights import open_weights
from meshinfer.engine.weights.gguf_file import GGUFFile
from helpers.tiny import add_model_metadata, random_weights, tiny_config, write_gguf, write_hf_dir

ARCHS = ("qwen2", "llama")  # qwen2: q/k/v bias, untied head; llama: tied head, Q/K permutation
IDS = torch.tensor([[1, 5, 258, 100, 7, 42]])  # (1, 6)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (config, HF-named weights, {reader kind: path})."""
    out = {}
    for arch in ARCHS:
        root = tmp_path_factory.mktemp(arch)
        cfg = tiny_config(arch)
        w = random_weights(cfg, seed=1)
        out[arch] = (cfg, w, {
            "gguf": write_gguf(root / "model.gguf", cfg, w),
            "safetensors": write_hf_dir(root / "hf1", cfg, w),
            "sharded": write_hf_dir(root / "hf3", cfg, w, shards=3),
        })
    return out


@pytest.fixture(scope="module")
def qwen_shard(models):
    return load_shard(models["qwen2"][2]["gguf"])


# ------------------------------------------------------------------------------ readers agree

@pytest.mark.parametrize("arch", ARCHS)
def test_every_reader_loads_the_original_weights_and_gives_the_same_logits(models, arch):
    cfg, w, paths = models[arch]
    shards = {kind: load_shard(p) for kind, p in paths.items()}
    for kind, shard in shards.items():
        for name, param in shard.state_dict().items():
            hf = "lm_head.weight" if name == "lm_head.weight" else f"model.{name}"
            if hf not in w:  # tied head
                assert cfg.tie_word_embeddings and name == "lm_head.weight"
                hf = "model.embed_tokens.weight"
            assert torch.equal(param, w[hf]), f"{kind}: {name}"
    logits = {kind: s(IDS, 0, logits="all") for kind, s in shards.items()}  # (1, 6, V)
    assert logits["gguf"].shape == (1, 6, cfg.vocab_size)
    for kind in ("safetensors", "sharded"):
        assert (logits[kind] - logits["gguf"]).abs().max().item() <= 1e-6


def test_gguf_config_matches_the_written_model(models):
    for arch in ARCHS:
        cfg, _, paths = models[arch]
        got = GGUFFile(paths["gguf"]).config
        assert replace(got, rms_norm_eps=cfg.rms_norm_eps) == cfg
        assert got.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-7)  # stored as f32
        assert open_weights(paths["sharded"]).config == cfg


def test_tokenizer_from_an_open_gguffile_equals_from_the_path(models):
    path = models["qwen2"][2]["gguf"]
    g = GGUFFile(path)
    assert g.metadata["tokenizer.ggml.pre"] == "qwen2"
    from_file, from_path = Tokenizer.from_gguf(g), Tokenizer.from_gguf(path)
    assert from_file.fingerprint() == from_path.fingerprint()
    assert from_file.encode("hi") == [ord("h"), ord("i")]


# ------------------------------------------------------------------------------ tensor types

def write_typed_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]]) -> Path:
    """A tiny qwen2 GGUF (metadata + embedding) holding extra tensors of the given raw types."""
    cfg = tiny_config("qwen2")
    wr = gguf.GGUFWriter(str(path), "qwen2")
    add_model_metadata(wr, cfg)
    wr.add_tensor("token_embd.weight", np.zeros((cfg.vocab_size, cfg.hidden_size), np.float32))
    for name, (data, qtype) in tensors.items():
        wr.add_tensor(name, data, raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


# Largest error a type may add to values in [-1, 1]: half a quantization step, plus slack for
# the f16 scale (F16 and BF16 round to 11 and 8 significant bits).
ROUND_TRIP = {Q.F32: 0.0, Q.F16: 2 ** -11, Q.BF16: 2 ** -8, Q.Q8_0: 1 / 127, Q.Q4_0: 1 / 8,
              Q.Q4_1: 2 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 2 / 31}


@pytest.mark.parametrize("qtype", list(ROUND_TRIP), ids=lambda t: t.name)
def test_quantized_types_dequantize_like_gguf(tmp_path, qtype):
    x = np.random.default_rng(3).uniform(-1, 1, (3, 64)).astype(np.float32)  # (rows, cols)
    q = gguf.quants.quantize(x, qtype)
    g = GGUFFile(write_typed_gguf(tmp_path / "t.gguf", {"t.weight": (q, qtype)}))
    out = g.dequantize("t.weight")
    assert g.tensor_type("t.weight") == qtype.name
    assert out.dtype == np.float32 and out.shape == (3, 64) and out.flags.writeable
    np.testing.assert_array_equal(out, gguf.quants.dequantize(q, qtype).reshape(3, 64))
    assert np.abs(out - x).max() <= ROUND_TRIP[qtype] * 1.01
    if qtype != Q.F32:
        assert np.abs(out - x).max() > 0  # the data really went through the quantized type


def test_dequantize_in_row_chunks_equals_one_call(tmp_path, monkeypatch):
    import meshinfer.engine.weights.gguf_file as gguf_file

    x = np.random.default_rng(4).uniform(-1, 1, (5, 64)).astype(np.float32)  # (rows, cols)
    tensors = {"q": (gguf.quants.quantize(x, Q.Q4_1), Q.Q4_1), "f": (x.astype(np.float64), None)}
    g = GGUFFile(write_typed_gguf(tmp_path / "t.gguf", tensors))
    monkeypatch.setattr(gguf_file, "DEQUANT_ROWS", 2)  # chunks of 2, 2 and 1 rows
    np.testing.assert_array_equal(g.dequantize("q"), gguf.quants.dequantize(tensors["q"][0], Q.Q4_1))
    np.testing.assert_array_equal(g.dequantize("f"), x)


def test_f64_and_1d_and_3d_shapes(tmp_path):
    x3 = np.arange(2 * 3 * 32, dtype=np.float32).reshape(2, 3, 32)
    bias = np.linspace(-1, 1, 48)  # float64
    g = GGUFFile(write_typed_gguf(tmp_path / "t.gguf", {"a": (x3, None), "b": (bias, None)}))
    assert g.tensor_type("b") == "F64"
    np.testing.assert_array_equal(g.dequantize("a"), x3)
    np.testing.assert_array_equal(g.dequantize("b"), bias.astype(np.float32))


def f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def pack_k4_scales(sc: np.ndarray, mn: np.ndarray) -> bytes:
    """8 six-bit scales and mins -> 12 bytes, as ggml's quantize_row_q4_K_ref packs them."""
    out = np.zeros(12, np.uint8)
    for j in range(8):
        if j < 4:
            out[j], out[j + 4] = sc[j], mn[j]
        else:
            out[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4)
            out[j - 4] |= (sc[j] >> 4) << 6
            out[j] |= (mn[j] >> 4) << 6
    return out.tobytes()


def q4_k_block(d, dmin, sc, mn, q) -> bytes:
    """block_q4_K (ggml-common.h): d f16, dmin f16, scales[12], qs[128]; ``q`` 256 ints 0..15."""
    qs = np.concatenate([q[64 * j:64 * j + 32] | (q[64 * j + 32:64 * j + 64] << 4) for j in range(4)])
    return f16(d) + f16(dmin) + pack_k4_scales(sc, mn) + qs.astype(np.uint8).tobytes()


def q5_k_block(d, dmin, sc, mn, q) -> bytes:
    """block_q5_K: d, dmin, scales[12], qh[32], qs[128]; bit k of qh[l] is the 5th bit of value 32k+l."""
    low = q & 0xF
    qs = np.concatenate([low[64 * j:64 * j + 32] | (low[64 * j + 32:64 * j + 64] << 4) for j in range(4)])
    qh = np.zeros(32, np.int64)
    for k in range(8):
        qh |= (q[32 * k:32 * k + 32] >> 4) << k
    return (f16(d) + f16(dmin) + pack_k4_scales(sc, mn) + qh.astype(np.uint8).tobytes()
            + qs.astype(np.uint8).tobytes())


def q6_k_block(d, sc, q) -> bytes:
    """block_q6_K: ql[128], qh[64], scales[16] int8, d f16; ``q`` 256 ints -32..31."""
    u = q + 32
    ql, qh = np.zeros(128, np.int64), np.zeros(64, np.int64)
    for h in range(2):  # two halves of 128 values
        for k in range(4):  # quarters of 32 values: low/high nibble of ql[l] or ql[l + 32]
            part = u[128 * h + 32 * k:128 * h + 32 * k + 32]
            start = 64 * h + 32 * (k % 2)
            ql[start:start + 32] |= (part & 0xF) << (4 * (k // 2))
            qh[32 * h:32 * h + 32] |= (part >> 4) << (2 * k)
    return (ql.astype(np.uint8).tobytes() + qh.astype(np.uint8).tobytes()
            + sc.astype(np.int8).tobytes() + f16(d))


def k_quant_case(qtype: Q, rng: np.random.Generator, simple: bool) -> tuple[bytes, np.ndarray]:
    """One block of ``qtype`` and its exact 256 values (``simple``: d=1, scales 1, mins 0)."""
    if qtype == Q.Q6_K:
        q = rng.integers(-32, 32, 256)
        sc = np.ones(16, np.int64) if simple else rng.integers(-128, 128, 16)
        d = 1.0 if simple else 0.5
        return q6_k_block(d, sc, q), d * np.repeat(sc, 16) * q
    top = 16 if qtype == Q.Q4_K else 32
    q = rng.integers(0, top, 256)
    sc = np.ones(8, np.int64) if simple else rng.integers(0, 64, 8)
    mn = np.zeros(8, np.int64) if simple else rng.integers(0, 64, 8)
    sc[-1], mn[-1] = (sc[-1], mn[-1]) if simple else (63, 62)  # exercise the packed high bits
    d, dmin = (1.0, 1.0) if simple else (0.5, 0.25)
    block = (q4_k_block if qtype == Q.Q4_K else q5_k_block)(d, dmin, sc, mn, q)
    return block, d * np.repeat(sc, 32) * q - dmin * np.repeat(mn, 32)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("simple", [True, False], ids=["unit-scales", "random-scales"])
def test_k_quants_dequantize_hand_built_blocks_exactly(tmp_path, qtype, simple):
    rng = np.random.default_rng(7)
    cases = [k_quant_case(qtype, rng, simple) for _ in range(4)]  # 2 rows of 2 blocks
    raw = np.frombuffer(b"".join(b for b, _ in cases), np.uint8).reshape(2, -1)  # (2, 2 * type_size)
    assert raw.shape[1] == 2 * gguf.GGML_QUANT_SIZES[qtype][1]
    expected = np.concatenate([v for _, v in cases]).reshape(2, 512)
    if simple:
        assert expected.min() < 0 if qtype == Q.Q6_K else expected.max() >= 15
    g = GGUFFile(write_typed_gguf(tmp_path / "t.gguf", {"k.weight": (raw, qtype)}))
    assert g.tensor_type("k.weight") == qtype.name
    np.testing.assert_array_equal(g.dequantize("k.weight"), expected.astype(np.float32))


def test_type_is_read_per_tensor_not_from_the_file_name(tmp_path):
    x = np.random.default_rng(5).uniform(-1, 1, (4, 64)).astype(np.float32)
    tensors = {"a": (gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0),
               "b": (gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0),
               "c": (x.astype(np.float16), None)}
    g = GGUFFile(write_typed_gguf(tmp_path / "model-Q8_0.gguf", tensors))
    assert [g.tensor_type(n) for n in ("token_embd.weight", "a", "b", "c")] == ["F32", "Q8_0", "Q4_0", "F16"]
    for name, (data, qtype) in tensors.items():
        ref = gguf.quants.dequantize(data, qtype or Q.F16).reshape(4, 64)
        np.testing.assert_array_equal(g.dequantize(name), ref)
    assert not np.array_equal(g.dequantize("a"), g.dequantize("b"))

    only_q4 = {"a": (gguf.quants.quantize(x, Q.Q4_0), Q.Q4_0)}
    g = GGUFFile(write_typed_gguf(tmp_path / "also-Q8_0.gguf", only_q4))
    assert g.tensor_type("a") == "Q4_0"
    np.testing.assert_array_equal(g.dequantize("a"), gguf.quants.dequantize(only_q4["a"][0], Q.Q4_0))


# ------------------------------------------------------------------------------ only what is needed

BLOCK_MODULES = {
    "qwen2": {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
              "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
              "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"},
}
BLOCK_MODULES["llama"] = {m for m in BLOCK_MODULES["qwen2"] if not m.endswith(".bias")}


def expected_names(arch: str, start: int, stop: int) -> set[str]:
    names = {f"layers.{i}.{m}" for i in range(start, stop) for m in BLOCK_MODULES[arch]}
    if start == 0:
        names.add("embed_tokens.weight")
    if stop == 4:
        names |= {"norm.weight", "lm_head.weight"}
    return names


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["gguf", "sharded"])
@pytest.mark.parametrize(("start", "stop"), [(1, 3), (0, 2), (2, 4)])
def test_shard_reads_only_its_tensors(models, arch, kind, start, stop):
    cfg, w, paths = models[arch]
    got = dict(open_weights(paths[kind]).iter_shard_tensors(LayerRange(start, stop)))
    assert set(got) == expected_names(arch, start, stop)
    if stop == 4:
        head = w["model.embed_tokens.weight"] if arch == "llama" else w["lm_head.weight"]
        assert torch.equal(got["lm_head.weight"], head)


def test_gguf_dequantizes_only_the_shards_tensors(models, monkeypatch):
    read = []
    original = GGUFFile.dequantize
    monkeypatch.setattr(GGUFFile, "dequantize", lambda self, name: read.append(name) or original(self, name))
    g = GGUFFile(models["llama"][2]["gguf"])
    list(g.iter_shard_tensors(LayerRange(1, 3)))
    assert read and all(n.startswith(("blk.1.", "blk.2.")) for n in read)
    read.clear()
    list(g.iter_shard_tensors(LayerRange(3, 4)))
    assert read[-2:] == ["output_norm.weight", "token_embd.weight"]  # the tied head
    assert not any(n.startswith(("blk.0.", "blk.1.", "blk.2.")) for n in read)


# ------------------------------------------------------------------------------ bad GGUF files

@pytest.fixture(scope="module")
def good(models) -> tuple[bytes, gguf.GGUFReader]:
    path = models["qwen2"][2]["gguf"]
    return path.read_bytes(), gguf.GGUFReader(path)


def write(tmp_path: Path, data: bytes, name: str = "bad.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def patched(data: bytes, pos: int, fmt: str, value: int) -> bytes:
    return data[:pos] + struct.pack(fmt, value) + data[pos + struct.calcsize(fmt):]


def tensor_info_pos(reader: gguf.GGUFReader, index: int) -> dict[str, int]:
    """Byte positions of tensor ``index``'s info fields (ggml docs/gguf.md)."""
    t = reader.tensors[index]
    start = t.field.offset
    n_dims_at = start + 8 + len(t.name.encode())
    dims_at = n_dims_at + 4
    type_at = dims_at + 8 * len(t.shape)
    return {"start": start, "n_dims": n_dims_at, "dims": dims_at, "type": type_at}


def kv_value_pos(reader: gguf.GGUFReader, key: str) -> int:
    """Byte position of metadata field ``key``'s value (after key and value type)."""
    return reader.fields[key].offset + 8 + len(key.encode()) + 4


def last_tensor(reader: gguf.GGUFReader) -> str:
    return max(reader.tensors, key=lambda t: t.data_offset).name


@pytest.mark.parametrize(("cut", "message"), [
    (lambda r: 2, "wrong magic b'GG', expected b'GGUF': not a GGUF file"),
    (lambda r: 12, "corrupt or truncated GGUF header .*: tensor count: needs 8 bytes at byte 8"),
    (lambda r: kv_value_pos(r, "tokenizer.ggml.tokens") + 40,
     r"metadata field 'tokenizer.ggml.tokens' \(array count\): count \d+ \(at least 8 bytes each\) "
     r"overruns the \d+ bytes left"),
    (lambda r: kv_value_pos(r, "tokenizer.chat_template") + 20,
     "metadata field 'tokenizer.chat_template': needs 175 bytes at byte \\d+, the file has 12 left"),
    (lambda r: tensor_info_pos(r, 3)["start"] + 5, "tensor #3 name"),
    (lambda r: tensor_info_pos(r, 3)["dims"] + 3, "tensor '{t3}' dims: needs 8 bytes at byte \\d+, the file has 3 left"),
])
def test_truncated_header(tmp_path, good, cut, message):
    data, reader = good
    with pytest.raises(WeightsError, match=message.format(t3=reader.tensors[3].name)):
        GGUFFile(write(tmp_path, data[:cut(reader)]))


@pytest.mark.parametrize("missing", [1, 40])
def test_truncated_data_names_the_last_tensor(tmp_path, good, missing):
    data, reader = good
    name = last_tensor(reader)
    with pytest.raises(WeightsError, match=f"tensor '{name}' of type F32 .* past the end of the file "
                                           f"\\({len(data) - missing} bytes\\): the file is truncated"):
        GGUFFile(write(tmp_path, data[:-missing]))


def test_wrong_magic_and_empty_file(tmp_path, good):
    with pytest.raises(WeightsError, match="wrong magic b'GGML', expected b'GGUF'"):
        GGUFFile(write(tmp_path, b"GGML" + good[0][4:]))
    with pytest.raises(WeightsError, match="wrong magic b'', expected"):
        GGUFFile(write(tmp_path, b""))
    with pytest.raises(WeightsError, match="cannot read"):
        GGUFFile(tmp_path / "absent.gguf")


def test_unsupported_gguf_version(tmp_path, good):
    with pytest.raises(WeightsError, match="GGUF version 1 is not supported"):
        GGUFFile(write(tmp_path, patched(good[0], 4, "<I", 1)))


def test_a_grown_dim_overlaps_the_next_tensor(tmp_path, good):
    data, reader = good
    by_offset = sorted(reader.tensors, key=lambda t: t.data_offset)
    index = next(i for i, t in enumerate(reader.tensors) if t.name == by_offset[0].name)
    pos = tensor_info_pos(reader, index)
    t = reader.tensors[index]
    bad = patched(data, pos["dims"] + 8, "<Q", int(t.shape[1]) * 2)  # ne1 doubled
    with pytest.raises(WeightsError, match=f"tensor '{t.name}' \\(ends at byte \\d+\\) overlaps tensor "
                                           f"'{by_offset[1].name}' .* its byte size does not match"):
        GGUFFile(write(tmp_path, bad))


def test_a_grown_last_tensor_runs_past_the_end(tmp_path, good):
    data, reader = good
    index = [t.name for t in reader.tensors].index(last_tensor(reader))
    pos = tensor_info_pos(reader, index)
    bad = patched(data, pos["dims"], "<Q", int(reader.tensors[index].shape[0]) * 4)
    with pytest.raises(WeightsError, match=f"tensor '{last_tensor(reader)}' .* the file is truncated"):
        GGUFFile(write(tmp_path, bad))


def test_shape_that_does_not_fit_the_block_size(tmp_path):
    x = gguf.quants.quantize(np.zeros((2, 64), np.float32), Q.Q8_0)
    data = write_typed_gguf(tmp_path / "ok.gguf", {"q": (x, Q.Q8_0)}).read_bytes()
    reader = gguf.GGUFReader(tmp_path / "ok.gguf")
    pos = tensor_info_pos(reader, [t.name for t in reader.tensors].index("q"))
    with pytest.raises(WeightsError, match=r"tensor 'q' has shape \[48, 2\], which does not fit type "
                                           r"Q8_0 \(rows must be a multiple of 32 values\)"):
        GGUFFile(write(tmp_path, patched(data, pos["dims"], "<Q", 48)))


@pytest.mark.parametrize(("raw", "shown"), [(int(Q.IQ2_XXS), "IQ2_XXS"), (int(Q.Q8_K), "Q8_K"),
                                            (99, "number 99 \\(unknown to GGML\\)")])
def test_unsupported_tensor_type(tmp_path, good, raw, shown):
    data, reader = good
    pos = tensor_info_pos(reader, 2)
    with pytest.raises(UnsupportedTensorType, match=f"tensor '{reader.tensors[2].name}' has type {shown}, "
                                                    "which meshinfer cannot dequantize; supported: BF16"):
        GGUFFile(write(tmp_path, patched(data, pos["type"], "<I", raw)))


@pytest.mark.parametrize(("where", "fmt", "value", "message"), [
    (lambda r: 8, "<Q", 2 ** 40, r"\(the tensor count is 1099511627776: at least \d+ bytes, the file had \d+ "
                                 r"left; the count is corrupt or the file is truncated\)"),
    (lambda r: 16, "<Q", 2 ** 62, r"\(the metadata count is 4611686018427387904: at least"),
    (lambda r: r.fields["general.architecture"].offset, "<Q", 2 ** 62,
     "metadata key #0: needs 4611686018427387904 bytes at byte 32"),
    (lambda r: kv_value_pos(r, "tokenizer.chat_template"), "<Q", 2 ** 63,
     "metadata field 'tokenizer.chat_template': needs 9223372036854775808 bytes at byte \\d+, "
     "the file has \\d+ left"),
    (lambda r: kv_value_pos(r, "tokenizer.ggml.tokens") + 4, "<Q", 2 ** 61,
     "metadata field 'tokenizer.ggml.tokens' \\(array count\\): count 2305843009213693952"),
    (lambda r: kv_value_pos(r, "tokenizer.ggml.token_type") + 4, "<Q", 10 ** 9,
     "metadata field 'tokenizer.ggml.token_type' \\(array count\\): count 1000000000 \\(at least 4 "
     "bytes each\\)"),
    (lambda r: kv_value_pos(r, "tokenizer.ggml.token_type"), "<I", 77,
     "metadata field 'tokenizer.ggml.token_type': unknown array item type 77"),
    (lambda r: kv_value_pos(r, "tokenizer.ggml.token_type"), "<I", int(gguf.GGUFValueType.ARRAY),
     "metadata field 'tokenizer.ggml.token_type': arrays of arrays are not supported"),
    (lambda r: kv_value_pos(r, "tokenizer.ggml.tokens") + 12, "<Q", 2 ** 40,
     r"metadata field 'tokenizer.ggml.tokens'\[0\]: string of 1099511627776 bytes at byte \d+ runs past"),
    (lambda r: tensor_info_pos(r, 1)["n_dims"], "<I", 5, "tensor 'output_norm.weight' n_dims: 5 is outside 1..4"),
    (lambda r: tensor_info_pos(r, 1)["start"], "<Q", 2 ** 50, "tensor #1 name: needs 1125899906842624 bytes"),
])
def test_huge_lengths_and_counts_fail_cleanly(tmp_path, good, where, fmt, value, message):
    data, reader = good
    assert reader.tensors[1].name == "output_norm.weight"
    bad = write(tmp_path, patched(data, where(reader), fmt, value))
    tracemalloc.start()
    try:
        with pytest.raises(WeightsError, match=message):
            GGUFFile(bad)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # no allocation sized by the corrupt number


def test_misaligned_tensor_offset(tmp_path, good):
    data, reader = good
    pos = tensor_info_pos(reader, 1)
    offset_at = pos["type"] + 4
    old = struct.unpack_from("<Q", data, offset_at)[0]
    with pytest.raises(WeightsError, match=f"tensor 'output_norm.weight' has data offset {old + 4}, "
                                           "which is not a multiple of the alignment 32"):
        GGUFFile(write(tmp_path, patched(data, offset_at, "<Q", old + 4)))


@pytest.mark.parametrize(("key", "message"), [
    ("qwen2.block_count", "metadata field 'qwen2.block_count' is missing"),
    ("general.architecture", "metadata field 'general.architecture' is missing"),
    ("qwen2.embedding_length", "metadata field 'qwen2.embedding_length' is missing"),
])
def test_missing_metadata_field(tmp_path, good, key, message):
    data = good[0]
    assert data.count(key.encode()) == 1
    renamed = key[:-1] + ("X" if key[-1] != "X" else "Y")
    with pytest.raises(WeightsError, match=message):
        GGUFFile(write(tmp_path, data.replace(key.encode(), renamed.encode())))


def test_unknown_metadata_value_type(tmp_path, good):
    data, reader = good
    bad = patched(data, kv_value_pos(reader, "qwen2.block_count") - 4, "<I", 13)
    with pytest.raises(WeightsError, match="metadata field 'qwen2.block_count': unknown value type 13"):
        GGUFFile(write(tmp_path, bad))


def test_missing_tensor_is_named(models):
    g = GGUFFile(models["qwen2"][2]["gguf"])
    with pytest.raises(WeightsError, match="tensor 'blk.9.attn_q.weight' is missing"):
        g.dequantize("blk.9.attn_q.weight")
    assert g.field("qwen2.block_count") == 4 and g.field("nope", None) is None
    assert g.field("tokenizer.ggml.token_type")[:2] == [1, 1]  # numeric arrays come back as lists


# ------------------------------------------------------------------------------ bad HF directories

def test_hf_dir_without_config(tmp_path, models):
    cfg, w, _ = models["qwen2"]
    d = write_hf_dir(tmp_path / "m", cfg, w)
    (d / "config.json").unlink()
    with pytest.raises(WeightsError, match="config.json is missing"):
        open_weights(d)


def test_hf_dir_with_malformed_config(tmp_path, models):
    cfg, w, _ = models["qwen2"]
    d = write_hf_dir(tmp_path / "m", cfg, w)
    (d / "config.json").write_text('{"model_type": "qwen2", ')
    with pytest.raises(WeightsError, match="config.json: not valid JSON"):
        open_weights(d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 32}))
    with pytest.raises(WeightsError, match="config.json: field 'num_attention_heads' is missing"):
        open_weights(d)


def test_hf_dir_with_missing_shard(tmp_path, models):
    cfg, w, _ = models["qwen2"]
    d = write_hf_dir(tmp_path / "m", cfg, w, shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(WeightsError, match="shard file 'model-00002-of-00003.safetensors' named by the "
                                           "index is missing"):
        open_weights(d)


# ------------------------------------------------------------------------------ model input errors

def test_layer_ranges(models):
    path = models["qwen2"][2]["gguf"]
    with pytest.raises(LayerRangeError, match="layer range 2-4 is outside the model: it has 4 layers"):
        load_shard(path, LayerRange(2, 5))
    with pytest.raises(LayerRangeError, match=r"layer range \[3, 3\) is empty"):
        LayerRange(3, 3)
    with pytest.raises(LayerRangeError, match="layer range '11-3' is empty: last layer 3 < first layer 11"):
        LayerRange.parse("11-3")
    assert LayerRange.parse("0-11") == LayerRange(0, 12)
    assert LayerRange.parse("5") == LayerRange(5, 6)
    for garbage in ("", "a-b", "1-", "-3", "1-2-3", "0..11"):
        with pytest.raises(LayerRangeError, match="is not of the form FIRST-LAST"):
            LayerRange.parse(garbage)


def test_token_id_outside_the_vocabulary(qwen_shard):
    V = qwen_shard.cfg.vocab_size
    with pytest.raises(InvalidInput, match=rf"token id {V} is outside the vocabulary \[0, {V}\)"):
        qwen_shard(torch.tensor([[1, V]]), 0)
    with pytest.raises(InvalidInput, match=r"token id -1 is outside the vocabulary"):
        qwen_shard(torch.tensor([[-1, 3]]), 0)


def test_hidden_states_of_the_wrong_width(models):
    tail = load_shard(models["qwen2"][2]["gguf"], LayerRange(2, 4))
    with pytest.raises(InvalidInput, match=r"layers 2-3 take hidden states \(B, T, 32\) float, got \(1, 3, 16\)"):
        tail(torch.zeros(1, 3, 16), 0)
    assert tail(torch.zeros(1, 3, 32), 0).shape == (1, 1, tail.cfg.vocab_size)


def test_positions_must_continue_the_cache(qwen_shard):
    cache = new_cache(qwen_shard)
    qwen_shard(IDS[:, :3], 0, cache)
    with pytest.raises(PositionError, match="step starts at position 5 but the cache holds 3 tokens"):
        qwen_shard(IDS[:, 3:4], 5, cache)
    with pytest.raises(PositionError, match="step starts at position 2 but the cache holds 3 tokens"):
        qwen_shard(IDS[:, 3:4], 2, cache)
    assert cache.length == 3


# ------------------------------------------------------------------------------ KV cache

def test_cache_grows_in_steps_and_counts_bytes(qwen_shard):
    cfg = qwen_shard.cfg
    cache = new_cache(qwen_shard)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K+V, f32
    assert cache.bytes_per_token == per_token and cache.nbytes == 0
    prompt = torch.randint(0, cfg.vocab_size, (1, GROW_TOKENS - 2), generator=torch.Generator().manual_seed(0))
    qwen_shard(prompt, 0, cache)
    assert (cache.length, cache.capacity, cache.nbytes) == (GROW_TOKENS - 2, GROW_TOKENS, GROW_TOKENS * per_token)
    for _ in range(2):
        qwen_shard(torch.tensor([[7]]), cache.length, cache)
    assert (cache.length, cache.capacity) == (GROW_TOKENS, GROW_TOKENS)
    qwen_shard(torch.tensor([[7]]), cache.length, cache)
    assert (cache.length, cache.capacity, cache.nbytes) == (GROW_TOKENS + 1, 2 * GROW_TOKENS,
                                                           2 * GROW_TOKENS * per_token)
    assert cache.free() == 2 * GROW_TOKENS * per_token
    assert cache.free() == 0 and cache.nbytes == 0 and cache.length == 0


def test_truncate_then_redecode_gives_the_same_logits(qwen_shard):
    cache = new_cache(qwen_shard)
    qwen_shard(IDS[:, :3], 0, cache)
    first = [qwen_shard(IDS[:, i:i + 1], i, cache) for i in range(3, 6)]  # 3 x (1, 1, V)
    full = qwen_shard(IDS, 0, logits="all")  # (1, 6, V), no cache
    for i, step in enumerate(first):
        assert (step[0, 0] - full[0, 3 + i]).abs().max().item() < 1e-5
    cache.truncate(4)
    assert cache.length == 4 and cache.capacity == GROW_TOKENS
    again = [qwen_shard(IDS[:, i:i + 1], i, cache) for i in range(4, 6)]
    assert torch.equal(again[0], first[1]) and torch.equal(again[1], first[2])
    with pytest.raises(PositionError, match="cannot truncate to position 7: the cache holds 6 tokens"):
        cache.truncate(7)
    assert cache.free() == GROW_TOKENS * cache.bytes_per_token


def test_cache_full_past_max_tokens(qwen_shard):
    cfg = qwen_shard.cfg
    cache = KVCache(qwen_shard.range, cfg.num_key_value_heads, cfg.head_dim, max_tokens=4)
    qwen_shard(IDS[:, :3], 0, cache)
    assert cache.capacity == 4  # capped at max_tokens, not rounded up to GROW_TOKENS
    with pytest.raises(CacheFull, match="KV cache would hold 5 tokens, the limit is 4"):
        qwen_shard(IDS[:, 3:5], 3, cache)
    assert cache.length == 3
    qwen_shard(IDS[:, 3:4], 3, cache)
    assert cache.length == 4
