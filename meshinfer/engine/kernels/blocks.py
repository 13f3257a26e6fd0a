"""A GGUF tensor kept as the file stores it, and products computed from its blocks.

:class:`QuantBlocks` is what ``GGUFFile.iter_shard_tensors(layers, blocks=True)`` yields for a
projection stored in a type of :data:`KERNEL_TYPES`; :func:`matmul` and :func:`dequantize`
compute from it with the C kernels (``native.py``), or, without them, through gguf-py's
``gguf.quants`` dequantization (same weights, much slower).

Pure computation: nothing here logs (except ``native.library()``'s one warning), prints or awaits.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from torch.nn import functional as F

from meshinfer.engine.kernels import native

#: GGML type ids (ggml.h ``enum ggml_type``) the kernels compute from directly; a projection in
#: another type is dequantized exactly at load and kept as float32 rows (type 0).
KERNEL_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}
#: (weights per block, bytes per block) of each type, from ggml's ggml-common.h (``QK*`` and
#: ``sizeof(block_*)``).
BLOCK_SHAPE = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34),
               12: (256, 144), 14: (256, 210)}
#: Most bytes of float32 weights :func:`dense_row_chunks` dequantizes at a time: a prefill
#: projection's weight never exists whole in float32 (the default model's gate, up and down
#: projections take 17 MiB each, two chunks here; its output head 519 MiB), yet each chunk stays
#: wide enough for torch's GEMM (docs/performance.md, "Prefill memory": on the 2-core AVX2 EPYC,
#: chunks of 107 rows of the 4,864-column down projection multiplied 45% slower than the whole
#: weight, 448 rows as fast; a 1,000-token prefill with 8 MiB chunks, 299 rows of down, took
#: 1.05-1.08x the time, with 16 MiB 1.01x).
DEQUANT_CHUNK_BYTES = 16 << 20
#: Fewest rows in a chunk (:data:`DEQUANT_CHUNK_BYTES` gives way): narrower outputs take other
#: GEMM kernels, slower, and they sum in another order than one matmul (on the EPYC chunks of
#: up to 32 rows did, from 48 rows none).
DEQUANT_CHUNK_MIN_ROWS = 256


@dataclass
class QuantBlocks:
    """One 2-D GGUF tensor as stored: ``data`` ``(N, row_bytes)`` uint8, ``N`` rows of ``K``
    weights in GGML type ``qtype`` (an id of :data:`KERNEL_TYPES`).

    Raises (on construction):
        ValueError: a type outside :data:`KERNEL_TYPES`, or ``data`` that does not hold whole
            rows of ``K`` weights in one contiguous buffer (the kernels read ``N * row_bytes``
            bytes from its first: a strided or expanded view would make them read other or
            unowned memory).
    """

    qtype: int
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_SHAPE:
            raise ValueError(f"GGML type {self.qtype} is not one the gguf kernels compute from")
        qk, nbytes = BLOCK_SHAPE[self.qtype]
        if (self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.in_features % qk
                or self.data.shape[1] != self.in_features // qk * nbytes or not self.data.is_contiguous()):
            raise ValueError(f"{tuple(self.data.shape)} {self.data.dtype} bytes are not rows of "
                             f"{self.in_features} weights of GGML type {self.qtype}")

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's logical shape ``(N, K)`` (a torch ``(out, in)`` weight's)."""
        return (self.data.shape[0], self.in_features)

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "QuantBlocks":
        """Float32 rows (type 0) holding ``w`` ``(N, K)`` exactly."""
        w = w.detach().to(torch.float32).contiguous()
        return cls(0, w.view(torch.uint8).reshape(w.shape[0], -1), w.shape[1])

    def rows(self, index: torch.Tensor) -> "QuantBlocks":
        """The rows ``index`` ``(R,)`` int64 (for an embedding lookup)."""
        return QuantBlocks(self.qtype, self.data.index_select(0, index), self.in_features)

    def to_device(self, device: torch.device | str) -> "QuantBlocks":
        return QuantBlocks(self.qtype, self.data.to(device), self.in_features)


