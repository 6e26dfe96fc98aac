"""Every JSON body the API takes, declared once (its answers: ``answers.py``).

Each is a pydantic model: a request is validated by its model (JSON's own types, strictly;
bounds; choices; unknown fields refused; ``null`` meaning the default) and the OpenAPI
document's schemas are the same models' JSON Schemas (``openapi.py``). What JSON Schema cannot
check the way the service does (a text's control tokens, a voice's name) is checked by the
domain's own functions, called from the model, and stated in the schema as a pattern; the
tests hold the two to each other.

The speech bodies depend on the deployment (the text limit, the defaults from the settings),
so they are built once per ``Settings`` (``speech_bodies``); everything else is static.
Longer than most modules: the bodies share their field types and the domain's checks, and the
three speech bodies share every option, each declared once in the README's order.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Protocol, Self, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from chattts_service.config import MAX_SEED, Settings
from chattts_service.domain.speech import CODE_SAMPLING, PRIORITIES
from chattts_service.domain.ssml import MAX_BREAK_MS, SSML_START, is_ssml
from chattts_service.domain.text import (
    INLINE_TOKENS,
    REFINE_TOKENS,
    NothingToSpeak,
    TextError,
    check_refine_prompt,
    normalise_text,
    text_to_speak,
)
from chattts_service.domain.voices import (
    BLEND_WEIGHT,
    MAX_BLEND_PARTS,
    MAX_EMBEDDING_CHARS,
    NAME,
)
from chattts_service.services.audio import FORMATS, OPUS_RATES, SAMPLE_RATES, STREAM_FORMATS
from chattts_service.services.captions import CAPTION_FORMATS
from chattts_service.services.consents import CONSENT_ID, LANGUAGE, MAX_LABEL_CHARS, MAX_PAGE
from chattts_service.services.recordings import (
    MAX_SAMPLE_SECONDS,
    MAX_TRANSCRIPT_CHARS,
    MIN_SAMPLE_SECONDS,
)

# Model names an OpenAI client may send; they all mean the one model this service runs.
MODEL_IDS = ("chattts", "tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
# OpenAI's free-text voice instructions: taken (and not applied) up to this length
MAX_INSTRUCTIONS_CHARS = 4096
STREAM_FORMAT_CHOICES = ("audio", "sse")  # OpenAI's: raw audio, or Server-Sent Events
PRIORITY_DESCRIPTION = (
    "How the box shares itself: `interactive` goes before `bulk` (a nightly batch, a long "
    "document nobody listens to yet). Default (or the `X-Priority` header): streams and whole "
    "answers of up to 2 segments interactive, longer whole answers bulk."
)
# SSML's markup may make a text this many times as long as the text limit (the text inside no
# longer); what the schema says begins SSML
SSML_MARKUP_ALLOWANCE = 4
SSML_PATTERN = "^" + SSML_START.pattern
MAX_TURNS = 100  # a dialogue's turns: each is a span of its own, of one segment or more
TURN_GAP_MS = 400  # the silence between two turns, unless the request says
# The voices a request may name change at run time: the document puts a reference to its
# component of them (``voice_schema``, built when the document is) where this key stands.
VOICE_MARK = "x-voice"

# A request's refusal that is not a plain 400: its pydantic error type -> the status
TOO_LARGE = "too_large"


def refuse(message: str, kind: str = "invalid") -> PydanticCustomError:
    """A validation error whose message is ours, word for word."""
    return PydanticCustomError(kind, "{message}", {"message": message})


def _domain(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A domain check (raising TextError) as a field validator."""

    def validate(value: Any) -> Any:
        try:
            return check(value)
        except TextError as error:
            raise refuse(str(error)) from None

    return validate


