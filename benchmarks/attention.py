"""A decode step's attention alone: how fast it reads the KV caches, against a plain read.

    python benchmarks/attention.py [--shapes 1x105,8x105,8x300,16x105] [--rounds N]

For each ROWSxPOSITIONS, fills that many requests' caches (the full-size GPT's 20 layers, 12
heads of 64; bf16, or int8 with ``--kv-cache-dtype int8``; reserved for ``--reserve`` positions
as the engine reserves a request's worst case), then times the attention kernel over all 20
layers for one step, with every cache evicted before each call (a step's 190 MB of weights
sweep the caches between two of its attentions), medians of ``--rounds``. Those are 20 calls
from Python, where an engine step attends from its one call for all layers: their fixed cost,
timed on empty caches, is printed and taken off. Prints the CPU, the milliseconds and the rate
the caches were read at, beside a read-only loop over the same bytes (``Kernels.read``, copies
of the caches: one stream a thread), so the two compare on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import RELEVANT_CPU_FLAGS, cpu_line  # noqa: E402
from chattts_service.runtime.cpu import (  # noqa: E402
    StealMeter,
    cpu_flags,
    cpu_model,
    describe_steal,
)

LAYERS, HEADS, DIM = 20, 12, 64  # ChatTTS's GPT
EVICT_MB = 400  # more than any last-level cache this runs on


def measure(kernels, rows: int, positions: int, reserve: int, dtype, rounds: int) -> dict:
    import torch

    from chattts_service.inference.transformer import KVCache
    from chattts_service.kernels import bindings

    generator = torch.Generator().manual_seed(rows * 1000 + positions)
    caches = []
    with torch.inference_mode():
        for _ in range(rows):
            cache = KVCache(LAYERS, HEADS, DIM, reserve=max(reserve, positions + 1), dtype=dtype)
            for layer in range(LAYERS):
                cache.write(
                    layer,
                    0,
                    torch.randn(HEADS, positions, DIM, generator=generator),
                    torch.randn(HEADS, positions, DIM, generator=generator),
                )
            caches.append(cache)
    q, k, v = (torch.randn(rows, HEADS, DIM, generator=generator) for _ in range(3))
    out = torch.empty(rows, HEADS, 1, DIM)
    step = bindings.StepRows(caches, [positions] * rows)
    # what the 20 calls cost with next to nothing to read (each row's cache empty: the new
    # token alone): Python's and ctypes' share of each call, which a step does not pay (its
    # layers run in one call)
    empty = [KVCache(LAYERS, HEADS, DIM, reserve=16, dtype=dtype) for _ in range(rows)]
    empty_step = bindings.StepRows(empty, [0] * rows)
    evict = torch.ones(EVICT_MB * 250_000)
    # what a step reads, copied out as plain buffers: every position's key and value of every
    # layer (and their scales, for int8)
    plain = [
        tensor.transpose(1, 2)[:, : positions + 1].contiguous()
        for cache in caches
        for tensor in (cache.keys, cache.values, cache.key_scales, cache.value_scales)
        if tensor is not None
    ]
    megabytes = sum(tensor.numel() * tensor.element_size() for tensor in plain) / 1e6
    times, reads, calls = [], [], []
    with torch.inference_mode():
        for index in range(rounds + 2):  # two untimed: threads started, pages touched
            started = time.perf_counter()
            for layer in range(LAYERS):
                kernels.attention(layer, q, k, v, empty_step, out, 1 / math.sqrt(DIM))
            call = time.perf_counter() - started
            evict.sum()
            started = time.perf_counter()
            for layer in range(LAYERS):
                kernels.attention(layer, q, k, v, step, out, 1 / math.sqrt(DIM))
            elapsed = time.perf_counter() - started
            evict.sum()
            started = time.perf_counter()
            kernels.read(plain)
            read = time.perf_counter() - started
            if index >= 2:
                times.append(elapsed)
                reads.append(read)
                calls.append(call)
    milliseconds = statistics.median(times) * 1e3
    read_ms = statistics.median(reads) * 1e3
    calls_ms = statistics.median(calls) * 1e3
    net_ms = max(milliseconds - calls_ms, 1e-6)
    return {
        "rows": rows,
        "positions": positions,
        "megabytes": megabytes,
        "ms": milliseconds,
        "gb_per_s": megabytes / milliseconds,
        "calls_ms": calls_ms,
        "net_ms": net_ms,
        "net_gb_per_s": megabytes / net_ms,
        "read_ms": read_ms,
        "read_gb_per_s": megabytes / read_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="1x105,8x105,8x300,16x105", help="ROWSxPOSITIONS,...")
    parser.add_argument("--reserve", type=int, default=2048, help="positions each cache reserves")
    parser.add_argument("--kv-cache-dtype", default="bf16", choices=("bf16", "int8"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from chattts_service.kernels import bindings

    kernels = bindings.load("on")
    dtype = torch.bfloat16 if args.kv_cache_dtype == "bf16" else torch.int8
    data = {
        "cpu": cpu_model(),
        "cpu_flags": sorted(RELEVANT_CPU_FLAGS & cpu_flags()),
        "threads": torch.get_num_threads(),
        "kv_cache_dtype": args.kv_cache_dtype,
        "shapes": [],
    }
    steal = StealMeter()
    for shape in (value for value in args.shapes.split(",") if value):
        rows, positions = (int(part) for part in shape.split("x"))
        data["shapes"].append(measure(kernels, rows, positions, args.reserve, dtype, args.rounds))
    data["steal_share"] = steal.share()
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(cpu_line(data))
    print(
        f"{args.kv_cache_dtype} KV cache, {LAYERS} layers x {HEADS} heads x {DIM}, "
        f"{data['threads']} threads, caches evicted before each call, medians of {args.rounds}"
    )
    for shape in data["shapes"]:
        print(
            f"{shape['rows']:>3} rows x {shape['positions']:>4} positions: attention "
            f"{shape['ms']:.2f} ms ({shape['gb_per_s']:.1f} GB/s), less the calls' own "
            f"{shape['calls_ms']:.2f} ms {shape['net_ms']:.2f} ms ({shape['net_gb_per_s']:.1f} "
            f"GB/s); reading as many "
            f"{shape['megabytes']:.0f} MB alone {shape['read_ms']:.2f} ms "
            f"({shape['read_gb_per_s']:.1f} GB/s)"
        )
    print(describe_steal(data["steal_share"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
