"""int8 linear layers whose output for a row never depends on the other rows of the batch.

Weights: int8 with one scale per output channel. Activations: int8 with one scale per row
(token), computed at run time. ``torch.ao``'s ``quantize_dynamic`` uses one activation scale
for the whole batch instead: a quiet row next to a loud one loses precision, and its result
changes with its neighbours.

Three kernels, all exact in their integer sums whatever the batch size:

- ``KernelInt8Linear`` (x86 with the C++ ``kernels``, which need AVX2): the kernels' own
  product, with the RMSNorm, the activations' quantization, SwiGLU and the residual in the
  same call, faster than fbgemm at every row count measured (docs/benchmarks.md). With
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

import torch

from chattts_service.config import QUANTIZATIONS
from chattts_service.kernels import int4
from chattts_service.kernels.int8 import Int8Packing
from chattts_service.runtime.cpu import cpu_flags


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

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.out_features * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_max = _absmax_rows(x)
        return self._product(rows / row_max, row_max, x.shape[:-1])

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x, gain, eps))`` with the norm fused into the row scaling by the
        C++ kernels (which this layer must have been given)."""
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


class KernelInt8Linear:
    """``y = x @ W.T`` with the C++ kernels' int8 product: one call per layer that norms
    (optionally), quantizes each row and multiplies, so a decode step's small products pay no
    per-operator overhead. Weights quantized as ``PackedInt8Linear`` quantizes them; the
    product's variant is the kernels' (``instructions``: "vnni" or "avx2"), unless given."""

    rows_independent = True  # exact integer sums, each row's own epilogue

    def __init__(self, weight: torch.Tensor, kernels, instructions: str | None = None):
        self.kernel = instructions or kernels.int8_instructions
        quantized = _quantized_tensor(weight.detach().float())
        self.packing = Int8Packing(
            quantized.int_repr(), quantized.q_per_channel_scales(), self.kernel
        )
        self.out_features, self.in_features = self.packing.out_features, self.packing.in_features
        self.kernels = kernels

    @classmethod
    def from_packing(cls, packing: Int8Packing, kernels) -> KernelInt8Linear:
        """A layer over weights packed earlier (the packed cache)."""
        linear = cls.__new__(cls)
        linear.kernel, linear.packing, linear.kernels = packing.instructions, packing, kernels
        linear.out_features, linear.in_features = packing.out_features, packing.in_features
        return linear

    @property
    def nbytes(self) -> int:
        return self.packing.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T``, plus ``residual`` (added in the same call) if given."""
        return self.kernels.int8_linear(x, self.packing, residual=residual).reshape(
            *x.shape[:-1], self.out_features
        )

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x, gain, eps))``, the norm done in the same call."""
        return self.kernels.int8_linear(x, self.packing, gain, eps).reshape(
            *x.shape[:-1], self.out_features
        )

    def swiglu(self, gate_up: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(silu(gate) * up)`` for ``gate, up = gate_up.chunk(2, -1)``, in
        one call (the MLP's down projection)."""
        return self.kernels.int8_linear(
            gate_up, self.packing, residual=residual, swiglu=True
        ).reshape(*gate_up.shape[:-1], self.out_features)


class KernelInt4Linear:
    """``y = x @ W.T`` with the C++ kernels' int4 product (``kernels/int4.py``, opt-in): the
    same calls as ``KernelInt8Linear`` (norm, SwiGLU and residual fused), on 4-bit weights
    with a scale per group of inputs."""

    kernel = "int4"
    rows_independent = True

    def __init__(self, weight: torch.Tensor, kernels):
        group = next((g for g in (int4.GROUP, 32, 16, 8) if weight.shape[1] % g == 0), None)
        if group is None:
            raise ValueError(f"int4 needs in_features divisible by 8, not {weight.shape[1]}")
        self.packing = int4.Int4Packing(weight, group)
        self.out_features, self.in_features = self.packing.out_features, self.packing.in_features
        self.kernels = kernels

    @classmethod
    def from_packing(cls, packing: int4.Int4Packing, kernels) -> KernelInt4Linear:
        """A layer over weights packed earlier (the packed cache)."""
        linear = cls.__new__(cls)
        linear.packing, linear.kernels = packing, kernels
        linear.out_features, linear.in_features = packing.out_features, packing.in_features
        return linear

    @property
    def nbytes(self) -> int:
        return self.packing.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = int4.int4_linear(self.kernels, x, self.packing, residual=residual)
        return out.reshape(*x.shape[:-1], self.out_features)

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        out = int4.int4_linear(self.kernels, x, self.packing, gain, eps)
        return out.reshape(*x.shape[:-1], self.out_features)

    def swiglu(self, gate_up: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = int4.int4_linear(self.kernels, gate_up, self.packing, residual=residual, swiglu=True)
        return out.reshape(*gate_up.shape[:-1], self.out_features)


class MatmulInt8Linear:
    """``y = x @ W.T`` with ``torch._int_mm``: W as int8 rows plus per-row scales."""

    kernel = "int_mm"
    rows_independent = True

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


class FloatLinear:
    """The fp32 reference with the same interface."""

    kernel = "fp32"
    rows_independent = False  # the GEMM's blocking, so its rounding, can follow the row count

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().float().contiguous()
        self.out_features, self.in_features = self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


def make_linear(weight: torch.Tensor, quantization: str, kernels=None):
    """The linear layer for ``quantization``. int8: the C++ ``kernels``' product where they
    are loaded, else fbgemm, else ``_int_mm`` (no fbgemm: ARM). int4: the kernels' only."""
    if quantization == "int8":
        if kernels is not None and weight.shape[1] % 4 == 0:
            return KernelInt8Linear(weight, kernels)
        return PackedInt8Linear(weight, kernels) if fbgemm_available() else MatmulInt8Linear(weight)
    if quantization == "int4":
        if kernels is None:
            raise ValueError("CHATTTS_QUANTIZE=int4 needs the C++ kernels (CHATTTS_KERNELS)")
        return KernelInt4Linear(weight, kernels)
    if quantization == "none":
        return FloatLinear(weight)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
