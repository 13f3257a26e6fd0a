"""Weights identity: which exact weights a peer runs, as one hex digest.

Peers on one route must hold byte-identical weights and compute at the same
precision; they compare :func:`shard_identity` strings in the handshake.

* A single file (GGUF): the sha256 of its contents, lowercase hex. For a known model
  this equals the sha256 in :mod:`meshinfer.engine.weights.registry`.
* A Hugging Face model directory: the sha256 of the UTF-8 text made of one line per
  identity file, in code-point order of the relative path::

      "<relpath>\\0<size in bytes>\\0<sha256 hex of the file>\\n"

  The identity files are ``config.json`` (required) and every ``*.safetensors`` file
  (at least one) directly inside the directory; ``<relpath>`` is the bare file name.
  Tokenizer files, ``*.safetensors.index.json``, ``generation_config.json``,
  ``*.bin`` and subdirectories are left out: they do not change what a shard
  computes from hidden states. (The client checks its own tokenizer.)

Hashing reads 8 MiB at a time and costs about 1-2 s per 500 MB, so each file's hash is
cached, keyed by ``(absolute resolved path, size in bytes, mtime_ns)``: in a dict for
this process and in ``<home>/hashcache.json`` across processes (rewritten atomically; a
corrupt cache file is ignored and replaced). Limitation of that key: a file whose
contents change while its size and mtime stay the same (a byte patched in place and
the mtime set back with ``os.utime``) keeps its old, now wrong, hash until the cache
entry is dropped. Normal writes, copies and downloads all change the mtime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from meshinfer.core.errors import ModelNotFound, WeightsError
from meshinfer.engine.weights.registry import meshinfer_home

log = logging.getLogger(__name__)

#: Bytes read per step while hashing.
CHUNK_BYTES = 8 * 1024 * 1024
#: File name of the persistent hash cache under the meshinfer home.
CACHE_FILE = "hashcache.json"
#: Layout version of the cache file; a file with another version is ignored.
CACHE_VERSION = 1

_HEX64 = re.compile(r"[0-9a-f]{64}")
_PRECISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")  # "f32", "q8-bf16", "gguf-a16"

#: In-process cache: (resolved path, size bytes, mtime_ns) -> sha256 hex.
_memo: dict[tuple[str, int, int], str] = {}


def weights_hash(path: str | os.PathLike, *, home: str | os.PathLike | None = None) -> str:
    """The identity digest (64 lowercase hex characters) of a GGUF file or HF directory.

    See the module docstring for the exact definition and the cache key. The first call
    for a file hashes it (about 1-2 s per 500 MB); later calls with the same size and
    mtime are dictionary or JSON look-ups.

    Raises:
        ModelNotFound: ``path`` does not exist.
        WeightsError: a directory lacks ``config.json`` or any ``*.safetensors`` file,
            or a file changed while it was being hashed.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return _file_hashes([p], home)[0][1]
    if p.is_dir():
        files = identity_files(p)
        h = hashlib.sha256()
        for f, (size, digest) in zip(files, _file_hashes(files, home)):
            h.update(f"{f.name}\0{size}\0{digest}\n".encode())
        return h.hexdigest()
    raise ModelNotFound(f"cannot hash weights: {str(p)!r} does not exist")


def identity_files(directory: str | os.PathLike) -> list[Path]:
    """The files of a Hugging Face directory that its identity covers, in digest order.

    Raises:
        WeightsError: ``config.json`` or every ``*.safetensors`` file is missing.
    """
    d = Path(directory)
    if not (d / "config.json").is_file():
        raise WeightsError(f"{str(d)!r} has no config.json, so it is not a Hugging Face model")
    tensors = [f for f in d.glob("*.safetensors") if f.is_file()]
    if not tensors:
        raise WeightsError(f"{str(d)!r} has no *.safetensors file")
    return sorted([d / "config.json", *tensors], key=lambda f: f.name)


def shard_identity(weights_hash: str, precision: str) -> str:
    """What two peers must share to serve the same route: ``f"{weights_hash}:{precision}"``.

    ``precision`` is the compute dtype name, for example ``"float32"`` or ``"bfloat16"``.

    Raises:
        ValueError: ``weights_hash`` is not 64 lowercase hex characters, or
            ``precision`` is empty or holds characters other than letters, digits, ``_``.
    """
    if not _HEX64.fullmatch(weights_hash):
        raise ValueError(f"weights_hash must be 64 lowercase hex characters, got {weights_hash!r}")
    if not _PRECISION.fullmatch(precision):
        raise ValueError(f"precision must be a name such as 'f32' or 'q8-bf16', got {precision!r}")
    return f"{weights_hash}:{precision}"


def _sha256_file(path: Path) -> str:
    """Hash one file in CHUNK_BYTES steps (the only place that reads weight bytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns)


def _file_hashes(paths: list[Path], home: str | os.PathLike | None) -> list[tuple[int, str]]:
    """(size bytes, sha256) of each path; from a cache when the key matches, else hashed."""
    keys = [_key(p) for p in paths]
    missing = [k for k in keys if k not in _memo]
    if missing:
        cache_path = meshinfer_home(home) / CACHE_FILE
        disk = _load_cache(cache_path)
        fresh = False
        for key in missing:
            entry = disk.get(key[0])
            if entry is not None and (entry["size"], entry["mtime_ns"]) == key[1:]:
                _memo[key] = entry["sha256"]
                continue
            _memo[key] = _hash_stable(Path(key[0]), key)
            disk[key[0]] = {"size": key[1], "mtime_ns": key[2], "sha256": _memo[key]}
            fresh = True
        if fresh:
            _save_cache(cache_path, disk)
    return [(k[1], _memo[k]) for k in keys]


def _hash_stable(path: Path, key: tuple[str, int, int]) -> str:
    digest = _sha256_file(path)
    if _key(path) != key:
        raise WeightsError(f"{str(path)!r} changed while it was being hashed; try again")
    return digest


def _valid_entry(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("size"), int)
        and isinstance(entry.get("mtime_ns"), int)
        and isinstance(entry.get("sha256"), str)
        and _HEX64.fullmatch(entry["sha256"]) is not None
    )


def _load_cache(cache_path: Path) -> dict[str, dict]:
    """Entries by resolved path; an absent, unreadable or corrupt file gives ``{}``."""
    try:
        data = json.loads(cache_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable hash cache %s: %s", cache_path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        log.warning("ignoring hash cache %s with unknown layout", cache_path)
        return {}
    files = data.get("files")
    if not isinstance(files, dict):
        return {}
    return {path: entry for path, entry in files.items() if _valid_entry(entry)}


def _save_cache(cache_path: Path, files: dict[str, dict]) -> None:
    """Write the cache atomically (temp file + rename); failure only costs a rehash later."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_path.parent, prefix=CACHE_FILE, suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": CACHE_VERSION, "files": files}, f, indent=1, sort_keys=True)
            os.replace(tmp, cache_path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("could not write hash cache %s: %s", cache_path, exc)
