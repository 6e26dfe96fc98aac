"""ChatTTS's normaliser and tokenizer as the service runs them (without Numba, without
transformers at a restart), held to upstream's: the Numba functions compiled by Numba from
upstream's own source, the tokenizer built by transformers from the model's files."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chattts_service.inference import chattts_norm
from chattts_service.inference.tokenizer import load_tokenizer, snapshot_key

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def numba_norm():
    """Upstream's ChatTTS/norm.py imported a second time, with the real Numba: its four
    functions compiled as upstream compiles them (nopython)."""
    pytest.importorskip("numba")
    norm = chattts_norm.norm_module()
    spec = importlib.util.spec_from_file_location("ChatTTS._numba_norm", norm.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert type(module._fast_replace).__name__ == "CPUDispatcher"  # really Numba's
    return module


@pytest.fixture(scope="module")
def homophones():
    return chattts_norm.chattts_normaliser().homophones_map


def _texts(homophones):
    sources = [chr(code) for code in homophones[0][:: max(1, homophones.shape[1] // 500)]]
    pieces = st.one_of(
        st.sampled_from(sources),  # characters the table replaces
        st.sampled_from(["[", "]", "[uv_break]", "[laugh", "]]", "[[", " ", "-", "，"]),
        st.characters(codec="utf-8", exclude_categories=["Cs"]),  # astral ones included
        st.sampled_from(["😀", "𠀀", "\U0010fffd"]),  # surrogate pairs in UTF-16
    )
    return st.lists(pieces, max_size=40).map("".join)


def test_the_ports_replace_homophones_as_numba_does(numba_norm, homophones):
    @FUZZ
    @given(_texts(homophones))
    def check(text):
        data = text.encode("utf-16-le")
        ours, our_words = chattts_norm._fast_replace(homophones, data)
        theirs, their_words = numba_norm._fast_replace(homophones, data)
        assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
        assert our_words == list(their_words)

    check()


def test_the_ports_split_and_join_tags_as_numba_does(numba_norm, homophones):
    # upstream joins only when there are tags (Numba cannot type an empty list argument)
    tags = st.lists(st.sampled_from(["[a]", "[uv_break]", "]"]), min_size=1, max_size=6)

    @FUZZ
    @given(_texts(homophones), tags)
    def check(text, tags):
        assert chattts_norm._split_tags(text) == tuple(map(list, numba_norm._split_tags(text)))
        pieces = chattts_norm._split_tags(text)[0] or [""]
        ours, theirs = list(tags), list(tags)
        joined = chattts_norm._combine_tags(list(pieces), ours)
        assert joined == numba_norm._combine_tags(list(pieces), theirs)
        assert ours == theirs  # both take the tags they used off the caller's list

    check()
    table = np.array([3, 5, 5, 9], dtype=np.uint32)
    for value in (5, 9, 4):
        found = chattts_norm._find_index(table, np.uint16(value))
        assert found == numba_norm._find_index(table, np.uint16(value))


def test_the_normaliser_gives_what_upstreams_numba_one_gives(numba_norm, homophones):
    ours = chattts_norm.chattts_normaliser()
    theirs = numba_norm.Normalizer(
        str(chattts_norm.homophones_path()), logging.getLogger("ChatTTS")
    )
    base = ["你好，世界。", "Hello [uv_break] world-wide!", "这是（一个）测试：好", "a[b]c[d", ""]

    @FUZZ
    @given(st.one_of(st.sampled_from(base), _texts(homophones)), st.booleans(), st.booleans())
    def check(text, normalise, replace):
        assert ours(text, normalise, replace) == theirs(text, normalise, replace)

    check()


# -- the tokenizer ------------------------------------------------------------------------------

SAMPLES = [
    "[Stts][spk_emb][speed_5]你好，世界。[Ptts]",
    "[Sbreak]Hello, world! It's a test of the tokenizer.[Pbreak]",
    "数字 123 和 English 混合 [uv_break] [laugh] 。",
    "Ünïcödé àccents, ＦＵＬＬＷＩＤＴＨ, tabs\tand\nnewlines",
    "[unknown_tag] [spk_emb] [break_0] [Ebreak]",
]


@pytest.fixture
def tokenizer_dir(tiny_model_dir, tmp_path):
    copy = tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir / "asset" / "tokenizer", copy)
    return copy


def _same_tokenizer(ours, theirs, texts) -> None:
    for attribute in ("len", "spk_emb_ids", "break_0_ids", "eos_token"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    for text in texts:
        for got, want in zip(ours.encode([text], 4), theirs.encode([text], 4), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), text
        ids = theirs.encode([text], 4)[0][0, :, 0]
        assert ours.decode([ids]) == theirs.decode([ids])
        assert ours.decode([ids], skip_special_tokens=True) == theirs.decode(
            [ids], skip_special_tokens=True
        )


def test_the_kept_tokenizer_is_the_one_transformers_builds(tokenizer_dir, tmp_path):
    from ChatTTS.model.tokenizer import Tokenizer

    kept = tmp_path / "kept"
    built = load_tokenizer(tokenizer_dir, kept)  # no snapshot yet: built through transformers
    assert type(built._tokenizer).__module__.startswith("transformers")
    files = list(kept.glob("tokenizer-*.json"))
    assert [f.name for f in files] == [f"tokenizer-{snapshot_key(tokenizer_dir)}.json"]
    read = load_tokenizer(tokenizer_dir, kept)  # from the snapshot
    assert type(read._tokenizer).__name__ == "BackendTokenizer"
    upstream = Tokenizer(str(tokenizer_dir))
    _same_tokenizer(read, upstream, SAMPLES)

    @FUZZ
    @given(st.text(max_size=60), st.sampled_from(["", "[uv_break]", "[spk_emb]", " ."]))
    def check(text, tag):
        _same_tokenizer(read, upstream, [text + tag + text[::-1]])

    check()


def test_a_changed_corrupt_or_unwritable_snapshot_falls_back_to_transformers(
    tokenizer_dir, tmp_path, caplog
):
    kept = tmp_path / "kept"
    load_tokenizer(tokenizer_dir, kept)
    first = next(kept.glob("tokenizer-*.json"))
    # the tokenizer's files change: another key, built again, the old snapshot removed
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    again = load_tokenizer(tokenizer_dir, kept)
    assert type(again._tokenizer).__module__.startswith("transformers")
    assert not first.exists() and len(list(kept.glob("tokenizer-*.json"))) == 1
    # a corrupt snapshot is rebuilt, with a warning, never used
    snapshot = next(kept.glob("tokenizer-*.json"))
    stored = json.loads(snapshot.read_text())
    snapshot.write_text(json.dumps({**stored, "backend": stored["backend"][:1000]}))
    with caplog.at_level(logging.WARNING, logger="chattts_service.inference.tokenizer"):
        rebuilt = load_tokenizer(tokenizer_dir, kept)
    assert "unusable" in caplog.text
    assert type(rebuilt._tokenizer).__module__.startswith("transformers")
    assert type(load_tokenizer(tokenizer_dir, kept)._tokenizer).__name__ == "BackendTokenizer"
    # a directory that cannot be written: the start still works, through transformers
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chattts_service.inference.tokenizer"):
        works = load_tokenizer(tokenizer_dir, blocked / "kept")
    assert "cannot keep" in caplog.text
    _same_tokenizer(works, rebuilt, SAMPLES)


def test_a_restart_imports_neither_numba_nor_transformers(tiny_model_dir, tmp_path):
    """Two loads of a copy of the tiny model in fresh processes: the first builds the
    tokenizer through transformers and keeps it; the second needs neither library, nor Numba,
    and speaks the same audio."""
    model = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns(".packed"))
    script = """
