"""Tests of meshinfer.engine.weights.identity: weights_hash, its caches, shard_identity."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from meshinfer.core.errors import ModelNotFound, WeightsError
from meshinfer.engine.weights import identity
from meshinfer.engine.weights.identity import shard_identity, weights_hash


@pytest.fixture(autouse=True)
def _fresh_caches(tmp_path, monkeypatch):
    """Empty in-process cache and a temp MESHINFER_HOME for every test."""
    monkeypatch.setattr(identity, "_memo", {})
    monkeypatch.setenv("MESHINFER_HOME", str(tmp_path / "home"))


@pytest.fixture
def hash_calls(monkeypatch) -> list[Path]:
    """Paths passed to identity._sha256_file, in call order."""
    calls: list[Path] = []
    real = identity._sha256_file

    def counting(path: Path) -> str:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(identity, "_sha256_file", counting)
    return calls


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _bump_mtime(path: Path, seconds: int = 10) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 1_000_000_000))


# ---------------------------------------------------------------- single files


def test_file_hash_is_sha256_of_contents(tmp_path):
    data = os.urandom(3 * 1024 + 5)
    f = _write(tmp_path / "m.gguf", data)
    assert weights_hash(f) == hashlib.sha256(data).hexdigest()


def test_files_one_byte_apart_differ(tmp_path):
    data = bytearray(os.urandom(100_000))
    a = _write(tmp_path / "a.gguf", bytes(data))
    data[54_321] ^= 0x01
    b = _write(tmp_path / "b.gguf", bytes(data))
    assert weights_hash(a) != weights_hash(b)


def test_file_hashed_in_8_mib_chunks(tmp_path, monkeypatch):
    sizes: list[int] = []
    real_sha256 = hashlib.sha256

    class Spy:
        def __init__(self):
            self.h = real_sha256()

        def update(self, chunk):
            sizes.append(len(chunk))
            self.h.update(chunk)

        def hexdigest(self):
            return self.h.hexdigest()

    f = _write(tmp_path / "big.gguf", b"\x07" * (8 * 1024 * 1024 + 10))
    monkeypatch.setattr(identity.hashlib, "sha256", Spy)
    weights_hash(f)
    assert sizes == [8 * 1024 * 1024, 10]


def test_missing_path_raises_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        weights_hash(tmp_path / "nope.gguf")


# ---------------------------------------------------------------- caching


def test_second_call_uses_memory_cache(tmp_path, hash_calls):
    f = _write(tmp_path / "m.gguf", b"weights")
    assert weights_hash(f) == weights_hash(f)
    assert hash_calls == [f.resolve()]


def test_disk_cache_survives_a_new_process(tmp_path, hash_calls, monkeypatch):
    f = _write(tmp_path / "m.gguf", b"weights")
    first = weights_hash(f)
    monkeypatch.setattr(identity, "_memo", {})  # as if in a new process
    assert weights_hash(f) == first
    assert len(hash_calls) == 1
    data = json.loads((tmp_path / "home" / "hashcache.json").read_text())
    st = f.stat()
    assert data == {
        "version": 1,
        "files": {str(f.resolve()): {"size": 7, "mtime_ns": st.st_mtime_ns, "sha256": first}},
    }


def test_changed_mtime_invalidates_cache(tmp_path, hash_calls):
    f = _write(tmp_path / "m.gguf", b"weights")
    weights_hash(f)
    _bump_mtime(f)
    weights_hash(f)
    assert len(hash_calls) == 2


def test_rewritten_file_gets_new_hash(tmp_path):
    f = _write(tmp_path / "m.gguf", b"weights-1")
    first = weights_hash(f)
    _write(f, b"weights-2")
    _bump_mtime(f)  # make the test independent of the filesystem's mtime resolution
    assert weights_hash(f) == hashlib.sha256(b"weights-2").hexdigest() != first


def test_cache_key_limitation_same_size_and_mtime(tmp_path, monkeypatch):
    """Documented limitation: a byte changed with size and mtime restored is not seen
    until the cache entries are dropped."""
    f = _write(tmp_path / "m.gguf", b"weights-1")
    stale = weights_hash(f)
    st = f.stat()
    _write(f, b"weights-2")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_hash(f) == stale
    monkeypatch.setattr(identity, "_memo", {})
    (tmp_path / "home" / "hashcache.json").unlink()
    assert weights_hash(f) == hashlib.sha256(b"weights-2").hexdigest()


def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, hash_calls):
    cache = tmp_path / "home" / "hashcache.json"
    cache.parent.mkdir()
    cache.write_text("{not json")
    f = _write(tmp_path / "m.gguf", b"weights")
    assert weights_hash(f) == hashlib.sha256(b"weights").hexdigest()
    assert len(hash_calls) == 1
    assert list(json.loads(cache.read_text())["files"]) == [str(f.resolve())]


def test_cache_entry_with_bad_digest_is_ignored(tmp_path, hash_calls):
    f = _write(tmp_path / "m.gguf", b"weights")
    st = f.stat()
    cache = tmp_path / "home" / "hashcache.json"
    cache.parent.mkdir()
    entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": "not-a-digest"}
    cache.write_text(json.dumps({"version": 1, "files": {str(f.resolve()): entry}}))
    assert weights_hash(f) == hashlib.sha256(b"weights").hexdigest()
    assert len(hash_calls) == 1


# ---------------------------------------------------------------- Hugging Face directories


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    _write(d / "model-00001-of-00002.safetensors", b"first shard bytes")
    _write(d / "model-00002-of-00002.safetensors", b"second shard")
    (d / "tokenizer.json").write_text("{}")
    return d


def test_hf_digest_matches_documented_formula(hf_dir):
    text = ""
    names = ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name in names:
        data = (hf_dir / name).read_bytes()
        text += f"{name}\0{len(data)}\0{hashlib.sha256(data).hexdigest()}\n"
    assert weights_hash(hf_dir) == hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize(
    "name", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"]
)
def test_hf_digest_changes_when_a_covered_file_changes(hf_dir, name):
    before = weights_hash(hf_dir)
    f = hf_dir / name
    data = bytearray(f.read_bytes())
    data[3] ^= 0x20
    _write(f, bytes(data))
    _bump_mtime(f)
    assert weights_hash(hf_dir) != before


def test_hf_digest_changes_when_a_shard_is_added(hf_dir):
    before = weights_hash(hf_dir)
    _write(hf_dir / "extra.safetensors", b"x")
    assert weights_hash(hf_dir) != before


def test_hf_digest_ignores_tokenizer_files(hf_dir):
    before = weights_hash(hf_dir)
    (hf_dir / "tokenizer.json").write_text('{"changed": true}')
    (hf_dir / "tokenizer_config.json").write_text("{}")
    assert weights_hash(hf_dir) == before


def test_hf_dir_without_safetensors_raises(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError, match=r"has no \*\.safetensors file$"):
        weights_hash(tmp_path)


def test_hf_dir_without_config_raises(tmp_path):
    _write(tmp_path / "model.safetensors", b"x")
    with pytest.raises(WeightsError, match="has no config.json"):
        weights_hash(tmp_path)


# ---------------------------------------------------------------- shard identity


def test_shard_identity_combines_hash_and_precision():
    h = "ab" * 32
    assert shard_identity(h, "float32") == f"{h}:float32"
    assert shard_identity(h, "float32") != shard_identity(h, "bfloat16")


@pytest.mark.parametrize(
    ("digest", "precision"),
    [("AB" * 32, "float32"), ("ab" * 31, "float32"), ("ab" * 32, ""), ("ab" * 32, "f:32")],
)
def test_shard_identity_rejects_bad_input(digest, precision):
    with pytest.raises(ValueError):
        shard_identity(digest, precision)
