"""Peak memory at full load: CHATTTS_MAX_BATCH of the longest segments at once.

    python benchmarks/memory.py [--model-dir DIR] [--steps N]

A long text is split into segments of at most CHATTTS_MAX_SEGMENT_CHARS characters, each one
generation, so the worst case is a full batch of segments that long (or of CHATTTS_MAX_CHARS, if
smaller). Every request is forced to run to its step cap (no request ends early), so the
KV-cache budget is what keeps memory bounded; requests that do not fit wait. Prints RSS after
ready, the peak RSS while the burst runs, and how long the burst took. Settings come from the
environment as for the server (CHATTTS_MAX_BATCH, CHATTTS_MAX_CHARS, CHATTTS_KV_CACHE_MB, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import DEFAULT_MODEL, TEXT, reset_peak_rss, rss_mb  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="force this many steps per request (default: each request's cap)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from chattts_service.runtime import heap

    heap.bound_native_caches()  # oneDNN's shape caches as the server bounds them (before torch)
    from chattts_service.config import Settings
    from chattts_service.domain.speech import SynthesisRequest
    from chattts_service.inference.engine import Engine

    settings = Settings.from_env(model_dir=args.model_dir, verify_model=False)
    engine = Engine(settings)
    started = time.perf_counter()
    engine.load()
    engine.warm_up()
    ready_seconds = time.perf_counter() - started
    after_ready = rss_mb()
    reset_peak_rss()

    chars = min(settings.max_chars, settings.max_segment_chars)
    text = (TEXT * (chars // len(TEXT) + 1))[:chars]
    text = engine.segments(SynthesisRequest(text, 0))[0]  # the longest single generation
    steps = args.steps or engine.prompts.max_steps_for(text)
    peak = [0.0]
    done = threading.Event()

    def sample_rss():
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb()["VmRSS"])
            time.sleep(0.2)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    burst_started = time.perf_counter()
    futures = [
        engine.submit(SynthesisRequest(text, seed, normalize=False), fixed_steps=steps)
        for seed in range(settings.max_batch)
    ]
    results = [future.result() for future in futures]
    burst_seconds = time.perf_counter() - burst_started
    done.set()
    sampler.join()
    engine.close()
    report = {
        "max_batch": settings.max_batch,
        "max_chars": len(text),
        "kv_cache_mb": settings.kv_cache_mb,
        "steps_per_request": steps,
        "ready_seconds": ready_seconds,
        "rss_after_ready_mb": after_ready["VmRSS"],
        "peak_rss_mb": max(peak[0], rss_mb()["VmHWM"]),
        "burst_seconds": burst_seconds,
        "audio_seconds": sum(result.seconds for result in results),
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['max_batch']} requests x {report['max_chars']} chars, "
            f"{steps} steps each, KV budget {report['kv_cache_mb']} MB"
        )
        print(f"ready in {ready_seconds:.1f} s, RSS after ready {after_ready['VmRSS']:.0f} MB")
        print(
            f"peak RSS during the burst {report['peak_rss_mb']:.0f} MB; burst took "
            f"{burst_seconds:.1f} s for {report['audio_seconds']:.1f} s of audio"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