def integral(value: Any) -> Any:
    """An integral JSON number as an int (4.0 -> 4), as JSON Schema counts it an integer;
    anything else unchanged, for the type check to refuse."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def Integer(low: int, high: int | None, description: str | None = None) -> Any:  # noqa: N802
    return Annotated[
        int, Field(ge=low, le=high, description=description), BeforeValidator(integral)
    ]


def Number(low: float, high: float, description: str | None = None) -> Any:  # noqa: N802
    return Annotated[float, Field(ge=low, le=high, allow_inf_nan=False, description=description)]


def choices(annotation: Any) -> tuple[Any, ...]:
    """The values a ``Literal`` (possibly ``| None``) allows."""
    found = []
    for arg in get_args(annotation):
        if isinstance(arg, str | bool | int):
            found.append(arg)
        else:
            found.extend(choices(arg))
    return tuple(found)


Flag = bool | None


class Body(BaseModel):
    """A JSON request body: JSON's types only ("1" is not 1), unknown fields refused, and
    ``null`` meaning the default for every field that has one."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    NULL_IS_DEFAULT: ClassVar[bool] = True

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.NULL_IS_DEFAULT:
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }


# -- the text, voices and the refinement prompt: checked by the domain, stated as patterns ----


def text_patterns() -> tuple[str, str]:
    """What the service takes as text, as two plain patterns: the whole text holds no
    ``[...]`` but the inline control tokens (a "[" counts as a token's start when a "]" comes
    before the next "["); and somewhere it has something besides white space and control
    characters. (Unpaired UTF-16 surrogates are refused too; JSON Schema cannot say so.)"""
    tokens = "|".join(token.strip("[]") for token in INLINE_TOKENS)
    segment = rf"\[(?:(?:{tokens})\][^\[]*|[^\[\]]*)"
    visible = rf"[^\s\x00-\x1f\x7f-\x9f\[]|\[(?:{tokens})\]"
    return rf"^[^\[]*(?:{segment})*$", visible


def _text_type(settings: Settings) -> Any:
    """The text to speak: at most ``max_chars`` code points as sent (413 beyond), only the
    inline control tokens, something to say; normalised (``normalise_text``). SSML (a text
    beginning with ``<speak``) may be ``SSML_MARKUP_ALLOWANCE`` times as long, for its markup;
    the limit applies to the text inside it (checked when it is read)."""

    def check(text: str, info: ValidationInfo) -> str:
        if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
            raise refuse(f"'{info.field_name}' contains an unpaired UTF-16 surrogate")
        if len(text) > settings.max_chars and not is_ssml(text):
            raise refuse(
                f"'{info.field_name}' has {len(text)} characters; the limit is "
                f"{settings.max_chars}",
                TOO_LARGE,
            )
        if is_ssml(text):  # its control tokens are those of the text inside, once it is read
            return normalise_text(text)
        # the schema's pattern reads the text as sent too
        try:
            return text_to_speak(text, settings.max_control_tokens)
        except NothingToSpeak:
            raise refuse(f"'{info.field_name}' must not be empty") from None
        except TextError as error:
            raise refuse(str(error)) from None

    whole, somewhere = text_patterns()
    plain_or_ssml: dict[str, Any] = {
        "anyOf": [{"maxLength": settings.max_chars}, {"pattern": SSML_PATTERN}]
    }
    return Annotated[
        str,
        Field(
            min_length=1,
            max_length=settings.max_chars * SSML_MARKUP_ALLOWANCE,
            description="Chinese and/or English, up to "
            f"{settings.max_chars} code points. Inline control "
            f"tokens allowed: {', '.join(INLINE_TOKENS)} (at most "
            f"{settings.max_control_tokens}). Long text is split at sentence boundaries. A text "
            "beginning with <speak is SSML (the subset in the README); its markup may make it "
            f"up to {SSML_MARKUP_ALLOWANCE} times as long, the text inside it no longer.",
            json_schema_extra={"pattern": whole, "allOf": [{"pattern": somewhere}, plain_or_ssml]},
        ),
        AfterValidator(check),
    ]


def refine_prompt_pattern() -> str:
    kinds = "|".join(
        f"{kind}_[{allowed.start}-{allowed.stop - 1}]" for kind, allowed in REFINE_TOKENS.items()
    )
    return rf"^ *(?:\[(?:{kinds})\] *)*$"


