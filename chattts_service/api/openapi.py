"""The OpenAPI 3.1 document served at /openapi.json, generated from the routes themselves.

Each view carries its ``Operation`` (``@operation(...)`` beside its route): a summary, the
model of its body or query, its answer, and the error statuses it can give. ``document`` walks
the app's URL map, so every route is described and nothing else is; every schema is a model's
own (``models.py``), so a field is never checked otherwise than it is documented.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flask import Flask
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode, models_json_schema

from chattts_service.api import answers, models
from chattts_service.config import Bounds, Settings
from chattts_service.services.audio import FORMATS

COMPONENTS = "#/components/schemas/"
VOICE_REFERENCE = "VoiceReference"  # the voices a request may name now
# what each status means, in every route's list of errors
ERRORS = {
    400: "A field missing, of the wrong type or out of range; unknown fields; a body that is "
    "not a JSON object",
    401: "API keys are configured and the request has none or a wrong one",
    403: "The endpoint needs API keys to be configured (CHATTTS_API_KEYS)",
    404: "No such resource",
    409: "A voice of that name exists (send replace: true), or as many voices or consents are "
    "kept as CHATTTS_MAX_STORED_VOICES allows",
    413: "A text longer than CHATTTS_MAX_CHARS, a JSON body over 64 KiB, or a recording over "
    "10 MiB",
    415: "Content-Type is not application/json (or multipart/form-data where a recording is "
    "sent), or a recording of a type that is not audio",
    422: "Well-formed but not usable: nothing speakable after normalisation, too many control "
    "tokens, a string that is not a speaker embedding, or a recording that is not audio, is "
    "silent, or is too short or too long",
    503: "Not ready (loading, warming up), the queue has no room, the estimated wait is too "
    "long, or shutting down; Retry-After says when to try again",
    504: "Not finished within CHATTTS_REQUEST_TIMEOUT_S; the work was dropped",
}
BODY_ERRORS = (400, 401, 413, 415)
AUDIO = "audio"  # an Operation's answer: audio in any format, or speech events


@dataclass(frozen=True)
class Context:
    """What the document depends on at run time."""

    settings: Settings
    voices: list[str]  # the names a request may use now
    limits: dict[str, Bounds]  # the batching policy's bounds


Model = type[BaseModel] | Callable[[Context], type[BaseModel]]
# a model's place in the components, by the model and whether it is read or written
Refs = Mapping[tuple[Any, JsonSchemaMode], Any]
Ref = Callable[[type[BaseModel], JsonSchemaMode], dict[str, Any]]


@dataclass(frozen=True)
class Operation:
    summary: str
    answer: Any = None  # a model, AUDIO, or None (described in ``described``)
    described: str = ""
    status: int = 200
    errors: tuple[int, ...] = ()
    body: Model | None = None  # a JSON body
    form: type[BaseModel] | None = None  # a multipart body (may come beside ``body``)
    query: type[BaseModel] | None = None
    path: dict[str, Any] = field(default_factory=dict)  # parameter -> its type
    others: dict[int, tuple[type[BaseModel], str]] = field(default_factory=dict)  # not errors


View = TypeVar("View", bound=Callable[..., Any])


def operation(summary: str, **details: Any) -> Callable[[View], View]:
    """Describe the view in the document (put it under the route's decorator)."""

    def describe(view: View) -> View:
        setattr(view, "operation", Operation(summary, **details))  # noqa: B010
        return view

    return describe


class _Schemas(GenerateJsonSchema):
    """Models' schemas without the titles pydantic makes up for every field."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _model(model: Model | None, context: Context) -> type[BaseModel] | None:
    if model is None or isinstance(model, type):
        return model
    return model(context)


def document(app: Flask, context: Context) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    wanted: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}  # in order, each once
    operations = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        described = getattr(app.view_functions[rule.endpoint], "operation", None)
        if described is None:
            raise TypeError(f"{rule.rule} has no @operation: say what it does and answers")
        path = rule.rule.replace("<", "{").replace(">", "}")
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            operations.append((path, method.lower(), described))
            for model, mode in _models_of(described, context):
                wanted[(model, mode)] = None
    refs, definitions = models_json_schema(
        list(wanted), ref_template=COMPONENTS + "{model}", schema_generator=_Schemas
    )
    schemas = definitions.get("$defs", {})
    for path, method, described in operations:
        openai = path.startswith("/v1/")
        paths.setdefault(path, {})[method] = _operation(described, context, refs, openai)
    schemas[VOICE_REFERENCE] = models.voice_schema(context.voices)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ChatTTS service",
            "version": "1",
            "description": "Text to speech with ChatTTS on the CPU. Audio is 24 kHz mono.",
        },
        "paths": paths,
        "components": {"schemas": _mark_voices(schemas)},
    }


def _models_of(
    described: Operation, context: Context
) -> Iterator[tuple[type[BaseModel], JsonSchemaMode]]:
    for model in (_model(described.body, context), described.form):
        if model is not None:
            yield model, "validation"
    answer = described.answer
    if answer is AUDIO:
        yield answers.SpeechAudioDelta, "serialization"
        yield answers.SpeechAudioDone, "serialization"
    elif answer is not None:
        yield answer, "serialization"
    for model, _ in described.others.values():
        yield model, "serialization"
    yield answers.Error, "serialization"
    yield answers.OpenAIError, "serialization"


def _operation(described: Operation, context: Context, refs: Refs, openai: bool) -> dict[str, Any]:
    def ref(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, Any]:
        return dict(refs[(model, mode)])

    result: dict[str, Any] = {"summary": described.summary}
    parameters = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": TypeAdapter(kind).json_schema(schema_generator=_Schemas),
        }
        for name, kind in described.path.items()
    ]
    if described.query is not None:
        schema = described.query.model_json_schema(schema_generator=_Schemas)
        required = set(schema.get("required", ()))
        parameters += [
            {"name": name, "in": "query", "required": name in required, "schema": item}
            for name, item in schema["properties"].items()
        ]
    if parameters:
        result["parameters"] = parameters
    content = {}
    body = _model(described.body, context)
    if body is not None:
        content["application/json"] = {"schema": ref(body, "validation")}
    if described.form is not None:
        content["multipart/form-data"] = {
            "schema": ref(described.form, "validation"),
            "encoding": {name: {"contentType": models.AUDIO_TYPES} for name in _files(described)},
        }
    if content:
        result["requestBody"] = {"required": True, "content": content}
    error = ref(answers.OpenAIError if openai else answers.Error, "serialization")
    result["responses"] = {
        str(described.status): _answer(described, ref),
        **{
            str(code): {
                "description": ERRORS[code],
                "content": {"application/json": {"schema": error}},
            }
            for code in described.errors
        },
        **{
            str(code): {
                "description": meaning,
                "content": {"application/json": {"schema": ref(model, "serialization")}},
            }
            for code, (model, meaning) in described.others.items()
        },
    }
    return result


def _files(described: Operation) -> list[str]:
    """The form's file fields: those typed ``models.Upload``."""
    if described.form is None:
        return []
    schema = described.form.model_json_schema(schema_generator=_Schemas)
    return [name for name, item in schema["properties"].items() if item.get("format") == "binary"]


def _answer(described: Operation, ref: Ref) -> dict[str, Any]:
    if described.answer is AUDIO:
        audio = {"schema": {"type": "string", "format": "binary"}}
        content = {FORMATS[name][0]: audio for name in FORMATS if name != "pcm"}
        content["audio/L16"] = audio
        # stream_format "sse": each event holds one JSON object in its data
        content["text/event-stream"] = {"schema": _speech_event(ref)}
        return {
            "description": "Audio. Headers: X-Cache (HIT/MISS), X-Audio-Seconds, X-Segments (how "
            "many segments a long text was split into).",
            "content": content,
        }
    if described.answer is None:
        return {"description": described.described}
    return {
        "description": described.described or described.answer.__doc__ or "",
        "content": {"application/json": {"schema": ref(described.answer, "serialization")}},
    }


def _speech_event(ref: Ref) -> dict[str, Any]:
    """A Server-Sent Event of the speech stream: its data is a delta or the end."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": "application/json",
                "contentSchema": {
                    "oneOf": [
                        ref(answers.SpeechAudioDelta, "serialization"),
                        ref(answers.SpeechAudioDone, "serialization"),
                    ]
                },
            },
        },
    }


def _mark_voices(schema: Any) -> Any:
    """Put the reference to the voices component where a model marked a voice."""
    if isinstance(schema, dict):
        result = {key: _mark_voices(value) for key, value in schema.items()}
        if result.pop(models.VOICE_MARK, False):
            result["$ref"] = COMPONENTS + VOICE_REFERENCE
        return result
    if isinstance(schema, list):
        return [_mark_voices(item) for item in schema]
    return schema
