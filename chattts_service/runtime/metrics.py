"""Prometheus metrics, one registry per app so tests can build as many apps as they like."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from chattts_service.runtime import heap
from chattts_service.runtime.cpu import CpuSampler

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
# a stream's lag behind its listener: 0 for one that kept ahead, 0.1 s the load test's tolerance
BEHIND_BUCKETS = (0, 0.05, 0.1, 0.25, 0.3, 0.5, 1, 2, 5, 10, 30)


class HeapCollector:
    """``chatts_heap_bytes{kind}``: the allocator's counts at each scrape (``heap.stats``),
    for all three kinds (NaN where the allocator cannot tell)."""

    def collect(self):
        numbers = heap.stats()
        family = GaugeMetricFamily(
            "chatts_heap_bytes",
            "The allocator's heap (jemalloc or glibc, as /status says): in_use (live "
            "allocations), mmapped (glibc: live large ones), free (held, not returned to the OS)",
            labels=["kind"],
        )
        for kind in heap.KINDS:
            family.add_metric([kind], float(numbers[kind]) if numbers else float("nan"))
        yield family


class KernelsCollector:
    """``chatts_kernels_info{architecture, kernels, linears, instructions}`` = 1: the machine's
    architecture (x86_64, aarch64), whether the C++ kernels run, what multiplies the GPT's
    linears (the int8 product's variant: vnni, avx2, i8mm, dotprod, neon; int4; or torch's)
    and the kernels' product, which int4 runs on too (none with the kernels off).
    ``describe`` (set once the engine exists) gives the four at each scrape; nothing before."""

    def __init__(self):
        self.describe = None

    def collect(self):
        if self.describe is None:
            return
        family = GaugeMetricFamily(
            "chatts_kernels_info",
            "1, labelled with the architecture, whether the C++ kernels run, what "
            "multiplies the GPT's linear layers (the int8 product's variant, int4 or torch's) "
            "and the kernels' product (which int4 runs on too)",
            labels=["architecture", "kernels", "linears", "instructions"],
        )
        family.add_metric(list(self.describe()), 1.0)
        yield family


class PrefixCollector:
    """``chatts_prompt_prefixes_total{outcome}``: speech prompts whose first positions were
    copied from a kept beginning (hit) or computed (miss); ``chatts_prompt_prefixes_kept``:
    the beginnings kept. Read from the model's store (``store``, set once the model is
    loaded) at each scrape."""

    def __init__(self):
        self.store = None

    def collect(self):
        store = self.store
        if store is None:
            return
        counts = CounterMetricFamily(
            "chatts_prompt_prefixes",
            "Speech prompts whose first positions were copied from a kept beginning (hit) "
            "or computed (miss)",
            labels=["outcome"],
        )
        counts.add_metric(["hit"], float(store.hits))
        counts.add_metric(["miss"], float(store.misses))
        yield counts
        yield GaugeMetricFamily(
            "chatts_prompt_prefixes_kept",
            "Prompt beginnings whose keys and values are kept",
            value=float(len(store)),
        )


class ConnectionCollector:
    """The HTTP intake's connections (``chattts_service.transport.intake``), read at each scrape
    from ``source`` (a callable the serving worker sets; absent under a test client):
    ``chatts_http_connections{state}`` open ones, ``chatts_http_timeouts_total{phase}``
    connections closed by a timeout (408 for header and body), ``chatts_http_rejected_total
    {status}`` requests refused before a thread saw them, ``chatts_http_buffered_bytes``
    requests held while they arrive, ``chatts_http_evicted_total`` connections closed to make
    room at the limit."""

    def __init__(self):
        self.source = None

    def collect(self):
        if self.source is None:
            return
        stats = self.source()
        open_now = GaugeMetricFamily(
            "chatts_http_connections",
            "Open connections: waiting (idle, or a request still arriving) or in_request "
            "(a whole request being answered)",
            labels=["state"],
        )
        open_now.add_metric(["waiting"], float(stats.waiting))
        open_now.add_metric(["in_request"], float(stats.in_threads))
        yield open_now
        timeouts = CounterMetricFamily(
            "chatts_http_timeouts",
            "Connections closed because a request's part did not arrive in time (idle: none "
            "begun; header, body: answered 408) or its answer was not read (send)",
            labels=["phase"],
        )
        for phase, count in stats.timeouts.items():
            timeouts.add_metric([phase], float(count))
        yield timeouts
        rejected = CounterMetricFamily(
            "chatts_http_rejected",
            "Requests refused as they arrived: 413 body, 414 request line, 431 headers too "
            "large; 503 too many request bytes arriving at once",
            labels=["status"],
        )
        for status, count in stats.rejected.items():
            rejected.add_metric([str(status)], float(count))
        yield rejected
        yield GaugeMetricFamily(
            "chatts_http_buffered_bytes",
            "Bytes of requests read and held while they arrive (at most 256 MiB)",
            value=float(stats.buffered),
        )
        yield CounterMetricFamily(
            "chatts_http_evicted",
            "Connections closed at the connection limit to admit a new one",
            value=float(stats.evicted),
        )


# The metric names keep the seed design's spelling, chatts_* (one "t"): its dashboards use them.
class Metrics:
    """Every metric of one app, in its own registry. ``__init__`` is one long list of
    declarations, kept together so the set of metrics reads in one place."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.infer_total = Counter(
            "chatts_infer",
            "Inferences run (cache misses that reached the model)",
            ["outcome"],
            registry=r,
        )
        self.infer_duration = Histogram(
            "chatts_infer_duration_seconds",
            "Model time per inference",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "chatts_request_duration_seconds",
            "Time to answer a speech request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.first_audio = Histogram(
            "chatts_first_audio_seconds",
            "Time from a streamed request's arrival to its first audio, by its class",
            ["priority"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "chatts_queue_wait_seconds",
            "Time a segment waited for its first row in the batch, by its class",
            ["priority"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.stall = Histogram(
            "chatts_scheduler_stall_seconds",
            "Time the running rows waited between two steps (prefill pieces, decode rounds)",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1),
            registry=r,
        )
        self.longest_stall = Gauge(
            "chatts_scheduler_stall_max_seconds",
            "The longest time the running rows waited between two steps since the start",
            registry=r,
        )
        self.rows_taken_back = Counter(
            "chatts_rows_taken_back",
            "Rows a waiting segment took from a running one it outranks (which paused), by the "
            "taker's class",
            ["priority"],
            registry=r,
        )
        self.stream_behind = Histogram(
            "chatts_stream_behind_seconds",
            "How far a generated stream fell behind a listener playing it from its first audio",
            buckets=BEHIND_BUCKETS,
            registry=r,
        )
        self.segments_truncated = Counter(
            "chatts_segments_truncated",
            "Segments stopped by the step cap before their speech ended",
            registry=r,
        )
        self.provisional_audio = Counter(
            "chatts_provisional_audio_seconds",
            "Streamed audio decoded with CHATTTS_STREAM_LOOKAHEAD's look-ahead: close to the "
            "whole answer's samples, not the same",
            registry=r,
        )
        self.rejected = Counter(
            "chatts_rejected",
            "Requests refused at once with 503 (queue_full, wait, draining)",
            ["reason"],
            registry=r,
        )
        self.degraded = Gauge(
            "chatts_degraded",
            "1 while degraded mode is on (CPU pressure: no refinement, shorter step cap)",
            registry=r,
        )
        self.segments_queued = Gauge(
            "chatts_segments_queued", "Segments queued, waiting for room, or generating", registry=r
        )
        self.config = Gauge(
            "chatts_config",
            "Batching settings in effect (tunable at run time)",
            ["setting"],
            registry=r,
        )
        self.instructions_ignored = Counter(
            "chatts_instructions_ignored",
            "Speech requests whose free-text instructions were not applied (answered all the same)",
            registry=r,
        )
        self.auth_failures = Counter(
            "chatts_auth_failures", "Requests refused for a missing or wrong API key", registry=r
        )
        self.cache_bytes = Gauge("chatts_cache_bytes", "Bytes of audio in the cache", registry=r)
        self.requests_total = Counter(
            "chatts_requests", "Answered speech requests", ["status"], registry=r
        )
        self.cache_hits = Counter(
            "chatts_cache_hits", "Requests answered from the audio cache", registry=r
        )
        self.cache_misses = Counter(
            "chatts_cache_misses", "Requests the cache could not answer", registry=r
        )
        self.audio_seconds = Counter("chatts_audio_seconds", "Seconds of audio served", registry=r)
        self.queue_depth = Gauge(
            "chatts_queue_depth", "Requests waiting for or running inference", registry=r
        )
        self.cache_entries = Gauge("chatts_cache_entries", "Entries in the audio cache", registry=r)
        self.ready = Gauge("chatts_ready", "1 once the model is loaded and warmed up", registry=r)
        self.cpu_percent = Gauge(
            "chatts_cpu_percent",
            "Process CPU use since the previous scrape, % of its CPUs",
            registry=r,
        )
        self.step_duration = Histogram(
            "chatts_step_duration_seconds",
            "Time of one batched GPT decode step",
            buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 1),
            registry=r,
        )
        self.batch_rows = Histogram(
            "chatts_batch_rows",
            "Sequences in a decode step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.prefill_duration = Histogram(
            "chatts_prefill_duration_seconds",
            "One prompt's prefill and first token (every row in the batch waits for it)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8),
            registry=r,
        )
        self.prefill_positions = Counter(
            "chatts_prefill_positions_total",
            "Prompt positions prefilled (those copied from a kept beginning too)",
            registry=r,
        )
        self.audio_decode = Histogram(
            "chatts_audio_decode_seconds",
            "One round of audio decoding between two steps (every chunk and segment asked for)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6),
            registry=r,
        )
        self.audio_decode_items = Counter(
            "chatts_audio_decode_items_total",
            "Chunks and segments decoded into audio",
            registry=r,
        )
        self._longest_stall = 0.0
        self._cpu = CpuSampler()
        self.cpu_percent.set_function(self._cpu.percent)
        r.register(HeapCollector())
        self.prompt_prefixes = PrefixCollector()
        r.register(self.prompt_prefixes)
        self.connections = ConnectionCollector()
        r.register(self.connections)
        self.kernels = KernelsCollector()
        r.register(self.kernels)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.step_duration.observe(seconds)
        self.batch_rows.observe(rows)

    def observe_prefill(self, positions: int, seconds: float) -> None:
        self.prefill_duration.observe(seconds)
        self.prefill_positions.inc(positions)

    def observe_stall(self, seconds: float) -> None:
        self.stall.observe(seconds)
        if seconds > self._longest_stall:
            self._longest_stall = seconds
            self.longest_stall.set(seconds)

    def observe_admitted(self, priority: str, seconds: float) -> None:
        self.queue_wait.labels(priority=priority).observe(seconds)

    def observe_taken_back(self, priority: str) -> None:
        self.rows_taken_back.labels(priority=priority).inc()

    def observe_decode(self, items: int, seconds: float) -> None:
        self.audio_decode.observe(seconds)
        self.audio_decode_items.inc(items)

    def render(self) -> bytes:
        return generate_latest(self.registry)