RefinePrompt = Annotated[
    str,
    AfterValidator(_domain(check_refine_prompt)),
    Field(
        description="Control tokens for refinement, e.g. [oral_2][laugh_0][break_6]; needs "
        "refine_text.",
        json_schema_extra={"pattern": refine_prompt_pattern()},
    ),
]


def seed_voice_pattern(maximum: int = MAX_SEED) -> str:
    """``seed:N`` for N from 0 to ``maximum`` (leading zeros allowed, as int() takes them)."""
    return rf"^{_seed_voice(maximum)}$"


def blend_pattern(voices: list[str]) -> str:
    """``name(weight)+name(weight)``, each part one of ``voices`` or ``seed:N``, the weight
    optional. (That the weights add up to more than 0 is checked by the service: 422.)"""
    names = "|".join(re.escape(name) for name in sorted(voices, key=lambda n: (-len(n), n)))
    voice = f"(?:{names}|{_seed_voice(MAX_SEED)})" if names else _seed_voice(MAX_SEED)
    part = rf"{voice}(?:\({BLEND_WEIGHT}\))?"
    return rf"^{part}(?:\+{part}){{0,{MAX_BLEND_PARTS - 1}}}$"


def _seed_voice(maximum: int) -> str:
    digits = str(maximum)
    alternatives = [rf"\d{{1,{len(digits) - 1}}}"]
    for index, digit in enumerate(digits):
        rest = len(digits) - index - 1
        if index == len(digits) - 1:
            alternatives.append(digits[:index] + f"[0-{digit}]")
        elif digit != "0":
            low = "0" if index else "1"
            if int(digit) - 1 >= int(low):
                alternatives.append(digits[:index] + f"[{low}-{int(digit) - 1}]" + rf"\d{{{rest}}}")
    return r"seed:0*(?:" + "|".join(alternatives) + r")"


def voice_schema(voices: list[str]) -> dict[str, Any]:
    """A voice a request may name now, as a string or as OpenAI's voice object
    ``{"id": "..."}``."""
    names = [
        {"enum": sorted(voices)},
        {"type": "string", "pattern": seed_voice_pattern()},
        {"type": "string", "pattern": blend_pattern(voices)},
    ]
    reference = {  # OpenAI's custom-voice reference; any voice's name is its id here
        "type": "object",
        "required": ["id"],
        "additionalProperties": False,
        "properties": {"id": {"anyOf": names}},
    }
    return {"anyOf": [*names, reference]}


def _voice_reference(value: Any, info: ValidationInfo) -> Any:
    """A voice as a string, or as OpenAI's voice object ``{"id": "..."}``: the string either
    way (the voice store resolves it)."""
    if value is None:
        raise refuse(f"'{info.field_name}' is required")
    if isinstance(value, dict):
        if set(value) != {"id"} or not isinstance(value["id"], str):
            raise refuse('a \'voice\' object must be {"id": "<a voice\'s name or id>"}')
        return value["id"]
    return value


VoiceReference = Annotated[
    str, BeforeValidator(_voice_reference), WithJsonSchema({VOICE_MARK: True})
]
VOICE_DESCRIPTION = (
    "A named voice (GET /v1/audio/voices), seed:N, or a blend of them such as alloy(2)+echo(1) "
    "(weights normalised; 422 when none is above 0); or any of them as OpenAI's voice object "
    '{"id": "..."}.'
)


# -- the speech bodies: /synthesize, /v1/audio/speech and its captioned form ------------------

