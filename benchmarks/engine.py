"""Engine benchmark: upstream ChatTTS vs this project's engine, side by side in one run.

    python benchmarks/engine.py [--model-dir DIR] [--steps N] [--json]

Each side runs in its own child process (so peak RSS and start-up are its own), one after the
other so they never share the CPUs:

* baseline: ``Chat.infer`` called the way a plain single-process Flask server would: fp32, one
  request at a time, fresh parameters per call, ``skip_refine_text=True``;
* ours: the service's engine (int8 by default) at concurrency 1, 4 and 8;
* fidelity: fp32 vs int8 on the same inputs with teacher forcing: top-1 agreement of the code
  logits per step, and the distance between the two decoded waveforms;
* arithmetic: what the CPU's instructions allow at most (the int8 product's and fp32 FMAs,
  from registers): the least time the GPT's products can take a step, and the least decode
  share at 8 concurrent; a MISSED target these already put out of reach says so.

Every request generates exactly ``--steps`` GPT steps on both sides (end-of-speech is suppressed
until then), so the work is identical; audio seconds are the nominal length of those steps.
Without ``--model-dir`` a full-size random-weight model is built (or reused) under models/.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chattts_service.config import DECODER_DTYPES, INT8_PRODUCTS, KV_CACHE_DTYPES  # noqa: E402  (nor config)
from chattts_service.runtime import heap  # noqa: E402  (imports nothing heavy)
from chattts_service.runtime.cpu import (  # noqa: E402
    STEAL_WARNING,
    StealMeter,
    cpu_flags,
    cpu_model,
)

TEXT = "今天天气很好，我们一起去公园散步吧。"
DEFAULT_MODEL = REPO / "models" / "full-random"
CONCURRENCY = (1, 4, 8, 16)  # requests at once (16 with CHATTTS_MAX_BATCH 16)


def default_model() -> Path:
    """The full-size random-weight model the benchmarks use by default, built on first use."""
    if not (DEFAULT_MODEL / "architecture.json").is_file():
        from chattts_service.tools.testmodel import build

        print(f"building a full-size random-weight model in {DEFAULT_MODEL} ...", file=sys.stderr)
        build(DEFAULT_MODEL, size="full")
    return DEFAULT_MODEL


def audio_seconds(steps: int) -> float:
    # 2 mel frames per step, hop 256, centred inverse STFT: (frames - 1) hops at 24 kHz
    return (2 * steps - 1) * 256 / 24_000


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def rss_mb() -> dict[str, float]:
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                values[key] = int(rest.split()[0]) / 1024
    return values


def measure_bandwidth(size_mb: int = 1024, repeats: int = 7) -> float:
    """Memory read bandwidth in GB/s: sum over a buffer much larger than the caches."""
    import torch

    buffer = torch.ones(size_mb * 2**20 // 4)
    buffer.sum()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - started)
    return buffer.numel() * 4 / statistics.median(times) / 1e9


READ_PREFETCHES = (0, 1024, 2048, 4096)  # bytes ahead: the fastest differs between CPUs
READ_STREAMS = (1, 4, 8)  # runs a thread reads side by side: some CPUs read several faster


def weights_read_seconds(transformer, rounds: int = 5) -> float | None:
    """The least time a loop that only reads them takes over the GPT's packed linear layers
    (``Kernels.read``: the same pages, threads and CPU as the step's products), fastest of
    several prefetch distances and numbers of runs a thread reads side by side, interleaved;
    None without the kernels' packings."""
    packings = transformer.kernel_packings()
    if len(packings) != 4 * len(transformer.layers):  # no kernels, or not every linear theirs
        return None
    tensors = [tensor for packing in packings for tensor in packing.tensors]
    times = []
    transformer.kernels.read(tensors)  # once untimed: start the threads
    for _ in range(rounds):
        for prefetch in READ_PREFETCHES:
            for streams in READ_STREAMS:
                started = time.perf_counter()
                transformer.kernels.read(tensors, prefetch, streams)
                times.append(time.perf_counter() - started)
    return min(times)


PRODUCT_ROWS = (1, 8)


def products_ms(transformer, rounds: int = 7, calls: int = 15) -> dict | None:
    """The GPT's int8 products alone, one Python call a layer, at each of ``PRODUCT_ROWS``
    rows: ``memory``, a pass over all the layers (each weight read from memory once, as a step
    reads it); ``cache``, the same work with the weights in the caches (each of the first
    layer's products called ``calls`` times in a row, the median call times the layers):
    what the instructions take when memory is no limit. Both less the calls' own fixed cost
    (a call on a 16 x 64 layer, median): the step makes one call for all the layers. None
    without the kernels' int8 packings."""
    import torch

    from chattts_service.kernels.int8 import Int8Packing

    packings = transformer.kernel_packings()
    layers = len(transformer.layers)
    if len(packings) != 4 * layers or not all(isinstance(p, Int8Packing) for p in packings):
        return None
    kernels = transformer.kernels
    tiny = Int8Packing(
        torch.ones(16, 64, dtype=torch.int8), torch.ones(16), packings[0].instructions
    )
    generator = torch.Generator().manual_seed(0)

    def seconds(call, *arguments) -> float:
        started = time.perf_counter()
        call(*arguments)
        return time.perf_counter() - started

    def one_pass(inputs: dict) -> None:
        for packing in packings:
            kernels.int8_linear(inputs[packing.in_features], packing)

    result = {}
    for rows in PRODUCT_ROWS:
        inputs = {
            width: torch.randn(rows, width, generator=generator)
            for width in {packing.in_features for packing in packings}
        }
        tiny_input = torch.randn(rows, 64, generator=generator)
        one_pass(inputs)  # untimed: pages and threads
        fixed = statistics.median(
            seconds(kernels.int8_linear, tiny_input, tiny) for _ in range(calls + 1)
        )
        memory = statistics.median(seconds(one_pass, inputs) for _ in range(rounds))
        cache = 0.0
        for packing in packings[:4]:
            x = inputs[packing.in_features]
            kernels.int8_linear(x, packing)  # into the caches
            cache += statistics.median(
                seconds(kernels.int8_linear, x, packing) for _ in range(calls)
            )
        result[str(rows)] = {
            "memory": (memory - len(packings) * fixed) * 1000,
            "cache": (cache - 4 * fixed) * layers * 1000,
            "call_fixed": fixed * 1000,
        }
    return result


def decode_multiply_adds(decoder, steps: int, hidden_size: int) -> int:
    """The multiply-adds of decoding ``steps`` steps: the decoder's and the vocoder's
    convolutions and linear layers (the bf16 decoder's and the int8 one's too), counted on a
    decode of random hidden states; the inverse STFT and the element-wise work are left out (a
    lower bound)."""
    import torch

    from chattts_service.inference.decoder_layers import Bf16Linear, Int8Pointwise, KernelDepthwise

    total = 0

    def count(module, inputs, output) -> None:
        nonlocal total
        if isinstance(module, KernelDepthwise):  # on the kernels, or its convolution's
            module = module.conv
        if isinstance(module, torch.nn.Conv1d):
            per_output = module.in_channels // module.groups * module.kernel_size[0]
            total += output.numel() * per_output
        else:  # Linear, Bf16Linear or Int8Pointwise: rows x in x out
            total += output.numel() * module.in_features

    modules = [module for part in (decoder.decoder, decoder.vocos) for module in part.modules()]
    wrapped = {id(module.conv) for module in modules if isinstance(module, KernelDepthwise)}
    hooks = [
        module.register_forward_hook(count)
        for module in modules
        if isinstance(
            module, (torch.nn.Conv1d, torch.nn.Linear, Bf16Linear, Int8Pointwise, KernelDepthwise)
        )
        and id(module) not in wrapped  # counted once, by the wrapper
    ]
    try:
        decoder(torch.randn(steps, hidden_size, generator=torch.Generator().manual_seed(0)))
    finally:
        for hook in hooks:
            hook.remove()
    return total


def peak_rates(engine) -> dict[str, float] | None:
    """The most multiply-adds a second (G) the int8 product's instructions, fp32 FMAs and,
    where the CPU has AVX512-BF16, bf16 pairs (the bf16 decoder's products) do from registers
    on the engine's threads (``Kernels.peak_rate``; call on its scheduler's thread). None
    without the kernels."""
    kernels = engine.model.transformer.kernels
    if kernels is None:
        return None
    bf16 = ("bf16",) if "avx512_bf16" in cpu_flags() else ()
    loops = dict.fromkeys((kernels.int8_instructions, "fp32", *bf16))
    return {loop: kernels.peak_rate(loop) / 1e9 for loop in loops}


def arithmetic(engine, steps: int, peaks: list[dict]) -> dict | None:
    """What the CPU's arithmetic allows (call on the engine's scheduler's thread): each loop's
    highest of the ``peaks`` readings (so a slow moment never flatters a bound), the GPT's int8
    multiply-adds per row and step, and a request's decoding's (``decode_multiply_adds``).
    None without the kernels."""
    kernels = engine.model.transformer.kernels
    if kernels is None or None in peaks:
        return None
    packings = engine.model.transformer.kernel_packings()
    return {
        "product": kernels.int8_instructions,
        "peak_readings_gmac_per_s": peaks,
        "peak_gmac_per_s": {loop: max(reading[loop] for reading in peaks) for loop in peaks[0]},
        "gpt_macs_per_row": sum(p.in_features * p.out_features for p in packings),
        "decode_macs": decode_multiply_adds(
            engine.model.decoder, steps, engine.model.heads.hidden_size
        ),
    }


# -- child phases -----------------------------------------------------------------------------


def load_upstream(model_dir: Path):
    """ChatTTS's own ``Chat``, loaded from ``model_dir`` as upstream loads it (fp32, CPU)."""
    import torch
    from ChatTTS import Chat

    from chattts_service.inference import model_files
    from chattts_service.inference.architecture import config_from_architecture, read_architecture
    from chattts_service.inference.loader import quiet_library_chatter

    quiet_library_chatter()
    paths = model_files.check_present(model_dir)
    chat = Chat()
    chat.config = config_from_architecture(read_architecture(paths.architecture))
    chat._load(
        vocos_ckpt_path=str(paths.vocos),
        dvae_ckpt_path=str(paths.dvae),
        gpt_ckpt_path=str(paths.gpt),
        embed_path=str(paths.embed),
        decoder_ckpt_path=str(paths.decoder),
        tokenizer_path=str(paths.tokenizer),
        device=torch.device("cpu"),
    )
    return chat


def upstream_params(chat, seed: int, steps: int):
    """Upstream's parameters for exactly ``steps`` GPT steps in the voice the service draws for
    ``seed`` (a fresh object: ``infer`` mutates the one it is given)."""
    from ChatTTS import Chat

    from chattts_service.inference.prompts import voice_for_seed

    return Chat.InferCodeParams(
        spk_emb=chat.speaker._encode(voice_for_seed(chat.speaker, seed)),
        manual_seed=seed,
        min_new_token=steps,
        max_new_token=steps,
        show_tqdm=False,
    )


def phase_baseline(model_dir: Path, steps: int, requests: int) -> dict:

    started = time.perf_counter()
    chat = load_upstream(model_dir)
    load_seconds = time.perf_counter() - started

    def one(seed: int) -> float:
        params = upstream_params(chat, seed, steps)  # the service's voice for the seed
        began = time.perf_counter()
        chat.infer(TEXT, skip_refine_text=True, params_infer_code=params)
        return time.perf_counter() - began

    one(0)  # warm-up (Numba JIT, allocator)
    reset_peak_rss()
    latencies = [one(seed) for seed in range(1, requests + 1)]
    wall = statistics.median(latencies)
    return {
        "load_seconds": load_seconds,
        "latency_seconds": latencies,
        "ms_per_step": wall / steps * 1000,
        "real_time_factor": wall / audio_seconds(steps),
        "audio_per_wall_second": audio_seconds(steps) / wall,
        "peak_rss_mb": rss_mb()["VmHWM"],
    }


def phase_ours(
    model_dir: Path,
    steps: int,
    quantize: str,
    rounds: int,
    int8_product: str = "auto",
    kv_cache_dtype: str = "bf16",
    decoder_dtype: str = "auto",
) -> dict:
    from chattts_service.config import Settings
    from chattts_service.domain.speech import SynthesisRequest
    from chattts_service.inference.engine import Engine

    step_log: list[tuple[int, float]] = []
    decode_log: list[float] = []  # seconds of each round of audio decoding
    started = time.perf_counter()
    engine = Engine(
        Settings.from_env(
            {},
            model_dir=model_dir,
            verify_model=False,
            quantize=quantize,
            max_batch=16,
            int8_product=int8_product,
            kv_cache_dtype=kv_cache_dtype,
            decoder_dtype=decoder_dtype,
        ),
        step_observer=lambda rows, seconds: step_log.append((rows, seconds)),
        decode_observer=lambda items, seconds: decode_log.append(seconds),
    )
    engine.load()
    engine.warm_up()
    ready_seconds = time.perf_counter() - started
    # the bandwidth read before the runs and after them (its buffer freed before the peak RSS
    # is reset): the floor takes the higher, so a slow moment never flatters the ratio. Read on
    # the scheduler's thread: a parallel operator on this one would give the process a second
    # OpenMP team, and with more workers than CPUs they stop spinning (steps 2x slower)
    bandwidths = [engine.scheduler.call(measure_bandwidth).result()]
    peaks = [engine.scheduler.call(lambda: peak_rates(engine)).result()]
    transformer = engine.model.transformer
    reads = [engine.scheduler.call(lambda: weights_read_seconds(transformer)).result()]
    ready_rss = rss_mb()
    reset_peak_rss()

    results = {}
    seed = 100
    for concurrency in CONCURRENCY:
        step_log.clear()
        decode_log.clear()
        latencies, walls = [], []
        for _ in range(rounds):
            round_latencies = [0.0] * concurrency

            def call(index: int, request_seed: int, latencies_out: list[float]):
                began = time.perf_counter()
                engine.synthesize(SynthesisRequest(TEXT, request_seed), fixed_steps=steps)
                latencies_out[index] = time.perf_counter() - began

            threads = [
                threading.Thread(target=call, args=(i, seed + i, round_latencies))
                for i in range(concurrency)
            ]
            seed += concurrency
            began = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            walls.append(time.perf_counter() - began)
            latencies += round_latencies
        full_steps = [seconds for rows, seconds in step_log if rows == concurrency]
        wall = statistics.median(walls)
        results[str(concurrency)] = {
            "latency_seconds": latencies,
            "ms_per_step": statistics.median(full_steps) * 1000 if full_steps else None,
            "real_time_factor": statistics.median(latencies) / audio_seconds(steps),
            "audio_per_wall_second": concurrency * audio_seconds(steps) / wall,
            "wall_seconds": wall,
            # every row waits while audio is decoded: its share of the runs' wall time
            "decode_share": sum(decode_log) / sum(walls),
        }
    peak_rss = rss_mb()["VmHWM"]  # before the bandwidth's buffer
    bandwidths.append(engine.scheduler.call(measure_bandwidth).result())
    reads.append(engine.scheduler.call(lambda: weights_read_seconds(transformer)).result())
    products = engine.scheduler.call(lambda: products_ms(transformer)).result()
    peaks.append(engine.scheduler.call(lambda: peak_rates(engine)).result())
    bounds = engine.scheduler.call(lambda: arithmetic(engine, steps, peaks)).result()
    engine.close()
    result = {
        "quantize": quantize,
        "decoder_dtype": engine.settings.resolved_decoder_dtype,
        "kernels": engine.kernels,
        "linear_kernel": engine.gpt_linear_kernel,
        "kernel_tuning": engine.kernel_tuning,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "ready_seconds": ready_seconds,
        "load_seconds": engine.load_seconds,
        "rss_after_ready_mb": ready_rss["VmRSS"],
        "gpt_linear_mb": engine.gpt_linear_bytes / 1e6,
        "peak_rss_mb": peak_rss,
        "concurrency": results,
    }
    result["bandwidth_readings_gb_per_s"] = bandwidths
    result["bandwidth_gb_per_s"] = max(bandwidths)
    if None not in reads:
        result["weights_read_ms"] = [seconds * 1000 for seconds in reads]
    result["floor_ms"] = floor_ms(result)
    if products is not None:
        result["products_ms"] = products
    if bounds is not None:
        result["arithmetic"] = bounds
    return result


def arithmetic_bounds(ours: dict, steps: int) -> dict | None:
    """From ``arithmetic``'s figures: the least time the GPT's int8 products take at 1 and 8
    rows (ms a step) and the least decode share at 8 concurrent (decoding 8 requests at the
    decoder's instructions' peak, against the run's own time outside decoding), where the
    instructions' peak is the only limit; None where they do not apply."""
    figures = ours.get("arithmetic")
    if not figures:
        return None
    peaks = figures["peak_gmac_per_s"]
    bounds = {}
    if ours["quantize"] == "int8":
        peak = peaks[figures["product"]] * 1e9
        for rows in (1, 8):
            bounds[f"products_{rows}_ms"] = rows * figures["gpt_macs_per_row"] / peak * 1000
    eight = ours["concurrency"].get("8")
    if eight and "wall_seconds" in eight:
        outside = eight["wall_seconds"] * (1 - eight["decode_share"])
        bounds["outside_decode_8_seconds"] = outside
        for dtype, peak in decoder_peaks(figures):
            decoding = 8 * figures["decode_macs"] / (peak * 1e9)
            bounds[f"decode_8_seconds_{dtype}"] = decoding
            bounds[f"decode_share_8_{dtype}"] = decoding / (decoding + outside)
        if f"decode_share_8_{ours['decoder_dtype']}" in bounds:  # bf16: where its peak is
            bounds["decode_share_8"] = bounds[f"decode_share_8_{ours['decoder_dtype']}"]
    return bounds


def decoder_peaks(figures: dict) -> list[tuple[str, float]]:
    """Each decoder precision with the peak of the instructions its products use (GMAC/s):
    fp32 FMAs, the int8 product's, and bf16 pairs where the CPU has them."""
    peaks = figures["peak_gmac_per_s"]
    found = [("fp32", peaks["fp32"]), ("int8", peaks[figures["product"]])]
    return found + ([("bf16", peaks["bf16"])] if "bf16" in peaks else [])


PEAK_NAMES = {"fp32": "fp32 FMAs", "bf16": "bf16 pairs"}


def arithmetic_lines(ours: dict, bounds: dict, steps: int, floor: float) -> list[str]:
    """``arithmetic``'s peaks and the bounds ``arithmetic_bounds`` drew from them."""
    figures = ours.get("arithmetic")
    if not figures:
        return []
    peaks = figures["peak_gmac_per_s"]
    rates = ", ".join(
        f"{PEAK_NAMES.get(loop, f'the {loop} int8 product')} {rate:.0f}"
        for loop, rate in peaks.items()
    )
    lines = [
        f"arithmetic (from registers, every thread, the higher of a reading before and after "
        f"the runs): GMAC/s at most: {rates}"
    ]
    if "products_1_ms" in bounds:
        lines.append(
            f"  the GPT's int8 products ({figures['gpt_macs_per_row'] / 1e6:.0f} M multiply-adds "
            f"a row) need at least {bounds['products_1_ms']:.2f} ms a step at 1 row "
            f"({bounds['products_1_ms'] / floor:.2f}x the floor), {bounds['products_8_ms']:.2f} "
            f"ms at 8 rows ({bounds['products_8_ms'] / floor:.2f}x)"
        )
    if "decode_share_8_fp32" in bounds:
        least = "; ".join(
            f"{dtype} {bounds[f'decode_8_seconds_{dtype}']:.2f} s, a decode share of at least "
            f"{100 * bounds[f'decode_share_8_{dtype}']:.0f}%"
            + (" (this run's decoder)" if dtype == ours["decoder_dtype"] else "")
            for dtype, _ in decoder_peaks(figures)
        )
        lines.append(
            f"  decoding a request ({figures['decode_macs'] / 1e9:.1f} G multiply-adds in "
            f"{steps} steps) x 8 at the peak, against the 8-concurrent run's other "
            f"{bounds['outside_decode_8_seconds']:.2f} s: {least}"
        )
    return lines


def beyond(bound: float | None, target: float, text: str) -> str:
    """A MISSED target's reason where the arithmetic alone puts it out of reach."""
    return f" (out of reach here: {text})" if bound is not None and bound > target else ""


def products_lines(products: dict | None, floor: float) -> list[str]:
    """What ``products_ms`` measured, against the floor: with the weights in the caches the
    products take what their instructions take, so where that is above the floor, no
    prefetching brings the step down to it."""
    if not products:
        return []
    fixed = max(row["call_fixed"] for row in products.values())
    figures = "; ".join(
        f"{rows} row{'s' if rows != '1' else ''}: {row['memory']:.2f} ms from memory, "
        f"{row['cache']:.2f} ms with the weights in cache ({row['cache'] / floor:.2f}x the floor)"
        for rows, row in products.items()
    )
    return [
        f"int8 products alone (a call a layer, less each call's fixed {1000 * fixed:.0f} us): "
        f"{figures}"
    ]


def floor_ms(ours: dict) -> float:
    """A step's floor: the GPT's linear layers read once, at the faster of the bandwidth a
    torch sum reads and what a loop that only reads the packed layers themselves takes (the
    lower floor, so the ratio to it is never flattered)."""
    by_sum = ours["gpt_linear_mb"] / ours["bandwidth_gb_per_s"]
    return min([by_sum, *ours.get("weights_read_ms", [])])


def phase_fidelity(
    model_dir: Path,
    steps: int,
    seeds: int,
    int8_product: str = "auto",
    kv_cache_dtype: str = "bf16",
    quantize: str = "int8",
    sampled: bool = False,
) -> dict:
    """fp32 generates; the ``quantize`` GPT (int8 or int4, with the service's int8 heads) is
    teacher-forced along the same tokens and compared step by step. ``sampled``: each prompt
    in a voice made from a 10 s recording (its codes in the prompt) instead of an embedding."""
    import numpy as np
    import torch
    from transformers import LlamaModel

    from chattts_service.config import Settings
    from chattts_service.domain.speech import SynthesisRequest
    from chattts_service.domain.voices import SpeakerSample
    from chattts_service.inference.engine import Engine
    from chattts_service.inference.generation import Batch
    from chattts_service.inference.quantize import make_linear
    from chattts_service.inference.transformer import Transformer

    engine = Engine(  # an fp32 decoder decodes both ways (a bf16 one holds bf16 weights)
        Settings.from_env(
            {},
            model_dir=model_dir,
            verify_model=False,
            quantize="none",
            max_batch=1,
            decoder_dtype="fp32",
        )
    )
    engine.load()
    engine.close()
    llama = LlamaModel.from_pretrained(str(model_dir / "asset" / "gpt"))
    reference = Transformer(llama, "none")
    quantized = Transformer(llama, quantize, int8_product=int8_product, kv_cache=kv_cache_dtype)
    del llama
    heads = engine.model.heads
    # the service's int8 code head (int4 too keeps its heads int8), on the transformer's kernels
    int8_head = make_linear(heads.code_head.weight, "int8", quantized.kernels)

    agreements, distances, snrs, decoder_errors = [], [], [], []
    kept_hiddens, fp32_waves, bf16_waves = [], [], []
    for seed in range(seeds):
        request = SynthesisRequest(TEXT, seed)
        speaker = engine.speaker_embedding(seed)
        if sampled:
            speaker = SpeakerSample(engine.sample_encoder(voiced_recording(seed)), TEXT)
        sequence = engine.prompts.code_sequence(
            engine.prompts.normalise(TEXT), request, speaker, fixed_steps=steps
        )
        batch = Batch(reference, heads, 1)
        batch.add(sequence)
        while len(batch):
            batch.step()
        tokens, hiddens = sequence.result_tokens(), sequence.result_hiddens()

        agree = 0
        forced = torch.empty_like(hiddens)
        with torch.inference_mode():
            cache = quantized.new_cache()
            hidden = quantized.prefill(sequence.prompt, cache)
            length = sequence.prompt.shape[0]
            for step in range(tokens.shape[0]):
                forced[step] = hidden
                logits_int8 = int8_head(hidden[None]).view(4, -1)
                logits_fp32 = heads.code_head(hiddens[step][None]).view(4, -1)
                agree += int((logits_int8.argmax(-1) == logits_fp32.argmax(-1)).sum())
                embedding = heads.code_embeddings[torch.arange(4), tokens[step]].sum(0)
                hidden = quantized.step(embedding[None], [cache], [length])[0]
                length += 1
        agreements.append(agree / (4 * tokens.shape[0]))
        wave_fp32 = engine.decode(hiddens, "fp32")
        wave_int8 = engine.decode(forced, "fp32")
        wave_bf16_decoder = engine.decode(hiddens, "bf16")
        scale = max(np.linalg.norm(wave_fp32), 1e-12)
        error = np.linalg.norm(wave_int8 - wave_fp32) / scale
        distances.append(float(error))
        snrs.append(float(-20 * np.log10(max(error, 1e-12))))
        decoder_errors.append(float(np.linalg.norm(wave_bf16_decoder - wave_fp32) / scale))
        kept_hiddens.append(hiddens)
        fp32_waves.append(wave_fp32)
        bf16_waves.append(wave_bf16_decoder)
    # the int8 decoder (CHATTTS_DECODER_DTYPE=int8) on the same hidden states, on the
    # quantized transformer's kernels (tuned as the service tunes them)
    int8_decoder_errors = []
    if quantized.kernels is not None:
        import copy

        from chattts_service.inference.decoding import AudioDecoder
        from chattts_service.kernels import tuning

        tuning.choose(quantized.kernels, quantized.kernel_packings(), "measure", None)
        fp32_decoder = engine.model.decoder
        int8_decoder = AudioDecoder(
            copy.deepcopy(fp32_decoder.decoder), copy.deepcopy(fp32_decoder.vocos), "int8"
        )
        int8_decoder.hold_in_int8(quantized.kernels)
        for hiddens, wave_fp32 in zip(kept_hiddens, fp32_waves, strict=True):
            wave = int8_decoder(hiddens)
            scale = max(np.linalg.norm(wave_fp32), 1e-12)
            int8_decoder_errors.append(float(np.linalg.norm(wave - wave_fp32) / scale))
        del int8_decoder
    # the seeds' audio decoded as one batch (as the service decodes what several requests ask
    # for between two steps): in bf16 against each decoded alone, and against fp32
    decoder, kept_dtype = engine.model.decoder, engine.model.decoder.dtype
    decoder.dtype = "bf16"
    try:
        batched = decoder.spans([(hiddens, 0, None) for hiddens in kept_hiddens])
    finally:
        decoder.dtype = kept_dtype
    batch_vs_alone = [
        float(np.linalg.norm(one - alone) / max(np.linalg.norm(alone), 1e-12))
        for one, alone in zip(batched, bf16_waves, strict=True)
    ]
    batch_vs_fp32 = [
        float(np.linalg.norm(one - reference) / max(np.linalg.norm(reference), 1e-12))
        for one, reference in zip(batched, fp32_waves, strict=True)
    ]
    return {
        **(
            {"int8_decoder_relative_l2": statistics.mean(int8_decoder_errors)}
            if int8_decoder_errors
            else {}
        ),
        "int8_product": quantized.kernels.int8_instructions if quantized.kernels else None,
        "seeds": seeds,
        "quantize": quantize,
        "top1_agreement": statistics.mean(agreements),
        "waveform_relative_l2": statistics.mean(distances),
        "waveform_snr_db": statistics.mean(snrs),
        "bf16_decoder_relative_l2": statistics.mean(decoder_errors),
        "bf16_batched_vs_alone_relative_l2": statistics.mean(batch_vs_alone),
        "bf16_batched_vs_fp32_relative_l2": statistics.mean(batch_vs_fp32),
    }


def voiced_recording(seed: int, seconds: float = 10.0, rate: int = 24_000):
    """A speech-like stand-in recording (a voiced tone with a wavering pitch and noise): what
    the DVAE encodes into a speaker prompt; random weights make any recording as good. The
    tests use it too."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    pitch = 2 * np.pi * (140 + 30 * np.sin(2 * np.pi * 0.7 * t)).cumsum() / rate
    voiced = 0.3 * np.sin(pitch) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
    return (voiced + rng.normal(0, 0.02, len(t))).astype(np.float32)


# -- the parent: run the phases in children and compare ----------------------------------------


def run_phase(
    script: str, phase: str, arguments: list[str], threads: int, service: bool, max_seconds: float
) -> dict:
    """Run ``script --phase phase *arguments`` in a fresh interpreter on ``threads`` torch
    threads (0: all this process may use) and return the JSON its last line prints.
    ``service``: the phase runs this service's engine, so it gets the service's bounds on
    native caches; upstream's code runs as it comes."""
    command = [sys.executable, script, "--phase", phase, *arguments]
    env = dict(os.environ)
    count = str(threads or len(os.sched_getaffinity(0)))
    env.update(OMP_NUM_THREADS=count, MKL_NUM_THREADS=count, CHATTTS_THREADS=count)
    if service:
        heap.bound_native_caches(env)
    steal = StealMeter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=max_seconds)
    if result.returncode != 0:
        raise RuntimeError(f"{phase} failed:\n{result.stderr[-4000:]}")
    data = json.loads(result.stdout.strip().splitlines()[-1])
    data["steal_share"] = steal.share()
    return data


