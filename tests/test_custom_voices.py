"""Voices made from a recording, through the official OpenAI client and plain HTTP.

A real server on loopback (tiny model). The flow OpenAI's custom voices have: a consent
recording, a voice from an audio sample made under it, speech in that voice by its id (and its
name, from every route), deletion; then every way a recording or a request can be wrong, each
a clear 4xx in OpenAI's error shape with nothing half-written and the worker alive.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import requests
import soundfile

LIMIT = 6  # CHATTTS_MAX_STORED_VOICES of this server: voices, and consents
TRANSCRIPT = "今天天气很好，我们一起去公园散步吧。"


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    server = start_server(CHATTTS_VOICES_DIR=str(voices), CHATTTS_MAX_STORED_VOICES=str(LIMIT))
    server.wait_ready()
    server.voices_dir = voices
    return server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _wav(samples: np.ndarray, rate: int = 24_000) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.fixture(scope="module")
def sample(server) -> bytes:
    """A recording this service made (ChatTTS copies its own voices best): a few seconds."""
    pieces = []
    for seed in (21, 22, 23):
        answer = requests.post(
            server.url + "/v1/audio/speech",
            json={
                "model": "tts-1",
                "voice": "coral",
                "input": TRANSCRIPT,
                "response_format": "wav",
                "stream": False,
                "seed": seed,
            },
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        pieces.append(soundfile.read(io.BytesIO(answer.content), dtype="float32")[0])
    audio = np.concatenate(pieces)
    assert 1.0 < len(audio) / 24_000 < 15.0
    return _wav(audio)


def _error(response, status: int, *words: str) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["code"], str) and error["type"]
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def _stored_files(server) -> list[str]:
    return sorted(
        str(path.relative_to(server.voices_dir))
        for path in server.voices_dir.rglob("*")
        if path.is_file()
    )


def test_the_official_clients_custom_voice_flow(server, client, sample):
    consent = client.audio.voice_consents.create(
        recording=("consent.wav", sample, "audio/wav"), name="Speaker A", language="zh-CN"
    )
    assert consent.object == "audio.voice_consent" and consent.id.startswith("cons_")
    assert client.audio.voice_consents.retrieve(consent.id).name == "Speaker A"
    assert client.audio.voice_consents.update(consent.id, name="Speaker B").name == "Speaker B"
    assert consent.id in [item.id for item in client.audio.voice_consents.list()]
    # the recording is kept for audit, as uploaded
    kept = server.voices_dir / "consents" / f"{consent.id}.wav"
    assert kept.read_bytes() == sample

    voice = client.audio.voices.create(
        audio_sample=("sample.wav", sample, "audio/wav"),
        consent=consent.id,
        name="narrator",
        extra_body={"transcript": TRANSCRIPT},
    )
    assert voice.object == "audio.voice" and voice.type == "audio_sample"
    assert voice.id.startswith("voice_") and voice.name == "narrator" and voice.created_at > 0

    by_id = client.audio.speech.create(
        model="gpt-4o-mini-tts",
        voice={"id": voice.id},
        input="用新声音说话。",
        stream_format="audio",
    ).content
    assert len(by_id) > 0
    body = {"model": "tts-1", "input": "用新声音说话。", "response_format": "wav", "stream": False}
    named = requests.post(
        server.url + "/v1/audio/speech", json={**body, "voice": "narrator"}, timeout=120
    )
    by_object = requests.post(
        server.url + "/v1/audio/speech", json={**body, "voice": {"id": voice.id}}, timeout=120
    )
    assert named.status_code == 200 and by_object.headers["X-Cache"] == "HIT"
    assert named.content == by_object.content  # one voice, one cache entry
    coral = requests.post(server.url + "/v1/audio/speech", json={**body, "voice": "coral"})
    assert coral.content != named.content
    # every route takes it: /synthesize, captions, streams, events
    synth = requests.post(
        server.url + "/synthesize", json={"text": "同一个声音。", "voice": voice.id}, timeout=120
    )
    assert synth.status_code == 200 and synth.content[:4] == b"RIFF"
    captioned = requests.post(
        server.url + "/v1/audio/captioned_speech",
        json={"model": "tts-1", "voice": "narrator", "input": "字幕。第二句。"},
        timeout=120,
    )
    assert captioned.status_code == 200 and len(captioned.json()["captions"]) == 2
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice={"id": voice.id}, input="事件。", stream_format="sse"
    ) as events:
        assert b"speech.audio.done" in events.read()
    # a blend cannot hold it; storing a copy of it under a JSON name cannot either
    blend = requests.post(server.url + "/v1/audio/speech", json={**body, "voice": "narrator+alloy"})
    _error(blend, 400, "cannot be blended")
    copy = requests.post(
        server.url + "/v1/audio/voices", json={"name": "copy", "voice": "narrator"}, timeout=30
    )
    _error(copy, 400, "recording")

    listing = requests.get(server.url + "/v1/audio/voices", timeout=30).json()
    (item,) = [entry for entry in listing["details"] if entry["name"] == "narrator"]
    assert item["id"] == voice.id and item["type"] == "audio_sample"
    assert requests.get(server.url + f"/v1/audio/voices/{voice.id}").json()["id"] == voice.id

    deleted = client.audio.voices.delete(voice.id)
    assert deleted.deleted and deleted.id == voice.id and deleted.object == "audio.voice.deleted"
    import openai

    with pytest.raises(openai.NotFoundError):
        client.audio.voices.delete(voice.id)
    with pytest.raises(openai.BadRequestError, match="no voice with the id"):
        client.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="还在吗？")
    assert client.audio.voice_consents.delete(consent.id).deleted
    assert not kept.exists()
    assert [name for name in _stored_files(server) if not name.startswith("ids")] == []


def test_a_voice_survives_a_restart_and_replicas_on_one_volume_see_it(
    server, client, sample, start_server
):
    consent = client.audio.voice_consents.create(
        recording=("c.wav", sample, "audio/wav"), name="shared", language="en"
    )
    other = start_server(
        CHATTTS_VOICES_DIR=str(server.voices_dir), CHATTTS_MAX_STORED_VOICES=str(LIMIT)
    )
    other.wait_ready()
    voice = client.audio.voices.create(
        audio_sample=("s.wav", sample, "audio/wav"), consent=consent.id, name="shared-voice"
    )
    body = {"model": "tts-1", "input": "两个副本。", "response_format": "pcm", "stream": False}
    here = requests.post(server.url + "/v1/audio/speech", json={**body, "voice": voice.id})
    there = requests.post(other.url + "/v1/audio/speech", json={**body, "voice": voice.id})
    assert here.status_code == there.status_code == 200
    assert here.content == there.content  # the same voice, the same seed: the same audio
    other.stop()
    restarted = start_server(
        CHATTTS_VOICES_DIR=str(server.voices_dir), CHATTTS_MAX_STORED_VOICES=str(LIMIT)
    )
    restarted.wait_ready()
    again = requests.post(restarted.url + "/v1/audio/speech", json={**body, "voice": voice.id})
    assert again.content == here.content
    restarted.stop()
    client.audio.voices.delete(voice.id)
    client.audio.voice_consents.delete(consent.id)


def _hours_of_silence_as_opus(minutes: float) -> bytes:
    """A small Ogg/Opus file that decodes to ``minutes`` of silence."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="ogg") as container:
        stream = container.add_stream("libopus", rate=24_000, layout="mono")
        stream.bit_rate = 6_000
        frame_samples = 24_000  # a second a frame
        silence = np.zeros((1, frame_samples), dtype=np.float32)
        for index in range(int(minutes * 60)):
            frame = av.AudioFrame.from_ndarray(silence, format="flt", layout="mono")
            frame.sample_rate, frame.pts = 24_000, index * frame_samples
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return out.getvalue()


