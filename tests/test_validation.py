import pytest

from chattts_service.config import Settings
from chattts_service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from chattts_service.validation import json_body, normalise_text, synthesize_request

SETTINGS = Settings.from_env({}, max_chars=20, default_seed=77)


def test_defaults_fill_missing_fields():
    request = synthesize_request({"text": "你好"}, SETTINGS)
    assert request.text == "你好"
    assert request.seed == 77
    assert request.refine_text is False


def test_text_is_normalised_for_model_and_cache_alike():
    assert normalise_text("  Hello \n\t world\x07 ") == "Hello world"
    # NFC: a decomposed "é" and the composed one are the same text
    assert normalise_text("e\u0301") == "\u00e9"


@pytest.mark.parametrize("body,message", [
    ({}, "'text' is required"),
    ({"text": 5}, "must be a string"),
    ({"text": ["a"]}, "must be a string"),
    ({"text": "   \n "}, "must not be empty"),
    ({"text": "hi", "seed": "1"}, "'seed' must be an integer"),
    ({"text": "hi", "seed": 1.5}, "'seed' must be an integer"),
    ({"text": "hi", "seed": True}, "'seed' must be an integer"),
    ({"text": "hi", "seed": -1}, "between 0 and"),
    ({"text": "hi", "seed": 2**31}, "between 0 and"),
    ({"text": "hi", "refine_text": "yes"}, "'refine_text' must be true or false"),
    ({"text": "hi", "speed": 2}, "unknown fields: speed"),
    ({"text": "a\ud800b"}, "surrogate"),
])
def test_bad_bodies_are_400_with_a_reason(body, message):
    with pytest.raises(BadRequest, match=message):
        synthesize_request(body, SETTINGS)


def test_text_over_the_limit_is_413():
    with pytest.raises(PayloadTooLarge, match="21 characters; the limit is 20"):
        synthesize_request({"text": "x" * 21}, SETTINGS)
    assert synthesize_request({"text": "x" * 20}, SETTINGS).text == "x" * 20


def test_body_parsing():
    assert json_body("application/json", b'{"text": "a"}') == {"text": "a"}
    with pytest.raises(UnsupportedMediaType):
        json_body("text/plain", b'{"text": "a"}')
    with pytest.raises(BadRequest, match="not valid JSON"):
        json_body("application/json", b'{"text": ')
    with pytest.raises(BadRequest, match="JSON object"):
        json_body("application/json", b'["text"]')
    with pytest.raises(BadRequest, match="UTF-8"):
        json_body("application/json", b'{"text": "\xff"}')