def dequantize(w: QuantBlocks, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``w`` as float32 ``(stop - start, K)``, equal bit for bit to
    ``gguf.quants.dequantize`` (the C kernel follows its operations; tests/test_gguf_kernels.py)."""
    data = w.data[start:stop].contiguous()
    n, k = data.shape[0], w.in_features  # rows there are: a stop past N reads nothing beyond
    if w.qtype in (0, 1):  # float rows: exact conversions
        return data.view(torch.float32 if w.qtype == 0 else torch.float16).reshape(n, k).float()
    lib = native.library()
    if lib is None:
        from gguf import GGMLQuantizationType, quants
        return torch.from_numpy(quants.dequantize(data.numpy(), GGMLQuantizationType(w.qtype))).reshape(n, k)
    out = torch.empty(n, k, dtype=torch.float32)
    if n and lib.mi_dequantize(w.qtype, data.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"the gguf kernels refused type {w.qtype} with {k} columns")
    return out


def matmul(x: torch.Tensor, w: QuantBlocks, *, act_bits: int = 32) -> torch.Tensor:
    """``x @ W.T`` for ``x`` ``(M, K)`` float32 and ``W`` ``(N, K)`` held as blocks: ``(M, N)``
    float32, accumulated in float32 (the summation order is the kernel's, so results differ from
    a float32 matmul of the dequantized weight within float32 rounding). Runs on torch's thread
    count; the GIL is released while the kernel runs.

    ``act_bits``: 32 multiplies float32 activations (the ``gguf`` precision). 8 (``gguf-a8``)
    first quantizes each row of ``x`` per 32 columns to int8 (ggml's ``quantize_row_q8_0``:
    scale ``max|x| / 127``, round to nearest) and takes each block's product as an integer dot
    product, as llama.cpp's CPU path does: about 0.5-1% relative error per product against
    float32 activations. 16 (``gguf-a16``) does the same with int16 (scale ``max|x| / 32767``):
    about 2e-5 (tests/test_gguf_kernels.py). Types the integer kernels do not take
    (``mi_supports_q8``: F16) use float32 activations. Without AVX2 (an Arm CPU) the kernels'
    portable C path gives the same bits.

    Raises:
        ValueError: ``x`` is not ``(M, K)`` float32.
    """
    M, K = x.shape
    if K != w.in_features or x.dtype != torch.float32:
        raise ValueError(f"x must be (M, {w.in_features}) float32, got {tuple(x.shape)} {x.dtype}")
    lib = native.library()
    if w.qtype == 0:  # float32 rows
        wf = w.data.view(torch.float32).reshape(w.shape)
        y = matmul_f32(x, wf, every_cpu=True)  # the same bits on every CPU, as the block kernels
        return F.linear(x, wf) if y is None else y
    if lib is None or K % 32:
        return dequantize_chunks(x, w)
    x = x.contiguous()
    y = torch.empty(M, w.shape[0], dtype=torch.float32)
    kernel = lib.mi_matmul
    if integer_activations(w, act_bits):
        kernel = lib.mi_matmul_q8 if act_bits == 8 else lib.mi_matmul_q16
    if M and kernel(w.qtype, w.data.data_ptr(), w.shape[0], K, x.data_ptr(), M, y.data_ptr(),
                           torch.get_num_threads()):
        raise ValueError(f"the gguf kernels refused type {w.qtype} with {K} columns")
    return y


class FusedProduct:
    """``x @ W_t.T + b_t`` for a few weights ``W_t`` that share one input (a layer's q, k and v;
    gate and up), as one kernel call (``mi_matmul_many``): the activations are rounded once and
    one thread team covers all the weights' rows, so the 128-row k and v of a decode step no
    longer run alone on one thread, and a step makes 4 calls per layer instead of 7. Each
    output equals :func:`matmul` of its own weight plus its bias, bit for bit
    (tests/test_gguf_kernels.py).

    The kernel's arguments are prepared once (ctypes arrays of types, data pointers, row counts
    and biases), and the weights and biases are kept referenced, so a call costs one ctypes
    call: at 169 projections a step, Python overhead was about a tenth of a decode step.

    Build with :meth:`make`, which returns None where the weights cannot share a call.
    """

    #: Most weights in one call (``MAX_TENSORS`` in gguf_blocks.c).
    MAX_WEIGHTS = 4

    def __init__(self, ws: Sequence[QuantBlocks], biases: Sequence[torch.Tensor | None], bits: int) -> None:
        n = len(ws)
        self.in_features, self.bits = ws[0].in_features, bits
        self.out_features = tuple(w.shape[0] for w in ws)
        # the kernel reads these tensors' memory: the tensors themselves, not the QuantBlocks,
        # whose ``data`` could be rebound and the bytes freed under the prepared pointers
        self._keep = (tuple(w.data for w in ws), tuple(biases))
        self._arrays = ((ctypes.c_int * n)(*(w.qtype for w in ws)),
                        (ctypes.c_void_p * n)(*(w.data.data_ptr() for w in ws)),
                        (ctypes.c_int64 * n)(*self.out_features),
                        (ctypes.c_void_p * n)(*(None if b is None else b.data_ptr() for b in biases)))
        self._args = (bits, n, *(ctypes.addressof(a) for a in self._arrays), self.in_features)

    @property
    def args(self) -> tuple:
        """The prepared leading arguments of ``mi_matmul_many`` (activation bits, weight count,
        addresses of the types, data pointers, row counts and biases, and ``K``): valid while
        this object lives."""
        return self._args

    @classmethod
    def make(cls, ws: Sequence[QuantBlocks], biases: Sequence[torch.Tensor | None],
             act_bits: int) -> "FusedProduct | None":
        """The fused product of ``ws`` (with ``biases``: ``(N_t,)`` float32 contiguous CPU
        tensors or None), or None when the kernels are not loaded, the weights differ in
        ``K`` or in the activation rounding :func:`matmul` would give them
        (:func:`integer_activations`), a weight is float32 rows or not on the CPU, a bias is not float32
        contiguous, or there are more than :data:`MAX_WEIGHTS`."""
        if native.library() is None or not 1 <= len(ws) <= cls.MAX_WEIGHTS or len(biases) != len(ws):
            return None
        bits = {act_bits if integer_activations(w, act_bits) else 32 for w in ws}
        if (len(bits) != 1 or len({w.in_features for w in ws}) != 1 or any(w.qtype == 0 for w in ws)
                or ws[0].in_features % 32 or any(w.data.device.type != "cpu" for w in ws)):
            return None
        for w, b in zip(ws, biases):
            if b is not None and (b.dtype != torch.float32 or not b.is_contiguous() or b.device.type != "cpu"
                                  or b.shape != (w.shape[0],)):
                return None
        return cls(ws, biases, bits.pop())

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` ``(M, K)`` float32 -> one ``(M, N_t)`` float32 per weight (views of one buffer).

        Raises:
            ValueError: ``x`` is not ``(M, K)`` float32 on the CPU, or the kernel refused.
        """
        M, K = x.shape
        if K != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x must be (M, {self.in_features}) float32, got {tuple(x.shape)} {x.dtype}")
        x = x.contiguous()
        y = torch.empty(M * sum(self.out_features), dtype=torch.float32)
        if M and native.library().mi_matmul_many(*self._args, x.data_ptr(), M, y.data_ptr(), torch.get_num_threads()):
            raise ValueError(f"the gguf kernels refused the fused product of {len(self.out_features)} weights")
        outs, start = [], 0
        for n in self.out_features:
            outs.append(y[start:start + M * n].view(M, n))
            start += M * n
        return outs


