"""The engine in-process, on the tiny random-weight model through ChatTTS's real classes."""

import threading
from dataclasses import replace

import numpy as np
import pytest
import torch
from engines import engine_on, read_streams

from chattts_service.domain.speech import SAMPLE_RATE, NothingToSay, SynthesisRequest


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with engine_on(tiny_model_dir, max_new_tokens=200) as engine:
        yield engine


@pytest.fixture(scope="module")
def fp32_decoder_engine(tiny_model_dir):
    """An engine whose decoder keeps fp32 weights, so it decodes either way (a bf16 decoder
    holds its weights in bf16)."""
    with engine_on(tiny_model_dir, decoder_dtype="fp32") as engine:
        yield engine


def test_audio_has_the_shape_the_steps_imply(engine):
    result = engine.synthesize(SynthesisRequest("你好，欢迎。", seed=3))
    assert result.sample_rate == SAMPLE_RATE
    assert result.audio.dtype == np.float32 and result.audio.ndim == 1
    assert 1 <= result.steps <= 200
    # one GPT step is 2 mel frames of hop 256; the centred inverse STFT yields (frames - 1) hops
    assert len(result.audio) == (2 * result.steps - 1) * 256
    assert np.abs(result.audio).max() <= 1.0
    assert np.abs(result.audio).max() > 0


def test_same_request_same_audio_other_seed_other_audio(engine):
    first = engine.synthesize(SynthesisRequest("今天天气很好", seed=11))
    again = engine.synthesize(SynthesisRequest("今天天气很好", seed=11))
    other = engine.synthesize(SynthesisRequest("今天天气很好", seed=12))
    assert np.array_equal(first.audio, again.audio)
    assert first.audio.shape != other.audio.shape or not np.array_equal(first.audio, other.audio)


def test_voice_from_a_seed_leaves_the_global_rng_alone(engine):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    voice_a = engine.speaker_embedding(42)
    after = torch.rand(3)
    assert torch.equal(expected, after)
    assert torch.equal(voice_a, engine.speaker_embedding(42))
    assert not torch.equal(voice_a, engine.speaker_embedding(43))


def test_requests_do_not_leak_parameters_into_each_other(engine):
    # upstream infer() leaves spk_smp/txt_smp set on shared defaults; ours builds fresh ones
    alone = engine.synthesize(SynthesisRequest("第二句话", seed=8))
    engine.synthesize(SynthesisRequest("第一句话。第二句。", seed=9, refine_text=True))
    after = engine.synthesize(SynthesisRequest("第二句话", seed=8))
    assert np.array_equal(alone.audio, after.audio)
    from ChatTTS import Chat

    assert Chat.InferCodeParams().spk_smp is None


def test_text_refinement_runs_and_is_deterministic(engine):
    first = engine.synthesize(SynthesisRequest("你好世界", seed=2, refine_text=True))
    again = engine.synthesize(SynthesisRequest("你好世界", seed=2, refine_text=True))
    assert first.steps >= 1
    assert np.array_equal(first.audio, again.audio)


def test_text_with_nothing_speakable_is_refused(engine):
    # without wetext, ChatTTS's own normaliser deletes digits and symbols
    with pytest.raises(NothingToSay):
        engine.synthesize(SynthesisRequest("1+1=2", seed=1, normalize=False))
    with pytest.raises(NothingToSay):
        engine.synthesize(SynthesisRequest("…… !!! ——", seed=1))


def test_numbers_are_spoken_with_normalisation(engine):
    # the language is detected per sentence: digits alone read as English, in Chinese as Chinese
    assert engine.segments(SynthesisRequest("1+1=2", seed=1)) == ["one plus one equals two"]
    mixed = SynthesisRequest("我买了3个苹果，花了12.5元。It was 5 dollars.", seed=1)
    assert engine.segments(mixed) == ["我买了三个苹果，花了十二点五元。It was five dollars."]
    result = engine.synthesize(SynthesisRequest("1+1=2", seed=1))
    assert result.steps >= 1 and result.spoken_text == "one plus one equals two"


