"""Decode-step products by a small AVX2 kernel over weights stored in blocks, on CPU.

A decode step multiplies a handful of rows (the G samples of each prompt) by every weight of
the model, so it is bound by how fast the weights stream from memory. On an AVX2 CPU (AMD
Zen 3, 2 threads) oneDNN's products on its packed weights stream 12-18 GB/s, while a plain
sum streams 33-38 GB/s. ``csrc/blocked_matmul.cpp`` streams each 16-row block of a weight
once, front to back, with the outputs in registers and the block prefetched ahead: 26-28
GB/s at 1 to 4 rows, 1.1-1.6x oneDNN's speed at 1 to 32 rows
(``benchmarks/decode_products.py``).

Its weight layout ("blocked": each 16-row block transposed) is a permutation of the weight's
own memory, so a weight that owns its memory is blocked in place, with no copy, and
unblocked exactly after (:class:`BlockedMatmul` ``in_place``).

The same library runs the step's RMSNorms (:func:`rms_norm`): on a few rows, six torch
operators cost more in dispatch than in arithmetic, and two decode threads side by side
also queue for the interpreter between them (1.07x on full fine-tuning's sampling,
``decode_step.py --against module-norms``), and SwiGLU's activation (:func:`silu_mul`). It
also holds the step's attention (``csrc/decode_attention.cpp``, called by
``decode_attention``).

The kernel is built on first use by the system's C++ compiler (``$CXX``, else ``g++``; one
second, no torch headers) into ``~/.cache/magrpo/kernels`` and loaded with ctypes. It runs
on torch's OpenMP threads, so ``torch.set_num_threads`` applies. Where it is not used (no
compiler, not an x86-64 CPU with AVX2 and FMA, AVX-512 CPUs where oneDNN is kept because
it was not measured against this kernel there, more than :data:`MAX_ROWS` rows), decode
steps keep oneDNN's products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from magrpo.speedups import onednn

logger = logging.getLogger(__name__)

BLOCK = 16  # weight rows per block (the kernel's kBlock)
MAX_ROWS = 32  # above this a decode step has enough rows for oneDNN's products to catch up

# compiled into one library: the decode step's attention (decode_attention.py) shares the
# build, the cache and the OpenMP check
CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "blocked_matmul.cpp", CSRC / "decode_attention.cpp")
HEADERS = (CSRC / "simd_math.h",)
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c++17")

_pointer, _long = ctypes.c_void_p, ctypes.c_long


def blocked_matmul_pays(rows: int) -> bool:
    """Whether a decode step of ``rows`` rows should multiply by :class:`BlockedMatmul`."""
    return onednn._CPU_CAPABILITY == "AVX2" and rows <= MAX_ROWS and library() is not None


def blockable(weights: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel can multiply by these weights (one product, concatenated)."""
    return all(
        w.device.type == "cpu"
        and w.dtype == torch.float32
        and w.dim() == 2
        and w.is_contiguous()
        and len(w) % BLOCK == 0
        and w.shape[1] == weights[0].shape[1]
        for w in weights
    )


class BlockedMatmul:
    """``x @ cat(weights).T (+ bias) (+ residual)`` (no autograd), float32 on CPU.

    ``in_place[j]``: weight j is blocked in its own memory (it must own it) and unreadable
    as a weight until :meth:`restore_weights`; the others are blocked as copies.
    """

    def __init__(
        self,
        weights: Sequence[torch.Tensor],
        bias: torch.Tensor | None = None,
        in_place: Sequence[bool] | None = None,
    ):
        self._kernel = library()
        in_place = list(in_place) if in_place is not None else [False] * len(weights)
        self._blocked: list[torch.Tensor] = []
        self._lent: list[torch.Tensor] = []
        try:
            for weight, own in zip(weights, in_place, strict=True):
                blocked = weight.detach() if own else weight.detach().clone()
                _transpose_blocks(self._kernel, blocked, to_blocked=True)
                self._blocked.append(blocked)
                if own:
                    self._lent.append(blocked)
        except BaseException:
            self.restore_weights()
            raise
        self.width = sum(len(w) for w in weights)
        self.fan_in = weights[0].shape[1]
        self.bias = bias.contiguous() if bias is not None else None
        self._weights = (_pointer * len(weights))(*(w.data_ptr() for w in self._blocked))
        self._widths = (_long * len(weights))(*(len(w) for w in weights))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self._blocked is None:
            raise RuntimeError("BlockedMatmul called after restore_weights()")
        x = _rows(x, self.fan_in)
        out = x.new_empty(len(x), self.width)
        if residual is not None:
            residual = _rows(residual, self.width)
            if len(residual) != len(x):
                raise ValueError(f"{len(residual)} residual rows for {len(x)} input rows")
        self._kernel.blocked_matmul(
            x.data_ptr(), x.stride(0), len(x), x.shape[1],
            self._weights, self._widths, len(self._widths),
            out.data_ptr(), out.stride(0),
            self.bias.data_ptr() if self.bias is not None else None,
            residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0,
        )  # fmt: skip
        return out

    def restore_weights(self) -> None:
        """The weights blocked in place, exactly as they were; the product cannot run after."""
        while self._lent:
            _transpose_blocks(self._kernel, self._lent.pop(), to_blocked=False)
        self._blocked = None


