"""Gaps between steps: how long the running rows wait for other work, with voices from a
recording joining a running batch.

    python benchmarks/stalls.py [--model-dir DIR] [--streams 8] [--sampled 4] [--steps 300]
                                [--sample-seconds 10] [--apart 0.25] [--rounds 2]
                                [--bulk 0] [--repeat 5] [--json]

Starts ``--streams`` streamed requests in the engine (no HTTP), one every ``--apart`` seconds,
``--sampled`` of them in a voice made from a ``--sample-seconds`` recording (its codes are a
long prompt: about 21.5 positions a second of recording), each held to ``--steps`` steps. From
the engine's step observer it takes every gap between the end of one step and the start of
the next while rows were stepping (prefills, decode rounds, work handed to the model thread):
the longest, the 99th percentile and how many passed 50 ms; the decode rounds among them (the
engine's decode observer); and how far each stream fell behind a listener who started at its
first chunk. With ``--bulk N``, N long texts (``bench.py --mix``'s, whole answers marked bulk,
``--steps`` a segment) start with each round and every stream's client sends its request
again, a second after the last one's audio ended, while they run (``--repeat`` times at most):
then the streams' first audio is reported too. It reads only the step observer, which
every revision of the engine has, so the same script measures an older checkout copied beside
it (run it from that checkout's ``benchmarks/``). Without ``--model-dir`` the full-size
random-weight model whose speech never ends is used (``models/full-endless``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chattts_service.domain.playback import Playback  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402

STALL_SECONDS = 0.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(REPO / "models" / "full-endless"))
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--sampled", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--apart", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bulk", type=int, default=0, help="long texts beside the streams")
    parser.add_argument("--repeat", type=int, default=5, help="with --bulk: requests a client")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from chattts_service.runtime import heap

    heap.bound_native_caches()
    import numpy as np
    import torch

    from benchmarks.mix import BULK_TEXT
    from chattts_service.config import Settings
    from chattts_service.domain.speech import BULK, SynthesisRequest
    from chattts_service.domain.voices import SpeakerSample, Voice
    from chattts_service.inference.engine import Engine

    steps: list[tuple[float, float, int]] = []  # (start, end, rows)

    def on_step(rows: int, seconds: float) -> None:
        end = time.perf_counter()
        steps.append((end - seconds, end, rows))

    settings = Settings.from_env(
        {}, model_dir=args.model_dir, verify_model=False, max_batch=max(8, args.streams)
    )
    decodes: list[float] = []
    engine = Engine(
        settings,
        step_observer=on_step,
        decode_observer=lambda items, seconds: decodes.append(seconds),
    )
    engine.load()
    engine.warm_up()
    # a recording: 24 kHz noise shaped like speech's level; its codes are what the prompt holds
    generator = np.random.default_rng(7)
    recording = (0.1 * generator.standard_normal(int(24_000 * args.sample_seconds))).astype(
        np.float32
    )
    codes = engine.encode_sample(recording)
    sampled = Voice(
        "recorded",
        engine.speaker_embedding(1),
        digest="recorded",
        sample=SpeakerSample(codes, "今天天气很好。"),
    )
    rounds = []
    for number in range(args.rounds):
        steps.clear()
        decodes.clear()
        arrivals: list[list[tuple[float, float]]] = []
        firsts: list[float] = []
        bulk = [
            engine.start(
                SynthesisRequest(BULK_TEXT, seed=1000 * number + index),
                fixed_steps=args.steps,
                priority=BULK,
            )
            for index in range(args.bulk)
        ]

        def listen(index: int, seed: int, bulk: list, arrivals: list, firsts: list) -> None:
            voice = sampled if index < args.sampled else None
            for again in range(args.repeat if bulk else 1):
                if again and all(job.future.done() for run in bulk for job in run.jobs):
                    return  # the long texts are done
                if again:
                    time.sleep(1.0)
                seed += 10_000 * bool(again)
                request = SynthesisRequest("你好，欢迎收听。", seed=seed, voice=voice)
                asked = time.perf_counter()
                run = engine.start(request, fixed_steps=args.steps, stream=True)
                heard: list[tuple[float, float]] = []
                arrivals.append(heard)
                for chunk in run.chunks(timeout=600):
                    heard.append((time.perf_counter(), len(chunk) / 24_000))
                if heard:
                    firsts.append(heard[0][0] - asked)

        threads = []
        for index in range(args.streams):
            thread = threading.Thread(
                target=listen, args=(index, 100 * number + index, bulk, arrivals, firsts)
            )
            thread.start()
            threads.append(thread)
            time.sleep(args.apart)
        for thread in threads:
            thread.join()
        for run in bulk:
            run.result(3600)
        gaps = [
            later[0] - earlier[1]
            for earlier, later in zip(steps, steps[1:], strict=False)
            if earlier[2] and later[0] - earlier[1] >= 0
        ]
        behind = []
        for pieces in arrivals:
            playback = Playback()
            for at, seconds in pieces:
                playback.arrived(at, seconds)
            behind.append(playback.behind)
        ordered = sorted(gaps)
        rounds.append(
            {
                "longest_gap": ordered[-1],
                "gap_p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                "gap_median": statistics.median(ordered),
                "gaps_over_50ms": sum(1 for gap in gaps if gap > STALL_SECONDS),
                "gaps": len(gaps),
                "behind_max": max(behind),
                "longest_decode_round": max(decodes, default=0.0),
                "decode_rounds_over_50ms": sum(1 for seconds in decodes if seconds > STALL_SECONDS),
                "decode_seconds": sum(decodes),
                "wall_seconds": steps[-1][1] - steps[0][0] if steps else 0.0,
                "streams_run": len(firsts),
                "first_audio_median": statistics.median(firsts) if firsts else None,
                "first_audio_max": max(firsts, default=None),
            }
        )
    engine.close()
    result = {
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "streams": args.streams,
        "sampled": args.sampled,
        "prompt_code_positions": int(codes.shape[-1]),
        "rounds": rounds,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"cpu {result['cpu']}, {result['threads']} threads")
        print(
            f"{args.streams} streams {args.apart:g} s apart, {args.sampled} in a voice from a "
            f"{args.sample_seconds:g} s recording ({result['prompt_code_positions']} code "
            f"positions in its prompt), {args.steps} steps each"
            + (f", beside {args.bulk} long texts" if args.bulk else "")
        )
        for index, one in enumerate(rounds):
            print(
                f"round {index + 1}: longest gap between steps {1000 * one['longest_gap']:.1f} ms, "
                f"p99 {1000 * one['gap_p99']:.1f} ms, median {1000 * one['gap_median']:.2f} ms; "
                f"{one['gaps_over_50ms']} of {one['gaps']} over 50 ms; streams behind at most "
                f"{one['behind_max']:.3f} s; decode rounds: longest "
                f"{1000 * one['longest_decode_round']:.1f} ms, {one['decode_rounds_over_50ms']} "
                f"over 50 ms, {one['decode_seconds']:.2f} s of {one['wall_seconds']:.2f} s; "
                f"{one['streams_run']} streams, first audio median "
                f"{one['first_audio_median']:.2f} s, longest {one['first_audio_max']:.2f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
