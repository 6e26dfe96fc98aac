"""The user's load check against a running service (``bench.py``): how many listeners does
this box serve?

Whole requests give latency percentiles and throughput. Streamed requests (``--stream``) give
the time to first audio and, for every stream, how far its audio fell behind a player that
started at its first byte: a stream that falls behind by more than ``--tolerance`` would
stutter. Closed loop (``--concurrency`` clients, each sending its next request when the last
one ends) or open loop (``--rate`` requests a second, whatever the answers); ``--capacity``
raises the number of streams until they fall behind playback or the first audio gets too slow,
and prints the largest level that held. Where the server's ``/metrics`` can be read, each run
also says what share of its wall time the model thread spent in steps, decoding and prefills
(it generates ahead of playback, so while any stream generates it is busy: the shares say where
that time goes). Bounded in requests and time; talks to one URL (and its ``/metrics``).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

from chattts_service.domain.playback import Playback
from chattts_service.runtime.cpu import StealMeter, describe_steal

DEFAULT_TEXT = "今天天气很好，我们一起去公园散步吧。"
# streamed: long enough that falling behind shows (three sentences, as benchmarks/speech.py)
DEFAULT_STREAM_TEXT = (
    "今天天气很好，我们一起去公园散步吧。路边的花都开了，空气里有淡淡的香味。"
    "走累了就在湖边坐一会儿，看看水里的鱼。"
)
PCM_BYTES_PER_SECOND = 24_000 * 2  # 16-bit mono at 24 kHz
# how far a stream may fall behind a player that started at its first byte before it counts:
# the jitter buffer a browser or phone player keeps
TOLERANCE_SECONDS = 0.3
MAX_FIRST_AUDIO_SECONDS = 1.0  # the capacity search's bound on the first audio's p95
ENDPOINTS = ("synthesize", "speech")


@dataclass
class Outcome:
    status: int  # 0 = no HTTP answer
    seconds: float
    audio_seconds: float
    cache: str
    error: str = ""
    first_audio: float | None = None  # streamed: seconds from sending to the first audio byte
    behind: float | None = None  # streamed: how far the audio fell behind its playback


@dataclass
class Load:
    """What to send, and where."""

    url: str
    endpoint: str = "synthesize"
    text: str = DEFAULT_TEXT
    stream: bool = False
    timeout: float = 300.0
    repeat_seed: bool = False
    first_seed: int = 1
    _counter: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def address(self) -> str:
        path = "/synthesize" if self.endpoint == "synthesize" else "/v1/audio/speech"
        return self.url.rstrip("/") + path

    def body(self) -> dict:
        with self._lock:
            index, self._counter = self._counter, self._counter + 1
        # a new seed per request keeps the cache out of the measurement unless asked
        seed = self.first_seed if self.repeat_seed else self.first_seed + index
        audio = "pcm" if self.stream else "wav"
        if self.endpoint == "synthesize":
            return {"text": self.text, "seed": seed, "format": audio, "stream": self.stream}
        return {
            "model": "tts-1",
            "voice": "alloy",
            "input": self.text,
            "seed": seed,
            "response_format": audio,
            "stream": self.stream,
        }


def wav_seconds(payload: bytes) -> float:
    with wave.open(io.BytesIO(payload)) as reader:
        return reader.getnframes() / reader.getframerate()


def read_metrics(url: str, names, timeout: float = 5.0) -> dict[str, float] | None:
    """The unlabelled series ``names`` from the server's ``/metrics`` at ``url``: None where
    it cannot be read (a protected or older server) or lacks any of them."""
    try:
        response = requests.get(url.rstrip("/") + "/metrics", timeout=timeout)
    except requests.RequestException:
        return None
    if response.status_code != 200:
        return None
    wanted, values = set(names), {}
    for line in response.text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            values[name] = float(value)
    return values if len(values) == len(wanted) else None


# the model thread's work, as the server's /metrics sums it: seconds in each part
SERVER_TIME_SERIES = {
    "steps": "chatts_step_duration_seconds_sum",
    "decoding": "chatts_audio_decode_seconds_sum",
    "prefills": "chatts_prefill_duration_seconds_sum",
}


class ServerTime:
    """What share of a run's wall time the server's model thread spent in its steps, decode
    rounds and prefills: their sums on its ``/metrics``, read at the start and at ``shares``.
    None where they cannot be read (a protected or older server, or another host's)."""

    def __init__(self, url: str):
        self.url = url
        self._start = self._read()
        self._began = time.perf_counter()

    def _read(self) -> dict[str, float] | None:
        return read_metrics(self.url, SERVER_TIME_SERIES.values())

    def shares(self) -> dict[str, float] | None:
        end, wall = self._read(), time.perf_counter() - self._began
        if self._start is None or end is None or wall <= 0:
            return None
        return {
            part: (end[name] - self._start[name]) / wall
            for part, name in SERVER_TIME_SERIES.items()
        }


def describe_server_time(shares: dict[str, float] | None) -> str:
    """``ServerTime.shares`` short: "steps 58%, decoding 30%, prefills 7%" (or "-")."""
    if shares is None:
        return "-"
    return ", ".join(f"{part} {100 * share:.0f}%" for part, share in shares.items())


def send(session: requests.Session, load: Load, timeout: float) -> Outcome:
    started = time.perf_counter()
    try:
        response = session.post(load.address, json=load.body(), timeout=timeout, stream=load.stream)
        if response.status_code != 200:
            return Outcome(
                response.status_code, time.perf_counter() - started, 0.0, "-", response.text[:200]
            )
        if load.stream:
            return _streamed(response, started)
        payload = response.content
    except requests.RequestException as error:
        return Outcome(0, time.perf_counter() - started, 0.0, "-", error.__class__.__name__)
    elapsed = time.perf_counter() - started
    try:
        audio = wav_seconds(payload)
    except (wave.Error, EOFError) as error:
        return Outcome(-1, elapsed, 0.0, "-", f"invalid WAV: {error}")
    return Outcome(200, elapsed, audio, response.headers.get("X-Cache", "-"))


def _streamed(response: requests.Response, started: float) -> Outcome:
    """Read a PCM stream as a player would: it starts at the first byte and needs each piece
    by the time the audio before it has played."""
    playback = Playback()
    for piece in response.iter_content(chunk_size=None):
        if piece:
            playback.arrived(time.perf_counter(), len(piece) / PCM_BYTES_PER_SECOND)
    elapsed = time.perf_counter() - started
    if playback.first is None:
        return Outcome(-1, elapsed, 0.0, "-", "a stream without audio")
    return Outcome(
        200,
        elapsed,
        playback.audio,
        response.headers.get("X-Cache", "-"),
        first_audio=playback.first - started,
        behind=playback.behind,
    )


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


class Progress:
    """A live line on a terminal (plain lines every few seconds when piped), on stderr."""

    def __init__(self, outcomes: list[Outcome], lock: threading.Lock, enabled: bool, label=""):
        self.outcomes, self.lock, self.label = outcomes, lock, label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.started = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        if self.enabled:
            self._thread.join()
            if self.tty:
                sys.stderr.write("\n")

    def line(self) -> str:
        with self.lock:
            done = list(self.outcomes)
        ok = [o for o in done if o.status == 200]
        text = (
            f"{self.label}{time.perf_counter() - self.started:6.1f} s  done {len(ok)}  "
            f"errors {len(done) - len(ok)}  p95 {percentile([o.seconds for o in ok], 0.95):.2f} s"
        )
        firsts = [o.first_audio for o in ok if o.first_audio is not None]
        if firsts:
            behind = sum(1 for o in ok if o.behind is not None and o.behind > 0)
            text += f"  first audio p95 {percentile(firsts, 0.95):.2f} s  fell behind {behind}"
        return text

    def _run(self) -> None:
        every = 0.5 if self.tty else 5.0
        while not self._stop.wait(every):
            if self.tty:
                sys.stderr.write("\r" + self.line() + "\033[K")
            else:
                sys.stderr.write(self.line() + "\n")
            sys.stderr.flush()


def run(
    load: Load,
    concurrency: int = 1,
    total: int = 10,
    duration: float = 600.0,
    rate: float | None = None,
    progress: bool = False,
    label: str = "",
) -> tuple[list[Outcome], float]:
    """Closed loop: ``concurrency`` clients send until ``total`` requests are sent or
    ``duration`` has passed. Open loop (``rate``): requests start at exponentially spaced times
    averaging ``rate`` a second, at most ``concurrency`` in flight (one that would exceed it is
    counted as refused by the client, status -2)."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    deadline = time.monotonic() + duration
    started = time.perf_counter()

    def record(outcome: Outcome) -> None:
        with lock:
            outcomes.append(outcome)

    with Progress(outcomes, lock, progress, label):
        if rate is None:
            sent = iter(range(total))

            def client():
                session = requests.Session()
                while time.monotonic() < deadline:
                    with lock:
                        if next(sent, None) is None:
                            return
                    wait = min(load.timeout, max(1.0, deadline - time.monotonic() + 30))
                    record(send(session, load, wait))

            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                for _ in range(concurrency):
                    pool.submit(client)
        else:
            _open_loop(load, rate, concurrency, total, deadline, record)
    return outcomes, time.perf_counter() - started


def _open_loop(load: Load, rate: float, limit: int, total: int, deadline: float, record):
    arrivals = random.Random(load.first_seed)
    in_flight = threading.Semaphore(limit)
    sessions = threading.local()

    def one():
        try:
            if not hasattr(sessions, "session"):
                sessions.session = requests.Session()
            record(send(sessions.session, load, load.timeout))
        finally:
            in_flight.release()

    with ThreadPoolExecutor(max_workers=limit) as pool:
        next_at = time.monotonic()
        for _ in range(total):
            next_at += arrivals.expovariate(rate)
            if next_at >= deadline:
                break
            time.sleep(max(0.0, next_at - time.monotonic()))
            if not in_flight.acquire(blocking=False):
                record(Outcome(-2, 0.0, 0.0, "-", f"over {limit} in flight"))
                continue
            pool.submit(one)


def summarise(
    outcomes: list[Outcome],
    load: Load,
    concurrency: int,
    total: int,
    wall: float,
    tolerance: float = 0.1,
    rate: float | None = None,
) -> dict:
    """The report of a run: latency percentiles, throughput, errors by status; for streams,
    the first audio's percentiles and the share of streams that fell behind playback."""
    ok = [o for o in outcomes if o.status == 200]
    latencies = [o.seconds for o in ok]
    audio = sum(o.audio_seconds for o in ok)
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            errors[str(o.status)] = errors.get(str(o.status), 0) + 1
    result = {
        "url": load.address,
        "mode": f"open loop, {rate:g} requests/s" if rate else "closed loop",
        "stream": load.stream,
        "concurrency": concurrency,
        "requests_sent": len(outcomes),
        "requests_ok": len(ok),
        "errors": errors,
        "cache_hits": sum(1 for o in ok if o.cache == "HIT"),
        "wall_seconds": wall,
        "latency_p50": statistics.median(latencies) if latencies else float("nan"),
        "latency_p95": percentile(latencies, 0.95),
        "latency_max": max(latencies) if latencies else float("nan"),
        "requests_per_second": len(ok) / wall if wall > 0 else 0.0,
        "audio_seconds": audio,
        "audio_seconds_per_wall_second": audio / wall if wall > 0 else 0.0,
        "real_time_factor_p50": statistics.median(
            o.seconds / o.audio_seconds for o in ok if o.audio_seconds > 0
        )
        if ok
        else float("nan"),
        "stopped_by_time_limit": len(outcomes) < total,
    }
    if load.stream:
        firsts = [o.first_audio for o in ok]
        behind = [o.behind for o in ok]
        result.update(
            first_audio_p50=percentile(firsts, 0.5),
            first_audio_p95=percentile(firsts, 0.95),
            first_audio_p99=percentile(firsts, 0.99),
            behind_max=max(behind) if behind else float("nan"),
            tolerance_seconds=tolerance,
            streams_behind=sum(1 for b in behind if b > tolerance),
            stutter_share=sum(1 for b in behind if b > tolerance) / len(ok) if ok else 1.0,
        )
    return result


def format_report(result: dict) -> str:
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(result["errors"].items())) or "none"
    lines = [
        f"{result['url']}  {result['mode']}, concurrency {result['concurrency']}"
        + ("  streamed" if result["stream"] else ""),
        f"requests      {result['requests_ok']} ok of {result['requests_sent']} sent"
        f" in {result['wall_seconds']:.1f} s ({result['cache_hits']} cache hits)"
        + ("  [stopped by the time limit]" if result["stopped_by_time_limit"] else ""),
        f"latency       p50 {result['latency_p50']:.3f} s   p95 {result['latency_p95']:.3f} s"
        f"   max {result['latency_max']:.3f} s",
        f"throughput    {result['requests_per_second']:.2f} requests/s   "
        f"{result['audio_seconds_per_wall_second']:.2f} audio s per wall s"
        f"   (real-time factor p50 {result['real_time_factor_p50']:.2f})",
    ]
    if result["stream"]:
        lines += [
            f"first audio   p50 {result['first_audio_p50']:.3f} s   p95 "
            f"{result['first_audio_p95']:.3f} s   p99 {result['first_audio_p99']:.3f} s",
            f"playback      {result['streams_behind']} of {result['requests_ok']} streams fell "
            f"behind by more than {result['tolerance_seconds']:g} s "
            f"({100 * result['stutter_share']:.0f}% would stutter; worst "
            f"{result['behind_max']:.2f} s)",
        ]
    lines.append(f"errors        {errors}")
    if result.get("server_time") is not None:
        lines.append(
            f"model thread  {describe_server_time(result['server_time'])} of the wall time "
            "(the server's /metrics)"
        )
    if "steal_share" in result:
        lines.append(f"this machine  {describe_steal(result['steal_share'])}")
    return "\n".join(lines)