def run_child(phase: str, args: argparse.Namespace, extra: list[str]) -> dict:
    return run_phase(
        __file__,
        phase,
        ["--model-dir", str(args.model_dir), "--steps", str(args.steps), *extra],
        args.threads,
        phase != "baseline",
        args.max_seconds,
    )


# the CPU features the kernels choose by (the int8 product, native bf16)
RELEVANT_CPU_FLAGS = frozenset(
    {
        "avx2",
        "fma",
        "avx512f",
        "avx512bw",
        "avx512_vnni",
        "avx_vnni",
        "avx512_bf16",
        "amx_bf16",
        "amx_int8",
    }
)


def cpu_line(data: dict) -> str:
    """The CPU a benchmark ran on and which of ``RELEVANT_CPU_FLAGS`` it has (``data``'s
    "cpu" and "cpu_flags"), as each benchmark's report begins."""
    return f"cpu {data['cpu']}; flags: {' '.join(data['cpu_flags']) or 'none of interest'}"


def steal_line(baseline: float | None, ours: float | None) -> str:
    """How much CPU time the hypervisor took while each side ran: the "vs baseline" figures
    compare two runs apart in time, so a host that took more from one of them skews them."""
    if baseline is None or ours is None:
        return "steal: not measured (unreadable here, or too short a run)"
    text = (
        f"steal: the hypervisor took {100 * baseline:.1f}% of this machine's CPU time while "
        f"the baseline ran, {100 * ours:.1f}% while ours did"
    )
    if max(baseline, ours) > STEAL_WARNING:
        text += (
            " (figures slowed by it; the ratios to the baseline are skewed where the two differ)"
        )
    return text


