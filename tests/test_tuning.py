"""The int8 product's per-CPU parameters: measured once and kept, or from the table."""

import json
import logging
from dataclasses import replace

import pytest
import torch

from chattts_service.kernels import abi, tuning
from chattts_service.kernels import bindings as cpp_kernels
from chattts_service.kernels.int4 import Int4Packing
from chattts_service.kernels.int8 import Int8Packing


@pytest.fixture()
def kernels():
    return cpp_kernels.load("on")


def _packings(kernels, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(192, 64), (64, 64), (256, 64), (64, 128)]
    return [
        Int8Packing(
            torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator),
            torch.rand(shape[0], generator=generator) / 100,
            kernels.int8_instructions,
        )
        for shape in shapes
    ]


def _every_tuning(kernels):
    tiles = (tuning.NO_TILES, 2, 9) if kernels.has_tiles else (tuning.NO_TILES,)
    return [
        replace(
            candidate,
            pair_blocks_from=pairs,
            tiles_from=start,
            quads_up_to=quads,
            octs_up_to=octs,
            bare_up_to=bare,
        )
        for candidate in tuning.CANDIDATES
        for pairs in (*tuning.PAIRINGS, 5)
        for start in tiles
        for quads, octs, bare in (
            (tuning.NO_QUADS, tuning.NO_OCTS, tuning.NO_BARE),
            (2, 0, 0),
            (4, 0, 1),
            (0, 1, 4),
            (4, 2, 2),
        )
    ]


def _needs_tiles(kernels):
    if not kernels.has_tiles:
        pytest.skip("no AMX tiles here (the CPU lacks AMX-INT8, or the OS grants no tile state)")


@pytest.mark.parametrize("shape", [(256, 64), (40, 68), (120, 64), (2504, 768)])
def test_every_candidate_gives_the_same_bits(kernels, shape):
    """Prefetching and pairing move no data and the integer sums are exact, so every tuning
    gives the same bits at every row count; a row's result is its own alone or in a batch.
    (68 inputs: 17 groups, a tail past the one-row chains; 40 channels end inside a block;
    120 channels inside the fourth block of a quad and the eighth of an oct; 2504 x 768: the
    code head, its last five blocks four at a time and one alone after its octs. 17 and 25
    rows: three and four passes over each block, each fetching its share of the next.)"""
    generator = torch.Generator().manual_seed(3)
    packing = Int8Packing(
        torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator),
        torch.rand(shape[0], generator=generator) / 100,
        kernels.int8_instructions,
    )
    x = torch.randn(25, packing.in_features, generator=generator)
    residual = torch.randn(25, packing.out_features, generator=generator)
    reference = None
    for candidate in _every_tuning(kernels):
        kernels.tuning = candidate.to_abi()
        results = {
            rows: kernels.int8_linear(x[:rows], packing, residual=residual[:rows])
            for rows in (*range(1, 11), 17, 25)
        }
        if reference is None:
            reference = results[25]
        for rows, result in results.items():
            assert torch.equal(result, reference[:rows]), (candidate, rows)
        for row in (7, 20):  # in the first pass of a batch, and in its third
            alone = kernels.int8_linear(x[row : row + 1], packing, residual=residual[row : row + 1])
            assert torch.equal(alone, reference[row : row + 1]), (candidate, row)


