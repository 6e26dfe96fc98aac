"""The speech API over real HTTP: formats, streaming, voices, long text, the OpenAI client."""

from __future__ import annotations

import io
import struct
import time

import numpy as np
import pytest
import requests
import soundfile

MAX_STEPS = 200


@pytest.fixture(scope="module")
def api(start_server, tmp_path_factory):
    voices = tmp_path_factory.mktemp("voices")
    server = start_server(CHATTTS_MAX_NEW_TOKENS=str(MAX_STEPS), CHATTTS_VOICES_DIR=str(voices))
    server.wait_ready()
    server.voices_dir = voices
    return server


def post(server, path, body, timeout=120, **kwargs):
    return requests.post(server.url + path, json=body, timeout=timeout, **kwargs)


def decode(payload: bytes):
    audio, rate = soundfile.read(io.BytesIO(payload), dtype="float32")
    return audio, rate


@pytest.mark.parametrize(
    "audio_format,content_type",
    [
        ("wav", "audio/wav"),
        ("flac", "audio/flac"),
        ("mp3", "audio/mpeg"),
        ("opus", "audio/ogg; codecs=opus"),
    ],
)
def test_every_format_decodes_at_the_model_rate(api, audio_format, content_type):
    response = post(api, "/synthesize", {"text": "格式测试。", "seed": 5, "format": audio_format})
    assert response.status_code == 200, response.text
    assert response.headers["Content-Type"] == content_type
    audio, rate = decode(response.content)
    info = soundfile.info(io.BytesIO(response.content))
    assert rate == 24_000 and info.channels == 1 and audio.ndim == 1
    seconds = float(response.headers["X-Audio-Seconds"])
    assert seconds > 0
    # lossy codecs pad a frame or two at the ends
    assert abs(len(audio) / rate - seconds) < 0.08, (len(audio) / rate, seconds)
    assert np.abs(audio).max() > 0


def test_raw_pcm_is_the_wav_payload(api):
    body = {"text": "原始数据。", "seed": 6}
    wav = post(api, "/synthesize", body).content
    pcm = post(api, "/synthesize", {**body, "format": "pcm"})
    assert pcm.headers["Content-Type"] == "audio/L16; rate=24000; channels=1"
    assert pcm.headers["X-Cache"] == "HIT"  # the same speech, encoded again, not re-synthesised
    assert pcm.content == wav[44:]


def test_formats_do_not_share_a_cache_entry_but_share_the_synthesis(api):
    body = {"text": "缓存格式。", "seed": 7}
    first = post(api, "/synthesize", {**body, "format": "flac"})
    second = post(api, "/synthesize", {**body, "format": "wav"})
    assert first.headers["X-Cache"] == "MISS" and second.headers["X-Cache"] == "HIT"
    assert first.content != second.content
    flac_audio, _ = decode(first.content)
    wav_audio, _ = decode(second.content)
    assert np.array_equal(flac_audio, wav_audio)  # FLAC is lossless: the same samples


def _read_stream(response):
    arrivals, data = [], b""
    for piece in response.iter_content(chunk_size=None):
        arrivals.append(time.perf_counter())
        data += piece
    return data, arrivals


