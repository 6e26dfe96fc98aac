"""What a voice made from a recording costs, and what the long-text setting costs.

    python benchmarks/voices.py [--model-dir DIR] [--steps 150] [--rounds 3] [--no-fidelity]
                                [--json]

In one process, on the full-size random-weight model with the service's default settings:

* encoding a 10 s sample (a recording this engine made) into ChatTTS's speaker prompt: the
  first time (which builds the DVAE's encoder) and after (median);
* what an encoding does to generation running beside it: the decode steps of 8 requests while
  samples are encoded on another thread, against the steps without (median, and the longest);
* a request in that voice against one in a plain voice: the first step (prefill, one step and
  its decode: the prompt carries the sample's ~470 codes), the time a step adds, alone and
  with 8 requests in one batch;
* the int8 GPT's drift from fp32 for a sampled voice's prompt, as ``benchmarks/engine.py``
  measures it for plain voices (teacher-forced top-1 agreement and waveform SNR);
* a six-segment text with ``CHATTTS_LONG_TEXT_VOICE=embedding`` and ``first_segment``: whole,
  and the first streamed audio.

Quiet machine, please: every figure is a wall-clock time. The CPU model is printed with them.
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

from benchmarks.engine import default_model, phase_fidelity  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402

SAMPLE_SECONDS = 10
SAMPLE_TEXT = "今天天气很好，我们一起去公园散步吧。The train leaves at nine."
TEXT = "请在下午三点之前把报告发给我，谢谢。"
LONG_TEXT = (
    "第一段讲的是早上的事情，大家都起得很早。The second part is about the afternoon meeting. "
    "第三段说的是晚饭吃了什么，味道很好。The fourth one describes the walk home at night. "
    "第五段是第二天的计划，要去图书馆。And the last part says goodbye to everyone here."
)


def _engine(model: Path, **settings):
    from chattts_service.config import Settings
    from chattts_service.inference.engine import Engine

    steps: list[tuple[float, int, float]] = []  # (when it ended, rows, seconds)

    def observe(rows: int, seconds: float) -> None:
        steps.append((time.perf_counter(), rows, seconds))

    engine = Engine(
        Settings.from_env({}, model_dir=model, verify_model=False, **settings),
        step_observer=observe,
    )
    engine.load()
    engine.steps = steps
    return engine


def _median_time(function, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _batch_wall(engine, requests, steps: int) -> float:
    started = time.perf_counter()
    runs = [engine.start(request, fixed_steps=steps) for request in requests]
    for run in runs:
        run.result(600)
    return time.perf_counter() - started


def measure_sample(engine, args) -> dict:
    from chattts_service.domain.speech import SynthesisRequest
    from chattts_service.domain.voices import SpeakerSample, Voice

    steps_for_sample = round(SAMPLE_SECONDS * 24_000 / 512)
    recording = engine.synthesize(
        SynthesisRequest(SAMPLE_TEXT, 3), fixed_steps=steps_for_sample
    ).audio
    started = time.perf_counter()
    codes = engine.encode_sample(recording)
    first = time.perf_counter() - started
    warm = _median_time(lambda: engine.encode_sample(recording), max(3, args.rounds))
    sample = SpeakerSample(codes, SAMPLE_TEXT)
    sampled = Voice("sampled", None, "bench", sample=sample, id="voice_bench")

    # encodings beside generation: 8 requests, and samples encoded on this thread meanwhile
    engine.steps.clear()
    windows = []
    runs = [
        engine.start(SynthesisRequest(TEXT, 100 + index), fixed_steps=2 * args.steps)
        for index in range(8)
    ]
    time.sleep(1.0)
    for _ in range(3):
        began = time.perf_counter()
        engine.encode_sample(recording)
        windows.append((began, time.perf_counter()))
        time.sleep(0.3)
    for run in runs:
        run.result(600)

    def during(end: float, seconds: float) -> bool:
        return any(lo < end and end - seconds < hi for lo, hi in windows)

    eight = [(end, seconds) for end, rows, seconds in engine.steps if rows == 8]
    beside = [seconds for end, seconds in eight if during(end, seconds)]
    apart = [seconds for end, seconds in eight if not during(end, seconds)]

    def requests(voice, count):
        return [SynthesisRequest(TEXT, 200 + index, voice=voice) for index in range(count)]

    result = {
        "sample_seconds": len(recording) / 24_000,
        "sample_codes": int(codes.shape[1]),
        "encode_first_s": first,
        "encode_s": warm,
        "step_8_rows_ms": 1000 * statistics.median(apart),
        "step_8_rows_beside_encoding_ms": 1000 * statistics.median(beside) if beside else None,
        "longest_step_beside_encoding_ms": 1000 * max(beside) if beside else None,
        "encoding_windows_s": [hi - lo for lo, hi in windows],
    }
    for label, voice in (("plain", None), ("sampled", sampled)):
        one = requests(voice, 1)[0]
        first_step = _median_time(
            lambda one=one: engine.synthesize(one, fixed_steps=1), args.rounds
        )
        whole = _median_time(
            lambda one=one: engine.synthesize(one, fixed_steps=args.steps), args.rounds
        )
        batch = statistics.median(
            _batch_wall(engine, requests(voice, 8), args.steps) for _ in range(args.rounds)
        )
        result[label] = {
            "first_step_s": first_step,
            "step_ms": 1000 * (whole - first_step) / (args.steps - 1),
            "alone_s": whole,
            "batch_of_8_s": batch,
        }
    return result


def measure_long_text(model: Path, args) -> dict:
    from chattts_service.domain.speech import SynthesisRequest

    results = {}
    for mode in ("embedding", "first_segment"):
        engine = _engine(model, long_text_voice=mode, max_segment_chars=40)
        try:
            request = SynthesisRequest(LONG_TEXT, 7)
            segments = len(engine.segments(request))
            whole = _median_time(
                lambda r=request, e=engine: e.synthesize(r, fixed_steps=args.steps), args.rounds
            )

            def first_audio(r=request, e=engine) -> float:
                started = time.perf_counter()
                run = e.start(r, fixed_steps=args.steps, stream=True)
                chunks = run.chunks(600)
                next(chunks)
                elapsed = time.perf_counter() - started
                for _ in chunks:
                    pass
                return elapsed

            first = statistics.median(first_audio() for _ in range(args.rounds))
            results[mode] = {"segments": segments, "whole_s": whole, "first_audio_s": first}
        finally:
            engine.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: models/full-random")
    parser.add_argument("--steps", type=int, default=150, help="GPT steps per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-fidelity", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from chattts_service.runtime import heap

    heap.bound_native_caches()  # oneDNN's shape caches as the server bounds them (before torch)
    model = args.model_dir or default_model()
    report = {"cpu": cpu_model(), "steps": args.steps}
    engine = _engine(model)
    try:
        report["sample"] = measure_sample(engine, args)
    finally:
        engine.close()
    report["long_text"] = measure_long_text(model, args)
    if not args.no_fidelity:
        for label, sampled in (("plain", False), ("sampled", True)):
            fidelity = phase_fidelity(model, args.steps, 2, sampled=sampled)
            report[f"fidelity_{label}"] = {
                key: fidelity[key] for key in ("top1_agreement", "waveform_snr_db")
            }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    sample = report["sample"]
    print(f"CPU: {report['cpu']}; {args.steps}-step requests, median of {args.rounds}")
    print(
        f"encoding a {sample['sample_seconds']:.1f} s sample ({sample['sample_codes']} codes): "
        f"{sample['encode_s'] * 1000:.0f} ms ({sample['encode_first_s']:.2f} s the first time, "
        "building the encoder)"
    )
    print(
        f"8-row decode step {sample['step_8_rows_ms']:.1f} ms; beside an encoding "
        f"{sample['step_8_rows_beside_encoding_ms']:.1f} ms (longest "
        f"{sample['longest_step_beside_encoding_ms']:.1f} ms)"
    )
    for label in ("plain", "sampled"):
        row = sample[label]
        print(
            f"{label:8s} first step {row['first_step_s'] * 1000:.0f} ms, a step "
            f"{row['step_ms']:.2f} ms, alone {row['alone_s']:.2f} s, 8 in a batch "
            f"{row['batch_of_8_s']:.2f} s"
        )
    for mode, row in report["long_text"].items():
        print(
            f"long text ({row['segments']} segments), {mode}: whole {row['whole_s']:.2f} s, "
            f"first streamed audio {row['first_audio_s']:.2f} s"
        )
    for label in ("plain", "sampled"):
        fidelity = report.get(f"fidelity_{label}")
        if fidelity:
            print(
                f"int8 vs fp32, {label} voice: top-1 {fidelity['top1_agreement']:.1%}, "
                f"waveform SNR {fidelity['waveform_snr_db']:.1f} dB"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
