"""One settings object, read once from the environment and passed to whoever needs it.

Every field here is documented in the README's settings table; an unknown ``CHATTTS_*``
variable is reported at start-up so a typo does not silently fall back to a default.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

PREFIX = "CHATTTS_"


class SettingsError(ValueError):
    """An environment variable holds a value the service cannot use."""


def available_cpus() -> int:
    """CPUs this process may run on: honours a container's cpuset and ``numactl``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


# the values of CHATTTS_QUANTIZE, CHATTTS_KERNELS and CHATTTS_INT8_PRODUCT; quantize.py and
# kernels.py take them from here (this module must not import torch)
QUANTIZATIONS = ("int8", "none")
KERNEL_MODES = ("auto", "on", "off")
INT8_PRODUCTS = ("auto", "vnni", "avx2")
KV_CACHE_DTYPES = ("bf16", "int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read). Read once:
    the questions asked of it come on every request (cache key) and every decode."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as handle:
            line = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: without them bf16 is emulated and slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def _env_field(name: str, default, help_text: str):
    return field(default=default, metadata={"env": PREFIX + name, "help": help_text})


@dataclass(frozen=True)
class Settings:
    model_dir: Path = _env_field("MODEL_DIR", Path("models/chattts"),
                                 "directory holding the model in ChatTTS's layout (asset/...)")
    verify_model: bool = _env_field("VERIFY_MODEL", True,
                                    "check every model file against ChatTTS's sha256 list at start")
    host: str = _env_field("HOST", "0.0.0.0", "address to listen on")
    port: int = _env_field("PORT", 8090, "port to listen on")
    threads: int = _env_field("THREADS", 0,
                              "torch compute threads; 0 = the CPUs this process may run on")
    http_threads: int = _env_field("HTTP_THREADS", 32,
                                   "gunicorn threads accepting requests (each waits on the scheduler)")
    worker_timeout: int = _env_field("WORKER_TIMEOUT", 300,
                                     "seconds gunicorn waits on a silent worker before restarting it")
    cache_size: int = _env_field("CACHE_SIZE", 256, "entries in the LRU audio cache; 0 disables it")
    cache_mb: int = _env_field("CACHE_MB", 256, "bytes of audio the cache may hold, in MiB")
    max_chars: int = _env_field("MAX_CHARS", 4000,
                                "longest text accepted, in characters (long text is split)")
    max_segment_chars: int = _env_field(
        "MAX_SEGMENT_CHARS", 100,
        "long text is split at sentence boundaries into segments of at most this many characters")
    segment_pause_ms: int = _env_field("SEGMENT_PAUSE_MS", 200,
                                       "silence between the segments of a long text")
    max_control_tokens: int = _env_field("MAX_CONTROL_TOKENS", 64,
                                         "most control tokens ([uv_break], [laugh]...) per text")
    voices_dir: Path = _env_field("VOICES_DIR", Path("voices"),
                                  "directory of named voices (<name>.json); created when a voice "
                                  "is registered")
    normalize: bool = _env_field("NORMALIZE", True,
                                 "default for the per-request normalize option (wetext)")
    max_new_tokens: int = _env_field("MAX_NEW_TOKENS", 2048,
                                     "cap on GPT steps per request (46.9 steps = 1 s of audio)")
    max_steps_per_char: int = _env_field(
        "MAX_STEPS_PER_CHAR", 25,
        "per-request step cap of 150 + this many steps per character (stops runaway speech)")
    quantize: str = _env_field("QUANTIZE", "int8", "GPT linear layers: int8 (per-row activation scales) or none (fp32)")
    kernels: str = _env_field(
        "KERNELS", "auto",
        "the built-in C++ kernels (decode attention, int8 product with RMSNorm and SwiGLU fused, "
        "sampling): on, off, or auto (if usable)")
    int8_product: str = _env_field(
        "INT8_PRODUCT", "auto",
        "the C++ kernels' int8 product: vnni (AVX512-VNNI, 8-bit activations), avx2 (7-bit "
        "activations, as on CPUs without VNNI), or auto (vnni where the CPU has it)")
    kv_cache_dtype: str = _env_field(
        "KV_CACHE_DTYPE", "bf16",
        "what the KV cache holds where the C++ kernels attend: bf16, or int8 with a scale per "
        "position and head (half the bytes to read each step; torch's attention keeps fp32)")
    decoder_dtype: str = _env_field(
        "DECODER_DTYPE", "auto",
        "decoder precision: bf16, fp32, or auto (bf16 where the CPU has native bf16 dot products)")
    max_batch: int = _env_field("MAX_BATCH", 8, "requests generated together in one batch")
    batch_wait_ms: int = _env_field("BATCH_WAIT_MS", 50,
                                    "how long an idle scheduler waits for more requests to batch")
    max_queue: int = _env_field("MAX_QUEUE", 64, "requests that may wait for the model; more get 503")
    kv_cache_mb: int = _env_field("KV_CACHE_MB", 768,
                                  "KV-cache budget; requests wait rather than exceed it")
    request_timeout_s: int = _env_field(
        "REQUEST_TIMEOUT_S", 300,
        "a request not finished after this many seconds is dropped and answered 504")
    max_wait_s: int = _env_field("MAX_WAIT_S", 120,
                                 "answer 503 at once when the estimated wait is longer; 0 = off")
    degrade_cpu_percent: int = _env_field(
        "DEGRADE_CPU_PERCENT", 85,
        "degraded mode when process CPU stays at or above this (% of its CPUs); 0 = never")
    degrade_after_s: int = _env_field("DEGRADE_AFTER_S", 10,
                                      "seconds the CPU must stay above (or below) to switch mode")
    degraded_max_new_tokens: int = _env_field(
        "DEGRADED_MAX_NEW_TOKENS", 1024, "per-segment step cap while degraded (no refinement)")
    drain_seconds: int = _env_field(
        "DRAIN_SECONDS", 3,
        "after SIGTERM: seconds of answering 503 (readiness too) before it stops accepting")
    graceful_timeout_s: int = _env_field(
        "GRACEFUL_TIMEOUT_S", 30, "after the drain: how long in-flight requests may finish")
    api_keys: str = _env_field("API_KEYS", "", "comma-separated API keys; empty = no auth")
    api_keys_file: str = _env_field("API_KEYS_FILE", "", "file of API keys, one per line")
    metrics_auth: bool = _env_field("METRICS_AUTH", False, "require a key for /metrics too")
    refine_text: bool = _env_field("REFINE_TEXT", False,
                                   "default for the per-request refine_text option")
    default_seed: int = _env_field("DEFAULT_SEED", 1234, "voice and sampling seed when a request gives none")
    warmup: bool = _env_field("WARMUP", True, "run warm-up texts through the model before ready")
    log_level: str = _env_field("LOG_LEVEL", "INFO", "Python logging level")

    @property
    def resolved_decoder_dtype(self) -> str:
        if self.decoder_dtype != "auto":
            return self.decoder_dtype
        return "bf16" if cpu_has_native_bf16() else "fp32"

    @property
    def torch_threads(self) -> int:
        return self.threads if self.threads > 0 else available_cpus()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Settings":
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
        checks = [
            (1 <= self.port <= 65535, "CHATTTS_PORT must be between 1 and 65535"),
            (self.threads >= 0, "CHATTTS_THREADS must be 0 (auto) or positive"),
            (self.http_threads >= 1, "CHATTTS_HTTP_THREADS must be at least 1"),
            (self.worker_timeout >= 10, "CHATTTS_WORKER_TIMEOUT must be at least 10 seconds"),
            (self.cache_size >= 0, "CHATTTS_CACHE_SIZE must be 0 or positive"),
            (self.max_chars >= 1, "CHATTTS_MAX_CHARS must be at least 1"),
            (self.cache_mb >= 0, "CHATTTS_CACHE_MB must be 0 (no byte bound) or positive"),
            (10 <= self.max_segment_chars <= 500,
             "CHATTTS_MAX_SEGMENT_CHARS must be between 10 and 500"),
            (0 <= self.segment_pause_ms <= 5000,
             "CHATTTS_SEGMENT_PAUSE_MS must be between 0 and 5000"),
            (self.max_control_tokens >= 0, "CHATTTS_MAX_CONTROL_TOKENS must be 0 or positive"),
            (self.max_wait_s >= 0, "CHATTTS_MAX_WAIT_S must be 0 (off) or positive"),
            (0 <= self.degrade_cpu_percent <= 100,
             "CHATTTS_DEGRADE_CPU_PERCENT must be between 0 (off) and 100"),
            (self.degrade_after_s >= 1, "CHATTTS_DEGRADE_AFTER_S must be at least 1"),
            (self.degraded_max_new_tokens >= 16,
             "CHATTTS_DEGRADED_MAX_NEW_TOKENS must be at least 16"),
            (0 <= self.drain_seconds <= 60, "CHATTTS_DRAIN_SECONDS must be between 0 and 60"),
            (1 <= self.graceful_timeout_s <= 600,
             "CHATTTS_GRACEFUL_TIMEOUT_S must be between 1 and 600"),
            (1 <= self.max_new_tokens <= 4096, "CHATTTS_MAX_NEW_TOKENS must be between 1 and 4096"),
            (self.max_steps_per_char >= 1, "CHATTTS_MAX_STEPS_PER_CHAR must be at least 1"),
            (self.quantize in QUANTIZATIONS, "CHATTTS_QUANTIZE must be int8 or none"),
            (self.kernels in KERNEL_MODES, "CHATTTS_KERNELS must be auto, on or off"),
            (self.int8_product in INT8_PRODUCTS,
             "CHATTTS_INT8_PRODUCT must be auto, vnni or avx2"),
            (self.kv_cache_dtype in KV_CACHE_DTYPES, "CHATTTS_KV_CACHE_DTYPE must be bf16 or int8"),
            (self.decoder_dtype in ("auto", "bf16", "fp32"),
             "CHATTTS_DECODER_DTYPE must be auto, bf16 or fp32"),
            (1 <= self.max_batch <= 64, "CHATTTS_MAX_BATCH must be between 1 and 64"),
            (0 <= self.batch_wait_ms <= 10_000, "CHATTTS_BATCH_WAIT_MS must be between 0 and 10000"),
            (self.max_queue >= 1, "CHATTTS_MAX_QUEUE must be at least 1"),
            (self.request_timeout_s >= 1, "CHATTTS_REQUEST_TIMEOUT_S must be at least 1"),
            (self.kv_cache_mb >= 64, "CHATTTS_KV_CACHE_MB must be at least 64"),
            (0 <= self.default_seed < 2**31, "CHATTTS_DEFAULT_SEED must be in [0, 2^31)"),
            (self.log_level.upper() in logging.getLevelNamesMapping(),
             "CHATTTS_LOG_LEVEL must be a Python logging level"),
        ]
        for ok, message in checks:
            if not ok:
                raise SettingsError(message)

    @classmethod
    def documentation(cls) -> list[tuple[str, str, str]]:
        """(variable, default, meaning) for every setting: the README table is built from it."""
        rows = []
        for item in fields(cls):
            default = item.default
            if isinstance(default, bool):
                default = "1" if default else "0"
            rows.append((item.metadata["env"], str(default), item.metadata["help"]))
        return rows


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
