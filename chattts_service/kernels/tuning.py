"""How the int8 and int4 products stream their weights, chosen for the CPU they run on.

A decode step reads every weight once, so how far ahead the product prefetches and with which
hint decides how near it gets to the memory's bandwidth, and the best differs from one CPU (and
memory system) to the next: a non-temporal prefetch that suits a Zen 3 halves what an Intel
Xeon (family 6 model 207) reads. So does, for the VNNI product, from how many rows two blocks of
16 channels share each broadcast input, up to how many four or eight do, and, where the CPU
has AMX, from how many rows the product runs on its tiles; and up to how many rows it
prefetches nothing (on a Zen 4 the hardware prefetcher alone streamed one row's pass faster,
while 8 rows needed the software prefetch). ``CHATTTS_KERNEL_TUNING`` says how
the parameters are chosen:

- ``measure`` (the default): at the first start on a CPU, each candidate in ``CANDIDATES`` is
  timed on the model's own packed layers at 1 and 8 rows; the fastest, if clearly faster than
  the default, is used; then (every product) that prefetch or none at each of ``BARE_ROWS``;
  then, for the VNNI product, that choice with each of ``PAIRINGS``
  at 1 and 8 rows; then with blocks four at a time or not at each of ``QUAD_ROWS``, and
  eight at a time or not at each of ``OCT_ROWS``; then,
  with AMX, on tiles or not at each of ``TILE_ROWS`` rows (about three seconds in all on the
  full-size model). The choice is kept beside
  the packed weights (``<model dir>/.packed/tuning-<key>.json``, keyed by the CPU's model,
  flags and thread count, the kernel library and the product) and read on later starts: a restart
  measures nothing, another CPU measures again.
- ``table``: the entry of ``TABLE`` for this CPU (vendor, family, model), each measured with
  ``python benchmarks/tuning.py``; the default for a CPU not in it.
- ``default``: ``DEFAULT``, whatever the CPU.

aarch64's products (NEON, DotProd, I8MM) have nothing to tune: they read one block at a time
with the hardware prefetcher alone, which Arm's cores of this class stream well (Neoverse's
and Apple's prefetchers follow a plain front-to-back read). Their choice is always ``default``
and a start measures nothing.

Every candidate gives the same bits (prefetching moves no data, and the integer sums are exact
in any order); only the time differs.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from chattts_service.kernels import abi
from chattts_service.kernels.int4 import Int4Packing, int4_linear
from chattts_service.kernels.int8 import ARM_PRODUCTS, Int8Packing
from chattts_service.runtime.cpu import cpu_fields, cpu_flags
from chattts_service.runtime.files import identity_key, replace_atomically

log = logging.getLogger(__name__)

HINTS = {"nta": 0, "t0": 1}
MODES = ("measure", "table", "default")
ROWS = (1, 8)  # a step alone, and a full batch
PAIRING_ROWS = ROWS  # pairs from 1 row or 2 differ at one row, pairs or not at 8
BETTER_BY = 0.05  # a candidate replaces the default only when this much faster: runs on a
# shared 2-core machine differ by a few percent between candidates that are the same
PAIRING_BETTER_BY = 0.03  # timed at one row count, twice the rounds: less noise
PAIRING_ROUNDS = 9
SINGLE_BLOCKS = 9  # pair_blocks_from: pairs only past a step's 8 rows
TILE_ROWS = (2, 4, 8, 16, 32)  # AMX: tiles or not at each; 32 rows stand for a prompt's prefill
TILES_BETTER_BY = 0.03  # tiles from the fewest rows from which they win by this at every count
NO_TILES = 0
QUAD_ROWS = (1, 2, 4)  # VNNI: four blocks at a time or not at each (at most 4 rows)
QUADS_BETTER_BY = 0.03  # quads up to the most rows up to which they win by this at every count
NO_QUADS = 0
OCT_ROWS = (1, 2)  # VNNI: eight blocks at a time or not at each (at most 2 rows)
OCTS_BETTER_BY = 0.03  # octs up to the most rows up to which they win by this at every count
NO_OCTS = 0
# no software prefetch or not at each (at most 4 rows): on some CPUs the candidate without
# prefetch has the fastest one-row pass and a much slower 8-row one, so one distance for both
# would lose the one-row gain
BARE_ROWS = (1, 2, 4)
BARE_BETTER_BY = 0.03  # no prefetch up to the most rows up to which it wins by this at every count
NO_BARE = 0
FILE_VERSION = 6


def _rows(count: int) -> str:
    return "1 row" if count == 1 else f"{count} rows"


@dataclass(frozen=True)
class KernelTuning:
    prefetch_groups: int  # 64-byte groups of weights ahead; 0: the hardware prefetcher alone
    prefetch_hint: str  # "nta" (non-temporal) or "t0"
    pair_blocks_from: int = SINGLE_BLOCKS  # VNNI: rows from which blocks go in pairs, 1..9
    tiles_from: int = NO_TILES  # VNNI with AMX: rows from which the product runs on tiles
    quads_up_to: int = NO_QUADS  # VNNI: rows up to which blocks go four at a time, 0..4
    octs_up_to: int = NO_OCTS  # VNNI: rows up to which blocks go eight at a time, 0..2
    bare_up_to: int = NO_BARE  # rows up to which nothing is prefetched, 0..4

    def __post_init__(self):
        if (
            not 0 <= self.prefetch_groups <= 256
            or self.prefetch_hint not in HINTS
            or not 1 <= self.pair_blocks_from <= SINGLE_BLOCKS
            or not (self.tiles_from == NO_TILES or 2 <= self.tiles_from <= 65)
            or not NO_QUADS <= self.quads_up_to <= QUAD_ROWS[-1]
            or not NO_OCTS <= self.octs_up_to <= OCT_ROWS[-1]
            or not NO_BARE <= self.bare_up_to <= BARE_ROWS[-1]
        ):
            raise ValueError(f"no such tuning: {self}")

    @classmethod
    def from_abi(cls, tuning: abi.Tuning) -> KernelTuning:
        hints = {number: name for name, number in HINTS.items()}
        return cls(
            tuning.prefetch_groups,
            hints[tuning.prefetch_hint],
            tuning.pair_blocks_from,
            tuning.tiles_from,
            tuning.quads_up_to,
            tuning.octs_up_to,
            tuning.bare_up_to,
        )

    def to_abi(self) -> abi.Tuning:
        return abi.Tuning(
            self.prefetch_groups,
            HINTS[self.prefetch_hint],
            self.pair_blocks_from,
            self.tiles_from,
            self.quads_up_to,
            self.octs_up_to,
            self.bare_up_to,
        )

    @property
    def name(self) -> str:
        tiles = f"/tiles {self.tiles_from}" if self.tiles_from else ""
        quads = f"/quads {self.quads_up_to}" if self.quads_up_to else ""
        octs = f"/octs {self.octs_up_to}" if self.octs_up_to else ""
        bare = f"/bare {self.bare_up_to}" if self.bare_up_to else ""
        blocks = f"{self.pair_blocks_from}{quads}{octs}"
        return f"{self.prefetch_groups}/{self.prefetch_hint}/{blocks}{tiles}{bare}"

    def describe(self) -> str:
        prefetch = (
            f"prefetch {self.prefetch_groups * 64} B ahead ({self.prefetch_hint})"
            if self.prefetch_groups
            else "no software prefetch"
        )
        if self.pair_blocks_from != SINGLE_BLOCKS:
            prefetch += f", blocks in pairs from {_rows(self.pair_blocks_from)}"
        if self.quads_up_to:
            prefetch += f", blocks four at a time up to {_rows(self.quads_up_to)}"
        if self.octs_up_to:
            prefetch += f", eight at a time up to {_rows(self.octs_up_to)}"
        if self.tiles_from:
            prefetch += f", AMX tiles from {self.tiles_from} rows"
        if self.bare_up_to:
            prefetch += f", none up to {_rows(self.bare_up_to)}"
        return prefetch


DEFAULT = KernelTuning.from_abi(abi.default_tuning())  # what the kernels start with
CANDIDATES = (
    DEFAULT,
    KernelTuning(0, "nta"),
    KernelTuning(8, "nta"),
    KernelTuning(32, "nta"),
    KernelTuning(64, "nta"),
    KernelTuning(16, "t0"),
    KernelTuning(32, "t0"),
    KernelTuning(64, "t0"),
)
# the VNNI product's candidates, with the chosen prefetch: single blocks up to 8 rows, pairs from
# 2 rows (one row walks one block in four chains), pairs from 1 row
PAIRINGS = (SINGLE_BLOCKS, 2, 1)
# (vendor, family, model) -> tuning, each measured with `python benchmarks/tuning.py` on that
# CPU (full-size model, 2 threads)
TABLE = {
    ("AuthenticAMD", 25, 1): KernelTuning(16, "nta"),  # AMD EPYC, Zen 3
    ("GenuineIntel", 6, 207): KernelTuning(64, "t0", 2),  # Intel Xeon (Emerald Rapids)
}


def parse_candidates(text: str) -> tuple[KernelTuning, ...]:
    """ "16/nta,128/t0" -> prefetch candidates (64-byte groups ahead and the hint), for
    ``benchmarks/tuning.py --prefetch``; ValueError saying what is wrong."""
    candidates = []
    for item in (part.strip() for part in text.split(",")):
        groups, _, hint = item.partition("/")
        try:
            candidates.append(KernelTuning(int(groups), hint))
        except ValueError:
            raise ValueError(
                f"not a prefetch candidate: {item!r} (GROUPS/HINT: 0-256 groups of 64 bytes "
                f"ahead, hint {' or '.join(HINTS)})"
            ) from None
    return tuple(candidates)


def cpu_identity() -> dict:
    """What the choice depends on: the CPU's vendor, family, model and name, and its flags."""
    fields = cpu_fields()

    def number(name: str) -> int:
        try:
            return int(fields.get(name, "-1"))
        except ValueError:
            return -1

    return {
        "vendor": fields.get("vendor_id", "unknown"),
        "family": number("cpu family"),
        "model": number("model"),
        "name": fields.get("model name", "unknown CPU"),
        "flags": sorted(cpu_flags()),
    }


