"""int8 weights laid out for the C++ int8 product (``csrc/int8_linear.cpp``): the default
quantization of the GPT's linear layers."""

from __future__ import annotations

import torch

from chattts_service.config import INT8_PRODUCTS
from chattts_service.kernels import abi

# the int8 product's variants (CHATTTS_INT8_PRODUCT but auto): the C++ call's code for each,
# and the activations' quantization levels either side of zero it takes (AVX2's vpmaddubsw adds
# pairs of u8 * s8 products into a saturating int16: 7-bit activations keep every pair within it;
# aarch64's three take VNNI's levels, signed, and give a row VNNI's bits)
INT8_INSTRUCTIONS = {
    "avx2": (abi.PRODUCT_AVX2, 63),
    "vnni": (abi.PRODUCT_VNNI, 127),
    "i8mm": (abi.PRODUCT_I8MM, 127),
    "dotprod": (abi.PRODUCT_DOTPROD, 127),
    "neon": (abi.PRODUCT_NEON, 127),
}
assert set(INT8_INSTRUCTIONS) == set(INT8_PRODUCTS) - {"auto"}
ARM_PRODUCTS = ("i8mm", "dotprod", "neon")  # aarch64's: they take no tuning


class Int8Packing:
    """int8 weights as ``chatts_int8_linear`` reads them for its ``instructions`` variant
    ("vnni" or "avx2", which fixes the activations' levels): blocks of 16 output channels
    (zero channels pad the last), 4 inputs of 16 channels per 64 bytes; each channel's weight
    sum times the activations' zero point; and each channel's scale divided by the levels, in
    float32. Made from ``weights`` [out, in] int8 and ``scales`` [out] float32 (one per output
    channel)."""

    def __init__(self, weights: torch.Tensor, scales: torch.Tensor, instructions: str = "vnni"):
        if instructions not in INT8_INSTRUCTIONS:
            raise ValueError(f"instructions must be one of {sorted(INT8_INSTRUCTIONS)}")
        self.instructions = instructions
        self.levels = INT8_INSTRUCTIONS[instructions][1]
        self.out_features, self.in_features = weights.shape
        if self.in_features % 4:
            raise ValueError("the int8 linear needs in_features % 4 == 0")
        padded = -self.out_features % 16
        weights = torch.cat([weights, weights.new_zeros(padded, self.in_features)])
        scales = torch.cat([scales.float(), scales.new_zeros(padded, dtype=torch.float32)])
        blocks = weights.shape[0] // 16
        self.packed = (
            weights.view(blocks, 16, self.in_features // 4, 4).transpose(1, 2).contiguous()
        )
        # the activations are u8 with zero point levels + 1: this much comes off each channel
        self.offsets = (weights.sum(dim=1, dtype=torch.int32) * (self.levels + 1)).contiguous()
        # the product fbgemm forms: the activations' scale (1/levels) times the channel's scale
        self.weight_scale = (
            torch.tensor(1 / self.levels, dtype=torch.float32) * scales
        ).contiguous()
        self.pointers = (
            self.packed.data_ptr(),
            self.offsets.data_ptr(),
            self.weight_scale.data_ptr(),
        )

    @classmethod
    def from_parts(
        cls,
        packed: torch.Tensor,
        offsets: torch.Tensor,
        weight_scale: torch.Tensor,
        out_features: int,
        in_features: int,
        instructions: str,
    ) -> Int8Packing:
        """A packing made earlier (kept on disk), checked against its stated shape."""
        if instructions not in INT8_INSTRUCTIONS:
            raise ValueError(f"instructions must be one of {sorted(INT8_INSTRUCTIONS)}")
        rows = out_features + (-out_features % 16)
        expected = (
            (packed, (rows // 16, in_features // 4, 16, 4), torch.int8),
            (offsets, (rows,), torch.int32),
            (weight_scale, (rows,), torch.float32),
        )
        for tensor, shape, dtype in expected:
            if tuple(tensor.shape) != shape or tensor.dtype != dtype or not tensor.is_contiguous():
                raise ValueError(f"a packed tensor is not {dtype} {shape}")
        packing = cls.__new__(cls)
        packing.instructions = instructions
        packing.levels = INT8_INSTRUCTIONS[instructions][1]
        packing.out_features, packing.in_features = out_features, in_features
        packing.packed, packing.offsets, packing.weight_scale = packed, offsets, weight_scale
        packing.pointers = (packed.data_ptr(), offsets.data_ptr(), weight_scale.data_ptr())
        return packing

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the product reads."""
        return self.packed, self.offsets, self.weight_scale

    @property
    def nbytes(self) -> int:
        return sum(tensor.numel() * tensor.element_size() for tensor in self.tensors)
