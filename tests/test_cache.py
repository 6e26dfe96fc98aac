from dataclasses import fields, replace

from chattts_service.cache import AudioCache, cache_key
from chattts_service.engine import SynthesisRequest

BASE = SynthesisRequest(text="你好", seed=1, refine_text=False)


def test_same_request_same_key():
    assert cache_key(BASE, "m") == cache_key(SynthesisRequest("你好", 1, False), "m")


def test_every_input_that_changes_audio_changes_the_key():
    changed = {"text": "你好吗", "seed": 2, "refine_text": True}
    assert set(changed) == {f.name for f in fields(SynthesisRequest)}, "new field: extend this test"
    keys = {cache_key(BASE, "m")}
    for name, value in changed.items():
        keys.add(cache_key(replace(BASE, **{name: value}), "m"))
    keys.add(cache_key(BASE, "another-model"))
    assert len(keys) == len(changed) + 2


def test_lru_evicts_the_least_recently_used():
    cache = AudioCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)
    assert cache.get("b") is None
    assert cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2


def test_size_zero_disables_the_cache():
    cache = AudioCache(0)
    cache.put("a", 1)
    assert cache.get("a") is None
    assert len(cache) == 0
