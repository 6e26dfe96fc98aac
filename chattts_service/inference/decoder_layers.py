"""The decoder's layers on the C++ kernels and oneDNN: the ConvNeXt blocks' pointwise linears
in int8 (``Int8Pointwise``) or bf16 with the bias fused (``Bf16Linear``), their depthwise
convolutions on the kernels (``KernelDepthwise``), and the probes that decide, once per process,
whether each gives the bits it replaces on this CPU and torch build."""

from __future__ import annotations

import functools

import torch

from chattts_service.inference.quantize import KernelLinear
from chattts_service.kernels.bindings import channels_last
from chattts_service.runtime.cpu import cpu_flags

# the rows oneDNN is told a packed linear weight will meet (1 to 2,048 read alike on a Zen 4)
PACK_ROWS = 256


class Int8Pointwise(torch.nn.Module):
    """A ConvNeXt block's pointwise ``nn.Linear`` on the C++ kernels' int8 product (see
    ``AudioDecoder.hold_in_int8``): ``x @ W.T + bias`` for x [..., in_features], each row
    quantized on its own."""

    bias: torch.Tensor | None  # a buffer

    def __init__(self, linear: torch.nn.Linear, kernels):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product: KernelLinear = KernelLinear.int8(linear.weight, kernels)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return self.product(x)
        # the bias as the product's residual, a row stride of 0: added in the same call to the
        # rounded product, the same IEEE sum as ``out + bias``, without another pass over out
        return self.product(x, residual=self.bias.expand(*x.shape[:-1], self.out_features))


class Bf16Linear(torch.nn.Module):
    """A bf16 ``nn.Linear`` with its bias added inside oneDNN's product (``mkldnn::
    _linear_pointwise``), where ``F.linear`` first copies the bias into every output row and
    then adds the product to it (another pass over the output): the same bits, checked once
    per process by ``fused_bias_linear``. The input is rounded to bf16 first, as autocast
    rounds it for ``F.linear``. Faster than ``F.linear`` on the decoder's shapes.

    ``pack`` then holds the weight in oneDNN's own blocked layout (``mkldnn::
    _reorder_linear_weight``, as torch's compiler packs it) in place of the plain one: a plain
    weight is reordered into that layout on every call, so packed decodes are faster (caches
    evicted before each, as a step evicts them). Not on a CPU with AMX
    (``packs_linear_weights``)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed: torch.Tensor | None = None

    def pack(self, check: bool = True) -> bool:
        """Hold the weight packed, where this layer's product then gives the plain weight's
        bits (rows of every remainder of oneDNN's blocks, compared on the spot: a packing
        whose kernels round otherwise keeps the plain weight); whether it does. oneDNN picks
        its kernels by shape, so a layer of a shape already checked may skip the check
        (``check=False``): on a Zen 4 the 40 layers packed and checked took 0.13 s of a
        start, packed and checked once a shape 0.05 s."""
        generator = torch.Generator().manual_seed(0)
        try:
            with torch.inference_mode():
                packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)
                for rows in (1, 7, 40) if check else ():
                    x = torch.randn(2, rows, self.in_features, generator=generator).bfloat16()
                    if not torch.equal(self._product(x, packed), self._product(x, self.weight)):
                        return False
        except (AttributeError, RuntimeError, NotImplementedError):
            return False
        self.packed = packed
        del self.weight  # the plain copy's memory goes, the packed one in its place
        return True

    def _product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(torch.bfloat16).contiguous()
        return self._product(x, self.packed if self.packed is not None else self.weight)


class KernelDepthwise(torch.nn.Module):
    """A ConvNeXt block's depthwise ``nn.Conv1d`` on the C++ kernels
    (``Kernels.depthwise_conv1d``) where its input lies channels-last, as every block but the
    first of a stack hands it on (the residual sum of a transposed tensor): the bits of torch's
    convolution, with no transposes around it, and an output the block's layer norm reads
    without copying. bf16 weights: as torch computes under autocast (a bf16 decoder); float32
    weights: as torch computes in float32 (the fp32 and int8 decoders), and under autocast
    (an fp32 decoder asked for bf16) the convolution itself. Any other input goes to the
    convolution itself too."""

    def __init__(self, conv: torch.nn.Conv1d, kernels):
        super().__init__()
        self.conv, self.kernels = conv, kernels
        self.float32 = conv.weight.dtype == torch.float32
        self.taps = conv.weight.detach().float()[:, 0].t().contiguous()  # [kernel, channels]
        self.bias_values = None if conv.bias is None else conv.bias.detach().float().contiguous()
        self.dilation, self.padding = conv.dilation[0], conv.padding[0]

    @staticmethod
    def suits(module, kernels) -> bool:
        """A depthwise bf16 or float32 ``Conv1d`` of stride 1 and zero padding, for which the
        kernels give what torch gives on this machine."""
        return (
            type(module) is torch.nn.Conv1d
            and module.weight.dtype in (torch.bfloat16, torch.float32)
            and module.groups == module.in_channels == module.out_channels
            and module.stride == (1,)
            and module.padding_mode == "zeros"
            and isinstance(module.padding, tuple)
            and _depthwise_matches(
                kernels,
                module.kernel_size[0],
                module.dilation[0],
                float32=module.weight.dtype == torch.float32,
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        readable = (
            x.dtype == torch.float32 and not torch.is_autocast_cpu_enabled()
            if self.float32
            else x.dtype in (torch.bfloat16, torch.float32)
        )
        if not readable or not channels_last(x):
            return self.conv(x)
        return self.kernels.depthwise_conv1d(
            x, self.taps, self.bias_values, self.dilation, self.padding, float32=self.float32
        )


def on_kernel_depthwise(modules, kernels) -> None:
    """Every ConvNeXt block's depthwise convolution in ``modules`` on the kernels
    (``KernelDepthwise``), where they give torch's bits for its kernel size, dilation and
    weights' type, as its weights are now; with no ``kernels``, every one back on torch."""
    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, KernelDepthwise):
                    child = child.conv
                    setattr(parent, name, child)
                if kernels is not None and KernelDepthwise.suits(child, kernels):
                    setattr(parent, name, KernelDepthwise(child, kernels))


