"""The torch-free part of the GGUF reader: the header and its key/value metadata.

The file layout is ggml's ``docs/gguf.md`` (magic, version, counts, key/value pairs, then
tensor infos and aligned data), little-endian. Every read is bounds-checked against the file
size, so a corrupt length or count raises :class:`~meshinfer.core.errors.WeightsError` naming
the field and never allocates more than the file holds. The tokenizer reads metadata through
:func:`read_gguf_metadata`; :mod:`meshinfer.engine.weights.gguf_file` reads tensors after it.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf import GGUFValueType

from meshinfer.core.errors import WeightsError


GGUF_MAGIC = b"GGUF"


#: GGUF versions read here (v1 used 32-bit counts; big-endian files fail the version check).
GGUF_VERSIONS = (2, 3)


SCALARS = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"), GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"), GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}


# Fewest bytes one array item of a type can take (a string: its u64 length). Bounds an array's
# count before reading it. Arrays of arrays are refused, as llama.cpp does.
MIN_ITEM_BYTES = {t: s.size for t, s in SCALARS.items()} | {GGUFValueType.STRING: 8}


# A key/value pair is at least a key length u64 and a value type u32; a tensor info at least a
# name length u64, n_dims u32, one dim u64, type u32 and offset u64.
MIN_KV_BYTES = 8 + 4


MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class Cursor:
    """Sequential reads over a GGUF header, each checked against the file size.

    ``what`` names the field being read; it goes into every error message.
    """

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, what: str, detail: str) -> WeightsError:
        return WeightsError(f"{self.path}: corrupt or truncated GGUF header ({self.size} bytes): "
                            f"{what}: {detail}")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise self.error(what, f"needs {n} bytes at byte {self.pos}, the file has "
                                   f"{self.size - self.pos} left")
        out, self.pos = self.buf[self.pos:self.pos + n], self.pos + n
        return out

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = SCALARS[vtype]
        if fmt.size > self.size - self.pos:
            self.take(fmt.size, what)  # raises
        value = fmt.unpack_from(self.buf, self.pos)[0]
        self.pos += fmt.size
        return value

    def string(self, what: str) -> str:
        raw = self.take(self.scalar(GGUFValueType.UINT64, f"{what} (length)"), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(what, f"string at byte {self.pos - len(raw)} is not UTF-8") from exc

    def count(self, n: int, item_bytes: int, what: str) -> int:
        """Check that ``n`` items of at least ``item_bytes`` each fit in the rest of the file."""
        left = self.size - self.pos
        if n * item_bytes > left:
            raise self.error(what, f"count {n} (at least {item_bytes} bytes each) overruns the "
                                   f"{left} bytes left in the file")
        return n

    def records(self, n: int, item_bytes: int, what: str, read: Callable[[int], Any]) -> list:
        """``[read(i) for i in range(n)]`` over a section of ``n`` records of at least
        ``item_bytes`` each. Each read is bounds-checked, so a corrupt ``n`` fails at the first
        record past the end; the error then also names the count, which may be the culprit."""
        left = self.size - self.pos
        try:
            return [read(i) for i in range(n)]
        except WeightsError as exc:
            if n * item_bytes <= left:
                raise
            raise WeightsError(f"{exc} ({what} is {n}: at least {n * item_bytes} bytes, the file "
                               f"had {left} left; the count is corrupt or the file is truncated)") from exc

    def strings(self, count: int, what: str) -> list[str]:
        buf, pos, size, out = self.buf, self.pos, self.size, []
        try:
            for i in range(count):  # hot loop: 150k+ tokens and merges
                n = int.from_bytes(buf[pos:pos + 8], "little")
                end = pos + 8 + n
                if end > size:
                    self.pos = pos
                    raise self.error(f"{what}[{i}]", f"string of {n} bytes at byte {pos} runs past "
                                                     f"the end of the file")
                out.append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError as exc:
            raise self.error(what, f"string at byte {pos} is not UTF-8") from exc
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype in SCALARS:
            return self.scalar(vtype, what)
        if vtype != GGUFValueType.ARRAY:
            raise self.error(what, f"unknown value type {vtype}")
        etype = self.scalar(GGUFValueType.UINT32, f"{what} (array item type)")
        if etype == GGUFValueType.ARRAY:
            raise self.error(what, "arrays of arrays are not supported")
        if etype not in MIN_ITEM_BYTES:
            raise self.error(what, f"unknown array item type {etype}")
        count = self.count(self.scalar(GGUFValueType.UINT64, f"{what} (array count)"),
                           MIN_ITEM_BYTES[etype], f"{what} (array count)")
        if etype == GGUFValueType.STRING:
            return self.strings(count, what)
        if etype == GGUFValueType.BOOL:
            return [bool(b) for b in self.take(count, what)]
        dtype = np.dtype(SCALARS[etype].format)
        return np.frombuffer(self.take(count * dtype.itemsize, what), dtype=dtype)


def map_gguf(path: Path, file=None) -> mmap.mmap:
    """Memory-map ``path`` (or its open binary ``file``, left open) read-only after checking its
    magic. Raises OSError as is."""
    if file is None:
        with open(path, "rb") as f:
            return map_gguf(path, f)
    magic = os.pread(file.fileno(), 4, 0)
    if magic != GGUF_MAGIC:
        raise WeightsError(f"{path}: wrong magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)


def read_header(cur: Cursor) -> tuple[int, dict[str, Any]]:
    """Parse magic, version, counts and the key/value section; return (tensor count, metadata)."""
    cur.take(4, "magic")
    version = cur.scalar(GGUFValueType.UINT32, "version")
    if version not in GGUF_VERSIONS:
        raise WeightsError(f"{cur.path}: GGUF version {version} is not supported (expected 2 or 3, "
                           "little-endian)")
    n_tensors = cur.scalar(GGUFValueType.UINT64, "tensor count")
    n_kv = cur.scalar(GGUFValueType.UINT64, "metadata count")
    meta: dict[str, Any] = {}

    def read_kv(i: int) -> None:
        key = cur.string(f"metadata key #{i}")
        if key in meta:
            raise cur.error(f"metadata field {key!r}", "the key appears twice")
        vtype = cur.scalar(GGUFValueType.UINT32, f"metadata field {key!r} (type)")
        meta[key] = cur.value(vtype, f"metadata field {key!r}")

    cur.records(n_kv, MIN_KV_BYTES, "the metadata count", read_kv)
    return n_tensors, meta


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Read the key/value metadata of a GGUF file (v2 or v3, little-endian), not its tensors.

    Args:
        path: the ``.gguf`` file.

    Returns:
        key -> value: ``str``, ``int``, ``float``, ``bool``, ``list[str]`` for string arrays and
        a 1-D ``numpy.ndarray`` for numeric arrays.

    Raises:
        FileNotFoundError: no such file.
        WeightsError: bad magic, unsupported version, truncated or non-UTF-8 metadata; the
            message names the field.
    """
    path = Path(path)
    with map_gguf(path) as buf:
        return read_header(Cursor(buf, path))[1]


def read_gguf_layer_count(path: str | os.PathLike) -> int:
    """The number of decoder blocks of a GGUF model (``<general.architecture>.block_count``),
    read from its header alone: no tensors, no torch. ``meshinfer join`` checks ``--layers``
    with it before loading the weights.

    Raises:
        FileNotFoundError: no such file.
        WeightsError: not a readable GGUF header (see :func:`read_gguf_metadata`), or the
            architecture or its block count is missing or not a positive whole number.
    """
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise WeightsError(f"{path}: metadata field 'general.architecture' is missing or not a string")
    count = meta.get(f"{arch}.block_count")
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise WeightsError(f"{path}: metadata field '{arch}.block_count' must be a positive whole number, "
                           f"got {count!r}")
    return int(count)
