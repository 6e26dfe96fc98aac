"""Home Assistant's Wyoming protocol, with the ``wyoming`` package's own client classes against a
real server process on loopback (tiny model): describe, a whole synthesis, a streamed answer
whose first audio comes before its text has all arrived, refusals, hostile clients."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import time

import numpy as np
import pytest
import requests
import soundfile
from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
    SynthesizeVoice,
)

from benchmarks.serverproc import free_port

SENTENCE = "今天天气很好。"


@pytest.fixture(scope="module")
def server(start_server):
    port = free_port()
    server = start_server(CHATTTS_WYOMING_PORT=str(port), CHATTTS_CACHE_SIZE="0")
    server.wait_ready()
    server.wyoming = port
    return server


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 120))


async def _events_until(client: AsyncTcpClient, done: str) -> list:
    """Every event up to and including the first of type ``done`` (or an error)."""
    events = []
    while True:
        event = await client.read_event()
        assert event is not None, f"closed before {done}: {[e.type for e in events]}"
        events.append(event)
        if event.type in (done, "error"):
            return events


def _pcm(events) -> bytes:
    return b"".join(AudioChunk.from_event(e).audio for e in events if AudioChunk.is_type(e.type))


def test_describe_says_it_streams_and_lists_the_voices(server):
    async def go():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(Describe().event())
            return Info.from_event(await client.read_event())

    info = run(go())
    program = info.tts[0]
    assert program.supports_synthesize_streaming and program.installed
    names = {voice.name for voice in program.voices}
    assert {"alloy", "nova", "shimmer"} <= names
    assert all(voice.languages == ["zh", "en"] for voice in program.voices)


def test_a_whole_synthesis_is_the_http_streams_audio(server):
    """The same sentence, voice and (default) seed: Wyoming's PCM is the audio HTTP streams."""

    async def go():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            voice = SynthesizeVoice(name="alloy")
            await client.write_event(Synthesize(text=SENTENCE, voice=voice).event())
            return await _events_until(client, "audio-stop")

    events = run(go())
    assert events[0].type == "audio-start" and events[-1].type == "audio-stop"
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (24000, 2, 1)
    pcm = _pcm(events)
    answer = requests.post(
        server.url + "/v1/audio/speech",
        json={"model": "tts-1", "voice": "alloy", "input": SENTENCE, "response_format": "pcm"},
        timeout=120,
    )
    assert answer.status_code == 200
    assert len(pcm) > 0 and len(pcm) == len(answer.content)
    ours = np.frombuffer(pcm, dtype="<i2").astype(np.float32)
    theirs = np.frombuffer(answer.content, dtype="<i2").astype(np.float32)
    assert np.array_equal(ours, theirs)


def test_a_streamed_answer_speaks_before_its_text_has_all_come(server):
    """Sentences arrive a few words at a time: the first sentence's audio arrives before
    synthesize-stop is sent; every sentence gets its own audio-start..audio-stop, in order;
    the compatibility synthesize inside the stream is ignored; synthesize-stopped ends it."""
    sentences = ["今天天气很好。", "我们去公园散步吧！", "The park opens at nine."]

    async def go():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(SynthesizeStart(voice=SynthesizeVoice(name="nova")).event())
            for sentence in sentences[:2]:
                for piece in (sentence[:3], sentence[3:]):
                    await client.write_event(SynthesizeChunk(text=piece).event())
            # the first sentence is complete: its audio comes while the rest is unwritten
            first = await asyncio.wait_for(client.read_event(), 60)
            second = await asyncio.wait_for(client.read_event(), 60)
            await client.write_event(SynthesizeChunk(text=" " + sentences[2]).event())
            await client.write_event(Synthesize(text="".join(sentences)).event())
            await client.write_event(SynthesizeStop().event())
            rest = await _events_until(client, "synthesize-stopped")
            return [first, second, *rest]

    events = run(go())
    assert events[0].type == "audio-start" and events[1].type == "audio-chunk"
    kinds = [event.type for event in events]
    assert kinds[-1] == SynthesizeStopped().event().type
    assert kinds.count("audio-start") == 3 and kinds.count("audio-stop") == 3
    assert "error" not in kinds
    # each sentence's audio is whole before the next starts
    stops = [i for i, kind in enumerate(kinds) if kind == "audio-stop"]
    starts = [i for i, kind in enumerate(kinds) if kind == "audio-start"]
    assert all(stop < start for stop, start in zip(stops, starts[1:], strict=False))
    # the three sentences, each spoken as HTTP speaks it alone: in order
    spans = [events[start + 1 : stop] for start, stop in zip(starts, stops, strict=True)]
    for sentence, span in zip(sentences, spans, strict=True):
        alone = requests.post(
            server.url + "/v1/audio/speech",
            json={"model": "tts-1", "voice": "nova", "input": sentence, "response_format": "pcm"},
            timeout=120,
        )
        assert _pcm(span) == alone.content


