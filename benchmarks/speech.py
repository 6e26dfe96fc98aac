"""Speech benchmark: time to first audio (streamed, ours vs upstream's stream mode, and over
HTTP), a request's fixed costs, and long text.

    python benchmarks/speech.py [--model-dir DIR] [--steps N] [--requests N] [--json]

Each side runs in its own child process, one after the other so they never share the CPUs:

* upstream: ``Chat.infer(stream=True)`` the way a plain server streams it (fp32, one request at
  a time, fresh parameters per call, ``skip_refine_text=True``); time to the first chunk that
  holds audio, and to the end;
* ours: the engine's stream (``Engine.start(stream=True)``) alone, the same text, voice and
  number of steps; time to the first chunk and to the end;
* fixed costs: the stages of the three-sentence request one by one, as the engine runs them
  (normalisation and splitting, prompt, prefill with the first token, one GPT step, decoding
  the first chunk, encoding it), and a request of 2 steps end to end through the scheduler:
  what a request costs besides its GPT steps and decoding; the prefill both for a voice's
  first request and for its next ones (the prompt's first positions kept);
* http: ``python server.py`` on a loopback port, ``POST /v1/audio/speech`` streamed (``pcm``,
  whose first byte is audio) with the three-sentence text at its natural length: time to the
  first audio byte, as ``curl -w '%{time_starttransfer}'`` reports it; then the same from a
  server with ``--stream-lookahead`` (CHATTTS_STREAM_LOOKAHEAD; 0 skips it), whose streams
  start with chunks decoded that many steps ahead of generation (close to the whole answer,
  not it);
* long text: a ~2,000-character mixed Chinese/English text with numbers through the engine
  (segmented, normalised, batched), natural lengths: wall time, audio seconds, segments,
  segments stopped by the step cap.

Every streamed request generates exactly ``--steps`` GPT steps on both sides (end of speech is
suppressed until then), so the work is identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import (  # noqa: E402
    RELEVANT_CPU_FLAGS,
    TEXT,
    audio_seconds,
    default_model,
    load_upstream,
    run_phase,
    upstream_params,
)
from chattts_service.config import DECODER_DTYPES, INT8_PRODUCTS  # noqa: E402  (no torch)

THREE_SENTENCES = "今天天气很好。我们一起去公园散步吧！The park opens at nine."
FIRST_AUDIO_TARGET = 0.5  # seconds, streamed over HTTP
FIXED_COST_TARGET = 0.05  # seconds a request costs besides its GPT steps and decoding

LONG_SENTENCES = (
    "第{n}段：今天是2024年3月{day}日，气温{deg}摄氏度，我们在公园里走了{km}公里。",
    "The meeting on March {day} starts at {hour}:30 pm, and tickets cost ${price}.",
    "会议室的电话是010-{phone}，请大家提前十分钟到达。",
)


def long_text(chars: int = 2000) -> str:
    text, n = "", 1
    while len(text) < chars:
        sentence = LONG_SENTENCES[n % len(LONG_SENTENCES)]
        text += (
            sentence.format(
                n=n,
                day=n % 28 + 1,
                deg=n % 30,
                km=n % 9 + 1,
                hour=n % 12 + 1,
                price=10 + n,
                phone=62750000 + n,
            )
            + " "
        )
        n += 1
    return text[:chars]


def phase_upstream(model_dir: Path, steps: int, requests: int) -> dict:
    import numpy as np

    chat = load_upstream(model_dir)

    def one(seed: int) -> tuple[float, float]:
        params = upstream_params(chat, seed, steps)
        began, first = time.perf_counter(), None
        for chunk in chat.infer(TEXT, stream=True, skip_refine_text=True, params_infer_code=params):
            if first is None and chunk is not None and np.asarray(chunk).size:
                first = time.perf_counter() - began
        return first, time.perf_counter() - began

    one(0)  # warm-up
    runs = [one(seed) for seed in range(1, requests + 1)]
    return {"first_audio_seconds": [r[0] for r in runs], "total_seconds": [r[1] for r in runs]}


def phase_ours(
    model_dir: Path, steps: int, requests: int, long_chars: int, quantize: str = "int8", **settings
) -> dict:
    """``settings``: the engine's other settings (the int8 product, the decoder's type)."""
    from chattts_service.config import Settings
    from chattts_service.domain.speech import Overloaded, SynthesisRequest
    from chattts_service.inference.engine import Engine

    engine = Engine(
        Settings.from_env(
            {}, model_dir=model_dir, verify_model=False, quantize=quantize, **settings
        )
    )
    engine.load()
    engine.warm_up()

    def one(seed: int) -> tuple[float, float, int]:
        began, first, chunks = time.perf_counter(), None, 0
        run = engine.start(SynthesisRequest(TEXT, seed), fixed_steps=steps, stream=True)
        for _ in run.chunks(timeout=600):
            chunks += 1
            if first is None:
                first = time.perf_counter() - began
        return first, time.perf_counter() - began, chunks

    one(0)
    runs = [one(seed) for seed in range(1, requests + 1)]
    result = {
        "first_audio_seconds": [r[0] for r in runs],
        "total_seconds": [r[1] for r in runs],
        "chunks": runs[0][2],
        "context_steps": engine.context_steps,
        "linear_kernel": engine.gpt_linear_kernel,
        "decoder_dtype": engine.model.decoder.dtype,
        "kernel_tuning": engine.kernel_tuning,
    }

    result["fixed_costs"] = fixed_costs(engine, requests)

    if long_chars:
        text = long_text(long_chars)
        request = SynthesisRequest(text, seed=7)
        began = time.perf_counter()
        segments = engine.segments(request)
        normalise_seconds = time.perf_counter() - began
        began = time.perf_counter()
        synthesis = engine.synthesize(request, timeout=3600)
        wall = time.perf_counter() - began
        began = time.perf_counter()
        first, refused = None, None
        try:
            for _ in engine.start(request, stream=True).chunks(timeout=3600):
                if first is None:
                    first = time.perf_counter() - began
        # a model whose speech never ends runs every segment to its cap: longer than
        # admission lets one request wait
        except Overloaded as error:
            refused = str(error)
        stream_wall = time.perf_counter() - began
        result["long_text"] = {
            "characters": len(text),
            "segments": len(segments),
            "longest_segment": max(len(s) for s in segments),
            "normalise_seconds": normalise_seconds,
            "wall_seconds": wall,
            "audio_seconds": synthesis.seconds,
            "real_time_factor": wall / synthesis.seconds,
            "steps": synthesis.steps,
            "truncated_segments": synthesis.truncated,
            "stream_first_audio_seconds": first,
            "stream_wall_seconds": stream_wall,
            "stream_refused": refused,
            "sample": segments[0][:80],
        }
    engine.close()
    return result


def _median_seconds(function, repeats: int) -> tuple[float, object]:
    times, value = [], None
    for _ in range(repeats):
        began = time.perf_counter()
        value = function()
        times.append(time.perf_counter() - began)
    return statistics.median(times), value


def fixed_costs(engine, requests: int) -> dict:
    """The three-sentence request's stages one by one, on the scheduler's thread (where the
    engine runs them: torch's thread pool belongs to it) while it is idle; and a request of 2
    GPT steps end to end."""
    import torch

    from chattts_service.domain.speech import SynthesisRequest

    repeats = max(5, requests)
    stages = engine.scheduler.call(lambda: _stages(engine, repeats)).result(timeout=600)

    def two_steps():
        return engine.synthesize(SynthesisRequest("你好。", seed=9), fixed_steps=2)

    two_steps()
    two_step_wall, _ = _median_seconds(two_steps, repeats)
    two_hiddens = torch.randn(2, engine.model.heads.hidden_size)
    short_decode = engine.scheduler.call(
        lambda: _median_seconds(lambda: engine.decode(two_hiddens), repeats)[0]
    ).result(timeout=600)
    step = stages.pop("step")
    first_chunk, decode_first_chunk = stages.pop("first_chunk_steps"), stages.pop("decode")
    return {
        "stages_seconds": stages,
        "fixed_seconds": stages["normalise"]
        + stages["prompt"]
        + stages["prefill"]
        + stages["encode_mp3"],
        "fixed_new_voice_seconds": stages["normalise"]
        + stages["prompt"]
        + stages["prefill_new_voice"]
        + stages["encode_mp3"],
        "step_seconds": step,
        "first_chunk_steps": first_chunk,
        "decode_first_chunk_seconds": decode_first_chunk,
        "two_step_request_seconds": two_step_wall,
        "two_step_decode_seconds": short_decode,
        "two_step_fixed_seconds": two_step_wall - 2 * step - short_decode,
        "projected_first_audio_seconds": stages["normalise"]
        + stages["prompt"]
        + stages["prefill"]
        + first_chunk * step
        + decode_first_chunk
        + stages["encode_pcm"],
    }


def _stages(engine, repeats: int) -> dict:
    """Medians of each stage of the three-sentence request's first segment, generating the
    steps of its first streamed chunk (``FIRST_CHUNK_STEPS`` + the decoder's context)."""
    from chattts_service.domain.speech import SAMPLE_RATE, SynthesisRequest
    from chattts_service.inference.generation import Batch
    from chattts_service.inference.job import FIRST_CHUNK_STEPS
    from chattts_service.services.audio import encode

    request = SynthesisRequest(THREE_SENTENCES, seed=5)
    model, prompts = engine.model, engine.prompts
    voice = engine.voices.from_seed(request.seed).embedding
    first_chunk = FIRST_CHUNK_STEPS + engine.context_steps
    stages = {"first_chunk_steps": first_chunk}
    stages["normalise"], (segments, _) = _median_seconds(lambda: prompts.split(request), repeats)
    text = segments[0]
    stages["prompt"], _ = _median_seconds(
        lambda: prompts.code_sequence(text, request, voice, first_chunk), repeats
    )
    batch = Batch(model.transformer, model.heads, 1)
    names = ("prefill_new_voice", "prefill", "step", "decode", "encode_mp3", "encode_pcm")
    timings = {name: [] for name in names}
    for _ in range(repeats):
        # a voice's first request: every position of the prompt through every layer, and the
        # first token drawn
        model.transformer.prefixes.clear()
        sequence = prompts.code_sequence(text, request, voice, first_chunk)
        began = time.perf_counter()
        Batch(model.transformer, model.heads, 1).add(sequence)
        timings["prefill_new_voice"].append(time.perf_counter() - began)
        # the voice's next requests: the prompt's first positions kept from the one before
        sequence = prompts.code_sequence(text, request, voice, first_chunk)
        began = time.perf_counter()
        batch.add(sequence)
        timings["prefill"].append(time.perf_counter() - began)
        while batch.active:
            began = time.perf_counter()
            batch.step()
            timings["step"].append(time.perf_counter() - began)
        began = time.perf_counter()  # as the stream decodes it: the chunk's frames only
        chunk = model.decoder.span(sequence.hiddens[: sequence.steps], 0, FIRST_CHUNK_STEPS)
        timings["decode"].append(time.perf_counter() - began)
        for audio_format in ("mp3", "pcm"):
            began = time.perf_counter()
            encode(chunk, SAMPLE_RATE, audio_format)
            timings[f"encode_{audio_format}"].append(time.perf_counter() - began)
    stages.update({name: statistics.median(values) for name, values in timings.items()})
    return stages


def phase_http(
    model_dir: Path, requests: int, quantize: str = "int8", lookahead: int = 0, **settings
) -> dict:
    """First audio byte of a streamed request over HTTP from a real server on loopback;
    ``settings``: its other settings (the int8 product, the decoder's type)."""
    import tempfile

    import requests as http

    from benchmarks.serverproc import Server

    with tempfile.TemporaryDirectory() as scratch:
        server = Server(
            model_dir,
            Path(scratch) / "server.log",
            CHATTTS_CACHE_SIZE="0",
            CHATTTS_QUANTIZE=quantize,
            CHATTTS_STREAM_LOOKAHEAD=str(lookahead),
            **{f"CHATTTS_{name.upper()}": value for name, value in settings.items()},
        )
        try:
            server.wait_ready(timeout=600)
            firsts, totals, seconds_of_audio = [], [], []
            for index in range(requests + 1):  # the first one is not counted
                body = {
                    "model": "chattts",
                    "input": THREE_SENTENCES,
                    "voice": f"seed:{100 + index}",
                    "response_format": "pcm",
                    "stream": True,
                    "seed": 100 + index,
                }
                began, first, size = time.perf_counter(), None, 0
                with http.post(
                    server.url + "/v1/audio/speech", json=body, stream=True, timeout=600
                ) as response:
                    response.raise_for_status()
                    for piece in response.iter_content(chunk_size=None):
                        if piece and first is None:
                            first = time.perf_counter() - began
                        size += len(piece)
                if index:
                    firsts.append(first)
                    totals.append(time.perf_counter() - began)
                    seconds_of_audio.append(size / 2 / 24_000)
        finally:
            server.stop()
    return {
        "lookahead": lookahead,
        "first_audio_seconds": firsts,
        "total_seconds": totals,
        "audio_seconds": seconds_of_audio,
    }


def run_child(phase: str, args, extra: list[str]) -> dict:
    return run_phase(
        __file__,
        phase,
        [
            "--model-dir",
            str(args.model_dir),
            "--steps",
            str(args.steps),
            "--requests",
            str(args.requests),
            *extra,
        ],
        0,
        phase != "upstream",
        args.max_seconds,
    )


def first_audio_reason(costs: dict | None) -> str:
    """Why exact first audio cannot meet its target here, where the steps alone say so: its
    first chunk waits for FIRST_CHUNK_STEPS and the decoder's context to be generated."""
    if not costs:
        return ""
    least = costs["first_chunk_steps"] * costs["step_seconds"]
    if least <= FIRST_AUDIO_TARGET:
        return ""
    return (
        f" (out of reach here: its first chunk's {costs['first_chunk_steps']} steps alone take "
        f"{least:.3f} s)"
    )


def look_ahead_reason(costs: dict | None, context_steps: int, lookahead: int) -> str:
    """Where a stream's steps are too slow for it to turn exact in time, the server starts it
    exact (``job.look_ahead_step_limit``): the look-ahead then changes nothing."""
    from chattts_service.inference.job import look_ahead_step_limit

    if not costs:
        return ""
    limit = look_ahead_step_limit(context_steps, lookahead)
    if costs["step_seconds"] <= limit:
        return ""
    return (
        f" (not taken here: a step of {costs['step_seconds'] * 1000:.1f} ms is slower than the "
        f"{limit * 1000:.1f} ms at which a stream could turn exact in time, so streams start "
        "exact)"
    )


def report(data: dict) -> str:
    up, ours = data["upstream"], data["ours"]
    up_first = statistics.median(up["first_audio_seconds"])
    our_first = statistics.median(ours["first_audio_seconds"])
    lines = [
        f"cpu {data.get('cpu', 'unknown')}; flags: {' '.join(data.get('cpu_flags', [])) or '-'}",
        f"ours: {data['quantize']} GPT on {ours.get('linear_kernel', '-')}, "
        f"{ours.get('decoder_dtype', '-')} decoder, kernel tuning: "
        f"{ours.get('kernel_tuning') or '-'}",
        f"streamed, {data['steps']} steps ({audio_seconds(data['steps']):.2f} s of audio), "
        f"median of {data['requests']}:",
        "                      first audio    whole",
        f"upstream stream       {up_first:8.2f} s {statistics.median(up['total_seconds']):8.2f} s",
        f"ours, stream          {our_first:8.2f} s "
        f"{statistics.median(ours['total_seconds']):8.2f} s"
        f"   ({ours['chunks']} chunks, {ours['context_steps']} steps of decoder context)",
        f"first audio {up_first / our_first:.1f}x sooner than upstream",
    ]
    costs = ours.get("fixed_costs")
    if costs:
        stages = costs["stages_seconds"]
        lines += [
            "",
            f"fixed costs of the three-sentence request (medians; one GPT step "
            f"{costs['step_seconds'] * 1000:.1f} ms):",
            *(f"  {name:<14}{seconds * 1000:8.1f} ms" for name, seconds in stages.items()),
            f"  first chunk: {costs['first_chunk_steps']} steps, decoded in "
            f"{costs['decode_first_chunk_seconds'] * 1000:.1f} ms",
            f"  a 2-step request end to end: {costs['two_step_request_seconds'] * 1000:.1f} ms, "
            f"of which {costs['two_step_fixed_seconds'] * 1000:.1f} ms besides its steps and "
            f"decoding",
            f"  projected first audio in the engine: "
            f"{costs['projected_first_audio_seconds']:.3f} s",
        ]
    http_run = data.get("http")
    if http_run:
        first = statistics.median(http_run["first_audio_seconds"])
        lines += [
            "",
            f"over HTTP (server.py on loopback, streamed pcm, the three-sentence text at its "
            f"natural length, median of {len(http_run['first_audio_seconds'])}): first audio "
            f"{first:.3f} s, whole {statistics.median(http_run['total_seconds']):.2f} s for "
            f"{statistics.median(http_run['audio_seconds']):.2f} s of audio",
        ]
    ahead_run = data.get("http_lookahead")
    if ahead_run:
        ahead_first = statistics.median(ahead_run["first_audio_seconds"])
        lines.append(
            f"the same with CHATTTS_STREAM_LOOKAHEAD={ahead_run['lookahead']} (a start close to "
            f"the whole answer, not it): first audio {ahead_first:.3f} s, whole "
            f"{statistics.median(ahead_run['total_seconds']):.2f} s"
        )
    if costs or http_run:
        lines.append("targets:")
    if http_run:
        lines.append(
            f"  first audio over HTTP <= {FIRST_AUDIO_TARGET} s        : {first:.3f} s  "
            f"{'ok' if first <= FIRST_AUDIO_TARGET else 'MISSED'}"
            + (first_audio_reason(costs) if first > FIRST_AUDIO_TARGET else "")
        )
    if ahead_run:
        lines.append(
            f"  the same, look-ahead {ahead_run['lookahead']:<2} steps      : {ahead_first:.3f} s  "
            f"{'ok' if ahead_first <= FIRST_AUDIO_TARGET else 'MISSED'}"
            + look_ahead_reason(costs, ours["context_steps"], ahead_run["lookahead"])
        )
    if costs:
        for label, seconds in (
            ("stages besides steps and decoding", costs["fixed_seconds"]),
            ("  the same, a voice's first request", costs.get("fixed_new_voice_seconds")),
            ("2-step request besides steps/decode", costs["two_step_fixed_seconds"]),
        ):
            if seconds is None:
                continue
            lines.append(
                f"  {label:<35} <= {FIXED_COST_TARGET * 1000:.0f} ms: {seconds * 1000:.1f} ms  "
                f"{'ok' if seconds <= FIXED_COST_TARGET else 'MISSED'}"
            )
    long = ours.get("long_text")
    if long:
        lines += [
            f"long text: {long['characters']} characters -> {long['segments']} segments "
            f"(longest {long['longest_segment']}), normalised in {long['normalise_seconds']:.2f} s",
            f"  whole: {long['wall_seconds']:.1f} s for {long['audio_seconds']:.1f} s of audio "
            f"(RTF {long['real_time_factor']:.2f}), {long['truncated_segments']} segments cut "
            f"by the step cap",
            f"  streamed: refused ({long['stream_refused']})"
            if long.get("stream_refused")
            else f"  streamed: first audio after {long['stream_first_audio_seconds']:.2f} s, "
            f"done in {long['stream_wall_seconds']:.1f} s",
            f"  first segment as read: {long['sample']}",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--long-chars", type=int, default=2000, help="0 skips the long text")
    parser.add_argument("--max-seconds", type=int, default=1800)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-http", action="store_true", help="skip the HTTP first-audio run")
    parser.add_argument(
        "--quantize", default="int8", choices=("int8", "int4"), help="our GPT's quantization"
    )
    parser.add_argument("--int8-product", default="auto", choices=INT8_PRODUCTS)
    parser.add_argument("--decoder-dtype", default="auto", choices=DECODER_DTYPES)
    parser.add_argument(
        "--stream-lookahead",
        type=int,
        default=16,
        help="also time first audio over HTTP with this CHATTTS_STREAM_LOOKAHEAD (0: skip)",
    )
    parser.add_argument("--phase", choices=["upstream", "ours", "http"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    settings = {"int8_product": args.int8_product, "decoder_dtype": args.decoder_dtype}

    if args.phase == "upstream":
        print(json.dumps(phase_upstream(args.model_dir, args.steps, args.requests)))
        return 0
    if args.phase == "ours":
        print(
            json.dumps(
                phase_ours(
                    args.model_dir,
                    args.steps,
                    args.requests,
                    args.long_chars,
                    args.quantize,
                    **settings,
                )
            )
        )
        return 0
    if args.phase == "http":
        print(
            json.dumps(
                phase_http(
                    args.model_dir,
                    args.requests,
                    args.quantize,
                    args.stream_lookahead,
                    **settings,
                )
            )
        )
        return 0

    if args.model_dir is None:
        args.model_dir = default_model()
    ours = ["--quantize", args.quantize, "--int8-product", args.int8_product]
    ours += ["--decoder-dtype", args.decoder_dtype]
    data = {
        "steps": args.steps,
        "requests": args.requests,
        "upstream": run_child("upstream", args, []),
        "ours": run_child("ours", args, [*ours, "--long-chars", str(args.long_chars)]),
    }
    if not args.no_http:
        http = [*ours, "--stream-lookahead"]
        data["http"] = run_child("http", args, [*http, "0"])
        if args.stream_lookahead:
            data["http_lookahead"] = run_child("http", args, [*http, str(args.stream_lookahead)])
    from chattts_service.runtime.cpu import cpu_flags, cpu_model

    data["cpu"] = cpu_model()
    data["cpu_flags"] = sorted(RELEVANT_CPU_FLAGS & cpu_flags())
    data["quantize"] = args.quantize
    data["settings"] = settings
    print(json.dumps(data, indent=1) if args.json else report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
