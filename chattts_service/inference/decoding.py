"""GPT hidden states to a waveform, through ChatTTS's decoder and the Vocos vocoder."""

from __future__ import annotations

import functools
import time

import numpy as np
import torch

from chattts_service.inference.quantize import KernelLinear
from chattts_service.kernels.bindings import channels_last
from chattts_service.runtime.cpu import cpu_flags


class AudioDecoder:
    """The decoder and the vocoder's ConvNeXt backbone may run in bf16 (on CPUs with native
    bf16 dot products; the waveform difference is in docs/benchmarks.md), or with their
    pointwise layers on the C++ kernels' int8 product (``hold_in_int8``); the vocoder's head
    (its complex inverse STFT) stays in fp32."""

    def __init__(self, decoder, vocos, dtype: str):
        self.decoder, self.vocos, self.dtype = decoder, vocos, dtype
        self.context_steps = decoder_context_steps(decoder, vocos)
        self._stages = _stages(decoder, vocos)
        self._head_radius = _head_radius(vocos)
        # frames either side of a kept one that can change it (what ``context_steps`` rounds up)
        self._reach = (
            None
            if self._stages is None
            else self._head_radius + sum(radius for _, radius in self._stages)
        )
        self._hop = vocos.head.istft.hop_length
        self.held = "fp32"  # the type its convolutions' and linears' weights are kept in

    def hold_in_bf16(self, kernels=None) -> None:
        """Keep the weights of the decoder's and the backbone's convolutions and linear layers
        in bf16, as autocast casts them on every call anyway: the same samples, half those
        weights' memory (156 -> 78 MB on ChatTTS's), and no casts on every decode (a fifth of a
        round of streamed chunks). The decoder then decodes in bf16 only. Its linear layers
        run on oneDNN's product with the bias fused and the weight packed (``Bf16Linear``),
        where those give the same bits. With ``kernels``, the ConvNeXt blocks' depthwise
        convolutions run on them (``KernelDepthwise``), where they give this torch's bits."""
        if self.dtype != "bf16":
            raise ValueError("only a bf16 decoder holds its weights in bf16")
        on_kernel_depthwise((self.decoder, self.vocos.backbone), None)  # plain convolutions
        for module in (self.decoder, self.vocos.backbone):
            for layer in module.modules():
                if isinstance(layer, (torch.nn.Linear, torch.nn.Conv1d)):
                    layer.to(torch.bfloat16)
        fused = fused_bias_linear()
        for module in (self.decoder, self.vocos.backbone):
            for parent in list(module.modules()):
                for name, child in list(parent.named_children()):
                    if fused and type(child) is torch.nn.Linear and child.bias is not None:
                        setattr(parent, name, Bf16Linear(child))
        if kernels is not None:
            self.depthwise_on(kernels)
        self._own_the_rest(keep=lambda tensor: tensor.dtype == torch.bfloat16)
        packs: dict[tuple[int, int], bool] = {}  # a shape's packing, checked on its first layer
        for module in (self.decoder, self.vocos.backbone) if packs_linear_weights() else ():
            for layer in module.modules():
                if isinstance(layer, Bf16Linear):
                    shape = (layer.in_features, layer.out_features)
                    if shape not in packs:
                        packs[shape] = layer.pack()
                    elif packs[shape]:
                        layer.pack(check=False)
        self.held = "bf16"

    def hold_in_int8(self, kernels) -> None:
        """Run the ConvNeXt blocks' pointwise layers (two linear layers a block, nearly all of a
        decode's multiply-adds) on the kernels' int8 product: weights int8 with a scale per
        output channel, each frame quantized by its own largest value (so a frame's result
        does not depend on the frames batched with it: streamed chunks stay the samples of the
        whole answer). The rest stays fp32. The faster decoder without native bf16, and on a
        Zen 4 with it too, at a waveform error printed by ``benchmarks/engine.py`` (opt-in:
        CHATTTS_DECODER_DTYPE=int8). Its depthwise convolutions run on the kernels in float32
        (``depthwise_on``). The decoder then decodes this way only."""
        if self.dtype != "int8":
            raise ValueError("only an int8 decoder holds its pointwise layers in int8")
        blocks = [
            *getattr(self.decoder.decoder, "decoder_block", []),
            *self.vocos.backbone.convnext,
        ]
        for block in blocks:
            for name in ("pwconv1", "pwconv2"):
                linear = getattr(block, name, None)
                if isinstance(linear, torch.nn.Linear) and linear.in_features % 4 == 0:
                    setattr(block, name, Int8Pointwise(linear, kernels))
        self.depthwise_on(kernels)
        self._own_the_rest(keep=lambda tensor: False)
        self.held = "int8"

    def depthwise_on(self, kernels) -> None:
        """The ConvNeXt blocks' depthwise convolutions on the kernels (``KernelDepthwise``),
        where they give this torch's bits: in bf16 as autocast computes, in float32 as torch
        does (so an fp32 decoder still gives upstream's samples). oneDNN's depthwise
        convolution reads channels-first, so torch transposed every block's input for it and
        its output back again, a copy each way (a third of what the int8 decoder spent outside
        its products)."""
        on_kernel_depthwise((self.decoder, self.vocos.backbone), kernels)

    def _own_the_rest(self, keep) -> None:
        """Every tensor of the decoder and the vocoder but those ``keep`` says in memory of its
        own: the weights came mapped from their files, one mapping per file, which stays
        (resident) while any tensor of it does."""
        with torch.no_grad():
            for module in (self.decoder, self.vocos):
                for tensor in [*module.parameters(), *module.buffers()]:
                    if not keep(tensor):
                        tensor.data = tensor.data.clone()
                for layer in module.modules():  # plain tensors too (the DVAE's ``coef``)
                    for name, value in list(vars(layer).items()):
                        if type(value) is torch.Tensor:
                            setattr(layer, name, value.clone())

    def __call__(self, hiddens: torch.Tensor, dtype: str | None = None) -> np.ndarray:
        """[steps, hidden] -> float32 samples in [-1, 1]."""
        requested = dtype or self.dtype
        bf16 = requested == "bf16"
        if requested != self.held and not (bf16 and self.held == "fp32"):
            raise ValueError(
                f"this decoder holds its weights in {self.held}: decode in {requested} with one "
                f"loaded for it (CHATTTS_DECODER_DTYPE={requested})"
            )
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                mel = self.decoder(hiddens.T[None].contiguous())
                features = self.vocos.backbone(mel.float())
            audio = self.vocos.head(features.float())[0]
        return _samples(audio)

    def span(self, hiddens: torch.Tensor, first: int, last: int | None = None) -> np.ndarray:
        """``self(hiddens)``'s samples of steps [first, last) (to the end when ``last`` is
        None), the same bits, computed from less: each stage of the decoder and the vocoder
        runs only on the frames the stages after it still read (a receptive field shrinks stage
        by stage), where ``self`` runs every stage on every frame. A streamed chunk keeps a few
        steps of a window that holds its context on both sides."""
        if self._stages is None:  # a decoder of another shape: decode the whole window
            audio = self(hiddens)
            end = None if last is None else last * 2 * self._hop
            return audio[first * 2 * self._hop : end]
        with torch.inference_mode():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
                x = _frames(hiddens.T[None].contiguous())
                total = x.shape[-1]
                keep_lo, keep_hi = 2 * first, total if last is None else 2 * last
                reach = self._reach
                offset = 0  # the frame x starts at
                for stage, radius in self._stages:
                    lo, hi = max(0, keep_lo - reach), min(total, keep_hi + reach)
                    x, offset = x[..., lo - offset : hi - offset], lo
                    x = stage(x)
                    reach -= radius
            lo, hi = max(0, keep_lo - reach), min(total, keep_hi + reach)
            features = x[..., lo - offset : hi - offset].transpose(1, 2)
            audio = self.vocos.head(features.float())[0]
        start = (keep_lo - lo) * self._hop
        end = None if last is None else start + (keep_hi - keep_lo) * self._hop
        return _samples(audio[start:end])

    def spans(self, items: list[Span]) -> list[np.ndarray]:
        """``[self.span(*item) for item in items]``, computed as one batch: each window is
        placed on a common canvas with the first step it keeps in one column, and before every
        stage that mixes frames each row is zeroed outside the frames its own ``span`` would
        still hold, so every row reads what it would read alone (as a convolution pads). The
        canvas is as wide as a width from a short list (``bucket``) and narrows, stage by
        stage, only by ``CROP_FRAMES`` at a time: oneDNN prepares a kernel for every new shape
        (tens of ms in bf16) and the service keeps only 256 of them (``runtime/heap.py``), so a
        decode must use few shapes, and the same ones call after call. Fewer, larger
        convolutions: about half the time of one call per window in bf16. (In bf16 a batch of
        one and a batch of several round differently: 0.8% of the waveform, each 1% from fp32;
        docs/benchmarks.md.)"""
        rows = [_Row(hiddens, first, last) for hiddens, first, last in items]
        reach = self._reach
        anchor = max(row.left(reach) for row in rows)  # canvas column of a row's keep_lo
        width = bucket(anchor + max(row.right(reach) for row in rows))
        with torch.inference_mode():
            first_frames = _frames(rows[0].hiddens.T[None].contiguous())
            x = first_frames.new_zeros(len(rows), first_frames.shape[1], width)
            for index, row in enumerate(rows):
                frames = first_frames if index == 0 else _frames(row.hiddens.T[None].contiguous())
                lo, hi = max(0, row.keep_lo - reach), min(row.total, row.keep_hi + reach)
                x[index, :, anchor - (row.keep_lo - lo) : anchor + (hi - row.keep_lo)] = frames[
                    0, :, lo:hi
                ]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
                offset = 0  # the canvas column x starts at
                for stage, radius in self._stages:
                    lo = anchor - max(row.left(reach) for row in rows)
                    hi = anchor + max(row.right(reach) for row in rows)
                    if x.shape[-1] - bucket(hi - lo) >= CROP_FRAMES:  # few widths: kernels reused
                        x = x[..., lo - offset : lo - offset + bucket(hi - lo)]
                        offset = lo
                    if radius:
                        x = x * _mask(rows, reach, anchor, offset, x.shape[-1]).to(x.dtype)
                    x = stage(x)
                    reach -= radius
            results = []
            for index, row in enumerate(rows):
                lo, hi = max(0, row.keep_lo - reach), min(row.total, row.keep_hi + reach)
                columns = slice(
                    anchor - (row.keep_lo - lo) - offset, anchor + (hi - row.keep_lo) - offset
                )
                features = x[index : index + 1, :, columns].transpose(1, 2)
                audio = self.vocos.head(features.float())[0]
                start = (row.keep_lo - lo) * self._hop
                end = None if row.last is None else start + row.keep_len * self._hop
                results.append(_samples(audio[start:end]))
        return results

    def stream(self) -> StreamState | None:
        """A new stream's state for ``advance_many``, or None for a decoder of another shape
        (its streams decode windows with ``span``)."""
        return None if self._stages is None else StreamState(len(self._stages))

    def advance_many(self, items: list[Advance]) -> list[np.ndarray]:
        """For each item, the samples of the frames that have become exact since its stream's
        last call: its ``hiddens`` are the stream's steps so far, and each stage of the decoder
        and the vocoder computes only its outputs whose inputs are all known (with ``final``,
        all of them: the true end pads with zeros, as a convolution does), from the inputs it
        kept of the last call (a receptive field's worth) and the new ones. So a chunk costs its
        own frames and the stages' radii, where a window decoded again with its context on
        both sides (``span``) costs the context too: 104 frames a side on ChatTTS's decoders,
        four times the work of a 32-step chunk. Non-final items stop at step ``until``. The
        same samples as a decode of the whole, within the rounding of convolutions over other
        widths (fp32: 1e-6; tested). The windows of the rows that compute at a stage lie side
        by side in one row, its width rounded to few (``bucket``): oneDNN keeps 256 kernels."""
        assert self._stages is not None, "a decoder of another shape streams with span"
        pending: list[torch.Tensor | None] = []
        with torch.inference_mode():
            for item in items:  # the new steps' frames: every stage's input starts there
                state = item.state
                pending.append(
                    _frames(item.hiddens[state.fed :].T[None].contiguous())[0]
                    if item.hiddens.shape[0] > state.fed
                    else None
                )
                state.fed = max(state.fed, item.hiddens.shape[0])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"):
                for index, (stage, radius) in enumerate(self._stages):
                    pending = self._advance_stage(items, pending, index, stage, radius)
            return [self._advance_head(item, new) for item, new in zip(items, pending, strict=True)]

    def _advance_stage(self, items, pending, index: int, stage, radius: int) -> list:
        """One stage of ``advance_many``: each item's new outputs (None: none yet)."""
        windows, outputs = [], [None] * len(items)
        for position, (item, new) in enumerate(zip(items, pending, strict=True)):
            state = item.state
            parts = state.parts(index, new)
            if not parts:  # nothing has reached this stage yet
                continue
            known = sum(part.shape[-1] for part in parts)
            end = state.starts[index] + known  # input frames known so far
            target = end if item.final else end - radius  # outputs whose inputs are all known
            done = state.done[index]
            if target <= done:
                state.take(index, new)
                continue
            # inputs [done - radius, target + radius): zeros before the start and, when final,
            # past the end, as the convolutions pad the whole
            left = max(0, radius - done)
            width = left + known + target + radius - end
            windows.append((position, parts, left, width, target - done))
        if windows:
            # the windows side by side in one row: each carries its own halo, so an output it
            # keeps reads only its own frames; one shape per total width (``bucket``). Each
            # stream's kept and new inputs are written straight onto the canvas (its zeros the
            # padding), not joined and padded first.
            total = sum(width for _, _, _, width, _ in windows)
            first = windows[0][1][0]
            if getattr(stage, "channels_last", False):  # the same values, laid out for it
                canvas = first.new_zeros(1, bucket(total), first.shape[0]).transpose(1, 2)
            else:
                canvas = first.new_zeros(1, first.shape[0], bucket(total))
            column, places = 0, []
            for position, parts, left, width, count in windows:
                at = column + left
                for part in parts:
                    canvas[0, :, at : at + part.shape[-1]] = part
                    at += part.shape[-1]
                state = items[position].state
                state.done[index] += count
                state.hold(index, parts, max(0, state.done[index] - radius))  # as ``keep``
                places.append(column)
                column += width
            spans = [
                (column + radius, count)
                for (_, _, _, _, count), column in zip(windows, places, strict=True)
            ]
            if isinstance(stage, _BlockStage):  # only the kept frames past the depthwise
                out = stage.kept(canvas, spans)  # side by side
                starts = np.cumsum([0] + [count for _, count in spans[:-1]]).tolist()
            else:
                out, starts = stage(canvas), [first for first, _ in spans]
            for (position, *_), start, (_, count) in zip(windows, starts, spans, strict=True):
                outputs[position] = out[0, :, start : start + count]
        return outputs

    def _advance_head(self, item: Advance, new) -> np.ndarray:
        """The vocoder's head (inverse STFT) on the features that became exact: samples."""
        state, radius, index = item.state, self._head_radius, len(self._stages)
        known = state.take(index, new)
        if known is None:
            return np.zeros(0, dtype=np.float32)
        end = state.starts[index] + known.shape[-1]
        done = state.done[index]
        target = end if item.final else min(end - radius, 2 * item.until)
        if target <= done:
            return np.zeros(0, dtype=np.float32)
        lo = max(0, done - radius)  # where the kept features start (``keep`` below)
        hi = end if item.final else min(end, target + radius)
        features = known[:, lo - state.starts[index] : hi - state.starts[index]]
        audio = self.vocos.head(features.T[None].float())[0]  # (advance_many's inference mode)
        start = (done - lo) * self._hop
        audio = audio[start:] if item.final else audio[start : start + (target - done) * self._hop]
        state.done[index] = target
        state.keep(index, max(0, target - radius))
        return _samples(audio)

    def decode_many(self, items: list[Span]) -> list[np.ndarray]:
        """Each item's ``span`` (a whole window: ``self(hiddens)``). In bf16 through
        ``spans``, windows of similar widths as one batch; in fp32 and int8 one by one
        (upstream's computation in fp32), as batching saves little there and costs as much on
        long windows (docs/benchmarks.md)."""
        if self.dtype != "bf16" or self._stages is None:
            return [
                self(hiddens) if first == 0 and last is None else self.span(hiddens, first, last)
                for hiddens, first, last in items
            ]
        results: list[np.ndarray | None] = [None] * len(items)
        for group in _groups([_Row(*item).width(self._reach) for item in items]):
            decoded = self.spans([items[index] for index in group])
            for index, samples in zip(group, decoded, strict=True):
                results[index] = samples
        return results


