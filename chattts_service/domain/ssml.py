"""SSML input: a documented subset of W3C SSML 1.1, read into spans of text and silences.

A text that begins with ``<speak`` (or ``<?xml``) is SSML. It is parsed by ``defusedxml``
(expat with DTDs, entity declarations and external references refused, so neither a billion
laughs nor a file read can ride in), then walked as a stream of events, never recursively.
What it becomes:

- ``Span``: text spoken with one voice, rate and language; a new span starts where any of those
  changes and at every ``<p>`` and ``<s>`` (each span is read as its own segments);
- ``Pause``: ``<break>``, silence of exactly that length.

``<say-as>`` and ``<sub>`` are written out in place (``say_as``); ``<emphasis>`` is read as
plain text and ``<mark>`` is ignored (ChatTTS has neither); ``<prosody>``'s ``pitch``,
``volume``, ``range`` and ``contour`` are ignored likewise. Any other element is refused with
its name and place.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chattts_service.domain.say_as import KINDS, SayAsError, say_as
from chattts_service.domain.text import LANGUAGES, TextError, normalise_text, speakable

SSML_NAMESPACE = "http://www.w3.org/2001/10/synthesis"
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
MAX_BREAK_MS = 10_000  # one <break>
MAX_SILENCE_MS = 120_000  # every <break> of a document together
MAX_PARTS = 200  # spans and breaks: each span is at least one segment of its own
MAX_DEPTH = 32
# <break strength>: the pause each strength makes (Azure's and Google's values)
STRENGTHS = {"none": 0, "x-weak": 250, "weak": 500, "medium": 750, "strong": 1000, "x-strong": 1250}
# <prosody rate> keywords: the speed each sets (1 = the model's normal pace)
RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "fast": 1.5, "x-fast": 2.0}
IGNORED_PROSODY = ("pitch", "volume", "range", "contour")
SUPPORTED = ("speak", "p", "s", "break", "prosody", "voice", "say-as", "sub", "lang")
PLAIN = ("emphasis", "mark")  # taken, without an effect on the audio
_TIME = re.compile(r"(\d+(?:\.\d+)?)(ms|s)")
SSML_START = re.compile(r"\s*<(?:speak|\?xml|!DOCTYPE)")
_PERCENT = re.compile(r"([+-]?\d+(?:\.\d+)?)%")
_BEFORE_PUNCTUATION = re.compile(r"\s+([,.!?;:，。！？；：])")


class SsmlError(TextError):
    """The document is not SSML this service reads; the message names the element and where."""


class SsmlTooLong(SsmlError):
    """The text inside the document is longer than the limit."""


def is_ssml(text: str) -> bool:
    """A text beginning with ``<speak`` (or an XML declaration or DOCTYPE, to be refused as
    SSML, not read as words)."""
    return SSML_START.match(text) is not None


@dataclass(frozen=True)
class Span:
    text: str
    voice: str | None = None  # as named; None: the request's
    speed: float | None = None  # set by a rate keyword; None: the request's
    factor: float = 1.0  # relative rates (percentages) on top
    language: str | None = None  # zh or en; None: detected


@dataclass(frozen=True)
class Pause:
    milliseconds: int


@dataclass
class _Frame:
    """An open element and what it sets for its content."""

    name: str
    where: str
    voice: str | None
    speed: float | None
    factor: float
    language: str | None
    say_as: tuple[str, str | None] | None = None  # interpret-as and format
    alias: str | None = None
    text: list[str] = field(default_factory=list)  # a say-as's or sub's own text


class _Reader:
    """The parser's target: builds the spans and pauses from start, data and end events."""

    def __init__(self, normalise: Callable[[str, str], str], max_chars: int):
        self.normalise, self.max_chars = normalise, max_chars
        self.parser: Any = None  # the expat parser, for the position of each element
        self.frames: list[_Frame] = []
        self.parts: list[Span | Pause] = []
        self.pending: list[str] = []  # the text of the span being read
        self.pending_state: tuple[str | None, float | None, float, str | None] | None = None
        self.chars = 0
        self.silence = 0
        self.done = False

    # -- the events --------------------------------------------------------------------------

    def start(self, tag: str, attributes: dict[str, str]) -> None:
        name, where = self._name(tag), self._where()
        if self.done:
            raise SsmlError(f"<{name}> at {where} is after </speak>")
        if not self.frames and name != "speak":
            raise SsmlError(f"an SSML document is one <speak> element; it begins with <{name}>")
        if self.frames and name == "speak":
            raise SsmlError(f"<speak> at {where} is inside <speak>")
        if len(self.frames) >= MAX_DEPTH:
            raise SsmlError(f"<{name}> at {where} is nested more than {MAX_DEPTH} deep")
        parent = self.frames[-1] if self.frames else None
        if parent is not None and (parent.say_as is not None or parent.alias is not None):
            raise SsmlError(f"<{name}> at {where} is inside <{parent.name}>, which holds text only")
        if name not in SUPPORTED and name not in PLAIN:
            raise SsmlError(
                f"<{name}> at {where} is not supported; supported: "
                f"{', '.join(f'<{n}>' for n in (*SUPPORTED, *PLAIN))}"
            )
        frame = _Frame(
            name,
            where,
            parent.voice if parent else None,
            parent.speed if parent else None,
            parent.factor if parent else 1.0,
            parent.language if parent else None,
        )
        read = getattr(self, "_" + name.replace("-", "_"), None)
        if read is not None:
            read(frame, attributes)
        if name in ("p", "s"):
            self._flush()
        self.frames.append(frame)

    def data(self, text: str) -> None:
        if not self.frames:
            if text.strip():
                raise SsmlError("text outside <speak>")
            return
        frame = self.frames[-1]
        if frame.say_as is not None or frame.alias is not None:
            frame.text.append(text)
        else:
            self._add(text)

    def end(self, tag: str) -> None:
        frame = self.frames.pop()
        if frame.say_as is not None:
            kind, date_format = frame.say_as
            language = frame.language or _language_of(self._document_text(frame))
            try:
                said = say_as(kind, "".join(frame.text), language, date_format, self.normalise)
            except SayAsError as error:
                raise SsmlError(
                    f"<say-as interpret-as={kind!r}> at {frame.where}: {error}"
                ) from None
            self._add(said if language == "zh" else f" {said} ")
        elif frame.alias is not None:
            self._add(f" {frame.alias} ")
        if frame.name in ("p", "s"):
            self._flush()
        if not self.frames:
            self._flush()
            self.done = True

    def close(self) -> list[Span | Pause]:
        return self.parts

    # -- the elements ------------------------------------------------------------------------

    def _speak(self, frame: _Frame, attributes: dict[str, str]) -> None:
        if XML_LANG in attributes:
            frame.language = _language(attributes[XML_LANG], frame.where)

    def _lang(self, frame: _Frame, attributes: dict[str, str]) -> None:
        if XML_LANG not in attributes:
            raise SsmlError(f"<lang> at {frame.where} needs xml:lang")
        frame.language = _language(attributes[XML_LANG], frame.where)

    def _voice(self, frame: _Frame, attributes: dict[str, str]) -> None:
        others = sorted(set(attributes) - {"name"})
        if others or not attributes.get("name", "").strip():
            raise SsmlError(
                f"<voice> at {frame.where} takes a name (any voice the API takes), "
                f"not {', '.join(others) or 'nothing'}"
            )
        frame.voice = attributes["name"].strip()

    def _prosody(self, frame: _Frame, attributes: dict[str, str]) -> None:
        others = sorted(set(attributes) - {"rate", *IGNORED_PROSODY})
        if others:
            raise SsmlError(f"<prosody> at {frame.where}: {', '.join(others)} is not supported")
        rate = attributes.get("rate")
        if rate is None:
            return
        rate = rate.strip().lower()
        percent = _PERCENT.fullmatch(rate)
        if rate in RATES:
            frame.speed, frame.factor = RATES[rate], 1.0
        elif rate == "default":
            frame.speed, frame.factor = None, 1.0
        elif percent is not None:
            # "+20%" and "-20%" change the rate by that much; "150%" sets it to that share
            value = float(percent.group(1))
            factor = 1 + value / 100 if percent.group(1)[0] in "+-" else value / 100
            if factor <= 0:
                raise SsmlError(f"<prosody rate={rate!r}> at {frame.where} is not above 0")
            frame.factor *= factor
        else:
            try:
                factor = float(rate)
            except ValueError:
                factor = 0.0
            if not 0 < factor < 100:
                raise SsmlError(
                    f"<prosody rate={rate!r}> at {frame.where}: a rate is "
                    f"{', '.join(RATES)}, default, a percentage or a positive number"
                )
            frame.factor *= factor

    def _say_as(self, frame: _Frame, attributes: dict[str, str]) -> None:
        kind = attributes.get("interpret-as", "")
        if kind not in KINDS:
            raise SsmlError(
                f"<say-as> at {frame.where}: interpret-as {kind!r} is not one of {', '.join(KINDS)}"
            )
        frame.say_as = (kind, attributes.get("format"))

    def _sub(self, frame: _Frame, attributes: dict[str, str]) -> None:
        if "alias" not in attributes:
            raise SsmlError(f"<sub> at {frame.where} needs alias")
        frame.alias = attributes["alias"]

    def _break(self, frame: _Frame, attributes: dict[str, str]) -> None:
        if "time" in attributes:
            match = _TIME.fullmatch(attributes["time"].strip())
            if match is None:
                raise SsmlError(
                    f"<break> at {frame.where}: time is like 700ms or 1.5s, "
                    f"not {attributes['time']!r}"
                )
            amount, unit = float(match.group(1)), match.group(2)
            milliseconds = round(amount * (1000 if unit == "s" else 1))
        else:
            strength = attributes.get("strength", "medium")
            if strength not in STRENGTHS:
                raise SsmlError(
                    f"<break> at {frame.where}: strength is one of {', '.join(STRENGTHS)}"
                )
            milliseconds = STRENGTHS[strength]
        if milliseconds > MAX_BREAK_MS:
            raise SsmlError(f"<break> at {frame.where} is longer than {MAX_BREAK_MS} ms")
        self.silence += milliseconds
        if self.silence > MAX_SILENCE_MS:
            raise SsmlError(f"the breaks add up to more than {MAX_SILENCE_MS} ms at {frame.where}")
        if milliseconds or attributes.get("strength") != "none":
            self._flush()
            self._append(Pause(milliseconds))

    # -- spans ---------------------------------------------------------------------------------

    def _add(self, text: str) -> None:
        frame = self.frames[-1]
        state = (frame.voice, frame.speed, frame.factor, frame.language)
        if self.pending_state is not None and state != self.pending_state:
            self._flush()
        if not self.pending and not text.strip():
            return
        self.pending_state = state
        self.pending.append(text)

    def _flush(self) -> None:
        text = _BEFORE_PUNCTUATION.sub(r"\1", normalise_text("".join(self.pending)))
        state, self.pending, self.pending_state = self.pending_state, [], None
        if not speakable(text) or state is None:  # punctuation alone: no span of its own
            return
        self.chars += len(text)
        if self.chars > self.max_chars:
            raise SsmlTooLong(
                f"the text inside the SSML has more than {self.max_chars} characters; "
                "that is the limit"
            )
        voice, speed, factor, language = state
        self._append(Span(text, voice, speed, factor, language))

    def _append(self, part: Span | Pause) -> None:
        if len(self.parts) >= MAX_PARTS:
            raise SsmlError(f"the document has more than {MAX_PARTS} spans and breaks")
        self.parts.append(part)

    # -- where -------------------------------------------------------------------------------

    def _name(self, tag: str) -> str:
        if tag.startswith("{"):
            namespace, _, local = tag[1:].partition("}")
            return local if namespace == SSML_NAMESPACE else f"{{{namespace}}}{local}"
        return tag

    def _where(self) -> str:
        if self.parser is None:
            return "?"
        return f"line {self.parser.CurrentLineNumber}, column {self.parser.CurrentColumnNumber + 1}"

    def _document_text(self, frame: _Frame) -> str:
        return "".join(self.pending) + "".join(frame.text)


