"""Voices and voice consents, as OpenAI's API has them, beside this service's own voices.

- ``GET /v1/audio/voices``: every voice a request may name.
- ``POST /v1/audio/voices``: JSON registers a named voice from a ChatTTS speaker embedding or
  from a voice this server resolves (a blend, ``seed:N``); multipart/form-data, as OpenAI's
  clients send it, makes a voice from a recording (``audio_sample``, ``name``, ``consent``,
  and this service's ``transcript``: the words spoken in it). Answers OpenAI's Voice object.
- ``GET/DELETE /v1/audio/voices/{id or name}``.
- ``POST/GET /v1/audio/voice_consents``, ``GET/POST/DELETE /v1/audio/voice_consents/{id}``:
  OpenAI's VoiceConsent objects, each with its recording kept for audit.
"""

from __future__ import annotations

import unicodedata

from flask import Blueprint, current_app, jsonify, request

from chattts_service.api import validation
from chattts_service.api.errors import (
    BadRequest,
    NotFound,
    NotReady,
    PayloadTooLarge,
    Unprocessable,
    UnsupportedMediaType,
    error_response,
    from_consent_error,
    from_engine_error,
    from_voice_error,
)
from chattts_service.domain.voices import SpeakerSample, VoiceError
from chattts_service.inference.types import EngineError
from chattts_service.services import recordings
from chattts_service.services.consents import (
    DEFAULT_PAGE,
    MAX_PAGE,
    ConsentError,
    ConsentStore,
)
from chattts_service.services.recordings import (
    MAX_CONSENT_SECONDS,
    MAX_SAMPLE_SECONDS,
    MAX_TRANSCRIPT_CHARS,
    MIN_CONSENT_SECONDS,
    MIN_SAMPLE_SECONDS,
)

blueprint = Blueprint("voices", __name__)

# multipart bodies: the recording (10 MiB at most) and a few small fields
MAX_FORM_BYTES = recordings.MAX_UPLOAD_BYTES + 64 * 1024
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
SAMPLE_FIELDS = {"audio_sample", "name", "consent", "type", "transcript"}
CONSENT_FIELDS = {"recording", "name", "language"}


def _state():
    state = current_app.extensions["chattts"]
    if state.engine.voices is None:
        raise NotReady(f"model is not ready ({state.phase})")
    return state


def _consents() -> ConsentStore:
    state = current_app.extensions["chattts"]
    settings = state.settings
    return ConsentStore(settings.voices_dir / "consents", settings.max_stored_voices)


@blueprint.get("/v1/audio/voices")
def list_voices():
    listing = _state().engine.voices.listing()
    return jsonify(
        voices=[item["name"] for item in listing],
        details=listing,
        seed_voices="seed:N (N from 0 to 2147483647)",
    )


@blueprint.post("/v1/audio/voices")
def create_voice():
    if request.mimetype in FORM_TYPES:
        return _voice_from_recording()
    return _register_voice()


def _register_voice():
    """A named voice from a ChatTTS speaker embedding string, or from a voice this server
    resolves (a blend such as ``alloy(2)+echo(1)``, ``seed:N``)."""
    store = _state().engine.voices
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    unknown = sorted(set(body) - {"name", "embedding", "voice", "replace"})
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; accepted: embedding, name, replace, voice "
            "(or multipart/form-data with audio_sample, consent, name, transcript)"
        )
    replace = body.get("replace", False)
    if not isinstance(replace, bool):
        raise BadRequest("'replace' must be true or false")
    source = validation.voice_reference(body.get("voice"))
    if source is not None and not isinstance(source, str):
        raise BadRequest("'voice' must be a string")
    try:
        voice = store.register(
            body.get("name"), body.get("embedding"), replace=replace, voice=source
        )
    except VoiceError as error:  # a voice to copy that does not exist: as in a speech request
        raise from_voice_error(error, in_field=True) from None
    response = jsonify(voice.describe())
    response.status_code = 201
    return response


def _form(accepted: set[str], files: set[str]):
    """The form's text fields and its one file, or a 4xx naming what is wrong."""
    request.max_content_length = MAX_FORM_BYTES
    form, uploads = request.form, request.files
    unknown = sorted((set(form) | set(uploads)) - accepted)
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; accepted: {', '.join(sorted(accepted))}"
        )
    (name,) = files
    upload = uploads.get(name)
    if upload is None:
        raise BadRequest(f"'{name}' is required: the recording, as a file in the form")
    try:
        extension = recordings.extension_for(upload.mimetype)
    except recordings.WrongContentType as error:
        raise UnsupportedMediaType(str(error)) from None
    data = upload.stream.read(recordings.MAX_UPLOAD_BYTES + 1)
    if len(data) > recordings.MAX_UPLOAD_BYTES:
        raise PayloadTooLarge(f"'{name}' is larger than 10 MiB")
    return form, data, extension


