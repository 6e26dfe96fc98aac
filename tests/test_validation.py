import pytest

from chattts_service.api.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from chattts_service.api.validation import (
    json_body,
    speech_request,
    speed_level,
    synthesize_request,
)
from chattts_service.config import Settings
from chattts_service.domain.text import normalise_text

SETTINGS = Settings.from_env({}, max_chars=20, default_seed=77)


def test_defaults_fill_missing_fields():
    request, output = synthesize_request({"text": "你好"}, SETTINGS)
    assert request.text == "你好"
    assert request.seed == 77
    assert request.refine_text is False
    assert request.voice is None and request.speed == 5 and request.normalize is True
    assert (request.temperature, request.top_p, request.top_k) == (0.3, 0.7, 20)
    assert output.format == "wav" and output.stream is False


def test_text_is_normalised_for_model_and_cache_alike():
    assert normalise_text("  Hello \n\t world\x07 ") == "Hello world"
    # NFC: a decomposed "é" and the composed one are the same text
    assert normalise_text("e\u0301") == "\u00e9"


@pytest.mark.parametrize(
    "body,message",
    [
        ({}, "give either 'text' \\(a text, or SSML\\) or 'turns'"),
        ({"text": 5}, "must be a string"),
        ({"text": ["a"]}, "must be a string"),
        ({"text": "   \n "}, "must not be empty"),
        ({"text": "hi", "seed": "1"}, "'seed' must be an integer"),
        ({"text": "hi", "seed": 1.5}, "'seed' must be an integer"),
        ({"text": "hi", "seed": True}, "'seed' must be an integer"),
        ({"text": "hi", "seed": -1}, "between 0 and 2147483647"),
        ({"text": "hi", "seed": 2**31}, "between 0 and 2147483647"),
        ({"text": "hi", "seed": 2.0**31}, "between 0 and 2147483647"),
        ({"text": "hi", "refine_prompt": {}}, "'refine_prompt' must be a string"),
        ({"text": "hi", "refine_text": "yes"}, "'refine_text' must be true or false"),
        ({"text": "hi", "pitch": 2}, "unknown fields: pitch"),
        ({"text": "a\ud800b"}, "surrogate"),
        ({"text": "hi", "speed": 0.1}, "'speed' must be between 0.25 and 4"),
        ({"text": "hi", "speed": "fast"}, "'speed' must be a number"),
        ({"text": "hi", "temperature": 0}, "'temperature' must be between"),
        ({"text": "hi", "top_p": 1.5}, "'top_p' must be between"),
        ({"text": "hi", "top_k": 2.5}, "'top_k' must be an integer"),
        ({"text": "hi", "top_k": 0}, "'top_k' must be between 1 and 100"),
        (
            {"text": "hi", "format": "m4a"},
            "'format' must be one of mp3, opus, flac, wav, pcm, aac, ulaw, alaw",
        ),
        ({"text": "hi", "format": "flac", "stream": True}, "cannot be streamed"),
        ({"text": "hi", "stream": "yes"}, "'stream' must be true or false"),
        ({"text": "hi", "normalize": 1}, "'normalize' must be true or false"),
        ({"text": "hi [cough] there"}, r"unknown control token\(s\) \[cough\]"),
        ({"text": "hi", "refine_prompt": "[oral_2]"}, "set 'refine_text': true"),
        ({"text": "hi", "refine_text": True, "refine_prompt": "[laugh_7]"}, "out of range"),
        ({"text": "hi", "refine_text": True, "refine_prompt": "be happy"}, "may only hold"),
        ({"text": "hi", "voice": "seed:x"}, "voices are not available"),
    ],
)
def test_bad_bodies_are_400_with_a_reason(body, message):
    with pytest.raises(BadRequest, match=message):
        synthesize_request(body, SETTINGS)


