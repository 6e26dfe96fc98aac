"""GPT hidden states to a waveform, through ChatTTS's decoder and the Vocos vocoder.

``AudioDecoder`` decodes whole windows, batches of windows side by side (masked to each row's
own frames, so a batch gives each window's own samples) and streams chunk by chunk
(``StreamState`` keeps each stream's place in every stage). Its layers on the kernels are in
``decoder_layers``, the queue that gathers a scheduler iteration's decodes in ``decode_queue``.
Longer than most modules: the three ways of decoding share the stages, their radii and the
canvas they are laid on, and split apart each would need the others' insides.
"""

from __future__ import annotations

import numpy as np
import torch

from chattts_service.inference.decoder_layers import (
    Bf16Linear,
    Int8Pointwise,
    KernelDepthwise,
    fused_bias_linear,
    on_kernel_depthwise,
    packs_linear_weights,
)


class AudioDecoder:
    """The decoder and the vocoder's ConvNeXt backbone may run in bf16 (on CPUs with native
    bf16 dot products; ``benchmarks/engine.py`` prints the waveform difference), or with their
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

    def _context_reach(self) -> int:
        """Frames either side of a kept one that can change it: known where the decoder is
        split into stages (every way of decoding a window but the whole answer's)."""
        if self._reach is None:
            raise RuntimeError("this decoder was not split into stages")
        return self._reach

    def hold_in_bf16(self, kernels=None) -> None:
        """Keep the weights of the decoder's and the backbone's convolutions and linear layers
        in bf16, as autocast casts them on every call anyway: the same samples, half those
        weights' memory, and no casts on every decode. The decoder then decodes in bf16 only.
        Its linear layers run on oneDNN's product with the bias fused and the weight packed
        (``Bf16Linear``), where those give the same bits. With ``kernels``, the ConvNeXt
        blocks' depthwise convolutions run on them (``KernelDepthwise``), where they give this
        torch's bits."""
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
                reach = self._context_reach()
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
        and the service keeps only 256 of them (``runtime/heap.py``), so a decode must use few
        shapes, and the same ones call after call. Fewer, larger convolutions take much less
        time than one call per window in bf16. (In bf16 a batch of one and a batch of several
        round differently, each about as far from fp32 as the other: a test bounds it.)"""
        return _finish(self._spans_stages(items))

    def _spans_stages(self, items: list[Span]):
        """``spans`` as a generator that yields before each stage and the heads and returns
        the samples; its torch modes are entered and left within each part."""
        rows = [_Row(hiddens, first, last) for hiddens, first, last in items]
        reach = self._context_reach()
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
        offset = 0  # the canvas column x starts at
        for stage, radius in self._stages:
            yield
            with (
                torch.inference_mode(),
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"),
            ):
                lo = anchor - max(row.left(reach) for row in rows)
                hi = anchor + max(row.right(reach) for row in rows)
                if x.shape[-1] - bucket(hi - lo) >= CROP_FRAMES:  # few widths: kernels reused
                    x = x[..., lo - offset : lo - offset + bucket(hi - lo)]
                    offset = lo
                if radius:
                    x = x * _mask(rows, reach, anchor, offset, x.shape[-1]).to(x.dtype)
                x = stage(x)
                reach -= radius
        yield
        results = []
        with torch.inference_mode():
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
        by side in one row, its width rounded to few (``bucket``): oneDNN keeps 256 kernels.
        All at once: ``advancing`` gives the same work a stage at a time."""
        assert self._stages is not None, "a decoder of another shape streams with span"
        return _finish(self._advance_stages(items))

    def advancing(self, items: list[Advance]) -> Round:
        """``advance_many``'s work on ``items`` as a ``Round`` run a stage at a time: other work
        (a GPT step) may run between two of its stages, each stage is still one batch of every
        item, and the samples are ``advance_many``'s."""
        assert self._stages is not None, "a decoder of another shape streams with span"
        return Round(self._advance_stages(items))

    def _advance_stages(self, items: list[Advance]):
        """``advance_many`` as a generator that yields after its frames and each stage and
        returns the samples; its torch modes are entered and left within each part, so whatever
        runs between two parts runs outside them."""
        stages = self._stages
        assert stages is not None
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
        for index, (stage, radius) in enumerate(stages):
            yield
            with (
                torch.inference_mode(),
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == "bf16"),
            ):
                pending = self._advance_stage(items, pending, index, stage, radius)
        yield
        with torch.inference_mode():
            return [self._advance_head(item, new) for item, new in zip(items, pending, strict=True)]

    def _advance_stage(self, items, pending, index: int, stage, radius: int) -> list:
        """One stage of ``advance_many``: each item's new outputs (None: none yet)."""
        windows: list[tuple] = []
        outputs: list[torch.Tensor | None] = [None] * len(items)
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
        long windows. All at once: ``decoding`` gives the same work in parts."""
        return _finish(self._windows_stages(items))

    def decoding(self, items: list[Span]) -> Round:
        """``decode_many``'s work on ``items`` as a ``Round``: in bf16 a stage of a batch at a
        time, else a window at a time; the samples are ``decode_many``'s."""
        return Round(self._windows_stages(items))

    def _windows_stages(self, items: list[Span]):
        if self.dtype != "bf16" or self._stages is None:
            whole = []
            for hiddens, first, last in items:
                yield
                alone = first == 0 and last is None
                whole.append(self(hiddens) if alone else self.span(hiddens, first, last))
            return whole
        results: list[np.ndarray | None] = [None] * len(items)
        for group in _groups([_Row(*item).width(self._context_reach()) for item in items]):
            decoded = yield from self._spans_stages([items[index] for index in group])
            for index, samples in zip(group, decoded, strict=True):
                results[index] = samples
        return every_one(results)


CROP_FRAMES = 64  # a stage narrows the canvas only by this much at least


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
        kept = self.inputs[index]
        self.hold(index, [] if kept is None else [kept], start)


class Round:
    """A batch of streams' chunks decoded a stage at a time (``AudioDecoder.advancing``):
    ``run_stage`` runs the next part and says whether the round is done; ``results`` then
    holds each item's samples, in order."""

    def __init__(self, work):
        self._work = work
        self.results: list[np.ndarray] = []
        self.done = False

    def run_stage(self) -> bool:
        if not self.done:
            try:
                next(self._work)
            except StopIteration as end:
                self.results, self.done = end.value, True
        return self.done


def _finish(work) -> list[np.ndarray]:
    """A decode's generator (``Round``'s work) run to its end: its samples."""
    whole = Round(work)
    while not whole.run_stage():
        pass
    return whole.results


class Advance:
    """One stream's call to ``advance_many``: its steps so far, the step its audio may stop
    at (unless ``final``: the stream's last call), and its state."""

    def __init__(self, state: StreamState, hiddens: torch.Tensor, until: int, final: bool):
        self.state, self.hiddens, self.until, self.final = state, hiddens, until, final


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


def every_one(results: list[np.ndarray | None]) -> list[np.ndarray]:
    """Results gathered by index from decodes in groups, each index filled: a missing one is a
    bug, said here rather than handed on as audio."""
    filled = [samples for samples in results if samples is not None]
    if len(filled) != len(results):
        raise RuntimeError(f"{len(results) - len(filled)} of {len(results)} decodes left no audio")
    return filled


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
