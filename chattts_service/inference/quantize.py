"""int8 linear layers whose output for a row never depends on the other rows of the batch.

Weights: int8 with one scale per output channel. Activations: int8 with one scale per row
(token), computed at run time. ``torch.ao``'s ``quantize_dynamic`` uses one activation scale
for the whole batch instead: a quiet row next to a loud one loses precision, and its result
changes with its neighbours.

Three kernels, all exact in their integer sums whatever the batch size (every layer, int4 and
fp32 ones too, is a ``Linear``):

- ``KernelLinear`` (x86 with the C++ ``kernels``, which need AVX2): the kernels' own
  product, with the RMSNorm, the activations' quantization, SwiGLU and the residual in the
  same call, faster than fbgemm at every row count measured. With
  AVX512-VNNI it takes 8-bit activations; on AVX2 alone 7-bit ones, as fbgemm does there.
  One copy of the weights.
- ``PackedInt8Linear`` (x86 without the kernels): fbgemm, with the weights packed once at load.
  Each row is divided by its own absolute maximum, so every row lies in [-1, 1] and one fixed
  activation scale (1/127, zero point 128) quantizes all of them exactly as a per-row scale
  would; the row's maximum multiplies the result back. It streams the weights faster than
  ``torch._int_mm`` at 8 rows and is no slower at one.
- ``MatmulInt8Linear``: ``torch._int_mm`` (oneDNN), where fbgemm is not built in (ARM).

The first two quantize the same weights and activations to the same integers (at the same
levels) and form the same float products in the same order: they give the same bits (a test
holds them to it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F

from chattts_service.config import QUANTIZATIONS
from chattts_service.kernels import int4
from chattts_service.kernels.int8 import Int8Packing
from chattts_service.runtime.cpu import cpu_flags


class Linear(Protocol):
    """What the hot path asks of a linear layer, whichever kernel multiplies."""

    kernel: str  # vnni, avx2, int4, fbgemm, int_mm or fp32
    rows_independent: bool  # a row's result never depends on the batch's other rows
    fused_norm: bool  # ``normed`` does the RMSNorm in the product's own call
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x, gain, eps))``."""
        ...


def _absmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.reshape(-1, x.shape[-1])
    # abs().amax() rather than vector_norm(inf): 15x faster for 8 rows here
    return rows, rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12)


def activation_levels() -> int:
    """Quantization levels either side of zero for activations on the fbgemm kernel.

    Without VNNI, fbgemm multiplies with ``vpmaddubsw``, which adds two u8*s8 products into a
    saturating int16: 8-bit activations (up to 255) with weights near +-127 can overflow it, so
    such CPUs get 7-bit activations (63 levels a side), whose pair sums always fit."""
    return 127 if "avx512_vnni" in cpu_flags() else 63