def test_streaming_sends_audio_as_it_is_made_and_fills_the_cache(api):
    # seed 10 makes this text ~100 steps long on the tiny model: several chunks
    body = {"text": "流式输出的一句比较长的话，测试分块。", "seed": 10, "stream": True}
    started = time.perf_counter()
    with post(api, "/synthesize", body, stream=True) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"] == "audio/wav"
        assert response.headers.get("Transfer-Encoding") == "chunked"
        assert response.headers["X-Cache"] == "MISS"
        data, arrivals = _read_stream(response)
    riff, data_size = struct.unpack("<4xI", data[:8])[0], struct.unpack("<I", data[40:44])[0]
    assert data[:4] == b"RIFF" and riff == 0xFFFFFFFF and data_size == 0xFFFFFFFF
    assert len(arrivals) >= 2, "the audio came in one piece"
    assert arrivals[0] - started < arrivals[-1] - started
    # the finished stream is cached: the same request, whole, is a HIT with the same samples;
    # the stream then has silence up to a whole 4 KiB block (FFmpeg reads it in such packets)
    whole = post(api, "/synthesize", {k: v for k, v in body.items() if k != "stream"})
    assert whole.headers["X-Cache"] == "HIT"
    samples = whole.content[44:]
    assert data[44 : 44 + len(samples)] == samples
    assert (len(data) - 44) % 4096 == 0 and len(data) - 44 - len(samples) < 4096
    assert not any(data[44 + len(samples) :])
    _every_wav_reader_takes(data, len(samples) // 2)


def _every_wav_reader_takes(data: bytes, at_least: int) -> None:
    """A streamed WAV (open-ended header) read by FFmpeg as strictly as it reads anything,
    libsndfile and Python's wave module, each finding every sample; a browser's <audio>
    plays one in the playground's test."""
    import shutil
    import subprocess
    import wave

    if shutil.which("ffmpeg"):  # script/test installs it; a bare checkout may lack it
        strict = subprocess.run(
            ["ffmpeg", "-v", "error", "-xerror", "-i", "pipe:0", "-f", "s16le", "pipe:1"],
            input=data,
            capture_output=True,
            timeout=60,
        )
        assert strict.returncode == 0 and not strict.stderr, strict.stderr.decode()
        assert len(strict.stdout) // 2 >= at_least
    audio, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    assert rate == 24000 and len(audio) >= at_least
    with wave.open(io.BytesIO(data)) as reader:
        assert reader.getframerate() == 24000
        assert len(reader.readframes(reader.getnframes())) // 2 >= at_least


def test_streaming_refuses_formats_it_cannot_stream(api):
    response = post(api, "/synthesize", {"text": "你好", "format": "flac", "stream": True})
    assert response.status_code == 400 and "cannot be streamed" in response.json()["error"]


def _decoded(payload: bytes) -> np.ndarray:
    """Any of the compressed formats, decoded with FFmpeg (PyAV), as float mono."""
    import av

    with av.open(io.BytesIO(payload)) as container:
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    audio = np.concatenate(frames).astype(np.float32)
    return audio, rate


@pytest.mark.parametrize("audio_format,seed", [("mp3", 41), ("opus", 42), ("aac", 43)])
def test_compressed_formats_stream_as_generated_and_decode_whole(api, audio_format, seed):
    body = {"text": "压缩格式的流式传输。", "seed": seed, "format": audio_format}
    streamed = post(api, "/synthesize", {**body, "stream": True}, stream=True)
    assert streamed.status_code == 200 and streamed.headers["X-Cache"] == "MISS"
    data = b"".join(streamed.iter_content(chunk_size=None))
    audio, rate = _decoded(data)
    # the same speech, whole (from the cache the stream filled, encoded in one go)
    whole = post(api, "/synthesize", body)
    assert whole.headers["X-Cache"] == "HIT"
    reference, reference_rate = _decoded(whole.content)
    assert rate == reference_rate and rate in (24_000, 48_000)  # Opus decodes at 48 kHz
    seconds = float(whole.headers["X-Audio-Seconds"])
    assert abs(len(audio) / rate - seconds) < 0.1 and abs(len(reference) / rate - seconds) < 0.1
    # the same audio within the codecs' tolerance: the level of the exact samples (WAV) within
    # 3 dB (random weights make noise-like audio, the hardest case for a lossy codec)
    exact, _ = decode(post(api, "/synthesize", {**body, "format": "wav"}).content)
    for decoded in (audio, reference):
        level = 20 * np.log10(np.sqrt(np.mean(decoded**2)) / np.sqrt(np.mean(exact**2)))
        assert abs(level) < 3.0, level


def test_openai_aac_is_adts(client):
    speech = client.audio.speech.create(
        model="tts-1", voice="alloy", input="高级音频编码。", response_format="aac"
    )
    assert speech.response.headers["Content-Type"] == "audio/aac"
    assert speech.content[:2] in (b"\xff\xf1", b"\xff\xf9")  # ADTS sync word
    audio, rate = _decoded(speech.content)
    assert rate == 24_000 and len(audio) > 0


def test_long_text_of_2000_characters(api):
    sentence = (
        "第{}段：今天是2024年3月{}日，气温{}摄氏度，票价12.5元。We met at 3:30 pm and paid $20. "
    )
    text, index = "", 1
    while len(text) < 2000:
        text += sentence.format(index, index % 28 + 1, index % 30)
        index += 1
    text = text[:2000]
    response = post(api, "/synthesize", {"text": text, "seed": 9}, timeout=600)
    assert response.status_code == 200, response.text
    segments = int(response.headers["X-Segments"])
    assert segments >= 20  # 2,000 characters in segments of at most 100
    audio, rate = decode(response.content)
    assert rate == 24_000
    # every segment contributed speech plus a 0.2 s pause between neighbours
    assert len(audio) / rate > 0.2 * (segments - 1)
    metrics = requests.get(api.url + "/metrics", timeout=10).text
    assert "chatts_segments_truncated_total 0.0" in metrics


def test_control_tokens_pass_through_and_unknown_ones_are_refused(api):
    ok = post(
        api,
        "/synthesize",
        {
            "text": "你好[uv_break]世界[laugh]。",
            "seed": 3,
            "refine_text": True,
            "refine_prompt": "[oral_2][break_4]",
        },
    )
    assert ok.status_code == 200, ok.text
    bad = post(api, "/synthesize", {"text": "你好[speed_9]世界"})
    assert bad.status_code == 400 and "[speed_9]" in bad.json()["error"]


def test_openapi_document_covers_every_route(api):
    from chattts_service.app import create_app
    from chattts_service.config import Settings

    document = requests.get(api.url + "/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.1")
    app = create_app(Settings.from_env({}), start_loading=False)
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<", "{").replace(">", "}")
        assert path in document["paths"], path
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            assert method.lower() in document["paths"][path], (path, method)


# -- the OpenAI API, through the OpenAI client --------------------------------------------------


@pytest.fixture(scope="module")
def client(api):
    import openai

    return openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_gets_mp3_by_default(client):
    speech = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello from ChatTTS.")
    assert speech.response.headers["Content-Type"] == "audio/mpeg"
    audio, rate = decode(speech.content)
    assert rate == 24_000 and len(audio) > 0


def test_openai_client_formats_speed_and_extras(client):
    wav = client.audio.speech.create(
        model="tts-1-hd",
        voice="nova",
        input="你好，世界。",
        response_format="wav",
        speed=1.5,
        extra_body={"seed": 4, "temperature": 0.5},
    )
    audio, rate = decode(wav.content)
    assert rate == 24_000 and len(audio) > 0
    slower = client.audio.speech.create(
        model="tts-1-hd",
        voice="nova",
        input="你好，世界。",
        response_format="wav",
        speed=0.5,
        extra_body={"seed": 4, "temperature": 0.5},
    )
    assert slower.content != wav.content  # speed reaches the model's prompt


def test_openai_client_streams_pcm(client):
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="echo",
        input="流式的OpenAI请求。",
        response_format="pcm",
        extra_body={"stream": True},
    ) as response:
        assert response.headers["Content-Type"].startswith("audio/L16")
        data = b"".join(response.iter_bytes())
    assert len(data) > 0 and len(data) % 2 == 0


