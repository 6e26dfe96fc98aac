"""The decode loop's C++ kernels (``csrc/``, one file per kernel): load and call.

- Decode attention. Attending over a sequence's cache is memory-bound: torch's CPU
  ``scaled_dot_product_attention``, called once per sequence and layer with one query, reads
  it at a fraction of the machine's bandwidth. The kernel does one
  layer for all rows in one call, writes the new token's key and value on the way, and keeps
  each (row, head) on one thread in a fixed order, so a row's result never depends on its batch.
  The cache it reads holds bf16 (half the bytes of fp32), or int8 with a scale per position
  and head (a quarter), converted to fp32 as it is read.
  It rotates q and k (rotary position embedding) itself, as torch's operators would.
- The int8 linear layers: one call per projection that RMSNorms (where the layer has a norm
  before it) or forms SwiGLU's silu(gate) * up (the MLP's down projection), quantizes each
  row, multiplies by the int8 weights (``int8.Int8Packing``), exact in its integer sums, and adds
  the residual (see ``quantize.KernelLinear``). The product uses AVX512-VNNI where the CPU
  has it, else AVX2 (with 7-bit activations, as fbgemm uses on such CPUs); on aarch64 I8MM,
  else DotProd, else plain NEON (each with VNNI's bits).
- Sampling: ChatTTS's rules and the inverse-CDF draw for every row of a step in one call
  (``generation.sample_with_kernels``).
- RMSNorm fused with fbgemm's per-row scaling, for int8 layers on fbgemm: one pass instead of
  a dozen small operators.

The library is built by ``kernels/build.py`` (an explicit step: the image build,
``script/setup``, ``script/test``); ``load()`` only loads it. Where it is missing or cannot be
loaded, ``load()`` says why and the caller keeps torch's operators (``CHATTTS_KERNELS=auto``) or
stops (``on``). Longer than most modules: one binding a kernel, each checking every shape and
pointer before the call, beside the library's loading.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chattts_service.config import INT8_PRODUCTS, KERNEL_MODES
from chattts_service.kernels import abi
from chattts_service.kernels.build import library_path
from chattts_service.kernels.int8 import INT8_INSTRUCTIONS
from chattts_service.runtime.cpu import cpu_flags

if TYPE_CHECKING:
    from chattts_service.kernels.int8 import Int8Packing

log = logging.getLogger(__name__)

REQUIRED_CPU_FLAGS = ("avx2", "fma")  # x86-64's build; every aarch64 CPU has NEON
VNNI_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
# the int8 products, best first: auto takes the first this CPU runs
PRODUCT_PREFERENCE = ("vnni", "avx2", "i8mm", "dotprod", "neon")


def cpu_supports(required: tuple[str, ...] = REQUIRED_CPU_FLAGS) -> bool:
    return cpu_flags().issuperset(required)


def arm() -> bool:
    """Whether this is an aarch64 machine (the kernels' NEON build)."""
    return platform.machine() == "aarch64"


class KernelError(ValueError):
    """A kernel refused its arguments; the message is the library's own."""


class Kernels:
    """The functions of the built library."""

    def __init__(self, path: Path, int8_product: str = "auto"):
        # torch has loaded its libgomp.so.1 already; the library's libgomp.so.1 resolves to it
        self.library = ctypes.CDLL(str(path))
        abi.declare(self.library)  # raises AbiMismatch for a library of other sources
        self.path = path
        # the int8 product's variant: as asked, or the best this CPU runs (the library asks the
        # CPU: cpuid on x86-64, the kernel's hardware capabilities on aarch64)
        mask = self.library.chatts_int8_products()
        self.int8_products = tuple(
            name for name in PRODUCT_PREFERENCE if mask & (1 << INT8_INSTRUCTIONS[name][0])
        )
        if not self.int8_products:
            raise RuntimeError("this CPU runs none of the int8 products")
        if int8_product == "auto":
            int8_product = self.int8_products[0]
        elif int8_product not in self.int8_products:
            raise ValueError(
                f"CHATTTS_INT8_PRODUCT={int8_product}, but this CPU runs only "
                + ", ".join(self.int8_products)
            )
        self.int8_instructions = int8_product
        # how the int8 product prefetches its weights; kernels/tuning.py sets what suits the CPU
        self.tuning = abi.default_tuning()

    def __deepcopy__(self, memo) -> Kernels:
        """The same library and tuning: a module copied with its layers on the kernels (a
        decoder, say) runs on the process's one library, as the original does."""
        return self

    @property
    def has_tiles(self) -> bool:
        """Whether the VNNI product may run on AMX tiles here (the CPU has AMX-INT8 and the
        OS granted the process its tile state): the tuning's ``tiles_from`` needs it."""
        return self.int8_instructions == "vnni" and bool(self.library.chatts_amx_tiles())

    def check(self, status: int, product: str = "") -> None:
        """Raise the library's own message for a kernel that refused its arguments."""
        if status:
            message = abi.status_message(self.library, status)
            raise KernelError(f"{message} ({product.upper()})" if product else message)

    # Long: every argument is checked before the C call, where a wrong shape would corrupt
    # memory instead of raising.
    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rows: StepRows,
        out: torch.Tensor,
        scale: float,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Write row i's ``k[i]``/``v[i]`` [heads, dim] at position ``lengths[i]`` of its cache
        (layer ``layer``) and attend with ``q[i]`` over positions 0..lengths[i] into
        ``out[i]``. ``q``, ``k``, ``v``: [rows, heads, dim] with each row contiguous. With
        ``rotary`` = (cos, sin) tables [positions, dim], q and k are rotated at the new
        token's position first."""
        count, heads, dim = q.shape
        for tensor in (q, k, v):
            if tensor.dtype != torch.float32 or tensor.stride()[1:] != (dim, 1):
                raise ValueError("q, k, v must be float32 with contiguous rows")
        if not out.is_contiguous() or out.numel() != count * heads * dim:
            raise ValueError("out must be a contiguous [rows, heads * dim] float32 tensor")
        cos = sin = None
        if rotary is not None:
            rows.check_positions(check_rotary(rotary, dim))
            cos, sin = (table.data_ptr() for table in rotary)
        self.check(
            self.library.chatts_decode_attention(
                ctypes.byref(
                    abi.AttentionArgs(
                        rows=count,
                        heads=heads,
                        dim=dim,
                        layer=layer,
                        scale=scale,
                        threads=torch.get_num_threads(),
                        q=q.data_ptr(),
                        q_row_stride=q.stride(0),
                        k_new=k.data_ptr(),
                        k_row_stride=k.stride(0),
                        v_new=v.data_ptr(),
                        v_row_stride=v.stride(0),
                        **rows.pointers(),
                        cos=cos,
                        sin=sin,
                        out=out.data_ptr(),
                    )
                )
            )
        )

    def rms_norm_unit_rows(
        self, x: torch.Tensor, gain: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of each row of ``x`` [..., width], divided by its largest magnitude:
        returns (rows [count, width] within [-1, 1], that magnitude [count, 1])."""
        rows = _float_rows(x)
        _check_gain(gain, rows.shape[1])
        count, width = rows.shape
        out, row_max = torch.empty(count, width), torch.empty(count, 1)
        self.library.chatts_rms_norm_unit_rows(
            ctypes.byref(
                abi.RmsNormArgs(
                    rows=count,
                    width=width,
                    x=rows.data_ptr(),
                    x_row_stride=rows.stride(0),
                    gain=gain.data_ptr(),
                    eps=eps,
                    out=out.data_ptr(),
                    row_max=row_max.data_ptr(),
                )
            )
        )
        return out, row_max

    def depthwise_conv1d(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        bias: torch.Tensor | None,
        dilation: int,
        padding: int,
        float32: bool = False,
    ) -> torch.Tensor:
        """torch's ``conv1d(x, w, bias, padding=padding, dilation=dilation, groups=channels)``
        in bf16, to the bit, for ``x`` [batch, channels, time] lying channels-last (its
        channels adjacent: a transposed [batch, time, channels] tensor), bf16 or float32
        (rounded to bf16 first, as autocast rounds it); ``weights`` [kernel, channels] and
        ``bias`` [channels] float32 holding bf16 values. Returns [batch, channels, time] bf16,
        channels-last too. With ``float32``: the convolution in float32 (``x`` float32 as it
        is, any float32 weights, each tap a fused multiply-add from the bias in tap order), a
        float32 result."""
        batch, channels, time = x.shape
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError("the depthwise convolution reads bf16 or float32")
        if not channels_last(x):
            raise ValueError("the depthwise convolution reads channels-last inputs")
        if float32 and x.dtype != torch.float32:
            raise ValueError("a float32 depthwise convolution reads float32")
        if (
            weights.dtype != torch.float32
            or not weights.is_contiguous()
            or weights.shape[1] != channels
        ):
            raise ValueError(f"weights must be a contiguous float32 [kernel, {channels}] tensor")
        if bias is not None and (
            bias.dtype != torch.float32 or not bias.is_contiguous() or bias.shape != (channels,)
        ):
            raise ValueError(f"bias must be a contiguous float32 [{channels}] tensor")
        out = torch.empty(batch, time, channels, dtype=torch.float32 if float32 else torch.bfloat16)
        status = self.library.chatts_depthwise_conv1d(
            ctypes.byref(
                abi.DepthwiseArgs(
                    batch=batch,
                    channels=channels,
                    time=time,
                    kernel=weights.shape[0],
                    dilation=dilation,
                    padding=padding,
                    x=x.data_ptr(),
                    x_float=int(x.dtype == torch.float32),
                    weights=weights.data_ptr(),
                    bias=None if bias is None else bias.data_ptr(),
                    out=out.data_ptr(),
                    threads=torch.get_num_threads(),
                    float32=int(float32),
                )
            )
        )
        self.check(status)
        return out.transpose(1, 2)

    def rms_norm(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """LlamaRMSNorm of each row of ``x`` [..., width] with ``gain``, the shape of ``x``."""
        rows = _float_rows(x)
        _check_gain(gain, rows.shape[1])
        out = torch.empty(rows.shape)
        self.library.chatts_rms_norm(
            ctypes.byref(
                abi.RmsNormArgs(
                    rows=rows.shape[0],
                    width=rows.shape[1],
                    x=rows.data_ptr(),
                    x_row_stride=rows.stride(0),
                    gain=gain.data_ptr(),
                    eps=eps,
                    out=out.data_ptr(),
                    row_max=None,
                )
            )
        )
        return out.view(x.shape)

    # Long, for the same reason as attention: the checks before the C call.
    def int8_linear(
        self,
        x: torch.Tensor,
        packing: Int8Packing,
        gain: torch.Tensor | None = None,
        eps: float = 0.0,
        residual: torch.Tensor | None = None,
        swiglu: bool = False,
    ) -> torch.Tensor:
        """[count, packing.out_features] float32: the rows of ``x`` [..., in_features]
        (RMSNorm-ed first with ``gain``) quantized per row and multiplied by the int8 weights
        that ``packing`` holds (``quantize.KernelLinear`` makes it); plus ``residual``
        [..., out_features] if given. With ``swiglu``, rows of ``x`` hold 2 * in_features
        values, gate then up, and ``silu(gate) * up`` is multiplied."""
        rows, residual = linear_rows(x, packing, gain, residual, swiglu)
        count, k = rows.shape[0], packing.in_features
        out = torch.empty(count, packing.out_features)
        packed, offsets, weight_scale = packing.pointers
        product = INT8_INSTRUCTIONS[packing.instructions][0]
        self.check(
            self.library.chatts_int8_linear(
                ctypes.byref(
                    abi.Int8LinearArgs(
                        rows=count,
                        n=packing.out_features,
                        k=k,
                        x=rows.data_ptr(),
                        x_row_stride=rows.stride(0),
                        gain=None if gain is None else gain.data_ptr(),
                        eps=eps,
                        swiglu=int(swiglu),
                        packed=packed,
                        offsets=offsets,
                        weight_scale=weight_scale,
                        residual=None if residual is None else residual.data_ptr(),
                        residual_stride=0 if residual is None else residual.stride(0),
                        out=out.data_ptr(),
                        out_stride=packing.out_features,
                        levels=packing.levels,
                        product=product,
                        threads=torch.get_num_threads(),
                        tuning=self.tuning,
                    )
                )
            ),
            packing.instructions,
        )
        return out

    def sample(
        self,
        logits: torch.Tensor,
        parameters: torch.Tensor,
        top_k: torch.Tensor,
        min_keep: int,
        windows: torch.Tensor,
        banned: torch.Tensor,
        uniforms: torch.Tensor,
    ) -> torch.Tensor:
        """ChatTTS's sampling rules and one draw for each (row, codebook): tokens
        [rows, width]. ``logits`` [rows, width * vocabulary]; ``parameters`` [rows, 3]
        (temperature, repetition penalty, 1 - top_p); ``top_k`` [rows]; ``min_keep`` tokens
        that top-p and top-k always keep; ``windows``
        [rows, width, window] recent tokens (``vocabulary`` = none); ``banned`` [rows] a token
        to forbid or -1; ``uniforms`` [rows, width] in [0, 1)."""
        draw = SampleCall(logits, parameters, top_k, min_keep, windows, banned, uniforms)
        self.check(self.library.chatts_sample(ctypes.byref(draw.arguments)))
        return draw.tokens

    def read(self, tensors: list[torch.Tensor], prefetch_bytes: int = 0, streams: int = 1) -> int:
        """Read every byte of ``tensors`` (contiguous) once on torch's threads, doing nothing
        but fold them together: the least a pass over them costs (the benchmarks' floor).
        ``streams``: runs each thread reads side by side. Returns the fold (the same bytes give
        the same number, however read)."""
        if any(not tensor.is_contiguous() for tensor in tensors):
            raise ValueError("read takes contiguous tensors")
        buffers = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
        sizes = (ctypes.c_int64 * len(tensors))(*(t.numel() * t.element_size() for t in tensors))
        arguments = abi.ReadArgs(
            count=len(tensors),
            buffers=ctypes.addressof(buffers),
            bytes=ctypes.addressof(sizes),
            prefetch_bytes=prefetch_bytes,
            threads=torch.get_num_threads(),
            streams=streams,
        )
        self.check(self.library.chatts_read_buffers(ctypes.byref(arguments)))
        return arguments.checksum

    def peak_rate(self, loop: str, seconds: float = 0.05, repeats: int = 5) -> float:
        """Multiply-adds a second that ``loop``'s instructions ("avx2" or "vnni": the int8
        product's; "fp32": fused multiply-adds, as wide as the CPU has; "bf16": AVX512-BF16's
        pairs, as oneDNN's bf16 products issue them) do at most on torch's
        threads, from registers (``csrc/peak.cpp``): the fastest of ``repeats`` runs of about
        ``seconds`` each. Raises KernelError where the CPU lacks them."""
        kind, threads = abi.PEAK_LOOPS[loop], torch.get_num_threads()

        def run(iterations: int) -> tuple[int, float]:
            started = time.perf_counter()
            done = self.library.chatts_peak_loop(kind, iterations, threads, None)
            elapsed = time.perf_counter() - started
            if done < 0:
                self.check(-done, loop)
            return done, elapsed

        iterations = 1024
        done, elapsed = run(iterations)  # also starts the threads
        while elapsed < seconds / 4:
            iterations *= 4
            done, elapsed = run(iterations)
        iterations = max(1, int(iterations * seconds / elapsed))
        return max(done / elapsed for done, elapsed in (run(iterations) for _ in range(repeats)))


class SampleCall:
    """``Kernels.sample``'s arguments, checked, and the tokens [rows, width] it draws into;
    also what the one-call step (``layers.DecodeLayers``) samples with, where ``logits`` is
    the buffer that call writes the head's logits to. Holds every tensor the C struct points
    into."""

    def __init__(self, logits, parameters, top_k, min_keep, windows, banned, uniforms):
        rows, width, window = windows.shape
        vocabulary = logits.shape[-1] // width
        arguments = [
            (logits, torch.float32, (rows, width * vocabulary)),
            (parameters, torch.float32, (rows, 3)),
            (top_k, torch.int64, (rows,)),
            (windows, torch.int64, (rows, width, window)),
            (banned, torch.int64, (rows,)),
            (uniforms, torch.float32, (rows, width)),
        ]
        for tensor, dtype, shape in arguments:
            if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
                raise ValueError(f"sample takes contiguous {dtype} tensors of shape {shape}")
        self._held = [tensor for tensor, _, _ in arguments]
        self.logits = logits
        self.tokens = torch.empty(rows, width, dtype=torch.int64)
        self.arguments = abi.SampleArgs(
            rows=rows,
            width=width,
            vocabulary=vocabulary,
            logits=logits.data_ptr(),
            parameters=parameters.data_ptr(),
            top_k=top_k.data_ptr(),
            min_keep=min_keep,
            windows=windows.data_ptr(),
            window=window,
            banned=banned.data_ptr(),
            uniforms=uniforms.data_ptr(),
            tokens=self.tokens.data_ptr(),
            threads=torch.get_num_threads(),
        )


def channels_last(x: torch.Tensor) -> bool:
    """Whether ``x`` [batch, channels, time] lies as a transposed [batch, time, channels]
    tensor, as ``Kernels.depthwise_conv1d`` reads it."""
    batch, channels, time = x.shape
    return (
        x.stride(1) == 1
        and (time == 1 or x.stride(2) == channels)
        and (batch == 1 or x.stride(0) == channels * time)
    )


def linear_rows(x: torch.Tensor, packing, gain, residual, swiglu: bool):
    """The checks an int8 or int4 product makes before its C call: ``x`` as float32 rows as
    wide as ``packing``'s inputs (twice that with ``swiglu``), ``gain`` as wide as the rows,
    ``residual`` [rows, out_features]. Returns the rows and the residual as float32 rows (or
    None): the caller keeps both alive through the call."""
    rows = _float_rows(x)
    if gain is not None:
        _check_gain(gain, rows.shape[1])
    count, width = rows.shape
    k = packing.in_features
    if width != (2 * k if swiglu else k):
        raise ValueError(
            f"rows of {width} values for a layer of {k} inputs"
            + (" (gate and up: twice that)" if swiglu else "")
        )
    if residual is not None:
        residual = _float_rows(residual)
        if residual.shape != (count, packing.out_features):
            raise ValueError("residual must be [rows, out_features]")
    return rows, residual


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., width] as [count, width] float32 rows with contiguous values."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    return rows


def _check_gain(gain: torch.Tensor, width: int) -> None:
    if gain.dtype != torch.float32 or not gain.is_contiguous() or gain.numel() != width:
        raise ValueError("gain must be a contiguous float32 vector as wide as the rows")


class StepRows:
    """Per-row cache addresses, capacities and lengths for one step, gathered once."""

    def __init__(self, caches, lengths: list[int]):
        dtypes = {(cache.keys.dtype, cache.values.dtype) for cache in caches}
        if dtypes not in ({(torch.bfloat16,) * 2}, {(torch.int8,) * 2}):
            raise ValueError(
                "the attention kernel reads KV caches of bf16, or of int8 with "
                "scales, all of a step's the same"
            )
        for cache in caches:  # the kernel reads them position-major (KVCache's storage)
            _, heads, capacity, dim = cache.keys.shape
            runs = (capacity * heads * dim, dim, heads * dim, 1)
            major = cache.keys.stride() == cache.values.stride() == runs
            if cache.key_scales is not None:
                scales = (capacity * heads, 1, heads)
                major &= cache.key_scales.stride() == cache.value_scales.stride() == scales
            if not major:
                raise ValueError("the attention kernel reads position-major KV caches (KVCache)")
        self.caches = caches  # hold the caches (and so their memory) while the step runs

        def addresses(name: str) -> torch.Tensor:
            return torch.tensor(
                [getattr(cache, name).data_ptr() for cache in caches], dtype=torch.int64
            )

        self.keys, self.values = addresses("keys"), addresses("values")
        self.key_scales = self.value_scales = None
        if caches[0].keys.dtype == torch.int8:
            self.key_scales, self.value_scales = addresses("key_scales"), addresses("value_scales")
        self.capacity = torch.tensor([cache.capacity for cache in caches], dtype=torch.int64)
        self.lengths = torch.tensor(lengths, dtype=torch.int64)
        self.longest = max(lengths)

    def pointers(self) -> dict:
        """The kernels' arguments for these rows' caches (ChattsAttentionArgs and
        ChattsDecodeLayersArgs name them alike)."""

        def address(tensor):
            return None if tensor is None else tensor.data_ptr()

        return {
            "keys": address(self.keys),
            "values": address(self.values),
            "key_scales": address(self.key_scales),
            "value_scales": address(self.value_scales),
            "capacity": address(self.capacity),
            "lengths": address(self.lengths),
        }

    def check_positions(self, positions: int) -> None:
        """Refuse a row whose new token lies beyond rotary tables of ``positions``."""
        if self.longest >= positions:
            raise ValueError("a position beyond the rotary tables")


def check_rotary(rotary: tuple[torch.Tensor, torch.Tensor], dim: int) -> int:
    """Check (cos, sin) tables as the kernels read them, contiguous float32 [positions, dim];
    returns the positions they cover."""
    for table in rotary:
        if (
            table.dtype != torch.float32
            or not table.is_contiguous()
            or table.dim() != 2
            or table.shape[1] != dim
        ):
            raise ValueError("rotary tables must be contiguous float32 [positions, dim]")
    return min(table.shape[0] for table in rotary)


def load(mode: str = "auto", int8_product: str = "auto", directory: str = "") -> Kernels | None:
    """The kernels for ``mode`` = auto (where they can be had), on (or raise), or off (None:
    torch's operators); their int8 product ``int8_product`` (auto: the CPU's best), from the
    library built into ``directory`` (``CHATTTS_KERNEL_DIR``). Asking for a product the CPU
    cannot run raises ``ValueError``, whatever the mode."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels must be one of {KERNEL_MODES}, not {mode!r}")
    if int8_product not in INT8_PRODUCTS:
        raise ValueError(f"int8 product must be one of {INT8_PRODUCTS}, not {int8_product!r}")
    if mode == "off":
        return None
    if int8_product == "vnni" and not arm() and not cpu_supports(VNNI_CPU_FLAGS):
        raise ValueError("CHATTTS_INT8_PRODUCT=vnni, but this CPU lacks AVX512-VNNI")
    try:
        if not arm() and not cpu_supports():
            raise RuntimeError("this CPU lacks " + "/".join(REQUIRED_CPU_FLAGS))
        path = library_path(directory)
        if not path.exists():
            raise RuntimeError(
                f"no kernel library at {path} for these sources: build it with "
                "`python -m chattts_service.kernels.build` (script/setup does)"
            )
        return Kernels(path, int8_product)
    except (OSError, RuntimeError) as error:
        if mode == "on":
            raise RuntimeError(f"the C++ kernels are unavailable: {error}") from error
        log.warning("C++ kernels unavailable, using torch's operators: %s", error)
        return None