CROP_FRAMES = 64  # a stage narrows the canvas only by this much at least
# the rows oneDNN is told a packed linear weight will meet (1 to 2,048 read alike on a Zen 4)
PACK_ROWS = 256


class StreamState:
    """A stream's place in the decoder between chunks (``AudioDecoder.advance_many``): for each
    stage, and the head after them, the input frames its next outputs still read (from frame
    ``starts``) and how many output frames it has made (``done``); how many steps it was fed."""

    def __init__(self, stages: int):
        self.fed = 0
        self.inputs: list[torch.Tensor | None] = [None] * (stages + 1)
        self.starts = [0] * (stages + 1)
        self.done = [0] * (stages + 1)

    def take(self, index: int, new: torch.Tensor | None) -> torch.Tensor | None:
        """Stage ``index``'s kept inputs with ``new`` ones after them ([channels, frames])."""
        parts = self.parts(index, new)
        kept = torch.cat(parts, dim=-1) if len(parts) > 1 else (parts[0] if parts else None)
        self.inputs[index] = kept
        return kept

    def parts(self, index: int, new: torch.Tensor | None) -> list[torch.Tensor]:
        """Stage ``index``'s kept inputs and ``new`` ones, in order, before ``take`` joins
        them."""
        kept = self.inputs[index]
        if kept is None:
            return [] if new is None else [new]
        return [kept] if new is None else [kept, new.to(kept.dtype)]

    def hold(self, index: int, parts: list[torch.Tensor], start: int) -> None:
        """``take`` then ``keep``, joining only what is kept: ``parts`` (from ``parts``) are
        stage ``index``'s inputs from frame ``starts``; those from frame ``start`` on stay."""
        pieces, offset = [], self.starts[index]
        for part in parts:
            skip = max(0, start - offset)
            if skip < part.shape[-1] or part is parts[-1]:  # (empty when nothing stays)
                pieces.append(part[:, min(skip, part.shape[-1]) :])
            offset += part.shape[-1]
        self.inputs[index] = torch.cat(pieces, dim=-1) if len(pieces) > 1 else pieces[0].clone()
        self.starts[index] = start

    def keep(self, index: int, start: int) -> None:
        """Drop stage ``index``'s inputs before frame ``start``: nothing later reads them."""
        self.hold(index, [self.inputs[index]], start)