def from_table(identity: dict) -> KernelTuning:
    return TABLE.get((identity["vendor"], identity["family"], identity["model"]), DEFAULT)


def _pass_seconds(kernels, packings, inputs: dict, tuning: KernelTuning) -> float:
    kernels.tuning = tuning.to_abi()
    started = time.perf_counter()
    for packing in packings:
        if isinstance(packing, Int4Packing):
            int4_linear(kernels, inputs[packing.in_features], packing)
        else:
            kernels.int8_linear(inputs[packing.in_features], packing)
    return time.perf_counter() - started


def _time(kernels, packings, candidates, rows_counts, rounds: int) -> dict:
    """Median seconds of one pass per candidate and row count, the candidates interleaved in
    every round (so a noisy moment hits every candidate alike)."""
    generator = torch.Generator().manual_seed(0)
    widths = {packing.in_features for packing in packings}
    inputs = {
        rows: {width: torch.randn(rows, width, generator=generator) for width in widths}
        for rows in rows_counts
    }
    times: dict[KernelTuning, dict[int, list[float]]] = {
        candidate: {rows: [] for rows in rows_counts} for candidate in candidates
    }
    for rows in rows_counts:  # once untimed: page the weights in, start the threads
        _pass_seconds(kernels, packings, inputs[rows], candidates[0])
    for _ in range(rounds):
        for candidate in candidates:
            for rows in rows_counts:
                times[candidate][rows].append(
                    _pass_seconds(kernels, packings, inputs[rows], candidate)
                )
    return {
        candidate: {rows: statistics.median(values) for rows, values in by_rows.items()}
        for candidate, by_rows in times.items()
    }


