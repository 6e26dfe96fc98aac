"""One settings object, read once from the environment and passed to whoever needs it.

Every field here is documented in the README's settings table; an unknown ``CHATTTS_*``
variable is reported at start-up so a typo does not silently fall back to a default. Just over
500 lines: one declaration a setting, each with its bounds and the line the README shows.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from chattts_service.runtime.cpu import available_cpus, cpu_has_native_bf16

log = logging.getLogger(__name__)

PREFIX = "CHATTTS_"


class SettingsError(ValueError):
    """An environment variable holds a value the service cannot use."""


# the values of CHATTTS_QUANTIZE, CHATTTS_KERNELS and CHATTTS_INT8_PRODUCT; quantize.py and
# kernels.py take them from here (this module must not import torch)
QUANTIZATIONS = ("int8", "int4", "none")
KERNEL_MODES = ("auto", "on", "off")
INT8_PRODUCTS = ("auto", "vnni", "avx2", "i8mm", "dotprod", "neon")
KERNEL_TUNINGS = ("measure", "table", "default")
KV_CACHE_DTYPES = ("bf16", "int8")
DECODER_DTYPES = ("auto", "bf16", "fp32", "int8")
DOWNLOAD_MODES = ("auto", "never")
ALLOCATORS = ("auto", "jemalloc", "system")
# the largest seed: a request's, a seed:N voice's and CHATTTS_DEFAULT_SEED's
MAX_SEED = 2**31 - 1
INSTRUCTION_MODES = ("ignore", "refuse")
LONG_TEXT_VOICES = ("embedding", "first_segment")
LOG_LEVELS = tuple(logging.getLevelNamesMapping())


def _env_field(
    name: str,
    default,
    help_text: str,
    *,
    low: int | None = None,
    high: int | None = None,
    choices: tuple[str, ...] | None = None,
):
    """A setting read from ``CHATTTS_<name>``. Its bounds (``low``/``high``, inclusive) or its
    ``choices`` are declared here once: the start-up check, the admin endpoint, the OpenAPI
    document and the README table all read them from the field."""
    return field(
        default=default,
        metadata={
            "env": PREFIX + name,
            "help": help_text,
            "low": low,
            "high": high,
            "choices": choices,
        },
    )


@dataclass(frozen=True)
class Bounds:
    low: int | None
    high: int | None

    def __contains__(self, value: int) -> bool:
        return (self.low is None or value >= self.low) and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.high is None:
            return f"at least {self.low}"
        return f"between {self.low} and {self.high}"


@dataclass(frozen=True)
class Settings:
    model_dir: Path = _env_field(
        "MODEL_DIR",
        Path("models/chattts"),
        "directory holding the model in ChatTTS's layout (asset/...)",
    )
    download: str = _env_field(
        "DOWNLOAD",
        "auto",
        "an empty, incomplete or corrupt model directory is fetched from the hub (HF_ENDPOINT, "
        "HF_TOKEN) at start: auto, or never (air-gapped sites: an error names what is missing)",
        choices=DOWNLOAD_MODES,
    )
    model_checksums: str = _env_field(
        "MODEL_CHECKSUMS",
        "",
        "a JSON file of {relative path: sha256} the model files must match, instead of the "
        "list the installed ChatTTS ships (for weights of another revision)",
    )
    verify_model: bool = _env_field(
        "VERIFY_MODEL", True, "check every model file against ChatTTS's sha256 list at start"
    )
    packed_cache: bool = _env_field(
        "PACKED_CACHE",
        True,
        "keep the GPT's packed int8 layers in <model dir>/.packed and map them on later starts",
    )
    host: str = _env_field("HOST", "0.0.0.0", "address to listen on")
    port: int = _env_field("PORT", 8090, "port to listen on", low=1, high=65535)
    wyoming_port: int = _env_field(
        "WYOMING_PORT",
        10200,
        "Home Assistant's Wyoming protocol (TTS) on this TCP port, beside HTTP; 0 turns it off",
        low=0,
        high=65535,
    )
    threads: int = _env_field(
        "THREADS", 0, "torch compute threads; 0 = the CPUs this process may run on", low=0
    )
    http_threads: int = _env_field(
        "HTTP_THREADS",
        32,
        "gunicorn threads accepting requests (each waits on the scheduler)",
        low=1,
    )
    instructions: str = _env_field(
        "INSTRUCTIONS",
        "ignore",
        "OpenAI's free-text 'instructions', which ChatTTS cannot follow: ignore (speak the text, "
        "say so in X-Instructions) or refuse (400)",
        choices=INSTRUCTION_MODES,
    )
    allocator: str = _env_field(
        "ALLOCATOR",
        "auto",
        "the server's malloc: jemalloc (flat memory under steady load), auto (jemalloc where "
        "installed) or system (glibc's)",
        choices=ALLOCATORS,
    )
    http_idle_timeout_s: int = _env_field(
        "HTTP_IDLE_TIMEOUT_S",
        5,
        "seconds a connection may stay open with no request begun (a new one, or kept alive "
        "between requests); then it is closed",
        low=1,
        high=3600,
    )
    http_header_timeout_s: int = _env_field(
        "HTTP_HEADER_TIMEOUT_S",
        10,
        "seconds a request's line and headers may take to arrive from its first byte; then 408",
        low=1,
        high=600,
    )
    http_body_timeout_s: int = _env_field(
        "HTTP_BODY_TIMEOUT_S",
        60,
        "seconds a request's body may take to arrive after its headers; then 408",
        low=1,
        high=3600,
    )
    http_send_timeout_s: int = _env_field(
        "HTTP_SEND_TIMEOUT_S",
        60,
        "seconds a client may go without taking any of its answer's bytes; then it is cut off",
        low=1,
        high=3600,
    )
    http_max_connections: int = _env_field(
        "HTTP_MAX_CONNECTIONS",
        1000,
        "open connections at most; a new one beyond closes the one that has waited longest "
        "without a request being answered",
        low=2,
        high=100000,
    )
    worker_timeout: int = _env_field(
        "WORKER_TIMEOUT",
        300,
        "seconds gunicorn waits on a silent worker before restarting it",
        low=10,
    )
    cache_size: int = _env_field(
        "CACHE_SIZE", 256, "entries in the LRU audio cache; 0 disables it", low=0
    )
    cache_mb: int = _env_field("CACHE_MB", 256, "bytes of audio the cache may hold, in MiB", low=0)
    max_chars: int = _env_field(
        "MAX_CHARS", 4000, "longest text accepted, in characters (long text is split)", low=1
    )
    max_segment_chars: int = _env_field(
        "MAX_SEGMENT_CHARS",
        100,
        "long text is split at sentence boundaries into segments of at most this many characters",
        low=10,
        high=500,
    )
    segment_pause_ms: int = _env_field(
        "SEGMENT_PAUSE_MS", 200, "silence between the segments of a long text", low=0, high=5000
    )
    max_control_tokens: int = _env_field(
        "MAX_CONTROL_TOKENS", 64, "most control tokens ([uv_break], [laugh]...) per text", low=0
    )
    voices_dir: Path = _env_field(
        "VOICES_DIR",
        Path("voices"),
        "directory of named voices (<name>.json), voices made from recordings and their "
        "consents (consents/); created when a voice is registered",
    )
    max_stored_voices: int = _env_field(
        "MAX_STORED_VOICES",
        1000,
        "most voices kept in CHATTTS_VOICES_DIR, and most consents: one more is a 409",
        low=1,
        high=100_000,
    )
    long_text_voice: str = _env_field(
        "LONG_TEXT_VOICE",
        "embedding",
        "a text of several segments: every segment from the voice's embedding (embedding), or, "
        "as upstream's Chat.infer, the first segment first and its audio as the recording "
        "the others are spoken from (first_segment; voices from a recording are unchanged)",
        choices=LONG_TEXT_VOICES,
    )
    normalize: bool = _env_field(
        "NORMALIZE", True, "default for the per-request normalize option (wetext)"
    )
    max_new_tokens: int = _env_field(
        "MAX_NEW_TOKENS",
        2048,
        "cap on GPT steps per request (46.9 steps = 1 s of audio)",
        low=1,
        high=4096,
    )
    max_steps_per_char: int = _env_field(
        "MAX_STEPS_PER_CHAR",
        25,
        "per-request step cap of 150 + this many steps per character (stops runaway speech)",
        low=1,
    )
    quantize: str = _env_field(
        "QUANTIZE",
        "int8",
        "GPT linear layers: int8 (per-row activation scales), int4 (4-bit weights, a scale per "
        "64 inputs; needs the C++ kernels; opt-in, check its fidelity first) or none (fp32)",
        choices=QUANTIZATIONS,
    )
    kernels: str = _env_field(
        "KERNELS",
        "auto",
        "the built-in C++ kernels (decode attention, int8 product with RMSNorm and SwiGLU fused, "
        "sampling): on, off, or auto (if usable)",
        choices=KERNEL_MODES,
    )
    kernel_dir: str = _env_field(
        "KERNEL_DIR",
        "",
        "where the built C++ kernels are found (the image sets it; empty: `_build` beside "
        "their sources, where `script/setup` builds them)",
    )
    int8_product: str = _env_field(
        "INT8_PRODUCT",
        "auto",
        "the C++ kernels' int8 product: on x86-64 vnni (AVX512-VNNI, 8-bit activations) or avx2 "
        "(7-bit activations, as on CPUs without VNNI); on aarch64 i8mm (smmla), dotprod (sdot) "
        "or neon (Armv8.0); auto: the best this CPU runs",
        choices=INT8_PRODUCTS,
    )
    kernel_tuning: str = _env_field(
        "KERNEL_TUNING",
        "measure",
        "how the int8 product's prefetching is chosen for the CPU: measure (once per CPU, kept "
        "in <model dir>/.packed), table (known CPUs), or default",
        choices=KERNEL_TUNINGS,
    )
    kv_cache_dtype: str = _env_field(
        "KV_CACHE_DTYPE",
        "bf16",
        "what the KV cache holds where the C++ kernels attend: bf16, or int8 with a scale per "
        "position and head (half the bytes to read each step; torch's attention keeps fp32)",
        choices=KV_CACHE_DTYPES,
    )
    decoder_dtype: str = _env_field(
        "DECODER_DTYPE",
        "auto",
        "decoder precision: bf16, fp32, int8 (the pointwise layers on the C++ kernels' int8 "
        "product: faster on CPUs without native bf16, opt-in for its waveform error), or auto "
        "(bf16 where the CPU has native bf16 dot products, else fp32)",
        choices=DECODER_DTYPES,
    )
    stream_lookahead: int = _env_field(
        "STREAM_LOOKAHEAD",
        0,
        "steps after a chunk that a stream's first chunks are decoded with, for sooner first "
        "audio (until its listener holds enough for exact chunks to catch up): those samples "
        "are close to the whole answer's, not the same, and such a stream is not cached. 0: "
        "the decoder's whole context (52 steps on ChatTTS's), every sample the whole answer's",
        low=0,
        high=256,
    )
    max_batch: int = _env_field(
        "MAX_BATCH", 8, "requests generated together in one batch", low=1, high=64
    )
    batch_wait_ms: int = _env_field(
        "BATCH_WAIT_MS",
        0,
        "how long an idle scheduler waits for more requests to batch (later ones join the "
        "running batch between two steps anyway)",
        low=0,
        high=10_000,
    )
    max_queue: int = _env_field(
        "MAX_QUEUE", 64, "requests that may wait for the model; more get 503", low=1, high=4096
    )
    default_stream: str = _env_field(
        "DEFAULT_STREAM",
        "early",
        "a stream nobody asked for (OpenAI's endpoint streams unless told not to): early "
        "(chunks as it generates, first audio as early as an asked-for stream's) or segments "
        "(each segment's audio once decoded whole: cheaper where clients read whole bodies)",
        choices=("early", "segments"),
    )
    bulk_min_rows: int = _env_field(
        "BULK_MIN_ROWS",
        1,
        "rows bulk work (a long text's later segments, requests marked bulk) keeps whenever it "
        "has work, however much interactive work waits",
        low=0,
        high=64,
    )
    bulk_rows_while_starting: int = _env_field(
        "BULK_ROWS_WHILE_STARTING",
        1,
        "rows bulk work may hold while a stream waits for its first audio or runs short of "
        "audio (every row makes each step slower); at least CHATTTS_BULK_MIN_ROWS",
        low=0,
        high=64,
    )
    stall_budget_ms: int = _env_field(
        "STALL_BUDGET_MS",
        40,
        "how long the running rows may wait between two steps for a prompt's prefill (a piece "
        "at a time within it) or streams' audio (a decode round a stage at a time)",
        low=5,
        high=10_000,
    )
    kv_cache_mb: int = _env_field(
        "KV_CACHE_MB", 768, "KV-cache budget; requests wait rather than exceed it", low=64
    )
    request_timeout_s: int = _env_field(
        "REQUEST_TIMEOUT_S",
        300,
        "a request not finished after this many seconds is dropped and answered 504",
        low=1,
    )
    max_wait_s: int = _env_field(
        "MAX_WAIT_S",
        120,
        "answer 503 at once when the estimated wait is longer; 0 = off",
        low=0,
        high=3600,
    )
    degrade_cpu_percent: int = _env_field(
        "DEGRADE_CPU_PERCENT",
        85,
        "degraded mode when process CPU stays at or above this (% of its CPUs); 0 = never",
        low=0,
        high=100,
    )
    degrade_after_s: int = _env_field(
        "DEGRADE_AFTER_S", 10, "seconds the CPU must stay above (or below) to switch mode", low=1
    )
    degraded_max_new_tokens: int = _env_field(
        "DEGRADED_MAX_NEW_TOKENS",
        1024,
        "per-segment step cap while degraded (no refinement)",
        low=16,
    )
    drain_seconds: int = _env_field(
        "DRAIN_SECONDS",
        3,
        "after SIGTERM: seconds of answering 503 (readiness too) before it stops accepting",
        low=0,
        high=60,
    )
    graceful_timeout_s: int = _env_field(
        "GRACEFUL_TIMEOUT_S",
        30,
        "after the drain: how long in-flight requests may finish",
        low=1,
        high=600,
    )
    api_keys: str = _env_field("API_KEYS", "", "comma-separated API keys; empty = no auth")
    api_keys_file: str = _env_field("API_KEYS_FILE", "", "file of API keys, one per line")
    metrics_auth: bool = _env_field("METRICS_AUTH", False, "require a key for /metrics too")
    refine_text: bool = _env_field(
        "REFINE_TEXT", False, "default for the per-request refine_text option"
    )
    default_seed: int = _env_field(
        "DEFAULT_SEED",
        1234,
        "voice and sampling seed when a request gives none",
        low=0,
        high=MAX_SEED,
    )
    warmup: bool = _env_field("WARMUP", True, "run warm-up texts through the model before ready")
    log_level: str = _env_field("LOG_LEVEL", "INFO", "Python logging level", choices=LOG_LEVELS)

    @property
    def resolved_decoder_dtype(self) -> str:
        if self.decoder_dtype != "auto":
            return self.decoder_dtype
        return "bf16" if cpu_has_native_bf16() else "fp32"

    @property
    def torch_threads(self) -> int:
        return self.threads if self.threads > 0 else available_cpus()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> Settings:
        environ = os.environ if environ is None else environ
        values = {}
        known = set()
        for item in fields(cls):
            name = item.metadata["env"]
            known.add(name)
            if name in environ and item.name not in overrides:
                values[item.name] = _parse(name, environ[name], item.default)
        unknown = sorted(k for k in environ if k.startswith(PREFIX) and k not in known)
        for name in unknown:
            log.warning("ignoring unknown setting %s (see the README's settings table)", name)
        settings = cls(**{**values, **overrides})
        settings.validate()
        return settings

    def validate(self) -> None:
        for item in fields(self):
            value, name = getattr(self, item.name), item.metadata["env"]
            choices = item.metadata["choices"]
            if choices is not None and _canonical(item.name, value) not in choices:
                raise SettingsError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
            bounds = self.bounds(item.name)
            if bounds is not None and value not in bounds:
                raise SettingsError(f"{name} must be {bounds.describe()}, not {value}")

    @classmethod
    def bounds(cls, name: str) -> Bounds | None:
        """The declared range of an integer setting (None for the others)."""
        metadata = next(item.metadata for item in fields(cls) if item.name == name)
        if metadata["low"] is None and metadata["high"] is None:
            return None
        return Bounds(metadata["low"], metadata["high"])

    @classmethod
    def documentation(cls) -> list[tuple[str, str, str, str]]:
        """(variable, default, allowed values, meaning) for every setting: the README table
        is checked against it."""
        rows = []
        for item in fields(cls):
            default = item.default
            if isinstance(default, bool):
                default = "1" if default else "0"
            rows.append(
                (
                    item.metadata["env"],
                    str(default),
                    _allowed(item.metadata, item.default),
                    item.metadata["help"],
                )
            )
        return rows


def _canonical(name: str, value):
    return value.upper() if name == "log_level" else value


def _allowed(metadata, default) -> str:
    if isinstance(default, bool):
        return "1, 0"
    if metadata["choices"] is not None:
        return ", ".join(metadata["choices"])
    low, high = metadata["low"], metadata["high"]
    if low is None and high is None:
        return ""
    return f"{low}.." + ("" if high is None else str(high))


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(name: str, raw: str, default):
    text = raw.strip()
    try:
        if isinstance(default, bool):
            lowered = text.lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError("expected 1/0, true/false, yes/no or on/off")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, Path):
            return Path(text)
        return text
    except ValueError as error:
        raise SettingsError(f"{name}={raw!r}: {error}") from error