#: Most rows :func:`matmul_f32` takes: decode batches and verification steps (up to 1 + 16
#: drafts). From about 32 rows torch's GEMM is as fast (``tests/benchmarks/small_m_gemm.py``).
F32_KERNEL_MAX_ROWS = 24


def matmul_f32(x: torch.Tensor, w: torch.Tensor, *, every_cpu: bool = False) -> torch.Tensor | None:
    """``x @ w.T`` ``(M, N)`` float32 for ``x`` ``(M, K)`` and ``w`` ``(N, K)``, both float32 on
    the CPU, through the register-blocked C kernel (``mi_matmul_f32``), or None where it does
    not apply: no kernels, a build without AVX2/FMA (unless ``every_cpu``), ``M`` outside
    1..:data:`F32_KERNEL_MAX_ROWS`, ``K`` not a multiple of 8, another dtype or device. The
    caller then uses torch.

    ``every_cpu``: take the kernel on any build. Its portable and NEON paths give the AVX2
    path's bits, which a gguf precision's float32 rows need (its peers on x86 and Arm must
    agree); the f32 precision keeps torch there, whose library (Accelerate on a Mac) was not
    measured against them.

    Why: on this project's 2-core AVX2 EPYC (MKL 2024), torch's one-row GEMV runs on one thread
    and its few-row GEMM at about 15% of the FMA peak; the kernel splits output rows over torch's
    thread count and keeps a 4 x 3 tile of accumulators in registers, 1.3-6x faster for 1-17
    rows (docs/performance.md, ``tests/benchmarks/small_m_gemm.py``). Each output element is the
    same sequence of 8-wide FMAs whatever the other rows are, so a row's result does not depend
    on what it is batched with; it differs from torch's by summation order only (within 1e-5
    relative). The GIL is released while it runs.
    """
    M = x.shape[0] if x.dim() == 2 else 0
    if (not 1 <= M <= F32_KERNEL_MAX_ROWS or x.dtype != torch.float32 or w.dtype != torch.float32
            or x.device.type != "cpu" or w.device.type != "cpu" or w.dim() != 2 or w.shape[1] != x.shape[1]
            or x.shape[1] % 8 or not w.is_contiguous()):
        return None
    lib = native.library()
    if lib is None or not (every_cpu or lib.mi_simd() == 1):
        return None
    x = x.contiguous()
    y = torch.empty(M, w.shape[0], dtype=torch.float32)
    if lib.mi_matmul_f32(w.data_ptr(), w.shape[0], x.shape[1], x.data_ptr(), M, y.data_ptr(), torch.get_num_threads()):
        return None
    return y