@pytest.mark.parametrize(
    ("event", "code", "words"),
    [
        (Synthesize(text=SENTENCE, voice=SynthesizeVoice("nobody")), "unknown_voice", "nobody"),
        (Synthesize(text="   "), "bad_text", "nothing to say"),
        (Synthesize(text="[bogus]好"), "bad_text", "[bogus]"),
    ],
)
def test_a_refusal_is_an_error_event(server, event, code, words):
    async def go():
        async with AsyncTcpClient("127.0.0.1", server.wyoming) as client:
            await client.write_event(event.event())
            answer = await client.read_event()
            # the connection still serves
            await client.write_event(Describe().event())
            return answer, await client.read_event()

    answer, described = run(go())
    error = Error.from_event(answer)
    assert error.code == code and words in error.text
    assert described.type == "info"


def _raw(port: int, data: bytes, wait: float = 10.0) -> bytes:
    """Send ``data`` on a plain socket; what came back before the server closed (or ``wait``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        received = b""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:  # closed with the rest of the event unread: a reset
                return received
            if not chunk:
                return received
            received += chunk
        raise AssertionError(f"the server kept the connection open; it sent {received[:200]!r}")


@pytest.mark.parametrize(
    "data",
    [
        b"this is not json\n",
        json.dumps({"data": {"text": "no type"}}).encode() + b"\n",
        b"x" * (200 * 1024) + b"\n",  # a header line past the limit
        json.dumps({"type": "synthesize", "data_length": 50 * 2**20}).encode() + b"\n",
    ],
    ids=["not-json", "no-type", "long-line", "huge-data"],
)
def test_a_malformed_or_oversized_event_closes_the_connection(server, data):
    assert _raw(server.wyoming, data) == b""
    assert requests.get(server.url + "/healthz", timeout=5).status_code == 200


def _cancelled(server) -> float:
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("chatts_infer_total") and 'outcome="cancelled"' in line:
            return float(line.split()[-1])
    return 0.0


def test_a_client_that_leaves_mid_answer_frees_its_rows(start_server, tiny_endless_model_dir):
    """A long answer (speech that never ends before its step cap), the connection dropped
    after its first audio: its generation is cancelled (counted so), the queue empties long
    before the answer would have ended, and the server serves both protocols on."""
    port = free_port()
    server = start_server(
        tiny_endless_model_dir, CHATTTS_WYOMING_PORT=str(port), CHATTTS_MAX_NEW_TOKENS="2048"
    )
    server.wait_ready()
    before = _cancelled(server)

    async def go():
        client = AsyncTcpClient("127.0.0.1", port)
        await client.connect()
        await client.write_event(Synthesize(text=SENTENCE * 3).event())
        while (await client.read_event()).type != "audio-chunk":
            pass
        await client.disconnect()

    run(go())
    # the cancellation is counted as the connection closes; the scheduler lets the rows go
    # at its next iteration, so the queue is watched until it empties, not read once
    deadline = time.monotonic() + 30
    depth = None
    while time.monotonic() < deadline:
        depth = requests.get(server.url + "/status", timeout=5).json()["queue_depth"]
        if _cancelled(server) > before and depth == 0:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(
            f"the dropped answer was not cancelled and let go (queue depth {depth}, "
            f"cancelled {_cancelled(server) - before:.0f})"
        )
    server.wyoming = port
    test_describe_says_it_streams_and_lists_the_voices(server)


def test_idle_wyoming_connections_leave_http_alone(server):
    """100 connections that send nothing: HTTP's probes and speech answer as before."""
    idle = [socket.create_connection(("127.0.0.1", server.wyoming)) for _ in range(100)]
    try:
        started = time.monotonic()
        assert requests.get(server.url + "/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0
        answer = requests.post(
            server.url + "/synthesize", json={"text": SENTENCE, "seed": 3}, timeout=120
        )
        assert answer.status_code == 200
        audio, rate = soundfile.read(io.BytesIO(answer.content))
        assert rate == 24000 and len(audio) > 0
        test_describe_says_it_streams_and_lists_the_voices(server)
    finally:
        for sock in idle:
            sock.close()


def test_a_full_queue_is_an_error_event(start_server):
    """A text of more segments than the queue holds: Wyoming's error event says so, as HTTP's
    503 does, and the connection goes on serving."""
    port = free_port()
    server = start_server(CHATTTS_WYOMING_PORT=str(port), CHATTTS_MAX_QUEUE="2")
    server.wait_ready()
    text = "这是第一句话。" * 100

    async def go():
        async with AsyncTcpClient("127.0.0.1", port) as client:
            await client.write_event(Synthesize(text=text).event())
            answer = await client.read_event()
            await client.write_event(Synthesize(text=SENTENCE).event())
            return answer, await _events_until(client, "audio-stop")

    answer, spoken = run(go())
    error = Error.from_event(answer)
    assert error.code == "overloaded" and "no room" in error.text
    assert spoken[-1].type == "audio-stop" and _pcm(spoken)