@pytest.mark.parametrize("shape", [(40, 68), (64, 40), (300, 768), (96, 3072)])
def test_tiles_give_the_vnni_products_bits_at_every_row_count(kernels, shape):
    """On AMX tiles the sums are vpdpbusd's, exactly, and the epilogue is the same: each row
    gets the bits the VNNI product gives it, past 16 rows (padded tiles) and with inputs past
    the last whole 64 (68: one tile and a group; 40: no whole tile), the norm, SwiGLU and a
    residual included."""
    _needs_tiles(kernels)
    generator = torch.Generator().manual_seed(11)
    n, k = shape
    packing = Int8Packing(
        torch.randint(-127, 128, shape, dtype=torch.int8, generator=generator),
        torch.rand(n, generator=generator) / 100,
        "vnni",
    )
    x = torch.randn(40, k, generator=generator) * 3
    both = torch.randn(40, 2 * k, generator=generator)
    gain = torch.rand(k, generator=generator) + 0.5
    residual = torch.randn(40, n, generator=generator)
    base = tuning.KernelTuning(64, "t0", 2)
    results = {}
    for start in (tuning.NO_TILES, 2):
        kernels.tuning = replace(base, tiles_from=start).to_abi()
        results[start] = [
            (
                kernels.int8_linear(x[:rows], packing, residual=residual[:rows]),
                kernels.int8_linear(x[:rows], packing, gain=gain),
                kernels.int8_linear(both[:rows], packing, swiglu=True),
            )
            for rows in (1, 2, 7, 16, 17, 33, 40)
        ]
    for tiled, plain in zip(results[2], results[tuning.NO_TILES]):
        for a, b in zip(tiled, plain):
            assert torch.equal(a, b)


def test_tiles_where_there_are_none_are_refused_with_the_reason(kernels):
    """Asked for tiles, a CPU without AMX (or an OS that grants no tile state) says so
    instead of faulting; one with them multiplies. Tiles are the VNNI product's: the AVX2
    product (a CPU without AVX512-VNNI) has no tile form and multiplies as it always does."""
    packing = _packings(kernels)[0]
    x = torch.randn(4, 64)
    kernels.tuning = tuning.KernelTuning(16, "nta", 9, 0).to_abi()
    without_tiles = kernels.int8_linear(x, packing)
    kernels.tuning = tuning.KernelTuning(16, "nta", 9, 2).to_abi()
    if kernels.has_tiles:
        assert torch.equal(kernels.int8_linear(x, packing), without_tiles)
    elif packing.instructions == "vnni":
        with pytest.raises(cpp_kernels.KernelError, match="AMX tiles asked for"):
            kernels.int8_linear(x, packing)
    else:
        assert torch.equal(kernels.int8_linear(x, packing), without_tiles)


def test_the_kernel_refuses_a_tuning_out_of_range(kernels):
    packing = _packings(kernels)[0]
    for bad in (
        abi.Tuning(257, 0, 9, 0),
        abi.Tuning(-1, 0, 9, 0),
        abi.Tuning(16, 2, 9, 0),
        abi.Tuning(16, 0, 0, 0),
        abi.Tuning(16, 0, 10, 0),
        abi.Tuning(16, 0, 9, 1),
        abi.Tuning(16, 0, 9, 66),
        abi.Tuning(16, 0, 9, 0, -1),
        abi.Tuning(16, 0, 9, 0, 5),
        abi.Tuning(16, 0, 9, 0, 0, -1),
        abi.Tuning(16, 0, 9, 0, 0, 3),
        abi.Tuning(16, 0, 9, 0, 0, 0, -1),
        abi.Tuning(16, 0, 9, 0, 0, 0, 5),
    ):
        kernels.tuning = bad
        with pytest.raises(cpp_kernels.KernelError, match="prefetch distance"):
            kernels.int8_linear(torch.randn(1, 64), packing)
    for bad in (
        (16, "t2"),
        (16, "t0", 0),
        (16, "t0", 10),
        (16, "t0", 9, 1),
        (16, "t0", 9, 66),
        (16, "t0", 9, 0, 5),
        (16, "t0", 9, 0, 0, 3),
        (16, "t0", 9, 0, 0, 0, -1),
        (16, "t0", 9, 0, 0, 0, 5),
    ):
        with pytest.raises(ValueError, match="no such tuning"):
            tuning.KernelTuning(*bad)


def _tiles_rule(passes: dict, without: str, tiled: str) -> int:
    """Tiles from the fewest rows from which they won by TILES_BETTER_BY at every count."""
    counts = sorted(passes[without], key=int)
    winning = [
        passes[tiled][rows] <= passes[without][rows] * (1 - tuning.TILES_BETTER_BY)
        for rows in counts
    ]
    start = tuning.NO_TILES
    for rows, won in reversed(list(zip(counts, winning))):
        if not won:
            break
        start = int(rows)
    return start