def test_openai_client_streams_mp3_as_it_is_generated(client):
    arrivals = []
    started = time.monotonic()
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="fable",
        input="第一句话先到。第二句话随后。The third sentence comes last.",
        extra_body={"stream": True, "seed": 8},
    ) as response:
        assert response.headers["Content-Type"] == "audio/mpeg"
        assert "Content-Length" not in response.headers  # chunked: sent as it is encoded
        data = b""
        for piece in response.iter_bytes():
            arrivals.append(time.monotonic() - started)
            data += piece
    assert len(arrivals) >= 2, "the MP3 arrived in one piece"
    audio, rate = _decoded(data)
    assert rate == 24_000 and len(audio) / rate > 0.1


def test_openai_errors_have_openai_shape(client):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="tts-1", voice="nobody", input="hi")
    error = caught.value.body
    assert "unknown voice 'nobody'" in error["message"] and "alloy" in error["message"]
    assert error["type"] == "invalid_request_error"
    # the client's ErrorObject types code as a string (or null), never a number; param names
    # the field at fault
    assert caught.value.code == "invalid_request" and caught.value.param == "voice"
    with pytest.raises(openai.BadRequestError, match="response_format") as wrong:
        client.audio.speech.create(model="tts-1", voice="alloy", input="hi", response_format="m4a")
    assert wrong.value.param == "response_format"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("whisper-1")
    assert missing.value.code == "not_found"


