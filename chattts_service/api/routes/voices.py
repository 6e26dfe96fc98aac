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
from chattts_service.api.models import (
    ConsentId,
    ConsentPage,
    Voice,
    VoiceConsent,
    VoiceConsentDeleted,
    VoiceConsentList,
    VoiceConsentRequest,
    VoiceConsentUpdate,
    VoiceDeleted,
    VoiceList,
    VoiceName,
    VoiceRequest,
    VoiceSampleRequest,
)
from chattts_service.api.openapi import BODY_ERRORS, operation
from chattts_service.config import MAX_SEED
from chattts_service.domain.speech import EngineError
from chattts_service.domain.voices import SpeakerSample, VoiceError
from chattts_service.services import recordings
from chattts_service.services.consents import ConsentError, ConsentStore
from chattts_service.services.recordings import (
    MAX_CONSENT_SECONDS,
    MAX_SAMPLE_SECONDS,
    MIN_CONSENT_SECONDS,
    MIN_SAMPLE_SECONDS,
)

blueprint = Blueprint("voices", __name__)

# multipart bodies: the recording (10 MiB at most) and a few small fields
MAX_FORM_BYTES = recordings.MAX_UPLOAD_BYTES + 64 * 1024
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
VOICE_ERRORS = (400, 401, 404, 503)


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
@operation("Named voices", answer=VoiceList, errors=(401, 503))
def list_voices():
    listing = _state().engine.voices.listing()
    answer = VoiceList(
        voices=[item["name"] for item in listing],
        details=listing,
        seed_voices=f"seed:N (N from 0 to {MAX_SEED})",
    )
    return jsonify(answer.model_dump(exclude_none=True))


@blueprint.post("/v1/audio/voices")
@operation(
    "A voice from a recording (multipart, as OpenAI's clients send it: audio_sample, consent, "
    "name, and the sample's transcript), or a named voice from a ChatTTS speaker embedding "
    "string or another voice (JSON)",
    body=VoiceRequest,
    form=VoiceSampleRequest,
    answer=Voice,
    status=201,
    described="The voice (OpenAI's Voice object for a recording)",
    errors=(*BODY_ERRORS, 404, 409, 422, 503),
)
def create_voice():
    if request.mimetype in FORM_TYPES:
        return _voice_from_recording()
    return _register_voice()


def _register_voice():
    """A named voice from a ChatTTS speaker embedding string, or from a voice this server
    resolves (a blend such as ``alloy(2)+echo(1)``, ``seed:N``)."""
    store = _state().engine.voices
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    asked = validation.parse(VoiceRequest, body)
    try:
        voice = store.register(
            asked.name, asked.embedding, replace=asked.replace, voice=asked.voice
        )
    except VoiceError as error:  # a voice to copy that does not exist: as in a speech request
        raise from_voice_error(error, in_field=True) from None
    response = jsonify(voice.describe())
    response.status_code = 201
    return response


def _form(model, name: str):
    """The form as ``model`` and its one file ``name``, or a 4xx naming what is wrong."""
    request.max_content_length = MAX_FORM_BYTES
    uploads = request.files
    form = validation.parse(model, {**request.form.to_dict(), **uploads.to_dict()})
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
    form, data, _ = _form(VoiceSampleRequest, "audio_sample")
    if not _consents().exists(form.consent):
        raise NotFound(
            f"no consent {form.consent!r}: record one with POST /v1/audio/voice_consents"
        )
    transcript = _transcript(form.transcript)
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
            form.name, SpeakerSample(codes, transcript), encode_prompt(codes), form.consent
        )
    except VoiceError as error:
        raise from_voice_error(error) from None
    response = jsonify(voice.describe())
    response.status_code = 201
    return response


def _transcript(value: str) -> str:
    """The words spoken in the sample, as upstream takes ``txt_smp``: as written (ChatTTS's
    issue #648: the prompt must say what the recording says), control characters removed."""
    text = unicodedata.normalize("NFC", value)
    text = "".join(ch for ch in text if ch.isprintable() or ch == " ").strip()
    if "[" in text or "]" in text:
        raise BadRequest("'transcript' is the words spoken in the sample: no [control] tokens")
    return text


