"""The C++ kernels against torch's operators, row by row."""

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chattts_service.inference.quantize import KernelLinear, PackedInt8Linear, fbgemm_available
from chattts_service.inference.transformer import KVCache, _rotate_half, quantize_vectors
from chattts_service.kernels import abi
from chattts_service.kernels import bindings as cpp_kernels
from chattts_service.kernels import build as kernel_build
from chattts_service.kernels.int8 import INT8_INSTRUCTIONS, Int8Packing
from chattts_service.runtime.cpu import cpu_flags

HEADS, DIM, LAYERS = 4, 64, 3
# tests that build a library of their own; tests/arm64 runs the others in an arm64 root with
# no compiler (it cross-compiles the library outside it)
needs_compiler = pytest.mark.skipif(
    shutil.which(kernel_build.compiler()) is None,
    reason=f"no C++ compiler ({kernel_build.compiler()}) here to build a library with",
)


@pytest.fixture(scope="module")
def kernel():
    # the test environment has a compiler: the kernels must build and load here, not fall back
    return cpp_kernels.load("on")


def _caches(lengths, seed=0, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    caches = []
    with torch.inference_mode():
        for length in lengths:
            cache = KVCache(LAYERS, HEADS, DIM, reserve=length + 1, dtype=dtype)
            keys = torch.randn(LAYERS, HEADS, length, DIM, generator=generator)
            values = torch.randn(LAYERS, HEADS, length, DIM, generator=generator) * 3
            for layer in range(LAYERS):
                cache.write(layer, 0, keys[layer], values[layer])
            caches.append(cache)
    return caches


def _dequantized(cache, layer, positions):
    """An int8 cache's keys and values of ``layer`` as the floats they stand for."""
    keys = cache.keys[layer, :, :positions].float() * cache.key_scales[layer, :, :positions, None]
    values = (
        cache.values[layer, :, :positions].float() * cache.value_scales[layer, :, :positions, None]
    )
    return keys, values


def _step(kernel, caches, lengths, q, k, v, layer=1, rotary=None):
    out = torch.empty(len(caches), HEADS, 1, DIM)
    with torch.inference_mode():
        kernel.attention(
            layer, q, k, v, cpp_kernels.StepRows(caches, lengths), out, 1 / math.sqrt(DIM), rotary
        )
    return out[:, :, 0]


def _rotary_tables(positions):
    """Llama's tables: cos/sin of position x frequency, the frequencies repeated twice."""
    frequencies = 1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM)
    angles = torch.outer(torch.arange(positions).float(), frequencies)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().contiguous(), angles.sin().contiguous()


def test_kernel_matches_torch_attention_and_writes_the_new_position(kernel):
    lengths = [0, 1, 37, 300]
    caches = _caches(lengths)
    q, k, v = (torch.randn(4, HEADS, DIM) for _ in range(3))
    out = _step(kernel, caches, lengths, q, k, v)
    for row, (cache, length) in enumerate(zip(caches, lengths)):
        # written as torch rounds to bf16 (to nearest even)
        assert torch.equal(cache.keys[1, :, length], k[row].bfloat16())
        assert torch.equal(cache.values[1, :, length], v[row].bfloat16())
        # the same attention as torch's over the cache's values, computed in fp32
        expected = F.scaled_dot_product_attention(
            q[row][:, None],
            cache.keys[1, :, : length + 1].float(),
            cache.values[1, :, : length + 1].float(),
        )
        torch.testing.assert_close(out[row], expected[:, 0], rtol=1e-5, atol=1e-5)
    # a sequence's first token attends only to itself
    assert torch.allclose(out[0], v[0].bfloat16().float())


@pytest.mark.parametrize("dim", [12, 40, 48, 128])
def test_heads_of_any_width_attend_as_torch_does(kernel, dim):
    """Widths off the vectorised paths too: not a multiple of 8 (12), of 8 but not 16 (40),
    of 16 (bf16 keys read in pairs) but not 64 (48), two blocks of 64 (128); lengths around
    the groups of four positions."""
    generator = torch.Generator().manual_seed(dim)
    lengths = [0, 2, 3, 4, 70]
    caches = []
    with torch.inference_mode():
        for length in lengths:
            cache = KVCache(2, HEADS, dim, reserve=length + 1, dtype=torch.bfloat16)
            cache.write(
                1,
                0,
                torch.randn(HEADS, length, dim, generator=generator),
                torch.randn(HEADS, length, dim, generator=generator),
            )
            caches.append(cache)
    q, k, v = (torch.randn(len(lengths), HEADS, dim, generator=generator) for _ in range(3))
    out = torch.empty(len(lengths), HEADS, 1, dim)
    with torch.inference_mode():
        kernel.attention(1, q, k, v, cpp_kernels.StepRows(caches, lengths), out, dim**-0.5)
    for row, (cache, length) in enumerate(zip(caches, lengths)):
        expected = F.scaled_dot_product_attention(
            q[row][:, None],
            cache.keys[1, :, : length + 1].float(),
            cache.values[1, :, : length + 1].float(),
        )
        torch.testing.assert_close(out[row, :, 0], expected[:, 0], rtol=1e-5, atol=1e-5)