def _wins_rule(passes: dict, without: str, wider: str, better_by: float) -> int:
    """More blocks at a time up to the most rows up to which they won by ``better_by`` at
    every count."""
    up_to = 0
    for rows in sorted(passes[without], key=int):
        if passes[wider][rows] > passes[without][rows] * (1 - better_by):
            break
        up_to = int(rows)
    return up_to


def _rule(passes: dict, baseline: str, better_by: float) -> str:
    """The choice, worked out again from the medians a measurement reported."""
    scores = {name: sum(by_rows.values()) for name, by_rows in passes.items()}
    fastest = min(scores, key=scores.get)
    return baseline if scores[fastest] > scores[baseline] * (1 - better_by) else fastest


@pytest.mark.parametrize("product", ["vnni", "avx2"])
def test_measuring_chooses_the_fastest_clearly_faster_than_the_default(product):
    if product == "vnni" and not cpp_kernels.cpu_supports(cpp_kernels.VNNI_CPU_FLAGS):
        pytest.skip("this CPU lacks AVX512-VNNI")
    kernels = cpp_kernels.load("on", int8_product=product)
    best, report = tuning.measure(kernels, _packings(kernels), rounds=3)
    passes = report["ms_per_pass"]
    assert set(passes) == {candidate.name for candidate in tuning.CANDIDATES}
    assert all(
        set(by_rows) == {"1", "8"} and min(by_rows.values()) > 0 for by_rows in passes.values()
    )
    prefetch = _rule(passes, tuning.DEFAULT.name, tuning.BETTER_BY)
    groups, hint, _ = prefetch.split("/")
    bare_best = _check_bare(report, tuning.KernelTuning(int(groups), hint), best)
    if product == "avx2":  # its product walks single blocks: no pairing to time
        assert "pairing_ms_per_pass" not in report and best == bare_best
    else:
        paired = report["pairing_ms_per_pass"]
        assert set(paired) == {replace(bare_best, pair_blocks_from=r).name for r in tuning.PAIRINGS}
        assert all(set(by_rows) == {"1", "8"} for by_rows in paired.values())
        paired_best = replace(
            best, tiles_from=tuning.NO_TILES, quads_up_to=tuning.NO_QUADS, octs_up_to=tuning.NO_OCTS
        )
        assert paired_best.name == _rule(paired, bare_best.name, tuning.PAIRING_BETTER_BY)
        quads = report["quads_ms_per_pass"]
        quadded = replace(paired_best, quads_up_to=tuning.QUAD_ROWS[-1]).name
        assert set(quads) == {paired_best.name, quadded}
        assert all(set(by_rows) == set(map(str, tuning.QUAD_ROWS)) for by_rows in quads.values())
        assert best.quads_up_to == _wins_rule(
            quads, paired_best.name, quadded, tuning.QUADS_BETTER_BY
        )
        quad_best = replace(best, tiles_from=tuning.NO_TILES, octs_up_to=tuning.NO_OCTS)
        octs = report["octs_ms_per_pass"]
        octed = replace(quad_best, octs_up_to=tuning.OCT_ROWS[-1]).name
        assert set(octs) == {quad_best.name, octed}
        assert all(set(by_rows) == set(map(str, tuning.OCT_ROWS)) for by_rows in octs.values())
        assert best.octs_up_to == _wins_rule(octs, quad_best.name, octed, tuning.OCTS_BETTER_BY)
        paired_best = replace(best, tiles_from=tuning.NO_TILES)
        if kernels.has_tiles:
            tiles = report["tiles_ms_per_pass"]
            tiled = replace(paired_best, tiles_from=tuning.TILE_ROWS[0]).name
            assert set(tiles) == {paired_best.name, tiled}
            counts = set(map(str, tuning.TILE_ROWS))
            assert all(set(by_rows) == counts for by_rows in tiles.values())
            assert best.tiles_from == _tiles_rule(tiles, paired_best.name, tiled)
        else:
            assert "tiles_ms_per_pass" not in report and best.tiles_from == tuning.NO_TILES
    assert tuning.KernelTuning.from_abi(kernels.tuning) == best