def _voice_from_recording():
    """OpenAI's ``voices.create(audio_sample=..., consent=..., name=...)``: the recording ->
    24 kHz mono -> the DVAE's codes (``Chat.sample_audio_speaker``) -> a stored voice."""
    state = _state()
    engine = state.engine
    form, data, _ = _form(SAMPLE_FIELDS, {"audio_sample"})
    kind = form.get("type", "audio_sample")
    if kind != "audio_sample":
        raise BadRequest(
            "'type' must be audio_sample: ChatTTS makes a voice from a recording, an "
            "embedding or a seed, not from a text prompt"
        )
    name = form.get("name")
    if not name:
        raise BadRequest("'name' is required")
    consent = form.get("consent")
    if not consent:
        raise BadRequest("'consent' is required: the id of a voice consent (cons_...)")
    if not _consents().exists(consent):
        raise NotFound(f"no consent {consent!r}: record one with POST /v1/audio/voice_consents")
    transcript = _transcript(form.get("transcript"))
    store = engine.voices
    try:
        store.check_room()  # before the work, and again when storing
    except VoiceError as error:
        raise from_voice_error(error) from None
    try:
        samples = recordings.read(data, "audio_sample", MAX_SAMPLE_SECONDS, MIN_SAMPLE_SECONDS)
    except recordings.RecordingError as error:  # well-formed, but not a usable recording
        raise Unprocessable(str(error)) from None
    try:
        codes = engine.encode_sample(samples)
    except EngineError as error:
        raise from_engine_error(error) from None
    from chattts_service.inference.sample_encoder import encode_prompt

    try:
        voice = store.create_from_sample(
            name, SpeakerSample(codes, transcript), encode_prompt(codes), consent
        )
    except VoiceError as error:
        raise from_voice_error(error) from None
    response = jsonify(voice.describe())
    response.status_code = 201
    return response


def _transcript(value) -> str:
    """The words spoken in the sample, as upstream takes ``txt_smp``: as written (ChatTTS's
    issue #648: the prompt must say what the recording says), control characters removed."""
    if value is None:
        return ""
    text = unicodedata.normalize("NFC", value)
    text = "".join(ch for ch in text if ch.isprintable() or ch == " ").strip()
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise BadRequest(f"'transcript' is longer than {MAX_TRANSCRIPT_CHARS} characters")
    if "[" in text or "]" in text:
        raise BadRequest("'transcript' is the words spoken in the sample: no [control] tokens")
    return text


@blueprint.get("/v1/audio/voices/<name>")
def get_voice(name: str):
    try:
        voice = _state().engine.voices.get(name)
    except VoiceError as error:
        raise from_voice_error(error) from None
    return jsonify(voice.describe())


@blueprint.delete("/v1/audio/voices/<name>")
def delete_voice(name: str):
    try:
        voice = _state().engine.voices.delete(name)
    except VoiceError as error:
        raise from_voice_error(error) from None
    return jsonify(
        id=voice.id or voice.name, object="audio.voice.deleted", deleted=True, name=voice.name
    )


# -- consents ------------------------------------------------------------------------------------


@blueprint.errorhandler(ConsentError)
def consent_error(error: ConsentError):
    """Every consent route's refusals, through the one table in ``errors``."""
    api_error = from_consent_error(error)
    return error_response(api_error.message, api_error.status)


@blueprint.post("/v1/audio/voice_consents")
def create_consent():
    if request.mimetype not in FORM_TYPES:
        raise UnsupportedMediaType(
            "send multipart/form-data with recording (a file), name and language"
        )
    form, data, extension = _form(CONSENT_FIELDS, {"recording"})
    for field in ("name", "language"):
        if not form.get(field):
            raise BadRequest(f"'{field}' is required")
    try:
        recordings.read(data, "recording", MAX_CONSENT_SECONDS, MIN_CONSENT_SECONDS)
    except recordings.RecordingError as error:
        raise Unprocessable(str(error)) from None
    consent = _consents().create(form["name"], form["language"], data, extension)
    response = jsonify(consent)
    response.status_code = 201
    return response


@blueprint.get("/v1/audio/voice_consents")
def list_consents():
    unknown = sorted(set(request.args) - {"after", "limit"})
    if unknown:
        raise BadRequest(f"unknown parameters: {', '.join(unknown)}; accepted: after, limit")
    limit = request.args.get("limit", str(DEFAULT_PAGE))
    if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
        raise BadRequest(f"'limit' must be an integer from 1 to {MAX_PAGE}")
    return jsonify(_consents().page(request.args.get("after"), int(limit)))


@blueprint.get("/v1/audio/voice_consents/<consent_id>")
def get_consent(consent_id: str):
    return jsonify(_consents().get(consent_id))


@blueprint.post("/v1/audio/voice_consents/<consent_id>")
def rename_consent(consent_id: str):
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    unknown = sorted(set(body) - {"name"})
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}; accepted: name")
    return jsonify(_consents().rename(consent_id, body.get("name")))


@blueprint.delete("/v1/audio/voice_consents/<consent_id>")
def delete_consent(consent_id: str):
    return jsonify(_consents().delete(consent_id))