def report(data: dict) -> str:
    base, ours, fidelity = data["baseline"], data["ours"], data.get("fidelity")
    lines = [
        cpu_line(data),
        f"model {data['model_dir']}   {data['steps']} GPT steps per request "
        f"({audio_seconds(data['steps']):.2f} s of audio)   {data['threads']} threads",
        "",
        f"{'':<22}{'ms/step':>9}{'RTF':>8}{'audio s/s':>11}{'vs baseline':>13}{'decode share':>14}",
        f"{'baseline (upstream)':<22}{base['ms_per_step']:>9.1f}{base['real_time_factor']:>8.2f}"
        f"{base['audio_per_wall_second']:>11.2f}{'1.0x':>13}",
    ]
    for concurrency, row in ours["concurrency"].items():
        step = f"{row['ms_per_step']:.1f}" if row["ms_per_step"] else "-"
        ratio = row["audio_per_wall_second"] / base["audio_per_wall_second"]
        lines.append(
            f"{'ours, concurrency ' + concurrency:<22}{step:>9}"
            f"{row['real_time_factor']:>8.2f}{row['audio_per_wall_second']:>11.2f}"
            f"{ratio:>12.1f}x{100 * row.get('decode_share', float('nan')):>13.0f}%"
        )
    one = ours["concurrency"]["1"]
    eight = ours["concurrency"]["8"]
    floor = ours["floor_ms"]
    speedup = base["real_time_factor"] / one["real_time_factor"]
    throughput = eight["audio_per_wall_second"] / base["audio_per_wall_second"]
    floor_ratio = one["ms_per_step"] / floor if one["ms_per_step"] else float("nan")
    eight_ratio = eight["ms_per_step"] / floor if eight["ms_per_step"] else float("nan")
    bounds = arithmetic_bounds(ours, data["steps"]) or {}
    share_bound = bounds.get("decode_share_8")
    eight_bound = bounds["products_8_ms"] / floor if "products_8_ms" in bounds else None
    reads = ours.get("weights_read_ms")
    read_text = (
        f"; a loop only reading them took {' and '.join(f'{ms:.2f}' for ms in reads)} ms "
        f"({ours['gpt_linear_mb'] / min(reads):.1f} GB/s)"
        if reads
        else ""
    )
    lines += [
        "",
        f"ours: {ours['quantize']} GPT on {ours['linear_kernel']}, C++ kernels {ours['kernels']}, "
        f"{ours['kv_cache_dtype']} KV cache, "
        f"{ours['decoder_dtype']} decoder; kernel tuning: {ours.get('kernel_tuning') or '-'}",
        f"GPT linears {ours['gpt_linear_mb']:.0f} MB ({ours['quantize']}): a torch sum reads "
        f"{ours['bandwidth_gb_per_s']:.1f} GB/s (the higher of "
        f"{' and '.join(f'{v:.1f}' for v in ours.get('bandwidth_readings_gb_per_s', []))}, "
        f"before and after the runs){read_text} -> floor {floor:.2f} ms/step (the lower); "
        f"batch-1 step is {floor_ratio:.2f}x the floor, 8-row step {eight_ratio:.2f}x",
        *products_lines(ours.get("products_ms"), floor),
        *arithmetic_lines(ours, bounds, data["steps"], floor),
        f"peak RSS: baseline {base['peak_rss_mb']:.0f} MB, ours {ours['peak_rss_mb']:.0f} MB "
        f"(after ready {ours['rss_after_ready_mb']:.0f} MB); ours ready in "
        f"{ours['ready_seconds']:.1f} s (load {ours['load_seconds']:.1f} s)",
        steal_line(base.get("steal_share"), ours.get("steal_share")),
        "",
        "targets:",
        f"  one request alone >= 3.5x faster than baseline : {speedup:.1f}x  "
        f"{'ok' if speedup >= 3.5 else 'MISSED'}",
        f"  one request real-time factor <= 1.0            : {one['real_time_factor']:.2f}  "
        f"{'ok' if one['real_time_factor'] <= 1.0 else 'MISSED'}",
        f"  8 concurrent aggregate >= 30x baseline         : {throughput:.1f}x  "
        f"{'ok' if throughput >= 30 else 'MISSED'}",
        f"  decode share at 8 concurrent < 20%             : "
        f"{100 * eight.get('decode_share', float('nan')):.0f}%  "
        f"{'ok' if eight.get('decode_share', 1.0) < 0.2 else 'MISSED'}"
        + beyond(
            share_bound,
            0.2,
            f"at least {100 * (share_bound or 0):.0f}% at the peak"
            + (
                f"; an int8 decoder's bound is {100 * bounds['decode_share_8_int8']:.0f}%"
                if ours["decoder_dtype"] != "int8" and "decode_share_8_int8" in bounds
                else ""
            ),
        ),
        f"  batch-1 step within 1.3x of bandwidth floor    : {floor_ratio:.2f}x  "
        f"{'ok' if floor_ratio <= 1.3 else 'MISSED'}",
        f"  8-row step within 2.5x of bandwidth floor      : {eight_ratio:.2f}x  "
        f"{'ok' if eight_ratio <= 2.5 else 'MISSED'}"
        + beyond(eight_bound, 2.5, f"the products alone {eight_bound or 0:.2f}x at the peak"),
        f"  peak RSS under 2.5 GB                          : {ours['peak_rss_mb']:.0f} MB  "
        f"{'ok' if ours['peak_rss_mb'] < 2560 else 'MISSED'}",
    ]
    if fidelity:
        lines += [
            "",
            f"fidelity fp32 vs {fidelity.get('quantize', 'int8')} (teacher forcing, "
            f"{fidelity['seeds']} seeds): top-1 "
            f"agreement {fidelity['top1_agreement'] * 100:.1f}%, waveform relative L2 "
            f"{fidelity['waveform_relative_l2']:.3f} (SNR {fidelity['waveform_snr_db']:.1f} dB)",
            f"fidelity fp32 vs bf16 decoder (same hidden states): waveform relative L2 "
            f"{fidelity['bf16_decoder_relative_l2']:.4f}; bf16 decoded as one batch: "
            f"{fidelity['bf16_batched_vs_fp32_relative_l2']:.4f} from fp32, "
            f"{fidelity['bf16_batched_vs_alone_relative_l2']:.4f} from each decoded alone",
        ]
        if "int8_decoder_relative_l2" in fidelity:
            error = fidelity["int8_decoder_relative_l2"]
            lines.append(
                f"fidelity fp32 vs int8 decoder ({fidelity['int8_product']} product, same hidden "
                f"states): waveform relative L2 {error:.4f} (SNR "
                f"{-20 * math.log10(max(error, 1e-12)):.1f} dB)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="model to measure (default: build/reuse a full random-weight model)",
    )
    parser.add_argument("--steps", type=int, default=150, help="GPT steps per request")
    parser.add_argument("--requests", type=int, default=3, help="baseline requests (median)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per concurrency level")
    parser.add_argument("--seeds", type=int, default=3, help="fidelity: sequences compared")
    parser.add_argument("--quantize", default="int8", choices=("int8", "int4", "none"))
    parser.add_argument(
        "--int8-product",
        default="auto",
        choices=INT8_PRODUCTS,
        help="the C++ kernels' int8 product (CHATTTS_INT8_PRODUCT)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="bf16",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's type with the kernels (CHATTTS_KV_CACHE_DTYPE)",
    )
    parser.add_argument(
        "--decoder-dtype",
        default="auto",
        choices=DECODER_DTYPES,
        help="the audio decoder's precision in the timed runs (CHATTTS_DECODER_DTYPE)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = all allowed)")
    parser.add_argument("--no-fidelity", action="store_true")
    parser.add_argument("--max-seconds", type=float, default=900, help="limit per phase")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--phase", choices=("baseline", "ours", "fidelity"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.phase:
        if args.phase == "baseline":
            result = phase_baseline(args.model_dir, args.steps, args.requests)
        elif args.phase == "ours":
            result = phase_ours(
                args.model_dir,
                args.steps,
                args.quantize,
                args.rounds,
                args.int8_product,
                args.kv_cache_dtype,
                args.decoder_dtype,
            )
        else:
            result = phase_fidelity(
                args.model_dir,
                args.steps,
                args.seeds,
                args.int8_product,
                args.kv_cache_dtype,
                "int8" if args.quantize == "none" else args.quantize,
            )
        print(json.dumps(result))
        return 0

    if args.model_dir is None:
        args.model_dir = default_model()
    data = {
        "cpu": cpu_model(),
        "cpu_flags": sorted(RELEVANT_CPU_FLAGS & cpu_flags()),
        "model_dir": str(args.model_dir),
        "steps": args.steps,
        "threads": args.threads or len(os.sched_getaffinity(0)),
    }
    data["baseline"] = run_child("baseline", args, ["--requests", str(args.requests)])
    product = ["--int8-product", args.int8_product, "--kv-cache-dtype", args.kv_cache_dtype]
    data["ours"] = run_child(
        "ours",
        args,
        [
            "--quantize",
            args.quantize,
            "--rounds",
            str(args.rounds),
            "--decoder-dtype",
            args.decoder_dtype,
            *product,
        ],
    )
    if not args.no_fidelity:
        data["fidelity"] = run_child(
            "fidelity",
            args,
            ["--seeds", str(args.seeds), "--quantize", args.quantize, *product],
        )
    print(json.dumps(data, indent=1) if args.json else report(data))
    return 0


if __name__ == "__main__":
    gc.collect()
    sys.exit(main())