AudioFormat = Literal[tuple(FORMATS)]
SEED_DESCRIPTION = (
    "Sampling seed (and the voice when 'voice' is absent); the server's CHATTTS_DEFAULT_SEED "
    "when absent."
)
SPEED_RANGE = (0.25, 4.0)  # OpenAI's: the bounds of every speed, SSML's rates held within them
SPEED_DESCRIPTION = (
    "1 = normal. Mapped onto ChatTTS's [speed_0]..[speed_9] prompt (two levels per doubling: "
    "0.5 -> 3, 1 -> 5, 2 -> 7, 4 -> 9); the model's own pace range is narrower than the "
    "numbers say."
)
SAMPLE_RATE_DESCRIPTION = (
    "The audio's sample rate in Hz: the model's 24000 unless asked (ulaw and alaw: 8000), "
    "resampled with FFmpeg's resampler. opus takes 8000, 16000, 24000 or 48000."
)
STREAM_FORMAT_DESCRIPTION = (
    "OpenAI's: 'audio' (the audio itself) or 'sse' (Server-Sent Events: speech.audio.delta "
    "with base64 audio as it is generated, then speech.audio.done; for flac one delta holds the "
    "whole file)."
)


def _known_model(value: Any) -> Any:
    if isinstance(value, str) and value not in MODEL_IDS:
        raise refuse(f"unknown model {value!r}; models: {', '.join(MODEL_IDS)}")
    return value


def _answered_whole(value: Any, info: ValidationInfo) -> Any:
    if not (value is None or value is False or value == "audio"):
        raise refuse(f"captioned speech is answered whole: '{info.field_name}' cannot be used here")
    return value


class SpeechFields(Protocol):
    """What a parsed speech body holds, as the models ``speech_bodies`` builds have it (they
    are built per deployment at run time, so a type checker cannot see their fields)."""

    voice: str | None
    seed: int
    refine_text: bool
    speed: float
    temperature: float
    top_p: float
    top_k: int
    normalize: bool
    refine_prompt: str
    stream_format: str | None
    stream: bool
    priority: str | None
    sample_rate: int | None
    turns: list[TurnFields] | None
    turn_gap_ms: int
    model_fields_set: set[str]

    @property
    def audio_format(self) -> str: ...


class TurnFields(Protocol):
    voice: str | None
    input: str
    speed: float | None


class SynthesizeFields(SpeechFields, Protocol):
    text: str | None


class OpenAISpeechFields(SpeechFields, Protocol):
    input: str | None


class CaptionedSpeechFields(OpenAISpeechFields, Protocol):
    caption_format: str | None


class SpeechBodies(NamedTuple):
    synthesize: type[Body]
    speech: type[Body]
    captioned: type[Body]