def _quantized_tensor(weight: torch.Tensor) -> torch.Tensor:
    """int8 per output channel (scale = max |row| / 127), as torch's quantized tensor."""
    scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    with warnings.catch_warnings():
        # quantized tensors are marked deprecated; their one use here is at load
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(
            weight, scale.double(), torch.zeros(weight.shape[0], dtype=torch.long), 0, torch.qint8
        )


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class PackedInt8Linear:
    """``y = x @ W.T`` on fbgemm, W int8 per output channel, packed once at load."""

    kernel = "fbgemm"
    rows_independent = True  # exact integer sums, elementwise scales

    def __init__(self, weight: torch.Tensor, kernels=None, levels: int | None = None):
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        quantized = _quantized_tensor(weight)
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        finally:
            torch.backends.quantized.engine = engine
        levels = levels or activation_levels()
        self.input_scale, self.input_zero_point = 1.0 / levels, levels + 1
        self.kernels = kernels
        self.fused_norm = kernels is not None  # the kernels' norm scales the rows

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.out_features * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_max = _absmax_rows(x)
        return self._product(rows / row_max, row_max, x.shape[:-1])

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x, gain, eps))``: with the C++ kernels, the norm fused into the
        row scaling."""
        if self.kernels is None:
            return self(_rms_norm(x, gain, eps))
        unit, row_max = self.kernels.rms_norm_unit_rows(x, gain, eps)
        return self._product(unit, row_max, x.shape[:-1])

    def _product(
        self, unit: torch.Tensor, row_max: torch.Tensor, leading: tuple[int, ...]
    ) -> torch.Tensor:
        """For rows already divided by their largest magnitude ``row_max``."""
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            unit, self.input_scale, self.input_zero_point, self.packed
        )
        return out.mul_(row_max).reshape(*leading, self.out_features)


class KernelLinear:
    """``y = x @ W.T`` with one of the C++ kernels' products: one call per layer that norms
    (optionally), quantizes each row and multiplies, with SwiGLU and the residual in the same
    call, so a decode step's small products pay no per-operator overhead. The product is the
    packing's: int8 (``Int8Packing``: weights quantized as ``PackedInt8Linear`` quantizes
    them, on the kernels' "vnni" or "avx2" instructions) or the opt-in int4
    (``kernels/int4.py``: 4-bit weights with a scale per group of inputs). Build one with
    ``int8`` or ``int4``, or with a packing made earlier (the packed cache)."""

    rows_independent = True  # exact integer sums, each row's own epilogue
    fused_norm = True

    def __init__(self, packing: Int8Packing | int4.Int4Packing, kernels):
        self.packing, self.kernels = packing, kernels
        self.out_features, self.in_features = packing.out_features, packing.in_features
        # the product for this packing: (x, packing, ...) -> out
        self._product: Callable[..., torch.Tensor]
        if isinstance(packing, int4.Int4Packing):
            self.kernel = "int4"
            self._product = partial(int4.int4_linear, kernels)
        else:
            self.kernel = packing.instructions
            self._product = kernels.int8_linear

    @classmethod
    def int8(cls, weight: torch.Tensor, kernels, instructions: str | None = None) -> KernelLinear:
        """On the kernels' int8 instructions, unless ``instructions`` names others."""
        quantized = _quantized_tensor(weight.detach().float())
        packing = Int8Packing(
            quantized.int_repr(),
            quantized.q_per_channel_scales(),
            instructions or kernels.int8_instructions,
        )
        return cls(packing, kernels)

    @classmethod
    def int4(cls, weight: torch.Tensor, kernels) -> KernelLinear:
        group = next((g for g in (int4.GROUP, 32, 16, 8) if weight.shape[1] % g == 0), None)
        if group is None:
            raise ValueError(f"int4 needs in_features divisible by 8, not {weight.shape[1]}")
        return cls(int4.Int4Packing(weight, group), kernels)

    @property
    def nbytes(self) -> int:
        return self.packing.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T``, plus ``residual`` (added in the same call) if given."""
        out = self._product(x, self.packing, residual=residual)
        return out.reshape(*x.shape[:-1], self.out_features)

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x, gain, eps))``, the norm done in the same call."""
        return self._product(x, self.packing, gain, eps).reshape(*x.shape[:-1], self.out_features)

    def swiglu(self, gate_up: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(silu(gate) * up)`` for ``gate, up = gate_up.chunk(2, -1)``, in
        one call (the MLP's down projection)."""
        out = self._product(gate_up, self.packing, residual=residual, swiglu=True)
        return out.reshape(*gate_up.shape[:-1], self.out_features)


class MatmulInt8Linear:
    """``y = x @ W.T`` with ``torch._int_mm``: W as int8 rows plus per-row scales."""

    kernel = "int_mm"
    rows_independent = True
    fused_norm = False

    def __init__(self, weight: torch.Tensor):
        weight = weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.weight = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.contiguous()  # [out]
        self.out_features, self.in_features = self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_max = _absmax_rows(x)
        row_scale = row_max.div_(127.0)
        # |rows / row_scale| <= 127 by construction, so rounding needs no clamp
        quantized = torch.round(rows / row_scale).to(torch.int8)
        # the transposed view of the [out, in] weight is the fastest layout for _int_mm here
        accumulated = torch._int_mm(quantized, self.weight.t())
        out = accumulated.float().mul_(row_scale).mul_(self.scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        return self(_rms_norm(x, gain, eps))


class FloatLinear:
    """The fp32 reference with the same interface."""

    kernel = "fp32"
    rows_independent = False  # the GEMM's blocking, so its rounding, can follow the row count
    fused_norm = False

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().float().contiguous()
        self.out_features, self.in_features = self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        return self(_rms_norm(x, gain, eps))


def _rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """The transformer's RMSNorm (one fused operator), for layers without a fused one."""
    return F.rms_norm(x, tuple(gain.shape), gain, eps)


def make_linear(weight: torch.Tensor, quantization: str, kernels=None) -> Linear:
    """The linear layer for ``quantization``. int8: the C++ ``kernels``' product where they
    are loaded, else fbgemm, else ``_int_mm`` (no fbgemm: ARM). int4: the kernels' only."""
    if quantization == "int8":
        if kernels is not None and weight.shape[1] % 4 == 0:
            return KernelLinear.int8(weight, kernels)
        return PackedInt8Linear(weight, kernels) if fbgemm_available() else MatmulInt8Linear(weight)
    if quantization == "int4":
        if kernels is None:
            raise ValueError("CHATTTS_QUANTIZE=int4 needs the C++ kernels (CHATTTS_KERNELS)")
        return KernelLinear.int4(weight, kernels)
    if quantization == "none":
        return FloatLinear(weight)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
