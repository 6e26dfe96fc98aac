"""The OpenAPI document is the contract: schemathesis, every check, finds nothing.

A real server on loopback (tiny model), its own /openapi.json, every phase (examples, coverage,
fuzzing, stateful), every check, with API keys (so the admin and authenticated paths are
reached) and without, and with a registered voice so the voice routes have data to act on.
Bounded: a few dozen examples per operation, one request at a time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from hypothesis import example, given, settings
from hypothesis import strategies as st

from chattts_service.api.models import blend_pattern, seed_voice_pattern, text_patterns
from chattts_service.api.validation import json_body
from chattts_service.domain.text import TextError, check_tokens
from chattts_service.domain.voices import SEED_VOICE

KEY = "contract-key-0123456789abcdef"
CONFIG = Path(__file__).with_name("schemathesis.toml")
ROOT = str(Path(__file__).resolve().parent.parent)


def _schemathesis(server, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "schemathesis"),
            "--config-file",
            str(CONFIG),
            "run",
            server.url + "/openapi.json",
            "--checks",
            "all",
            "--phases",
            "examples,coverage,fuzzing,stateful",
            "--max-examples",
            "25",
            "--max-response-time",
            "120",
            "--request-timeout",
            "120",
            "--generation-deterministic",
            "--no-color",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        # what it may send (tests/schemathesis_hooks.py), importable from the repository
        env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks", "PYTHONPATH": ROOT},
        cwd=ROOT,
    )


def _register_voice(server, headers: dict) -> None:
    import torch

    from chattts_service.domain.embeddings import encode_embedding
    from chattts_service.tools.testmodel import TINY

    dim = TINY["gpt"]["hidden_size"]
    embedding = encode_embedding(torch.randn(dim, generator=torch.Generator().manual_seed(3)))
    answer = requests.post(
        server.url + "/v1/audio/voices",
        json={"name": "narrator", "embedding": embedding},
        headers=headers,
        timeout=30,
    )
    assert answer.status_code == 201, answer.text


@pytest.mark.parametrize("keys", [True, False], ids=["with-keys", "without-keys"])
def test_schemathesis_with_every_check_finds_nothing(start_server, tmp_path, keys):
    settings_env = {
        "CHATTTS_MAX_NEW_TOKENS": "40",
        "CHATTTS_MAX_CHARS": "200",
        "CHATTTS_VOICES_DIR": str(tmp_path / "voices"),
    }
    headers = {}
    if keys:
        settings_env["CHATTTS_API_KEYS"] = KEY
        headers = {"Authorization": f"Bearer {KEY}"}
    server = start_server(**settings_env)
    server.wait_ready()
    _register_voice(server, headers)
    extra = ("-H", f"Authorization: Bearer {KEY}") if keys else ()
    # The document lists the voices that exist when it is fetched: deleting the registered
    # one midway would make later speech requests that name it invalid. The delete route is
    # exercised in a second run, after everything else.
    for scope in (("--exclude-method", "DELETE"), ("--include-method", "DELETE")):
        result = _schemathesis(server, *extra, *scope)
        assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
        assert re.search(r"\b[1-9]\d* generated, [1-9]\d* passed", result.stdout), result.stdout[
            -2000:
        ]


def test_a_method_a_route_does_not_take_gets_405_with_allow(start_server):
    server = start_server(CHATTTS_WARMUP="0")
    server.wait_ready()
    answer = requests.request("TRACE", server.url + "/healthz", timeout=10)
    assert answer.status_code == 405 and "GET" in answer.headers["Allow"]
    assert answer.json()["error"]
    answer = requests.put(server.url + "/v1/audio/speech", json={}, timeout=10)
    assert answer.status_code == 405
    assert {method.strip() for method in answer.headers["Allow"].split(",")} == {"POST", "OPTIONS"}
    assert answer.json()["error"]["code"] == "method_not_allowed"


# -- the document's patterns say what the service enforces -----------------------------------


PIECES = st.sampled_from(["[", "]", "a", " ", "laugh", "uv_break", "x_y", "你"])


@settings(max_examples=400, deadline=None)
@given(st.lists(PIECES, max_size=12).map("".join))
def test_the_text_pattern_accepts_exactly_the_control_tokens_the_service_takes(text):
    whole, _ = text_patterns()
    try:
        check_tokens(text, 10_000)
        taken = True
    except TextError:
        taken = False
    assert bool(re.search(whole, text)) == taken


CONTROL_PIECES = st.sampled_from(["[", "]", "laugh", "lau", "gh", "\x01", "\x7f", "a", " "])


@settings(max_examples=400, deadline=None)
@given(st.lists(CONTROL_PIECES, min_size=1, max_size=10).map("".join))
def test_the_service_reads_control_tokens_as_sent_like_the_pattern(text):
    from chattts_service.api.errors import BadRequest
    from chattts_service.api.validation import synthesize_request
    from chattts_service.config import Settings
    from chattts_service.domain.text import normalise_text

    whole, _ = text_patterns()
    try:
        synthesize_request({"text": text}, Settings.from_env({}))
        taken = True
    except BadRequest:
        taken = False
    # (a text with nothing to say passes here and is a 422 later, as documented)
    assert taken == bool(re.search(whole, text) and normalise_text(text)), repr(text)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**11), st.integers(min_value=0, max_value=3))
def test_the_seed_voice_pattern_is_the_service_range(seed, zeros):
    name = "seed:" + "0" * zeros + str(seed)
    assert SEED_VOICE.match(name)
    assert bool(re.match(seed_voice_pattern(), name)) == (seed <= 2**31 - 1)


def test_deeply_nested_json_is_a_400_not_a_500():
    from chattts_service.api.errors import BadRequest

    with pytest.raises(BadRequest, match="nested too deeply"):
        json_body("application/json", b"[" * 5000 + b"]" * 5000)
    with pytest.raises(BadRequest, match="nested too deeply"):
        json_body("application/json", b'{"a":' * 5000 + b"1" + b"}" * 5000)


REFINE_PIECES = st.sampled_from(["[", "]", " ", "oral_", "laugh_", "break_", "2", "9", "x"])


@settings(max_examples=400, deadline=None)
@given(st.lists(REFINE_PIECES, max_size=10).map("".join))
def test_the_refine_prompt_pattern_is_what_the_service_takes(prompt):
    from chattts_service.api.models import refine_prompt_pattern
    from chattts_service.domain.text import check_refine_prompt

    try:
        check_refine_prompt(prompt)
        taken = True
    except TextError:
        taken = False
    assert bool(re.search(refine_prompt_pattern(), prompt)) == taken, repr(prompt)


def test_every_route_is_in_the_document_and_none_goes_undescribed():
    from flask import Blueprint

    from chattts_service.api.context import service_of
    from chattts_service.api.openapi import Context, document
    from chattts_service.app import create_app
    from chattts_service.config import Settings

    settings = Settings.from_env({})
    app = create_app(settings, start_loading=False)
    context = Context(settings, ["alloy"], service_of(app).admin.limits())
    paths = document(app, context)["paths"]
    routes = {
        (rule.rule.replace("<", "{").replace(">", "}"), method.lower())
        for rule in app.url_map.iter_rules()
        if rule.endpoint != "static"
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    assert routes == {(path, method) for path, item in paths.items() for method in item}
    extra = Blueprint("extra", __name__)
    extra.get("/undescribed")(lambda: "")
    app.register_blueprint(extra)
    with pytest.raises(TypeError, match="/undescribed has no @operation"):
        document(app, context)


BLEND_PIECES = st.sampled_from(["alloy", "echo", "ghost", "seed:7", "(", ")", "+", "2", ".5", "0"])


@settings(max_examples=400, deadline=None)
@given(st.lists(BLEND_PIECES, min_size=1, max_size=10).map("".join))
@example("alloyalloy(0)")  # an unknown voice at weight 0 was once taken as a weightless blend
def test_the_blend_pattern_is_what_the_service_resolves(spec):
    import torch

    from chattts_service.domain.voice_store import VoiceStore
    from chattts_service.domain.voices import UnusableBlend, VoiceError

    store = VoiceStore(Path("/nonexistent-voices"), 4, lambda seed: torch.full((4,), float(seed)))
    try:
        store.get(spec)
        resolved = True
    except UnusableBlend:  # well-formed, all weights 0: a 422, as documented
        resolved = True
    except VoiceError:
        resolved = False
    documented = bool(re.match(blend_pattern(["alloy", "echo"]), spec))
    plain = bool(re.match(r"^(alloy|echo)$", spec)) or bool(re.match(seed_voice_pattern(), spec))
    assert (documented or plain) == resolved, spec


# -- deep and odd JSON on every JSON route, over HTTP ------------------------------------------


def _deep(depth: int, kind: str) -> str:
    return "[" * depth + "]" * depth if kind == "array" else '{"a":' * depth + "1" + "}" * depth


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
ODD_BODIES = st.one_of(
    st.builds(
        _deep, st.integers(min_value=50, max_value=20_000), st.sampled_from(["array", "object"])
    ),
    st.builds(
        lambda field, depth, kind: json.dumps({field: None}).replace("null", _deep(depth, kind)),
        st.sampled_from(["text", "input", "voice", "name", "embedding", "max_batch"]),
        st.integers(min_value=50, max_value=20_000),
        st.sampled_from(["array", "object"]),
    ),
    JSON_VALUES.map(lambda value: json.dumps(value, allow_nan=True)),
    st.text(max_size=40),
)
JSON_ROUTES = [
    "/synthesize",
    "/v1/audio/speech",
    "/v1/audio/captioned_speech",
    "/v1/audio/voices",
    "/admin/config",
]


@pytest.fixture(scope="module")
def odd_server(start_server, tmp_path_factory):
    server = start_server(
        CHATTTS_MAX_NEW_TOKENS="20",
        CHATTTS_API_KEYS=KEY,
        CHATTTS_VOICES_DIR=str(tmp_path_factory.mktemp("voices")),
    )
    server.wait_ready()
    return server


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(JSON_ROUTES), ODD_BODIES)
def test_deep_and_odd_json_gets_a_clear_4xx_on_every_json_route(odd_server, route, body):
    answer = requests.post(
        odd_server.url + route,
        data=body.encode("utf-8", "surrogatepass"),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert 400 <= answer.status_code < 500 or answer.status_code == 200, (
        answer.status_code,
        body[:200],
    )
    if answer.status_code != 200:
        error = answer.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert message and "Traceback" not in message
