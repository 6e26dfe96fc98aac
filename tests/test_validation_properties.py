"""Property tests of request validation: any JSON body gets a request or a clear 4xx."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from chattts_service.api.errors import ApiError
from chattts_service.api.models import speech_bodies
from chattts_service.api.validation import json_body, speech_request, synthesize_request
from chattts_service.config import Settings
from chattts_service.domain.text import TOKEN, normalise_text, pack, split_sentences

SETTINGS = Settings.from_env({}, max_chars=300)
FIELDS = sorted(
    set(speech_bodies(SETTINGS).synthesize.model_fields)
    | set(speech_bodies(SETTINGS).speech.model_fields)
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3)
    ),
    max_leaves=6,
)
texts = st.lists(
    st.characters(codec="utf-8")
    | st.sampled_from(
        ["[uv_break]", "[laugh]", "[bad]", "。", ". ", "\x00", "\ud800", "1", "$", "\n"]
    ),
    max_size=300,
).map("".join)
bodies = st.dictionaries(st.sampled_from(FIELDS + ["extra"]), json_values | texts, max_size=8)


@settings(max_examples=400, deadline=None)
@given(bodies)
def test_any_body_gives_a_request_or_a_4xx(body):
    for parse in (synthesize_request, lambda b, s: speech_request(b, s, None)):
        try:
            request, output = parse(body, SETTINGS)
        except ApiError as error:
            assert 400 <= error.status < 500 and error.message
            continue
        assert 1 <= len(request.text) <= SETTINGS.max_chars
        assert not any(0xD800 <= ord(ch) <= 0xDFFF for ch in request.text)
        assert 0 <= request.speed <= 9 and 1 <= request.top_k <= 100
        assert output.format in ("mp3", "opus", "flac", "wav", "pcm")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_parse_as_a_body_or_a_4xx(raw):
    try:
        body = json_body("application/json", raw)
    except ApiError as error:
        assert error.status == 400
    else:
        assert isinstance(body, dict) and body == json.loads(raw.decode("utf-8"))


@settings(max_examples=300, deadline=None)
@given(texts)
def test_canonical_text_is_stable_and_clean(text):
    once = normalise_text(text)
    assert normalise_text(once) == once
    assert once == once.strip() and "  " not in once
    assert not any(ch in once for ch in "\x00\x07\x1b")


@settings(max_examples=300, deadline=None)
@given(texts.map(normalise_text), st.integers(min_value=10, max_value=120))
def test_splitting_keeps_every_character_and_respects_the_limit(text, limit):
    segments = pack(split_sentences(text), limit)
    # nothing but whitespace is lost or added, in order
    assert "".join("".join(segments).split()) == "".join(text.split())
    for segment in segments:
        # a segment over the limit can only be one control token that cannot be cut
        assert len(segment) <= limit or TOKEN.fullmatch(segment.strip())
