"""Speech as written: SSML, dialogue turns, and audio at other rates and in G.711.

The readers on their own first (say-as, the SSML subset, a script's silences), then a script
through the real pipeline on the tiny model (which voice each span's jobs carried), then over
real HTTP against a server, with the official ``openai`` client too.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import wave
from dataclasses import replace

import numpy as np
import openai
import pytest
import requests
import soundfile
import torch

from chattts_service.api.validation import speech_request, synthesize_request
from chattts_service.config import Settings
from chattts_service.domain import ssml
from chattts_service.domain.say_as import SayAsError, say_as
from chattts_service.domain.speech import Silence, SynthesisRequest
from chattts_service.domain.text import NORMALISER
from chattts_service.runtime.metrics import Metrics
from chattts_service.services.cache import AudioCache
from chattts_service.services.speech import SpeechPipeline
from tests.engines import engine_on

RATE = 24_000
MAX_STEPS = 40
BILLION_LAUGHS = (
    '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
    '<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">'
    '<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>'
    "<speak>&lol3;</speak>"
)
EXTERNAL = '<!DOCTYPE speak [<!ENTITY x SYSTEM "file:///etc/passwd">]><speak>&x;</speak>'


def parse(text: str, max_chars: int = 1000):
    return ssml.parse(text, max_chars, NORMALISER)


# -- say-as ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,text,language,date_format,said",
    [
        ("cardinal", "1234", "en", None, "one thousand two hundred thirty four"),
        ("cardinal", "1,000,001", "en", None, "one million one"),
        ("cardinal", "-3.25", "en", None, "minus three point two five"),
        ("ordinal", "21", "en", None, "twenty first"),
        ("ordinal", "112", "en", None, "one hundred twelfth"),
        ("ordinal", "40", "en", None, "fortieth"),
        ("cardinal", "1234", "zh", None, "一千二百三十四"),
        ("cardinal", "15", "zh", None, "十五"),
        ("cardinal", "100000001", "zh", None, "一亿零一"),
        ("ordinal", "3", "zh", None, "第三"),
        ("digits", "1234", "en", None, "one two three four"),
        ("digits", "2024", "zh", None, "二零二四"),
        ("characters", "ABC1", "en", None, "A B C one"),
        (
            "telephone",
            "+1 (555) 123-4567",
            "en",
            None,
            "plus one, five five five, one two three, four five six seven",
        ),  # noqa: E501
        ("telephone", "138-0013", "zh", None, "幺三八，零零幺三"),
        ("date", "2024-03-05", "en", None, "the fifth of march twenty twenty four"),
        ("date", "3/5/2024", "en", "dmy", "the third of may twenty twenty four"),
        ("date", "3/5", "en", "md", "the fifth of march"),
        ("date", "2024-03-05", "zh", None, "二零二四年三月五日"),
        ("time", "15:30", "en", None, "fifteen thirty"),
        ("time", "15:30", "zh", None, "十五点三十分"),
    ],
)
def test_say_as_reads_as_its_kind_says(kind, text, language, date_format, said):
    assert say_as(kind, text, language, date_format, NORMALISER) == said


def test_say_as_decides_what_normalisation_would_guess():
    # a bare 1234 in English is read as a year; say-as cardinal says it is a number
    assert NORMALISER("1234", "en") == "twelve thirty four"
    assert say_as("cardinal", "1234", "en") == "one thousand two hundred thirty four"


@pytest.mark.parametrize(
    "kind,text,date_format",
    [
        ("cardinal", "twelve", None),
        ("ordinal", "0", None),
        ("ordinal", "1.5", None),
        ("digits", "12a", None),
        ("telephone", "call me", None),
        ("date", "2024-13-01", None),
        ("date", "5/3", "xyz"),
        ("time", "soon", None),
        ("cardinal", "1" * 16, None),
    ],
)
def test_say_as_refuses_what_is_not_its_kind(kind, text, date_format):
    with pytest.raises(SayAsError):
        say_as(kind, text, "en", date_format, NORMALISER)


# -- the SSML subset ---------------------------------------------------------------------------


def test_ssml_becomes_spans_and_pauses():
    parts = parse(
        '<speak version="1.1" xmlns="http://www.w3.org/2001/10/synthesis" xml:lang="en-US">'
        'Hello there.<break time="700ms"/>Call <say-as interpret-as="telephone">555-1234'
        '</say-as> now. <voice name="echo">I am <prosody rate="slow">slow</prosody>, '
        '<prosody rate="+50%">quicker</prosody>.</voice><p>The <sub alias="World Wide Web '
        'Consortium">W3C</sub>.</p><s>One <emphasis>more</emphasis><mark name="m"/>.</s>'
        '<break strength="strong"/><lang xml:lang="zh-CN">你好</lang></speak>'
    )
    assert parts == [
        ssml.Span("Hello there.", language="en"),
        ssml.Pause(700),
        ssml.Span("Call five five five, one two three four now.", language="en"),
        ssml.Span("I am", "echo", language="en"),
        ssml.Span("slow", "echo", 0.75, language="en"),
        ssml.Span("quicker", "echo", None, 1.5, language="en"),
        ssml.Span("The World Wide Web Consortium.", language="en"),
        ssml.Span("One more.", language="en"),
        ssml.Pause(1000),
        ssml.Span("你好", language="zh"),
    ]


@pytest.mark.parametrize(
    "document,message",
    [
        (BILLION_LAUGHS, "may not declare a DTD or entities"),
        (EXTERNAL, "may not declare a DTD or entities"),
        ("<speak>Hi <audio src='a.wav'/></speak>", "<audio> at line 1, column 11 is not supported"),
        ("<speak>Hi\n <phoneme ph='x'>a</phoneme></speak>", "<phoneme> at line 2, column 2"),
        ("<speak>Hi <break time='soon'/></speak>", "time is like 700ms or 1.5s"),
        ("<speak>Hi <break time='11s'/></speak>", "longer than 10000 ms"),
        ("<speak>Hi <break strength='huge'/></speak>", "strength is one of"),
        ("<speak><prosody pitch='high' rate='fast'>a</prosody></speak>", None),
        ("<speak><prosody rate='zippy'>a</prosody></speak>", "a rate is"),
        ("<speak><prosody duration='2s'>a</prosody></speak>", "duration is not supported"),
        ("<speak><voice gender='female'>a</voice></speak>", "<voice> at line 1, column 8 takes"),
        ("<speak><lang xml:lang='fr'>a</lang></speak>", "the languages are zh, en"),
        ("<speak><say-as interpret-as='spell'>a</say-as></speak>", "is not one of"),
        ("<speak><say-as interpret-as='cardinal'>abc</say-as></speak>", "'abc' is not a number"),
        ("<speak><say-as interpret-as='digits'><s>1</s></say-as></speak>", "holds text only"),
        ("<speak><sub>W3C</sub></speak>", "needs alias"),
        ("<speak>Hi", "not well-formed XML"),
        ("<p>Hi</p>", "it begins with <p>"),
        ("<speak><speak>a</speak></speak>", "inside <speak>"),
        ("<speak>[laugh]</speak>", None),
        ("<speak>" + "<s>" * 40 + "a" + "</s>" * 40 + "</speak>", "nested more than 32 deep"),
        ("<speak> . ! </speak>", "nothing to say"),
    ],
)
def test_ssml_that_cannot_be_read_is_refused_with_where(document, message):
    if message is None:  # read: ignored attributes and tokens pass
        assert parse(document)
        return
    with pytest.raises(ssml.SsmlError, match=message):
        parse(document)


def test_the_limit_is_the_text_inside():
    document = "<speak>" + "<s>abcd</s>" * 5 + "</speak>"
    assert len(parse(document, max_chars=20)) == 5
    with pytest.raises(ssml.SsmlTooLong, match="more than 19 characters"):
        parse(document, max_chars=19)


def test_a_scripts_silences():
    span = SynthesisRequest(text="a", seed=1)
    script = replace(span, parts=(Silence(100), span, span, Silence(700), Silence(300), span))
    # before each span, then after the last: as written, or the segment pause between spans
    assert script.gaps(pause_samples=5) == [2400, 5, 24000, 0]
    assert span.gaps(pause_samples=5) == [0, 0]
    # a break of 0 ms is no silence at all, not the segment pause
    assert replace(span, parts=(span, Silence(0), span)).gaps(pause_samples=5) == [0, 0, 0]


SETTINGS = Settings.from_env({}, max_chars=200, default_seed=77)


def test_turns_and_ssml_become_one_script():
    request, _ = synthesize_request(
        {
            "turns": [
                {"input": "Hello."},
                {"input": '<speak>Bye<break time="1s"/>now.</speak>', "speed": 2},
            ],
            "turn_gap_ms": 250,
            "seed": 3,
        },
        SETTINGS,
    )
    assert [type(part).__name__ for part in request.parts] == [
        "SynthesisRequest",
        "Silence",
        "SynthesisRequest",
        "Silence",
        "SynthesisRequest",
    ]
    assert [part.milliseconds for part in request.parts if isinstance(part, Silence)] == [250, 1000]
    assert [span.speed for span in request.spans()] == [5, 7, 7]
    assert request.text == "Hello. Bye now."


@pytest.mark.parametrize(
    "body,status,message",
    [
        ({"text": "a", "turns": [{"input": "b"}]}, 400, "not both"),
        ({"text": "", "turns": [{"input": "b"}]}, 400, "with 'turns', leave 'text' out or null"),
        ({"turns": []}, 400, "'turns'"),
        ({"turns": [{"input": "x" * 150}, {"input": "y" * 60}]}, 413, "the limit is 200"),
        ({"text": "<speak>" + "<s>abcde</s>" * 41 + "</speak>"}, 413, "more than 200"),
        ({"text": "x" * 201}, 413, "201 characters; the limit is 200"),
        ({"text": "<speak>hi [cough]</speak>"}, 400, r"unknown control token\(s\) \[cough\]"),
        ({"text": "hi", "format": "opus", "sample_rate": 44100}, 400, "opus cannot carry"),
        ({"text": "hi", "sample_rate": 11025}, 400, "'sample_rate' must be one of"),
    ],
)
def test_scripts_that_cannot_be_made(body, status, message):
    from chattts_service.api.errors import ApiError

    with pytest.raises(ApiError, match=message) as refused:
        synthesize_request(body, SETTINGS)
    assert refused.value.status == status


# -- through the pipeline on the tiny model ----------------------------------------------------


def test_a_voice_switch_speaks_that_span_in_the_other_voice(tiny_model_dir):
    with engine_on(tiny_model_dir, max_new_tokens=MAX_STEPS) as engine:
        pipeline = SpeechPipeline(engine.settings, engine, AudioCache(0), Metrics())
        submitted = []
        submit = engine.scheduler.submit
        engine.scheduler.submit = lambda job: (submitted.append(job), submit(job))[1]
        body = {
            "model": "tts-1",
            "voice": "alloy",
            "input": '<speak>One. <voice name="echo">Two.</voice> Three.</speak>',
            "response_format": "pcm",
            "stream": False,
        }
        request, output = speech_request(body, engine.settings, engine.voices)
        whole = pipeline.synthesize(pipeline.plan(request, degraded=False), output, None)
        voices = {name: engine.voices.resolve(name, "voice") for name in ("alloy", "echo")}
        said = [(job.text, job.voice) for job in submitted]
        assert [text for text, _ in said] == ["One.", "Two.", "Three."]
        for (_, voice), name in zip(said, ("alloy", "echo", "alloy"), strict=True):
            assert torch.equal(voice, voices[name].speaker), name
        # each span is the request it stands for: its samples are that request's, exactly
        alone = []
        for text, name in (("One.", "alloy"), ("Two.", "echo"), ("Three.", "alloy")):
            one = {**body, "input": text, "voice": name}
            plain, _ = speech_request(one, engine.settings, engine.voices)
            alone.append(pipeline.synthesize(pipeline.plan(plain, False), output, None).body)
        pause = bytes(2 * round(engine.settings.segment_pause_ms * RATE / 1000))
        assert whole.body == pause.join(alone)


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(start_server):
    """Without a cache: every answer is made, streamed or whole."""
    server = start_server(
        CHATTTS_MAX_NEW_TOKENS=str(MAX_STEPS), CHATTTS_CACHE_SIZE="0", CHATTTS_MAX_QUEUE="16"
    )
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def cached_api(start_server):
    server = start_server(CHATTTS_MAX_NEW_TOKENS=str(MAX_STEPS), CHATTTS_CACHE_SIZE="64")
    server.wait_ready()
    return server


def post(server, path, body, **kwargs):
    return requests.post(server.url + path, json=body, timeout=120, **kwargs)


def pcm(server, text: str, **fields) -> np.ndarray:
    answer = post(server, "/synthesize", {"text": text, "format": "pcm", "seed": 5, **fields})
    assert answer.status_code == 200, answer.text
    return np.frombuffer(answer.content, dtype="<i2")


def test_a_break_is_that_much_silence_to_the_sample(api):
    before, after = pcm(api, "Hello there."), pcm(api, "Goodbye.")
    both = pcm(api, '<speak>Hello there.<break time="700ms"/>Goodbye.</speak>')
    assert np.array_equal(both, np.concatenate([before, np.zeros(16_800, "<i2"), after]))
    leading = pcm(api, '<speak><break time="0.25s"/>Goodbye.<break time="100ms"/></speak>')
    assert np.array_equal(leading, np.concatenate([np.zeros(6000, "<i2"), after, np.zeros(2400)]))


def test_say_as_and_sub_change_what_the_model_reads(api):
    answer = post(
        api,
        "/v1/audio/captioned_speech",
        {
            "model": "tts-1",
            "voice": "alloy",
            "input": '<speak>Room <say-as interpret-as="cardinal">1234</say-as>. The '
            '<sub alias="World Wide Web Consortium">W3C</sub> met.</speak>',
        },
    )
    assert answer.status_code == 200, answer.text
    spoken = " ".join(caption["spoken_text"] for caption in answer.json()["captions"])
    assert "one thousand two hundred thirty four" in spoken.lower()
    assert "world wide web consortium" in spoken.lower() and "w3c" not in spoken.lower()
    # without say-as, the normaliser reads the bare number as a year
    plain = post(
        api,
        "/v1/audio/captioned_speech",
        {"model": "tts-1", "voice": "alloy", "input": "Room 1234."},
    )
    assert "twelve thirty four" in plain.json()["captions"][0]["spoken_text"].lower()


@pytest.mark.parametrize("document", [BILLION_LAUGHS, EXTERNAL])
def test_entities_are_refused(api, document):
    answer = post(api, "/v1/audio/speech", {"model": "tts-1", "voice": "alloy", "input": document})
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert "may not declare a DTD or entities" in error["message"] and error["param"] == "input"


DIALOGUE = [
    {"voice": "echo", "input": "Hi there. How are you?"},
    {"voice": "nova", "input": "Fine, thanks."},
    {"input": "Good to hear."},
    {"voice": "seed:7", "input": "Bye."},
]


def test_a_dialogue_is_one_file_whose_captions_name_each_voice(cached_api):
    api = cached_api
    body = {"model": "tts-1", "voice": "alloy", "turns": DIALOGUE, "turn_gap_ms": 300}
    answer = post(api, "/v1/audio/captioned_speech", {**body, "caption_format": "vtt"})
    assert answer.status_code == 200, answer.text
    captions = answer.json()["captions"]
    assert [(c["speaker"], c["text"]) for c in captions] == [
        ("echo", "Hi there."),
        ("echo", "How are you?"),
        ("nova", "Fine, thanks."),
        ("alloy", "Good to hear."),
        ("seed:7", "Bye."),
    ]
    assert "<v echo>Hi there." in answer.json()["vtt"] and "<v seed:7>Bye." in answer.json()["vtt"]
    audio, rate = soundfile.read(io.BytesIO(base64.b64decode(answer.json()["audio"])))
    assert rate == 24_000 and len(audio) == captions[-1]["end_sample"]
    # the turns' gap: exactly 300 ms between one turn's last cue and the next turn's first
    assert captions[2]["start_sample"] - captions[1]["end_sample"] == 7200
    srt = post(api, "/v1/audio/captioned_speech", {**body, "caption_format": "srt"}).json()["srt"]
    assert "nova: Fine, thanks." in srt
    # the same turns as one whole file: the turns' audio, the gaps between them
    whole = post(api, "/v1/audio/speech", {**body, "response_format": "pcm", "stream": False})
    alone = []
    for turn in DIALOGUE:
        one = {"model": "tts-1", "voice": turn.get("voice", "alloy"), "input": turn["input"]}
        made = post(api, "/v1/audio/speech", {**one, "response_format": "pcm", "stream": False})
        alone.append(made.content)
        assert made.headers["X-Cache"] == "HIT"  # each turn was cached when the dialogue ran
    assert whole.content == bytes(2 * 7200).join(alone)


def test_a_dialogue_streams_across_its_turns_as_its_whole_answer(api):
    body = {"voice": "alloy", "turns": DIALOGUE, "format": "pcm", "seed": 11}
    whole = post(api, "/synthesize", body)
    with post(api, "/synthesize", {**body, "seed": 11, "stream": True}, stream=True) as streamed:
        assert streamed.status_code == 200
        chunks = list(streamed.iter_content(None))
    assert len(chunks) > 1 and b"".join(chunks) == whole.content


def test_a_script_larger_than_the_queue_is_refused_whole(api):
    turns = [{"input": f"Line {n}."} for n in range(17)]
    answer = post(api, "/synthesize", {"turns": turns})
    assert answer.status_code == 422
    assert "needs 17 segments at once; the queue holds 16" in answer.json()["error"]
    # nothing of it was queued: a script that fits is answered at once
    assert post(api, "/synthesize", {"turns": turns[:16]}).status_code == 200


def _ffmpeg_samples(payload: bytes, codec: str, rate: int) -> np.ndarray:
    decoded = subprocess.run(
        ["ffmpeg", "-v", "error", "-f", codec, "-ar", str(rate), "-ac", "1", "-i", "pipe:0"]
        + ["-f", "s16le", "pipe:1"],
        input=payload,
        capture_output=True,
        check=True,
    )
    return np.frombuffer(decoded.stdout, dtype="<i2")


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="needs the ffmpeg command")
@pytest.mark.parametrize("audio_format,codec", [("ulaw", "mulaw"), ("alaw", "alaw")])
def test_telephone_audio_decodes_to_its_length(api, audio_format, codec):
    body = {"model": "tts-1", "voice": "alloy", "input": "Press one for sales."}
    answer = post(
        api, "/v1/audio/speech", {**body, "response_format": audio_format, "stream": False}
    )
    assert answer.status_code == 200
    assert (
        answer.headers["Content-Type"]
        == f"audio/{'PCMU' if codec == 'mulaw' else 'PCMA'}; rate=8000; channels=1"
    )  # noqa: E501
    model_rate = post(api, "/v1/audio/speech", {**body, "response_format": "pcm"}).content
    samples = _ffmpeg_samples(answer.content, codec, 8000)
    assert len(answer.content) == len(samples) and abs(len(samples) - len(model_rate) / 6) <= 1
    # the same audio as the 8 kHz PCM, through G.711's 8 bits
    linear = post(api, "/v1/audio/speech", {**body, "response_format": "pcm", "sample_rate": 8000})
    reference = np.frombuffer(linear.content, dtype="<i2").astype(float)
    assert len(reference) == len(samples)
    assert np.abs(samples - reference).max() <= max(64, np.abs(reference).max() / 16)
    # streamed: the same bytes
    with post(api, "/v1/audio/speech", {**body, "response_format": audio_format}, stream=True) as s:
        assert b"".join(s.iter_content(None)) == answer.content


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_a_sample_rate_is_resampled_whole_and_streamed_alike(api, rate):
    body = {"text": "Resample me, please.", "seed": 5, "sample_rate": rate}
    whole = post(api, "/synthesize", {**body, "format": "wav"})
    with wave.open(io.BytesIO(whole.content)) as reader:
        assert reader.getframerate() == rate
        frames = reader.getnframes()
    model_rate = len(pcm(api, body["text"]))
    assert abs(frames - model_rate * rate / RATE) <= 1
    with post(api, "/synthesize", {**body, "format": "pcm", "stream": True}, stream=True) as s:
        assert s.headers["Content-Type"] == f"audio/L16; rate={rate}; channels=1"
        streamed = b"".join(s.iter_content(None))
    assert streamed == whole.content[44:]


def test_the_openai_client_sends_ssml_turns_and_telephone_audio(api):
    client = openai.OpenAI(base_url=api.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ssml_answer = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input='<speak>Hello.<break time="500ms"/><voice name="echo">Hi.</voice></speak>',
        response_format="pcm",
    )
    assert len(ssml_answer.content) > 2 * 12_000
    # the types have no turns, and input is a required string: extra_body sends them, with
    # input null (absent)
    dialogue = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input="",
        response_format="wav",
        extra_body={"input": None, "turns": DIALOGUE[:2]},
    )
    with wave.open(io.BytesIO(dialogue.content)) as reader:
        assert reader.getnframes() > 0
    phone = client.audio.speech.create(
        model="tts-1",
        voice="alloy",
        input="Press one.",
        response_format="pcm",
        extra_body={"response_format": "ulaw", "sample_rate": 8000},
    )
    assert len(phone.content) > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model="tts-1", voice="alloy", input="<speak><audio/></speak>")
    assert "<audio>" in json.dumps(refused.value.body)