# Long: the three bodies share their options; each field is declared once, in the order of
# the README's field table.
@functools.cache
def speech_bodies(settings: Settings) -> SpeechBodies:
    """The speech bodies as this deployment takes them (its text limit and defaults)."""
    Text = _text_type(settings)  # noqa: N806

    class Options(Body):
        seed: Integer(0, MAX_SEED, SEED_DESCRIPTION) | None = settings.default_seed
        speed: Number(*SPEED_RANGE, SPEED_DESCRIPTION) | None = 1.0
        temperature: Number(0.01, 2.0, "Sampling temperature of the speech codes.") | None = (
            CODE_SAMPLING.temperature
        )
        top_p: Number(0.01, 1.0, "Nucleus sampling threshold.") | None = CODE_SAMPLING.top_p
        top_k: Integer(1, 100, "Top-k sampling.") | None = CODE_SAMPLING.top_k
        refine_text: Annotated[
            Flag,
            Field(description="Let the model rewrite the text first (pauses, fillers, laughter)."),
        ] = settings.refine_text
        refine_prompt: RefinePrompt | None = ""
        normalize: Annotated[
            Flag,
            Field(
                description="Write numbers, dates, money, units and phone numbers out in words "
                "(wetext, zh and en) first."
            ),
        ] = settings.normalize
        stream: Annotated[
            Flag,
            Field(
                description="Send audio while it is generated (chunked; "
                f"{' or '.join(STREAM_FORMATS)} only)."
            ),
        ] = False
        stream_format: Annotated[
            Literal[STREAM_FORMAT_CHOICES] | None, Field(description=STREAM_FORMAT_DESCRIPTION)
        ] = "audio"
        priority: Annotated[Literal[PRIORITIES] | None, Field(description=PRIORITY_DESCRIPTION)] = (
            None
        )
        sample_rate: Annotated[
            Literal[SAMPLE_RATES] | None,
            BeforeValidator(integral),
            Field(description=SAMPLE_RATE_DESCRIPTION),
        ] = None

        # the fields naming the audio format and holding the text, in this body's spelling
        FORMAT_FIELD: ClassVar[str] = "format"
        TEXT_FIELD: ClassVar[str] = "text"

        @property
        def audio_format(self) -> str:
            return str(getattr(self, self.FORMAT_FIELD))

        @model_validator(mode="before")
        @classmethod
        def _empty_text_beside_turns(cls, data: Any) -> Any:
            """An empty text beside turns (as OpenAI's clients send ``input``, a required
            string in their types) is refused with the way to send turns from them."""
            if isinstance(data, dict) and data.get("turns") and data.get(cls.TEXT_FIELD) == "":
                raise refuse(
                    f"with 'turns', leave '{cls.TEXT_FIELD}' out or null (OpenAI's clients: "
                    f'extra_body={{"{cls.TEXT_FIELD}": None, "turns": [...]}})'
                )
            return data

        @model_validator(mode="after")
        def _consistent(self) -> Self:
            asked_to_stream = "stream" in self.model_fields_set and self.stream
            if asked_to_stream and self.audio_format not in STREAM_FORMATS:
                raise refuse(
                    f"streaming sends {' or '.join(STREAM_FORMATS)}; "
                    f"'{self.FORMAT_FIELD}' {self.audio_format!r} cannot be streamed"
                )
            if self.refine_prompt and not self.refine_text:
                raise refuse("'refine_prompt' steers text refinement; set 'refine_text': true")
            text = getattr(self, self.TEXT_FIELD)
            if (text is None) == (getattr(self, "turns", None) is None):
                raise refuse(
                    f"give either '{self.TEXT_FIELD}' (a text, or SSML) or 'turns' (a dialogue)"
                    + (", not both" if text is not None else "")
                )
            if self.audio_format == "opus" and self.sample_rate not in (None, *OPUS_RATES):
                raise refuse(
                    f"opus cannot carry {self.sample_rate} Hz; 'sample_rate' for opus is one of "
                    f"{', '.join(str(rate) for rate in OPUS_RATES if rate in SAMPLE_RATES)}"
                )
            return self

    stream_then = {"properties": {"stream": {"const": True}}, "required": ["stream"]}
    refine_if = {
        "properties": {"refine_prompt": {"type": "string", "pattern": r"\["}},
        "required": ["refine_prompt"],
    }
    refine_then = (
        {"properties": {"refine_text": {"enum": [True, None]}}}
        if settings.refine_text
        else {"properties": {"refine_text": {"const": True}}, "required": ["refine_text"]}
    )

    opus_rates = [rate for rate in SAMPLE_RATES if rate not in OPUS_RATES]

    def rules(format_field: str, needs_format: bool) -> dict[str, Any]:
        """What the model validator checks across fields, as JSON Schema's if/then."""
        then: dict[str, Any] = {"properties": {format_field: {"enum": list(STREAM_FORMATS)}}}
        if needs_format:
            then["required"] = [format_field]
        opus_if = {"properties": {format_field: {"const": "opus"}}, "required": [format_field]}
        opus_then = {"properties": {"sample_rate": {"not": {"enum": opus_rates}}}}
        return {
            "allOf": [
                {"if": stream_then, "then": then},
                {"if": refine_if, "then": refine_then},
                {"if": opus_if, "then": opus_then},
            ]
        }

    class Turn(Body):
        """One line of a dialogue: its text (plain or SSML) and who says it."""

        voice: Annotated[
            VoiceReference | None,
            Field(description="Who says it (as 'voice' takes); without it the request's voice."),
        ] = None
        input: Text
        speed: Number(*SPEED_RANGE, "This turn's speed; without it the request's.") | None = None

    Turns = Annotated[  # noqa: N806
        list[Turn],
        Field(
            min_length=1,
            max_length=MAX_TURNS,
            description="A dialogue: the turns spoken one after another in one audio, each "
            "in its own voice, 'turn_gap_ms' apart; instead of the text field. Captions name "
            "each cue's voice.",
        ),
    ]
    TurnGap = Integer(  # noqa: N806
        0, MAX_BREAK_MS, f"The silence between two turns, in ms ({TURN_GAP_MS} without it)."
    )

    def script_rules(text_field: str) -> dict[str, Any]:
        """The text or the turns, not both, as JSON Schema says it (null is absent)."""
        return {
            "oneOf": [
                {"required": [name], "properties": {name: {"type": kind}}}
                for name, kind in ((text_field, "string"), ("turns", "array"))
            ]
        }

    class SynthesizeRequest(Options):
        model_config = ConfigDict(
            json_schema_extra={
                **rules("format", needs_format=True),
                **script_rules("text"),
            }
        )
        text: Text | None = None
        turns: Turns | None = None
        turn_gap_ms: TurnGap | None = TURN_GAP_MS
        voice: Annotated[
            VoiceReference | None,
            Field(description=VOICE_DESCRIPTION + " Without it the voice of 'seed'."),
        ] = None
        format: AudioFormat | None = "wav"

    class SpeechRequest(Options):
        model_config = ConfigDict(
            json_schema_extra={
                **rules("response_format", needs_format=False),
                **script_rules("input"),
            }
        )
        FORMAT_FIELD: ClassVar[str] = "response_format"
        TEXT_FIELD: ClassVar[str] = "input"
        model: Annotated[Literal[MODEL_IDS], BeforeValidator(_known_model)]
        input: Text | None = None
        turns: Turns | None = None
        turn_gap_ms: TurnGap | None = TURN_GAP_MS
        voice: Annotated[VoiceReference, Field(description=VOICE_DESCRIPTION)]
        response_format: AudioFormat | None = "mp3"
        instructions: _instructions_type(settings) | None = None
        stream: Annotated[
            Flag,
            Field(
                description="As OpenAI's endpoint: audio is sent while it is generated "
                f"(chunked) in {', '.join(STREAM_FORMATS)}; flac comes whole. false asks for "
                "the whole file with a Content-Length."
            ),
        ] = True

    class CaptionedSpeechRequest(SpeechRequest):
        """Answered whole, every sentence read as its own segment so the captions are exact."""

        caption_format: Annotated[
            Literal[CAPTION_FORMATS] | None,
            Field(
                description="json: captions in the JSON answer only; srt or vtt: also as a "
                "SubRip or WebVTT string."
            ),
        ] = "json"
        stream: Annotated[Literal[False] | None, BeforeValidator(_answered_whole)] = False
        stream_format: Annotated[Literal["audio"] | None, BeforeValidator(_answered_whole)] = (
            "audio"
        )

    return SpeechBodies(SynthesizeRequest, SpeechRequest, CaptionedSpeechRequest)


