"""The OpenAPI 3.1 document served at /openapi.json.

Built from the definitions the validation enforces (the numeric fields, the formats, the
control tokens, the voice names, the settings' bounds), so a field is never checked otherwise
than it is documented; every status a route can answer is listed with its error schema.
"""

from __future__ import annotations

from chattts_service.api.bodies import captioned_request, speech_request, voice_schema
from chattts_service.api.schemas import CAPTIONED_SPEECH, SPEECH_EVENT, VOICE_NAME
from chattts_service.api.validation import MODEL_IDS
from chattts_service.config import Settings
from chattts_service.domain.voices import MAX_EMBEDDING_CHARS
from chattts_service.inference.policy import KNOBS
from chattts_service.services.audio import FORMATS
from chattts_service.services.consents import CONSENT_ID, LANGUAGE, MAX_LABEL_CHARS, MAX_PAGE
from chattts_service.services.recordings import (
    MAX_SAMPLE_SECONDS,
    MAX_TRANSCRIPT_CHARS,
    MIN_SAMPLE_SECONDS,
)


def _error(description: str, openai: bool) -> dict:
    name = "OpenAIError" if openai else "Error"
    schema = {"$ref": f"#/components/schemas/{name}"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(openai: bool, *codes: int) -> dict:
    meaning = {
        400: "A field missing, of the wrong type or out of range; unknown fields; a body "
        "that is not a JSON object",
        401: "API keys are configured and the request has none or a wrong one",
        403: "The endpoint needs API keys to be configured (CHATTTS_API_KEYS)",
        404: "No such resource",
        409: "A voice of that name exists (send replace: true), or as many voices or "
        "consents are kept as CHATTTS_MAX_STORED_VOICES allows",
        413: "A text longer than CHATTTS_MAX_CHARS, a JSON body over 64 KiB, or a recording "
        "over 10 MiB",
        415: "Content-Type is not application/json (or multipart/form-data where a recording "
        "is sent), or a recording of a type that is not audio",
        422: "Well-formed but not usable: nothing speakable after normalisation, too many "
        "control tokens, a string that is not a speaker embedding, or a recording that is not "
        "audio, is silent, or is too short or too long",
        503: "Not ready (loading, warming up), the queue has no room, the estimated wait is "
        "too long, or shutting down; Retry-After says when to try again",
        504: "Not finished within CHATTTS_REQUEST_TIMEOUT_S; the work was dropped",
    }
    return {str(code): _error(meaning[code], openai) for code in codes}


BODY_ERRORS = (400, 401, 413, 415)


def _audio_responses(openai: bool) -> dict:
    audio = {"schema": {"type": "string", "format": "binary"}}
    content = {FORMATS[name][0]: audio for name in FORMATS if name != "pcm"}
    content["audio/L16"] = audio
    # stream_format "sse": each event (this schema, as OpenAPI 3.1 reads it) holds one JSON object
    content["text/event-stream"] = {"schema": SPEECH_EVENT}
    ok = {
        "description": "Audio. Headers: X-Cache (HIT/MISS), X-Audio-Seconds, X-Segments (how "
        "many segments a long text was split into).",
        "content": content,
    }
    return {"200": ok, **_errors(openai, *BODY_ERRORS, 422, 503, 504)}


def _tuning(limits: dict) -> dict:
    properties = {
        name: {"type": "integer", "minimum": limits[name].low, "maximum": limits[name].high}
        for name in KNOBS
    }
    return {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": properties,
    }


def _path_name(pattern: str | None = None, enum: list[str] | None = None, example=None) -> list:
    schema = {"type": "string"}
    if pattern:
        schema["pattern"] = pattern
    if enum:
        schema["enum"] = enum
    parameter = {"name": "name", "in": "path", "required": True, "schema": schema}
    if example:
        parameter["example"] = example
    return [parameter]


def _json_body(name: str) -> dict:
    schema = {"$ref": f"#/components/schemas/{name}"}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _ok(description: str) -> dict:
    return {"200": {"description": description}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _object(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {}}}}


def _query(name: str, schema: dict) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _consent_id() -> list:
    schema = {"type": "string", "pattern": CONSENT_ID.pattern}
    return [{"name": "consent_id", "in": "path", "required": True, "schema": schema}]


# what a recording may be labelled (services/recordings.py takes these, and unlabelled bytes)
AUDIO_TYPES = "audio/mpeg, audio/wav, audio/ogg, audio/aac, audio/flac, audio/webm, audio/mp4"


