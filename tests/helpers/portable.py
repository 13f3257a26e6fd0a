"""The C kernels built as another CPU gets them (no AVX2; AVX2 with VNNI), to compare with this
machine's build."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from meshinfer.engine.kernels import native


def portable_library(directory: Path) -> ctypes.CDLL:
    """The kernel library built into ``directory`` without ``-march`` (x86-64's baseline: no
    AVX2; the path an Arm Mac's NEON build or a compiler that refuses the flag takes), bound.
    Fails the test unless this machine's own build uses AVX2: the tests compare the two."""
    if native.library().mi_simd() != 1:
        pytest.fail("this test compares the portable path against the AVX2 one: the machine must have AVX2")
    out = Path(directory) / "portable.so"
    native.build(shutil.which("cc"), out, flags=[f for f in native.CFLAGS if not f.startswith("-march")])
    lib = native.bind(ctypes.CDLL(str(out)))
    assert lib.mi_simd() == 0
    return lib


def vnni_library(directory: Path) -> ctypes.CDLL:
    """The kernel library built into ``directory`` with :data:`native.CFLAGS` and VNNI's two dot
    instructions emulated in C (``tests/helpers/vnni_emulation.h``, by ``-include``): the path a
    CPU with AVX512-VNNI or AVX-VNNI takes, on one without. Fails the test unless this machine's
    own build uses AVX2 (the emulation stands in for instructions of AVX2's registers)."""
    if native.library().mi_simd() != 1:
        pytest.fail("this test compares the VNNI path against the AVX2 one: the machine must have AVX2")
    out = Path(directory) / "vnni.so"
    native.build(shutil.which("cc"), out, flags=[*native.CFLAGS, "-include", str(Path(__file__).with_name("vnni_emulation.h"))])
    lib = native.bind(ctypes.CDLL(str(out)))
    assert lib.mi_vnni() == 2 and lib.mi_simd() == 1
    return lib
