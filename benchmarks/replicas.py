"""Replicas on one host: memory per replica and in total for 1..N replicas, and throughput
through nginx (the shipped configuration) for 1 vs 2 replicas.

    python benchmarks/replicas.py [--model-dir DIR] [--max-replicas 3] [--seconds 60]

Memory: each replica's RSS, its PSS (shared pages divided among the processes sharing them)
and its private memory, from /proc/PID/smaps_rollup once every replica is ready, and the host's
used memory (MemTotal - MemAvailable) against the same reading with no replica. Throughput:
``--clients`` clients (new seeds, so no cache hits; the overload script's mix, half of them
streamed) through nginx for ``--seconds``, with the CPUs split evenly among the replicas
(affinity set before torch loads) and torch threads set to match. ``--max-replicas 2`` for the
throughput comparison alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import default_model  # noqa: E402
from benchmarks.overload import drive, summarise  # noqa: E402
from benchmarks.serverproc import Nginx, Server  # noqa: E402


def meminfo_used_mb() -> float:
    values = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0])
    return (values["MemTotal"] - values["MemAvailable"]) / 1024


def rollup(pid: int) -> dict[str, float]:
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) / 1024
    return {
        "rss": values["Rss"],
        "pss": values["Pss"],
        "private": values["Private_Clean"] + values["Private_Dirty"],
        "shared": values["Shared_Clean"] + values["Shared_Dirty"],
    }


def start_replicas(model_dir: Path, count: int, scratch: Path, cpus: list[int]) -> list[Server]:
    share = max(1, len(cpus) // count)
    servers = []
    for index in range(count):
        mine = cpus[index * share : (index + 1) * share] or cpus
        server = Server(
            model_dir, scratch / f"replica-{count}-{index}.log", CHATTTS_THREADS=str(len(mine))
        )
        os.sched_setaffinity(server.process.pid, mine)  # before it imports torch
        servers.append(server)
    for server in servers:
        server.wait_ready()
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="default: the full random-weight model, built on first use",
    )
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.model_dir = args.model_dir or default_model()
    cpus = sorted(os.sched_getaffinity(0))
    result = {"cpus": len(cpus), "memory": {}, "throughput": {}}

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        baseline = meminfo_used_mb()
        for count in range(1, args.max_replicas + 1):
            servers = start_replicas(args.model_dir, count, scratch, cpus)
            try:
                time.sleep(2)
                per = []
                for server in servers:
                    totals = {"rss": 0.0, "pss": 0.0, "private": 0.0, "shared": 0.0}
                    for pid in server.pids():
                        for key, value in rollup(pid).items():
                            totals[key] += value
                    per.append({k: round(v) for k, v in totals.items()})
                result["memory"][count] = {
                    "replicas": per,
                    "host_used_mb": round(meminfo_used_mb() - baseline),
                }
                if count <= 2:
                    proxy = Nginx(scratch / f"nginx-{count}", [s.port for s in servers])
                    url = proxy.url
                    try:
                        drive(url, 2, 5, 120)  # warm the path
                        # clients keep going until --seconds, then in-flight requests finish
                        outcomes, wall = drive(url, args.clients, args.seconds, 300)
                    finally:
                        proxy.stop()
                    run = summarise(outcomes, wall, [])
                    result["throughput"][count] = {
                        k: run[k]
                        for k in (
                            "requests",
                            "statuses",
                            "latency_p50",
                            "latency_p95",
                            "audio_seconds_per_wall_second",
                        )
                    }
            finally:
                for server in servers:
                    server.stop()
            time.sleep(2)

    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['cpus']} CPUs; memory once ready (MB):")
    for count, memory in result["memory"].items():
        rows = "; ".join(
            f"RSS {r['rss']} PSS {r['pss']} private {r['private']}" for r in memory["replicas"]
        )
        print(f"  {count} replica(s): {rows}; host used +{memory['host_used_mb']}")
    for count, run in result["throughput"].items():
        print(
            f"  {count} replica(s) through nginx, {args.clients} clients: "
            f"{run['audio_seconds_per_wall_second']:.2f} audio s per wall s, "
            f"p50 {run['latency_p50']:.2f} s, p95 {run['latency_p95']:.2f} s, "
            f"statuses {run['statuses']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