def test_int8_cache_attention_matches_torch_over_what_it_stands_for(kernel):
    """An int8 cache: the new position is quantized as ``quantize_vectors`` quantizes (prefill
    writes with it), and attention equals torch's over the dequantized keys and values."""
    lengths = [0, 1, 37, 300]
    caches = _caches(lengths, dtype=torch.int8)
    q, k, v = (torch.randn(4, HEADS, DIM) for _ in range(3))
    out = _step(kernel, caches, lengths, q, k, v)
    for row, (cache, length) in enumerate(zip(caches, lengths)):
        for new, stored, scales in (
            (k, cache.keys, cache.key_scales),
            (v, cache.values, cache.value_scales),
        ):
            quantized, scale = quantize_vectors(new[row])
            assert torch.equal(stored[1, :, length], quantized)
            assert torch.equal(scales[1, :, length], scale)
        keys, values = _dequantized(cache, 1, length + 1)
        expected = F.scaled_dot_product_attention(q[row][:, None], keys, values)
        torch.testing.assert_close(out[row], expected[:, 0], rtol=1e-4, atol=1e-5)
    # and close to the attention over the floats it stores: one scale per position and head,
    # so quiet and loud positions alike keep ~7 bits (rounding to 1/127 of a vector's largest
    # value: ~0.6% of its norm, ~1% at worst here)
    torch.manual_seed(11)
    keys = torch.randn(HEADS, 300, DIM) * torch.logspace(-3, 3, 300)[None, :, None]
    values = torch.randn(HEADS, 300, DIM) * 3
    cache = KVCache(LAYERS, HEADS, DIM, reserve=301, dtype=torch.int8)
    cache.write(1, 0, keys, values)
    stored = _dequantized(cache, 1, 300)
    for original, kept in zip((keys, values), stored):
        error = (kept - original).norm(dim=-1) / original.norm(dim=-1)
        assert float(error.mean()) < 0.008 and float(error.max()) < 0.015
    query = torch.randn(HEADS, 1, DIM) * 0.1
    exact = F.scaled_dot_product_attention(query, keys, values)
    approximate = F.scaled_dot_product_attention(query, *stored)
    assert float((approximate - exact).norm() / exact.norm()) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_cache_that_grows_keeps_what_it_held(dtype):
    cache = _caches([200], dtype=dtype)[0]
    before = [
        tensor[:, :, :200].clone()
        for tensor in (cache.keys, cache.values, cache.key_scales, cache.value_scales)
        if tensor is not None
    ]
    cache.ensure(300)
    assert cache.capacity >= 300
    after = [
        tensor
        for tensor in (cache.keys, cache.values, cache.key_scales, cache.value_scales)
        if tensor is not None
    ]
    assert len(after) == (4 if dtype == torch.int8 else 2)
    for old, new in zip(before, after):
        assert new.shape[2] == cache.capacity and torch.equal(new[:, :, :200], old)
    assert len(cache.layer_keys) == LAYERS and cache.layer_keys[1].shape[1] == cache.capacity


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_row_is_bit_identical_alone_and_in_any_batch(kernel, dtype):
    lengths = [90, 5, 400, 90]
    q, k, v = (torch.randn(4, HEADS, DIM) for _ in range(3))
    together = _step(kernel, _caches(lengths, dtype=dtype), lengths, q, k, v)
    for row in range(4):
        alone = _step(
            kernel,
            _caches(lengths, dtype=dtype)[row : row + 1],
            lengths[row : row + 1],
            q[row : row + 1],
            k[row : row + 1],
            v[row : row + 1],
        )
        assert torch.equal(alone[0], together[row]), row


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_cache_is_position_major_and_the_kernel_reads_no_other(kernel, dtype):
    """A layer's positions lie in one run, every head of a position together (the kernel
    reads it as one stream); a cache laid out otherwise is refused, not misread."""
    cache = _caches([40], dtype=dtype)[0]
    size = cache.keys.element_size()
    start = cache.keys[1].data_ptr()
    for head, position in ((0, 0), (2, 5), (HEADS - 1, 39)):
        offset = (position * HEADS + head) * DIM * size
        assert cache.keys[1, head, position].data_ptr() == start + offset
    if cache.key_scales is not None:
        assert cache.key_scales[1, 2, 5].data_ptr() == cache.key_scales[1].data_ptr() + (
            (5 * HEADS + 2) * 4
        )
    lengths = [39]
    q, k, v = (torch.randn(1, HEADS, DIM) for _ in range(3))
    expected = _step(kernel, _caches(lengths, dtype=dtype), lengths, q, k, v)
    head_major = _caches(lengths, dtype=dtype)[0]
    head_major.keys = head_major.keys.contiguous()
    with pytest.raises(ValueError, match="position-major"):
        _step(kernel, [head_major], lengths, q, k, v)
    grown = _caches(lengths, dtype=dtype)[0]
    grown.ensure(500)  # a grown cache is laid out the same way, and attends the same
    assert torch.equal(_step(kernel, [grown], lengths, q, k, v), expected)
    if dtype == torch.int8:
        scales_apart = _caches(lengths, dtype=dtype)[0]
        scales_apart.key_scales = scales_apart.key_scales.contiguous()
        with pytest.raises(ValueError, match="position-major"):
            _step(kernel, [scales_apart], lengths, q, k, v)


