"""The OpenAPI 3.1 document served at /openapi.json, built from the same constants the
validation uses, so the ranges it states are the ranges enforced."""

from __future__ import annotations

from chattts_service.api.validation import MAX_SEED, MODEL_IDS, SPEED, TEMPERATURE, TOP_K, TOP_P
from chattts_service.config import Settings
from chattts_service.services.audio import FORMATS, STREAM_FORMATS
from chattts_service.services.text import INLINE_TOKENS
from chattts_service.services.voices import DEFAULT_VOICES


def _error(description: str, openai: bool = False) -> dict:
    schema = {
        "$ref": "#/components/schemas/OpenAIError" if openai else "#/components/schemas/Error"
    }
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _audio_responses(openai: bool) -> dict:
    audio = {"schema": {"type": "string", "format": "binary"}}
    content = {FORMATS[name][0]: audio for name in FORMATS if name != "pcm"}
    content["audio/L16"] = audio
    return {
        "200": {
            "description": "Audio. Headers: X-Cache (HIT/MISS), X-Audio-Seconds, "
            "X-Segments (how many segments a long text was split into).",
            "content": content,
        },
        "400": _error("Invalid field, unknown voice, unknown control token", openai),
        "413": _error("Text longer than CHATTTS_MAX_CHARS, or body over 64 KiB", openai),
        "415": _error("Content-Type is not application/json", openai),
        "422": _error("Nothing speakable left after normalisation", openai),
        "503": _error("Model not ready, or the queue is full (see Retry-After)", openai),
        "504": _error("Not finished within CHATTTS_REQUEST_TIMEOUT_S", openai),
    }


def _options(settings: Settings) -> dict:
    def number(spec, description, integer=False):
        default, low, high = spec
        return {
            "type": "integer" if integer else "number",
            "minimum": low,
            "maximum": high,
            "default": default,
            "description": description,
        }

    return {
        "voice": {
            "type": "string",
            "pattern": r"^([a-z0-9][a-z0-9_-]{0,63}|seed:\d{1,10})$",
            "description": "A named voice (see GET /v1/audio/voices; "
            f"{', '.join(DEFAULT_VOICES)} are always there) or seed:N. "
            "Without it /synthesize uses the voice of 'seed'.",
        },
        "seed": {
            "type": "integer",
            "minimum": 0,
            "maximum": MAX_SEED,
            "description": "Sampling seed (and the voice when 'voice' is absent).",
        },
        "speed": number(
            SPEED,
            "1 = normal. Mapped onto ChatTTS's [speed_0]..[speed_9] prompt "
            "(two levels per doubling: 0.5 -> 3, 1 -> 5, 2 -> 7, 4 -> 9); "
            "the model's own pace range is narrower than the numbers say.",
        ),
        "temperature": number(TEMPERATURE, "Sampling temperature of the speech codes."),
        "top_p": number(TOP_P, "Nucleus sampling threshold."),
        "top_k": number(TOP_K, "Top-k sampling.", integer=True),
        "refine_text": {
            "type": "boolean",
            "default": settings.refine_text,
            "description": "Let the model rewrite the text first (adds pauses, fillers, laughter).",
        },
        "refine_prompt": {
            "type": "string",
            "pattern": r"^(\[(oral_\d|laugh_[0-2]|break_[0-7])\])*$",
            "description": "Control tokens for refinement, e.g. "
            "[oral_2][laugh_0][break_6]; needs refine_text.",
        },
        "normalize": {
            "type": "boolean",
            "default": settings.normalize,
            "description": "Write numbers, dates, times, money, units and phone "
            "numbers out in words (wetext, zh and en) first.",
        },
        "stream": {
            "type": "boolean",
            "default": False,
            "description": "Send audio while it is generated (chunked; "
            f"{' or '.join(STREAM_FORMATS)} only).",
        },
    }


def _text(settings: Settings) -> dict:
    return {
        "type": "string",
        "minLength": 1,
        "maxLength": settings.max_chars,
        "description": "Chinese and/or English. Inline control tokens allowed: "
        f"{', '.join(INLINE_TOKENS)} (at most {settings.max_control_tokens}). "
        "Long text is split at sentence boundaries.",
    }


