"""Speech benchmark: time to first audio (streamed, ours vs upstream's stream mode) and long text.

    python benchmarks/speech.py [--model-dir DIR] [--steps N] [--requests N] [--json]

Each side runs in its own child process, one after the other so they never share the CPUs:

* upstream: ``Chat.infer(stream=True)`` the way a plain server streams it (fp32, one request at
  a time, fresh parameters per call, ``skip_refine_text=True``); time to the first chunk that
  holds audio, and to the end;
* ours: the engine's stream (``Engine.start(stream=True)``) alone, the same text, voice and
  number of steps; time to the first chunk and to the end;
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
    TEXT,
    audio_seconds,
    default_model,
    load_upstream,
    run_phase,
    upstream_params,
)

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


def phase_ours(model_dir: Path, steps: int, requests: int, long_chars: int) -> dict:
    from chattts_service.config import Settings
    from chattts_service.inference.engine import Engine
    from chattts_service.inference.types import SynthesisRequest

    engine = Engine(Settings.from_env({}, model_dir=model_dir, verify_model=False))
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
    }

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
        first = None
        for _ in engine.start(request, stream=True).chunks(timeout=3600):
            if first is None:
                first = time.perf_counter() - began
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
            "sample": segments[0][:80],
        }
    engine.close()
    return result


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


def report(data: dict) -> str:
    up, ours = data["upstream"], data["ours"]
    up_first = statistics.median(up["first_audio_seconds"])
    our_first = statistics.median(ours["first_audio_seconds"])
    lines = [
        f"streamed, {data['steps']} steps ({audio_seconds(data['steps']):.2f} s of audio), "
        f"median of {data['requests']}:",
        "                      first audio    whole",
        f"upstream stream       {up_first:8.2f} s {statistics.median(up['total_seconds']):8.2f} s",
        f"ours, stream          {our_first:8.2f} s "
        f"{statistics.median(ours['total_seconds']):8.2f} s"
        f"   ({ours['chunks']} chunks, {ours['context_steps']} steps of decoder context)",
        f"first audio {up_first / our_first:.1f}x sooner than upstream",
    ]
    long = ours.get("long_text")
    if long:
        lines += [
            f"long text: {long['characters']} characters -> {long['segments']} segments "
            f"(longest {long['longest_segment']}), normalised in {long['normalise_seconds']:.2f} s",
            f"  whole: {long['wall_seconds']:.1f} s for {long['audio_seconds']:.1f} s of audio "
            f"(RTF {long['real_time_factor']:.2f}), {long['truncated_segments']} segments cut "
            f"by the step cap",
            f"  streamed: first audio after {long['stream_first_audio_seconds']:.2f} s, "
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
    parser.add_argument("--phase", choices=["upstream", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.phase == "upstream":
        print(json.dumps(phase_upstream(args.model_dir, args.steps, args.requests)))
        return 0
    if args.phase == "ours":
        print(json.dumps(phase_ours(args.model_dir, args.steps, args.requests, args.long_chars)))
        return 0

    if args.model_dir is None:
        args.model_dir = default_model()
    data = {
        "steps": args.steps,
        "requests": args.requests,
        "upstream": run_child("upstream", args, []),
        "ours": run_child("ours", args, ["--long-chars", str(args.long_chars)]),
    }
    print(json.dumps(data, indent=1) if args.json else report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