def norm_weight_supported(weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` can scale by ``weight``."""
    return weight.dtype == torch.float32 and weight.dim() == 1 and weight.is_contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of float32 rows ``x`` [rows, features] (no autograd), in one kernel
    call: a decode step's norm is otherwise six torch operators on a few rows, each costing
    more in dispatch than in arithmetic."""
    if not norm_weight_supported(weight):
        raise ValueError(f"expected a contiguous float32 [features] weight, got {weight.dtype}")
    x = _rows(x, len(weight))
    out = x.new_empty(x.shape)
    library().rms_norm_rows(
        x.data_ptr(), x.stride(0), len(x), x.shape[1], weight.data_ptr(), eps,
        out.data_ptr(), out.stride(0),
    )  # fmt: skip
    return out


def silu_mul(hidden: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation ``silu(gate) * up`` of float32 rows ``hidden`` = [gate | up]
    (no autograd), in one kernel call instead of four torch operators."""
    if hidden.dim() != 2 or hidden.shape[1] % 2:
        raise ValueError(f"expected rows [rows, 2 * half], got {tuple(hidden.shape)}")
    hidden = _rows(hidden, hidden.shape[1])
    rows, half = len(hidden), hidden.shape[1] // 2
    out = hidden.new_empty(rows, half)
    library().silu_mul_rows(
        hidden.data_ptr(), hidden.stride(0), rows, half, out.data_ptr(), out.stride(0)
    )
    return out


def _rows(x: torch.Tensor, features: int) -> torch.Tensor:
    """``x`` as the kernel reads it (it checks no bounds): float32 [rows, features], each
    row contiguous."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != features:
        raise ValueError(
            f"expected float32 rows [rows, {features}], got {x.dtype} {tuple(x.shape)}"
        )
    return x if x.stride(1) == 1 else x.contiguous()


def _transpose_blocks(kernel, weight: torch.Tensor, to_blocked: bool) -> None:
    if kernel.transpose_blocks(weight.data_ptr(), len(weight), weight.shape[1], to_blocked):
        raise MemoryError("no memory for a block copy while (un)blocking a weight")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built and loaded once per process; None (and one warning) if it cannot be."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if not x86 or not onednn._CPU_CAPABILITY.startswith(("AVX2", "AVX512")):
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        logger.warning(
            "No C++ compiler found (tried $CXX, else g++): decode steps use oneDNN's products, "
            "about 1.5x slower on AVX2 CPUs. Install g++ (e.g. apt install g++) to build the "
            "faster kernel on the next run."
        )
        return None
    try:
        kernel = ctypes.CDLL(str(_built(compiler)))
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning(
            "Could not build %s, decode steps use oneDNN's products: %s",
            ", ".join(map(str, SOURCES)),
            error,
        )
        return None
    kernel.blocked_matmul.argtypes = [
        _pointer, _long, _long, _long, _pointer, _pointer, _long, _pointer, _long,
        _pointer, _pointer, _long,
    ]  # fmt: skip
    kernel.blocked_matmul.restype = None
    kernel.transpose_blocks.argtypes = [_pointer, _long, _long, ctypes.c_int]
    kernel.rms_norm_rows.argtypes = [
        _pointer, _long, _long, _long, _pointer, ctypes.c_float, _pointer, _long,
    ]  # fmt: skip
    kernel.rms_norm_rows.restype = None
    kernel.silu_mul_rows.argtypes = [_pointer, _long, _long, _long, _pointer, _long]
    kernel.silu_mul_rows.restype = None
    # (caches: the address of decode_attention's AttentionCaches)
    kernel.decode_attention.argtypes = [
        _pointer, _pointer, _long, _pointer, _pointer, _long, _long, _pointer, _long,
    ]  # fmt: skip
    kernel.decode_attention.restype = None
    kernel.max_threads.restype = ctypes.c_int
    if kernel.max_threads() != torch.get_num_threads():
        # the kernel got an OpenMP runtime of its own (torch not built with libgomp): its
        # threads would compete with torch's
        logger.warning(
            "The decode kernel's OpenMP runtime is not torch's; decode steps use oneDNN's products."
        )
        return None
    return kernel


def _built(compiler: str) -> Path:
    """The compiled kernel in the cache, compiled now if needed (atomically: concurrent
    processes each write their own file and rename it into place)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    sources = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*sources, version, *FLAGS]).encode()).hexdigest()
    cache = Path.home() / ".cache" / "magrpo" / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache = Path(tempfile.gettempdir())
    target = cache / f"blocked_matmul-{key[:16]}.so"
    if target.exists():
        return target
    handle, partial = tempfile.mkstemp(dir=cache, suffix=".so")
    os.close(handle)
    try:
        result = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", partial],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed:\n{result.stderr[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return target
