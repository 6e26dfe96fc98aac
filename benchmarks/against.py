"""This checkout's kernels against another revision's, on the same decode steps, side by side.

    python benchmarks/against.py REVISION|LIBRARY [--model-dir DIR] [--rows 1,2,4,8]
        [--steps 60] [--positions 40] [--tuning measure|table|default] [--json]

A kernel change is judged by a step's time before and after it, and on a shared 2-core machine
two runs minutes apart differ by more than most changes do. So both libraries are loaded into
one process: this checkout's (as ``python -m chattts_service.kernels.build`` builds it) and
REVISION's ``chattts_service/kernels/csrc`` compiled with this checkout's flags (or a LIBRARY
already built). The model's layers are packed once and both run them with the same tuning (by
default measured with this checkout's library, as the service measures it), on the same decode
steps: one step each in turn, the order swapped every step, so a noisy moment hits both alike.

For each row count: each side's median step, the ratio of the medians and the median of the
per-step ratios, and whether the two gave the same bits (every step's hidden states): a change
that should move no bits is checked on the full model as well. Libraries of another ABI
(``kernels/abi.py``) cannot share one process: it says so. Without ``--model-dir`` the
full-size random-weight model is used.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import RELEVANT_CPU_FLAGS, cpu_line, default_model  # noqa: E402
from chattts_service.runtime.cpu import (  # noqa: E402
    StealMeter,
    cpu_flags,
    cpu_model,
    describe_steal,
)

SOURCES = "chattts_service/kernels/csrc"


def revision_library(revision: str, directory: Path) -> Path:
    """``revision``'s kernel sources (from git) built with this checkout's flags into
    ``directory``; raise ``RuntimeError`` saying why not."""
    from chattts_service.kernels import build

    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", revision, SOURCES],
            capture_output=True,
            timeout=120,
        )
    except FileNotFoundError:
        raise RuntimeError(
            f"no kernel sources at {revision!r} here: a revision needs git (not installed) "
            "and this checkout's history; give a built library's path instead"
        ) from None
    if archive.returncode != 0:
        raise RuntimeError(
            f"no kernel sources at {revision!r} here: {archive.stderr.decode()[-500:].strip()}"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(directory, filter="data")
    return build.build(directory / "kernels-against.so", source=directory / SOURCES / "kernels.cpp")


def describe_revision(revision: str) -> str:
    """``revision`` with its commit's short hash, where git knows it."""
    try:
        named = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", revision],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError:
        return revision
    short = named.stdout.strip()
    return f"{revision} ({short})" if named.returncode == 0 and short != revision else revision