def _language(value: str, where: str) -> str:
    primary = value.strip().lower().replace("_", "-").split("-")[0]
    language = {"cmn": "zh", "yue": "zh"}.get(primary, primary)
    if language not in LANGUAGES:
        raise SsmlError(f"xml:lang {value!r} at {where}: the languages are {', '.join(LANGUAGES)}")
    return language


def _language_of(text: str) -> str:
    """zh when the text around holds a Chinese character, else en."""
    return "zh" if any("\u4e00" <= char <= "\u9fff" for char in text) else "en"


def parse(text: str, max_chars: int, normalise: Callable[[str, str], str]) -> list[Span | Pause]:
    """The spans and pauses of an SSML document, or ``SsmlError`` naming what is wrong and
    where. ``max_chars``: the limit of the text inside (``SsmlTooLong`` beyond);
    ``normalise(text, language)``: the text normaliser, for say-as dates and times."""
    from xml.etree.ElementTree import ParseError

    from defusedxml import DefusedXmlException
    from defusedxml.ElementTree import DefusedXMLParser

    reader = _Reader(normalise, max_chars)
    parser = DefusedXMLParser(target=reader, forbid_dtd=True)
    reader.parser = parser.parser  # expat's, whose position is that of the event being read
    try:
        parser.feed(text)
        parser.close()  # the target's result: its parts
        parts = reader.parts
    except DefusedXmlException as error:
        raise SsmlError(
            "SSML may not declare a DTD or entities, nor refer to anything outside it "
            f"({error.__class__.__name__})"
        ) from None
    except ParseError as error:
        raise SsmlError(f"the SSML is not well-formed XML: {error}") from None
    if not any(isinstance(part, Span) for part in parts):
        raise SsmlError("the SSML has nothing to say")
    return parts