import sys, hashlib
from chattts_service.config import Settings
from chattts_service.inference.engine import Engine
from chattts_service.domain.speech import SynthesisRequest
engine = Engine(Settings.from_env())
engine.load()
digest = hashlib.sha256()
for refine in (False, True):  # refining decodes text through the tokenizer too
    request = SynthesisRequest(text="Hello there, 你好。", seed=3, refine_text=refine)
    synthesis = engine.synthesize(request, fixed_steps=30)
    digest.update(synthesis.audio.tobytes() + synthesis.spoken_text.encode())
loaded = sorted(m for m in ("numba", "transformers", "llvmlite") if m in sys.modules)
print("loaded", ",".join(loaded) or "-", digest.hexdigest())
engine.close()
"""
    env = {
        **os.environ,
        "CHATTTS_MODEL_DIR": str(model),
        "CHATTTS_VERIFY_MODEL": "0",
        "CHATTTS_THREADS": "1",
    }

    def run() -> list[str]:
        result = subprocess.run(
            [sys.executable, "-c", script],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.strip().splitlines()[-1].split()

    first, second = run(), run()
    assert first[1] == "transformers"  # the first start builds the tokenizer upstream's way
    assert second[1] == "-"
    assert first[2] == second[2]  # the same audio from the kept tokenizer
