"""Time from ``python server.py`` to a ready service: the first start (nothing kept: no packed
GPT, no tokenizer snapshot, no kernel tuning) and restarts, on the tiny and the full-size
random-weight models.

Each run is a real server process on loopback, timed from its spawn to the instant its log says
it is ready (the line written as readiness turns on; ``/readyz`` is polled every 100 ms to
confirm it, gently: a tight poll takes the starting worker's interpreter away from the start);
the phases come from the same log (model load, warm-up). Python writes bytecode as it would for
any user (the restarts read it). The targets: ready within 3 s (tiny) and 5 s (full) of
process start, as the median of restarts.

    .venv/bin/python benchmarks/coldstart.py [--restarts 5] [--sizes tiny,full]

Run it alone: on 2 cores anything else running distorts start times several-fold.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serverproc import Server  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402
from chattts_service.tools.testmodel import build  # noqa: E402

TARGETS = {"tiny": 3.0, "full": 5.0}
LOADED = re.compile(r"loaded from .* in ([\d.]+)s")
WARMED = re.compile(r"warm-up of \d+ texts? took ([\d.]+)s")
PACKED = re.compile(r"packed GPT kept in")
READY = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: ready [\d.]+s after start", re.M
)


def ready_instant(log: str) -> float:
    """The wall-clock time of the server's "ready" line."""
    found = READY.search(log)
    if found is None:
        raise RuntimeError(f"no ready line in the log:\n{log[-4000:]}")
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def one_start(model_dir: Path, log_path: Path) -> dict:
    started, spawned = time.monotonic(), time.time()
    server = Server(model_dir, log_path, PYTHONDONTWRITEBYTECODE="")
    try:
        while True:
            if server.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{server.log()[-4000:]}")
            try:
                if requests.get(server.url + "/readyz", timeout=1).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):
                pass
            if time.monotonic() - started > 300:
                raise TimeoutError(f"not ready in 300 s:\n{server.log()[-4000:]}")
            time.sleep(0.1)
        ready = ready_instant(log_path.read_text(errors="replace")) - spawned
        answer = requests.post(server.url + "/synthesize", json={"text": "Hello."}, timeout=120)
        answer.raise_for_status()
    finally:
        server.stop()
    log = log_path.read_text(errors="replace")
    load, warm = LOADED.search(log), WARMED.search(log)
    return {
        "ready": ready,
        "load": float(load.group(1)) if load else float("nan"),
        "warm": float(warm.group(1)) if warm else float("nan"),
        "packed": bool(PACKED.search(log)),
    }


def bench(size: str, restarts: int, work: Path) -> list[str]:
    model_dir = build(work / size, size=size, seed=0)  # a fresh copy: nothing cached yet
    runs = []
    for index in range(restarts + 1):
        runs.append(one_start(model_dir, work / f"{size}-{index}.log"))
    first, later = runs[0], runs[1:]
    median = statistics.median(run["ready"] for run in later)
    target = TARGETS[size]
    lines = [
        f"{size:5} first start (nothing cached)  ready {first['ready']:5.2f} s  (load "
        f"{first['load']:.2f} s, warm-up {first['warm']:.2f} s, packed GPT written: "
        f"{'yes' if first['packed'] else 'no'})",
    ]
    for number, run in enumerate(later, start=1):
        lines.append(
            f"{size:5} restart {number}                  ready {run['ready']:5.2f} s  (load "
            f"{run['load']:.2f} s, warm-up {run['warm']:.2f} s)"
        )
    verdict = "ok" if median <= target else "MISSED"
    lines.append(f"{size:5} restart median {median:.2f} s (target <= {target:.0f} s): {verdict}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--sizes", default="tiny,full")
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    work = Path(tempfile.mkdtemp(prefix="coldstart-"))
    try:
        for size in args.sizes.split(","):
            for line in bench(size, args.restarts, work):
                print(line, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
