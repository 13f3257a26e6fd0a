"""Build and load the C kernels: ``gguf_blocks.c`` (products from a GGUF file's own blocks, and
the f32 precision's few-row products) and ``step_ops.c`` (RMSNorm, RoPE and attention of a
decode or verification step), one library.

The library is compiled once per source, compiler and CPU with the system C compiler
(``cc``, or ``$CC``) into ``$MESHINFER_HOME/kernels`` (default ``~/.cache/meshinfer/kernels``)
and loaded with ``ctypes``; ``deploy/install.sh`` builds it (``python -m
meshinfer.engine.kernels.native``) so a peer's first start does not wait for the compiler.
``ctypes`` releases the GIL for the call, so the executor thread computes while the event loop
runs. When there is no compiler, or the build fails, :func:`library` logs one warning and
returns None; callers then use the torch path (``gguf.quants`` dequantization).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("meshinfer.kernels")

#: The C sources, compiled together into one library.
SOURCES = (Path(__file__).with_name("gguf_blocks.c"), Path(__file__).with_name("step_ops.c"))
#: Compiler flags. ``-march=native``: the library is built on the machine that runs it (AVX2
#: and FMA where the CPU has them, NEON with dotprod on a recent Arm CPU; a portable path with
#: the same bits otherwise). ``-ffp-contract=off``
#: keeps each dequantized weight the exact float32 result gguf-py computes (see the source).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-pthread", "-ffp-contract=off", "-shared", "-fPIC", "-std=c11"]
#: Flags left out, in turn, when a build with all of :data:`CFLAGS` fails: a compiler without
#: OpenMP (Apple's clang) still builds the kernels, whose largest products then split their
#: rows over POSIX threads (``-pthread``) and the others run on one thread; one that does not
#: take ``-march=native`` builds for the baseline CPU. ``-fopenmp`` only enables the sources'
#: pragmas.
FALLBACK_DROPS = (("-fopenmp",), ("-fopenmp", "-march=native"))
#: Seconds the compiler may take before the build counts as failed.
BUILD_TIMEOUT_S = 120


def _cpu_signature() -> str:
    """The CPU's model name and feature flags (Linux), so a library built for one CPU is not
    loaded on another that shares the cache directory."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def library_path(cc: str) -> Path:
    """Where the library for this source, compiler and CPU lives (built or not)."""
    home = Path(os.environ.get("MESHINFER_HOME") or Path.home() / ".cache" / "meshinfer")
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES), cc.encode(), " ".join(CFLAGS).encode(),
                 _cpu_signature().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return home / "kernels" / f"gguf_blocks-{h.hexdigest()[:16]}.so"