def _fastest(medians: dict, baseline: KernelTuning, better_by: float) -> KernelTuning:
    """The candidate of the least summed median, if ``better_by`` faster than ``baseline``."""
    scores = {candidate: sum(by_rows.values()) for candidate, by_rows in medians.items()}
    best = min(scores, key=lambda candidate: scores[candidate])
    return baseline if scores[best] > scores[baseline] * (1 - better_by) else best


def _tiles_from(medians: dict, without: KernelTuning, tiled: KernelTuning) -> int:
    """The fewest of ``TILE_ROWS`` rows from which tiles were ``TILES_BETTER_BY`` faster at
    every count measured, or ``NO_TILES``."""
    start = NO_TILES
    for rows in sorted(TILE_ROWS, reverse=True):
        if medians[tiled][rows] > medians[without][rows] * (1 - TILES_BETTER_BY):
            break
        start = rows
    return start


def _wins_up_to(
    medians: dict, without: KernelTuning, wider: KernelTuning, rows_counts, better_by: float
) -> int:
    """The most of ``rows_counts`` rows up to which ``wider`` (more blocks at a time) was
    ``better_by`` faster than ``without`` at every count measured, or 0."""
    up_to = 0
    for rows in sorted(rows_counts):
        if medians[wider][rows] > medians[without][rows] * (1 - better_by):
            break
        up_to = rows
    return up_to