def _rss_mb(server) -> float:
    return server.rss_mb()


def test_every_bad_recording_or_request_is_a_clear_4xx(server, client, sample):
    url = server.url + "/v1/audio/voices"
    consent = client.audio.voice_consents.create(
        recording=("c.wav", sample, "audio/wav"), name="c", language="en-US"
    )

    def create(data, content_type="audio/wav", **fields):
        form = {"name": "bad", "consent": consent.id, **fields}
        files = {"audio_sample": ("a", data, content_type)} if data is not None else None
        return requests.post(url, data=form, files=files, timeout=120)

    before = _stored_files(server)
    rss_before = _rss_mb(server)
    _error(create(b"this is not audio at all" * 100), 422, "not audio")
    _error(create(b""), 422, "empty")
    _error(create(_wav(np.zeros(24_000 * 3, dtype=np.float32))), 422, "silent")
    rng = np.random.default_rng(1)
    _error(create(_wav(rng.normal(0, 0.1, 24_000 * 20).astype(np.float32))), 422, "longer than 15")
    _error(create(_wav(rng.normal(0, 0.1, 2_400).astype(np.float32))), 422, "at least 1 s")
    bomb = _hours_of_silence_as_opus(minutes=30)
    assert len(bomb) < 2 * 2**20  # small, and 30 minutes long
    _error(create(bomb, "audio/ogg"), 422, "longer than 15")
    _error(create(os.urandom(10 * 2**20 + 10)), 413, "10 MiB")
    _error(create(sample, "text/plain"), 415, "text/plain")
    _error(create(None), 400, "audio_sample")
    _error(create(sample, consent="cons_" + "0" * 24), 404, "no consent")
    _error(create(sample, consent="not-an-id"), 404, "no consent")
    _error(create(sample, type="prompt"), 400, "not from a text prompt")
    _error(create(sample, name="Has Spaces"), 400, "'name'")
    _error(create(sample, transcript="[laugh] x"), 400, "transcript")
    _error(create(sample, surprise="1"), 400, "unknown fields: surprise")
    # memory stayed flat through the 30-minute file: decoding stopped at the limit
    assert _rss_mb(server) - rss_before < 60
    assert _stored_files(server) == before, "a refused voice left files behind"

    made = create(sample, name="once")
    assert made.status_code == 201, made.text
    _error(create(sample, name="once"), 409, "exists")
    _error(requests.delete(url + "/voice_" + "f" * 24, timeout=30), 404, "no voice with the id")
    _error(requests.delete(url + "/nobody", timeout=30), 404, "no stored voice")
    # a deleted consent makes no more voices
    client.audio.voice_consents.delete(consent.id)
    _error(create(sample, name="late"), 404, "no consent")
    consents = server.url + "/v1/audio/voice_consents"
    _error(requests.get(consents + "/" + consent.id, timeout=30), 404, "no consent")
    _error(requests.get(consents + "?limit=0", timeout=30), 400, "limit")
    _error(requests.post(consents, json={"name": "x"}, timeout=30), 415, "multipart")
    bad_language = requests.post(
        consents,
        data={"name": "x", "language": "not a language"},
        files={"recording": ("r.wav", sample, "audio/wav")},
        timeout=30,
    )
    _error(bad_language, 400, "BCP 47")
    requests.delete(url + "/once", timeout=30)
    assert requests.get(server.url + "/healthz", timeout=10).status_code == 200


