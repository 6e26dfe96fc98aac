"""Home Assistant's voice: the Wyoming protocol (text to speech) on its own TCP port.

The server runs in the service's process, on a thread of its own with an asyncio loop, and
speaks through the same services as HTTP: one model, one scheduler, the same voices, cache and
admission. Events and the server come from the ``wyoming`` package.

- ``describe``: ``info`` with one TTS program, its voices (the names a request may use now)
  and ``supports_synthesize_streaming``.
- ``synthesize``: the whole text, answered ``audio-start``, ``audio-chunk``s as they are
  decoded (24 kHz, 16-bit, mono PCM), ``audio-stop``.
- ``synthesize-start``, ``synthesize-chunk``s, ``synthesize-stop``: the text arrives in pieces
  (an LLM's answer); each sentence is started as soon as it is complete, while later text
  still arrives, and spoken in order, each its own ``audio-start`` ... ``audio-stop``; then
  ``synthesize-stopped``. The ``synthesize`` a client sends inside such a stream (for servers
  that do not stream) is ignored.
- A refusal (no such voice, no text, a full queue, the model not ready) is an ``error`` event
  with its text; a client that leaves stops its generation at once.

Wyoming has no authentication: API keys cover HTTP only. Events are bounded (a header line of
asyncio's 64 KiB line limit, data and payload of ``MAX_EVENT_BYTES`` each: beyond, the
connection is closed), as are idle connections (``IDLE_SECONDS``) and connections at once
(``MAX_CONNECTIONS``: beyond, a new one is closed at once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice
from wyoming.server import AsyncEventHandler, AsyncTcpServer
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeStopped,
)

from chattts_service.domain.speech import SAMPLE_RATE, EngineError, Overloaded, SynthesisRequest
from chattts_service.domain.text import TextError, complete_sentences, text_to_speak
from chattts_service.domain.voices import VoiceError
from chattts_service.services.service import Service
from chattts_service.services.speech import Output, SpeechStream, StreamBroken
from chattts_service.services.voices import NotLoaded

log = logging.getLogger(__name__)

MAX_EVENT_BYTES = 256 * 1024
IDLE_SECONDS = 300.0
READ_SECONDS = 30.0  # an event's data and payload, once its header line has come
MAX_CONNECTIONS = 256
LANGUAGES = ["zh", "en"]
PCM = Output(format="pcm", stream=True)
ATTRIBUTION = Attribution(name="2noise", url="https://github.com/2noise/ChatTTS")


class _BoundedReader:
    """The connection's reader as ``wyoming``'s ``async_read_event`` uses it, with bounds: an
    idle connection reads as closed, an event longer than allowed is refused (``ValueError``,
    which ends the connection)."""

    def __init__(self, reader: asyncio.StreamReader):
        self._reader = reader

    async def readline(self) -> bytes:
        try:
            return await asyncio.wait_for(self._reader.readline(), IDLE_SECONDS)
        except TimeoutError:
            return b""

    async def readexactly(self, size: int) -> bytes:
        if size > MAX_EVENT_BYTES:
            raise ValueError(f"an event of {size} bytes; the limit is {MAX_EVENT_BYTES}")
        return await asyncio.wait_for(self._reader.readexactly(size), READ_SECONDS)

    def feed_eof(self) -> None:
        self._reader.feed_eof()


class WyomingServer:
    """The Wyoming port of a running service: ``start()`` on a thread of its own."""

    def __init__(self, service: Service, host: str, port: int):
        self.service, self.host, self.port = service, host, port
        # the threads that wait for a stream's next chunk (one per sentence being spoken)
        self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="wyoming-audio")
        self._ready = threading.Event()
        self.connections = 0

    def start(self) -> None:
        thread = threading.Thread(target=self._run, name="wyoming", daemon=True)
        thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        server = AsyncTcpServer(self.host, self.port)
        try:
            loop.run_until_complete(server.start(self._handler))
            self._ready.set()
            log.info("Wyoming (Home Assistant) on %s:%d", self.host, self.port)
            loop.run_forever()
        except OSError as error:
            log.error("Wyoming cannot listen on %s:%d: %s", self.host, self.port, error)
            self._ready.set()

    def _handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Handler:
        return Handler(reader, writer, self)

    def info(self) -> Info:
        voices = [
            TtsVoice(
                name=name,
                description=None,
                attribution=ATTRIBUTION,
                installed=True,
                version=None,
                languages=LANGUAGES,
            )
            for name in self.service.voices.names()
        ]
        program = TtsProgram(
            name="chattts",
            description="ChatTTS on the CPU (Chinese and English)",
            attribution=ATTRIBUTION,
            installed=True,
            version="0.2.5",
            voices=voices,
            supports_synthesize_streaming=True,
        )
        return Info(tts=[program])


class Handler(AsyncEventHandler):
    """One client connection."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: WyomingServer
    ):
        # the bounds stand in for the reader wyoming reads events from
        super().__init__(_BoundedReader(reader), writer)  # type: ignore[arg-type]
        self.server, self.service = server, server.service
        self.left = threading.Event()  # the client went away: its streams stop
        self._voice: str | None = None  # the streamed answer's voice
        self._text = ""  # streamed text not yet a complete sentence
        self._sentences: asyncio.Queue[SpeechStream | Error | None] | None = None
        self._speaking: asyncio.Task[None] | None = None

    async def run(self) -> None:
        server = self.server
        if server.connections >= MAX_CONNECTIONS:
            self.writer.close()
            return
        server.connections += 1
        try:
            await super().run()
        except Exception as error:  # a malformed event (no type, bad JSON types): closed
            log.info("Wyoming connection closed: %r", error)
            self.writer.close()
        finally:
            server.connections -= 1

    async def disconnect(self) -> None:
        self.left.set()
        if self._speaking is not None:
            self._speaking.cancel()
        sentences = self._sentences
        while sentences is not None and not sentences.empty():  # begun, never spoken
            begun = sentences.get_nowait()
            if isinstance(begun, SpeechStream):
                begun.close_unsent()

    async def handle_event(self, event: Event) -> bool:
        if Describe.is_type(event.type):
            await self.write_event(self.server.info().event())
        elif SynthesizeStart.is_type(event.type):
            start = SynthesizeStart.from_event(event)
            self._voice = start.voice.name if start.voice is not None else None
            self._text = ""
            self._sentences = asyncio.Queue()
            self._speaking = asyncio.create_task(self._speak_in_order(self._sentences))
        elif SynthesizeChunk.is_type(event.type):
            if self._sentences is not None:
                done, self._text = complete_sentences(
                    self._text + SynthesizeChunk.from_event(event).text
                )
                if len(self._text) >= self.service.settings.max_chars:  # no end in sight
                    done, self._text = [*done, self._text], ""
                for sentence in done:
                    self._sentences.put_nowait(self._begin(sentence, self._voice))
        elif SynthesizeStop.is_type(event.type):
            queued, speaking = self._sentences, self._speaking
            if queued is not None and speaking is not None:
                if self._text.strip():
                    queued.put_nowait(self._begin(self._text, self._voice))
                queued.put_nowait(None)
                self._sentences, self._text = None, ""
                await speaking
                await self.write_event(SynthesizeStopped().event())
        elif Synthesize.is_type(event.type) and self._sentences is None:
            # (inside a stream it repeats the chunks: ignored)
            synthesize = Synthesize.from_event(event)
            name = synthesize.voice.name if synthesize.voice is not None else None
            await self._speak(self._begin(synthesize.text, name))
        return True  # other events are not for a TTS server: ignored, as Wyoming says

    def _begin(self, text: str, voice: str | None) -> SpeechStream | Error:
        """Start speaking ``text`` (its audio is generated from now on, while earlier
        sentences are still sent), or the error event that refuses it."""
        service, settings = self.service, self.service.settings
        try:
            if not service.ready:
                raise NotLoaded(f"model is not ready ({service.serving_phase})")
            if len(text) > settings.max_chars:
                raise TextError(
                    f"text has {len(text)} characters; the limit is {settings.max_chars}"
                )
            request = SynthesisRequest(
                text=text_to_speak(text, settings.max_control_tokens),
                seed=settings.default_seed,
                voice=service.voices.resolve(voice, "voice") if voice else None,
            )
            plan = service.speech.plan(request, degraded=service.degraded)
            started = time.perf_counter()
            service.recent.begin()

            def ended(error: EngineError | None, seconds: float, cache: str) -> None:
                elapsed = time.perf_counter() - started
                service.recent.end(elapsed, seconds, cache if error is None else None)

            return service.speech.stream(plan, PCM, started, ended, self.left.is_set)
        except Overloaded as error:
            return Error(text=f"server is overloaded: {error}", code="overloaded")
        except NotLoaded as error:
            return Error(text=str(error), code="not_ready")
        except VoiceError as error:
            return Error(text=str(error), code="unknown_voice")
        except TextError as error:
            return Error(text=str(error), code="bad_text")
        except EngineError as error:
            return Error(text=f"synthesis failed: {error}", code="failed")

    async def _speak_in_order(self, sentences: asyncio.Queue[SpeechStream | Error | None]) -> None:
        while (begun := await sentences.get()) is not None:
            await self._speak(begun)

    async def _speak(self, begun: SpeechStream | Error) -> None:
        """``audio-start``, the stream's chunks as they come, ``audio-stop``; or the error."""
        if isinstance(begun, Error):
            await self.write_event(begun.event())
            return
        loop = asyncio.get_running_loop()
        chunks: Iterator[bytes] = iter(begun.chunks)
        finished = False
        try:
            await self.write_event(AudioStart(rate=SAMPLE_RATE, width=2, channels=1).event())
            while (
                chunk := await loop.run_in_executor(self.server.pool, _next, chunks)
            ) is not None:
                if chunk:
                    event = AudioChunk(rate=SAMPLE_RATE, width=2, channels=1, audio=chunk)
                    await self.write_event(event.event())
            finished = True
            await self.write_event(AudioStop().event())
        except StreamBroken as broken:  # after its first audio
            text = f"synthesis failed: {broken.error}"
            await self.write_event(Error(text=text, code="failed").event())
        finally:
            if not finished:  # the client left or the stream broke: stop its generation
                self.left.set()
                await loop.run_in_executor(self.server.pool, _close, chunks)


def _next(chunks: Iterator[bytes]) -> bytes | None:
    return next(chunks, None)


def _close(chunks: Any) -> None:
    chunks.close()