def _check_bare(
    report: dict, prefetch: tuning.KernelTuning, best: tuning.KernelTuning
) -> tuning.KernelTuning:
    """The chosen ``prefetch`` timed without prefetching or with it at each of BARE_ROWS where
    it prefetches, and the rows chosen by the same rule as more blocks at a time; returns the
    choice that far."""
    if not prefetch.prefetch_groups:
        assert "bare_ms_per_pass" not in report and best.bare_up_to == tuning.NO_BARE
        return prefetch
    timed = report["bare_ms_per_pass"]
    bared = replace(prefetch, bare_up_to=tuning.BARE_ROWS[-1]).name
    assert set(timed) == {prefetch.name, bared}
    assert all(set(by_rows) == set(map(str, tuning.BARE_ROWS)) for by_rows in timed.values())
    assert best.bare_up_to == _wins_rule(timed, prefetch.name, bared, tuning.BARE_BETTER_BY)
    return replace(prefetch, bare_up_to=best.bare_up_to)


def test_int4_layers_are_timed_with_their_own_product(kernels):
    generator = torch.Generator().manual_seed(5)
    packings = [Int4Packing(torch.randn(shape, generator=generator)) for shape in ((64, 64),) * 3]
    best, report = tuning.measure(kernels, packings, rounds=2)
    assert set(report["ms_per_pass"]) == {candidate.name for candidate in tuning.CANDIDATES}
    assert "pairing_ms_per_pass" not in report  # the int4 product walks single blocks
    assert "quads_ms_per_pass" not in report and "octs_ms_per_pass" not in report
    assert best.pair_blocks_from == tuning.SINGLE_BLOCKS and best.quads_up_to == tuning.NO_QUADS
    assert best.octs_up_to == tuning.NO_OCTS
    prefetch = replace(best, bare_up_to=tuning.NO_BARE)
    assert prefetch.name == _rule(report["ms_per_pass"], tuning.DEFAULT.name, tuning.BETTER_BY)
    assert _check_bare(report, prefetch, best) == best


def test_a_measured_choice_is_kept_and_read_on_the_next_start(kernels, tmp_path):
    packings = _packings(kernels)
    first = tuning.choose(kernels, packings, "measure", tmp_path)
    assert first.source == "measured"
    (kept,) = tmp_path.glob("tuning-*.json")
    stored = json.loads(kept.read_text())
    assert stored["tuning"] == {
        "prefetch_groups": first.tuning.prefetch_groups,
        "prefetch_hint": first.tuning.prefetch_hint,
        "pair_blocks_from": first.tuning.pair_blocks_from,
        "tiles_from": first.tuning.tiles_from,
        "quads_up_to": first.tuning.quads_up_to,
        "octs_up_to": first.tuning.octs_up_to,
        "bare_up_to": first.tuning.bare_up_to,
    }
    assert stored["cpu"] == tuning.cpu_identity()["name"] and "ms_per_pass" in stored
    # what the next start reads, not what it measures: a choice written by hand is used as is
    stored["tuning"] = {"prefetch_groups": 40, "prefetch_hint": "t0", "pair_blocks_from": 3}
    kept.write_text(json.dumps(stored))
    second = tuning.choose(kernels, packings, "measure", tmp_path)
    assert (second.source, second.tuning) == ("kept", tuning.KernelTuning(40, "t0", 3))
    assert tuning.KernelTuning.from_abi(kernels.tuning) == second.tuning


def test_an_unusable_kept_choice_is_measured_again(kernels, tmp_path, caplog):
    packings = _packings(kernels)
    tuning.choose(kernels, packings, "measure", tmp_path)
    (kept,) = tmp_path.glob("tuning-*.json")
    for broken in (
        "{not json",
        '{"tuning": {"prefetch_groups": 999, "prefetch_hint": "nta"}}',
        '{"tuning": {"prefetch_groups": 16, "prefetch_hint": "nta", "pair_blocks_from": 0}}',
    ):
        kept.write_text(broken)
        with caplog.at_level(logging.WARNING):
            again = tuning.choose(kernels, packings, "measure", tmp_path)
        assert again.source == "measured" and "unusable" in caplog.text
        assert json.loads(kept.read_text())["tuning"]["prefetch_groups"] <= 256