def test_stored_voices_and_consents_are_bounded(server, client, sample):
    consents = [
        client.audio.voice_consents.create(
            recording=(f"c{index}.wav", sample, "audio/wav"), name=f"c{index}", language="en"
        )
        for index in range(LIMIT)
    ]
    import openai

    with pytest.raises(openai.ConflictError, match="CHATTTS_MAX_STORED_VOICES"):
        client.audio.voice_consents.create(
            recording=("c.wav", sample, "audio/wav"), name="one too many", language="en"
        )
    page = client.audio.voice_consents.list(limit=4)
    assert len(page.data) == 4 and page.has_more
    assert len(list(client.audio.voice_consents.list(limit=4))) == LIMIT  # follows the cursor
    voices = [
        client.audio.voices.create(
            audio_sample=(f"s{index}.wav", sample, "audio/wav"),
            consent=consents[0].id,
            name=f"v{index}",
        )
        for index in range(LIMIT)
    ]
    with pytest.raises(openai.ConflictError, match="CHATTTS_MAX_STORED_VOICES"):
        client.audio.voices.create(
            audio_sample=("s.wav", sample, "audio/wav"), consent=consents[0].id, name="extra"
        )
    for voice in voices:
        client.audio.voices.delete(voice.id)
    for consent in consents:
        client.audio.voice_consents.delete(consent.id)


def test_the_consent_bound_holds_for_requests_at_once(server, client, sample):
    """One consent store per process, its lock around "count, then write": twelve consents
    sent at once where there is room for fewer leave exactly the bound, the others a 409."""
    from concurrent.futures import ThreadPoolExecutor

    room = LIMIT - len(list(client.audio.voice_consents.list(limit=100)))
    assert room > 0

    def create(index: int) -> requests.Response:
        return requests.post(
            server.url + "/v1/audio/voice_consents",
            files={"recording": (f"r{index}.wav", sample, "audio/wav")},
            data={"name": f"at once {index}", "language": "en"},
            timeout=120,
        )

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(create, range(12)))
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [201] * room + [409] * (12 - room), statuses
    kept = list(client.audio.voice_consents.list(limit=100))
    assert len(kept) == LIMIT
    for answer in answers:
        if answer.status_code == 201:
            client.audio.voice_consents.delete(answer.json()["id"])