def test_rows_may_be_strided_views(kernel):
    """q, k and v arrive as views into the projection's output, rows further apart."""
    lengths = [20, 21]
    wide = torch.randn(2, 3, HEADS, DIM)
    q, k, v = wide[:, 0], wide[:, 1], wide[:, 2]
    strided = _step(kernel, _caches(lengths), lengths, q, k, v)
    packed = _step(
        kernel, _caches(lengths), lengths, q.contiguous(), k.contiguous(), v.contiguous()
    )
    assert torch.equal(strided, packed)


def test_rotary_in_the_kernel_is_torchs_rotation_to_the_bit(kernel):
    """Rotating q and k inside the kernel gives the bits of rotating them with torch's
    operators as the transformer's own torch path does (transformers' apply_rotary_pos_emb)
    and passing them in rotated."""
    lengths = [0, 7, 300]
    cos, sin = _rotary_tables(512)
    q, k, v = (torch.randn(3, HEADS, DIM) for _ in range(3))
    positions = torch.tensor(lengths)
    c, s = cos[positions][:, None], sin[positions][:, None]  # [rows, 1, dim]

    inside, outside = _caches(lengths), _caches(lengths)
    rotated_inside = _step(kernel, inside, lengths, q, k, v, rotary=(cos, sin))
    rotated_outside = _step(
        kernel, outside, lengths, q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v
    )
    assert torch.equal(rotated_inside, rotated_outside)
    for a, b, length in zip(inside, outside, lengths):  # layer 1's positions, the new one too
        assert torch.equal(a.keys[1, :, : length + 1], b.keys[1, :, : length + 1])
        assert torch.equal(a.values[1, :, : length + 1], b.values[1, :, : length + 1])
    # and it does rotate: position 7 differs from no rotation
    assert not torch.equal(rotated_inside[1], _step(kernel, _caches(lengths), lengths, q, k, v)[1])
    with pytest.raises(ValueError, match="beyond the rotary tables"):
        _step(kernel, _caches(lengths), lengths, q, k, v, rotary=(cos[:300], sin[:300]))
    with pytest.raises(ValueError, match="rotary tables must be"):
        _step(kernel, _caches(lengths), lengths, q, k, v, rotary=(cos[:, :8], sin[:, :8]))


def test_bad_arguments_are_refused(kernel):
    caches = _caches([4])
    q = torch.randn(1, HEADS, DIM)
    with pytest.raises(ValueError, match="reads KV caches of bf16, or of int8"):
        cpp_kernels.StepRows([KVCache(LAYERS, HEADS, DIM, reserve=8)], [4])
    with pytest.raises(ValueError, match="all of a step's the same"):
        cpp_kernels.StepRows([caches[0], _caches([4], dtype=torch.int8)[0]], [4, 4])
    with pytest.raises(ValueError, match="cache is full"):
        _step(kernel, caches, [caches[0].capacity], q, q, q)
    with pytest.raises(ValueError, match="contiguous rows"):
        _step(kernel, caches, [4], q.transpose(1, 2).contiguous().transpose(1, 2), q, q)
    with pytest.raises(ValueError, match="kernels must be one of"):
        cpp_kernels.load("flash")
    assert cpp_kernels.load("off") is None