def _milliseconds(medians: dict) -> dict:
    return {
        candidate.name: {str(rows): seconds * 1000 for rows, seconds in by_rows.items()}
        for candidate, by_rows in medians.items()
    }


def measure(kernels, packings, rounds: int = 5, candidates=CANDIDATES) -> tuple[KernelTuning, dict]:
    """Time one pass of the int8 product over ``packings`` per candidate, at each of ``ROWS``
    rows, ``rounds`` times interleaved; the score is the sum over the row counts of the
    median pass, and the fastest replaces the first candidate only when ``BETTER_BY`` faster.
    When it prefetches, it is then timed without prefetching and with it at each of
    ``BARE_ROWS`` (every product). For the VNNI product, that choice is then timed with each of
    ``PAIRINGS`` at ``PAIRING_ROWS``, likewise; then with four blocks at a time and without at
    each of ``QUAD_ROWS``, then with eight at a time and without at each of ``OCT_ROWS``
    (``_wins_up_to`` decides these and the prefetch's rows); where the kernels may use AMX
    tiles, that choice with tiles and without at each of ``TILE_ROWS`` (``_tiles_from``
    decides).
    Returns the choice and the timings. The kernels' tuning is left as chosen."""
    medians = _time(kernels, packings, candidates, ROWS, rounds)
    best = _fastest(medians, candidates[0], BETTER_BY)
    report = {"ms_per_pass": _milliseconds(medians), "rounds": rounds}
    if best.prefetch_groups:
        bare = replace(best, bare_up_to=BARE_ROWS[-1])
        timed = _time(kernels, packings, [best, bare], BARE_ROWS, PAIRING_ROUNDS)
        best = replace(best, bare_up_to=_wins_up_to(timed, best, bare, BARE_ROWS, BARE_BETTER_BY))
        report["bare_ms_per_pass"] = _milliseconds(timed)
    pairs = all(isinstance(packing, Int8Packing) for packing in packings)
    if kernels.int8_instructions == "vnni" and pairs:  # int4 and AVX2 walk single blocks
        pairings = [replace(best, pair_blocks_from=rows) for rows in PAIRINGS]
        paired = _time(kernels, packings, pairings, PAIRING_ROWS, PAIRING_ROUNDS)
        best = _fastest(paired, pairings[0], PAIRING_BETTER_BY)
        report["pairing_ms_per_pass"] = _milliseconds(paired)
        quads = replace(best, quads_up_to=QUAD_ROWS[-1])
        timed = _time(kernels, packings, [best, quads], QUAD_ROWS, PAIRING_ROUNDS)
        up_to = _wins_up_to(timed, best, quads, QUAD_ROWS, QUADS_BETTER_BY)
        best = replace(best, quads_up_to=up_to)
        report["quads_ms_per_pass"] = _milliseconds(timed)
        octs = replace(best, octs_up_to=OCT_ROWS[-1])
        timed = _time(kernels, packings, [best, octs], OCT_ROWS, PAIRING_ROUNDS)
        best = replace(best, octs_up_to=_wins_up_to(timed, best, octs, OCT_ROWS, OCTS_BETTER_BY))
        report["octs_ms_per_pass"] = _milliseconds(timed)
        if kernels.has_tiles:
            tiled = replace(best, tiles_from=TILE_ROWS[0])
            timed = _time(kernels, packings, [best, tiled], TILE_ROWS, PAIRING_ROUNDS)
            best = replace(best, tiles_from=_tiles_from(timed, best, tiled))
            report["tiles_ms_per_pass"] = _milliseconds(timed)
    kernels.tuning = best.to_abi()
    return best, report


