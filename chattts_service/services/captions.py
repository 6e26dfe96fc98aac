"""Captions for speech: one per sentence, timed from the audio's own segment boundaries.

A captioned request reads every sentence as its own segment (``sentence_segments``), and the
service joins segments with a pause it inserts itself, so where each sentence starts and ends is
known to the sample: no alignment model, no estimate. A sentence with nothing to say (symbols
alone) has no audio; its text joins the caption before it (or the first one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

CAPTION_FORMATS = ("json", "srt", "vtt")


@dataclass(frozen=True)
class Caption:
    text: str  # as the user wrote it
    spoken_text: str  # as the model read it (normalised, or refined)
    start_sample: int  # into the returned audio
    end_sample: int
    sample_rate: int
    speaker: str | None = None  # the voice that says it (a script's spans name theirs)

    @property
    def start(self) -> float:
        return round(self.start_sample / self.sample_rate, 6)

    @property
    def end(self) -> float:
        return round(self.end_sample / self.sample_rate, 6)

    def describe(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "end": self.end,
            "text": self.text,
            "spoken_text": self.spoken_text,
            "start_sample": self.start_sample,
            "end_sample": self.end_sample,
            **({"speaker": self.speaker} if self.speaker is not None else {}),
        }


def captions(
    sentences: list[tuple[str, int]],
    part_samples: tuple[int, ...],
    part_texts: tuple[str, ...],
    pause_samples: int,
    sample_rate: int,
) -> list[Caption]:
    """``sentences``: each sentence as written and how many segments (in order) speak it;
    ``part_samples``/``part_texts``: each segment's length and spoken text; segments are
    joined by ``pause_samples`` of silence."""
    if sum(count for _, count in sentences) != len(part_samples):
        raise ValueError("the sentences do not account for every segment")
    starts, offset = [], 0
    for index, samples in enumerate(part_samples):
        offset += pause_samples if index else 0
        starts.append(offset)
        offset += samples
    made: list[Caption] = []
    orphans: list[str] = []  # sentences without audio before the first caption
    part = 0
    for text, count in sentences:
        if count == 0:
            if made:
                made[-1] = replace(made[-1], text=f"{made[-1].text} {text}")
            else:
                orphans.append(text)
            continue
        first, last = part, part + count - 1
        made.append(
            Caption(
                text=" ".join([*orphans, text]),
                spoken_text=" ".join(part_texts[first : last + 1]),
                start_sample=starts[first],
                end_sample=starts[last] + part_samples[last],
                sample_rate=sample_rate,
            )
        )
        orphans = []
        part += count
    return made


def shifted(items: Sequence[Caption], offset: int, speaker: str | None) -> list[Caption]:
    """A span's captions placed ``offset`` samples into the whole answer, naming its speaker
    (a script's span; None for a plain text)."""
    return [
        replace(
            item,
            start_sample=item.start_sample + offset,
            end_sample=item.end_sample + offset,
            speaker=speaker,
        )
        for item in items
    ]


def at_rate(items: Sequence[Caption], sample_rate: int) -> list[Caption]:
    """Captions whose sample numbers count samples at ``sample_rate`` (the rate the audio
    leaves at); starts rounded down, ends up."""
    return [
        replace(
            item,
            start_sample=item.start_sample * sample_rate // item.sample_rate,
            end_sample=-(-item.end_sample * sample_rate // item.sample_rate),
            sample_rate=sample_rate,
        )
        for item in items
    ]


def _clock(seconds: float, separator: str, up: bool = False) -> str:
    """A cue time in milliseconds: starts rounded down and ends up, so a cue holds its audio."""
    millis = math.ceil(seconds * 1000 - 1e-6) if up else math.floor(seconds * 1000 + 1e-6)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    whole, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{whole:02d}{separator}{millis:03d}"


def srt(items: Sequence[Caption]) -> str:
    """SubRip: numbered cues, times as HH:MM:SS,mmm."""
    cues = [
        f"{number}\n{_clock(item.start, ',')} --> {_clock(item.end, ',', up=True)}\n"
        f"{_said_by(item)}{item.text}\n"
        for number, item in enumerate(items, start=1)
    ]
    return "\n".join(cues)


def _said_by(item: Caption) -> str:
    """SubRip has no speaker field: a script's cue begins with its speaker's name, as
    subtitles write it ("echo: ...")."""
    return f"{item.speaker}: " if item.speaker is not None else ""


def vtt(items: Sequence[Caption]) -> str:
    """WebVTT: times as HH:MM:SS.mmm; the cue text escaped (&, <, >), so a "-->" in it
    cannot end a cue; a script's cue in its speaker's voice span (``<v echo>``)."""
    cues = ["WEBVTT\n"]
    for item in items:
        text = _escaped(item.text)
        if item.speaker is not None:
            text = f"<v {_escaped(item.speaker)}>{text}"
        cues.append(f"{_clock(item.start, '.')} --> {_clock(item.end, '.', up=True)}\n{text}\n")
    return "\n".join(cues)


def _escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