def test_instructions_are_taken_spoken_without_and_said_so(api, client):
    """Home Assistant's integration always sends instructions; LiveKit's and Pipecat's
    plugins do when a user sets them."""

    def ignored() -> float:
        text = requests.get(api.url + "/metrics", timeout=10).text
        name = "chatts_instructions_ignored_total "
        return float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])

    body = {"model": "gpt-4o-mini-tts", "voice": "marin", "input": "你好。"}
    before = ignored()
    plain = client.audio.speech.with_raw_response.create(
        **body, response_format="wav", extra_body={"seed": 21}
    )
    told = client.audio.speech.with_raw_response.create(
        **body,
        response_format="wav",
        instructions="Speak in a cheerful and positive tone.",
        extra_body={"seed": 21},
    )
    assert told.status_code == 200 and told.headers["X-Instructions"] == "ignored"
    assert "X-Instructions" not in plain.headers
    assert told.content == plain.content  # the same speech: nothing of them was applied
    assert ignored() == before + 1


def test_openai_model_listing(client):
    names = {model.id for model in client.models.list()}
    assert {"chattts", "tts-1", "tts-1-hd"} <= names


def _client_voice_names() -> tuple[str, ...]:
    """The built-in voice names in the installed openai package's own types."""
    from typing import get_args

    from openai.types.audio.speech_create_params import Voice

    literals = [get_args(option) for option in get_args(Voice) if get_args(option)]
    names = [args for args in literals if all(isinstance(name, str) for name in args)]
    assert len(names) == 1, names
    return names[0]


def test_every_voice_and_model_the_installed_client_names_is_accepted(api, client):
    from typing import get_args

    from openai.types.audio.speech_model import SpeechModel

    voices = _client_voice_names()
    models = get_args(SpeechModel)
    assert len(voices) >= 13 and "marin" in voices and "gpt-4o-mini-tts" in models
    listed = requests.get(api.url + "/v1/audio/voices", timeout=10).json()["voices"]
    assert set(voices) <= set(listed)
    assert set(models) <= {model.id for model in client.models.list()}

    # each name its own voice: stored under another name (a voice given as OpenAI's object),
    # each embedding's digest differs
    digests = {}
    for name in voices:
        created = post(api, "/v1/audio/voices", {"name": f"copy-{name}", "voice": {"id": name}})
        assert created.status_code == 201, created.text
        digests[name] = created.json()["digest"]
        assert requests.delete(api.url + f"/v1/audio/voices/copy-{name}", timeout=10).ok
    assert len(set(digests.values())) == len(voices), digests

    # every model and every name, by the official client, as a string and as {"id": ...}
    for index, name in enumerate(voices):
        voice = {"id": name} if index % 2 else name
        speech = client.audio.speech.create(
            model=models[index % len(models)], voice=voice, input="你好。", response_format="wav"
        )
        audio, rate = decode(speech.content)
        assert rate == 24_000 and len(audio) > 0, name

    # a voice object that is not {"id": <string>}: a clear 400
    for voice in ({"id": 7}, {"name": "alloy"}, {"id": "alloy", "x": 1}):
        refused = post(api, "/v1/audio/speech", {"model": "tts-1", "voice": voice, "input": "hi"})
        assert refused.status_code == 400
        assert "voice" in refused.json()["error"]["message"]


