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

from typing import TypeVar

from flask import Blueprint, Response, jsonify, request
from pydantic import BaseModel

from chattts_service.api import validation
from chattts_service.api.answers import (
    Voice,
    VoiceConsent,
    VoiceConsentDeleted,
    VoiceConsentList,
    VoiceDeleted,
    VoiceList,
)
from chattts_service.api.context import service
from chattts_service.api.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from chattts_service.api.models import (
    ConsentId,
    ConsentPage,
    VoiceConsentRequest,
    VoiceConsentUpdate,
    VoiceName,
    VoiceRequest,
    VoiceSampleRequest,
)
from chattts_service.api.openapi import BODY_ERRORS, operation
from chattts_service.config import MAX_SEED
from chattts_service.services import recordings

blueprint = Blueprint("voices", __name__)
Form = TypeVar("Form", bound=BaseModel)

# multipart bodies: the recording (10 MiB at most) and a few small fields
MAX_FORM_BYTES = recordings.MAX_UPLOAD_BYTES + 64 * 1024
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
VOICE_ERRORS = (400, 401, 404, 503)


@blueprint.get("/v1/audio/voices")
@operation("Named voices", answer=VoiceList, errors=(401, 503))
def list_voices() -> Response:
    listing = service().voices.listing()
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
def create_voice() -> Response:
    voices = service().voices
    if request.mimetype in FORM_TYPES:
        form, data, _ = _form(VoiceSampleRequest, "audio_sample")
        voice = voices.from_recording(form.name, data, form.consent, form.transcript)
    else:
        body = validation.json_body(request.mimetype, request.get_data(cache=False))
        asked = validation.parse(VoiceRequest, body)
        voice = voices.register(asked.name, asked.embedding, asked.replace, asked.voice)
    response = jsonify(voice.describe())
    response.status_code = 201
    return response


def _form(model: type[Form], name: str) -> tuple[Form, bytes, str]:
    """The form as ``model`` and its one file ``name``, or a 4xx naming what is wrong."""
    request.max_content_length = MAX_FORM_BYTES
    uploads = request.files
    form = validation.parse(model, {**request.form.to_dict(), **uploads.to_dict()})
    upload = uploads.get(name)
    if upload is None:
        raise BadRequest(f"'{name}' is required: the recording, as a file in the form")
    extension = recordings.extension_for(upload.mimetype)
    data = upload.stream.read(recordings.MAX_UPLOAD_BYTES + 1)
    if len(data) > recordings.MAX_UPLOAD_BYTES:
        raise PayloadTooLarge(f"'{name}' is larger than 10 MiB")
    return form, data, extension


@blueprint.get("/v1/audio/voices/<name>")
@operation(
    "One voice, by name or id",
    answer=Voice,
    described="The voice",
    path={"name": VoiceName},
    errors=VOICE_ERRORS,
)
def get_voice(name: str) -> Response:
    return jsonify(Voice(service().voices.get(name).describe()).model_dump())


@blueprint.delete("/v1/audio/voices/<name>")
@operation(
    "Delete a stored voice, by name or id",
    answer=VoiceDeleted,
    described="OpenAI's VoiceDeleted object",
    path={"name": VoiceName},
    errors=VOICE_ERRORS,
)
def delete_voice(name: str) -> Response:
    voice = service().voices.delete(name)
    deleted = VoiceDeleted(id=voice.id or voice.name, deleted=True, name=voice.name)
    return jsonify(deleted.model_dump())


# -- consents ------------------------------------------------------------------------------------


@blueprint.post("/v1/audio/voice_consents")
@operation(
    "Record a speaker's consent to voices made from them (the recording is kept for audit)",
    form=VoiceConsentRequest,
    answer=VoiceConsent,
    status=201,
    described="OpenAI's VoiceConsent object",
    errors=(*BODY_ERRORS, 409, 422),
)
def create_consent() -> Response:
    if request.mimetype not in FORM_TYPES:
        raise UnsupportedMediaType(
            "send multipart/form-data with recording (a file), name and language"
        )
    form, data, extension = _form(VoiceConsentRequest, "recording")
    consent = service().voices.record_consent(form.name, form.language, data, extension)
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
def list_consents() -> Response:
    page = validation.parse(ConsentPage, request.args.to_dict(), what="parameters")
    consents = service().voices.consents
    return jsonify(VoiceConsentList(**consents.page(page.after, page.limit)).model_dump())


CONSENT = {"consent_id": ConsentId}


@blueprint.get("/v1/audio/voice_consents/<consent_id>")
@operation("One consent", answer=VoiceConsent, path=CONSENT, errors=(401, 404))
def get_consent(consent_id: str) -> Response:
    return jsonify(VoiceConsent(**service().voices.consents.get(consent_id)).model_dump())


@blueprint.post("/v1/audio/voice_consents/<consent_id>")
@operation(
    "Rename a consent",
    body=VoiceConsentUpdate,
    answer=VoiceConsent,
    path=CONSENT,
    errors=(*BODY_ERRORS, 404),
)
def rename_consent(consent_id: str) -> Response:
    body = validation.json_body(request.mimetype, request.get_data(cache=False))
    name = validation.parse(VoiceConsentUpdate, body).name
    consents = service().voices.consents
    return jsonify(VoiceConsent(**consents.rename(consent_id, name)).model_dump())


@blueprint.delete("/v1/audio/voice_consents/<consent_id>")
@operation(
    "Delete a consent and its recording",
    answer=VoiceConsentDeleted,
    path=CONSENT,
    errors=(401, 404),
)
def delete_consent(consent_id: str) -> Response:
    consents = service().voices.consents
    return jsonify(VoiceConsentDeleted(**consents.delete(consent_id)).model_dump())