def _instructions_type(settings: Settings) -> Any:
    refused = settings.instructions == "refuse"

    def check(value: str) -> str:
        if value and refused:
            raise refuse(
                "'instructions' is not supported; ChatTTS is steered with control tokens in "
                "the text and 'refine_prompt'"
            )
        return value

    return Annotated[
        str,
        Field(
            max_length=0 if refused else MAX_INSTRUCTIONS_CHARS,
            description="OpenAI's voice instructions. ChatTTS cannot follow free text: the text "
            "is spoken as it would be without them and the answer says X-Instructions: ignored"
            + (" (refused here: CHATTTS_INSTRUCTIONS=refuse)." if refused else "."),
        ),
        BeforeValidator(lambda value: check(value) if isinstance(value, str) else value),
    ]


# -- voices and consents ---------------------------------------------------------------------

VoiceName = Annotated[str, Field(json_schema_extra={"pattern": NAME.pattern})]
ConsentId = Annotated[str, Field(json_schema_extra={"pattern": CONSENT_ID.pattern})]
Label = Annotated[str, Field(max_length=MAX_LABEL_CHARS, json_schema_extra={"pattern": r"\S"})]
# what a recording may be labelled (services/recordings.py takes these, and unlabelled bytes)
AUDIO_TYPES = "audio/mpeg, audio/wav, audio/ogg, audio/aac, audio/flac, audio/webm, audio/mp4"
Upload = Annotated[Any, WithJsonSchema({"type": "string", "format": "binary"})]


