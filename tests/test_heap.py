import os
from pathlib import Path

from benchmarks.engine import rss_mb
from chattts_service.runtime import heap


def test_heap_stats_follow_a_large_allocation():
    before = heap.stats()
    block = bytearray(64 * 2**20)  # above glibc's mmap threshold: an mmapped chunk
    during = heap.stats()
    del block
    after = heap.stats()
    assert during["mmapped"] - before["mmapped"] >= 64 * 2**20
    assert during["mmapped"] - after["mmapped"] >= 64 * 2**20


def test_release_returns_freed_heap_memory_to_the_os():
    # 1,500 blocks of 100 kB come from the arena (below the mmap threshold); the last one
    # stays alive on top of them, so glibc cannot shrink the heap by itself when they are freed
    blocks = [bytearray(b"x" * 100_000) for _ in range(1500)]
    pin = blocks.pop()
    del blocks
    held = heap.stats()["free"]
    before = rss_mb()["VmRSS"]
    heap.release()
    assert held >= 140_000_000
    assert (before - rss_mb()["VmRSS"]) * 2**20 >= 100_000_000
    assert pin[:1] == b"x"


GROWTH_PROBE = """
import sys, torch
from chattts_service.runtime import heap
linear = torch.nn.Linear(256, 1024)
def run(rows):
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        linear(torch.randn(1, rows, 256))
settle = heap.NATIVE_CACHE_ENTRIES + 16  # every entry taken, and then some
for rows in range(1, settle):
    run(rows)
before = heap.stats()["in_use"]
for rows in range(settle, settle + 400):  # 400 new lengths, as 400 requests would bring
    run(rows)
print((heap.stats()["in_use"] - before) / 2**20)
"""


def heap_growth_mb(environment: dict) -> float:
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", GROWTH_PROBE],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
        check=True,
    )
    return float(result.stdout.split()[-1])


def test_bounded_native_caches_stop_growth_with_new_shapes():
    """The decoders meet a new length with nearly every request; with the caches bounded the
    heap stays put instead of keeping something for each length."""
    environment = {k: v for k, v in os.environ.items() if k not in heap.NATIVE_CACHE_VARIABLES}
    environment["OMP_NUM_THREADS"] = "1"
    heap.bound_native_caches(environment)
    assert heap_growth_mb(environment) < 16


def test_bound_native_caches_leaves_operator_choices_alone():
    environment = {"LRU_CACHE_CAPACITY": "8"}
    heap.bound_native_caches(environment)
    assert environment == {
        "LRU_CACHE_CAPACITY": "8",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(heap.NATIVE_CACHE_ENTRIES),
    }


def _serves_malloc(pid: int) -> str:
    maps = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8")
    return "jemalloc" if "libjemalloc" in maps else "system"


def test_the_server_runs_on_jemalloc_unless_told_otherwise(start_server):
    import requests

    chosen = start_server()  # CHATTTS_ALLOCATOR=auto; script/test installs libjemalloc2
    system = start_server(CHATTTS_ALLOCATOR="system")
    for server, expected in ((chosen, "jemalloc"), (system, "system")):
        server.wait_ready()
        assert [_serves_malloc(pid) for pid in server.pids()] == [expected, expected]
        tasks = Path(f"/proc/{server.pids()[1]}/task")
        worker_threads = [path.read_text().strip() for path in tasks.glob("*/comm")]
        # the worker purges freed pages on a thread of its own, as its parent does
        assert ("jemalloc_bg_thd" in worker_threads) == (expected == "jemalloc")
        assert requests.get(server.url + "/status", timeout=5).json()["allocator"] == expected
        requests.post(server.url + "/synthesize", json={"text": "内存。"}, timeout=60)
        families = requests.get(server.url + "/metrics", timeout=5).text
        in_use = next(
            float(line.split()[-1])
            for line in families.splitlines()
            if line.startswith('chatts_heap_bytes{kind="in_use"}')
        )
        assert in_use > 50 * 2**20  # the model's live memory, counted by either allocator
