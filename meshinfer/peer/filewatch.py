"""Watch the model file a running peer computes from: a change in place stops the peer.

At the gguf precisions the weights stay in the file's memory map (no copy; docs/performance.md),
as with llama.cpp's mmap. A file written over in place (``cp`` onto it, a second download into
the same path) then changes the weights under the running peer, which still advertises the old
weights hash, or, when it is truncated, kills it with SIGBUS at the next step that touches a
page past the new end. :func:`watch` checks the file every :data:`MODEL_WATCH_INTERVAL_S` and
reports such a change, so the peer stops serving and ``join`` exits with a clear error instead
(a change between two checks can still reach a step first: replace model files by rename).
A file replaced by rename, or deleted, is not a change: the mapping keeps the old file's pages.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

#: Seconds between two checks of the model file: a stat each, negligible.
MODEL_WATCH_INTERVAL_S = 2.0


@dataclass(frozen=True)
class FileIdentity:
    """What a ``stat`` says of a file: device and inode (which file), size in bytes and
    modification time in nanoseconds (what it holds)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str | os.PathLike) -> "FileIdentity | None":
        """The identity of the file at ``path`` now, or None when it cannot be read (gone)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def change_in_place(path: str | os.PathLike, loaded: FileIdentity) -> str | None:
    """Why the file at ``path`` no longer holds what was loaded (``loaded``: its identity at
    load), or None: unchanged, or replaced by another file or deleted (other inode, or gone),
    which leaves the mapped pages intact."""
    now = FileIdentity.of(path)
    if now is None or (now.dev, now.ino) != (loaded.dev, loaded.ino):
        return None
    if now.size != loaded.size:
        return (f"the model file {Path(path).name} was changed in place while this peer computes from it "
                f"({loaded.size:,} -> {now.size:,} bytes)")
    if now.mtime_ns != loaded.mtime_ns:
        return f"the model file {Path(path).name} was written to while this peer computes from it"
    return None


async def watch(path: str | os.PathLike, loaded: FileIdentity, on_change: Callable[[str], Awaitable[None]], *,
                interval_s: float | None = None) -> None:
    """Check ``path`` every ``interval_s`` seconds (default :data:`MODEL_WATCH_INTERVAL_S`) and
    await ``on_change(reason)`` once at the first change in place (:func:`change_in_place`);
    then return. Runs until cancelled otherwise."""
    while True:
        await asyncio.sleep(MODEL_WATCH_INTERVAL_S if interval_s is None else interval_s)
        reason = change_in_place(path, loaded)
        if reason is not None:
            await on_change(reason)
            return