class Advance:
    """One stream's call to ``advance_many``: its steps so far, the step its audio may stop
    at (unless ``final``: the stream's last call), and its state."""

    def __init__(self, state: StreamState, hiddens: torch.Tensor, until: int, final: bool):
        self.state, self.hiddens, self.until, self.final = state, hiddens, until, final


class Int8Pointwise(torch.nn.Module):
    """A ConvNeXt block's pointwise ``nn.Linear`` on the C++ kernels' int8 product (see
    ``AudioDecoder.hold_in_int8``): ``x @ W.T + bias`` for x [..., in_features], each row
    quantized on its own."""

    def __init__(self, linear: torch.nn.Linear, kernels):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.product = KernelLinear.int8(linear.weight, kernels)
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
    rounds it for ``F.linear``. On the decoder's shapes (8 windows of 320 frames) 0.73-0.93
    of ``F.linear``'s time (docs/benchmarks.md).

    ``pack`` then holds the weight in oneDNN's own blocked layout (``mkldnn::
    _reorder_linear_weight``, as torch's compiler packs it) in place of the plain one: a plain
    weight is reordered into that layout on every call. Side by side on a Zen 4 (AMD EPYC,
    family 25 model 17), caches evicted before each decode as a step evicts them: a round of
    streamed chunks 0.90-0.975 of the time, 8 whole windows 0.93 (docs/benchmarks.md). Not
    on a CPU with AMX (``packs_linear_weights``)."""

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
    CPU with AMX. On an Intel Xeon with AMX (family 6 model 167) packed weights made the
    products faster but every small copy around them about ten times slower: a round of 8
    streams' 32-step chunks 178-185 ms against 114-121 ms (docs/benchmarks.md); on a Zen 4
    (AVX512-BF16, no AMX) packing took 0.90-0.975 of a round's time."""
    return "amx_bf16" not in cpu_flags()


