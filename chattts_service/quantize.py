"""int8 linear layers whose output for a row never depends on the other rows of the batch.

Weights: int8 with one scale per output channel. Activations: int8 with one scale per row
(token), computed at run time. ``torch.ao``'s ``quantize_dynamic`` uses one activation scale
for the whole batch instead: a quiet row next to a loud one loses precision, and its result
changes with its neighbours (measured: 1.5% -> 11% relative error).

Two kernels, both exact in their integer sums whatever the batch size:

- ``PackedInt8Linear`` (x86): fbgemm, with the weights packed once at load. Each row is divided
  by its own absolute maximum, so every row lies in [-1, 1] and one fixed activation scale
  (1/127, zero point 128) quantizes all of them exactly as a per-row scale would; the row's
  maximum multiplies the result back. At 8 rows it streams the weights ~1.6x faster than
  ``torch._int_mm`` here (measured: 20 layers 8.2 vs 13.3 ms), and is no slower at one row.
  With AVX512-VNNI, one or two rows go through the C++ kernels' own product instead.
- ``MatmulInt8Linear``: ``torch._int_mm`` (oneDNN), where fbgemm is not built in (ARM).
"""

from __future__ import annotations

import warnings

import torch

from .config import cpu_flags

QUANTIZATIONS = ("int8", "none")


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
        return torch.quantize_per_channel(weight, scale.double(),
                                          torch.zeros(weight.shape[0], dtype=torch.long), 0,
                                          torch.qint8)


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class PackedInt8Linear:
    """``y = x @ W.T`` with W int8 per output channel, packed once at load.

    fbgemm does the product, except for one or two rows on CPUs with AVX512-VNNI, where the
    C++ ``kernels``' own product streams the weights faster (measured here, the 80 projections
    of a step at one row: 6.2 vs 7.3 ms; from 4 rows on fbgemm is as fast or faster). Both see
    the same integers and form the same float products in the same order, so they give the
    same bits (a test holds them to it), and a row's result never depends on which one ran.
    The VNNI copy of the weights costs as much memory again."""

    kernel = "fbgemm"
    rows_independent = True  # exact integer sums, elementwise scales
    VNNI_MAX_ROWS = 2

    def __init__(self, weight: torch.Tensor, kernels=None):
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        quantized = _quantized_tensor(weight)
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
        finally:
            torch.backends.quantized.engine = engine
        levels = activation_levels()
        self.input_scale, self.input_zero_point = 1.0 / levels, levels + 1
        self.kernels = kernels
        self.vnni = None
        if kernels is not None and kernels.int8_gemm_supported and self.in_features % 4 == 0:
            self.vnni = _vnni_packing(quantized)
            self.kernel = "fbgemm+vnni"

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.out_features * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_vnni(x):
            return self._vnni_product(*self.kernels.quantize_rows(x), x.shape[:-1])
        rows, row_max = _absmax_rows(x)
        return self._fbgemm_product(rows / row_max, row_max, x.shape[:-1])

    def normed(self, x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x, gain, eps))`` with the norm fused into the row scaling by the
        C++ kernels (which this layer must have been given)."""
        if self._use_vnni(x):
            return self._vnni_product(*self.kernels.quantize_rows(x, gain, eps), x.shape[:-1])
        unit, row_max = self.kernels.rms_norm_unit_rows(x, gain, eps)
        return self._fbgemm_product(unit, row_max, x.shape[:-1])

    def _use_vnni(self, x: torch.Tensor) -> bool:
        return self.vnni is not None and x.numel() <= self.VNNI_MAX_ROWS * self.in_features

    def _fbgemm_product(self, unit: torch.Tensor, row_max: torch.Tensor,
                        leading: tuple[int, ...]) -> torch.Tensor:
        """For rows already divided by their largest magnitude ``row_max``."""
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            unit, self.input_scale, self.input_zero_point, self.packed)
        return out.mul_(row_max).reshape(*leading, self.out_features)

    def _vnni_product(self, quantized: torch.Tensor, row_max: torch.Tensor,
                      leading: tuple[int, ...]) -> torch.Tensor:
        """For rows as ``kernels.quantize_rows`` gives them."""
        out = self.kernels.int8_gemm(quantized, row_max, *self.vnni)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.reshape(*leading, self.out_features)


def _vnni_packing(quantized: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fbgemm's int8 weights and scales laid out for ``kernels.int8_gemm``: blocks of 16
    channels (zero channels pad the last), 4 inputs of 16 channels per 64 bytes; the channels'
    weight sums; and the activation scale (1/127) times each channel's scale in float32, the
    product fbgemm forms."""
    weights = quantized.int_repr()
    scale = quantized.q_per_channel_scales().float()
    out_features, in_features = weights.shape
    padded = -out_features % 16
    weights = torch.cat([weights, weights.new_zeros(padded, in_features)])
    scale = torch.cat([scale, scale.new_zeros(padded)])
    blocks = weights.shape[0] // 16
    packed = weights.view(blocks, 16, in_features // 4, 4).transpose(1, 2).contiguous()
    column_sums = weights.sum(dim=1, dtype=torch.int32).contiguous()
    weight_scale = (torch.tensor(1 / 127, dtype=torch.float32) * scale).contiguous()
    return packed, column_sums, weight_scale


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
    """The linear layer for ``quantization``; int8 runs on fbgemm (with the C++ ``kernels``' VNNI
    product for one or two rows where the CPU has it), or on ``_int_mm`` without fbgemm."""
    if quantization == "int8":
        return PackedInt8Linear(weight, kernels) if fbgemm_available() \
            else MatmulInt8Linear(weight)
    if quantization == "none":
        return FloatLinear(weight)
    raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