def test_voices_listing_registration_and_use(api, client):
    import torch

    from chattts_service.domain.embeddings import encode_embedding
    from chattts_service.tools.testmodel import TINY

    listing = requests.get(api.url + "/v1/audio/voices", timeout=10).json()
    assert set(_client_voice_names()) <= set(listing["voices"])

    dim = TINY["gpt"]["hidden_size"]
    embedding = encode_embedding(torch.randn(dim, generator=torch.Generator().manual_seed(1)))
    created = post(api, "/v1/audio/voices", {"name": "narrator", "embedding": embedding})
    assert created.status_code == 201, created.text
    assert (api.voices_dir / "narrator.json").is_file()
    assert "narrator" in requests.get(api.url + "/v1/audio/voices", timeout=10).json()["voices"]
    first = client.audio.speech.create(
        model="tts-1", voice="narrator", input="注册的声音。", response_format="wav"
    )
    again = post(
        api,
        "/synthesize",
        {"text": "注册的声音。", "voice": "narrator", "format": "wav", "seed": 1234},
    )
    streamed, whole = decode(first.content)[0], decode(again.content)[0]
    # the client's answer streamed (a WAV stream ends on a whole 4 KiB block of silence)
    assert 0 <= len(streamed) - len(whole) < 2048 and not streamed[len(whole) :].any()

    exists = post(api, "/v1/audio/voices", {"name": "narrator", "embedding": embedding})
    assert exists.status_code == 409 and "exists" in exists.json()["error"]["message"]
    for name in ("../x", "Narrator", "a" * 70):
        bad = post(api, "/v1/audio/voices", {"name": name, "embedding": embedding})
        assert bad.status_code == 400
    junk = post(api, "/v1/audio/voices", {"name": "junk", "embedding": "zzz"})
    assert junk.status_code == 422 and "embedding" in junk.json()["error"]["message"]
    empty = post(api, "/v1/audio/voices", {"name": "junk", "embedding": ""})
    assert empty.status_code == 400
    # a voice to copy that is not there is the field's fault: 400 naming it, not 404
    missing = post(api, "/v1/audio/voices", {"name": "junk", "voice": "nobody"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "voice"
    assert "nobody" in missing.json()["error"]["message"]

    assert requests.delete(api.url + "/v1/audio/voices/narrator", timeout=10).status_code == 200
    assert requests.delete(api.url + "/v1/audio/voices/narrator", timeout=10).status_code == 404
    gone = post(api, "/synthesize", {"text": "你好", "voice": "narrator"})
    assert gone.status_code == 400


def test_a_stream_whose_client_leaves_stops_generating(api):
    def counter(name, label):
        for line in requests.get(api.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and label in line:
                return float(line.split()[-1])
        return 0.0

    before = counter("chatts_requests_total", 'status="499"')
    text = "这是一段很长的话，用来测试客户端离开以后生成是否停止。" * 60
    response = requests.post(
        api.url + "/synthesize",
        json={"text": text[:1500], "seed": 10, "stream": True, "format": "pcm"},
        stream=True,
        timeout=120,
    )
    assert response.status_code == 200
    next(response.iter_content(chunk_size=1024))  # audio is flowing
    response.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (
            counter("chatts_requests_total", 'status="499"') > before
            and counter("chatts_queue_depth", "") == 0
        ):
            break
        time.sleep(0.2)
    assert counter("chatts_requests_total", 'status="499"') == before + 1
    assert counter("chatts_queue_depth", "") == 0
    assert counter("chatts_infer_total", 'outcome="cancelled"') >= 1
    # no more decode steps are being spent on it
    steps = counter("chatts_step_duration_seconds_count", "")
    time.sleep(1.0)
    assert counter("chatts_step_duration_seconds_count", "") == steps


def _events(lines) -> list[dict]:
    """A plain Server-Sent Events reader: the JSON of every ``data:`` line."""
    import json

    events = []
    for line in lines:
        line = line.decode() if isinstance(line, bytes) else line
        if line.startswith("data: "):
            events.append(json.loads(line[len("data: ") :]))
    return events


def _joined(events) -> bytes:
    import base64

    assert events and events[-1]["type"] == "speech.audio.done", events[-1:]
    assert all(event["type"] == "speech.audio.delta" for event in events[:-1])
    return b"".join(base64.b64decode(event["audio"]) for event in events[:-1])


def test_openai_client_streams_server_sent_events(api, client):
    body = {"model": "tts-1", "voice": "alloy", "input": "事件流测试。", "response_format": "pcm"}
    with client.audio.speech.with_streaming_response.create(
        **body, stream_format="sse", extra_body={"seed": 31}
    ) as response:
        assert response.headers["content-type"] == "text/event-stream"
        events = _events(response.iter_lines())
    pcm = _joined(events)
    assert len(events) >= 2  # deltas as the audio is decoded, then done
    usage = events[-1]["usage"]
    assert usage["output_tokens"] == -(-len(pcm) // 2 // 512)
    # the text tokens the model read: more for a longer text
    assert usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    with client.audio.speech.with_streaming_response.create(
        **{**body, "input": body["input"] * 3}, stream_format="sse", extra_body={"seed": 31}
    ) as response:
        longer = _events(response.iter_lines())[-1]["usage"]
    assert longer["input_tokens"] > usage["input_tokens"]
    # the finished stream filled the cache with what it sent: the plain answer is those bytes
    plain = post(api, "/v1/audio/speech", {**body, "seed": 31})
    assert plain.headers["X-Cache"] == "HIT" and plain.content == pcm


def test_server_sent_events_on_synthesize_carry_the_wav_and_whole_files(api):
    wav = post(
        api, "/synthesize", {"text": "事件流。", "seed": 32, "stream_format": "sse"}, stream=True
    )
    assert wav.headers["Content-Type"] == "text/event-stream"
    streamed = _joined(_events(wav.iter_lines()))
    audio, rate = decode(
        streamed[:4]
        + struct.pack("<I", len(streamed) - 8)
        + streamed[8:40]
        + struct.pack("<I", len(streamed) - 44)
        + streamed[44:]
    )
    assert rate == 24_000 and len(audio) > 0
    # FLAC cannot stream: one delta holding the whole file, the same file as without events
    body = {"text": "整段。", "seed": 33, "format": "flac"}
    events = _events(post(api, "/synthesize", {**body, "stream_format": "sse"}).iter_lines())
    assert len(events) == 2
    assert _joined(events) == post(api, "/synthesize", body).content
    # an encoded stream's usage counts its audio, not its bytes
    body = {"text": "编码的事件流。", "seed": 34, "format": "mp3"}
    events = _events(post(api, "/synthesize", {**body, "stream_format": "sse"}).iter_lines())
    assert _joined(events)[:3] in (b"ID3", b"\xff\xf3", b"\xff\xfb")
    seconds = float(post(api, "/synthesize", {**body, "format": "pcm"}).headers["X-Audio-Seconds"])
    assert events[-1]["usage"]["output_tokens"] == -(-round(seconds * 24_000) // 512)
    bad = post(api, "/synthesize", {"text": "hi", "stream_format": "chunks"})
    assert bad.status_code == 400 and "'stream_format' must be one of audio, sse" in bad.text


def test_a_voices_next_prompts_reuse_its_kept_beginning(api):
    """/metrics counts the speech prompts whose first positions were copied from the kept
    beginning of an earlier prompt in the same voice (hit) or computed (miss)."""

    def value(name, label=""):
        for line in requests.get(api.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and label in line:
                return float(line.split()[-1])
        raise AssertionError(f"{name}{label} not in /metrics")

    hits = value("chatts_prompt_prefixes_total", 'outcome="hit"')
    misses = value("chatts_prompt_prefixes_total", 'outcome="miss"')
    for text in ("前缀测试第一句。", "前缀测试的第二句话。"):  # one voice, two texts: no cache hit
        response = post(api, "/synthesize", {"text": text, "seed": 431, "format": "wav"})
        assert response.status_code == 200, response.text
    assert value("chatts_prompt_prefixes_total", 'outcome="hit"') >= hits + 1
    assert value("chatts_prompt_prefixes_total", 'outcome="miss"') >= misses
    assert value("chatts_prompt_prefixes_kept") >= 1


def _steps_run(server) -> float:
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("chatts_step_duration_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("no step count in /metrics")


def test_openai_speech_streams_by_default_as_openais_endpoint_does(api, client):
    """No field asks for it: the official client's streaming response gets its first audio
    while later audio is still being generated (OpenAI's endpoint always answers chunked).
    The text has more segments than a batch has rows, so its last ones start only after the
    first ones end."""
    sentence = "第{}句：流式的回答先到，后面的还在生成。"
    text = "".join(sentence.format(index) for index in range(1, 61))
    for voice, fmt in (("coral", "pcm"), ("marin", "wav"), ("ash", "mp3")):
        started, steps_before = time.monotonic(), _steps_run(api)
        arrivals, data, steps_at_first = [], b"", None
        with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice=voice, input=text, response_format=fmt
        ) as response:
            assert "content-length" not in response.headers
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.headers["x-cache"] == "MISS"
            for piece in response.iter_bytes():
                if steps_at_first is None:
                    steps_at_first = _steps_run(api)
                arrivals.append(time.monotonic() - started)
                data += piece
        # by order: the first audio reached the client long before the model had run the
        # answer's steps (in the first of two rounds of segments), whatever the CPU's pace
        # (by time, 0.25-0.7 of the way here: on a slow CPU a request's fixed costs weigh more)
        steps_total = _steps_run(api) - steps_before
        assert steps_at_first - steps_before < 0.7 * steps_total, (fmt, steps_at_first, steps_total)
        assert arrivals[0] < arrivals[-1]
        # the same speech asked whole: a Content-Length, and the samples the stream carried
        body = {"model": "tts-1", "voice": voice, "input": text, "response_format": fmt}
        whole = post(api, "/v1/audio/speech", {**body, "stream": False})
        assert whole.headers["X-Cache"] == "HIT"
        assert int(whole.headers["Content-Length"]) == len(whole.content)
        if fmt == "pcm":
            assert whole.content == data
        elif fmt == "wav":
            assert data[44 : len(whole.content)] == whole.content[44:]
        else:
            assert abs(len(_decoded(data)[0]) - len(_decoded(whole.content)[0])) < 2 * 1152
    # FLAC cannot stream: it comes whole unless the request insists (then a 400)
    flac = {"model": "tts-1", "voice": "sage", "input": "整段。", "response_format": "flac"}
    whole = post(api, "/v1/audio/speech", flac)
    assert whole.status_code == 200 and "Content-Length" in whole.headers
    assert post(api, "/v1/audio/speech", {**flac, "stream": True}).status_code == 400


def test_a_streamed_answers_log_line_and_metrics_describe_the_whole_request(api):
    def duration_sum():
        for line in requests.get(api.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("chatts_request_duration_seconds_sum"):
                return float(line.split()[-1])
        raise AssertionError("no request duration in /metrics")

    before = duration_sum()
    body = {
        "model": "tts-1",
        "voice": "verse",
        "input": "日志应该记录整个请求。",
        "response_format": "pcm",
    }
    started = time.monotonic()
    with requests.post(
        api.url + "/v1/audio/speech", json=body, stream=True, timeout=60
    ) as response:
        data = b"".join(response.iter_content(chunk_size=None))
    elapsed = time.monotonic() - started
    seconds = len(data) / 2 / 24000
    # the line is written as the connection's answer closes: wait for one with this audio
    deadline = time.monotonic() + 10
    found = None
    while found is None and time.monotonic() < deadline:
        for line in reversed(api.log_path.read_text().splitlines()):
            if "POST /v1/audio/speech 200 " not in line:
                continue
            logged = line.split("POST /v1/audio/speech 200 ")[1].split()
            duration, audio = float(logged[0].rstrip("s")), float(logged[1][6:-1])
            if abs(audio - seconds) < 0.01:
                found = (line, duration)
                break
        else:
            time.sleep(0.1)
    assert found is not None, f"no access log line with audio={seconds:.2f}s"
    line, logged_duration = found
    assert logged_duration > 0.5 * elapsed - 0.01, (line, elapsed)
    assert duration_sum() - before > 0.5 * elapsed - 0.01