def test_text_over_the_limit_is_413():
    with pytest.raises(PayloadTooLarge, match="21 characters; the limit is 20"):
        synthesize_request({"text": "x" * 21}, SETTINGS)
    assert synthesize_request({"text": "x" * 20}, SETTINGS)[0].text == "x" * 20


def test_too_many_control_tokens_is_400():
    settings = Settings.from_env({}, max_control_tokens=2)
    synthesize_request({"text": "a[uv_break]b[laugh]"}, settings)
    with pytest.raises(BadRequest, match="3 control tokens; the limit is 2"):
        synthesize_request({"text": "a[uv_break]b[laugh]c[lbreak]"}, settings)


@pytest.mark.parametrize(
    "speed,level", [(0.25, 1), (0.5, 3), (0.8, 4), (1.0, 5), (1.25, 6), (2.0, 7), (4.0, 9)]
)
def test_speed_maps_onto_chattts_levels(speed, level):
    assert speed_level(speed) == level
    request, _ = synthesize_request({"text": "hi", "speed": speed}, SETTINGS)
    assert request.speed == level


def test_openai_request_fields(tmp_path):
    import torch

    from chattts_service.domain.voice_store import VoiceStore

    voices = VoiceStore(tmp_path, 4, lambda seed: torch.full((4,), float(seed)))
    request, output = speech_request(
        {"model": "tts-1", "input": "hello", "voice": "seed:3"}, SETTINGS, voices
    )
    assert output.format == "mp3" and request.text == "hello"
    assert request.voice.name == "seed:3"
    with pytest.raises(BadRequest, match="'voice' is required"):
        speech_request({"model": "tts-1", "input": "hello", "voice": None}, SETTINGS, voices)
    for body, message in [
        ({"input": "a", "voice": "alloy"}, "'model' is required"),
        ({"model": "whisper", "input": "a", "voice": "alloy"}, "unknown model"),
        ({"model": "tts-1", "input": "a"}, "'voice' is required"),
        ({"model": "tts-1", "text": "a", "voice": "alloy"}, "unknown fields: text"),
        ({"model": "tts-1", "input": "a", "voice": "alloy", "instructions": 3}, "a string"),
        (
            {"model": "tts-1", "input": "a", "voice": "alloy", "instructions": "x" * 4097},
            "longer than 4096",
        ),
    ]:
        with pytest.raises(BadRequest, match=message):
            speech_request(body, SETTINGS, voices)
    # instructions are taken (and not applied) unless the operator refuses them
    whisper = {"model": "tts-1", "input": "a", "voice": "alloy", "instructions": "whisper"}
    assert speech_request(whisper, SETTINGS, voices)[0].text == "a"
    refusing = Settings.from_env({"CHATTTS_INSTRUCTIONS": "refuse"})
    with pytest.raises(BadRequest, match="not supported"):
        speech_request(whisper, refusing, voices)


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


def test_integers_take_integral_json_numbers_as_json_schema_does():
    request, _ = synthesize_request({"text": "hi", "top_k": 4.0, "seed": 12.0}, SETTINGS)
    assert request.top_k == 4 and isinstance(request.top_k, int)
    assert request.seed == 12 and isinstance(request.seed, int)


def test_null_options_mean_their_defaults():
    body = {
        "text": "hi",
        "seed": None,
        "voice": None,
        "speed": None,
        "top_k": None,
        "format": None,
        "stream": None,
        "refine_prompt": None,
        "normalize": None,
    }
    request, output = synthesize_request(body, SETTINGS)
    assert request.seed == 77 and request.top_k == 20 and output.format == "wav"


def test_text_length_counts_the_code_points_sent():
    # JSON Schema's maxLength counts what the client sent, before white space is collapsed
    with pytest.raises(PayloadTooLarge, match="21 characters; the limit is 20"):
        synthesize_request({"text": "a" + " " * 20}, SETTINGS)
    request, _ = synthesize_request({"text": "a" + " " * 19}, SETTINGS)
    assert request.text == "a"
