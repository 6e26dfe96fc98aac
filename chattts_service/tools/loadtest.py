"""The user's load check against a running service (``bench.py``).

Bounded in request count and wall time; prints latency percentiles, throughput and errors.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

DEFAULT_TEXT = "今天天气很好，我们一起去公园散步吧。"


@dataclass
class Outcome:
    status: int  # 0 = no HTTP answer
    seconds: float
    audio_seconds: float
    cache: str
    error: str = ""


def wav_seconds(payload: bytes) -> float:
    with wave.open(io.BytesIO(payload)) as reader:
        return reader.getnframes() / reader.getframerate()


def _one(session: requests.Session, url: str, body: dict, timeout: float) -> Outcome:
    started = time.perf_counter()
    try:
        response = session.post(url, json=body, timeout=timeout)
    except requests.RequestException as error:
        return Outcome(0, time.perf_counter() - started, 0.0, "-", f"{error.__class__.__name__}")
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        return Outcome(response.status_code, elapsed, 0.0, "-", response.text[:200])
    try:
        audio = wav_seconds(response.content)
    except (wave.Error, EOFError) as error:
        return Outcome(-1, elapsed, 0.0, "-", f"invalid WAV: {error}")
    return Outcome(200, elapsed, audio, response.headers.get("X-Cache", "-"))


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def run(
    url: str,
    concurrency: int,
    total: int,
    text: str,
    max_seconds: float,
    timeout: float,
    repeat_seed: bool = False,
    first_seed: int = 1,
) -> dict:
    """Send ``total`` requests with ``concurrency`` in flight; stop early at ``max_seconds``."""
    endpoint = url.rstrip("/") + "/synthesize"
    counter = iter(range(total))
    counter_lock = threading.Lock()
    outcomes: list[Outcome] = []
    outcomes_lock = threading.Lock()
    deadline = time.monotonic() + max_seconds

    def worker():
        session = requests.Session()
        while time.monotonic() < deadline:
            with counter_lock:
                index = next(counter, None)
            if index is None:
                return
            # A new seed per request keeps the cache out of the measurement unless asked.
            seed = first_seed if repeat_seed else first_seed + index
            outcome = _one(
                session,
                endpoint,
                {"text": text, "seed": seed},
                min(timeout, max(1.0, deadline - time.monotonic())),
            )
            with outcomes_lock:
                outcomes.append(outcome)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    wall = time.perf_counter() - started
    return summarise(outcomes, endpoint, concurrency, total, wall)


def summarise(
    outcomes: list[Outcome], endpoint: str, concurrency: int, total: int, wall: float
) -> dict:
    """The report of a run: latency percentiles, throughput, errors by status."""
    ok = [o for o in outcomes if o.status == 200]
    latencies = [o.seconds for o in ok]
    audio = sum(o.audio_seconds for o in ok)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            errors[str(o.status)] = errors.get(str(o.status), 0) + 1
    return {
        "url": endpoint,
        "concurrency": concurrency,
        "requests_sent": len(outcomes),
        "requests_ok": len(ok),
        "errors": errors,
        "cache_hits": sum(1 for o in ok if o.cache == "HIT"),
        "wall_seconds": wall,
        "latency_p50": statistics.median(latencies) if latencies else float("nan"),
        "latency_p95": percentile(latencies, 0.95),
        "latency_max": max(latencies) if latencies else float("nan"),
        "requests_per_second": len(ok) / wall if wall > 0 else 0.0,
        "audio_seconds": audio,
        "audio_seconds_per_wall_second": audio / wall if wall > 0 else 0.0,
        "real_time_factor_p50": statistics.median(
            o.seconds / o.audio_seconds for o in ok if o.audio_seconds > 0
        )
        if ok
        else float("nan"),
        "stopped_by_time_limit": len(outcomes) < total,
    }


def format_report(result: dict) -> str:
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(result["errors"].items())) or "none"
    return "\n".join(
        [
            f"{result['url']}  concurrency {result['concurrency']}",
            f"requests      {result['requests_ok']} ok of {result['requests_sent']} sent"
            f" in {result['wall_seconds']:.1f} s ({result['cache_hits']} cache hits)"
            + ("  [stopped by --max-seconds]" if result["stopped_by_time_limit"] else ""),
            f"latency       p50 {result['latency_p50']:.3f} s   p95 {result['latency_p95']:.3f} s"
            f"   max {result['latency_max']:.3f} s",
            f"throughput    {result['requests_per_second']:.2f} requests/s   "
            f"{result['audio_seconds_per_wall_second']:.2f} audio s per wall s"
            f"   (real-time factor p50 {result['real_time_factor_p50']:.2f})",
            f"errors        {errors}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8090")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=600.0,
        help="stop sending after this long (default 600)",
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout")
    parser.add_argument(
        "--repeat-seed",
        action="store_true",
        help="send the same seed every time (measures the cache)",
    )
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.concurrency < 1 or args.requests < 1 or args.max_seconds <= 0:
        parser.error("--concurrency, --requests and --max-seconds must be positive")
    result = run(
        args.url,
        args.concurrency,
        args.requests,
        args.text,
        args.max_seconds,
        args.timeout,
        args.repeat_seed,
        args.seed,
    )
    print(json.dumps(result) if args.json else format_report(result))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