def document(settings: Settings) -> dict:
    options = _options(settings)
    formats = list(FORMATS)

    def json_body(ref: str) -> dict:
        return {"required": True, "content": {"application/json": {"schema": {"$ref": ref}}}}

    def plain(description: str) -> dict:
        return {"200": {"description": description}}

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
                    "requestBody": json_body("#/components/schemas/SynthesizeRequest"),
                    "responses": _audio_responses(openai=False),
                }
            },
            "/v1/audio/speech": {
                "post": {
                    "summary": "OpenAI-compatible speech (MP3 by default)",
                    "requestBody": json_body("#/components/schemas/SpeechRequest"),
                    "responses": _audio_responses(openai=True),
                }
            },
            "/v1/models": {
                "get": {
                    "summary": "Model names accepted in 'model'",
                    "responses": plain("OpenAI model list"),
                }
            },
            "/v1/models/{name}": {
                "get": {
                    "summary": "One model",
                    "parameters": [
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        **plain("OpenAI model object"),
                        "404": _error("No such model", True),
                    },
                }
            },
            "/v1/audio/voices": {
                "get": {"summary": "Named voices", "responses": plain("{voices: [names]}")},
                "post": {
                    "summary": "Register a voice from a ChatTTS speaker embedding string",
                    "requestBody": json_body("#/components/schemas/VoiceRequest"),
                    "responses": {
                        "201": {"description": "Registered"},
                        "400": _error("Bad name or embedding, or it exists", True),
                    },
                },
            },
            "/v1/audio/voices/{name}": {
                "delete": {
                    "summary": "Delete a registered voice",
                    "parameters": [
                        {
                            "name": "name",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string"},
                        }
                    ],
                    "responses": {
                        **plain("Deleted"),
                        "404": _error("No stored voice", True),
                        "400": _error("Invalid name", True),
                    },
                }
            },
            "/admin/config": {
                "get": {
                    "summary": "Batching settings in effect, and their limits (API key)",
                    "responses": {**plain("Settings"), "403": _error("No API keys configured")},
                },
                "post": {
                    "summary": "Change max_batch, batch_wait_ms, max_queue, max_wait_s "
                    "on the running server (API key)",
                    "requestBody": json_body("#/components/schemas/TuningRequest"),
                    "responses": {
                        **plain("Settings now in effect"),
                        "400": _error("Out of range or unknown"),
                        "403": _error("No API keys configured"),
                    },
                },
            },
            "/healthz": {"get": {"summary": "Liveness", "responses": plain("Alive")}},
            "/readyz": {
                "get": {
                    "summary": "Readiness: 200 once loaded and warmed up",
                    "responses": {**plain("Ready"), "503": _error("Loading, warming up or failed")},
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": plain("Prometheus text format"),
                }
            },
            "/": {
                "get": {
                    "summary": "The playground page (HTML, no external assets)",
                    "responses": plain("HTML"),
                }
            },
            "/status": {
                "get": {
                    "summary": "Service status for the playground: state, queue, cache, recent "
                    "latency and real-time factor, degraded mode, model, uptime",
                    "responses": plain("Status object"),
                }
            },
            "/openapi.json": {
                "get": {"summary": "This document", "responses": plain("OpenAPI 3.1")}
            },
        },
        "components": {
            "schemas": {
                "SynthesizeRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["text"],
                    "properties": {
                        "text": _text(settings),
                        "format": {"type": "string", "enum": formats, "default": "wav"},
                        **options,
                    },
                },
                "SpeechRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["model", "input", "voice"],
                    "properties": {
                        "model": {"type": "string", "enum": list(MODEL_IDS)},
                        "input": _text(settings),
                        "response_format": {"type": "string", "enum": formats, "default": "mp3"},
                        "instructions": {
                            "type": "string",
                            "maxLength": 0,
                            "description": "Not supported; must be empty.",
                        },
                        **options,
                    },
                },
                "VoiceRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "embedding"],
                    "properties": {
                        "name": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9_-]{0,63}$"},
                        "embedding": {
                            "type": "string",
                            "maxLength": 16384,
                            "description": "ChatTTS speaker embedding string",
                        },
                        "replace": {"type": "boolean", "default": False},
                    },
                },
                "TuningRequest": {
                    "type": "object",
                    "additionalProperties": False,
                    "minProperties": 1,
                    "properties": {
                        "max_batch": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": settings.max_batch,
                        },
                        "batch_wait_ms": {"type": "integer", "minimum": 0, "maximum": 2000},
                        "max_queue": {"type": "integer", "minimum": 1, "maximum": 4096},
                        "max_wait_s": {"type": "integer", "minimum": 0, "maximum": 3600},
                    },
                },
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
                                "param": {},
                                "code": {},
                            },
                        }
                    },
                },
            }
        },
    }
