"""Home Assistant's Wyoming port against HTTP: first audio, and a streamed answer's pace.

    python benchmarks/home_assistant.py [--model-dir DIR] [--rounds 5] [--max-new-tokens 300]
                                        [--json]

Starts ``python server.py`` on loopback (cache off) with the Wyoming port, then:

1. The same sentence, voice and seed, alternated ``--rounds`` times: the first ``audio-chunk``
   of a whole Wyoming ``synthesize`` against the first byte of an HTTP stream
   (``/v1/audio/speech``, PCM). Target: within 50 ms of HTTP's.
2. A five-sentence answer sent as Home Assistant sends an LLM's: chunks of about five words
   (five characters of Chinese), 100 ms apart. It measures the first audio after the first
   sentence's last chunk was sent (target: 1.0 s), the longest silence between one sentence's
   ``audio-stop`` and the next one's first chunk (which includes waiting for the next
   sentence's text), and how far the audio fell behind a listener who started at its first
   chunk (``domain.playback``: the gaps a listener hears; target: none over 0.3 s once audio
   has started).

Without ``--model-dir`` it uses the full-size random-weight model whose speech never ends
(``models/full-endless``), each segment held to ``--max-new-tokens`` steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from wyoming.audio import AudioChunk  # noqa: E402
from wyoming.client import AsyncTcpClient  # noqa: E402
from wyoming.tts import (  # noqa: E402
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

from benchmarks.serverproc import Server, free_port, model_arguments  # noqa: E402
from chattts_service.domain.playback import Playback  # noqa: E402
from chattts_service.runtime.cpu import cpu_model  # noqa: E402

SENTENCE = "今天天气很好，我们一起去公园散步吧。"
ANSWER = [
    "好的，我来帮你查一下。",
    "客厅的灯已经打开了。",
    "The living room is now at twenty one degrees.",
    "明天早上七点会下小雨，记得带伞。",
    "Is there anything else I can do for you?",
]
VOICE = "nova"
BYTES_PER_SECOND = 24000 * 2


def pieces(sentence: str) -> list[str]:
    """The sentence as an LLM streams it: about five words (five characters of Chinese)."""
    if sentence.isascii():
        words = sentence.split(" ")
        return [" ".join(words[i : i + 5]) + " " for i in range(0, len(words), 5)]
    return [sentence[i : i + 5] for i in range(0, len(sentence), 5)]


async def wyoming_first_audio(port: int, seed_text: str) -> float:
    async with AsyncTcpClient("127.0.0.1", port) as client:
        started = time.perf_counter()
        await client.write_event(Synthesize(seed_text, SynthesizeVoice(name=VOICE)).event())
        first = None
        while True:
            event = await client.read_event()
            if event is None or event.type == "error":
                raise RuntimeError(f"Wyoming answered {event}")
            if first is None and event.type == "audio-chunk":
                first = time.perf_counter() - started
            if event.type == "audio-stop":
                return first if first is not None else float("nan")


def http_first_audio(url: str, text: str) -> float:
    body = {"model": "tts-1", "voice": VOICE, "input": text, "response_format": "pcm"}
    started = time.perf_counter()
    with requests.post(url + "/v1/audio/speech", json=body, stream=True, timeout=120) as answer:
        answer.raise_for_status()
        first = None
        for chunk in answer.iter_content(4096):
            if chunk and first is None:
                first = time.perf_counter() - started
        return first if first is not None else float("nan")


async def streamed_answer(port: int) -> dict:
    """Send the answer as an LLM writes it while reading the audio as it comes."""
    async with AsyncTcpClient("127.0.0.1", port) as client:
        arrivals: list[tuple[str, float, int]] = []  # (event type, time, audio bytes)
        first_sentence_sent: list[float] = []

        async def write() -> None:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name=VOICE)).event())
            for index, sentence in enumerate(ANSWER):
                for piece in pieces(sentence):
                    await client.write_event(SynthesizeChunk(text=piece).event())
                    if index == 0 and not first_sentence_sent and sentence.endswith(piece):
                        first_sentence_sent.append(time.perf_counter())  # its last piece
                    await asyncio.sleep(0.1)
            await client.write_event(SynthesizeStop().event())

        async def read() -> None:
            while True:
                event = await client.read_event()
                if event is None or event.type == "error":
                    raise RuntimeError(f"Wyoming answered {event}")
                size = len(AudioChunk.from_event(event).audio) if event.type == "audio-chunk" else 0
                arrivals.append((event.type, time.perf_counter(), size))
                if event.type == "synthesize-stopped":
                    return

        await asyncio.gather(write(), read())
    chunks = [(at, size) for kind, at, size in arrivals if kind == "audio-chunk"]
    playback = Playback()
    for at, size in chunks:
        playback.arrived(at, size / BYTES_PER_SECOND)
    silences, stopped = [], None
    for kind, at, _ in arrivals:
        if kind == "audio-stop":
            stopped = at
        elif kind == "audio-chunk" and stopped is not None:
            silences.append(at - stopped)
            stopped = None
    return {
        "first_audio_after_first_sentence": chunks[0][0] - first_sentence_sent[0],
        "longest_silence_between_sentences": max(silences) if silences else 0.0,
        "behind_playback": playback.behind,
        "sentences": sum(1 for kind, _, _ in arrivals if kind == "audio-start"),
        "audio_seconds": sum(size for _, size in chunks) / BYTES_PER_SECOND,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args = model_arguments(parser, rounds=5)
    port = free_port()
    log = Path("/tmp") / f"wyoming-bench-{port}.log"
    server = Server(
        args.model_dir,
        log,
        CHATTTS_WYOMING_PORT=str(port),
        CHATTTS_CACHE_SIZE="0",
        CHATTTS_MAX_NEW_TOKENS=str(args.max_new_tokens),
    )
    try:
        server.wait_ready()
        http_first_audio(server.url, "热身。")  # the voice's first request
        wyoming, http = [], []
        for _ in range(args.rounds):
            wyoming.append(asyncio.run(wyoming_first_audio(port, SENTENCE)))
            http.append(http_first_audio(server.url, SENTENCE))
        streamed = [asyncio.run(streamed_answer(port)) for _ in range(max(1, args.rounds // 2))]
    finally:
        server.stop()
    result = {
        "cpu": cpu_model(),
        "wyoming_first_audio_median": statistics.median(wyoming),
        "http_first_audio_median": statistics.median(http),
        "wyoming_first_audio": wyoming,
        "http_first_audio": http,
        "streamed": streamed,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    difference = result["wyoming_first_audio_median"] - result["http_first_audio_median"]
    print(f"cpu {result['cpu']}")
    print(
        f"whole synthesize, first audio: Wyoming {result['wyoming_first_audio_median']:.3f} s, "
        f"HTTP {result['http_first_audio_median']:.3f} s (medians of {args.rounds}); "
        f"difference {difference * 1000:+.0f} ms (target within 50 ms: "
        f"{'ok' if difference <= 0.05 else 'MISSED'})"
    )
    for run in streamed:
        first = run["first_audio_after_first_sentence"]
        print(
            f"streamed answer ({run['sentences']} sentences, {run['audio_seconds']:.1f} s of "
            f"audio): first audio {first:.3f} s after the first sentence's last chunk "
            f"(target 1.0 s: {'ok' if first <= 1.0 else 'MISSED'}); longest silence between "
            f"sentences {run['longest_silence_between_sentences']:.3f} s; behind playback "
            f"{run['behind_playback']:.3f} s (target 0.3 s: "
            f"{'ok' if run['behind_playback'] <= 0.3 else 'MISSED'})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