class VoiceRequest(Body):
    """A named voice from a ChatTTS speaker embedding string, or from a voice this server
    resolves (a blend, ``seed:N``, another voice). The name and the embedding are checked by
    the voice store."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": [source], "properties": {source: {"not": {"type": "null"}}}}
                for source in ("embedding", "voice")
            ]
        }
    )
    name: VoiceName
    embedding: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=MAX_EMBEDDING_CHARS,
                description="ChatTTS speaker embedding string",
            ),
        ]
        | None
    ) = None
    voice: Annotated[
        VoiceReference | None,
        Field(
            description="Store this voice under the name: a blend such as alloy(2)+echo(1), "
            "seed:N, or another voice."
        ),
    ] = None
    replace: bool = False


class Form(Body):
    """A multipart form: its text fields are strings; a file is checked by its route."""

    model_config = ConfigDict(strict=False)


def _from_a_recording(value: Any) -> Any:
    if value != "audio_sample":
        raise refuse(
            "'type' must be audio_sample: ChatTTS makes a voice from a recording, an embedding "
            "or a seed, not from a text prompt"
        )
    return value


class VoiceSampleRequest(Form):
    """OpenAI's ``voices.create``: a recording, a consent, a name, and this service's
    ``transcript`` (the words spoken in the sample, ChatTTS's txt_smp)."""

    audio_sample: Annotated[
        Upload,
        Field(
            description="The recording: mp3, wav, ogg/opus, aac, flac, webm or mp4, at most "
            f"10 MiB, {MIN_SAMPLE_SECONDS:g} to {MAX_SAMPLE_SECONDS:g} s of clear speech"
        ),
    ]
    consent: ConsentId
    name: VoiceName
    type: Annotated[Literal["audio_sample"], BeforeValidator(_from_a_recording)] = "audio_sample"
    transcript: Annotated[
        str,
        Field(
            max_length=MAX_TRANSCRIPT_CHARS,
            description="The words spoken in the sample (ChatTTS's txt_smp; OpenAI clients "
            "send it through extra_body)",
            json_schema_extra={"pattern": r"^[^\[\]]*$"},
        ),
    ] = ""


class VoiceConsentRequest(Form):
    recording: Upload
    name: Label
    language: Annotated[str, Field(json_schema_extra={"pattern": LANGUAGE.pattern})]


class VoiceConsentUpdate(Body):
    name: Label


class ConsentPage(Form):
    """``GET /v1/audio/voice_consents``'s query: OpenAI's cursor paging."""

    after: ConsentId | None = None
    limit: Integer(1, MAX_PAGE) = 20


class TuningBody(Body):
    """One or more batching knobs, each an integer within its bounds."""

    model_config = ConfigDict(json_schema_extra={"minProperties": 1})
    NULL_IS_DEFAULT: ClassVar[bool] = False


@functools.cache
def tuning_body(limits: tuple[tuple[str, int, int | None], ...]) -> type[Body]:
    """``POST /admin/config``'s body for these knobs (name, low, high)."""
    fields: dict[str, Any] = {name: (Integer(low, high), None) for name, low, high in limits}
    return create_model(
        "TuningRequest",
        __base__=TuningBody,
        __doc__="One or more batching knobs, each within its bounds.",
        __module__=__name__,
        **fields,
    )
