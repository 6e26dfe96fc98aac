"""The decode loop's C++ kernels (``csrc/kernels.cpp``): build, load, call.

- Decode attention. Attending over a sequence's cache is memory-bound: torch's CPU
  ``scaled_dot_product_attention`` reads it at about a third of the machine's bandwidth when
  called once per sequence and layer with one query (measured here: 8 rows at 250 positions,
  12.6 ms a step against 7.2 ms to merely read the same keys and values). The kernel does one
  layer for all rows in one call, writes the new token's key and value on the way, and keeps
  each (row, head) on one thread in a fixed order, so a row's result never depends on its batch.
  The cache it reads holds bf16 (half the bytes of fp32), converted to fp32 as it is read.
- RMSNorm fused with the int8 linear's per-row scaling: one pass instead of a dozen small
  operators (13 -> 3 us a row here), before the two normed projections of every layer.

Plain C++ with OpenMP and no torch headers: a compile takes about a second, and it runs on
torch's own OpenMP runtime (the same ``libgomp.so.1``, already loaded by torch). Built for
x86-64-v3 (AVX2, FMA). The container image builds it at image build time; elsewhere it is built
on first use into ``CHATTTS_KERNEL_DIR`` (default: ``_build`` beside this file). Where it cannot
be built or loaded, ``load()`` says why and the caller keeps torch's operators.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .config import cpu_flags

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kernels.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-shared", "-fPIC")
REQUIRED_CPU_FLAGS = ("avx2", "fma")
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
MODES = ("auto", "on", "off")

_pointer = ctypes.c_void_p
_int64 = ctypes.c_int64


def kernel_dir() -> Path:
    return Path(os.environ.get("CHATTTS_KERNEL_DIR") or Path(__file__).parent / "_build")


def library_path() -> Path:
    """The built library's path, named by what it was built from: source, flags, compiler."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(os.environ.get("CXX", "g++").encode())
    return kernel_dir() / f"kernels-{digest.hexdigest()[:16]}.so"


def cpu_supports(required: tuple[str, ...] = REQUIRED_CPU_FLAGS) -> bool:
    return cpu_flags().issuperset(required)


def build(path: Path | None = None) -> Path:
    """Compile the kernel (about a second); raise ``RuntimeError`` saying why it failed."""
    path = path or library_path()
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) to build the kernels")
    path.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: a concurrent builder never sees half a file
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"building the kernels failed: {result.stderr[-2000:]}")
        os.replace(built, path)
    return path


