"""Where kept memory comes from: each suspect run alone, on glibc and on jemalloc.

    python benchmarks/heap_sources.py [--model-dir DIR] [--rounds 300] [--threads 4]

A soak shows RSS creeping up while the memory in use does not; this takes the service's
allocation patterns one at a time, each in a fresh process on each allocator, from several
threads as the server's request threads and scheduler allocate:

- ``encoders``: streamed MP3, Opus and AAC encoders (PyAV/FFmpeg) fed pieces of audio of
  varying length, then closed, as streamed answers do;
- ``decoders``: ChatTTS's decoder and Vocos on hidden states of varying length, whole and in
  the spans streaming decodes (torch's CPU allocator: large tensors of ever-new sizes);
- ``text``: the text normaliser (wetext) and ChatTTS's tokenizer on texts of varying length;
- ``python``: Python objects of a request's shape (dicts, lists, bytes of audio) made and freed.

For each it warms up, then reports RSS and the allocator's in-use and free-but-kept bytes at
the end of each fifth of the measured rounds, and the growth over the last three fifths (MB
per 1,000 rounds). The suspect whose RSS grows on glibc and not on jemalloc, while its memory
in use stays flat, is the fragmentation a soak shows. ``--json`` for one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SUSPECTS = ("encoders", "decoders", "text", "python")
TEXTS = (
    "今天天气很好，我们一起去公园散步吧。",
    "The meeting starts at 3:30 pm on March 5, room 1204.",
    "请把2024年的报告在周五之前发给我，金额是¥1,234.50。",
)


def _workload(suspect: str, model_dir: Path):
    """A function of the round number doing one request's worth of ``suspect``'s work."""
    import random

    import numpy as np

    if suspect == "encoders":
        from chattts_service.services.audio import StreamEncoder, to_pcm16

        def encoders(index: int) -> None:
            rng = random.Random(index)
            encoder = StreamEncoder(("mp3", "opus", "aac")[index % 3], 24_000)
            for _ in range(rng.randint(2, 12)):
                audio = np.random.default_rng(index).standard_normal(rng.randint(2_000, 40_000))
                encoder.encode(to_pcm16(0.1 * audio.astype(np.float32)))
            encoder.finish()

        return encoders
    if suspect in ("decoders", "text"):
        import torch

        from chattts_service.config import Settings
        from chattts_service.domain.text import Normaliser, pack, split_sentences
        from chattts_service.inference.engine import Engine

        torch.set_num_threads(1)
        engine = Engine(Settings.from_env(model_dir=model_dir, verify_model=False))
        engine.load()
    if suspect == "decoders":
        decoder, hidden = engine.model.decoder, engine.model.transformer.hidden_size

        def decoders(index: int) -> None:
            rng = random.Random(index)
            steps = rng.randint(20, 400)
            hiddens = torch.randn(steps, hidden)
            with torch.inference_mode():
                if index % 2:
                    decoder(hiddens)
                else:  # streaming: spans of 32 steps with their context
                    for first in range(0, steps, 32):
                        decoder.span(hiddens, first, min(steps, first + 32))

        return decoders
    if suspect == "text":
        normaliser, tokenizer = Normaliser(), engine.model.chat.tokenizer
        normaliser.warm_up()

        def text(index: int) -> None:
            rng = random.Random(index)
            body = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 12)))
            for segment in pack(split_sentences(body), 100):
                tokenizer.encode([normaliser(segment)], 4)

        return text

    def python(index: int) -> None:
        rng = random.Random(index)
        kept = [
            {"text": "x" * rng.randint(10, 4000), "audio": bytes(rng.randint(1_000, 400_000))}
            for _ in range(rng.randint(1, 20))
        ]
        kept.clear()

    return python


def measure(suspect: str, rounds: int, threads: int, model_dir: Path) -> dict:
    """In this process (started on the allocator to measure): warm up, then run ``rounds``
    rounds on ``threads`` threads, sampling after each fifth."""
    from benchmarks.engine import rss_mb
    from chattts_service.runtime import heap

    work = _workload(suspect, model_dir)

    def run(first: int, count: int) -> None:
        def worker(offset: int) -> None:
            for index in range(first + offset, first + count, threads):
                work(index)

        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()

    run(0, max(threads, rounds // 10))  # warm-up: every shape class seen once
    samples = []
    fifth = max(1, rounds // 5)
    for part in range(5):
        run(10**6 + part * fifth, fifth)
        figures = heap.stats() or {}
        samples.append(
            {
                "rounds": (part + 1) * fifth,
                "rss_mb": rss_mb()["VmRSS"],
                "in_use_mb": (figures.get("in_use", 0) + figures.get("mmapped", 0)) / 2**20,
                "free_mb": figures.get("free", 0) / 2**20,
            }
        )
    per_thousand = 1000 / (samples[-1]["rounds"] - samples[1]["rounds"])
    return {
        "allocator": heap.allocator(),
        "samples": samples,
        "growth_mb_per_1000_rounds": {
            key: (samples[-1][key] - samples[1][key]) * per_thousand
            for key in ("rss_mb", "in_use_mb", "free_mb")
        },
    }


def in_child(suspect: str, allocator: str, args) -> dict:
    import ctypes.util

    env = dict(os.environ)
    if allocator == "jemalloc":
        library = ctypes.util.find_library("jemalloc")
        if library is None:
            return {"error": "jemalloc is not installed"}
        env["LD_PRELOAD"] = library
        env.setdefault("MALLOC_CONF", "background_thread:true")
    command = [
        sys.executable, __file__, "--child", suspect, "--rounds", str(args.rounds),
        "--threads", str(args.threads), "--model-dir", str(args.model_dir),
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--suspect", choices=SUSPECTS, action="append")
    parser.add_argument("--child", choices=SUSPECTS, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.child:
        from chattts_service.runtime import heap

        # as the server starts: glibc's arenas limited, oneDNN's shape caches bounded
        heap.limit_arenas()
        heap.bound_native_caches()
        print(json.dumps(measure(args.child, args.rounds, args.threads, args.model_dir)))
        return 0
    from benchmarks.engine import default_model
    from chattts_service.runtime.cpu import cpu_model

    args.model_dir = args.model_dir or default_model()
    results = {"cpu": cpu_model(), "rounds": args.rounds, "threads": args.threads}
    if not args.json:
        print(f"cpu: {results['cpu']}; {args.rounds} rounds on {args.threads} threads", flush=True)
    for suspect in args.suspect or SUSPECTS:
        for allocator in ("system", "jemalloc"):
            result = in_child(suspect, allocator, args)
            results[f"{suspect}/{allocator}"] = result
            if not args.json:
                if "error" in result:
                    print(f"{suspect:9s} {allocator:9s} error: {result['error']}")
                    continue
                growth = result["growth_mb_per_1000_rounds"]
                print(
                    f"{suspect:9s} {allocator:9s} per 1,000 rounds: RSS {growth['rss_mb']:+7.1f} MB"
                    f", in use {growth['in_use_mb']:+7.1f} MB, free but kept "
                    f"{growth['free_mb']:+7.1f} MB (RSS at the end "
                    f"{result['samples'][-1]['rss_mb']:.0f} MB)",
                    flush=True,
                )
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
