"""Text before the model: control tokens, sentence splitting and real text normalisation.

ChatTTS's own normaliser deletes digits and most symbols ("1+1=2" becomes silence), so numbers,
dates, times, money, units and phone numbers are first written out in words by ``wetext``
(WeTextProcessing's FSTs), with the language detected per sentence. Control tokens such as
``[uv_break]`` are kept out of its way and put back unchanged.

Long text is split at sentence boundaries (Chinese and English punctuation) and packed into
segments of at most ``max_chars`` characters; a sentence longer than that is cut at a clause
boundary, then at a space, and only as a last resort in the middle of a run of characters.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from typing import Any

log = logging.getLogger(__name__)

# Tokens ChatTTS understands inside the text itself.
INLINE_TOKENS = ("[uv_break]", "[v_break]", "[lbreak]", "[laugh]")
# Tokens that steer the text-refinement pass (its prompt), with their ranges.
REFINE_TOKENS = {"oral": range(10), "laugh": range(3), "break": range(8)}

TOKEN = re.compile(r"\[[^\[\]]*\]")
_REFINE_TOKEN = re.compile(r"\[(oral|laugh|break)_(\d)\]")
_REFINE_PROMPT = re.compile(r"(?: *\[(?:oral|laugh|break)_\d\])* *")
# A sentence ends after these, with any closing quotes or brackets that follow.
_SENTENCE_END = re.compile(r"(?<=[。！？!?；;…\n])[”’\"'）)\]」』]*|(?<=[.])[”’\"')\]]*(?=\s|$)")
_CLAUSE_END = re.compile(r"(?<=[，,、：:])")
_WHITESPACE = re.compile(r"\s+")


class TextError(ValueError):
    """The text breaks a rule about control tokens; the message says which."""


def check_tokens(text: str, max_tokens: int) -> int:
    """Every ``[...]`` in the text must be an inline control token; returns how many there are."""
    found = TOKEN.findall(text)
    unknown = sorted({token for token in found if token not in INLINE_TOKENS})
    if unknown:
        raise TextError(
            f"unknown control token(s) {', '.join(unknown)}; allowed in the text: "
            f"{', '.join(INLINE_TOKENS)}"
        )
    if len(found) > max_tokens:
        raise TextError(f"text has {len(found)} control tokens; the limit is {max_tokens}")
    return len(found)


def check_refine_prompt(prompt: str) -> str:
    """A refinement prompt is a run of ``[oral_N]``, ``[laugh_N]`` and ``[break_N]`` tokens,
    spaces allowed between them; returned without the spaces."""
    if not _REFINE_PROMPT.fullmatch(prompt):
        kinds = [f"[{kind}_{r.start}-{r.stop - 1}]" for kind, r in REFINE_TOKENS.items()]
        raise TextError(
            f"'refine_prompt' may only hold {', '.join(kinds[:-1])} and {kinds[-1]} tokens; "
            f"got {prompt!r}"
        )
    tokens = _REFINE_TOKEN.findall(prompt)
    for kind, number in tokens:
        if int(number) not in REFINE_TOKENS[kind]:
            allowed = REFINE_TOKENS[kind]
            raise TextError(
                f"[{kind}_{number}] is out of range: {kind} goes from "
                f"{allowed.start} to {allowed.stop - 1}"
            )
    return "".join(f"[{kind}_{number}]" for kind, number in tokens)


def normalise_text(text: str) -> str:
    """The canonical form of a text: it is what the model reads and what the cache keys on."""
    text = unicodedata.normalize("NFC", text)
    # Control characters other than whitespace carry no speech and confuse the tokenizer.
    text = "".join(ch for ch in text if ch.isspace() or unicodedata.category(ch) != "Cc")
    return _WHITESPACE.sub(" ", text).strip()


def speakable(text: str) -> bool:
    """Whether a text has anything to say (a letter, a digit, a character)."""
    return any(ch.isalnum() for ch in text)


class NothingToSpeak(TextError):
    """After normalisation the text is empty."""


def text_to_speak(text: str, max_tokens: int) -> str:
    """A text as every route takes it: only the inline control tokens, at most ``max_tokens``
    of them (checked as sent: "[lau\x01gh]" is not "[laugh]", though removing control
    characters would make it one), normalised, not empty. Raises ``TextError``."""
    check_tokens(unicodedata.normalize("NFC", text), max_tokens)
    text = normalise_text(text)
    if not text:
        raise NothingToSpeak("there is nothing to say")
    return text


def complete_sentences(text: str) -> tuple[list[str], str]:
    """The sentences of a text still being written that are complete, and the rest. A sentence
    ending in "." counts once something follows it (more may come: "3." of "3.5"); one ending
    in 。！？!?；; or a newline at once."""
    end = 0
    for match in _SENTENCE_END.finditer(text):
        if match.end() > end and (match.end() < len(text) or text[match.start() - 1] != "."):
            end = match.end()
    return split_sentences(text[:end]), text[end:]


def split_sentences(text: str) -> list[str]:
    """Sentences, each with its closing punctuation; nothing dropped, whitespace trimmed."""
    pieces, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        if end > start:
            pieces.append(text[start:end])
            start = end
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def _cut_long(sentence: str, max_chars: int) -> list[str]:
    """Cut one over-long sentence at clause boundaries, then spaces, then anywhere."""
    if len(sentence) <= max_chars:
        return [sentence]
    for boundary in (_CLAUSE_END, re.compile(r"(?<=\s)")):
        parts = [part for part in boundary.split(sentence) if part]
        if len(parts) > 1:
            return pack([p for part in parts for p in _cut_long(part, max_chars)], max_chars)
    # no boundary at all: cut, but never inside a control token
    pieces, current = [], ""
    for chunk in re.split(r"(\[[^\[\]]*\])", sentence):
        units = [chunk] if TOKEN.fullmatch(chunk) else list(chunk)
        for unit in units:
            if current and len(current) + len(unit) > max_chars:
                pieces.append(current)
                current = ""
            current += unit
    if current:
        pieces.append(current)
    return pieces


def pack(sentences: list[str], max_chars: int) -> list[str]:
    """Join consecutive sentences while a segment stays within ``max_chars``."""
    segments: list[str] = []
    for sentence in sentences:
        for piece in _cut_long(sentence, max_chars):
            piece = piece.strip()
            if not piece:
                continue
            joined = (
                f"{segments[-1]} {piece}"
                if segments and _needs_space(segments[-1], piece)
                else (segments[-1] + piece if segments else piece)
            )
            if segments and len(joined) <= max_chars:
                segments[-1] = joined
            else:
                segments.append(piece)
    return segments


def _needs_space(left: str, right: str) -> bool:
    return left[-1].isascii() and right[0].isascii()


LANGUAGES = ("zh", "en")  # what the normalisers read (wetext's and ChatTTS's)


class Normaliser:
    """``wetext`` text normalisation, language detected per call unless given, control tokens
    protected.

    The FSTs load on first use (~0.2 s); ``warm_up`` does that before the service is ready."""

    def __init__(self) -> None:
        # wetext's Normalizers (untyped), by language ("auto": detected), loaded on first use
        self._normalizers: dict[str, Any] = {}
        self._lock = threading.Lock()  # wetext's FST objects are not documented as thread-safe

    def warm_up(self) -> None:
        self("今天是2024年3月5日。")
        self("It is 3:30 pm on Jan 5, 2024.")

    def many(self, texts: list[str], language: str | None = None) -> list[str]:
        return [self(text, language) for text in texts]

    def __call__(self, text: str, language: str | None = None) -> str:
        parts = re.split(r"(\[[^\[\]]*\])", text)
        out = []
        for part in parts:
            if (
                not part
                or TOKEN.fullmatch(part)
                or not any(ch.isdigit() or not ch.isalnum() for ch in part)
            ):
                out.append(part)  # control tokens, and plain words with nothing to expand
                continue
            out.append(self._normalise(part, language))
        return "".join(out)

    def _normalise(self, text: str, language: str | None) -> str:
        stripped = text.strip()
        if not stripped:
            return text
        key = language or "auto"
        with self._lock:
            if key not in self._normalizers:
                from wetext import Normalizer

                self._normalizers[key] = Normalizer(lang=key, operator="tn")
            try:
                normalised = self._normalizers[key].normalize(stripped)
            except Exception as error:  # wetext asserts on some inputs (e.g. "\xad\xa0:")
                log.warning("text normalisation skipped a part it could not parse: %r", error)
                normalised = stripped
        # keep the whitespace around the part: it separates it from neighbouring tokens
        lead = text[: len(text) - len(text.lstrip())]
        trail = text[len(text.rstrip()) :]
        return f"{lead}{normalised}{trail}"


# the process's one normaliser: the engine's, and SSML's say-as dates and times
NORMALISER = Normaliser()