def test_concurrent_callers_get_the_same_audio_as_sequential_ones(engine):
    texts = [("一二三", 1), ("你好", 2), ("hello there", 3), ("再见", 4)]
    sequential = {t: engine.synthesize(SynthesisRequest(t, s)).audio for t, s in texts}
    results = {}

    def call(text, seed):
        results[text] = engine.synthesize(SynthesisRequest(text, seed)).audio

    threads = [threading.Thread(target=call, args=item) for item in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert set(results) == set(sequential)
    for text in results:
        assert np.array_equal(results[text], sequential[text]), text


def test_warm_up_runs_the_whole_pipeline(engine):
    assert engine.warm_up() > 0


def test_a_full_queue_refuses_instead_of_growing(tiny_model_dir):
    from chattts_service.domain.speech import Overloaded

    with engine_on(
        tiny_model_dir, max_new_tokens=200, max_batch=1, max_queue=2, batch_wait_ms=0
    ) as small:
        accepted, refused = [], 0
        for seed in range(12):  # submitted far faster than one sequence generates
            try:
                accepted.append(small.submit(SynthesisRequest("排队测试", seed), fixed_steps=60))
            except Overloaded:
                refused += 1
        assert refused > 0
        # at most: one generating, one started and waiting for room, two queued
        assert len(accepted) <= 4
        for future in accepted:
            assert future.result(timeout=60).steps == 60
        assert small.scheduler.depth == 0


def test_refinement_and_speech_rows_share_batches_without_changing_results(engine):
    requests = [
        SynthesisRequest("第一句话", 21, refine_text=True),
        SynthesisRequest("第二句话", 22),
        SynthesisRequest("第三句话", 23, refine_text=True),
        SynthesisRequest("hello", 24),
    ]
    alone = [engine.synthesize(request).audio for request in requests]
    futures = [engine.submit(request) for request in requests]
    together = [future.result(timeout=60).audio for future in futures]
    for one, other in zip(alone, together):
        assert np.array_equal(one, other)


def test_fp32_mode_runs_and_is_deterministic(tiny_model_dir):
    with engine_on(
        tiny_model_dir, max_new_tokens=200, quantize="none", decoder_dtype="fp32"
    ) as fp32:
        assert fp32.gpt_linear_bytes > 0 and "/gpt-none/decoder-fp32/" in fp32.identity
        first = fp32.synthesize(SynthesisRequest("精度测试", 5))
        again = fp32.synthesize(SynthesisRequest("精度测试", 5))
        assert first.steps >= 1 and np.array_equal(first.audio, again.audio)


@pytest.mark.parametrize(
    "int8_product,kv_cache_dtype,quantize",
    [("avx2", "bf16", "int8"), ("auto", "int8", "int8"), ("auto", "bf16", "int4")],
)
def test_other_kernel_settings_serve_and_keep_rows_independent(
    tiny_model_dir, int8_product, kv_cache_dtype, quantize
):
    """CHATTTS_INT8_PRODUCT=avx2 (what CPUs without AVX512-VNNI run, on any CPU with the
    kernels), CHATTTS_KV_CACHE_DTYPE=int8 and CHATTTS_QUANTIZE=int4: a request gives the same
    audio alone and batched with others."""
    with engine_on(
        tiny_model_dir,
        max_new_tokens=200,
        kernels="on",
        int8_product=int8_product,
        kv_cache_dtype=kv_cache_dtype,
        quantize=quantize,
    ) as avx2:
        if int8_product == "avx2":
            assert avx2.gpt_linear_kernel == "avx2"
        if quantize == "int4":  # 4-bit layers, gathered into one call a step; int8 heads
            assert avx2.gpt_linear_kernel == "int4" and "/gpt-int4/" in avx2.identity
            assert avx2.model.transformer.decode_layers is not None
            assert avx2.model.heads.code_head.kernel in ("avx2", "vnni")
        assert avx2.kv_cache_dtype == kv_cache_dtype and f"/kv-{kv_cache_dtype}" in avx2.identity
        requests = [
            SynthesisRequest("第一句话", 41),
            SynthesisRequest("第二句话，长一点", 42),
            SynthesisRequest("hello there", 43),
        ]
        alone = [avx2.synthesize(request).audio for request in requests]
        futures = [avx2.submit(request) for request in requests]
        together = [future.result(timeout=60).audio for future in futures]
        for one, other in zip(alone, together):
            assert one.size > 0 and np.array_equal(one, other)


def test_int8_weights_are_a_quarter_of_fp32(engine, tiny_model_dir):
    from transformers import LlamaModel

    from chattts_service.inference.transformer import Transformer

    llama = LlamaModel.from_pretrained(str(tiny_model_dir / "asset/gpt"))
    fp32 = Transformer(llama, "none")
    linears = [
        linear
        for layer in fp32.layers
        for linear in (layer.qkv, layer.out, layer.gate_up, layer.down)
    ]
    # one byte a weight, plus at most 8 bytes a channel (its scale; the VNNI layout adds its
    # weight sum and pads the channels to a multiple of 16 with zero weights)
    most = sum(-(-linear.out_features // 16) * 16 * (linear.in_features + 8) for linear in linears)
    assert fp32.linear_bytes / 4 < engine.gpt_linear_bytes <= most
    assert engine.identity.startswith("tiny-random/gpt-int8/")


def test_a_stage_that_ends_at_its_prefill_still_hands_over_to_the_next(engine, monkeypatch):
    import chattts_service.inference.prompts as prompts_module

    # a one-step refinement finishes during its prefill; its speech stage must still run
    monkeypatch.setattr(prompts_module, "REFINE_MAX_STEPS", 1)
    result = engine.synthesize(SynthesisRequest("交接测试", 31, refine_text=True), timeout=60)
    assert result.steps >= 1


def test_segments_queued_together_generate_together(engine, monkeypatch):
    """A request's segments, queued at once, are admitted at once, even when the first would be
    done within one iteration of the scheduler (2 steps each here): none is left in the queue
    behind a batch that emptied, waiting for the idle wake-up (half a second a segment)."""
    rows_per_step: list[int] = []
    monkeypatch.setattr(engine.scheduler, "_on_step", lambda rows, _: rows_per_step.append(rows))
    request = SynthesisRequest("".join(f"第{i}句话讲了一件事情。" for i in range(1, 13)), seed=62)
    segments = engine.segments(request)
    assert 2 <= len(segments) <= engine.settings.max_batch
    hold = threading.Event()
    held = engine.scheduler.call(hold.wait)  # the scheduler busy until every segment is queued
    run = engine.start(request, fixed_steps=2)
    hold.set()
    held.result(timeout=30)
    result = run.result(60)
    assert result.segments == len(segments) and result.steps == 2 * len(segments)
    assert rows_per_step == [len(segments)]


def test_a_request_past_its_deadline_is_dropped_and_the_batch_goes_on(engine):
    import time

    from chattts_service.domain.speech import DeadlineExceeded

    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        # thousands of forced steps: far longer than the deadline
        engine.synthesize(SynthesisRequest("超时测试", 41), fixed_steps=4000, timeout=0.5)
    assert time.monotonic() - started < 5
    deadline = time.monotonic() + 5
    while engine.scheduler.depth and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.scheduler.depth == 0, "the dropped request still holds a batch row"
    assert engine.synthesize(SynthesisRequest("超时之后", 42)).steps >= 1


def test_a_caller_that_goes_away_has_its_request_dropped(engine):
    import time

    from chattts_service.domain.speech import Cancelled

    asked = time.monotonic() + 0.3
    with pytest.raises(Cancelled, match="went away"):
        engine.synthesize(
            SynthesisRequest("离开测试", 43),
            fixed_steps=4000,
            should_stop=lambda: time.monotonic() > asked,
        )
    deadline = time.monotonic() + 5
    while engine.scheduler.depth and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.scheduler.depth == 0


def test_client_disconnect_is_detected_on_the_socket():
    import socket

    from chattts_service.api.speech import client_gone

    server_side, client_side = socket.socketpair()
    gone = client_gone({"gunicorn.socket": server_side})
    assert gone() is False
    client_side.sendall(b"GET / HTTP/1.1\r\n")  # a pipelined request is not a disconnect
    assert gone() is False
    server_side.recv(100)
    client_side.close()
    assert gone() is True
    server_side.close()
    assert client_gone({}) is None


# -- speech options, streaming, long text -----------------------------------------------------


def test_streamed_audio_is_the_non_streamed_audio(engine):
    request = SynthesisRequest("流式测试，一句话。", seed=51)
    whole = engine.synthesize(request, fixed_steps=200)
    chunks = list(engine.start(request, fixed_steps=200, stream=True).chunks(timeout=60))
    # first chunk early, then growing chunks, then the tail: several of them
    assert len(chunks) >= 4
    streamed = np.concatenate(chunks)
    assert len(streamed) == len(whole.audio)
    error = np.linalg.norm(streamed - whole.audio) / np.linalg.norm(whole.audio)
    assert error < 1e-3, error


def test_decoder_context_covers_the_receptive_field(fp32_decoder_engine):
    """A window decoded with less context than ``context_steps`` differs from the whole
    decode, with exactly that much it does not: the stream's overlap is neither short nor
    arbitrary."""
    engine = fp32_decoder_engine
    context = engine.context_steps
    assert context >= 4
    hiddens = torch.randn(
        120, engine.model.heads.hidden_size, generator=torch.Generator().manual_seed(0)
    )

    def window_error(left_right: int) -> float:
        result = engine.scheduler.call(
            lambda: (
                engine.decode(hiddens, decoder_dtype="fp32"),
                engine.decode(hiddens[60 - left_right : 80 + left_right], decoder_dtype="fp32"),
            )
        ).result()
        whole, window = result
        piece = window[left_right * 512 : (left_right + 20) * 512]
        reference = whole[60 * 512 : 80 * 512]
        return float(np.linalg.norm(piece - reference) / np.linalg.norm(reference))

    assert window_error(context) < 1e-5
    assert window_error(max(1, context // 3)) > 1e-4


def test_a_span_decodes_what_the_whole_window_gives_for_those_steps(engine):
    """``AudioDecoder.span`` runs each stage on the frames the later stages read; the samples
    it keeps are the window's, within the rounding the stream already allows (a GEMM over
    fewer frames may round a row differently)."""
    decoder = engine.model.decoder
    assert decoder._stages is not None  # ChatTTS's modules: the cropping path, no fallback
    context = decoder.context_steps
    hiddens = torch.randn(
        3 * context + 40, engine.model.heads.hidden_size, generator=torch.Generator().manual_seed(1)
    )

    def compare(first: int, last: int | None) -> tuple[int, float]:
        window = hiddens if last is None else hiddens[: last + context]
        reference = decoder(window)[first * 512 : None if last is None else last * 512]
        got = decoder.span(window, first, last)
        assert got.dtype == np.float32 and len(got) == len(reference)
        return len(got), float(np.linalg.norm(got - reference) / np.linalg.norm(reference))

    spans = [(0, 8), (0, None), (context, context + 16), (context, context + 1), (5, 20)]
    spans.append((context + 3, None))
    results = engine.scheduler.call(lambda: [compare(*span) for span in spans]).result()
    for (first, last), (length, error) in zip(spans, results, strict=True):
        if last is not None:
            assert length == (last - first) * 512
        assert error < 1e-6, (first, last, error)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_streams_decoded_stage_by_stage_are_their_whole_decodes(fp32_decoder_engine, dtype):
    """``advance_many`` keeps each stream's stage inputs between calls: three streams fed at
    different paces (a call before any audio is exact, calls of a few steps, a stream ending
    while the others go on, an end with no new step, batched together) give each a decode of
    the whole, every chunk ending at its ``until``. Without the inputs kept between calls (a
    fresh state each time) the samples go wrong: the kept frames are what makes it exact."""
    from chattts_service.inference.decoding import Advance, AudioDecoder

    engine = fp32_decoder_engine
    model = engine.model.decoder
    decoder = AudioDecoder(model.decoder, model.vocos, dtype)
    context = decoder.context_steps
    generator = torch.Generator().manual_seed(4)
    hidden = engine.model.heads.hidden_size
    streams = [torch.randn(steps, hidden, generator=generator) for steps in (3 * context, 70, 25)]
    paces = [
        [context // 2, context + 12, context + 13, 2 * context + 5, 3 * context],
        [context + 40, 70],
        [20, 25, 25],  # the last call brings no new step: only the end's padding
    ]

    def run(fresh: bool) -> list[tuple[list[np.ndarray], np.ndarray]]:
        states = [decoder.stream() for _ in streams]
        chunks: list[list[np.ndarray]] = [[] for _ in streams]
        for call in range(max(map(len, paces))):
            items, owners = [], []
            for index, (hiddens, pace) in enumerate(zip(streams, paces, strict=True)):
                if call < len(pace):
                    steps, final = pace[call], call == len(pace) - 1
                    state = decoder.stream() if fresh else states[index]
                    until = max(0, steps - context)
                    items.append(Advance(state, hiddens[:steps], until, final))
                    owners.append(index)
            for index, samples in zip(owners, decoder.advance_many(items), strict=True):
                chunks[index].append(samples)
        return [(pieces, decoder(hiddens)) for pieces, hiddens in zip(chunks, streams, strict=True)]

    bound = 1e-5 if dtype == "fp32" else 0.03
    results = engine.scheduler.call(lambda: run(fresh=False)).result()
    for (pieces, whole), pace in zip(results, paces, strict=True):
        streamed = np.concatenate(pieces)
        assert len(streamed) == len(whole)
        assert np.linalg.norm(streamed - whole) <= bound * np.linalg.norm(whole)
        untils = [0] + [max(0, steps - context) for steps in pace[:-1]]
        for piece, before, after in zip(pieces[:-1], untils, untils[1:], strict=False):
            assert len(piece) == (after - before) * 512
    assert len(results[0][0][0]) == 0  # before its first exact step: nothing yet
    broken = engine.scheduler.call(lambda: run(fresh=True)).result()
    pieces, whole = broken[0]
    streamed = np.concatenate(pieces)[: len(whole)]
    assert len(streamed) != len(whole) or np.linalg.norm(streamed - whole) > 0.1 * np.linalg.norm(
        whole
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_a_block_run_on_its_kept_frames_gives_their_values(tiny_model_dir, dtype):
    """A stream's chunk runs each ConvNeXt block past its depthwise convolution on the frames
    it keeps alone (``_BlockStage.kept``): each of them is the value the whole block gives that
    frame, on ChatTTS's blocks and Vocos', for every decoder precision, on a canvas laid out as
    the stage's depthwise convolution reads it. The same bits with pip's torch; Debian's (the
    image's) rounds fp32 products over other row counts otherwise, so the block's own part
    (its output less the residual) is held to 1e-5 of its norm, as streams are to their whole
    decodes, where the frames one to the side miss by far more."""
    from chattts_service.inference.decoding import _BlockStage
    from chattts_service.kernels import bindings

    if dtype == "int8" and not bindings.cpu_supports():
        pytest.skip("the C++ kernels need AVX2 and FMA, which this CPU lacks")
    with engine_on(tiny_model_dir, decoder_dtype=dtype) as engine:
        decoder = engine.model.decoder
        stages = [
            (stage, radius) for stage, radius in decoder._stages if isinstance(stage, _BlockStage)
        ]
        kinds = {type(stage.block).__module__.split(".")[0] for stage, _ in stages}
        assert kinds == {"ChatTTS", "vocos"}

        def compare():
            generator = torch.Generator().manual_seed(6)
            found = []
            for stage, radius in stages:
                channels = stage.block.norm.normalized_shape[0]
                canvas = torch.randn(1, channels, 64, generator=generator)
                if stage.channels_last:
                    canvas = canvas.transpose(1, 2).contiguous().transpose(1, 2)
                spans = [(radius, 17), (30 + radius, 1), (40 + radius, 9)]
                beside = [(first + 1, count) for first, count in spans]
                with (
                    torch.inference_mode(),
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"),
                ):
                    whole = stage(canvas)
                    kept, shifted = stage.kept(canvas, spans), stage.kept(canvas, beside)

                def own(output, at, canvas=canvas):  # the block's part: less the residual
                    residual = torch.cat([canvas[:, :, a : a + n] for a, n in at], dim=2)
                    return output.float() - residual

                expected = own(torch.cat([whole[:, :, a : a + n] for a, n in spans], dim=2), spans)
                scale = expected.norm().item()
                error = (own(kept, spans) - expected).norm().item() / scale
                apart = (own(shifted, beside) - expected).norm().item() / scale
                found.append((expected.shape == kept.shape, scale > 0, error <= 1e-5, apart > 0.1))
                if dtype != "fp32":  # bf16 and int8 products: each frame's bits, whatever the
                    found[-1] += (torch.equal(own(kept, spans), expected),)  # row count
            return found

        checks = engine.scheduler.call(compare).result()
        assert checks == [(True,) * (4 if dtype == "fp32" else 5)] * len(stages)


def test_a_bf16_decoder_holds_bf16_weights_and_gives_autocasts_samples(tiny_model_dir):
    """Autocast casts the convolutions' and linears' weights to bf16 on every call; a bf16
    decoder keeps them so: the same samples, whole and streamed, half the bytes; asked to
    decode in fp32 it says it cannot. Where torch has oneDNN's linear with the bias fused, the
    linear layers run on it, and the samples are still autocast's."""
    from chattts_service.inference.decoder_layers import (
        Bf16Linear,
        KernelDepthwise,
        _depthwise_matches,
        fused_bias_linear,
    )
    from chattts_service.inference.decoding import Advance

    with engine_on(tiny_model_dir, decoder_dtype="fp32") as engine:
        decoder = engine.model.decoder
        hiddens = torch.randn(
            90, engine.model.heads.hidden_size, generator=torch.Generator().manual_seed(8)
        )

        def both():
            state = decoder.stream()
            return decoder(hiddens, "bf16"), decoder.advance_many(
                [Advance(state, hiddens, 90, True)]
            )[0]

        decoder.dtype = "bf16"  # decodes in bf16 by casting, as the service did before
        cast_whole, cast_streamed = engine.scheduler.call(both).result()
        before = sum(p.numel() * p.element_size() for p in decoder.vocos.backbone.parameters())
        kernels = engine.model.transformer.kernels
        decoder.hold_in_bf16(kernels)
        held_whole, held_streamed = engine.scheduler.call(both).result()
        packed = [  # packed weights are no parameters: counted as they are held
            layer.packed
            for layer in decoder.vocos.backbone.modules()
            if isinstance(layer, Bf16Linear) and layer.packed is not None
        ]
        after = sum(
            p.numel() * p.element_size() for p in [*decoder.vocos.backbone.parameters(), *packed]
        )
        fused = [
            layer
            for module in (decoder.decoder, decoder.vocos.backbone)
            for layer in module.modules()
            if isinstance(layer, Bf16Linear)
        ]
        plain = [
            layer
            for module in (decoder.decoder, decoder.vocos.backbone)
            for layer in module.modules()
            if type(layer) is torch.nn.Linear
        ]
        # every linear layer of the two on one path: fused where this torch has it
        assert (fused and not plain) if fused_bias_linear() else (plain and not fused)
        # the ConvNeXt blocks' depthwise convolutions on the kernels, where they give torch's bits
        blocks = [*decoder.decoder.decoder.decoder_block, *decoder.vocos.backbone.convnext]
        wrapped = [isinstance(block.dwconv, KernelDepthwise) for block in blocks]
        convs = [block.dwconv.conv if on else block.dwconv for block, on in zip(blocks, wrapped)]
        assert blocks and wrapped == [
            kernels is not None and _depthwise_matches(kernels, c.kernel_size[0], c.dilation[0])
            for c in convs
        ]
        assert np.array_equal(held_whole, cast_whole)
        assert np.array_equal(held_streamed, cast_streamed)
        assert after < 0.6 * before
        with pytest.raises(ValueError, match="holds its weights in bf16"):
            engine.scheduler.call(lambda: decoder(hiddens, "fp32")).result()


def test_a_packed_bf16_linear_gives_the_plain_weights_bits():
    """``Bf16Linear.pack`` holds the weight in oneDNN's blocked layout where its product then
    gives the plain weight's bits (checked on three row counts): on row counts and shapes the
    check did not try, the same bits as the plain layer, the plain copy gone. Where this CPU's
    packing rounds otherwise, it says so and keeps the plain weight."""
    from chattts_service.inference.decoder_layers import Bf16Linear, fused_bias_linear

    if not fused_bias_linear():
        pytest.skip("this torch has no oneDNN linear with a fused bias (a build without oneDNN)")
    generator = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(384, 1000)  # 1000: the last block of outputs partly filled
    with torch.no_grad():
        linear.weight.copy_(torch.randn(1000, 384, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(1000, generator=generator) * 0.05)
    linear.to(torch.bfloat16)
    plain, packed = Bf16Linear(linear), Bf16Linear(linear)
    did = packed.pack()
    assert plain.packed is None and plain.weight is not None
    if did:
        assert packed.packed is not None and "weight" not in dict(packed.named_parameters())
    else:
        assert packed.packed is None and packed.weight is not None
    with torch.inference_mode():
        for shape in ((1, 2, 384), (1, 33, 384), (3, 100, 384), (300, 384), (1, 1, 384)):
            x = torch.randn(*shape, generator=generator)  # float32: rounded to bf16 first
            assert torch.equal(packed(x), plain(x)), shape


def test_an_fp32_decoder_runs_its_depthwise_convolutions_on_the_kernels_to_the_bit(
    fp32_decoder_engine,
):
    """The fp32 decoder's ConvNeXt blocks' depthwise convolutions run on the kernels in
    float32 where they give torch's bits (checked once per process): whole windows, batches
    and streams give, bit for bit, what the same decoder gives with torch's convolutions; asked
    for bf16 (autocast) it still gives autocast's samples."""
    from chattts_service.inference.decoder_layers import (
        KernelDepthwise,
        _depthwise_matches,
        on_kernel_depthwise,
    )
    from chattts_service.inference.decoding import Advance

    engine = fp32_decoder_engine
    decoder, kernels = engine.model.decoder, engine.model.transformer.kernels
    if kernels is None:
        pytest.skip("the C++ kernels are off here (they need AVX2 and FMA)")
    blocks = [*decoder.decoder.decoder.decoder_block, *decoder.vocos.backbone.convnext]
    convs = [getattr(block.dwconv, "conv", block.dwconv) for block in blocks]
    wrapped = [isinstance(block.dwconv, KernelDepthwise) for block in blocks]
    assert blocks and wrapped == [
        _depthwise_matches(kernels, c.kernel_size[0], c.dilation[0], float32=True) for c in convs
    ]
    if not any(wrapped):
        pytest.skip("this torch's float32 depthwise convolution sums otherwise than the kernel")
    items = _windows(engine, 4)
    hiddens = items[1][0]

    def everything():
        state = decoder.stream()
        steps = hiddens.shape[0]
        streamed = [
            decoder.advance_many([Advance(state, hiddens[:until], until - 40, False)])[0]
            for until in range(60, steps, 23)
        ]
        streamed += decoder.advance_many([Advance(state, hiddens, steps, True)])
        return (
            decoder(hiddens),
            decoder(hiddens, "bf16"),
            [decoder.span(*item) for item in items],
            np.concatenate(streamed),
        )

    on = engine.scheduler.call(everything).result()
    modules = (decoder.decoder, decoder.vocos.backbone)
    engine.scheduler.call(lambda: on_kernel_depthwise(modules, None)).result()
    try:
        assert not any(isinstance(block.dwconv, KernelDepthwise) for block in blocks)
        off = engine.scheduler.call(everything).result()
    finally:
        engine.scheduler.call(lambda: on_kernel_depthwise(modules, kernels)).result()
    assert np.array_equal(on[0], off[0]) and np.array_equal(on[1], off[1])
    assert not np.array_equal(on[0], on[1])  # bf16 is autocast's, not the float32 kernel's
    for one, other in zip(on[2], off[2], strict=True):
        assert np.array_equal(one, other)
    assert np.array_equal(on[3], off[3]) and len(on[3]) == len(on[0])


def test_an_int8_decoder_runs_its_pointwise_layers_on_the_kernels(
    tiny_model_dir, fp32_decoder_engine
):
    """CHATTTS_DECODER_DTYPE=int8: every ConvNeXt block's two pointwise layers on the
    kernels' int8 product, the rest fp32; near the fp32 decoder's samples; each frame
    quantized on its own, so a batch of windows decodes what each window gives alone and a
    stream what its whole answer gives, but for the fp32 layers' rounding (1e-5 of a window
    in fp32), which now and then moves a value across a quantization level; asked to decode
    in fp32 it says it cannot."""
    from chattts_service.inference.decoder_layers import Int8Pointwise, KernelDepthwise
    from chattts_service.inference.decoder_layers import _depthwise_matches as matches
    from chattts_service.kernels import bindings

    if not bindings.cpu_supports():
        pytest.skip("the C++ kernels need AVX2 and FMA, which this CPU lacks")
    with engine_on(tiny_model_dir, max_new_tokens=200, decoder_dtype="int8") as engine:
        decoder = engine.model.decoder
        kernels = engine.model.transformer.kernels
        blocks = [*decoder.decoder.decoder.decoder_block, *decoder.vocos.backbone.convnext]
        assert blocks and decoder.held == "int8"
        for block in blocks:
            assert isinstance(block.pwconv1, Int8Pointwise)
            assert isinstance(block.pwconv2, Int8Pointwise)
            # the depthwise convolutions on the kernels in float32, where torch's bits
            conv = getattr(block.dwconv, "conv", block.dwconv)
            on = isinstance(block.dwconv, KernelDepthwise)
            assert on == matches(kernels, conv.kernel_size[0], conv.dilation[0], float32=True)
        # the bias rides in the product's call as a residual of row stride 0: the same bits as
        # adding it after
        layer = blocks[0].pwconv1
        frames = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(4))
        with_bias = engine.scheduler.call(lambda: layer(frames)).result()
        assert with_bias.shape == (2, 5, layer.out_features)
        assert torch.equal(with_bias, layer.product(frames) + layer.bias)
        items = _windows(engine, 6)
        hiddens = items[1][0]
        int8_whole = engine.scheduler.call(lambda: decoder(hiddens)).result()
        fp32_whole = fp32_decoder_engine.scheduler.call(
            lambda: fp32_decoder_engine.model.decoder(hiddens)
        ).result()
        error = np.linalg.norm(int8_whole - fp32_whole) / np.linalg.norm(fp32_whole)
        assert 0 < error < 0.1, error

        def alone_and_together():
            return [decoder.span(*item) for item in items], decoder.spans(items)

        alone, together = engine.scheduler.call(alone_and_together).result()
        for one, batched in zip(alone, together, strict=True):
            assert len(one) == len(batched)
            assert np.linalg.norm(batched - one) <= 1e-3 * np.linalg.norm(one)
        request = SynthesisRequest("流式测试，一句话。", seed=52)
        whole = engine.synthesize(request, fixed_steps=200)
        streamed = np.concatenate(
            list(engine.start(request, fixed_steps=200, stream=True).chunks(timeout=60))
        )
        assert len(streamed) == len(whole.audio)
        error = np.linalg.norm(streamed - whole.audio) / np.linalg.norm(whole.audio)
        assert error < 1e-3, error
        with pytest.raises(ValueError, match="holds its weights in int8"):
            engine.scheduler.call(lambda: decoder(hiddens, "fp32")).result()


def test_an_int8_decoder_without_the_kernels_is_refused_at_load(tiny_model_dir):
    from chattts_service.config import SettingsError

    with (
        pytest.raises(SettingsError, match="CHATTTS_DECODER_DTYPE=int8 runs on the C"),
        engine_on(tiny_model_dir, kernels="off", decoder_dtype="int8"),
    ):
        pass


def test_long_text_is_split_batched_and_joined_without_losing_a_segment(engine):
    sentence = "第{}句话讲了一件事情。"
    text = "".join(sentence.format(i) for i in range(1, 13))
    request = SynthesisRequest(text, seed=61)
    segments = engine.segments(request)
    assert len(segments) >= 2 and all(len(s) <= engine.settings.max_segment_chars for s in segments)
    # every sentence is in exactly one segment, in order
    joined = "".join(segments)
    for i in range(1, 13):
        assert joined.count(engine.prompts.normalise(sentence.format(i))) == 1
    result = engine.synthesize(request)
    assert result.segments == len(segments) and result.truncated == 0
    pause = int(engine.settings.segment_pause_ms / 1000 * SAMPLE_RATE)
    assert len(result.audio) == sum(
        (2 * steps - 1) * 256
        for steps in [
            engine.synthesize(SynthesisRequest(s, 61, normalize=False)).steps for s in segments
        ]
    ) + pause * (len(segments) - 1)
    streamed = np.concatenate(list(engine.start(request, stream=True).chunks(timeout=60)))
    assert np.linalg.norm(streamed - result.audio) <= 1e-3 * np.linalg.norm(result.audio)


def test_voices_speed_and_sampling_change_the_audio_and_are_reproducible(engine):
    base = SynthesisRequest("选项测试", seed=71)
    alloy = engine.voices.get("alloy")
    assert alloy.embedding.shape == (engine.model.heads.hidden_size,)
    assert torch.equal(engine.voices.get("alloy").embedding, alloy.embedding)  # stable
    variants = [
        base,
        replace(base, voice=alloy),
        replace(base, voice=engine.voices.get("nova")),
        replace(base, speed=9),
        replace(base, temperature=1.0),
        replace(base, top_k=1),
    ]
    audios = [engine.synthesize(v, fixed_steps=40).audio for v in variants]
    for i in range(len(audios)):
        for j in range(i + 1, len(audios)):
            assert not np.array_equal(audios[i], audios[j]), (variants[i], variants[j])
    again = engine.synthesize(replace(base, voice=alloy), fixed_steps=40).audio
    assert np.array_equal(again, audios[1])
    # seed:N is the voice a request without a voice gets from its seed
    seeded = replace(base, voice=engine.voices.get("seed:71"))
    assert np.array_equal(engine.synthesize(seeded, fixed_steps=40).audio, audios[0])


def test_registered_voice_round_trips_through_its_file(engine, tmp_path):
    from chattts_service.domain.embeddings import encode_embedding
    from chattts_service.domain.voice_store import VoiceStore
    from chattts_service.domain.voices import VoiceError

    store = VoiceStore(tmp_path / "voices", engine.voices.dim, engine.speaker_embedding)
    embedding = torch.randn(store.dim, generator=torch.Generator().manual_seed(3))
    voice = store.register("narrator_1", encode_embedding(embedding))
    assert (tmp_path / "voices" / "narrator_1.json").is_file()
    assert torch.allclose(
        voice.embedding, embedding, atol=1e-2
    )  # stored as float16, as ChatTTS does
    assert "narrator_1" in store.names()
    with pytest.raises(VoiceError, match="exists"):
        store.register("narrator_1", encode_embedding(embedding))
    replaced = store.register("narrator_1", encode_embedding(-embedding), replace=True)
    assert replaced.digest != voice.digest
    for bad in ("../etc", "A", "a/b", "", "x" * 65, ".hidden"):
        with pytest.raises(VoiceError):
            store.register(bad, encode_embedding(embedding))
    with pytest.raises(VoiceError, match="has 3 values"):
        store.register("short", encode_embedding(torch.ones(3)))
    with pytest.raises(VoiceError, match="not a ChatTTS speaker embedding"):
        store.register("junk", "not an embedding")
    store.delete("narrator_1")
    assert "narrator_1" not in store.names()


def test_speech_prompts_in_one_voice_share_their_first_three_positions(engine):
    """[Stts][spk_emb][speed_N] begins every speech prompt: the same embeddings for every text
    in one voice and speed (so their keys and values are kept once), others in another."""
    request = SynthesisRequest("你好。", seed=3)
    voice, other = engine.speaker_embedding(3), engine.speaker_embedding(4)
    first = engine.prompts.code_sequence("你好。", request, voice, fixed_steps=2)
    second = engine.prompts.code_sequence("再见，朋友们。", request, voice, fixed_steps=2)
    third = engine.prompts.code_sequence("你好。", request, other, fixed_steps=2)
    assert first.shared_prefix == second.shared_prefix == third.shared_prefix == 3
    assert torch.equal(first.prompt[:3], second.prompt[:3])
    assert not torch.equal(first.prompt[:4], second.prompt[:4])
    assert not torch.equal(first.prompt[:3], third.prompt[:3])
    faster = replace(request, speed=2)
    assert engine.prompts.code_sequence("你好。", faster, voice, fixed_steps=2).shared_prefix == 3
    assert engine.prompts.text_sequence("你好。", request).shared_prefix == 0


def _windows(engine, seed: int):
    """Windows as streams and whole answers ask for them: first chunks without left context,
    middle chunks with context on both sides, tails, whole segments; widths all different."""
    context = engine.model.decoder.context_steps
    hidden = engine.model.heads.hidden_size
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (8 + context, 0, 8),
        (150, 0, None),
        (2 * context + 32, context, context + 32),
        (context + 94, context, None),
        (3 * context, 5, 20),
        (2 * context + 16, context, context + 16),
        (40, 0, None),
    ]
    return [(torch.randn(steps, hidden, generator=generator), a, b) for steps, a, b in shapes]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_batch_of_windows_decodes_what_each_window_gives_alone(fp32_decoder_engine, dtype):
    """``AudioDecoder.spans`` puts windows of any widths on one canvas, masked so that each
    row reads what it would alone: fp32 within GEMM rounding of one call per window; bf16
    within the batch-of-one kernel's other rounding (docs/benchmarks.md)."""
    from chattts_service.runtime.cpu import cpu_has_native_bf16

    engine = fp32_decoder_engine

    if dtype == "bf16" and not cpu_has_native_bf16():
        pytest.skip("bf16 decoding runs only where the CPU has native bf16 dot products")
    decoder = engine.model.decoder
    items = _windows(engine, 5)

    def compare():
        kept = decoder.dtype
        decoder.dtype = dtype
        try:
            alone = [decoder.span(*item) for item in items]
            together = decoder.spans(items)
            grouped = decoder.decode_many(items)
        finally:
            decoder.dtype = kept
        return alone, together, grouped

    alone, together, grouped = engine.scheduler.call(compare).result()
    bound = 1e-5 if dtype == "fp32" else 0.03
    for one, batched, many in zip(alone, together, grouped, strict=True):
        assert len(one) == len(batched) == len(many)
        assert np.linalg.norm(batched - one) <= bound * np.linalg.norm(one)
        assert np.linalg.norm(many - one) <= bound * np.linalg.norm(one)


def test_without_its_mask_a_batch_would_not_decode_what_each_window_gives(engine, monkeypatch):
    """The mask is what makes a batch exact: with every frame kept, short rows read the zeros
    and neighbours' widths as frames (a check that the test above can fail)."""
    from chattts_service.inference import decoding

    decoder = engine.model.decoder
    items = _windows(engine, 7)
    monkeypatch.setattr(
        decoding,
        "_mask",
        lambda rows, reach, anchor, offset, width: torch.ones(len(rows), 1, width),
    )
    alone, together = engine.scheduler.call(
        lambda: ([decoder.span(*item) for item in items], decoder.spans(items))
    ).result()
    errors = [
        np.linalg.norm(batched - one) / np.linalg.norm(one)
        for one, batched in zip(alone, together, strict=True)
    ]
    assert max(errors) > 0.05, errors


def test_a_failed_decode_fails_its_own_request_only(engine):
    from chattts_service.inference.decode_queue import DecodeQueue

    queue = DecodeQueue(engine.model.decoder)
    items = _windows(engine, 6)[:3]
    outcomes: list = []

    def done(index):
        def take(samples):
            if index == 1:
                raise RuntimeError("the listener's queue is gone")
            outcomes.append((index, len(samples)))

        return take

    for index, item in enumerate(items):
        queue.submit(*item, done(index), lambda error, index=index: outcomes.append((index, error)))
    engine.scheduler.call(queue.run).result()
    assert [index for index, _ in outcomes] == [0, 1, 2]
    assert isinstance(outcomes[1][1], RuntimeError) and outcomes[0][1] > 0 and outcomes[2][1] > 0
    assert len(queue) == 0


def test_a_round_of_chunks_runs_a_stage_an_iteration_within_its_budget(engine):
    """With a budget of nothing, each ``run`` runs one part of a round (its frames, a stage,
    the head), so the rows wait for one stage at most; the round's chunks arrive together at
    its end with the samples of one ``advance_many`` of the same batch. A stream's second
    chunk, asked for while its first waits, goes in the next round; without a budget one
    ``run`` decodes both rounds."""
    from chattts_service.inference.decode_queue import DecodeQueue
    from chattts_service.inference.decoding import Advance

    decoder = engine.model.decoder
    context = decoder.context_steps
    generator = torch.Generator().manual_seed(11)
    hidden = engine.model.heads.hidden_size
    streams = [torch.randn(steps, hidden, generator=generator) for steps in (90, 70, 60)]
    firsts = [(0, 80, False), (1, 70, True), (2, 40, False)]  # (stream, steps fed, final)
    second = (0, 90, True)
    parts = len(decoder._stages) + 2  # the frames, every stage, the head

    def chunk(states, stream, steps, final):
        until = steps if final else steps - context
        return Advance(states[stream], streams[stream][:steps], until, final)

    def expected():
        states = [decoder.stream() for _ in streams]
        round_one = decoder.advance_many([chunk(states, *one) for one in firsts])
        return round_one, decoder.advance_many([chunk(states, *second)])[0]

    def queued(budget):
        queue = DecodeQueue(decoder)
        states = [decoder.stream() for _ in streams]
        got: list[tuple[int, int, np.ndarray]] = []
        for index, one in enumerate([*firsts, second]):
            work = chunk(states, *one)
            queue.submit_stream(
                work.state,
                work.hiddens,
                work.until,
                work.final,
                lambda samples, index=index: got.append((calls, index, samples)),
                lambda error: got.append((calls, -1, error)),
            )
        calls = 0
        while queue.pending or len(queue):
            calls += 1
            queue.run(budget=budget)
            assert calls <= 3 * parts
        return got, calls

    (round_one, tail), (sliced, calls), (whole, one_call) = engine.scheduler.call(
        lambda: (expected(), queued(0.0), queued(None))
    ).result()
    assert calls == 2 * parts and one_call == 1
    assert [(call, index) for call, index, _ in sliced] == [
        (parts, 0),
        (parts, 1),
        (parts, 2),
        (2 * parts, 3),
    ]
    assert [index for _, index, _ in whole] == [0, 1, 2, 3]
    for got in (sliced, whole):
        for (_, _, samples), wanted in zip(got, [*round_one, tail], strict=True):
            assert len(wanted) and np.array_equal(samples, wanted)


@pytest.mark.parametrize("which", ["engine", "fp32_decoder_engine"])
def test_windows_decode_in_parts_within_a_budget_and_give_decode_manys_samples(request, which):
    """Whole answers' windows run as rounds too, a round's longest stage kept within half the
    budget at the measured pace: with a budget of nothing each window is a round of its own,
    run a part an iteration (a stage in bf16, the window in fp32 and int8) and delivered at its
    round's end with ``decode_many``'s samples of it alone; with a budget that fits them all,
    and without one, the windows go as one round (``decode_many``'s batches) in one ``run``."""
    from chattts_service.inference.decode_queue import DecodeQueue

    engine = request.getfixturevalue(which)
    decoder = engine.model.decoder
    items = _windows(engine, 13)[:4]

    def queued(budget):
        queue = DecodeQueue(decoder)
        got: list[tuple[int, np.ndarray]] = []
        for item in items:
            queue.submit(*item, lambda samples: got.append((calls, samples)), pytest.fail)
        calls = 0
        while queue.pending or len(queue):
            calls += 1
            queue.run(budget=budget)
            assert calls <= 200
        return got, calls

    def expected():
        return decoder.decode_many(items), [decoder.decode_many([item])[0] for item in items]

    (together, alone), (sliced, calls), (roomy, roomy_calls), (whole, one_call) = (
        engine.scheduler.call(
            lambda: (expected(), queued(0.0), queued(1000.0), queued(None))
        ).result()
    )
    assert calls >= len(items) and roomy_calls == one_call == 1
    delivered = [call for call, _ in sliced]
    assert delivered == sorted(set(delivered)) and delivered[-1] == calls  # one a round
    for got, wanted_samples in ((sliced, alone), (roomy, together), (whole, together)):
        for (_, samples), wanted in zip(got, wanted_samples, strict=True):
            assert len(wanted) and np.array_equal(samples, wanted)


def test_windows_start_no_stage_past_the_budget_before_a_prefill_piece(engine, monkeypatch):
    """With a prefill piece to follow (``piece_follows``: it goes whatever time is left) and
    no chunks, windows start no stage their measured pace says would pass the budget (with
    none to follow, one stage goes anyway); once they have had no stage for
    ``MAX_DEFER_SECONDS`` they go, and their samples are ``decode_many``'s."""
    from chattts_service.inference import decode_queue, decoding

    decoder = engine.model.decoder
    items = _windows(engine, 13)[:2]
    stages = []
    run_stage = decoding.Round.run_stage

    def counted(self):
        stages.append(self)
        return run_stage(self)

    monkeypatch.setattr(decoding.Round, "run_stage", counted)

    def run():
        queue = decode_queue.DecodeQueue(decoder)
        got: list[np.ndarray] = []
        for item in items:
            queue.submit(*item, got.append, pytest.fail)
        queue.run(budget=0.0)
        for _ in range(5):
            queue.run(budget=0.0, piece_follows=True)
        held = (len(stages), queue.pending)
        monkeypatch.setattr(decode_queue, "MAX_DEFER_SECONDS", 0.0)
        calls = 0
        while queue.pending or len(queue):
            calls += 1
            queue.run(budget=0.0, piece_follows=True)
            assert calls <= 200
        return held, got, calls, decoder.decode_many([items[0]]) + decoder.decode_many([items[1]])

    (started, pending), got, calls, wanted = engine.scheduler.call(run).result()
    assert started == 1 and pending  # the stage with no piece to follow, then none
    assert calls >= 2 and len(got) == len(wanted) == 2
    for samples, expected in zip(got, wanted, strict=True):
        assert len(expected) and np.array_equal(samples, expected)


def test_a_bulk_window_waits_for_the_streams_slack_and_longer_while_one_starts(engine, monkeypatch):
    """A bulk segment's whole audio waits while the streams cannot spare its time; once it has
    waited ``MAX_DEFER_SECONDS`` it goes anyway, unless a stream waits for its first audio:
    then until ``MAX_HOLD_SECONDS``. With time to spare it goes at once."""
    from chattts_service.inference import decode_queue

    queue = decode_queue.DecodeQueue(engine.model.decoder)
    hiddens, first, last = _windows(engine, 12)[1]  # a whole segment's window
    decoded: list[int] = []

    def ask() -> None:
        queue.submit(
            hiddens,
            first,
            last,
            lambda samples: decoded.append(len(samples)),
            pytest.fail,
            deferrable=True,
        )

    def run(slack, starting=False) -> int:
        before = len(decoded)
        engine.scheduler.call(lambda: queue.run(slack, None, starting)).result()
        return len(decoded) - before

    ask()
    assert run(0.0) == 0 and queue.pending  # no slack, not overdue
    assert run(10.0) == 1 and not queue.pending  # slack enough
    monkeypatch.setattr(decode_queue, "MAX_DEFER_SECONDS", 0.0)  # every window overdue
    ask()
    assert run(0.0, starting=True) == 0 and queue.pending  # a stream starts: held
    assert run(0.0) == 1 and not queue.pending
    monkeypatch.setattr(decode_queue, "MAX_HOLD_SECONDS", 0.0)
    ask()
    assert run(0.0, starting=True) == 1  # held as long as it may be
    assert decoded and all(length == decoded[0] > 0 for length in decoded)


def test_concurrent_streams_are_their_whole_answers_and_chunks_follow_the_listener(engine):
    """Four streams decoded together (their chunks batched) give what each gives whole, and a
    stream's chunks grow: the second as large as the first at least, and no chunk after it but
    the last under the first's size (the smallest a stream sends when its listener would
    otherwise run dry)."""
    from chattts_service.inference import job

    requests = [SynthesisRequest("并发流式测试。", seed=90 + i) for i in range(4)]
    wholes = [engine.synthesize(request, fixed_steps=180).audio for request in requests]
    runs = [engine.start(request, fixed_steps=180, stream=True) for request in requests]
    results = read_streams(runs)
    bound = 1e-3 if engine.model.decoder.dtype == "fp32" else 0.03
    for whole, chunks in zip(wholes, results, strict=True):
        streamed = np.concatenate(chunks)
        assert len(streamed) == len(whole)
        assert np.linalg.norm(streamed - whole) <= bound * np.linalg.norm(whole)
        # the first: FIRST_CHUNK_STEPS, or a step or two fewer to join the others' first round
        assert job.JOIN_FIRST_STEPS * 512 <= len(chunks[0]) <= job.FIRST_CHUNK_STEPS * 512
        sizes = [len(chunk) // 512 for chunk in chunks]
        assert len(chunks) < 3 or sizes[1] >= job.FIRST_CHUNK_STEPS, sizes
        assert all(size >= job.FIRST_CHUNK_STEPS for size in sizes[2:-1]), sizes


def test_a_stream_sends_what_waits_when_its_full_chunk_would_come_too_late():
    """The slow host's case: after two 12-step chunks the listener holds 0.325 s and a step
    takes 16 ms, so waiting for the third chunk's 24 steps (0.38 s) would leave it without
    audio; with 12 steps waiting (0.19 s to the 24) it goes. At 7 ms a step the stream waits
    for its full size, as it does while the listener is well ahead."""
    from chattts_service.inference import job

    size = 2 * job.FIRST_CHUNK_STEPS
    slow, fast = 0.016, 0.007
    assert not job.later_chunk_due(job.FIRST_CHUNK_STEPS - 1, size, 0.325, slow)
    assert job.later_chunk_due(job.FIRST_CHUNK_STEPS, size, 0.325, slow)
    assert not job.later_chunk_due(job.FIRST_CHUNK_STEPS, size, 0.325, fast)
    assert job.later_chunk_due(size, size, 0.325, fast)
    # well ahead (above the low water): nothing until the chunk could join a decode round
    assert not job.later_chunk_due(job.FIRST_CHUNK_STEPS, size, 1.0, slow)
    assert not job.later_chunk_due(size, size, 1.0, slow)
    assert job.later_chunk_due(job.JOIN_CHUNK_STEPS, size, 1.0, slow, joining=True)
    # a chunk of MAX_CHUNK_STEPS goes however far ahead the listener is
    assert job.later_chunk_due(job.MAX_CHUNK_STEPS, job.MAX_CHUNK_STEPS, 30.0, fast)


def test_a_streams_first_chunk_joins_a_decode_that_runs_anyway(tiny_model_dir):
    """A whole answer ends, its decode queued, while a stream admitted with it has 11 steps
    decodable: the stream's first chunk joins that decode round with those 11 steps
    (from JOIN_FIRST_STEPS on) instead of waiting for FIRST_CHUNK_STEPS."""
    from chattts_service.inference import job

    with engine_on(tiny_model_dir, batch_wait_ms=500) as engine:
        steps = job.JOIN_FIRST_STEPS + 1
        assert steps < job.FIRST_CHUNK_STEPS
        # both taken in one batch (the idle scheduler waits for the second): the same steps
        whole = engine.start(
            SynthesisRequest("整段先结束。", seed=71), fixed_steps=engine.context_steps + steps
        )
        stream = engine.start(SynthesisRequest("流式首块。", seed=72), fixed_steps=120, stream=True)
        chunks = list(stream.chunks(timeout=60))
        assert len(whole.result(60).audio) > 0
        assert len(chunks[0]) == steps * 512, len(chunks[0]) // 512