@needs_compiler
def test_build_names_the_library_by_its_sources_and_flags(tmp_path):
    path = kernel_build.library_path(str(tmp_path))
    assert path.parent == tmp_path and not path.exists()
    assert kernel_build.build(path) == path and path.exists()
    assert cpp_kernels.load("on", directory=str(tmp_path)).path == path
    assert kernel_build.library_path(str(tmp_path), kernel_build.FLAGS + ("-DUNUSED",)) != path


def test_the_serving_process_never_builds_and_auto_falls_back(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        assert cpp_kernels.load("auto", directory=str(tmp_path)) is None
    assert "kernels.build" in caplog.text  # says how to build it
    assert not any(tmp_path.iterdir())  # and did not build it
    with pytest.raises(RuntimeError, match="C\\+\\+ kernels are unavailable"):
        cpp_kernels.load("on", directory=str(tmp_path))


def test_a_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        kernel_build.build(kernel_build.library_path(str(tmp_path)))


@needs_compiler
def test_a_library_of_another_interface_is_refused_at_load(tmp_path):
    flags = kernel_build.FLAGS + ("-DCHATTS_ABI_VERSION=99",)
    path = kernel_build.build(kernel_build.library_path(str(tmp_path), flags), flags)
    with pytest.raises(abi.AbiMismatch, match="ABI version 99"):
        cpp_kernels.Kernels(path)


@needs_compiler
def test_two_fields_of_one_type_swapped_are_refused_at_load(tmp_path):
    """The same size, the same version: only the fields' offsets tell the structs apart."""
    flags = kernel_build.FLAGS + ("-DCHATTS_TEST_SWAPPED_FIELDS",)
    path = kernel_build.build(kernel_build.library_path(str(tmp_path), flags), flags)
    with pytest.raises(abi.AbiMismatch, match=r"RmsNormArgs's field 0 is rows:8:q .* rows:0:q"):
        cpp_kernels.Kernels(path)


def test_every_struct_is_mirrored_field_by_field(kernel):
    """What the load checks, shown: the library's own offsetof for every field of every struct
    is what ctypes lays out (nested structs by name, each checked on its own)."""
    for kind, struct in abi.STRUCTS.items():
        reported = kernel.library.chatts_args_layout(kind).decode().split(",")
        assert reported == abi.layout(struct), struct.__name__
    assert kernel.library.chatts_args_layout(len(abi.STRUCTS)) is None


def test_the_librarys_name_does_not_depend_on_the_serving_compiler(monkeypatch, tmp_path):
    built_with = kernel_build.library_path(str(tmp_path))
    monkeypatch.setenv("CXX", "another-compiler")
    assert kernel_build.library_path(str(tmp_path)) == built_with


def test_read_folds_every_byte_of_every_buffer(kernel):
    """The benchmarks' floor is a loop that only reads the weights: it must read each byte of
    every buffer (of any length, any prefetch, in one run or several), which its fold of them
    shows."""
    generator = torch.Generator().manual_seed(4)
    buffers = [
        torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        for size in (1, 127, 128, 4099, 1 << 20)
    ]
    fold = kernel.read(buffers)
    assert all(kernel.read(buffers, prefetch) == fold for prefetch in (1024, 4096))
    assert all(kernel.read(buffers, 1024, streams) == fold for streams in (2, 4, 7, 16))
    assert kernel.read([buffer.clone() for buffer in buffers]) == fold
    for index, at in ((0, 0), (2, 77), (3, 4098), (4, 300_000), (4, (1 << 20) - 1)):
        changed = [buffer.clone() for buffer in buffers]
        changed[index][at] ^= 0x10
        assert kernel.read(changed) != fold, (index, at)
        assert kernel.read(changed, 0, 4) != fold, (index, at)
    assert kernel.read([]) == 0
    with pytest.raises(ValueError, match="contiguous"):
        kernel.read([torch.zeros(8, 8, dtype=torch.uint8).t()])
    with pytest.raises(cpp_kernels.KernelError, match="read needs"):
        kernel.read(buffers, -64)
    for streams in (0, 17):
        with pytest.raises(cpp_kernels.KernelError, match="read needs"):
            kernel.read(buffers, 0, streams)


def _runs(kernel, product):
    """Skip unless this CPU runs the int8 product ``product``."""
    if product not in kernel.int8_products:
        pytest.skip(f"this CPU lacks the {product} product's instructions")


def test_kernel_errors_carry_the_library_message(kernel):
    packing = Int8Packing(
        torch.ones(16, 8, dtype=torch.int8), torch.ones(16), kernel.int8_instructions
    )
    packing.levels = 200  # more than any product takes
    with pytest.raises(cpp_kernels.KernelError, match="too many activation levels"):
        kernel.int8_linear(torch.randn(1, 8), packing)


def test_fused_rms_norm_matches_torch_and_lies_within_unit_range(kernel):
    torch.manual_seed(4)
    x = torch.randn(5, 1, 96) * torch.logspace(-3, 3, 5)[:, None, None]
    gain = torch.rand(96) + 0.5
    unit, row_max = kernel.rms_norm_unit_rows(x, gain, 1e-5)
    normed = F.rms_norm(x, (96,), gain, 1e-5).reshape(5, 96)
    torch.testing.assert_close(unit * row_max, normed, rtol=1e-5, atol=1e-6)
    assert torch.equal(unit.abs().amax(dim=1), torch.ones(5))  # the largest is exactly +-1
    # each row alone gives the same bits
    for row in range(5):
        alone, alone_max = kernel.rms_norm_unit_rows(x[row], gain, 1e-5)
        assert torch.equal(alone[0], unit[row]) and torch.equal(alone_max[0], row_max[row])
    with pytest.raises(ValueError, match="gain must be"):
        kernel.rms_norm_unit_rows(x, gain[:10], 1e-5)


@pytest.mark.parametrize("layer", ["fbgemm", *cpp_kernels.PRODUCT_PREFERENCE])
def test_fused_norm_then_int8_equals_norm_then_int8(kernel, layer):
    if layer == "fbgemm" and not fbgemm_available():
        pytest.skip("fbgemm is not built into this torch")
    if layer != "fbgemm":
        _runs(kernel, layer)
    torch.manual_seed(5)
    weight = torch.randn(64, 96) * 0.05
    linear = (
        PackedInt8Linear(weight, kernel)
        if layer == "fbgemm"
        else KernelLinear.int8(weight, kernel, layer)
    )
    gain = torch.rand(96) + 0.5
    for x in (torch.randn(1, 1, 96), torch.randn(3, 2, 96)):
        fused = linear.normed(x, gain, 1e-5)
        reference = F.linear(F.rms_norm(x, (96,), gain, 1e-5), weight)
        assert fused.shape == (*x.shape[:-1], 64)
        error = (fused - reference).norm() / reference.norm()
        assert float(error) < 0.03


@pytest.mark.parametrize("instructions", cpp_kernels.PRODUCT_PREFERENCE)
@pytest.mark.parametrize("rows,width", [(11, 64), (9, 532), (1, 60), (2, 532), (3, 44), (7, 68)])
def test_int8_linear_sums_exactly(kernel, instructions, rows, width):
    """Each row quantized to round(levels * x / max|x|) (levels: 63 for the AVX2 product,
    127 for the others), times the int8 weights: the integer sums are exact, every product
    finishes them alike (the sum as a float, times the channel's scale over the levels, times
    the row's largest magnitude: the same bits), and only the channels asked for are written.
    9 rows of 532 inputs: three of the AVX2 product's passes of 4 rows over each block, and
    more groups of 4 inputs than its prefetching's 64-byte steps split evenly. On aarch64 the
    row counts and widths cover each product's passes (NEON's 2 rows, DotProd's 4, I8MM's pairs
    and a last odd row) and groups of 4 inputs left over (DotProd reads 16 at once, I8MM 8)."""
    _runs(kernel, instructions)
    from chattts_service.inference.quantize import _quantized_tensor

    torch.manual_seed(7)
    weight = torch.randn(40, width)  # 40 channels: the last block of 16 is padded
    quantized = _quantized_tensor(weight)
    packing = Int8Packing(quantized.int_repr(), quantized.q_per_channel_scales(), instructions)
    most = INT8_INSTRUCTIONS[instructions][1]
    assert packing.levels == most
    x = torch.randn(rows, width)
    row_max = x.abs().amax(dim=1, keepdim=True)
    inverse_scale = 1 / torch.tensor(1 / most, dtype=torch.float32)  # in float32, as the kernel
    levels = torch.round((x / row_max) * inverse_scale)
    assert int(levels.abs().max()) == most
    out = kernel.int8_linear(x, packing)
    assert out.shape == (rows, 40)
    sums = levels.long() @ quantized.int_repr().long().T
    scale = quantized.q_per_channel_scales().float() / most * row_max
    # the integers are exact: dividing the scales back out recovers them
    assert torch.equal(torch.round(out / scale).long(), sums)
    # and each is finished in the one order every product keeps
    assert torch.equal(out, sums.float() * packing.weight_scale[:40] * row_max)
    with pytest.raises(ValueError, match=f"rows of {width - 32} values"):
        kernel.int8_linear(x[:, :-32], packing)


def _hardware_capabilities() -> tuple[int, int]:
    """AT_HWCAP and AT_HWCAP2 from /proc/self/auxv (aarch64: what the CPU runs)."""
    import struct

    words = struct.iter_unpack("<QQ", Path("/proc/self/auxv").read_bytes())
    entries = dict(words)
    return entries.get(16, 0), entries.get(26, 0)


@pytest.mark.skipif(not cpp_kernels.arm(), reason="aarch64's int8 products")
def test_the_int8_product_on_aarch64_is_the_best_the_cpu_runs(kernel):
    """I8MM where the CPU has it (and DotProd), else DotProd, else NEON: as the kernel's
    hardware capabilities say (qemu's -cpu max has both; cortex-a53 neither)."""
    hwcap, hwcap2 = _hardware_capabilities()
    dotprod, i8mm = bool(hwcap & (1 << 20)), bool(hwcap2 & (1 << 13))
    expected = ("i8mm",) * (dotprod and i8mm) + ("dotprod",) * dotprod + ("neon",)
    assert kernel.int8_products == expected
    assert kernel.int8_instructions == expected[0]
    for product in ("i8mm", "dotprod"):
        if product not in expected:
            with pytest.raises(ValueError, match="this CPU runs only neon"):
                cpp_kernels.load("on", product)
    for product in ("vnni", "avx2"):
        with pytest.raises(ValueError, match="runs only"):
            cpp_kernels.load("on", product)


@pytest.mark.skipif(cpp_kernels.arm(), reason="x86-64's int8 products")
def test_the_int8_product_is_the_cpus_best_unless_chosen(kernel):
    from chattts_service.inference.quantize import make_linear

    vnni_cpu = cpp_kernels.cpu_supports(cpp_kernels.VNNI_CPU_FLAGS)
    assert kernel.int8_instructions == ("vnni" if vnni_cpu else "avx2")
    avx2 = cpp_kernels.load("on", "avx2")
    assert avx2.int8_instructions == "avx2"
    assert make_linear(torch.randn(16, 8), "int8", avx2).kernel == "avx2"
    if vnni_cpu:
        assert cpp_kernels.load("on", "vnni").int8_instructions == "vnni"
    else:
        with pytest.raises(ValueError, match="lacks AVX512-VNNI"):
            cpp_kernels.load("auto", "vnni")
    with pytest.raises(ValueError, match="int8 product must be one of"):
        cpp_kernels.load("on", "avx512")
    with pytest.raises(ValueError, match="runs only"):
        cpp_kernels.load("on", "i8mm")


@pytest.mark.parametrize("loop", ["avx2", "vnni", "fp32", "bf16"])
def test_peak_loops_count_the_multiply_adds_they_do(kernel, loop):
    """The benchmarks' arithmetic bound: a loop reports its instructions' multiply-adds
    (iterations x threads x its own per iteration), its results change with every iteration
    (nothing was left out of the loop), and a CPU without the instructions refuses it."""
    import ctypes

    kind = abi.PEAK_LOOPS[loop]
    if cpp_kernels.arm():
        with pytest.raises(cpp_kernels.KernelError, match="lacks"):
            kernel.peak_rate(loop)
        return
    if (loop == "vnni" and kernel.int8_instructions != "vnni") or (
        loop == "bf16" and "avx512_bf16" not in cpu_flags()
    ):
        with pytest.raises(cpp_kernels.KernelError, match="lacks"):
            kernel.peak_rate(loop)
        return

    def run(iterations, threads=2):
        checksum = ctypes.c_uint64()
        done = kernel.library.chatts_peak_loop(kind, iterations, threads, ctypes.byref(checksum))
        return done, checksum.value

    per_iteration = {"avx2": 256, "vnni": 1024, "bf16": 384}.get(loop)
    done, checksum = run(1000)
    assert done > 0 and done % 2000 == 0
    if per_iteration:
        assert done == per_iteration * 1000 * 2
    assert run(2000)[0] == 2 * done and run(1000, threads=1)[0] == done // 2
    assert run(1001)[1] != checksum and run(1000)[1] == checksum
    assert 0 < kernel.peak_rate(loop, seconds=0.01, repeats=2) < float("inf")
    for refused in ((99, 10, 1), (kind, 0, 1), (kind, 10, 0)):
        with pytest.raises(cpp_kernels.KernelError, match="peak loop needs"):
            kernel.check(-kernel.library.chatts_peak_loop(*refused, None))


def _the_check_tells(matches: bool, equal_here: bool) -> None:
    """The decoder's check (``matches``, on 64 channels) against torch's bits on this test's
    shape (``equal_here``). It must never pass a kernel that differs from torch. On x86-64 it
    must also pass one that matches (oneDNN sums the taps alike at every channel count); on
    aarch64 torch's convolution may sum 64 channels in another order than more, so the check
    may refuse a kernel that matches here, and the decoder keeps torch's convolution."""
    if matches:
        assert equal_here
    if not cpp_kernels.arm():
        assert matches == equal_here


def _depthwise_in_order(x, weight, bias, dilation, padding, float32=False):
    """The depthwise convolution as the kernel forms it, in float64 rounded to float32 after
    every tap: each output starts at its bias and adds the taps' products in tap order (a
    product of two float32 values is exact in float64, so this is a fused multiply-add's
    rounding, but for a sum that float64 rounds before float32 does, about one in 2^29), then
    is rounded to bf16 (unless ``float32``). ``x`` [batch, channels, time] holding bf16 values,
    or any float32 with ``float32``."""
    batch, channels, time = x.shape
    kernel = weight.shape[-1]
    padded = F.pad(x.double(), (padding, padding))
    acc = bias.double()[None, :, None].expand(batch, channels, time).float()
    for tap in range(kernel):
        window = padded[:, :, tap * dilation : tap * dilation + time]
        acc = (acc.double() + window * weight.double()[None, :, 0, tap, None]).float()
    return acc if float32 else acc.bfloat16()


@pytest.mark.parametrize(
    "channels,time,dilation", [(512, 96, 1), (512, 96, 2), (100, 37, 1), (24, 5, 2), (48, 1, 1)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_depthwise_conv1d_sums_its_taps_in_order_from_the_bias(
    kernel, channels, time, dilation, dtype
):
    """bf16 or float32 channels-last inputs (float32 rounded to bf16 first), every channel
    count (vectors of 16 channels and the rest one by one), taps that fall in the padding at
    both ends; the output channels-last too. Where this machine's torch (oneDNN) sums the
    taps in the same order, the kernel gives its convolution's bits under autocast, which is
    what the audio decoder checks before using it."""
    from chattts_service.inference.decoder_layers import _depthwise_matches

    generator = torch.Generator().manual_seed(channels + time + dilation)
    weight = (torch.randn(channels, 1, 7, generator=generator) * 0.3).bfloat16()
    bias = torch.randn(channels, generator=generator).bfloat16()
    scales = torch.logspace(-3, 3, channels)
    x = (torch.randn(3, time, channels, generator=generator) * scales).to(dtype).transpose(1, 2)
    padding = 3 * dilation
    taps = weight.float()[:, 0].t().contiguous()
    out = kernel.depthwise_conv1d(x, taps, bias.float(), dilation, padding)
    assert out.shape == (3, channels, time) and out.dtype == torch.bfloat16
    assert out.stride(1) == 1  # channels-last, as its input
    assert torch.equal(out, _depthwise_in_order(x.bfloat16(), weight, bias, dilation, padding))
    no_bias = kernel.depthwise_conv1d(x, taps, None, dilation, padding)
    zero = torch.zeros(channels, dtype=torch.bfloat16)
    assert torch.equal(no_bias, _depthwise_in_order(x.bfloat16(), weight, zero, dilation, padding))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torchs = F.conv1d(x, weight, bias, padding=padding, dilation=dilation, groups=channels)
    if channels >= 64:  # the decoder's check runs on 64 channels; oneDNN may differ on fewer
        _the_check_tells(_depthwise_matches(kernel, 7, dilation), torch.equal(out, torchs))


@pytest.mark.parametrize(
    "channels,time,dilation", [(512, 96, 1), (512, 96, 2), (100, 37, 1), (24, 5, 2), (48, 1, 1)]
)
def test_depthwise_conv1d_in_float32_fuses_each_tap_in_order_from_the_bias(
    channels, time, dilation, kernel
):
    """The fp32 and int8 decoders' depthwise convolutions: float32 in (not rounded), float32
    weights and out, each tap a fused multiply-add in tap order from the bias, every channel
    count; where this machine's torch forms them so too, its float32 convolution's bits, which
    the decoder checks before using the kernel."""
    from chattts_service.inference.decoder_layers import _depthwise_matches

    generator = torch.Generator().manual_seed(channels + time + dilation + 1)
    weight = torch.randn(channels, 1, 7, generator=generator) * 0.3
    bias = torch.randn(channels, generator=generator)
    scales = torch.logspace(-3, 3, channels)
    x = (torch.randn(3, time, channels, generator=generator) * scales).transpose(1, 2)
    padding = 3 * dilation
    taps = weight[:, 0].t().contiguous()
    out = kernel.depthwise_conv1d(x, taps, bias, dilation, padding, float32=True)
    assert out.shape == (3, channels, time) and out.dtype == torch.float32
    assert out.stride(1) == 1  # channels-last, as its input
    expected = _depthwise_in_order(x, weight, bias, dilation, padding, float32=True)
    assert torch.equal(out, expected)
    no_bias = kernel.depthwise_conv1d(x, taps, None, dilation, padding, float32=True)
    zero = torch.zeros(channels)
    assert torch.equal(
        no_bias, _depthwise_in_order(x, weight, zero, dilation, padding, float32=True)
    )
    # not rounded to bf16 on the way in, as the bf16 convolution rounds it
    assert not torch.equal(out, kernel.depthwise_conv1d(x, taps, bias, dilation, padding).float())
    torchs = F.conv1d(x, weight, bias, padding=padding, dilation=dilation, groups=channels)
    if channels >= 64:  # the decoder's check runs on 64 channels; oneDNN may differ on fewer
        matches = _depthwise_matches(kernel, 7, dilation, float32=True)
        _the_check_tells(matches, torch.equal(out, torchs))
    with pytest.raises(ValueError, match="reads float32"):
        kernel.depthwise_conv1d(x.bfloat16(), taps, bias, dilation, padding, float32=True)


def test_the_float32_depthwise_check_tells_a_fused_multiply_add(kernel):
    """In float32 the decoder's check plants a second output: (1 + 2^-12)^2 - 1 is
    2^-11 + 2^-24 with the product fused into its sum, 2^-11 with the product rounded first,
    so a convolution that rounds its products fails the check."""
    near_one = 1 + 2**-12
    x = torch.zeros(1, 7, 16)
    x[0, 3, 0] = near_one
    weight, bias = torch.zeros(16, 1, 7), torch.zeros(16)
    weight[0, 0, 3], bias[0] = near_one, -1.0
    out = kernel.depthwise_conv1d(
        x.transpose(1, 2), weight[:, 0].t().contiguous(), bias, 1, 3, float32=True
    )
    assert float(out[0, 0, 3]) == 2**-11 + 2**-24
    rounded_first = torch.tensor(near_one) * torch.tensor(near_one)
    assert float(rounded_first - 1.0) == 2**-11


def test_depthwise_conv1d_refuses_what_it_cannot_read(kernel):
    taps, bias = torch.randn(7, 16), torch.randn(16)
    plain = torch.randn(2, 16, 10)  # channels-first: the kernel reads channels-last only
    with pytest.raises(ValueError, match="channels-last"):
        kernel.depthwise_conv1d(plain, taps, bias, 1, 3)
    channels_last = torch.randn(2, 10, 16).transpose(1, 2)
    with pytest.raises(ValueError, match="bf16 or float32"):
        kernel.depthwise_conv1d(channels_last.double(), taps, bias, 1, 3)
    with pytest.raises(ValueError, match="weights must be"):
        kernel.depthwise_conv1d(channels_last, torch.randn(7, 8), bias, 1, 3)
    with pytest.raises(cpp_kernels.KernelError, match="dilation >= 1"):
        kernel.depthwise_conv1d(channels_last, taps, bias, 0, 3)


@pytest.mark.parametrize("dilation", [1, 2])
def test_the_depthwise_check_has_an_output_that_tells_the_order(kernel, dilation):
    """The decoder's check before it uses the kernel plants one output whose bits depend on
    the order of the sums: bias 1 and these products give 1 in tap order from the bias (the
    kernel's), and 1 + 2^-7 in reverse, in pairs or with the bias last, where random values
    differ in a few outputs in a million."""
    products = [2**-24, 2**-9, 2**-24, 0.0, 2**-23, -(2**-24), 2**-9]
    x = torch.zeros(1, 7 * dilation + 1, 16)
    for tap, product in enumerate(products):
        x[0, tap * dilation, 0] = product
    x = x.bfloat16().transpose(1, 2)
    weight, bias = torch.ones(16, 1, 7).bfloat16(), torch.ones(16).bfloat16()
    taps = weight.float()[:, 0].t().contiguous()
    out = kernel.depthwise_conv1d(x, taps, bias.float(), dilation, 3 * dilation)
    assert float(out[0, 0, 3 * dilation]) == 1.0
    assert torch.equal(out, _depthwise_in_order(x, weight, bias, dilation, 3 * dilation))
    for order, bias_last in (
        (range(6, -1, -1), False),
        ((1, 0, 3, 2, 5, 4, 6), False),
        (range(7), True),
    ):
        acc = torch.tensor(0.0 if bias_last else 1.0)
        for tap in order:
            acc = (acc.double() + products[tap]).float()
        if bias_last:
            acc = (acc.double() + 1.0).float()
        assert float(acc.bfloat16()) == 1 + 2**-7