def product_name(kernels, packings) -> str:
    """Which product the packings run on, as kept choices are keyed: "int8-vnni",
    "int4-avx2", ... Each streams its weights its own way, so a choice measured on one says
    nothing of another (CHATTTS_INT8_PRODUCT or CHATTTS_QUANTIZE changed on the same CPU)."""
    kind = "int4" if any(isinstance(packing, Int4Packing) for packing in packings) else "int8"
    return f"{kind}-{kernels.int8_instructions}"


def cache_path(directory: Path, identity: dict, threads: int, library: Path, product: str) -> Path:
    key = identity_key(
        {
            "version": FILE_VERSION,
            "cpu": identity,
            "threads": threads,
            "library": library.name,
            "product": product,
            "candidates": [asdict(c) for c in CANDIDATES],
            "pairings": PAIRINGS,
            "tile_rows": TILE_ROWS,
            "quad_rows": QUAD_ROWS,
            "oct_rows": OCT_ROWS,
            "bare_rows": BARE_ROWS,
        }
    )
    return Path(directory) / f"tuning-{key}.json"


def _read(path: Path) -> KernelTuning | None:
    try:
        stored = json.loads(path.read_text())
        return KernelTuning(**stored["tuning"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        log.warning("kernel tuning %s is unusable (%s): measuring again", path, error)
        return None


def _write(path: Path, tuning: KernelTuning, identity: dict, report: dict) -> bool:
    body = {"tuning": asdict(tuning), "cpu": identity["name"], **report}
    try:
        path.parent.mkdir(exist_ok=True)
        replace_atomically(path, lambda out: json.dump(body, out, indent=1), binary=False)
    except OSError as error:
        log.warning("cannot keep the kernel tuning in %s (%s)", path.parent, error)
        return False
    return True


@dataclass
class Choice:
    tuning: KernelTuning
    # "measured", "kept" (an earlier start's measurement), "table", "default", or "untuned"
    # (aarch64's products, which read every weight with the hardware prefetcher alone)
    source: str

    def describe(self) -> str:
        if self.source == "untuned":
            return "the hardware prefetcher alone (aarch64's products take no tuning)"
        return f"{self.tuning.describe()}, {self.source}"


def choose(kernels, packings, mode: str, directory: Path | None) -> Choice:
    """Set ``kernels``' tuning as ``mode`` says (see the module's docstring) and return it.
    ``directory``: where the measured choice is kept (None: measure on every start)."""
    if mode not in MODES:
        raise ValueError(f"kernel tuning must be one of {MODES}, not {mode!r}")
    identity = cpu_identity()
    if kernels.int8_instructions in ARM_PRODUCTS:  # nothing to tune
        choice = Choice(DEFAULT, "untuned")
    elif mode == "default" or (mode == "measure" and not packings):  # nothing to time
        choice = Choice(DEFAULT, "default")
    elif mode == "table":
        tuning = from_table(identity)
        known = (identity["vendor"], identity["family"], identity["model"]) in TABLE
        choice = Choice(tuning, "table" if known else "default")
    else:
        path = None
        if directory is not None:
            path = cache_path(
                directory,
                identity,
                torch.get_num_threads(),
                kernels.path,
                product_name(kernels, packings),
            )
        kept = _read(path) if path is not None else None
        if kept is not None:
            choice = Choice(kept, "kept")
        else:
            tuning, report = measure(kernels, packings)
            if path is not None:
                _write(path, tuning, identity, report)
            choice = Choice(tuning, "measured")
    kernels.tuning = choice.tuning.to_abi()
    return choice
