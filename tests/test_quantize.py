"""The int8 kernels: per-row results independent of the batch, close to fp32, exact sums."""

import pytest
import torch

from chattts_service.quantize import (FloatLinear, MatmulInt8Linear, PackedInt8Linear,
                                      activation_levels, fbgemm_available, make_linear)

KERNELS = [MatmulInt8Linear,
           pytest.param(PackedInt8Linear, marks=pytest.mark.skipif(
               not fbgemm_available(), reason="fbgemm is not built into this torch"))]


def _rows_of_every_loudness(rows: int, width: int) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(rows, width) * torch.logspace(-3, 3, rows)[:, None]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_row_is_the_same_alone_and_in_any_batch(kernel):
    linear = kernel(torch.randn(192, 64) * 0.05)
    x = _rows_of_every_loudness(9, 64)
    together = linear(x)
    for row in range(9):
        assert torch.equal(linear(x[row:row + 1])[0], together[row])
    # and in a differently shaped batch, next to other rows
    assert torch.equal(linear(x[2:5][None])[0], together[2:5])


@pytest.mark.parametrize("kernel", KERNELS)
def test_int8_is_close_to_fp32_for_quiet_and_loud_rows(kernel):
    weight = torch.randn(256, 128) * 0.05
    x = _rows_of_every_loudness(8, 128)
    reference = FloatLinear(weight)(x)
    error = (kernel(weight)(x) - reference).norm(dim=1) / reference.norm(dim=1)
    # per-row scales: a row 10^6 times quieter than its neighbour is as precise as it
    assert float(error.max()) < 0.03, error


@pytest.mark.parametrize("kernel", KERNELS)
def test_extreme_products_are_summed_exactly(kernel):
    """Weights at +-127 and inputs at the row's maximum: the integer sums are the largest the
    kernel can meet, and they must not saturate (fbgemm without VNNI adds pairs in int16)."""
    weight = torch.full((64, 256), 1.0)
    weight[1::2] = -1.0
    x = torch.ones(3, 256)
    x[1] = -1.0
    x[2, 1::2] = -1.0  # alternating signs: pairs cancel
    exact = x @ weight.T  # 256, -256 or 0
    # the float scales may round the last bit; a saturated int16 pair would be off by ~half
    torch.testing.assert_close(kernel(weight)(x), exact, rtol=1e-5, atol=1e-3)


def test_activation_levels_fit_the_cpus_multiplier():
    levels = activation_levels()
    with open("/proc/cpuinfo") as cpuinfo:
        vnni = "avx512_vnni" in cpuinfo.read()
    assert levels == (127 if vnni else 63)
    # without VNNI two u8*s8 products are added in int16: they must fit
    assert vnni or 2 * (2 * levels + 1) * 127 <= 32767


def test_make_linear_picks_the_packed_kernel_where_fbgemm_exists():
    linear = make_linear(torch.randn(8, 8), "int8")
    assert linear.kernel == ("fbgemm" if fbgemm_available() else "int_mm")
    assert make_linear(torch.randn(8, 8), "none").kernel == "fp32"
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_linear(torch.randn(8, 8), "int4")
