"""Scripts: what reading SSML costs, and a dialogue against its turns sent one by one.

    python benchmarks/scripts.py [--model-dir DIR] [--rounds 3] [--max-new-tokens 300] [--json]

1. Parsing, in this process, no model: a plain text and the same words as SSML (breaks, a voice
   switch, prosody, say-as) through the request parser ``/v1/audio/speech`` uses, each timed
   over many calls (the median of five batches), and the SSML with and without the say-as
   elements (a date is written out by the normaliser).
2. Against ``python server.py`` on loopback (cache off): a four-turn dialogue in three voices,
   each turn one or two sentences, made three ways, alternated ``--rounds`` times:
   one request with ``turns`` (its turns generate side by side), the same turns sent one by one
   and waited for in turn (a podcast script driven line by line), and the same turns sent at
   once by a client on four threads. It prints the wall time of each and the dialogue's
   audio seconds per wall second, plus a streamed dialogue's first audio.

Without ``--model-dir`` it uses the full-size random-weight model whose speech never ends
(``models/full-endless``), each segment held to ``--max-new-tokens`` steps: every way makes the
same number of steps, so the comparison is of the scheduling, not of what the model says.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.serverproc import Server, model_arguments  # noqa: E402
from chattts_service.api.validation import speech_request  # noqa: E402
from chattts_service.config import Settings  # noqa: E402
from chattts_service.domain.text import NORMALISER  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402

PLAIN = (
    "Welcome back to the show. Today we talk about trains. The first line opened on "
    "March 5, 2024, at 9:30 am. Call 555-1234 for tickets. 欢迎收听本期节目。"
)
SAY_AS = (
    '<speak>Welcome back to the show.<break time="500ms"/>'
    '<voice name="seed:7">Today we talk about <prosody rate="slow">trains</prosody>.</voice>'
    ' The first line opened on <say-as interpret-as="date">2024-03-05</say-as>, at '
    '<say-as interpret-as="time">9:30 am</say-as>. Call <say-as interpret-as="telephone">'
    '555-1234</say-as> for tickets.<break strength="strong"/>'
    '<lang xml:lang="zh">欢迎收听本期节目。</lang></speak>'
)
NO_SAY_AS = (
    '<speak>Welcome back to the show.<break time="500ms"/>'
    '<voice name="seed:7">Today we talk about <prosody rate="slow">trains</prosody>.</voice>'
    " The first line opened on March 5, 2024, at 9:30 am. Call 555-1234 for tickets."
    '<break strength="strong"/><lang xml:lang="zh">欢迎收听本期节目。</lang></speak>'
)
TURNS = [
    {"voice": "echo", "input": "Did you hear about the new train line? It opens next week."},
    {"voice": "nova", "input": "I did. They say it cuts the trip in half."},
    {"voice": "echo", "input": "That would save me an hour every day."},
    {"voice": "onyx", "input": "Tickets go on sale on Monday. Get yours early."},
]
GAP_MS = 400


class _Voices:
    """Resolves any voice name to a placeholder: parsing, not the voice store, is timed."""

    def resolve(self, name: str, field: str):
        from chattts_service.domain.voices import Voice

        return Voice(name, None, name)


def parse_cost(settings: Settings, calls: int = 200) -> dict[str, float]:
    NORMALISER.warm_up()
    voices = _Voices()
    costs = {}
    for name, text in (("plain", PLAIN), ("ssml", NO_SAY_AS), ("ssml_say_as", SAY_AS)):
        body = {"model": "tts-1", "voice": "alloy", "input": text}
        batches = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                speech_request(body, settings, voices)
            batches.append((time.perf_counter() - started) / calls)
        costs[name] = statistics.median(batches)
    return costs


def _speech(url: str, body: dict) -> tuple[bytes, float]:
    answer = requests.post(url + "/v1/audio/speech", json=body, timeout=600)
    answer.raise_for_status()
    return answer.content, float(answer.headers["X-Audio-Seconds"])


def dialogue(url: str) -> tuple[float, float]:
    started = time.perf_counter()
    body = {"model": "tts-1", "voice": "alloy", "turns": TURNS, "turn_gap_ms": GAP_MS}
    _, seconds = _speech(url, {**body, "response_format": "pcm", "stream": False})
    return time.perf_counter() - started, seconds


def one_by_one(url: str) -> tuple[float, float]:
    started, seconds = time.perf_counter(), len(TURNS[1:]) * GAP_MS / 1000
    for turn in TURNS:
        body = {"model": "tts-1", "response_format": "pcm", "stream": False, **turn}
        seconds += _speech(url, body)[1]
    return time.perf_counter() - started, seconds


def at_once(url: str) -> tuple[float, float]:
    started = time.perf_counter()
    bodies = [{"model": "tts-1", "response_format": "pcm", "stream": False, **t} for t in TURNS]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: _speech(url, body), bodies))
    seconds = sum(seconds for _, seconds in answers) + len(TURNS[1:]) * GAP_MS / 1000
    return time.perf_counter() - started, seconds


def streamed_first_audio(url: str) -> float:
    body = {"model": "tts-1", "voice": "alloy", "turns": TURNS, "response_format": "pcm"}
    started = time.perf_counter()
    with requests.post(url + "/v1/audio/speech", json=body, stream=True, timeout=600) as answer:
        answer.raise_for_status()
        first = None
        for chunk in answer.iter_content(None):
            if chunk and first is None:
                first = time.perf_counter() - started
    assert first is not None
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = model_arguments(parser, rounds=3)
    result: dict = {"cpu": cpu_model(), "parse_seconds": parse_cost(Settings.from_env({}))}
    server = Server(
        args.model_dir,
        Path("/tmp") / "scripts-bench.log",
        CHATTTS_CACHE_SIZE="0",
        CHATTTS_MAX_NEW_TOKENS=str(args.max_new_tokens),
    )
    ways = {"dialogue": dialogue, "one_by_one": one_by_one, "at_once": at_once}
    walls: dict[str, list[float]] = {name: [] for name in ways}
    audio: dict[str, float] = {}
    try:
        server.wait_ready()
        one_by_one(server.url)  # every voice's first request
        for _ in range(args.rounds):
            for name, way in ways.items():
                wall, seconds = way(server.url)
                walls[name].append(wall)
                audio[name] = seconds
        first = [streamed_first_audio(server.url) for _ in range(args.rounds)]
    finally:
        server.stop()
    result["wall_seconds"] = walls
    result["audio_seconds"] = audio
    result["streamed_dialogue_first_audio"] = first
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    costs = result["parse_seconds"]
    print(f"cpu {result['cpu']}")
    print(
        f"parsing /v1/audio/speech's body: plain {costs['plain'] * 1e6:.0f} us, SSML "
        f"{costs['ssml'] * 1e6:.0f} us, SSML with say-as {costs['ssml_say_as'] * 1e6:.0f} us "
        f"({len(PLAIN)} characters of text)"
    )
    for name in ways:
        wall = statistics.median(walls[name])
        print(
            f"{name:>10}: {wall:.2f} s wall (median of {args.rounds}), "
            f"{audio[name]:.2f} s of audio, {audio[name] / wall:.2f} audio s per wall s"
        )
    ratio = statistics.median(walls["one_by_one"]) / statistics.median(walls["dialogue"])
    print(f"one dialogue request is {ratio:.2f}x as fast as its turns sent one by one")
    print(f"streamed dialogue: first audio {statistics.median(first):.3f} s (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
