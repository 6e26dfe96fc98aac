"""Soak test: steady load for a long time under the compose file's 3 GiB memory limit.

    python benchmarks/soak.py [--model-dir DIR] [--minutes 30] [--clients 8] [--limit-mb 3072]
                              [--samples soak.csv] [--plot soak.svg]

Runs the server (loopback) inside a cgroup v1 memory group limited like the compose file, keeps
``--clients`` requests in flight and samples the server's RSS, the group's memory use and the
allocator's counts every 10 s. The requests rotate through every route and kind of answer
(``MIX``): whole WAV, AAC and FLAC; streamed PCM, MP3 and Opus; Server-Sent Events; captions;
long texts of several segments; cache hits; a voice registered, used and deleted; and, from a
side thread, the probes, metrics, status, models, voices, playground, OpenAPI and admin routes,
with an idle and a slow-header connection now and then. Reports the RSS slope (MB per hour,
least squares over the second half of the run, after the allocator has settled), peak group
usage, OOM kills and request outcomes per kind. Exit status 0 when no OOM kill happened, the
server lived, every answer was the one expected (audio, a deliberate 503) and the slope is under
``--max-slope`` MB/hour.
"""

from __future__ import annotations

import argparse
import json
import socket
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
# several segments of CHATTTS_MAX_SEGMENT_CHARS each, generated together
LONG_TEXT = "第一句话讲的是天气。第二句话讲的是交通，路上车很多。" * 8 + "The end, at 5:45 pm."


def _speech(body: dict) -> tuple[str, dict]:
    return "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", **body}