def test_an_unwritable_directory_still_gives_a_measured_choice(kernels, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        choice = tuning.choose(kernels, _packings(kernels), "measure", blocked / "sub")
    assert choice.source == "measured" and "cannot keep the kernel tuning" in caplog.text


def test_each_cpu_thread_count_library_and_product_has_its_own_kept_choice(tmp_path, kernels):
    identity = tuning.cpu_identity()
    path = kernels.path

    def kept(*changed, **changes):
        arguments = {"identity": identity, "threads": 2, "library": path, "product": "int8-vnni"}
        return tuning.cache_path(tmp_path, **{**arguments, **changes})

    here = kept()
    assert here == kept(identity=dict(identity))
    others = [
        kept(identity={**identity, "model": identity["model"] + 1}),
        kept(identity={**identity, "flags": ["avx2"]}),
        kept(threads=4),
        kept(library=path.with_name("kernels-other.so")),
        kept(product="int8-avx2"),
        kept(product="int4-vnni"),
    ]
    assert len({here, *others}) == 7


def test_a_choice_kept_for_one_product_is_not_read_for_another(tmp_path):
    """The same CPU and library, CHATTTS_INT8_PRODUCT or CHATTTS_QUANTIZE changed: each
    product measures its own choice instead of reading another's."""
    products = ["avx2"] + (["vnni"] if cpp_kernels.cpu_supports(cpp_kernels.VNNI_CPU_FLAGS) else [])
    generator = torch.Generator().manual_seed(3)
    int4 = [Int4Packing(torch.randn(64, 64, generator=generator)) for _ in range(3)]
    for product in products:
        kernels = cpp_kernels.load("on", product)
        assert tuning.choose(kernels, _packings(kernels), "measure", tmp_path).source == "measured"
        assert tuning.choose(kernels, _packings(kernels), "measure", tmp_path).source == "kept"
        assert tuning.choose(kernels, int4, "measure", tmp_path).source == "measured"
    assert len(list(tmp_path.glob("tuning-*.json"))) == 2 * len(products)


def test_the_table_gives_its_entry_for_a_known_cpu_and_the_default_otherwise(kernels):
    (vendor, family, model), entry = next(iter(tuning.TABLE.items()))
    known = {"vendor": vendor, "family": family, "model": model, "name": "", "flags": []}
    assert tuning.from_table(known) == entry
    assert tuning.from_table({**known, "model": -1}) == tuning.DEFAULT
    here = tuning.cpu_identity()
    choice = tuning.choose(kernels, _packings(kernels), "table", None)
    listed = (here["vendor"], here["family"], here["model"]) in tuning.TABLE
    assert choice.source == ("table" if listed else "default")
    assert choice.tuning == tuning.from_table(here)
    assert tuning.KernelTuning.from_abi(kernels.tuning) == choice.tuning


def test_the_kernels_start_with_the_default_and_every_tuning_converts_both_ways():
    started = tuning.KernelTuning.from_abi(cpp_kernels.load("on").tuning)
    assert started == tuning.DEFAULT
    every = [*tuning.CANDIDATES, tuning.KernelTuning(64, "t0", 1, 16, 4, 2, 1)]
    for each in every:
        assert tuning.KernelTuning.from_abi(each.to_abi()) == each


def test_default_mode_measures_nothing_and_keeps_nothing(kernels, tmp_path):
    choice = tuning.choose(kernels, _packings(kernels), "default", tmp_path)
    assert (choice.source, choice.tuning) == ("default", tuning.DEFAULT)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="kernel tuning must be one of"):
        tuning.choose(kernels, [], "fastest", tmp_path)


def test_prefetch_candidates_parse_or_say_what_is_wrong():
    """``benchmarks/tuning.py --prefetch``: groups of 64 bytes ahead and the hint."""
    assert tuning.parse_candidates("16/nta, 128/t0") == (
        tuning.KernelTuning(16, "nta"),
        tuning.KernelTuning(128, "t0"),
    )
    for bad in ("", "16", "16/fast", "300/t0", "-1/nta", "x/t0"):
        with pytest.raises(ValueError, match="not a prefetch candidate"):
            tuning.parse_candidates(bad)