def compare(transformer, sides: dict, rows: int, steps: int, positions: int) -> dict:
    """Both sides' decode steps for ``rows`` rows after a ``positions``-long prompt each:
    the same inputs, one step each in turn, the order swapped every step."""
    import torch

    from chattts_service.kernels.bindings import StepRows

    names = list(sides)
    generator = torch.Generator().manual_seed(rows)
    caches = {name: [] for name in names}
    for _ in range(rows):  # the prompts run on this checkout's kernels: the same caches
        prompt = torch.randn(positions, transformer.hidden_size, generator=generator) * 0.1
        for name in names:
            cache = transformer.new_cache(positions + steps + 1)
            transformer.prefill(prompt, cache)
            caches[name].append(cache)
    lengths = [positions] * rows
    times = {name: [] for name in names}
    same_bits, largest_difference = True, 0.0
    with torch.inference_mode():
        for step in range(steps):
            x = torch.randn(rows, transformer.hidden_size, generator=generator) * 0.1
            outputs = {}
            for name in names if step % 2 == 0 else names[::-1]:
                y = x.clone()
                step_rows = StepRows(caches[name], lengths)
                started = time.perf_counter()
                outputs[name] = sides[name](y, step_rows)
                times[name].append(time.perf_counter() - started)
            ours, theirs = (outputs[name] for name in names)
            if not torch.equal(ours.view(torch.int32), theirs.view(torch.int32)):
                same_bits = False
                largest_difference = max(largest_difference, (ours - theirs).abs().max().item())
            lengths = [length + 1 for length in lengths]
    ours, theirs = (times[name] for name in names)
    return {
        "rows": rows,
        "ms": statistics.median(ours) * 1e3,
        "against_ms": statistics.median(theirs) * 1e3,
        "ratio": statistics.median(ours) / statistics.median(theirs),
        "step_ratio": statistics.median(a / b for a, b in zip(ours, theirs)),
        "same_bits": same_bits,
        "largest_difference": largest_difference,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("against", help="a git revision, or a kernel library's path")
    parser.add_argument("--model-dir", type=Path, help="model to measure on")
    parser.add_argument("--rows", default="1,2,4,8", help="row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=60, help="decode steps a row count")
    parser.add_argument("--positions", type=int, default=40, help="each row's prompt length")
    parser.add_argument("--tuning", default="measure", choices=("measure", "table", "default"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        row_counts = [int(value) for value in args.rows.split(",") if value]
    except ValueError:
        parser.error(f"--rows takes whole numbers, not {args.rows!r}")
    if not row_counts or min(row_counts) < 1 or args.steps < 1 or args.positions < 1:
        parser.error("--rows, --steps and --positions must be at least 1")

    import torch

    from chattts_service.inference.gpt_weights import GptWeights
    from chattts_service.inference.transformer import Transformer
    from chattts_service.kernels import abi, bindings, tuning

    model_dir = args.model_dir or default_model()
    transformer = Transformer(GptWeights(model_dir / "asset" / "gpt"), "int8", "on")
    if transformer.decode_layers is None:
        print("error: this model's layers do not run in the kernels' decode step", file=sys.stderr)
        return 2
    ours = transformer.kernels
    with tempfile.TemporaryDirectory() as scratch:
        given = Path(args.against)
        try:
            if given.is_file():
                path, label = given, str(given)
            else:
                path = revision_library(args.against, Path(scratch))
                label = describe_revision(args.against)
            theirs = bindings.Kernels(path, ours.int8_instructions)
        except abi.AbiMismatch as error:
            print(
                f"error: {args.against}'s kernels have another ABI, so they cannot share this "
                f"process: {error}",
                file=sys.stderr,
            )
            return 2
        except (RuntimeError, OSError, subprocess.SubprocessError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        choice = tuning.choose(ours, transformer.kernel_packings(), args.tuning, None)
        theirs.tuning = ours.tuning  # the same struct: the ABIs match
        rival = copy.copy(transformer.decode_layers)  # the same packed layers, their kernels
        rival.kernels = theirs
        sides = {"this checkout": transformer.decode_layers, label: rival}
        steal = StealMeter()
        results = [
            compare(transformer, sides, rows, args.steps, args.positions) for rows in row_counts
        ]
        stolen = steal.share()
    data = {
        "cpu": cpu_model(),
        "cpu_flags": sorted(RELEVANT_CPU_FLAGS & cpu_flags()),
        "threads": torch.get_num_threads(),
        "against": label,
        "tuning": choice.describe(),
        "steps": args.steps,
        "positions": args.positions,
        "rows": results,
        "steal_share": stolen,
    }
    if args.json:
        print(json.dumps(data, indent=1))
        return 0
    print(cpu_line(data))
    print(
        f"this checkout's kernels against {label}'s, {args.steps} decode steps a row count "
        f"after {args.positions}-position prompts, alternated; {data['threads']} threads; "
        f"tuning: {data['tuning']}"
    )
    print("rows  this (ms)  against (ms)  ratio  per-step ratio  same bits")
    for result in results:
        bits = "yes" if result["same_bits"] else f"no (up to {result['largest_difference']:.3g})"
        print(
            f"{result['rows']:>4}  {result['ms']:9.2f}  {result['against_ms']:12.2f}  "
            f"{result['ratio']:5.3f}  {result['step_ratio']:14.3f}  {bits}"
        )
    print(describe_steal(stolen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