def integer_activations(w: QuantBlocks, act_bits: int) -> bool:
    """Whether :func:`matmul` with ``act_bits`` quantizes the activations for ``w``: 8 or 16
    bits, the kernels loaded, ``K`` a multiple of 32 and a type ``mi_supports_q8`` takes."""
    if act_bits not in (8, 16) or w.qtype == 0 or w.in_features % 32:
        return False
    lib = native.library()
    return lib is not None and bool(lib.mi_supports_q8(w.qtype))


def quantize_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` ``(M, K)`` float32 (``K`` a multiple of 32) rounded as the integer kernels round
    it, returned as float32 ``q * dx``: per 32 columns ``dx = max|x| / L`` (``L`` 127 for 8
    bits, 32767 for 16), ``q = round(x / dx)`` halves away from zero, clamped to ``[-L, L]``
    (``round_block`` in gguf_blocks.c; computed there by
    ``mi_round_activations`` when the kernels are loaded, else with torch operations that give the
    same bits, tests/test_gguf_kernels.py). A float32 product of the
    result equals the kernel's integer product up to float32 rounding, so a row gets the same
    result whether it runs through the kernel or, packed with other rows, through the dense
    path (a pass's path depends on its total row count, which other conversations set)."""
    return _round_activations(x, bits, overwrite=False)


def _round_activations(x: torch.Tensor, bits: int, *, overwrite: bool) -> torch.Tensor:
    """:func:`quantize_activations`; with ``overwrite`` (the caller no longer needs ``x``) into
    ``x``'s own memory where the kernels do it (``mi_round_activations`` reads each 32-block
    before it writes it)."""
    lib = native.library()
    if lib is not None and x.dtype == torch.float32 and x.device.type == "cpu":
        x = x.contiguous()
        out = x if overwrite else torch.empty_like(x)
        if not lib.mi_round_activations(x.data_ptr(), x.shape[0], x.shape[1], bits, out.data_ptr(),
                                        torch.get_num_threads()):
            return out
    lim = 127.0 if bits == 8 else 32767.0
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / lim  # (M, K / 32, 1)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    f = xb * inv
    t = torch.trunc(f)
    q = (t + torch.sign(f) * ((f - t).abs() >= 0.5)).clamp(-lim, lim)  # roundf: f - t is exact
    return (q.nan_to_num(0.0) * d).reshape(x.shape)


def dense_row_chunks(w: QuantBlocks) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``W``'s rows dequantized a few at a time: ``(start, stop, W[start:stop])``, each
    ``(stop - start, K)`` float32, in order: as few chunks of equal rows (the last may be
    shorter) as keep each within :data:`DEQUANT_CHUNK_BYTES`, but never under
    :data:`DEQUANT_CHUNK_MIN_ROWS` rows unless the weight has fewer. Each chunk is a fresh
    tensor the caller may keep or drop."""
    n = w.shape[0]
    chunks = max(1, -(-n * 4 * w.in_features // DEQUANT_CHUNK_BYTES))  # ceil
    rows = max(DEQUANT_CHUNK_MIN_ROWS, -(-n // chunks))
    for i in range(0, n, rows):
        yield i, min(i + rows, n), dequantize(w, i, min(i + rows, n))


def dense_input(x: torch.Tensor, w: QuantBlocks, act_bits: int = 32, *, overwrite: bool = False) -> torch.Tensor:
    """``x`` ``(M, K)`` float32 as :func:`dequantize_chunks` multiplies it: rounded per 32
    columns as :func:`matmul` would quantize it (:func:`quantize_activations`) where
    ``act_bits`` is 8 or 16 and the kernels take ``w`` so, else ``x`` itself. ``overwrite``: the
    caller no longer needs ``x``, which may then be rounded in its own memory (a prefill's SwiGLU
    product, 10 MiB at a 512-position chunk of the default model)."""
    if integer_activations(w, act_bits):
        return _round_activations(x, act_bits, overwrite=overwrite)
    return x


def dequantize_chunks(x: torch.Tensor, w: QuantBlocks, act_bits: int = 32, *,
                      overwrite_x: bool = False) -> torch.Tensor:
    """``x @ W.T`` ``(M, N)`` float32 for ``x`` ``(M, K)`` float32 through dense float32
    matmuls of :func:`dense_row_chunks`' chunks, each written into its columns of the result:
    the prefill path, where the product is compute-bound and torch's GEMM is the faster one.
    ``x`` is first rounded as :func:`matmul` would quantize it (:func:`dense_input`; in its own
    memory with ``overwrite_x``)."""
    x = dense_input(x, w, act_bits, overwrite=overwrite_x)
    y = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    for i, j, wc in dense_row_chunks(w):
        torch.mm(x, wc.t(), out=y[:, i:j])
    return y


def blocks_from_file(raw: np.ndarray, type_name: str, in_features: int) -> QuantBlocks | None:
    """The file's bytes ``raw`` ``(N, row_bytes)`` uint8 as :class:`QuantBlocks`, or None when
    ``type_name`` is not a type of :data:`KERNEL_TYPES`.

    A contiguous, writable ``raw`` is taken as the caller's own copy and used as it is
    (``GGUFFile`` copies the blocks out of its memory map); anything else, a read-only view of a
    memory map included, is copied first, so that a model file written over or truncated later
    (SIGBUS on a mapped page) cannot reach the weights."""
    qtype = KERNEL_TYPES.get(type_name)
    if qtype is None:
        return None
    owned = raw if raw.flags.c_contiguous and raw.flags.writeable else np.array(raw, dtype=np.uint8, copy=True)
    return QuantBlocks(qtype, torch.from_numpy(owned), in_features)