# Long: the whole document as one literal shows every path beside its neighbours; field types
# and bounds come from the shared definitions above.
def document(settings: Settings, voices: list[str], limits: dict) -> dict:
    """``voices``: the names a request may use now; ``limits``: the batching policy's bounds."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ChatTTS service",
            "version": "1",
            "description": "Text to speech with ChatTTS on the CPU. Audio is 24 kHz mono.",
        },
        "paths": {
            "/synthesize": {
                "post": {
                    "summary": "Synthesise speech (WAV by default)",
                    "requestBody": _json_body("SynthesizeRequest"),
                    "responses": _audio_responses(openai=False),
                }
            },
            "/v1/audio/speech": {
                "post": {
                    "summary": "OpenAI-compatible speech (MP3 by default)",
                    "requestBody": _json_body("SpeechRequest"),
                    "responses": _audio_responses(openai=True),
                }
            },
            "/v1/audio/captioned_speech": {
                "post": {
                    "summary": "Speech with a caption per sentence, timed to the sample (JSON: "
                    "base64 audio, captions, and SubRip or WebVTT when asked)",
                    "requestBody": _json_body("CaptionedSpeechRequest"),
                    "responses": {
                        "200": {
                            "description": "Audio and captions. Headers as /v1/audio/speech.",
                            "content": {"application/json": {"schema": CAPTIONED_SPEECH}},
                        },
                        **_errors(True, *BODY_ERRORS, 422, 503, 504),
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "Model names accepted in 'model'",
                    "responses": {**_ok("OpenAI model list"), **_errors(True, 401)},
                }
            },
            "/v1/models/{name}": {
                "get": {
                    "summary": "One model",
                    "parameters": _path_name(enum=list(MODEL_IDS), example="tts-1"),
                    "responses": {**_ok("OpenAI model object"), **_errors(True, 401, 404)},
                }
            },
            "/v1/audio/voices": {
                "get": {
                    "summary": "Named voices",
                    "responses": {**_ok("{voices: [names]}"), **_errors(True, 401, 503)},
                },
                "post": {
                    "summary": "A voice from a recording (multipart, as OpenAI's clients send "
                    "it: audio_sample, consent, name, and the sample's transcript), or a named "
                    "voice from a ChatTTS speaker embedding string or another voice (JSON)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": _ref("VoiceRequest")},
                            "multipart/form-data": {
                                "schema": _ref("VoiceSampleRequest"),
                                "encoding": {"audio_sample": {"contentType": AUDIO_TYPES}},
                            },
                        },
                    },
                    "responses": {
                        "201": _object("The voice (OpenAI's Voice object for a recording)"),
                        **_errors(True, *BODY_ERRORS, 404, 409, 422, 503),
                    },
                },
            },
            "/v1/audio/voices/{name}": {
                "get": {
                    "summary": "One voice, by name or id",
                    "parameters": _path_name(pattern=VOICE_NAME, example="narrator"),
                    "responses": {**_ok("The voice"), **_errors(True, 400, 401, 404, 503)},
                },
                "delete": {
                    "summary": "Delete a stored voice, by name or id",
                    "parameters": _path_name(pattern=VOICE_NAME, example="narrator"),
                    "responses": {
                        **_ok("OpenAI's VoiceDeleted object"),
                        **_errors(True, 400, 401, 404, 503),
                    },
                },
            },
            "/v1/audio/voice_consents": {
                "get": {
                    "summary": "Voice consents, newest first (OpenAI's cursor paging)",
                    "parameters": [
                        _query("after", {"type": "string", "pattern": CONSENT_ID.pattern}),
                        _query(
                            "limit",
                            {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": 20},
                        ),
                    ],
                    "responses": {**_ok("A list page"), **_errors(True, 400, 401, 404)},
                },
                "post": {
                    "summary": "Record a speaker's consent to voices made from them (the "
                    "recording is kept for audit)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "multipart/form-data": {
                                "schema": _ref("VoiceConsentRequest"),
                                "encoding": {"recording": {"contentType": AUDIO_TYPES}},
                            }
                        },
                    },
                    "responses": {
                        "201": _object("OpenAI's VoiceConsent object"),
                        **_errors(True, *BODY_ERRORS, 409, 422),
                    },
                },
            },
            "/v1/audio/voice_consents/{consent_id}": {
                "get": {
                    "summary": "One consent",
                    "parameters": _consent_id(),
                    "responses": {**_ok("VoiceConsent"), **_errors(True, 401, 404)},
                },
                "post": {
                    "summary": "Rename a consent",
                    "parameters": _consent_id(),
                    "requestBody": _json_body("VoiceConsentUpdate"),
                    "responses": {
                        **_ok("VoiceConsent"),
                        **_errors(True, *BODY_ERRORS, 404),
                    },
                },
                "delete": {
                    "summary": "Delete a consent and its recording",
                    "parameters": _consent_id(),
                    "responses": {**_ok("VoiceConsentDeleted"), **_errors(True, 401, 404)},
                },
            },
            "/admin/config": {
                "get": {
                    "summary": "Batching settings in effect, and their limits (API key)",
                    "responses": {**_ok("Settings"), **_errors(False, 401, 403, 503)},
                },
                "post": {
                    "summary": "Change max_batch, batch_wait_ms, max_queue, max_wait_s on the "
                    "running server (API key)",
                    "requestBody": _json_body("TuningRequest"),
                    "responses": {
                        **_ok("Settings now in effect"),
                        **_errors(False, *BODY_ERRORS, 403, 503),
                    },
                },
            },
            "/healthz": {"get": {"summary": "Liveness", "responses": _ok("Alive")}},
            "/readyz": {
                "get": {
                    "summary": "Readiness: 200 once loaded and warmed up",
                    "responses": {**_ok("Ready"), **_errors(False, 503)},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {**_ok("Prometheus text format"), **_errors(False, 401)},
                }
            },
            "/": {
                "get": {
                    "summary": "The playground page (HTML, no external assets)",
                    "responses": _ok("HTML"),
                }
            },
            "/status": {
                "get": {
                    "summary": "Service status for the playground: state, queue, cache, recent "
                    "latency and real-time factor, degraded mode, model, uptime",
                    "responses": {**_ok("Status object"), **_errors(False, 401)},
                }
            },
            "/openapi.json": {"get": {"summary": "This document", "responses": _ok("OpenAPI 3.1")}},
        },
        "components": {
            "schemas": {
                "SynthesizeRequest": speech_request(
                    settings, voices, "text", "format", "wav", openai=False
                ),
                "SpeechRequest": speech_request(
                    settings, voices, "input", "response_format", "mp3", openai=True
                ),
                "CaptionedSpeechRequest": captioned_request(settings, voices),
                "VoiceRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "oneOf": [{"required": ["embedding"]}, {"required": ["voice"]}],
                    "properties": {
                        "name": {"type": "string", "pattern": VOICE_NAME},
                        "embedding": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": MAX_EMBEDDING_CHARS,
                            "description": "ChatTTS speaker embedding string",
                        },
                        "voice": {
                            **voice_schema(voices, required=True),
                            "description": "Store this voice under the name: a blend such as "
                            "alloy(2)+echo(1), seed:N, or another voice.",
                        },
                        "replace": {"type": "boolean", "default": False},
                    },
                },
                "VoiceSampleRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["audio_sample", "consent", "name"],
                    "properties": {
                        "audio_sample": {
                            "type": "string",
                            "format": "binary",
                            "description": "The recording: mp3, wav, ogg/opus, aac, flac, webm "
                            f"or mp4, at most 10 MiB, {MIN_SAMPLE_SECONDS:g} to "
                            f"{MAX_SAMPLE_SECONDS:g} s of clear speech",
                        },
                        "consent": {"type": "string", "pattern": CONSENT_ID.pattern},
                        "name": {"type": "string", "pattern": VOICE_NAME},
                        "type": {"type": "string", "enum": ["audio_sample"]},
                        "transcript": {
                            "type": "string",
                            "maxLength": MAX_TRANSCRIPT_CHARS,
                            "pattern": r"^[^\[\]]*$",
                            "description": "The words spoken in the sample (ChatTTS's txt_smp; "
                            "OpenAI clients send it through extra_body)",
                        },
                    },
                },
                "VoiceConsentRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["recording", "name", "language"],
                    "properties": {
                        "recording": {"type": "string", "format": "binary"},
                        "name": {"type": "string", "maxLength": MAX_LABEL_CHARS, "pattern": r"\S"},
                        "language": {"type": "string", "pattern": LANGUAGE.pattern},
                    },
                },
                "VoiceConsentUpdate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "name": {"type": "string", "maxLength": MAX_LABEL_CHARS, "pattern": r"\S"}
                    },
                },
                "TuningRequest": _tuning(limits),
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {"error": {"type": "string"}},
                },
                "OpenAIError": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                },
            }
        },
    }
