"""The int8 product's per-CPU parameters: measured once and kept, or from the table."""

import json
import logging

import pytest
import torch

from chattts_service.kernels import abi, tuning
from chattts_service.kernels import bindings as cpp_kernels
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


def test_every_candidate_gives_the_same_bits(kernels):
    packing = _packings(kernels)[2]
    x, residual = torch.randn(8, packing.in_features), torch.randn(8, packing.out_features)
    results = []
    for candidate in tuning.CANDIDATES:
        kernels.tuning = candidate.to_abi()
        results.append(kernels.int8_linear(x, packing, residual=residual))
    assert all(torch.equal(result, results[0]) for result in results[1:])


def test_the_kernel_refuses_a_tuning_out_of_range(kernels):
    packing = _packings(kernels)[0]
    for bad in (abi.Tuning(257, 0), abi.Tuning(-1, 0), abi.Tuning(16, 2)):
        kernels.tuning = bad
        with pytest.raises(cpp_kernels.KernelError, match="prefetch distance"):
            kernels.int8_linear(torch.randn(1, 64), packing)
    with pytest.raises(ValueError, match="no such tuning"):
        tuning.KernelTuning(16, "t2")


def test_measuring_chooses_the_fastest_clearly_faster_than_the_default(kernels):
    best, report = tuning.measure(kernels, _packings(kernels), rounds=3)
    passes = report["ms_per_pass"]
    assert set(passes) == {f"{c.prefetch_groups}/{c.prefetch_hint}" for c in tuning.CANDIDATES}
    assert all(
        set(by_rows) == {"1", "8"} and min(by_rows.values()) > 0 for by_rows in passes.values()
    )
    # the rule, applied again to the medians it reported
    scores = {name: sum(by_rows.values()) for name, by_rows in passes.items()}
    default = f"{tuning.DEFAULT.prefetch_groups}/{tuning.DEFAULT.prefetch_hint}"
    fastest = min(scores, key=scores.get)
    if scores[fastest] > scores[default] * (1 - tuning.BETTER_BY):
        fastest = default
    assert f"{best.prefetch_groups}/{best.prefetch_hint}" == fastest
    assert (kernels.tuning.prefetch_groups, kernels.tuning.prefetch_hint) == (
        best.prefetch_groups,
        tuning.HINTS[best.prefetch_hint],
    )


def test_a_measured_choice_is_kept_and_read_on_the_next_start(kernels, tmp_path):
    packings = _packings(kernels)
    first = tuning.choose(kernels, packings, "measure", tmp_path)
    assert first.source == "measured"
    (kept,) = tmp_path.glob("tuning-*.json")
    stored = json.loads(kept.read_text())
    assert stored["tuning"] == {
        "prefetch_groups": first.tuning.prefetch_groups,
        "prefetch_hint": first.tuning.prefetch_hint,
    }
    assert stored["cpu"] == tuning.cpu_identity()["name"] and "ms_per_pass" in stored
    # what the next start reads, not what it measures: a choice written by hand is used as is
    stored["tuning"] = {"prefetch_groups": 40, "prefetch_hint": "t0"}
    kept.write_text(json.dumps(stored))
    second = tuning.choose(kernels, packings, "measure", tmp_path)
    assert (second.source, second.tuning) == ("kept", tuning.KernelTuning(40, "t0"))
    assert (kernels.tuning.prefetch_groups, kernels.tuning.prefetch_hint) == (40, 1)


def test_an_unusable_kept_choice_is_measured_again(kernels, tmp_path, caplog):
    packings = _packings(kernels)
    tuning.choose(kernels, packings, "measure", tmp_path)
    (kept,) = tmp_path.glob("tuning-*.json")
    for broken in ("{not json", '{"tuning": {"prefetch_groups": 999, "prefetch_hint": "nta"}}'):
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


def test_each_cpu_thread_count_and_library_has_its_own_kept_choice(tmp_path, kernels):
    identity = tuning.cpu_identity()
    here = tuning.cache_path(tmp_path, identity, 2, kernels.path)
    assert here == tuning.cache_path(tmp_path, dict(identity), 2, kernels.path)
    others = [
        tuning.cache_path(tmp_path, {**identity, "model": identity["model"] + 1}, 2, kernels.path),
        tuning.cache_path(tmp_path, {**identity, "flags": ["avx2"]}, 2, kernels.path),
        tuning.cache_path(tmp_path, identity, 4, kernels.path),
        tuning.cache_path(tmp_path, identity, 2, kernels.path.with_name("kernels-other.so")),
    ]
    assert len({here, *others}) == 5


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
    assert kernels.tuning.prefetch_groups == choice.tuning.prefetch_groups


def test_default_mode_measures_nothing_and_keeps_nothing(kernels, tmp_path):
    choice = tuning.choose(kernels, _packings(kernels), "default", tmp_path)
    assert (choice.source, choice.tuning) == ("default", tuning.DEFAULT)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="kernel tuning must be one of"):
        tuning.choose(kernels, [], "fastest", tmp_path)