def steal_percent(result: dict) -> str:
    """A capacity level's steal, short: the share of this machine's CPU time the hypervisor
    took while the level ran (where the server runs here too, a level that failed while it was
    high may hold on a quieter day)."""
    share = result.get("steal_share")
    return "steal -" if share is None else f"steal {100 * share:.0f}%"


def shortfalls(result: dict, max_first_audio: float) -> list[str]:
    """What kept a capacity level from holding: "errors" (or no stream answered), "playback"
    (a stream fell behind its player), "first audio" (its p95 past the bound); none: it held."""
    found = []
    if result["errors"] or result["requests_ok"] == 0:
        found.append("errors")
    if result["streams_behind"]:
        found.append("playback")
    if not result["first_audio_p95"] <= max_first_audio:
        found.append("first audio")
    return found


def held(result: dict, max_first_audio: float) -> bool:
    """A capacity level holds: no errors, no stream fell behind playback, and the first
    audio's p95 within the bound."""
    return not shortfalls(result, max_first_audio)


def capacity(load: Load, args) -> dict:
    """Streams at 1, 2, 4, ... clients (up to ``--max-concurrency``) until a level fails, then
    halving the gap between the last that held and the first that failed; the largest level
    that held."""
    levels: dict[int, dict] = {}

    def measure(clients: int) -> bool:
        steal, server = StealMeter(), ServerTime(load.url)
        outcomes, wall = run(
            load,
            clients,
            total=args.requests_per_level * clients,
            duration=args.duration,
            progress=args.progress,
            label=f"[{clients} streams] ",
        )
        result = summarise(
            outcomes, load, clients, args.requests_per_level * clients, wall, args.tolerance
        )
        result["held"] = held(result, args.max_first_audio)
        result["steal_share"] = steal.share()
        result["server_time"] = server.shares()
        levels[clients] = result
        if not args.json:
            print(
                f"{clients:4d} streams  first audio p95 {result['first_audio_p95']:.2f} s  "
                f"fell behind {result['streams_behind']}/{result['requests_ok']} "
                f"(worst {result['behind_max']:.2f} s)  errors {sum(result['errors'].values())}"
                f"  {'held' if result['held'] else 'FAILED'}  {steal_percent(result)}  "
                f"server {describe_server_time(result['server_time'])}",
                flush=True,
            )
        return result["held"]

    good, bad, clients = 0, None, 1
    while True:
        if not measure(clients):
            bad = clients
            break
        good = clients
        if clients >= args.max_concurrency:
            break
        clients = min(2 * clients, args.max_concurrency)
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        if measure(middle):
            good = middle
        else:
            bad = middle
    # listeners who can wait longer for their first audio: the most streams, of the levels
    # tried, that kept up with playback whatever their first audio's p95
    kept_up = [
        clients
        for clients, result in levels.items()
        if not set(shortfalls(result, args.max_first_audio)) - {"first audio"}
    ]
    playback = max(kept_up, default=0)
    return {
        "url": load.address,
        "capacity_streams": good,
        "limited_by": [] if bad is None else shortfalls(levels[bad], args.max_first_audio),
        "playback_streams": playback,
        "playback_first_audio_p95": levels[playback]["first_audio_p95"] if playback else None,
        "max_first_audio_seconds": args.max_first_audio,
        "tolerance_seconds": args.tolerance,
        "levels": {str(clients): result for clients, result in sorted(levels.items())},
        "limited_by_max_concurrency": bad is None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8090")
    parser.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="synthesize",
        help="/synthesize, or OpenAI's /v1/audio/speech",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        help="clients (closed loop), or the most in flight (--rate)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="at most this many requests (10 unless --duration is given)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="send for this many seconds (then --requests is only a cap)",
    )
    parser.add_argument(
        "--rate", type=float, default=None, help="open loop: requests a second, Poisson arrivals"
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="streamed PCM: first audio, and streams behind playback",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=TOLERANCE_SECONDS,
        help="seconds a stream may fall behind its playback before it counts",
    )
    parser.add_argument(
        "--capacity",
        action="store_true",
        help="find the most concurrent streams the box serves (implies --stream)",
    )
    parser.add_argument(
        "--max-first-audio",
        type=float,
        default=MAX_FIRST_AUDIO_SECONDS,
        help="capacity: the bound on the first audio's p95, in seconds",
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=64, help="capacity: the most streams tried"
    )
    parser.add_argument(
        "--requests-per-level",
        type=int,
        default=3,
        help="capacity: streams each client sends per level",
    )
    parser.add_argument("--text", default=None)
    parser.add_argument(
        "--max-seconds", type=float, default=600.0, help="stop sending after this long"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per-request timeout")
    parser.add_argument(
        "--repeat-seed",
        action="store_true",
        help="send the same seed every time (measures the cache)",
    )
    parser.add_argument("--seed", type=int, default=1, help="first seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress lines on stderr"
    )
    from benchmarks import mix  # beside this module, which it builds on

    mix.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.requests is None:
        args.requests = 10 if args.duration is None else 100_000
    if args.concurrency < 1 or args.requests < 1 or args.max_seconds <= 0:
        parser.error("--concurrency, --requests and --max-seconds must be positive")
    if args.rate is not None and args.rate <= 0:
        parser.error("--rate must be positive")
    if args.mix:
        result = mix.run_mix(args)
        print(json.dumps(result) if args.json else mix.format_mix(result))
        return 0
    stream = args.stream or args.capacity
    text = args.text or (DEFAULT_STREAM_TEXT if stream else DEFAULT_TEXT)
    load = Load(args.url, args.endpoint, text, stream, args.timeout, args.repeat_seed, args.seed)
    if args.capacity:
        args.duration = min(args.duration or args.max_seconds, args.max_seconds)
        result = capacity(load, args)
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"capacity: {result['capacity_streams']} concurrent streams held (no stream "
                f"more than {args.tolerance:g} s behind playback, first audio p95 <= "
                f"{args.max_first_audio:g} s)"
                + ("; the most tried" if result["limited_by_max_concurrency"] else "")
            )
            if result["limited_by"]:
                print(f"  held back by: {', '.join(result['limited_by'])}")
            if result["playback_streams"] > result["capacity_streams"]:
                print(
                    f"  {result['playback_streams']} streams kept up with playback, their "
                    f"first audio p95 {result['playback_first_audio_p95']:.2f} s (a larger "
                    "--max-first-audio counts them)"
                )
        return 0
    duration = min(args.duration or args.max_seconds, args.max_seconds)
    total = args.requests
    steal, server = StealMeter(), ServerTime(load.url)
    outcomes, wall = run(load, args.concurrency, total, duration, args.rate, args.progress)
    result = summarise(outcomes, load, args.concurrency, total, wall, args.tolerance, args.rate)
    result["steal_share"] = steal.share()
    result["server_time"] = server.shares()
    print(json.dumps(result) if args.json else format_report(result))
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