# (name, route and body for a request numbered i, streamed); every kind of answer the service
# gives, in turn
MIX = (
    ("wav", lambda i, text: ("/synthesize", {"text": text}), False),
    (
        "pcm-stream",
        lambda i, text: ("/synthesize", {"text": text, "format": "pcm", "stream": True}),
        True,
    ),
    ("mp3-stream", lambda i, text: _speech({"input": text, "stream": True}), True),
    (
        "opus-stream",
        lambda i, text: _speech({"input": text, "response_format": "opus", "stream": True}),
        True,
    ),
    ("sse", lambda i, text: _speech({"input": text, "stream_format": "sse"}), True),
    (
        "captions",
        lambda i, text: (
            "/v1/audio/captioned_speech",
            {"model": "tts-1", "voice": "echo", "input": text, "caption_format": "srt"},
        ),
        False,
    ),
    ("long-mp3", lambda i, text: ("/synthesize", {"text": LONG_TEXT, "format": "mp3"}), False),
    ("aac", lambda i, text: _speech({"input": text, "response_format": "aac"}), False),
    (
        "flac-blend",
        lambda i, text: _speech(
            {"input": text, "response_format": "flac", "voice": "alloy(2)+nova(1)"}
        ),
        False,
    ),
    ("cache-hit", lambda i, text: ("/synthesize", {"text": TEXTS[i % 2], "seed": i % 3}), False),
)
SIDE_ROUTES = (
    "/healthz",
    "/readyz",
    "/metrics",
    "/status",
    "/v1/models",
    "/v1/audio/voices",
    "/",
    "/openapi.json",
    "/admin/config",
)
# the answers that count as right: audio, a deliberate 503, and the admin route refusing
# without keys configured
EXPECTED = {"200", "201", "503", "403"}


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
    parser.add_argument("--max-slope", type=float, default=10.0, help="MB per hour")
    parser.add_argument("--samples", type=Path, help="write the samples here (CSV)")
    parser.add_argument("--plot", type=Path, help="draw RSS and the heap over time here (SVG)")
    parser.add_argument(
        "--allocator",
        choices=("auto", "jemalloc", "system"),
        default="auto",
        help="the server's CHATTTS_ALLOCATOR",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.model_dir = args.model_dir or default_model()

    cgroup = MemoryCgroup(args.limit_mb * 2**20)
    samples: list[tuple[float, float, int]] = []
    heap_samples: list[tuple[float, dict[str, float]]] = []
    outcomes: dict[str, int] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as scratch:
        server = Server(
            args.model_dir,
            Path(scratch) / "server.log",
            cgroup,
            CHATTTS_ALLOCATOR=args.allocator,
            CHATTTS_VOICES_DIR=str(Path(scratch) / "voices"),
        )
        try:
            server.wait_ready()
            began = time.monotonic()
            deadline = began + args.minutes * 60
            counter = iter(range(10**9))

            def count(kind: str, status: str) -> None:
                with lock:
                    outcomes.setdefault(kind, {})
                    outcomes[kind][status] = outcomes[kind].get(status, 0) + 1

            def send(session, kind, method, route, body=None, stream=False) -> str:
                try:
                    with session.request(
                        method, server.url + route, json=body, timeout=300, stream=stream
                    ) as response:
                        _ = response.content
                        status = str(response.status_code)
                except requests.RequestException as error:
                    status = error.__class__.__name__
                count(kind, status)
                return status

            def client():
                session = requests.Session()
                while time.monotonic() < deadline:
                    with lock:
                        index = next(counter)
                    kind, make, stream = MIX[index % len(MIX)]
                    route, body = make(index, TEXTS[index % len(TEXTS)])
                    body.setdefault("seed", 10_000 + index)
                    if index % (len(MIX) * 3) == 1:  # now and then, a voice of its own
                        name = f"soak-{index}"
                        voice = {"name": name, "voice": f"seed:{index}"}
                        send(session, "voice-add", "POST", "/v1/audio/voices", voice)
                        body = {"model": "tts-1", "voice": name, "input": TEXTS[0]}
                        route, kind, stream = "/v1/audio/speech", "voice-use", False
                        status = send(session, kind, "POST", route, body, stream)
                        send(session, "voice-delete", "DELETE", f"/v1/audio/voices/{name}")
                    else:
                        status = send(session, kind, "POST", route, body, stream)
                    if status == "503":
                        time.sleep(1)

            def side():
                """The other routes, and connections that idle or send their headers slowly."""
                session = requests.Session()
                for index in range(10**9):
                    if time.monotonic() >= deadline:
                        return
                    route = SIDE_ROUTES[index % len(SIDE_ROUTES)]
                    send(session, "get" + route, "GET", route)
                    if index % 20 == 0:
                        idle = socket.create_connection(("127.0.0.1", server.port))
                        slow = socket.create_connection(("127.0.0.1", server.port))
                        slow.sendall(b"GET /healthz HTTP/1.1\r\n")
                        time.sleep(1)
                        idle.close()
                        slow.close()
                    time.sleep(1)

            threads = [threading.Thread(target=client) for _ in range(args.clients)]
            threads.append(threading.Thread(target=side))
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
                    with lock:
                        done = sum(sum(by.values()) for by in outcomes.values())
                    print(
                        f"{elapsed / 60:5.1f} min  RSS {rss:7.0f} MB  cgroup "
                        f"{usage / 2**20:7.0f} MB  heap MB: {heap_text}  requests {done}",
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
    bad = {
        kind: statuses
        for kind, statuses in outcomes.items()
        if set(statuses) - EXPECTED or (not kind.startswith("get/admin") and "403" in statuses)
    }
    result["unexpected"] = bad
    result["requests"] = sum(sum(by.values()) for by in outcomes.values())
    result["passed"] = (
        oom_kills == 0 and alive and not bad and result["rss_slope_mb_per_hour"] < args.max_slope
    )
    if args.samples:
        write_samples(args.samples, samples, heap_samples)
    if args.plot:
        args.plot.write_text(plot(samples, heap_samples, result), encoding="utf-8")
    print(json.dumps(result, indent=None if args.json else 1))
    return 0 if result["passed"] else 1


def write_samples(path: Path, samples, heap_samples) -> None:
    heap_at = dict(heap_samples)
    lines = ["seconds,rss_mb,cgroup_mb," + ",".join(f"heap_{kind}_mb" for kind in heap.KINDS)]
    for elapsed, rss, usage in samples:
        figures = heap_at.get(elapsed, {})
        kinds = ",".join(f"{figures[kind]:.1f}" if kind in figures else "" for kind in heap.KINDS)
        lines.append(f"{elapsed:.0f},{rss:.1f},{usage / 2**20:.1f},{kinds}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def plot(samples, heap_samples, result, width=720, height=300) -> str:
    """RSS, the cgroup's usage and the allocator's in-use and free memory against time, as an
    SVG with no dependencies."""
    left, right, top, bottom = 60, 150, 20, 40
    series = {
        "RSS": ("#d62728", [(t, rss) for t, rss, _ in samples]),
        "cgroup": ("#7f7f7f", [(t, usage / 2**20) for t, _, usage in samples]),
        "heap in use": ("#1f77b4", [(t, f["in_use"] + f["mmapped"]) for t, f in heap_samples]),
        "heap free, kept": ("#2ca02c", [(t, f["free"]) for t, f in heap_samples]),
    }
    t_max = max(t for t, *_ in samples) or 1
    v_max = max(v for _, points in series.values() for _, v in points) * 1.1 or 1
    step = 10 ** len(str(int(v_max / 5))) / 10 * 2 or 1

    def x(t):
        return left + (width - left - right) * t / t_max

    def y(v):
        return top + (height - top - bottom) * (1 - v / v_max)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    value = 0.0
    while value <= v_max:
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
            'stroke="#ddd"/>'
            f'<text x="{left - 5}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.0f}</text>'
        )
        value += step
    for minute in range(0, int(t_max / 60) + 1, max(1, int(t_max / 60 / 8))):
        parts.append(
            f'<text x="{x(minute * 60):.1f}" y="{height - bottom + 15}" '
            f'text-anchor="middle">{minute}</text>'
        )
    parts.append(
        f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">'
        f"minutes (RSS slope over the second half: "
        f"{result['rss_slope_mb_per_hour']:.1f} MB/h)</text>"
        f'<text x="12" y="{top + 100}" transform="rotate(-90 12 {top + 100})">MB</text>'
    )
    for row, (name, (colour, points)) in enumerate(series.items()):
        if not points:
            continue
        path = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in points)
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>'
        )
        parts.append(
            f'<line x1="{width - right + 10}" x2="{width - right + 30}" y1="{top + 15 * row}" '
            f'y2="{top + 15 * row}" stroke="{colour}" stroke-width="2"/>'
            f'<text x="{width - right + 35}" y="{top + 15 * row + 4}">{name}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
