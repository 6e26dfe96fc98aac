"""``bench.py --mix``: bulk clients and interactive streamers on one box at once.

Three phases against a running service, each bounded in requests and time:

1. **interactive alone**: ``--interactive`` clients each stream a short text, one after another
   ``--interval`` seconds apart, ``--streams`` times: the first audio and how far each stream
   fell behind a player that started at its first byte;
2. **bulk alone**: ``--bulk`` clients each ask for a long text's whole answer
   (``--bulk-requests`` times): audio seconds per wall second;
3. **the mix**: the same bulk work, and the same streamers sending for as long as it runs.

It prints the streams' first audio p50/p95 alone and in the mix (their ratio is the target's
"interactive first audio under bulk load"), how far streams fell behind playback, and the bulk
audio per wall second alone and in the mix; ``--json`` for one JSON object.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import replace

import requests

from benchmarks.loadtest import (
    DEFAULT_TEXT,
    Load,
    Outcome,
    ServerTime,
    describe_server_time,
    percentile,
    send,
)
from chattts_service.domain.text import split_sentences
from chattts_service.runtime.cpu import StealMeter, cpu_model

# a nightly batch's document: 60 sentences (27 segments at the default 100 characters)
BULK_TEXT = "".join(
    f"第{i}段：今天我们整理了项目的进度，大家按计划完成了各自的工作。" for i in range(1, 61)
)


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--mix (bulk clients and streamers at once)")
    group.add_argument("--mix", action="store_true", help="bulk and interactive clients at once")
    group.add_argument("--bulk", type=int, default=2, help="mix: clients asking for long texts")
    group.add_argument(
        "--bulk-requests", type=int, default=1, help="mix: long texts each bulk client asks for"
    )
    group.add_argument("--bulk-text", default=BULK_TEXT, help="mix: the long text")
    group.add_argument(
        "--mark-bulk",
        action="store_true",
        help='mix: send the long texts with "priority": "bulk" (else the service decides)',
    )
    group.add_argument("--interactive", type=int, default=1, help="mix: streaming clients")
    group.add_argument(
        "--interval", type=float, default=2.0, help="mix: seconds between a streamer's streams"
    )
    group.add_argument(
        "--streams", type=int, default=6, help="mix: streams each streamer sends alone"
    )


def _streamer(
    load: Load, interval: float, limit: int, stop: threading.Event, out: list, started: float
):
    session = requests.Session()
    for _ in range(limit):
        if stop.is_set():
            return
        sent = time.perf_counter() - started
        out.append((sent, send(session, load, load.timeout)))
        if stop.wait(interval):
            return


def _bulk_client(load: Load, count: int, out: list, deadline: float) -> None:
    session = requests.Session()
    for _ in range(count):
        if time.monotonic() >= deadline:
            return
        out.append(send(session, load, max(1.0, deadline - time.monotonic())))


def _phase(bulk: Load | None, stream: Load | None, args, until_bulk_ends: bool) -> dict:
    """Run the bulk clients and/or the streamers; the streamers stop after ``--streams`` each
    (alone) or when the bulk work ends (the mix)."""
    deadline = time.monotonic() + args.max_seconds
    stop = threading.Event()
    streams: list[tuple[float, Outcome]] = []  # (sent, seconds into the phase; its outcome)
    bulk_outcomes: list[Outcome] = []
    threads = []
    steal, server = StealMeter(), ServerTime(args.url)
    started = time.perf_counter()
    if stream is not None:
        limit = 1_000 if until_bulk_ends else args.streams
        for index in range(args.interactive):
            load = replace(stream, first_seed=stream.first_seed + 1000 * index)
            thread = threading.Thread(
                target=_streamer,
                args=(load, args.interval, limit, stop, streams, started),
                daemon=True,
            )
            threads.append(thread)
    bulk_threads = []
    if bulk is not None:
        for index in range(args.bulk):
            load = replace(bulk, first_seed=bulk.first_seed + 1000 * index)
            thread = threading.Thread(
                target=_bulk_client,
                args=(load, args.bulk_requests, bulk_outcomes, deadline),
                daemon=True,
            )
            bulk_threads.append(thread)
    for thread in bulk_threads + threads:
        thread.start()
    bulk_wall = None
    if bulk_threads:
        for thread in bulk_threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 30)
        bulk_wall = time.perf_counter() - started
        stop.set()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 60)
    stop.set()
    ok_streams = [o for _, o in streams if o.status == 200]
    firsts = [o.first_audio for o in ok_streams]
    behind = [o.behind for o in ok_streams]
    ok_bulk = [o for o in bulk_outcomes if o.status == 200]
    result = {
        "streams": len(streams),
        "streams_ok": len(ok_streams),
        "first_audio_p50": statistics.median(firsts) if firsts else float("nan"),
        "first_audio_p95": percentile(firsts, 0.95),
        # each stream: when it was sent (seconds into the phase) and its first audio
        "first_audio_each": [
            [round(sent, 3), None if o.first_audio is None else round(o.first_audio, 3)]
            for sent, o in sorted(streams, key=lambda pair: pair[0])
        ],
        "behind_max": max(behind) if behind else float("nan"),
        "streams_behind": sum(1 for b in behind if b > args.tolerance),
        "bulk_requests": len(bulk_outcomes),
        "bulk_ok": len(ok_bulk),
        "bulk_audio_seconds": sum(o.audio_seconds for o in ok_bulk),
        "errors": sorted(
            {
                f"{o.status} {o.error[:80]}"
                for o in [*(o for _, o in streams), *bulk_outcomes]
                if o.status != 200
            }
        ),
        "steal_share": steal.share(),
        "server_time": server.shares(),
    }
    if bulk_wall:
        result["bulk_wall_seconds"] = bulk_wall
        result["bulk_audio_per_wall_second"] = result["bulk_audio_seconds"] / bulk_wall
    return result


def run_mix(args) -> dict:
    stream = Load(
        args.url, args.endpoint, args.text or DEFAULT_TEXT, True, args.timeout, False, args.seed
    )
    bulk: Load = _Documents(
        args.url, "synthesize", args.bulk_text, False, args.timeout, False, args.seed + 500_000
    )
    if args.mark_bulk:
        bulk = _MarkedBulk(**{name: getattr(bulk, name) for name in _LOAD_FIELDS})
    alone = _phase(None, stream, args, until_bulk_ends=False)
    bulk_alone = _phase(bulk, None, args, until_bulk_ends=True)
    mixed = _phase(replace(bulk, first_seed=bulk.first_seed + 7), stream, args, True)
    ratio = mixed["first_audio_p95"] / alone["first_audio_p95"]
    throughput = (
        mixed.get("bulk_audio_per_wall_second", 0.0)
        / bulk_alone.get("bulk_audio_per_wall_second", float("nan"))
        if bulk_alone.get("bulk_audio_per_wall_second")
        else float("nan")
    )
    return {
        "cpu": cpu_model(),
        "url": args.url,
        "bulk_clients": args.bulk,
        "interactive_clients": args.interactive,
        "interactive_alone": alone,
        "bulk_alone": bulk_alone,
        "mix": mixed,
        "first_audio_p95_ratio": ratio,
        "bulk_throughput_ratio": throughput,
        "tolerance_seconds": args.tolerance,
    }


_LOAD_FIELDS = ("url", "endpoint", "text", "stream", "timeout", "repeat_seed", "first_seed")


class _Documents(Load):
    """The long text as a new document each time: its sentences rotated by the request's
    seed (the same sentences, so the same work, but no text the server has seen: a nightly
    batch's documents differ, and what the server keeps of a text it has read must not
    flatter the measurement)."""

    def body(self) -> dict:
        body = super().body()
        sentences = split_sentences(body["text"])
        turn = body["seed"] % len(sentences)
        joiner = " " if body["text"].isascii() else ""
        return {**body, "text": joiner.join(sentences[turn:] + sentences[:turn])}


class _MarkedBulk(_Documents):
    """A long text sent with ``"priority": "bulk"``."""

    def body(self) -> dict:
        return {**super().body(), "priority": "bulk"}


def format_mix(result: dict) -> str:
    alone, bulk, mixed = result["interactive_alone"], result["bulk_alone"], result["mix"]

    def streams(phase: dict) -> str:
        return (
            f"first audio p50 {phase['first_audio_p50']:.3f} s  p95 "
            f"{phase['first_audio_p95']:.3f} s  ({phase['streams_ok']} of {phase['streams']} "
            f"streams; {phase['streams_behind']} more than {result['tolerance_seconds']:g} s "
            f"behind playback, worst {phase['behind_max']:.2f} s)"
        )

    def audio(phase: dict) -> str:
        return (
            f"{phase.get('bulk_audio_per_wall_second', float('nan')):.2f} audio s per wall s "
            f"({phase['bulk_ok']} of {phase['bulk_requests']} long texts, "
            f"{phase['bulk_audio_seconds']:.0f} audio s in "
            f"{phase.get('bulk_wall_seconds', 0):.1f} s)"
        )

    lines = [
        f"{result['cpu']}  {result['url']}: {result['bulk_clients']} bulk client(s), "
        f"{result['interactive_clients']} streamer(s)",
        f"streams alone   {streams(alone)}",
        f"streams in mix  {streams(mixed)}",
        f"{'':16}first audio p95 in the mix / alone: {result['first_audio_p95_ratio']:.2f}x",
        f"bulk alone      {audio(bulk)}",
        f"bulk in mix     {audio(mixed)}",
        f"{'':16}bulk throughput in the mix / alone: {result['bulk_throughput_ratio']:.2f}x",
    ]
    for name, phase in (("alone", alone), ("bulk alone", bulk), ("mix", mixed)):
        if phase["errors"]:
            lines.append(f"errors ({name}): {'; '.join(phase['errors'])}")
        lines.append(
            f"model thread ({name}): {describe_server_time(phase['server_time'])}; steal "
            + ("-" if phase["steal_share"] is None else f"{100 * phase['steal_share']:.1f}%")
        )
    return "\n".join(lines)