def bucket(frames: int) -> int:
    """``frames`` rounded up to a width from a short list: 32 frames apart up to 512, then
    128 apart."""
    step = 32 if frames <= 512 else 128
    return -(-frames // step) * step


Span = tuple  # (hiddens [steps, hidden], first step kept, last step kept (exclusive) or None)
MAX_BATCH_ROWS = 16
MAX_PADDING = 0.25  # a batch's canvas may be this much larger than its rows' own widths
# frames in one batch's canvas (rows x width): its activations are transient memory, one
# ConvNeXt intermediate alone 6 KB a frame in fp32, so 16 segments of 2,048 steps would take
# ~400 MB at once; streams' windows (16 rows of up to ~460 frames) still batch whole
MAX_BATCH_FRAMES = 8192


def _groups(widths: list[int]) -> list[list[int]]:
    """Indices of ``widths`` in batches of similar widths, widest first: a batch's canvas is
    as wide as its widest row, so mixing a long window with short ones wastes work."""
    order = sorted(range(len(widths)), key=lambda index: -widths[index])
    groups: list[list[int]] = []
    for index in order:
        group = groups[-1] if groups else None
        if (
            group is not None
            and len(group) < MAX_BATCH_ROWS
            and widths[group[0]] * (len(group) + 1) <= MAX_BATCH_FRAMES
            and widths[group[0]] * (len(group) + 1)
            <= (1 + MAX_PADDING) * (sum(widths[i] for i in group) + widths[index])
        ):
            group.append(index)
        else:
            groups.append([index])
    return groups


class DecodeQueue:
    """Audio decoding gathered between two GPT steps and done together on the model's thread
    (``run``): windows (``submit``) and streams' chunks (``submit_stream``), each kind as
    batches; each item's ``done(samples)`` is called in the order submitted, or
    ``failed(error)`` if its decode raised.

    A bulk segment's whole window (``submit(..., deferrable=True)``) may wait: decoding one
    holds every row for as long as its audio takes (a 6 s segment, tens of ms; several that end
    together, hundreds), which a stream that has little audio ahead of its listener cannot
    ride out. ``run(slack)`` decodes such windows only as far as their estimated time (at the
    measured pace) fits ``slack``, the seconds the streams can spare, oldest first, and one
    anyway once the oldest has waited ``MAX_DEFER_SECONDS``; ``slack`` None decodes them all.
    Each window is decoded whole, as when nobody listens: the same samples."""

    def __init__(self, decoder: AudioDecoder, on_run=None):
        self.decoder = decoder
        self.on_run = on_run  # on_run(items, seconds): the time spent decoding
        self._items: list[tuple[Span, object, object]] = []
        self._deferred: list[tuple[float, tuple]] = []  # (since, item): bulk windows waiting
        self._seconds_per_step = FIRST_DECODE_PACE_SECONDS  # recent pace of a round, a step

    def __len__(self) -> int:
        """Items asked for since the last round (a decode runs this iteration)."""
        return len(self._items)

    @property
    def pending(self) -> bool:
        """Bulk windows waiting for streams to have time to spare."""
        return bool(self._deferred)

    def submit(
        self, hiddens, first: int, last: int | None, done, failed, deferrable: bool = False
    ) -> None:
        """A window: the samples of steps [first, last) of ``hiddens`` (to the end: None).
        ``deferrable``: a bulk segment's whole audio, which may wait (see the class)."""
        item = ((hiddens, first, last), done, failed)
        if deferrable:
            self._deferred.append((time.monotonic(), item))
        else:
            self._items.append(item)

    def submit_stream(self, state, hiddens, until: int, final: bool, done, failed) -> None:
        """A stream's next chunk: ``AudioDecoder.advance_many`` on its steps so far."""
        self._items.append((Advance(state, hiddens, until, final), done, failed))

    def run(self, slack: float | None = None) -> None:
        """Decode what was asked for, and the deferred windows that ``slack`` allows (all of
        them with None)."""
        items, self._items = self._items, []
        now = time.monotonic()
        while self._deferred:
            since, item = self._deferred[0]
            cost = self._seconds_per_step * _steps(item[0])
            overdue = now - since >= MAX_DEFER_SECONDS
            if slack is not None and cost > slack and not overdue:
                break
            self._deferred.pop(0)
            items.append(item)
            if slack is not None:
                slack -= cost
                if overdue:
                    slack = min(slack, 0.0)  # one overdue window a round
        if not items:
            return
        started = time.perf_counter()
        try:
            decoded = self._decode([work for work, _, _ in items])
        except Exception as error:  # every item of the batch fails; the thread goes on
            for _, _, failed in items:
                failed(error)
            return
        finally:
            seconds = time.perf_counter() - started
            if self.on_run is not None:
                self.on_run(len(items), seconds)
        steps = sum(_steps(work) for work, _, _ in items)
        if steps:
            self._seconds_per_step = 0.8 * self._seconds_per_step + 0.2 * seconds / steps
        for (_, done, failed), samples in zip(items, decoded, strict=True):
            try:
                done(samples)
            except Exception as error:  # the item's own failure, not its neighbours'
                failed(error)

    def _decode(self, work: list) -> list[np.ndarray]:
        """Windows through ``decode_many`` and streams' chunks through ``advance_many``, the
        results in the order of ``work``."""
        chunks = [index for index, item in enumerate(work) if isinstance(item, Advance)]
        windows = [index for index, item in enumerate(work) if not isinstance(item, Advance)]
        results: list[np.ndarray | None] = [None] * len(work)
        for indices, decode in (
            (windows, self.decoder.decode_many),
            (chunks, self.decoder.advance_many),
        ):
            if indices:
                for index, samples in zip(indices, decode([work[i] for i in indices]), strict=True):
                    results[index] = samples
        return results


# A bulk window waits at most this long for the streams to spare the time to decode it, and a
# round's time is estimated at this pace (seconds a step) until rounds have been timed.
MAX_DEFER_SECONDS = 2.0
FIRST_DECODE_PACE_SECONDS = 0.0005


def _steps(work) -> int:
    """The steps an item's decode reads: a stream chunk's new ones, a window's all."""
    if isinstance(work, Advance):
        return max(0, work.hiddens.shape[0] - work.state.fed)
    return work[0].shape[0]


class _Row:
    """One window of a batch, in frames (two a step)."""

    def __init__(self, hiddens: torch.Tensor, first: int, last: int | None):
        self.hiddens, self.last = hiddens, last
        self.total = 2 * hiddens.shape[0]
        self.keep_lo = 2 * first
        self.keep_hi = self.total if last is None else 2 * last
        self.keep_len = self.keep_hi - self.keep_lo

    def left(self, reach: int) -> int:
        """Frames before its first kept one that it reads, at most ``reach``."""
        return min(self.keep_lo, reach)

    def right(self, reach: int) -> int:
        """Frames from its first kept one to the last it reads, ``reach`` past what it keeps."""
        return self.keep_len + min(self.total - self.keep_hi, reach)

    def width(self, reach: int) -> int:
        """The frames a batch reads for this row (what it keeps and its context)."""
        return self.left(reach) + self.right(reach)


def _mask(rows, reach: int, anchor: int, offset: int, width: int) -> torch.Tensor:
    """[rows, 1, width]: 1 where a row's own ``span`` would hold a frame at this stage (its
    window, within ``reach`` of what it keeps), 0 elsewhere."""
    mask = torch.zeros(len(rows), 1, width)
    for index, row in enumerate(rows):
        lo = anchor - row.left(reach) - offset
        hi = anchor + row.right(reach) - offset
        mask[index, :, max(0, lo) : max(0, hi)] = 1.0
    return mask


def _samples(audio: torch.Tensor) -> np.ndarray:
    return np.clip(audio.numpy().astype(np.float32, copy=False), -1.0, 1.0)


def _conv_radius(module) -> int:
    """How many frames on each side of an output frame its convolutions read."""
    return sum(
        conv.dilation[0] * (conv.kernel_size[0] - 1) // 2
        for conv in module.modules()
        if isinstance(conv, torch.nn.Conv1d)
    )


def _head_radius(vocos) -> int:
    """How many frames on each side of an output sample's frame the inverse STFT reads."""
    istft = vocos.head.istft
    return istft.win_length // istft.hop_length // 2


def _frames(x: torch.Tensor) -> torch.Tensor:
    """ChatTTS's DVAE.forward: each step's hidden state is two mel frames' features."""
    return x.view(x.size(0), 2, x.size(1) // 2, x.size(2)).permute(0, 2, 3, 1).flatten(2)


def _stages(decoder, vocos):
    """The decoder's and the backbone's forward passes (ChatTTS's ``DVAE.forward`` decode path,
    ``DVAEDecoder.forward``, Vocos' ``VocosBackbone.forward``) as steps, each with how many
    frames either side it reads, on [batch, channels, frames] tensors (the head takes the last
    one transposed, as the backbone returns it); None for modules of another shape."""
    dvae, backbone = decoder.decoder, vocos.backbone
    if getattr(decoder, "vq_layer", None) is not None or getattr(backbone, "adanorm", True):
        return None
    if len(dvae.conv_in) != 3:
        return None

    def out(y):
        y = decoder.out_conv(y)
        return torch.mul(y, decoder.coef, out=y)

    def norm(y):
        return backbone.norm(y.transpose(1, 2)).transpose(1, 2)

    def final(y):
        return backbone.final_layer_norm(y.transpose(1, 2)).transpose(1, 2)

    first, act, second = dvae.conv_in  # two convolutions: a batch masks between them
    stages = [(lambda y: act(first(y)), _conv_radius(first)), (second, _conv_radius(second))]
    stages += [(_BlockStage(b, None), _conv_radius(b)) for b in dvae.decoder_block]
    stages += [(dvae.conv_out, _conv_radius(dvae.conv_out)), (out, _conv_radius(decoder.out_conv))]
    stages += [(lambda y: backbone.embed(y.float()), _conv_radius(backbone.embed)), (norm, 0)]
    stages += [(_BlockStage(b, "cond_embedding_id"), _conv_radius(b)) for b in backbone.convnext]
    stages.append((final, 0))
    return stages


class _BlockStage:
    """A ConvNeXt block as a stage (ChatTTS's takes its condition second, Vocos' by name).
    ``channels_last``: whether its depthwise convolution runs on the kernels, which read their
    input channels-last, so a canvas made for it is laid out so."""

    def __init__(self, block, condition: str | None):
        self.block, self.condition = block, condition

    @property
    def channels_last(self) -> bool:
        return isinstance(getattr(self.block, "dwconv", None), KernelDepthwise)

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.condition is None:
            return self.block(y, None)
        return self.block(y, **{self.condition: None})

    def kept(self, y: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The block's outputs [1, channels, frames] at the frames of ``spans`` ((first,
        count) on ``y``'s frames), side by side: only the depthwise convolution reads the
        frames around them, so everything after it (the norm, both pointwise layers, the
        activation) runs on these frames alone, where ``__call__`` runs it on every frame of
        the canvas and a stream's chunk throws the halo's away (12 frames a window on the
        DVAE's blocks, 6 on Vocos'). Each frame's values are the block's own: the steps of
        ChatTTS's block (its scale multiplied in place) or Vocos' (out of place), in their
        order."""
        block = self.block
        frames = torch.cat([torch.arange(first, first + count) for first, count in spans])
        x = block.dwconv(y).transpose(1, 2).index_select(1, frames)  # [1, frames, channels]
        residual = y.transpose(1, 2).index_select(1, frames).transpose(1, 2)
        x = block.pwconv2(block.act(block.pwconv1(block.norm(x))))
        if self.condition is None:  # ChatTTS's DVAE block
            if block.weight is not None:
                x *= block.weight
            return x.transpose(1, 2) + residual
        if block.gamma is not None:  # Vocos' block
            x = block.gamma * x
        return residual + x.transpose(1, 2)


def decoder_context_steps(decoder, vocos) -> int:
    """How many GPT steps on each side of an audio sample can change it: the receptive field of
    the decoder's and the vocoder's convolutions plus the inverse STFT's window, in mel frames
    (two per step). A chunk decoded with this much context on both sides is the same as that
    stretch of a decode of the whole."""
    frames = _conv_radius(decoder) + _conv_radius(vocos.backbone) + _head_radius(vocos)
    return -(-frames // 2)
