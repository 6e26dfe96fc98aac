"""Overload test: far more concurrent clients than the batch holds, for a few minutes.

    python benchmarks/overload.py [--model-dir DIR | --tiny] [--clients 32] [--seconds 180]
                                  [--slow-clients N]

Starts the server (loopback only) with its default settings unless overridden, then keeps
``--clients`` requests in flight (4x the default batch of 8) until ``--seconds`` have passed,
each with a new seed so the cache stays out of it, half of them streamed. It checks what the
service promises under overload: every answer is audio (a valid WAV) or a deliberate 503 with
Retry-After; no other 5xx; no reset or refused connection; and the accepted requests' p95
latency stays bounded. Exit status 0 only if all of that held. ``--json`` for a JSON object.

``--slow-clients N`` runs the same load twice on the same server, side by side: alone, then
with N idle connections, N that send their headers a line a second and N/10 that stop their
body halfway held open throughout (``benchmarks.slowclients``), and reports both.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
import wave
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import default_model  # noqa: E402
from benchmarks.serverproc import Server  # noqa: E402
from benchmarks.slowclients import SlowClients  # noqa: E402

TEXTS = (
    "今天天气很好，我们一起去公园散步吧。",
    "The train leaves at 9:45 from platform 3.",
    "请在下午三点之前把报告发给我，谢谢。",
)


def one(session: requests.Session, url: str, index: int, timeout: float) -> dict:
    stream = index % 2 == 1
    body = {"text": TEXTS[index % len(TEXTS)], "seed": 1000 + index, "stream": stream}
    started = time.perf_counter()
    try:
        with session.post(
            url + "/synthesize", json=body, timeout=timeout, stream=stream
        ) as response:
            payload = response.content  # a cut-off stream raises here
            status = response.status_code
            retry_after = response.headers.get("Retry-After")
    except requests.RequestException as error:
        return {
            "status": 0,
            "error": error.__class__.__name__,
            "stream": stream,
            "seconds": time.perf_counter() - started,
        }
    result = {"status": status, "stream": stream, "seconds": time.perf_counter() - started}
    if status == 200:
        try:
            if stream:  # open-ended header: the samples are what follows it
                valid = payload[:4] == b"RIFF" and len(payload) > 44 and len(payload) % 2 == 0
                result["audio_seconds"] = (len(payload) - 44) / 2 / 24_000
            else:
                with wave.open(io.BytesIO(payload)) as reader:
                    valid = reader.getframerate() == 24_000 and reader.getnframes() > 0
                    result["audio_seconds"] = reader.getnframes() / 24_000
        except (wave.Error, EOFError):
            valid = False
        result["valid"] = valid
    elif status == 503:
        result["retry_after"] = retry_after
    return result


def drive(
    url: str, clients: int, seconds: float, timeout: float, first: int = 0
) -> tuple[list[dict], float]:
    """Requests numbered from ``first`` (their seeds follow: a second run on the same server
    must start past the first's, or it would be answered from the cache)."""
    results: list[dict] = []
    lock = threading.Lock()
    counter = iter(range(first, 10**9))
    deadline = time.monotonic() + seconds

    def client():
        session = requests.Session()
        while time.monotonic() < deadline:
            with lock:
                index = next(counter)
            outcome = one(session, url, index, timeout)
            with lock:
                results.append(outcome)
            if outcome["status"] == 503:  # a well-behaved client backs off a little
                time.sleep(min(1.0, float(outcome.get("retry_after") or 1)))

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - began


def summarise(results: list[dict], wall: float, rss: list[float]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    latencies = sorted(r["seconds"] for r in ok)
    p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else None
    unexpected_5xx = sum(n for s, n in statuses.items() if s.startswith("5") and s != "503")
    summary = {
        "requests": len(results),
        "statuses": statuses,
        "ok": len(ok),
        "invalid_audio": sum(1 for r in ok if not r.get("valid")),
        "connection_errors": statuses.get("0", 0),
        "unexpected_5xx": unexpected_5xx,
        "503_without_retry_after": sum(
            1 for r in results if r["status"] == 503 and not r.get("retry_after")
        ),
        "latency_p50": statistics.median(latencies) if latencies else None,
        "latency_p95": p95,
        "latency_max": latencies[-1] if latencies else None,
        "audio_seconds_per_wall_second": sum(r.get("audio_seconds", 0) for r in ok) / wall,
        "wall_seconds": wall,
        "server_rss_mb_max": max(rss) if rss else None,
    }
    summary["passed"] = (
        summary["invalid_audio"] == 0
        and summary["connection_errors"] == 0
        and unexpected_5xx == 0
        and summary["503_without_retry_after"] == 0
        and len(ok) > 0
    )
    return summary


def run_phase(server: Server, args, mix: SlowClients | None, first: int) -> dict:
    """The ordinary load for ``args.seconds``, with the slow-client ``mix`` held open."""
    rss: list[float] = []
    sampling = threading.Event()

    def sample():
        while not sampling.wait(2.0):
            rss.append(server.rss_mb())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if mix is not None:
        with mix:
            time.sleep(1.0)  # every slow connection open before the load starts
            results, wall = drive(server.url, args.clients, args.seconds, args.timeout, first)
    else:
        results, wall = drive(server.url, args.clients, args.seconds, args.timeout, first)
    sampling.set()
    summary = summarise(results, wall, rss)
    if mix is not None:
        summary["slow_connections_opened"] = mix.opened
        summary["answers_to_slow_connections"] = mix.answers
        summary["passed"] = summary["passed"] and mix.answers.get("refused", 0) == 0
    return summary


def report(prefix: str, summary: dict, clients: int) -> None:
    print(
        f"{prefix}{summary['requests']} requests from {clients} clients in "
        f"{summary['wall_seconds']:.0f} s: statuses {summary['statuses']}"
    )
    print(
        f"{prefix}accepted: p50 {summary['latency_p50']:.2f} s, p95 "
        f"{summary['latency_p95']:.2f} s, max {summary['latency_max']:.2f} s; "
        f"{summary['audio_seconds_per_wall_second']:.2f} audio s per wall s"
    )
    print(
        f"{prefix}invalid audio {summary['invalid_audio']}, connection errors "
        f"{summary['connection_errors']}, other 5xx {summary['unexpected_5xx']}, "
        f"503 without Retry-After {summary['503_without_retry_after']}; "
        f"server RSS max {summary['server_rss_mb_max']:.0f} MB"
    )
    if "slow_connections_opened" in summary:
        print(
            f"{prefix}{summary['slow_connections_opened']} slow connections opened, "
            f"the server's answers to them: {summary['answers_to_slow_connections']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir", type=Path, help="default: models/full-random, built on first use"
    )
    parser.add_argument("--tiny", action="store_true", help="build and use the tiny model")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=180)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        help="CHATTTS_NAME=value for the server (repeatable)",
    )
    parser.add_argument(
        "--slow-clients", type=int, default=0, help="also run the load with this slow-client mix"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            from chattts_service.tools.testmodel import build

            model_dir = build(Path(scratch) / "tiny", size="tiny")
        else:
            model_dir = args.model_dir or default_model()
        settings = dict(item.split("=", 1) for item in args.setting)
        server = Server(model_dir, Path(scratch) / "server.log", **settings)
        try:
            ready = server.wait_ready()
            summaries = {}
            phases = ("alone", "with slow clients")[: 2 if args.slow_clients else 1]
            for number, phase in enumerate(phases):
                counts = (args.slow_clients, args.slow_clients, args.slow_clients // 10)
                mix = (
                    SlowClients("127.0.0.1", server.port, *counts, seconds=args.seconds + 30)
                    if phase != "alone"
                    else None
                )
                summaries[phase] = run_phase(server, args, mix, first=number * 10**6)
            summary = summaries["alone"]
            if args.slow_clients:
                summary["with_slow_clients"] = summaries["with slow clients"]
            summary.update(
                clients=args.clients,
                model_dir=str(model_dir),
                ready_seconds=ready,
                worker_alive=server.process.poll() is None,
            )
            summary["passed"] = (
                all(phase["passed"] for phase in summaries.values()) and summary["worker_alive"]
            )
        finally:
            server.stop()
    if args.json:
        print(json.dumps(summary))
    else:
        report("", summary, args.clients)
        if args.slow_clients:
            report("with slow clients: ", summary["with_slow_clients"], args.clients)
        print("PASSED" if summary["passed"] else "FAILED")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
