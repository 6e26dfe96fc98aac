"""Soak test: steady load for a long time under the compose file's 3 GiB memory limit.

    python benchmarks/soak.py [--model-dir DIR] [--minutes 30] [--clients 8] [--limit-mb 3072]

Runs the server (loopback) inside a cgroup v1 memory group limited like the compose file, keeps
``--clients`` requests in flight (new seeds, mixed lengths, some streamed, some long texts, some
cache hits) and samples the server's RSS and the group's memory use every 10 s. Reports the RSS
slope (MB per hour, least squares over the second half of the run, after the allocator has
settled), peak group usage, OOM kills and request outcomes. Exit status 0 when no OOM kill
happened, the server lived, every answer was audio or a deliberate 503, and the slope is under
``--max-slope`` MB/hour.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import default_model  # noqa: E402
from benchmarks.serverproc import MemoryCgroup, Server  # noqa: E402
from chattts_service.runtime import heap  # noqa: E402

TEXTS = (
    "今天天气很好，我们一起去公园散步吧。",
    "The meeting starts at 3:30 pm on March 5.",
    "请把2024年的报告在周五之前发给我，谢谢。",
    "这是一段比较长的文字。" * 12,
    "Short one.",
)


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per hour."""
    n = len(points)
    if n < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / var * 3600


def heap_mb(url: str) -> dict[str, float]:
    """The worker's chatts_heap_bytes gauges, in MB (empty if the scrape failed)."""
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return {}
    return {
        sample.labels["kind"]: sample.value / 2**20
        for family in text_string_to_metric_families(text)
        if family.name == "chatts_heap_bytes"
        for sample in family.samples
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="default: the full random-weight model, built on first use",
    )
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--limit-mb", type=int, default=3072)
    parser.add_argument("--max-slope", type=float, default=50.0, help="MB per hour")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.model_dir = args.model_dir or default_model()

    cgroup = MemoryCgroup(args.limit_mb * 2**20)
    samples: list[tuple[float, float, int]] = []
    heap_samples: list[tuple[float, dict[str, float]]] = []
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as scratch:
        server = Server(args.model_dir, Path(scratch) / "server.log", cgroup)
        try:
            server.wait_ready()
            began = time.monotonic()
            deadline = began + args.minutes * 60
            counter = iter(range(10**9))

            def client():
                session = requests.Session()
                while time.monotonic() < deadline:
                    with lock:
                        index = next(counter)
                    body = {
                        "text": TEXTS[index % len(TEXTS)],
                        "seed": index % 50 if index % 5 == 0 else 10_000 + index,
                        "stream": index % 3 == 0,
                    }
                    try:
                        with session.post(
                            server.url + "/synthesize",
                            json=body,
                            timeout=300,
                            stream=body["stream"],
                        ) as response:
                            _ = response.content
                            status = str(response.status_code)
                    except requests.RequestException as error:
                        status = error.__class__.__name__
                    with lock:
                        outcomes[status] = outcomes.get(status, 0) + 1
                    if status == "503":
                        time.sleep(1)

            threads = [threading.Thread(target=client) for _ in range(args.clients)]
            for thread in threads:
                thread.start()
            while time.monotonic() < deadline:
                samples.append((time.monotonic() - began, server.rss_mb(), cgroup.usage()))
                figures = heap_mb(server.url)
                if figures:
                    heap_samples.append((samples[-1][0], figures))
                if not args.json:
                    elapsed, rss, usage = samples[-1]
                    heap_text = " ".join(
                        f"{kind} {figures[kind]:6.0f}" for kind in heap.KINDS if kind in figures
                    )
                    print(
                        f"{elapsed / 60:5.1f} min  RSS {rss:7.0f} MB  cgroup "
                        f"{usage / 2**20:7.0f} MB  heap MB: {heap_text}  {dict(outcomes)}",
                        flush=True,
                    )
                time.sleep(10)
            for thread in threads:
                thread.join()
            alive = server.process.poll() is None
        finally:
            server.stop()
            oom_kills, peak = cgroup.oom_kills(), cgroup.max_usage()
            cgroup.close()

    half_time = samples[-1][0] / 2
    second_half = [(t, rss) for t, rss, _ in samples if t >= half_time]
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "limit_mb": args.limit_mb,
        "rss_first_mb": samples[0][1],
        "rss_last_mb": samples[-1][1],
        "rss_max_mb": max(rss for _, rss, _ in samples),
        "rss_slope_mb_per_hour": slope_per_hour(second_half),
        "rss_slope_whole_run_mb_per_hour": slope_per_hour([(t, r) for t, r, _ in samples]),
        "heap_slopes_mb_per_hour": {
            kind: slope_per_hour(
                [
                    (t, figures[kind])
                    for t, figures in heap_samples
                    if t >= half_time and kind in figures
                ]
            )
            for kind in heap.KINDS
        },
        "heap_last_mb": heap_samples[-1][1] if heap_samples else {},
        "cgroup_peak_mb": peak / 2**20,
        "oom_kills": oom_kills,
        "server_alive": alive,
        "outcomes": outcomes,
    }
    bad = {k: v for k, v in outcomes.items() if k not in ("200", "503")}
    result["passed"] = (
        oom_kills == 0 and alive and not bad and result["rss_slope_mb_per_hour"] < args.max_slope
    )
    print(json.dumps(result, indent=None if args.json else 1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