_DEPTHWISE_CHECKED: dict[tuple, bool] = {}


def _depthwise_matches(kernels, kernel: int, dilation: int, float32: bool = False) -> bool:
    """Whether the kernels' depthwise convolution gives torch's bits for this kernel size and
    dilation, checked once per process (oneDNN could sum the taps in another order on another
    CPU, and a torch without it computes otherwise): bf16 weights under autocast, on bf16 and
    float32 inputs, or (``float32``) all in float32. Another order changes only a few outputs
    in a million of random values, so one output is made to tell: bias 1 and products 2^-24,
    2^-9, 2^-24, 0, 2^-23, -2^-24, 2^-9 give 1 when added in tap order from the bias, and
    1 + 2^-7 when the taps go in reverse, in pairs, or before the bias. In float32 a second
    tells a fused multiply-add from a product rounded before its sum: (1 + 2^-12)^2 - 1 is
    2^-11 + 2^-24 fused, 2^-11 rounded first. Random values of many magnitudes fill the rest."""
    key = (id(kernels), kernel, dilation, float32)
    if key not in _DEPTHWISE_CHECKED:
        generator = torch.Generator().manual_seed(kernel * 100 + dilation)
        channels, time, padding = 64, 512, dilation * (kernel // 2)
        weight = torch.randn(channels, 1, kernel, generator=generator) * 0.3
        bias = torch.randn(channels, generator=generator)
        values = torch.randn(2, time, channels, generator=generator)
        values *= torch.logspace(-3, 3, channels)
        if kernel == 7:  # the telling output: channel 0 at frame `padding`, every tap inside
            products = [2**-24, 2**-9, 2**-24, 0.0, 2**-23, -(2**-24), 2**-9]
            weight[0, 0], bias[0] = 1.0, 1.0
            for tap, product in enumerate(products):
                values[0, tap * dilation, 0] = product
        if float32 and kernel % 2:  # channel 1 at frame `padding`: the middle tap alone
            weight[1, 0], bias[1] = 0.0, -1.0
            weight[1, 0, kernel // 2] = 1 + 2**-12
            values[0, : 2 * padding + 1, 1] = 0.0
            values[0, padding, 1] = 1 + 2**-12
        if not float32:
            weight, bias = weight.bfloat16(), bias.bfloat16()
        taps = weight.float()[:, 0].t().contiguous()
        matches = True
        with torch.inference_mode():
            for dtype in (torch.float32,) if float32 else (torch.bfloat16, torch.float32):
                x = values.to(dtype).transpose(1, 2)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not float32):
                    expected = torch.nn.functional.conv1d(
                        x, weight, bias, padding=padding, dilation=dilation, groups=channels
                    )
                got = kernels.depthwise_conv1d(
                    x, taps, bias.float(), dilation, padding, float32=float32
                )
                matches = matches and torch.equal(got, expected)
        _DEPTHWISE_CHECKED[key] = matches
    return _DEPTHWISE_CHECKED[key]


@functools.cache
def fused_bias_linear() -> bool:
    """Whether this torch has oneDNN's linear with its bias fused (a build with oneDNN) and it
    gives ``F.linear``'s bits in bf16 (on rows of every remainder of the kernels' blocks)."""
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for rows in (1, 7, 40):
                x = torch.randn(2, rows, 512, generator=generator).bfloat16()
                weight = torch.randn(48, 512, generator=generator).bfloat16()
                bias = torch.randn(48, generator=generator).bfloat16()
                fused = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
                if not torch.equal(fused, torch.nn.functional.linear(x, weight, bias)):
                    return False
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def packs_linear_weights() -> bool:
    """Whether a bf16 decoder holds its linear weights packed (``Bf16Linear.pack``): not on a
    CPU with AMX. On an Intel Xeon with AMX packed weights made the products faster but every
    small copy around them much slower, so a decode round was slower; on a CPU with
    AVX512-BF16 and no AMX packing made it faster."""
    return "amx_bf16" not in cpu_flags()
