"""The int8 kernels: per-row results independent of the batch, close to fp32, exact sums."""

import pytest
import torch

from chattts_service.inference.quantize import (
    FloatLinear,
    KernelLinear,
    MatmulInt8Linear,
    PackedInt8Linear,
    activation_levels,
    fbgemm_available,
    make_linear,
)
from chattts_service.kernels import bindings as cpp_kernels
from chattts_service.kernels.int8 import INT8_INSTRUCTIONS

needs_fbgemm = pytest.mark.skipif(
    not fbgemm_available(), reason="fbgemm is not built into this torch"
)
CPP = cpp_kernels.load("auto")
needs_kernels = pytest.mark.skipif(CPP is None, reason="the C++ kernels are unavailable")
needs_vnni = pytest.mark.skipif(
    CPP is None or CPP.int8_instructions != "vnni", reason="this CPU lacks AVX512-VNNI"
)
# the kernels' int8 product in each variant this CPU can run (every CPU with the kernels runs
# the AVX2 one, whatever it would choose itself)
INSTRUCTIONS = [pytest.param("vnni", marks=needs_vnni), pytest.param("avx2", marks=needs_kernels)]


def _vnni(weight):
    return KernelLinear.int8(weight, CPP, "vnni")


def _avx2(weight):
    return KernelLinear.int8(weight, CPP, "avx2")


KERNELS = [
    MatmulInt8Linear,
    pytest.param(PackedInt8Linear, marks=needs_fbgemm),
    pytest.param(_vnni, marks=needs_vnni),
    pytest.param(_avx2, marks=needs_kernels),
]


def _rows_of_every_loudness(rows: int, width: int) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(rows, width) * torch.logspace(-3, 3, rows)[:, None]


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_row_is_the_same_alone_and_in_any_batch(kernel):
    linear = kernel(torch.randn(192, 64) * 0.05)
    x = _rows_of_every_loudness(9, 64)
    together = linear(x)
    for row in range(9):
        assert torch.equal(linear(x[row : row + 1])[0], together[row])
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


@needs_fbgemm
@pytest.mark.parametrize("instructions", INSTRUCTIONS)
@pytest.mark.parametrize("shape", [(2304, 768), (768, 3072), (2504, 768), (48, 64), (40, 64)])
def test_kernel_and_fbgemm_products_give_the_same_bits(shape, instructions):
    """The kernels' product must give fbgemm's bits at the same activation levels for every
    row count (fbgemm is the reference for its integers and its float products), plain and
    with the RMSNorm fused in; and a row must give the same bits alone and in any batch (up to
    8 rows and beyond, which the VNNI product walks differently). (2504: the code head, 40:
    channels that end inside a block of 16.)"""
    torch.manual_seed(6)
    weight = torch.randn(*shape) * 0.02
    levels = INT8_INSTRUCTIONS[instructions][1]
    fbgemm = PackedInt8Linear(weight, CPP, levels=levels)
    ours = KernelLinear.int8(weight, CPP, instructions)
    x = torch.randn(20, shape[1]) * torch.logspace(-2, 2, 20)[:, None]
    gain = torch.rand(shape[1]) + 0.5
    batch, batch_normed = ours(x), ours.normed(x, gain, 1e-5)
    for rows in (1, 2, 3, 4, 5, 8, 9, 17, 20):
        assert torch.equal(ours(x[:rows]), fbgemm(x[:rows])), rows
        assert torch.equal(
            ours.normed(x[:rows], gain, 1e-5), fbgemm.normed(x[:rows], gain, 1e-5)
        ), rows
        assert torch.equal(ours(x[:rows]), batch[:rows]), rows
        assert torch.equal(ours.normed(x[-rows:], gain, 1e-5), batch_normed[-rows:]), rows
    # the fused norm equals the norm then the product, within rounding
    reference = fbgemm(torch.nn.functional.rms_norm(x, (shape[1],), gain, 1e-5))
    assert float((batch_normed - reference).norm() / reference.norm()) < 1e-3


@pytest.mark.parametrize("instructions", INSTRUCTIONS)
def test_kernel_residual_and_swiglu_in_the_same_call(instructions):
    """The residual is added as torch adds it (same bits); SwiGLU before the product is
    torch's silu(gate) * up within rounding; and a row stays the same alone or in a batch."""
    torch.manual_seed(8)
    weight = torch.randn(40, 96) * 0.05
    linear = KernelLinear.int8(weight, CPP, instructions)
    x = torch.randn(9, 1, 96) * torch.logspace(-2, 2, 9)[:, None, None]
    residual = torch.randn(9, 1, 40)
    assert torch.equal(linear(x, residual=residual), residual + linear(x))

    gate_up = torch.randn(9, 1, 192) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    fused = linear.swiglu(gate_up, residual)
    reference = residual + FloatLinear(weight)(torch.nn.functional.silu(gate) * up)
    assert fused.shape == (9, 1, 40)
    assert float((fused - reference).norm() / reference.norm()) < 0.03  # int8's error
    # silu itself: the same integers as torch's silu nearly everywhere
    unfused = residual + linear(torch.nn.functional.silu(gate) * up)
    assert float((fused - unfused).norm() / unfused.norm()) < 1e-3
    for row in range(9):
        assert torch.equal(
            linear.swiglu(gate_up[row : row + 1], residual[row : row + 1])[0], fused[row]
        )
    with pytest.raises(ValueError, match="gate and up"):
        linear.swiglu(x, residual)
    with pytest.raises(ValueError, match="residual must be"):
        linear(x, residual=residual[:, :, :8])


def test_make_linear_picks_the_fastest_int8_kernel_present():
    linear = make_linear(torch.randn(8, 8), "int8")
    assert linear.kernel == ("fbgemm" if fbgemm_available() else "int_mm")
    if CPP is not None:
        with_kernels = make_linear(torch.randn(8, 8), "int8", CPP)
        assert with_kernels.kernel == CPP.int8_instructions
        assert CPP.int8_instructions == (
            "vnni" if cpp_kernels.cpu_supports(cpp_kernels.VNNI_CPU_FLAGS) else "avx2"
        )
        # the kernels' product takes inputs in groups of four
        assert make_linear(torch.randn(8, 6), "int8", CPP).kernel == linear.kernel
    assert make_linear(torch.randn(8, 8), "none").kernel == "fp32"
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_linear(torch.randn(8, 8), "int2")
    with pytest.raises(ValueError, match="int4 needs the C"):  # int4 is the kernels' alone
        make_linear(torch.randn(8, 8), "int4")
