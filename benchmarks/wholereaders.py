"""What streaming by default costs clients that read the whole body anyway.

    python benchmarks/wholereaders.py [--model-dir DIR | --tiny] [--clients 8] [--seconds 60]
                                      [--rounds 2] [--format mp3] [--setting K=V] [--json]

``/v1/audio/speech`` streams unless a request says ``"stream": false``. Most OpenAI clients
(Open WebUI, n8n, Home Assistant) read the whole body before they play it, so for them the
stream only changes how the server decodes: in growing chunks as it generates instead of once
at the end. This runs ``--clients`` such readers (closed loop, a new seed every request, so
the cache stays out of it) against one server, alternating the kinds of request (whole:
``"stream": false``; default: no field; asked: ``"stream": true``, chunks from the first steps
on, as a client that plays as it receives asks), ``--rounds`` times each, ``--seconds`` per
phase, and reports for each the audio seconds made per wall second (from the server's own
``chatts_audio_seconds_total``) and the latency p50/p95, then the ratios of the medians to
whole answers. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import default_model  # noqa: E402
from benchmarks.loadtest import read_metrics  # noqa: E402
from benchmarks.overload import TEXTS  # noqa: E402
from benchmarks.serverproc import Server  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402


def audio_seconds_total(url: str) -> float:
    read = read_metrics(url, ["chatts_audio_seconds_total"], timeout=30)
    if read is None:
        raise RuntimeError("the server reports no chatts_audio_seconds_total")
    return read["chatts_audio_seconds_total"]


KINDS = {"whole": False, "default": None, "asked": True}  # the request's "stream" field


def phase(url: str, kind: str, args, first: int) -> dict:
    """Closed-loop whole-body readers for ``args.seconds``; seeds from ``first``."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    counter = iter(range(first, 10**9))
    deadline = time.monotonic() + args.seconds

    def reader():
        session = requests.Session()
        while time.monotonic() < deadline:
            with lock:
                index = next(counter)
            body = {
                "model": "tts-1",
                "voice": "alloy",
                "input": TEXTS[index % len(TEXTS)],
                "seed": index,
                "response_format": args.format,
            }
            if KINDS[kind] is not None:
                body["stream"] = KINDS[kind]
            started = time.perf_counter()
            try:
                response = session.post(url + "/v1/audio/speech", json=body, timeout=300)
                ok = response.status_code == 200 and len(response.content) > 0
            except requests.RequestException as error:
                ok, response = False, error
            with lock:
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    failures.append(str(getattr(response, "status_code", response)))

    before, began = audio_seconds_total(url), time.perf_counter()
    threads = [threading.Thread(target=reader) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    audio = audio_seconds_total(url) - before
    latencies.sort()
    return {
        "kind": kind,
        "requests": len(latencies),
        "failures": failures,
        "audio_per_wall": audio / wall,
        "p50": statistics.median(latencies) if latencies else None,
        "p95": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="default: models/full-random")
    parser.add_argument("--tiny", action="store_true", help="build and use the tiny model")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--format", default="mp3", choices=("mp3", "opus", "aac", "wav", "pcm"))
    parser.add_argument("--kinds", default="whole,default,asked", help="of " + ", ".join(KINDS))
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="CHATTTS_NAME=VALUE",
        help="a setting of the server (repeatable), e.g. CHATTTS_DEFAULT_STREAM=segments",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    settings = dict(setting.split("=", 1) for setting in args.setting)
    kinds = args.kinds.split(",")
    if "whole" not in kinds or not set(kinds) <= set(KINDS):
        parser.error(f"--kinds: some of {', '.join(KINDS)}, whole among them")
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            from chattts_service.tools.testmodel import build

            model = build(Path(scratch) / "tiny", size="tiny", seed=0)
        else:
            model = args.model_dir or default_model()
        server = Server(model, Path(scratch) / "server.log", **settings)
        try:
            server.wait_ready(timeout=600)
            phases, first = [], 0
            for _ in range(args.rounds):
                for kind in kinds:  # alternated: drift on a shared host hits every kind
                    result = phase(server.url, kind, args, first)
                    first += 100_000
                    phases.append(result)
                    if not args.json:
                        print(
                            f"{kind:8s} {result['requests']:4d} requests, "
                            f"{result['audio_per_wall']:.2f} audio s per wall s, p50 "
                            f"{result['p50']:.2f} s, p95 {result['p95']:.2f} s, "
                            f"failures {len(result['failures'])}"
                        )
        finally:
            server.stop()

    def median_of(kind: str, key: str) -> float:
        return statistics.median(p[key] for p in phases if p["kind"] == kind)

    summary = {"cpu": cpu_model(), "clients": args.clients, "format": args.format}
    summary["phases"] = phases
    for kind in kinds:
        summary[kind] = {
            "throughput_ratio": median_of(kind, "audio_per_wall")
            / median_of("whole", "audio_per_wall"),
            "p50_ratio": median_of(kind, "p50") / median_of("whole", "p50"),
        }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"CPU: {summary['cpu']}; medians against whole answers:")
        for kind in kinds:
            print(
                f"  {kind:8s} throughput {summary[kind]['throughput_ratio']:.3f}, "
                f"p50 latency {summary[kind]['p50_ratio']:.3f}"
            )
    return 0 if all(not p["failures"] for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
