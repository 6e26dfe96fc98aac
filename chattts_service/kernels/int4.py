"""4-bit weights with a scale per group of inputs, for the C++ int4 product (opt-in).

``CHATTTS_QUANTIZE=int4`` halves the bytes a decode step reads (a step at batch 1 is bound by
reading the weights): each output channel's inputs in groups of ``GROUP``, each group rounded
to [-7, 7] times its own scale (its largest magnitude / 7). The activations are quantized per
row as the AVX2 int8 product quantizes them (63 levels a side); see ``csrc/int4_linear.cpp``
for the product and why its integer sums are exact. The product runs on the instructions the
kernels chose for int8 (``Kernels.int8_instructions``: VNNI or AVX2 on x86-64, I8MM, DotProd
or NEON on aarch64), with the same bits on every one.
Fidelity against fp32 is measured by ``benchmarks/engine.py --quantize int4``; the default
stays int8.
"""

from __future__ import annotations

import ctypes

import torch

from chattts_service.kernels import abi
from chattts_service.kernels.bindings import Kernels, linear_rows
from chattts_service.kernels.int8 import INT8_INSTRUCTIONS

GROUP = 64  # inputs a scale covers (the kernel takes 8..64 in steps of 8)
LEVELS = 63  # the activations' levels either side of zero, as the AVX2 int8 product's
MAX_Q = 7


class Int4Packing:
    """``weight`` [out, in] float quantized to 4 bits per group of ``group`` inputs, laid out
    as ``chatts_int4_linear`` reads it: blocks of 16 output channels (zero channels pad the
    last), per 8 inputs 64 bytes of nibbles q + 8 (the low nibble of byte [channel][j] for
    input j, the high one for input 4 + j); the scales [blocks, in / group, 16] divided by the
    activations' levels."""

    levels = LEVELS

    def __init__(self, weight: torch.Tensor, group: int = GROUP):
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        if group % 8 or not 8 <= group <= 64 or self.in_features % group:
            raise ValueError(
                f"int4 groups of {group} inputs: need 8..64 in steps of 8, dividing "
                f"in_features ({self.in_features})"
            )
        self.group = group
        padded = -self.out_features % 16
        weight = torch.cat([weight, weight.new_zeros(padded, self.in_features)])
        rows, groups = weight.shape[0], self.in_features // group
        grouped = weight.view(rows, groups, group)
        largest = grouped.abs().amax(dim=2)
        scale = largest / MAX_Q
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(grouped / safe[..., None]).clamp(-MAX_Q, MAX_Q).to(torch.int8)
        self.scale = scale.contiguous()  # [rows, groups]: for dequantized(), 1/16 of the weights
        blocks = rows // 16
        nibbles = (q + 8).to(torch.uint8).view(blocks, 16, self.in_features // 8, 2, 4)
        self.packed = (
            (nibbles[:, :, :, 0] | (nibbles[:, :, :, 1] << 4)).transpose(1, 2).contiguous()
        )  # [blocks, in / 8, 16, 4]
        # each group's scale times the activations' scale (1/levels), as the kernel multiplies
        self.scales = (
            (torch.tensor(1 / LEVELS, dtype=torch.float32) * scale)
            .view(blocks, 16, groups)
            .transpose(1, 2)
            .contiguous()
        )  # [blocks, groups, 16]

    @classmethod
    def from_parts(
        cls,
        packed: torch.Tensor,
        scales: torch.Tensor,
        scale: torch.Tensor,
        out_features: int,
        in_features: int,
        group: int,
    ) -> Int4Packing:
        """A packing made earlier (kept on disk), checked against its stated shape."""
        if group % 8 or not 8 <= group <= 64 or in_features % group:
            raise ValueError(f"int4 groups of {group} inputs do not fit {in_features} inputs")
        rows = out_features + (-out_features % 16)
        groups = in_features // group
        expected = (
            (packed, (rows // 16, in_features // 8, 16, 4), torch.uint8),
            (scales, (rows // 16, groups, 16), torch.float32),
            (scale, (rows, groups), torch.float32),
        )
        for tensor, shape, dtype in expected:
            if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
                raise ValueError(f"a packed tensor is not {dtype} {shape}")
        packing = cls.__new__(cls)
        packing.out_features, packing.in_features, packing.group = out_features, in_features, group
        packing.packed, packing.scales, packing.scale = packed, scales, scale
        return packing

    @property
    def q(self) -> torch.Tensor:
        """The 4-bit weights as int8 [rows, in] (the padding channels included), unpacked from
        ``packed``: a byte a weight, so made when asked, not kept beside the nibbles."""
        low = (self.packed & 0x0F).to(torch.int8) - 8
        high = (self.packed >> 4).to(torch.int8) - 8
        unpacked = torch.stack([low, high], dim=3)  # [blocks, in / 8, 16, 2, 4]
        return unpacked.permute(0, 2, 1, 3, 4).reshape(-1, self.in_features)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the product reads (not ``scale``, kept for ``dequantized``)."""
        return self.packed, self.scales

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)

    def dequantized(self) -> torch.Tensor:
        """The weights the packing stands for, [out, in] float32."""
        rows = self.q.shape[0]
        values = self.q.view(rows, -1, self.group).float() * self.scale[..., None]
        return values.view(rows, self.in_features)[: self.out_features]


def int4_linear(
    kernels: Kernels,
    x: torch.Tensor,
    packing: Int4Packing,
    gain: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    swiglu: bool = False,
) -> torch.Tensor:
    """``Kernels.int8_linear``'s contract on an ``Int4Packing``: [count, out_features]."""
    rows, residual = linear_rows(x, packing, gain, residual, swiglu)
    count, k = rows.shape[0], packing.in_features
    out = torch.empty(count, packing.out_features)
    arguments = abi.Int4LinearArgs(
        rows=count,
        n=packing.out_features,
        k=k,
        group=packing.group,
        x=rows.data_ptr(),
        x_row_stride=rows.stride(0),
        gain=None if gain is None else gain.data_ptr(),
        eps=eps,
        swiglu=int(swiglu),
        packed=packing.packed.data_ptr(),
        scales=packing.scales.data_ptr(),
        residual=None if residual is None else residual.data_ptr(),
        residual_stride=0 if residual is None else residual.stride(0),
        out=out.data_ptr(),
        out_stride=packing.out_features,
        levels=packing.levels,
        product=INT8_INSTRUCTIONS[kernels.int8_instructions][0],
        threads=torch.get_num_threads(),
        tuning=kernels.tuning,
    )
    kernels.check(
        kernels.library.chatts_int4_linear(ctypes.byref(arguments)),
        f"int4 on {kernels.int8_instructions}",
    )
    return out
