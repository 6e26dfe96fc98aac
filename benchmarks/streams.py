"""Streams in the engine: how far each falls behind its listener, and what a chunk costs.

    python benchmarks/streams.py [--model-dir DIR] [--streams 1,4,8] [--steps N] [--rounds N]
                                 [--lookahead 0,16]

Starts N streamed requests at once in the engine (no HTTP), each held to exactly ``--steps``
GPT steps, and plays each stream to a listener who starts at its first chunk and waits when it
runs dry: the first audio, how far the stream fell behind (seconds the listener waited), its
chunks, the audio made per wall second, and where listeners waited: for the second chunk (the
start, when every stream's first chunk is decoded and the listener holds 12 steps of audio) or
later (generation and decoding slower than playback); and what the last stream's first audio
was made of: the prefills, steps and decode rounds the engine ran until then (its observers'
timings), against the steps an exact first chunk waits for and what they would take at the read
floor (the GPT's int8 layers read once a step); with 8 streams or more, the capacity target
in the engine (every stream kept up, the last first audio within 1 s) as ok or MISSED, and
where the first audio misses, what it was made of. Then a round of streamed chunks decoded
both ways the decoder can: stage by stage from what each stream kept
(``AudioDecoder.advance_many``, the service's way) and as windows with their context on both
sides (``decode_many``), medians of ``--repeats``. Without ``--model-dir`` the full-size
random-weight model is used; ``--text`` sets what every stream says (``bench.py`` streams
three sentences). For the same question over HTTP, with a capacity search, use
``bench.py --capacity``.

``--lookahead 0,16`` runs every level with each CHATTTS_STREAM_LOOKAHEAD in turn (alternated, in
one process) and prints how close a chunk decoded with that many steps after it comes to the
whole answer (SNR over the chunk, against the decoder's whole context), and how far the streams'
provisional starts are from their whole answers: run it on your model before choosing one.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import (  # noqa: E402
    RELEVANT_CPU_FLAGS,
    TEXT,
    cpu_line,
    default_model,
    weights_read_seconds,
)
from benchmarks.loadtest import (  # noqa: E402
    MAX_FIRST_AUDIO_SECONDS,
    TOLERANCE_SECONDS,
)
from chattts_service.config import DECODER_DTYPES, KV_CACHE_DTYPES  # noqa: E402  (no torch)
from chattts_service.domain.playback import waits  # noqa: E402
from chattts_service.runtime.cpu import cpu_flags, cpu_model  # noqa: E402

SAMPLE_RATE = 24_000
# the capacity target in the engine: this many streams started at once all keep up with their
# listeners (none behind by more than bench.py's default tolerance) and the last first audio
# comes within bench.py --capacity's default bound on its p95
TARGET_STREAMS = 8


class Timeline:
    """The engine's prefills, steps and decode rounds as they end: (end, size, seconds) each,
    from the observers ``Engine`` takes (``observers()``)."""

    def __init__(self):
        self.prefills: list[tuple[float, int, float]] = []
        self.steps: list[tuple[float, int, float]] = []
        self.decodes: list[tuple[float, int, float]] = []

    def observers(self) -> dict:
        def into(events):
            return lambda size, seconds: events.append((time.perf_counter(), size, seconds))

        return {
            "prefill_observer": into(self.prefills),
            "step_observer": into(self.steps),
            "decode_observer": into(self.decodes),
        }

    def clear(self) -> None:
        self.prefills.clear()
        self.steps.clear()
        self.decodes.clear()

    def first_audio(self, started: float, until: float, rows: int) -> dict:
        """What the engine did from ``started`` to ``until`` (the last stream's first audio):
        the prefills, steps and decode rounds that ended by then, the steps at ``rows`` rows,
        and the rest (the scheduler's own work, handing chunks over)."""

        def within(events):
            return [(size, seconds) for end, size, seconds in events if started < end <= until]

        prefills, steps, decodes = (
            within(self.prefills),
            within(self.steps),
            within(self.decodes),
        )
        full = [seconds for size, seconds in steps if size == rows]
        parts = {
            "prefills": len(prefills),
            "prefill_seconds": sum(seconds for _, seconds in prefills),
            "steps": len(steps),
            "step_seconds": sum(seconds for _, seconds in steps),
            "full_step_ms": statistics.median(full) * 1e3 if full else None,
            "decode_rounds": len(decodes),
            "decode_seconds": sum(seconds for _, seconds in decodes),
        }
        parts["other_seconds"] = (until - started) - (
            parts["prefill_seconds"] + parts["step_seconds"] + parts["decode_seconds"]
        )
        return parts


def run_streams(
    engine,
    count: int,
    steps: int,
    seed: int,
    text: str = TEXT,
    whole: bool = False,
    timeline: Timeline | None = None,
) -> dict:
    """``whole``: then generate each stream's whole answer too and compare its provisional
    start (a look-ahead's) with it. With the engine's ``timeline``: what the last stream's
    first audio was made of."""
    from chattts_service.domain.speech import SynthesisRequest

    results: list = [None] * count
    if timeline is not None:
        timeline.clear()
    started = time.perf_counter()
    runs = [
        engine.start(SynthesisRequest(text, seed + index), fixed_steps=steps, stream=True)
        for index in range(count)
    ]

    kept: list = [[] for _ in range(count)]  # the chunks themselves, with ``whole``

    def listen(index: int) -> None:
        arrivals = []
        for chunk in runs[index].chunks(timeout=600):
            arrivals.append((time.perf_counter(), len(chunk) / SAMPLE_RATE))
            if whole:
                kept[index].append(chunk)
        results[index] = arrivals

    threads = [threading.Thread(target=listen, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    audio = sum(seconds for arrivals in results for _, seconds in arrivals)
    waited = [waits(arrivals) for arrivals in results]
    behind = [sum(stream) for stream in waited]
    level = {
        "streams": count,
        "lookahead": engine.settings.stream_lookahead,
        "first_audio_max": max(arrivals[0][0] - started for arrivals in results),
        "behind_max": max(behind),
        "behind_median": statistics.median(behind),
        "chunks_median": statistics.median(len(arrivals) for arrivals in results),
        # where listeners wait: for the second chunk (the start: every stream's first chunks
        # and the decoder's context), or later (generation slower than playback)
        "second_chunk_wait_max": max(sum(stream[1:2]) for stream in waited),
        "later_wait_max": max(sum(stream[2:]) for stream in waited),
        "audio_per_wall_second": audio / wall,
        "provisional_steps_max": max(run.provisional for run in runs),
    }
    if timeline is not None:
        level["first_audio_parts"] = timeline.first_audio(
            started, started + level["first_audio_max"], count
        )
    if whole and level["provisional_steps_max"]:
        level["provisional_snr_db_min"] = min(
            _provisional_snr(engine, run, chunks, SynthesisRequest(text, seed + index), steps)
            for index, (run, chunks) in enumerate(zip(runs, kept, strict=True))
            if run.provisional
        )
    return level


def _provisional_snr(engine, run, chunks, request, steps: int) -> float:
    """The SNR of a stream's provisional start against the same steps of its whole answer."""
    import numpy as np

    from chattts_service.domain.speech import SAMPLES_PER_STEP

    whole = engine.start(request, fixed_steps=steps).result(600).audio
    samples = run.provisional * SAMPLES_PER_STEP
    streamed = np.concatenate(chunks)[:samples]
    return _snr(whole[:samples], streamed)


def _snr(reference, other) -> float:
    import numpy as np

    noise = float(np.sum((reference - other) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(reference**2)) / noise)


def lookahead_fidelity(engine, lookaheads: list[int], seeds: int = 3) -> list[dict]:
    """A 12-step chunk decoded from a window that ends ``lookahead`` steps after it, against
    the same steps decoded with the decoder's whole context: SNR over the chunk (min over three
    places in three seeds' hidden states of the stream's text)."""
    from chattts_service.domain.speech import SAMPLES_PER_STEP, SynthesisRequest
    from chattts_service.inference.generation import Batch

    decoder = engine.model.decoder

    def measure():
        hiddens = []
        for seed in range(seeds):
            request = SynthesisRequest(TEXT, seed)
            sequence = engine.prompts.code_sequence(
                engine.prompts.normalise(TEXT), request, engine.speaker_embedding(seed), 150
            )
            batch = Batch(engine.model.transformer, engine.model.heads, 1)
            batch.add(sequence)
            while len(batch):
                batch.step()
            hiddens.append(sequence.result_hiddens())
        rows = []
        for lookahead in lookaheads:
            snrs = []
            for states in hiddens:
                whole = decoder(states)
                for first in (0, 12, 60):
                    last = first + 12
                    chunk = decoder.span(states[: last + lookahead], first, last)
                    reference = whole[first * SAMPLES_PER_STEP : last * SAMPLES_PER_STEP]
                    snrs.append(_snr(reference[: len(chunk)], chunk[: len(reference)]))
            rows.append({"lookahead": lookahead, "chunk_snr_db_min": min(snrs)})
        return rows

    return engine.scheduler.call(measure).result()


def decode_round(engine, rows: int, chunk: int, repeats: int) -> dict:
    """A round of ``rows`` streams' ``chunk``-step chunks in steady state, both ways."""
    import torch

    from chattts_service.inference.decoding import Advance

    decoder = engine.model.decoder
    context = decoder.context_steps
    hidden = engine.model.heads.hidden_size

    def measure():
        generator = torch.Generator().manual_seed(rows * 1000 + chunk)
        total = context + 100 + (repeats + 1) * chunk + context
        streams = [torch.randn(total, hidden, generator=generator) for _ in range(rows)]
        states = [decoder.stream() for _ in streams]
        steps = context + 100
        decoder.advance_many(
            [Advance(s, h[:steps], steps - context, False) for s, h in zip(states, streams)]
        )
        staged, windows = [], []
        for _ in range(repeats):
            steps += chunk
            until = steps - context
            began = time.perf_counter()
            decoder.advance_many(
                [Advance(s, h[:steps], until, False) for s, h in zip(states, streams)]
            )
            staged.append(time.perf_counter() - began)
            start = until - chunk - context
            began = time.perf_counter()
            decoder.decode_many([(h[start:steps], context, context + chunk) for h in streams])
            windows.append(time.perf_counter() - began)
        return statistics.median(staged), statistics.median(windows)

    staged, windows = engine.scheduler.call(measure).result()
    return {
        "rows": rows,
        "chunk_steps": chunk,
        "staged_ms": staged * 1e3,
        "windows_ms": windows * 1e3,
    }


def report(data: dict) -> str:
    lines = [
        cpu_line(data),
        f"decoder {data['decoder_dtype']}, {data['kv_cache_dtype']} KV cache, "
        f"{data['steps']} steps a stream, "
        f"{data['threads']} threads",
    ]
    for level in data["levels"]:
        lookahead = (
            f" (look-ahead {level['lookahead']}: at most {level['provisional_steps_max']} steps "
            f"provisional, SNR {level['provisional_snr_db_min']:.1f} dB at least)"
            if "provisional_snr_db_min" in level
            else f" (look-ahead {level['lookahead']})"
            if level["lookahead"]
            else ""
        )
        lines.append(
            f"{level['streams']:>3} streams{lookahead}: first audio max "
            f"{level['first_audio_max']:.2f} s, "
            f"behind max {level['behind_max']:.3f} s (median {level['behind_median']:.3f}), "
            f"{level['chunks_median']:g} chunks, "
            f"{level['audio_per_wall_second']:.2f} audio s per wall s; "
            f"waits for the 2nd chunk max {level['second_chunk_wait_max']:.3f} s, "
            f"later max {level['later_wait_max']:.3f} s"
        )
        parts = level.get("first_audio_parts")
        if parts is not None:
            at_rows = (
                f" (at {level['streams']} rows {parts['full_step_ms']:.1f} ms median)"
                if parts["full_step_ms"] is not None
                else ""
            )
            lines.append(
                f"    first audio {level['first_audio_max']:.3f} s: {parts['prefills']} prefills "
                f"{parts['prefill_seconds']:.3f} s, {parts['steps']} steps "
                f"{parts['step_seconds']:.3f} s{at_rows}, {parts['decode_rounds']} decode rounds "
                f"{parts['decode_seconds']:.3f} s, the rest {parts['other_seconds']:.3f} s"
            )
    target = [level for level in data["levels"] if level["streams"] >= TARGET_STREAMS]
    if target:
        lines += target_lines(target, data)
    if "first_chunk_steps" in data:
        floor_seconds = first_chunk_at_floor(data)
        at_floor = (
            f"; at the read floor (the GPT's int8 layers read once a step, "
            f"{data['read_floor_ms']:.2f} ms) they take {floor_seconds:.2f} s"
            if floor_seconds is not None
            else ""
        )
        lines.append(
            f"an exact first chunk waits for {data['first_chunk_steps']} steps (the decoders' "
            f"{data['context_steps']} of context and its own "
            f"{data['first_chunk_steps'] - data['context_steps']}){at_floor}"
        )
    for row in data["lookahead_fidelity"]:
        lines.append(
            f"a 12-step chunk decoded {row['lookahead']} steps ahead of generation: SNR "
            f"{row['chunk_snr_db_min']:.1f} dB at least against its exact samples"
        )
    for round_ in data["decode_rounds"]:
        lines.append(
            f"a round of {round_['rows']} x {round_['chunk_steps']}-step chunks: stage by stage "
            f"{round_['staged_ms']:.1f} ms, as windows {round_['windows_ms']:.1f} ms "
            f"({round_['staged_ms'] / round_['windows_ms']:.2f})"
        )
    return "\n".join(lines)


def first_chunk_at_floor(data: dict) -> float | None:
    """Seconds the steps an exact first chunk waits for take at the read floor (None where
    either was not measured)."""
    if "read_floor_ms" not in data or "first_chunk_steps" not in data:
        return None
    return data["first_chunk_steps"] * data["read_floor_ms"] / 1e3


def target_lines(levels: list[dict], data: dict) -> list[str]:
    """ok/MISSED for the levels of TARGET_STREAMS streams or more (their worst run), and where
    the first audio is missed, what it was made of against the steps at the read floor."""
    first = max(levels, key=lambda level: level["first_audio_max"])
    behind = max(level["behind_max"] for level in levels)
    reason = ""
    parts = first.get("first_audio_parts")
    if first["first_audio_max"] > MAX_FIRST_AUDIO_SECONDS and parts is not None:
        floor = first_chunk_at_floor(data)
        at_floor = f", {floor:.2f} s at the read floor" if floor is not None else ""
        reason = (
            f" (its steps {parts['step_seconds']:.2f} s{at_floor}; its prefills "
            f"{parts['prefill_seconds']:.2f} s; its decode rounds {parts['decode_seconds']:.2f} s)"
        )
    streams = first["streams"]
    first_label = f"{streams} streams at once: last first audio <= {MAX_FIRST_AUDIO_SECONDS:g} s"
    behind_label = f"{streams} streams at once: each within {TOLERANCE_SECONDS:g} s of playback"
    return [
        "targets:",
        f"  {first_label:<52}: {first['first_audio_max']:.2f} s  "
        f"{'ok' if first['first_audio_max'] <= MAX_FIRST_AUDIO_SECONDS else 'MISSED'}{reason}",
        f"  {behind_label:<52}: {behind:.3f} s behind at most  "
        f"{'ok' if behind <= TOLERANCE_SECONDS else 'MISSED'}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--streams", default="1,4,8", help="levels: streams started at once")
    parser.add_argument("--steps", type=int, default=300, help="GPT steps a stream")
    parser.add_argument("--rounds", type=int, default=2, help="runs per level")
    parser.add_argument("--repeats", type=int, default=9, help="decode rounds timed (median)")
    parser.add_argument("--chunks", default="8x32,8x16,1x32", help="decode rounds: rowsxsteps")
    parser.add_argument(
        "--text", default=TEXT, help="what every stream says (bench.py streams three sentences)"
    )
    parser.add_argument("--decoder-dtype", default="auto", choices=DECODER_DTYPES)
    parser.add_argument(
        "--kv-cache-dtype", default="bf16", choices=KV_CACHE_DTYPES, help="CHATTTS_KV_CACHE_DTYPE"
    )
    parser.add_argument(
        "--lookahead",
        default="0",
        help="CHATTTS_STREAM_LOOKAHEAD values, each level run with each in turn (e.g. 0,16)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from chattts_service.runtime import heap

    heap.bound_native_caches()  # oneDNN's shape caches as the server bounds them (before torch)
    import torch

    from chattts_service.config import Settings
    from chattts_service.inference.engine import Engine
    from chattts_service.inference.job import FIRST_CHUNK_STEPS

    levels = [int(value) for value in args.streams.split(",") if value]
    lookaheads = [int(value) for value in args.lookahead.split(",") if value]
    timeline = Timeline()
    engine = Engine(
        Settings.from_env(
            {},
            model_dir=args.model_dir or default_model(),
            verify_model=False,
            max_batch=max(levels + [8]),
            decoder_dtype=args.decoder_dtype,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        **timeline.observers(),
    )
    engine.load()
    engine.warm_up()
    data = {
        "cpu": cpu_model(),
        "cpu_flags": sorted(RELEVANT_CPU_FLAGS & cpu_flags()),
        "decoder_dtype": engine.model.decoder.dtype,
        "kv_cache_dtype": engine.settings.kv_cache_dtype,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "levels": [],
        "lookahead_fidelity": [],
        "decode_rounds": [],
        "context_steps": engine.model.decoder.context_steps,
        "first_chunk_steps": engine.model.decoder.context_steps + FIRST_CHUNK_STEPS,
    }
    seed = 1000
    try:
        for count in levels:
            for _ in range(args.rounds):
                for lookahead in lookaheads:  # the same seeds each way
                    engine.settings = replace(engine.settings, stream_lookahead=lookahead)
                    data["levels"].append(
                        run_streams(
                            engine,
                            count,
                            args.steps,
                            seed,
                            args.text,
                            whole=lookahead > 0,
                            timeline=timeline,
                        )
                    )
                seed += count
        if any(lookaheads):
            fidelity = sorted({4, 8, 12, 16, 24, *(value for value in lookaheads if value)})
            data["lookahead_fidelity"] = lookahead_fidelity(engine, fidelity)
        for spec in (value for value in args.chunks.split(",") if value):
            rows, chunk = (int(part) for part in spec.split("x"))
            data["decode_rounds"].append(decode_round(engine, rows, chunk, args.repeats))
        transformer = engine.model.transformer
        read = engine.scheduler.call(lambda: weights_read_seconds(transformer)).result()
        if read is not None:
            data["read_floor_ms"] = read * 1e3
    finally:
        engine.close()
    print(json.dumps(data, indent=1) if args.json else report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
