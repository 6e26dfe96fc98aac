"""The int8 product's prefetching candidates on this CPU, side by side (for ``tuning.TABLE``).

    python benchmarks/tuning.py [--model-dir DIR] [--rounds N] [--prefetch 16/nta,128/t0,...]

Times one pass of the int8 product over the model's packed layers at 1 and 8 rows for every
candidate of ``chattts_service.kernels.tuning``, interleaved, medians of ``--rounds`` (then,
for every product, the chosen prefetch or none at 1, 2 and 4 rows; for the VNNI product, that
choice with blocks in pairs or not at 1 and 8 rows, four at a time or not at 1, 2 and 4 rows,
eight at a time or not at 1 and 2 rows, and with AMX on tiles or not at 2 to 32 rows); prints
the CPU, the figures, what ``CHATTTS_KERNEL_TUNING=measure`` would choose, and the table entry
that records it. Without ``--model-dir`` the full-size random-weight model is used.
``--prefetch`` times other prefetch candidates in place of the service's (distances in 64-byte
groups ahead, up to 256, and the hint; the first is the one the others must beat by 5%), to
see whether a distance the service does not try would pay on this CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.engine import default_model  # noqa: E402  (after the path is set)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="model to measure on")
    parser.add_argument("--rounds", type=int, default=7, help="passes per candidate and rows")
    parser.add_argument(
        "--prefetch",
        help="prefetch candidates instead of the service's: GROUPS/HINT,... (e.g. 16/nta,128/t0)",
    )
    args = parser.parse_args(argv)

    import torch

    from chattts_service.inference.gpt_weights import GptWeights
    from chattts_service.inference.transformer import Transformer
    from chattts_service.kernels import tuning
    from chattts_service.runtime.cpu import StealMeter, describe_steal

    model_dir = args.model_dir or default_model()
    transformer = Transformer(GptWeights(model_dir / "asset" / "gpt"), "int8", "on")
    packings = transformer.kernel_packings()
    megabytes = sum(packing.nbytes for packing in packings) / 1e6
    identity = tuning.cpu_identity()
    interesting = [f for f in identity["flags"] if f.startswith(("avx2", "avx512", "amx"))]
    print(
        f"cpu {identity['name']} ({identity['vendor']} family {identity['family']} model "
        f"{identity['model']}); flags: {' '.join(interesting) or 'none of interest'}"
    )
    print(
        f"{transformer.linear_kernel} product over {megabytes:.0f} MB of int8 layers, "
        f"{torch.get_num_threads()} threads, medians of {args.rounds}"
    )
    candidates = tuning.CANDIDATES
    if args.prefetch:
        try:
            candidates = tuning.parse_candidates(args.prefetch)
        except ValueError as error:
            parser.error(str(error))
    steal = StealMeter()
    best, report = tuning.measure(transformer.kernels, packings, args.rounds, candidates)
    stolen = steal.share()
    print("prefetch distance/hint/pairs from, a pass over the layers:")
    sections = (
        "ms_per_pass",
        "bare_ms_per_pass",
        "pairing_ms_per_pass",
        "quads_ms_per_pass",
        "octs_ms_per_pass",
    )
    for section in (*sections, "tiles_ms_per_pass"):
        for name, by_rows in report.get(section, {}).items():
            figures = "  ".join(
                f"{rows} rows {ms:7.2f} ms ({megabytes / ms:5.1f} GB/s)"
                for rows, ms in by_rows.items()
            )
            print(f"  {name:>17}  {figures}")
    print(f"measure would choose: {best.describe()}")
    print(
        f"TABLE entry: ({identity['vendor']!r}, {identity['family']}, {identity['model']}): "
        f"KernelTuning({best.prefetch_groups}, {best.prefetch_hint!r}, {best.pair_blocks_from}, "
        f"{best.tiles_from}, {best.quads_up_to}, {best.octs_up_to}, {best.bare_up_to})"
    )
    print(describe_steal(stolen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