def build(cc: str, out: Path, flags: list[str] | None = None) -> None:
    """Compile :data:`SOURCES` to ``out`` (atomically: a temporary file, then a rename) with
    ``flags`` (default :data:`CFLAGS`; tests build the portable path without ``-march``).

    Raises:
        OSError: the directory cannot be written.
        subprocess.CalledProcessError, subprocess.TimeoutExpired: the compiler failed.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *(CFLAGS if flags is None else flags), *map(str, SOURCES), "-o", tmp], check=True,
                       capture_output=True,
                       timeout=BUILD_TIMEOUT_S)
        with open(tmp, "rb") as f:  # on disk before the rename: a crash never leaves a short library at `out`
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's functions' argument and result types (ctypes); returns ``lib``."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.mi_matmul.argtypes = lib.mi_matmul_q8.argtypes = lib.mi_matmul_q16.argtypes = [i32, p, i64, i64, p, i64, p, i32]
    lib.mi_dequantize.argtypes = [i32, p, i64, i64, p, i32]
    lib.mi_matmul_f32.argtypes = [p, i64, i64, p, i64, p, i32]
    lib.mi_round_activations.argtypes = [p, i64, i64, i32, p, i32]
    lib.mi_matmul_many.argtypes = [i32, i32, p, p, p, p, i64, p, i64, p, i32]
    for f in (lib.mi_matmul_many, lib.mi_round_activations, lib.mi_matmul_f32, lib.mi_matmul, lib.mi_matmul_q8, lib.mi_matmul_q16, lib.mi_dequantize, lib.mi_supports, lib.mi_supports_q8, lib.mi_simd, lib.mi_vnni):
        f.restype = i32
    lib.mi_supports.argtypes = lib.mi_supports_q8.argtypes = [i32]
    lib.mi_rmsnorm.argtypes = [p, i64, i64, p, ctypes.c_float, p]
    lib.mi_rope.argtypes = [p, i64, i64, i64, i64, p, p, i64, p]
    lib.mi_attention.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, p, i32]
    lib.mi_swiglu.argtypes = [p, p, i64, p]
    lib.mi_layer_step.argtypes = [p, p, i64, p, p, i64, p, p, i64, i64, i32]
    lib.mi_layers_step.argtypes = [p, i64, p, i64, p, p, i64, p, p, i64, i64, i32]
    lib.mi_all_finite.argtypes = [p, i64]
    lib.mi_argmax.argtypes = [p, i64]
    lib.mi_argmax.restype = i64
    for f in (lib.mi_rmsnorm, lib.mi_rope, lib.mi_attention, lib.mi_swiglu, lib.mi_layer_step, lib.mi_layers_step,
              lib.mi_all_finite):
        f.restype = i32
    return lib


def build_with_fallbacks(cc: str, out: Path) -> tuple[str, ...]:
    """:func:`build` with :data:`CFLAGS`, else without each set of :data:`FALLBACK_DROPS` in
    turn; returns the flags left out (empty when none were).

    Raises:
        the last build's error when every attempt failed (see :func:`build`).
    """
    *tries, last = ((), *FALLBACK_DROPS)
    for drop in tries:
        try:
            build(cc, out, [f for f in CFLAGS if f not in drop])
            return drop
        except subprocess.SubprocessError:
            pass
    build(cc, out, [f for f in CFLAGS if f not in last])  # its error is the one raised
    return last


#: What a process without the kernels loses, said after why.
WITHOUT_KERNELS = "--dtype gguf computes through torch, much slower, and gguf-a16 / gguf-a8 cannot run"


def _dropped_note(path: Path) -> Path:
    """Where the build of the library at ``path`` notes the flags it went without."""
    return path.with_name(path.name + ".dropped")


def built_without(path: Path) -> tuple[str, ...]:
    """The :data:`CFLAGS` the library at ``path`` was built without (its ``.dropped`` note,
    written at the build), or () when it has them all."""
    try:
        return tuple(_dropped_note(path).read_text().split())
    except OSError:
        return ()


def _warn_dropped(dropped: tuple[str, ...]) -> None:
    """The one warning line of a library built without the flags ``dropped``: what it lacks."""
    log.warning("the C kernels were built without %s (the compiler refused %s): %s",
                " ".join(dropped), "it" if len(dropped) == 1 else "them",
                "one thread per product, POSIX threads for the largest block products"
                if "-march=native" not in dropped
                else "for the baseline CPU (x86: the portable C path without AVX2; Arm: NEON "
                     "without dotprod), slower")


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, building it first if needed; None (after one warning line)
    when it cannot be built or loaded. A library built without some of :data:`CFLAGS` says so
    in one warning line in every process that loads it. ``MESHINFER_NO_NATIVE=1`` forces None
    (tests of the fallback)."""
    if os.environ.get("MESHINFER_NO_NATIVE") == "1":
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (%s not found): %s", os.environ.get("CC") or "cc", WITHOUT_KERNELS)
        return None
    path = library_path(cc)
    try:
        if not path.exists():
            dropped = build_with_fallbacks(cc, path)
            if dropped:
                _dropped_note(path).write_text(" ".join(dropped) + "\n")
            else:
                _dropped_note(path).unlink(missing_ok=True)
        dropped = built_without(path)
        if dropped:
            _warn_dropped(dropped)
        try:
            return bind(ctypes.CDLL(str(path)))
        except (OSError, AttributeError):  # a library left broken at that path (an older crash): build it again, once
            build(cc, path)
            return bind(ctypes.CDLL(str(path)))
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        first = detail.decode(errors="replace").strip().splitlines()[:1]
        log.warning("could not build the gguf kernels (%s%s): %s", type(exc).__name__, f": {first[0]}" if first else "",
                    WITHOUT_KERNELS)
        return None


def main() -> int:
    """``python -m meshinfer.engine.kernels.native``: build (if needed) and report. Exit 0 when
    the library loads, 1 otherwise."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    lib = library()
    if lib is None:
        print("gguf kernels: not available (see the warning above)", file=sys.stderr)
        return 1
    cc = _compiler()
    simd = {1: "AVX2+FMA", 2: "NEON"}.get(lib.mi_simd(), "portable C") + (", VNNI" if lib.mi_vnni() else "")
    dropped = built_without(library_path(cc))
    print(f"gguf kernels: {library_path(cc)} ({simd}{'; built without ' + ' '.join(dropped) if dropped else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