@blueprint.get("/v1/audio/voices/<name>")
@operation(
    "One voice, by name or id",
    answer=Voice,
    described="The voice",
    path={"name": VoiceName},
    errors=VOICE_ERRORS,
)
def get_voice(name: str):
    try:
        voice = _state().engine.voices.get(name)
    except VoiceError as error:
        raise from_voice_error(error) from None
    return jsonify(Voice(voice.describe()).model_dump())


@blueprint.delete("/v1/audio/voices/<name>")
@operation(
    "Delete a stored voice, by name or id",
    answer=VoiceDeleted,
    described="OpenAI's VoiceDeleted object",
    path={"name": VoiceName},
    errors=VOICE_ERRORS,
)
def delete_voice(name: str):
    try:
        voice = _state().engine.voices.delete(name)
    except VoiceError as error:
        raise from_voice_error(error) from None
    deleted = VoiceDeleted(id=voice.id or voice.name, deleted=True, name=voice.name)
    return jsonify(deleted.model_dump())


# -- consents ------------------------------------------------------------------------------------


@blueprint.errorhandler(ConsentError)
def consent_error(error: ConsentError):
    """Every consent route's refusals, through the one table in ``errors``."""
    api_error = from_consent_error(error)
    return error_response(api_error.message, api_error.status)


@blueprint.post("/v1/audio/voice_consents")
@operation(
    "Record a speaker's consent to voices made from them (the recording is kept for audit)",
    form=VoiceConsentRequest,
    answer=VoiceConsent,
    status=201,
    described="OpenAI's VoiceConsent object",
    errors=(*BODY_ERRORS, 409, 422),
)
def create_consent():
    if request.mimetype not in FORM_TYPES:
        raise UnsupportedMediaType(
            "send multipart/form-data with recording (a file), name and language"
        )
    form, data, extension = _form(VoiceConsentRequest, "recording")
    try:
        recordings.read(data, "recording", MAX_CONSENT_SECONDS, MIN_CONSENT_SECONDS)
    except recordings.RecordingError as error:
        raise Unprocessable(str(error)) from None
    consent = _consents().create(form.name, form.language, data, extension)
    response = jsonify(VoiceConsent(**consent).model_dump())
    response.status_code = 201
    return response


@blueprint.get("/v1/audio/voice_consents")
@operation(
    "Voice consents, newest first (OpenAI's cursor paging)",
    query=ConsentPage,
    answer=VoiceConsentList,
    described="A list page",
    errors=(400, 401, 404),
)
def list_consents():
    page = validation.parse(ConsentPage, request.args.to_dict(), what="parameters")
    return jsonify(VoiceConsentList(**_consents().page(page.after, page.limit)).model_dump())


CONSENT = {"consent_id": ConsentId}


@blueprint.get("/v1/audio/voice_consents/<consent_id>")
@operation("One consent", answer=VoiceConsent, path=CONSENT, errors=(401, 404))
def get_consent(consent_id: str):
    return jsonify(VoiceConsent(**_consents().get(consent_id)).model_dump())


@blueprint.post("/v1/audio/voice_consents/<consent_id>")
@operation(
    "Rename a consent",
    body=VoiceConsentUpdate,
    answer=VoiceConsent,
    path=CONSENT,
    errors=(*BODY_ERRORS, 404),
)
def rename_consent(consent_id: str):
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    name = validation.parse(VoiceConsentUpdate, body).name
    return jsonify(VoiceConsent(**_consents().rename(consent_id, name)).model_dump())


@blueprint.delete("/v1/audio/voice_consents/<consent_id>")
@operation(
    "Delete a consent and its recording",
    answer=VoiceConsentDeleted,
    path=CONSENT,
    errors=(401, 404),
)
def delete_consent(consent_id: str):
    return jsonify(VoiceConsentDeleted(**_consents().delete(consent_id)).model_dump())
