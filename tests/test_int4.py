"""The int4 product (opt-in): its packing, and its sums against a plain torch reference."""

import numpy as np
import pytest
import torch

from chattts_service.kernels import bindings as cpp_kernels
from chattts_service.kernels import int4


@pytest.fixture(scope="module", params=cpp_kernels.PRODUCT_PREFERENCE)
def kernels(request):
    """The kernels with each int4 product this CPU can run (it takes the int8 product's: on
    x86-64 VNNI and AVX2, on aarch64 I8MM, DotProd and NEON), each held to the same reference."""
    runs = cpp_kernels.load("on").int8_products
    if request.param not in runs:
        pytest.skip(f"this CPU lacks the {request.param} product's instructions")
    return cpp_kernels.load("on", int8_product=request.param)


def _reference(x: torch.Tensor, packing: int4.Int4Packing, residual=None) -> torch.Tensor:
    """The product as the kernel defines it, in float32 torch operations one by one: each row
    quantized to 63 levels a side of its largest magnitude, each group's exact integer sum
    times the group's scale, added in group order, times the row's largest magnitude."""
    largest = x.abs().amax(dim=1).clamp(min=1e-12)[:, None]
    inverse = torch.tensor(1.0 / np.float32(1.0 / int4.LEVELS), dtype=torch.float32)
    levels = torch.round((x / largest) * inverse).to(torch.int64)  # [rows, in]
    q = packing.q[: packing.out_features].to(torch.int64)  # [out, in]
    groups = packing.in_features // packing.group
    scales = packing.scales.transpose(1, 2).reshape(-1, groups)[: packing.out_features]
    total = torch.zeros(x.shape[0], packing.out_features)
    for g in range(groups):
        span = slice(g * packing.group, (g + 1) * packing.group)
        sums = levels[:, span] @ q[:, span].T  # exact: int64
        total = total + sums.float() * scales[:, g]
    result = total * largest
    return result if residual is None else residual + result


@pytest.mark.parametrize("group", [8, 32, 64])
@pytest.mark.parametrize("shape", [(16, 64), (40, 128), (70, 192)])
def test_int4_product_equals_the_reference_to_the_bit(kernels, group, shape):
    generator = torch.Generator().manual_seed(group + shape[0])
    weight = torch.randn(shape, generator=generator) * 0.05
    packing = int4.Int4Packing(weight, group)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(rows, shape[1], generator=generator) * 3
        residual = torch.randn(rows, shape[0], generator=generator)
        assert torch.equal(int4.int4_linear(kernels, x, packing), _reference(x, packing))
        assert torch.equal(
            int4.int4_linear(kernels, x, packing, residual=residual),
            _reference(x, packing, residual),
        )


def test_int4_rows_do_not_depend_on_their_batch(kernels):
    generator = torch.Generator().manual_seed(1)
    packing = int4.Int4Packing(torch.randn(48, 256, generator=generator))
    x = torch.randn(9, 512, generator=generator)
    gain = torch.rand(256, generator=generator) + 0.5
    together = int4.int4_linear(kernels, x, packing, swiglu=True)
    normed = int4.int4_linear(kernels, x[:, :256], packing, gain=gain, eps=1e-6)
    for row in range(9):
        alone = int4.int4_linear(kernels, x[row : row + 1], packing, swiglu=True)
        assert torch.equal(alone[0], together[row])
        assert torch.equal(
            int4.int4_linear(kernels, x[row : row + 1, :256], packing, gain=gain, eps=1e-6)[0],
            normed[row],
        )


def test_int4_packing_keeps_every_weight_and_scale(kernels):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(21, 64, generator=generator)
    weight[3, :32] = 0  # a group of zeros: scale 0, weights 0
    packing = int4.Int4Packing(weight, 32)
    assert packing.packed.shape == (2, 8, 16, 4) and packing.scales.shape == (2, 2, 16)
    assert packing.nbytes == 2 * 8 * 16 * 4 + 2 * 2 * 16 * 4  # half a byte a weight + scales
    # unpack the nibbles by hand (the layout the kernel reads): each weight rounded to its
    # group's 7 levels a side of the group's largest magnitude, the padding channels zero
    low = (packing.packed & 0x0F).to(torch.int16) - 8
    high = (packing.packed >> 4).to(torch.int16) - 8
    unpacked = torch.stack([low, high], dim=3)  # [blocks, in / 8, 16, 2, 4]
    unpacked = unpacked.permute(0, 2, 1, 3, 4).reshape(32, 64)
    largest = weight.view(21, 2, 32).abs().amax(dim=2, keepdim=True)
    expected = torch.round(weight.view(21, 2, 32) / torch.where(largest > 0, largest / 7, 1))
    assert torch.equal(unpacked[:21], expected.view(21, 64).to(torch.int16))
    assert torch.all(unpacked[21:] == 0)
    assert torch.equal(unpacked.to(torch.int8), packing.q)
    assert packing.q.abs().max() <= 7 and torch.all(packing.q[3, :32] == 0)
    # the dequantized weights are within half a step of the originals
    step = packing.scale.repeat_interleave(32, dim=1)[:21]
    assert torch.all((packing.dequantized() - weight).abs() <= step / 2 + 1e-7)


def test_int4_refuses_groups_the_kernel_cannot_take(kernels):
    for group in (4, 12, 128):
        with pytest.raises(ValueError, match="int4 groups"):
            int4.Int4Packing(torch.randn(16, 128), group)
    packing = int4.Int4Packing(torch.randn(16, 64), 64)
    packing.group = 48  # does not divide 64: the kernel says so rather than read past the row
    with pytest.raises(cpp_kernels.KernelError, match="int4 groups"):
        int4.int4_linear(kernels, torch.randn(1, 64), packing)


def test_rows_and_residuals_of_other_layouts_are_converted_not_misread(kernels):
    generator = torch.Generator().manual_seed(3)
    packing = int4.Int4Packing(torch.randn(32, 64, generator=generator))
    x = torch.randn(4, 64, generator=generator)
    residual = torch.randn(4, 32, generator=generator)
    expected = int4.int4_linear(kernels, x, packing, residual=residual)
    wide = torch.randn(32, 4, dtype=torch.float64, generator=generator)
    wide[:] = residual.T.double()  # float64 and transposed: both need a float32 copy
    assert torch.equal(int4.int4_linear(kernels, x.double(), packing, residual=wide.T), expected)
    with pytest.raises(ValueError, match="residual must be"):
        int4.int4_linear(kernels, x, packing, residual=residual[:, :16])
    with pytest.raises(ValueError, match="rows of 32 values"):
        int4.int4_linear(kernels, x[:, :32], packing)