class Kernels:
    """The functions of the built library."""

    def __init__(self, path: Path):
        # torch has loaded its libgomp.so.1 already; the library's libgomp.so.1 resolves to it
        self.library = ctypes.CDLL(str(path))
        attention = self.library.chatts_decode_attention
        attention.restype = ctypes.c_int
        attention.argtypes = [_int64, _int64, _int64, _int64, ctypes.c_float, ctypes.c_int,
                              _pointer, _int64, _pointer, _int64, _pointer, _int64,
                              _pointer, _pointer, _pointer, _pointer, _pointer]
        self._attention = attention
        norm = self.library.chatts_rms_norm_unit_rows
        norm.restype = None
        norm.argtypes = [_int64, _int64, _pointer, _int64, _pointer, ctypes.c_float,
                         _pointer, _pointer]
        self._norm = norm
        quantize = self.library.chatts_quantize_rows
        quantize.restype = None
        quantize.argtypes = [_int64, _int64, _pointer, _int64, _pointer, ctypes.c_float,
                             _pointer, _pointer]
        self._quantize = quantize
        gemm = self.library.chatts_int8_gemm
        gemm.restype = ctypes.c_int
        gemm.argtypes = [_int64, _int64, _int64, _pointer, _pointer, _pointer, _pointer,
                         _pointer, _pointer, ctypes.c_int]
        self._gemm = gemm
        self.path = path
        # the int8 product needs AVX512-VNNI; without it the int8 layers stay on fbgemm
        self.int8_gemm_supported = cpu_supports(VNNI_CPU_FLAGS)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rows: "StepRows", out: torch.Tensor, scale: float) -> None:
        """Write row i's ``k[i]``/``v[i]`` [heads, dim] at position ``lengths[i]`` of its cache
        (layer ``layer``) and attend with ``q[i]`` over positions 0..lengths[i] into
        ``out[i]``. ``q``, ``k``, ``v``: [rows, heads, dim] with each row contiguous."""
        count, heads, dim = q.shape
        for tensor in (q, k, v):
            if tensor.dtype != torch.float32 or tensor.stride()[1:] != (dim, 1):
                raise ValueError("q, k, v must be float32 with contiguous rows")
        if not out.is_contiguous() or out.numel() != count * heads * dim:
            raise ValueError("out must be a contiguous [rows, heads * dim] float32 tensor")
        status = self._attention(
            count, heads, dim, layer, scale, torch.get_num_threads(),
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            rows.keys.data_ptr(), rows.values.data_ptr(), rows.capacity.data_ptr(),
            rows.lengths.data_ptr(), out.data_ptr())
        if status:
            raise ValueError({1: "head dimension above 256",
                              2: "a sequence's cache is full"}.get(status, f"error {status}"))

    def rms_norm_unit_rows(self, x: torch.Tensor, gain: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of each row of ``x`` [..., width], divided by its largest magnitude:
        returns (rows [count, width] within [-1, 1], that magnitude [count, 1])."""
        return self._prepare_rows(self._norm, torch.float32, x, gain, eps)

    def quantize_rows(self, x: torch.Tensor, gain: torch.Tensor | None = None,
                      eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``x`` [..., width] (RMSNorm-ed first with ``gain``) as u8 for ``int8_gemm``:
        round(127 * row / max|row|) + 128, and that max [count, 1]."""
        return self._prepare_rows(self._quantize, torch.uint8, x, gain, eps)

    @staticmethod
    def _prepare_rows(function, dtype: torch.dtype, x: torch.Tensor,
                      gain: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Call one of the row functions (rows, width, x, row stride, gain or NULL, eps, out,
        row_max) on ``x`` as [count, width] float32 rows, into new ``dtype`` rows."""
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        if gain is not None and (gain.dtype != torch.float32 or not gain.is_contiguous()
                                 or gain.numel() != width):
            raise ValueError("gain must be a contiguous float32 vector as wide as the rows")
        count = rows.shape[0]
        out, row_max = torch.empty(count, width, dtype=dtype), torch.empty(count, 1)
        function(count, width, rows.data_ptr(), rows.stride(0),
                 None if gain is None else gain.data_ptr(), eps, out.data_ptr(),
                 row_max.data_ptr())
        return out, row_max

    def int8_gemm(self, xq: torch.Tensor, row_max: torch.Tensor, packed: torch.Tensor,
                  column_sums: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
        """[rows, n] float32 from ``quantize_rows`` output and weights packed as
        ``quantize._vnni_packing`` packs them."""
        count, k = xq.shape
        n = weight_scale.numel()
        if not (xq.is_contiguous() and row_max.is_contiguous() and packed.is_contiguous()):
            raise ValueError("int8_gemm takes contiguous tensors")
        out = torch.empty(count, n)
        status = self._gemm(count, n, k, xq.data_ptr(), packed.data_ptr(),
                            column_sums.data_ptr(), weight_scale.data_ptr(), row_max.data_ptr(),
                            out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError({1: "int8_gemm needs n % 16 == 0 and k % 4 == 0",
                              2: "this CPU lacks AVX512-VNNI"}.get(status, f"error {status}"))
        return out


class StepRows:
    """Per-row cache addresses, capacities and lengths for one step, gathered once."""

    def __init__(self, caches, lengths: list[int]):
        if any(cache.keys.dtype != torch.bfloat16 or cache.values.dtype != torch.bfloat16
               for cache in caches):
            raise ValueError("the attention kernel reads bf16 KV caches")
        self.caches = caches  # hold the caches (and so their memory) while the step runs
        self.keys = torch.tensor([cache.keys.data_ptr() for cache in caches], dtype=torch.int64)
        self.values = torch.tensor([cache.values.data_ptr() for cache in caches],
                                   dtype=torch.int64)
        self.capacity = torch.tensor([cache.capacity for cache in caches], dtype=torch.int64)
        self.lengths = torch.tensor(lengths, dtype=torch.int64)


def load(mode: str = "auto") -> Kernels | None:
    """The kernels for ``mode`` = auto (where they can be had), on (or raise), or off (None:
    torch's operators)."""
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {MODES}, not {mode!r}")
    if mode == "off":
        return None
    try:
        if not cpu_supports():
            raise RuntimeError("this CPU lacks " + "/".join(REQUIRED_CPU_FLAGS))
        path = library_path()
        if not path.exists():
            build(path)
        return Kernels(path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        if mode == "on":
            raise RuntimeError(f"the C++ kernels are unavailable: {error}") from error
        log.warning("C++ kernels unavailable, using torch's operators: %s", error)
        return None


if __name__ == "__main__":
    # `python -m chattts_service.kernels`: build (as the container image does) and report
    print(build())
