from dataclasses import fields, replace

import torch

from chattts_service.domain.speech import Silence, SynthesisRequest
from chattts_service.domain.voices import Voice
from chattts_service.services.cache import AudioCache, cache_key

BASE = SynthesisRequest(text="你好", seed=1, refine_text=False)
VOICE = Voice("nova", torch.zeros(4), "d1")


def test_same_request_same_key():
    assert cache_key(BASE, "m", "wav") == cache_key(SynthesisRequest("你好", 1, False), "m", "wav")


def test_every_input_that_changes_audio_changes_the_key():
    changed = {
        "text": "你好吗",
        "seed": 2,
        "refine_text": True,
        "voice": VOICE,
        "speed": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "normalize": False,
        "refine_prompt": "[oral_2]",
        "sentence_segments": True,
        "language": "en",
        "parts": (replace(BASE, text="a"), Silence(300), replace(BASE, text="b")),
    }
    assert set(changed) == {f.name for f in fields(SynthesisRequest)}, "new field: extend this test"
    keys = {cache_key(BASE, "m", "wav")}
    for name, value in changed.items():
        keys.add(cache_key(replace(BASE, **{name: value}), "m", "wav"))
    keys.add(cache_key(BASE, "another-model", "wav"))
    keys.add(cache_key(BASE, "m", "mp3"))
    assert len(keys) == len(changed) + 3


def test_a_scripts_spans_and_silences_are_keyed():
    one, two = replace(BASE, text="a"), replace(BASE, text="b")
    scripts = [
        (one, Silence(300), two),
        (one, Silence(301), two),
        (one, two),
        (one, Silence(300), replace(two, voice=VOICE)),
        (one, Silence(300), replace(two, voice=Voice("nova", torch.ones(4), "d2"))),
    ]
    keys = {cache_key(replace(BASE, parts=parts), "m", "wav") for parts in scripts}
    assert len(keys) == len(scripts)


def test_a_voice_is_keyed_by_its_embedding_not_only_its_name():
    same_name_new_embedding = Voice("nova", torch.ones(4), "d2")
    assert cache_key(replace(BASE, voice=VOICE), "m", "wav") != cache_key(
        replace(BASE, voice=same_name_new_embedding), "m", "wav"
    )


def test_lru_evicts_the_least_recently_used():
    cache = AudioCache(2)
    cache.put("a", (b"1", 1.0))
    cache.put("b", (b"2", 1.0))
    assert cache.get("a") == (b"1", 1.0)  # a is now the most recent
    cache.put("c", (b"3", 1.0))
    assert cache.get("b") is None
    assert cache.get("a") is not None and cache.get("c") is not None
    assert len(cache) == 2 and cache.bytes == 2


def test_byte_budget_evicts_oldest_entries():
    cache = AudioCache(100, max_bytes=10)
    cache.put("a", (b"x" * 4, 1.0))
    cache.put("b", (b"x" * 4, 1.0))
    cache.put("a", (b"x" * 5, 1.0))  # replacing an entry counts its new size only
    assert cache.bytes == 9 and len(cache) == 2
    cache.put("c", (b"x" * 4, 1.0))  # over budget: the least recently used (b) goes
    assert cache.get("b") is None and cache.bytes == 9
    cache.put("huge", (b"x" * 11, 1.0))  # larger than the whole budget: not kept
    assert cache.get("huge") is None and cache.bytes == 9


def test_size_zero_disables_the_cache():
    cache = AudioCache(0)
    cache.put("a", (b"1", 1.0))
    assert cache.get("a") is None
    assert len(cache) == 0
