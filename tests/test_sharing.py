"""How the box shares itself: the policy's rules, then the engine under a long text and streams
(the tiny model; steps forced with ``fixed_steps``, so every request is as long as set)."""

import threading
import time

import pytest
import requests
from engines import engine_on

from chattts_service.domain.speech import BULK, INTERACTIVE, SynthesisRequest
from chattts_service.inference import scheduler as scheduler_module
from chattts_service.inference.fairness import (
    SHORT_WHOLE_SEGMENTS,
    Share,
    next_share,
    segment_priority,
    victim,
)

LONG_TEXT = "".join(f"第{i}句话讲了一件很长的事情，大家都在听。" for i in range(1, 9))


def share(priority, request, index=0, tenant=None, arrival=0):
    return Share(priority, tenant, request, index, arrival)


# -- the rules -----------------------------------------------------------------------------------


def test_a_segments_class_follows_its_request():
    assert segment_priority(None, stream=True, segments=30) == INTERACTIVE
    assert segment_priority(None, stream=False, segments=1) == INTERACTIVE
    assert segment_priority(None, stream=False, segments=SHORT_WHOLE_SEGMENTS) == INTERACTIVE
    assert segment_priority(None, stream=False, segments=SHORT_WHOLE_SEGMENTS + 1) == BULK
    assert segment_priority(BULK, stream=True, segments=1) == BULK
    assert segment_priority(INTERACTIVE, stream=False, segments=30) == INTERACTIVE


def test_interactive_goes_first_then_the_request_holding_fewest_rows():
    running = [share(BULK, 1, 1), share(BULK, 1, 2), share(BULK, 2, 1)]
    waiting = [
        share(BULK, 1, 3, arrival=0),
        share(BULK, 2, 2, arrival=1),
        share(INTERACTIVE, 3, 0, arrival=2),
    ]
    assert next_share(waiting, running, bulk_min_rows=1, free_rows=2) == 2
    del waiting[2]
    assert next_share(waiting, running, bulk_min_rows=1, free_rows=2) == 1  # 2 holds fewer
    # with keys, the key holding the fewest rows goes first, whatever its requests hold
    keyed_running = [share(BULK, 1, 1, "a"), share(BULK, 2, 1, "b"), share(BULK, 3, 1, "b")]
    keyed_waiting = [share(BULK, 2, 2, "b", 0), share(BULK, 1, 2, "a", 1)]
    assert next_share(keyed_waiting, keyed_running, bulk_min_rows=0, free_rows=1) == 1


def test_the_rows_bulk_is_short_of_its_floor_are_kept_for_it():
    waiting = [share(INTERACTIVE, 1), share(BULK, 2, 1, arrival=1)]
    # the last free row: bulk holds none of its one
    assert next_share(waiting, [share(INTERACTIVE, 3)], bulk_min_rows=1, free_rows=1) == 1
    # rows to spare: interactive first
    assert next_share(waiting, [share(INTERACTIVE, 3)], bulk_min_rows=1, free_rows=2) == 0
    # bulk holds its floor already
    assert next_share(waiting, [share(BULK, 2, 0)], bulk_min_rows=1, free_rows=1) == 0


def test_a_waiting_segment_takes_back_the_row_it_outranks_and_no_other():
    running = [share(BULK, 1, 1, arrival=0), share(BULK, 1, 2, arrival=1)]
    # interactive over bulk: the latest segment of the request holding most rows
    assert victim(share(INTERACTIVE, 2), running, bulk_min_rows=1) == 1
    # never below the bulk floor
    assert victim(share(INTERACTIVE, 2), running[:1], bulk_min_rows=1) is None
    # bulk over bulk only where the holder has two rows more
    assert victim(share(BULK, 2, 1), running, bulk_min_rows=0) == 1
    assert victim(share(BULK, 2, 1), running[:1], bulk_min_rows=0) is None
    # interactive never loses its row to bulk
    assert victim(share(BULK, 2, 1), [share(INTERACTIVE, 1)], bulk_min_rows=5) is None


# -- the engine ----------------------------------------------------------------------------------


class Timeline:
    """When each step ran and how many rows it had, from the scheduler's observer."""

    def __init__(self, engine):
        self.steps: list[tuple[float, int]] = []
        engine.scheduler._on_step = lambda rows, seconds: self.steps.append(
            (time.perf_counter(), rows)
        )


def test_a_stream_sent_while_a_long_text_runs_hears_itself_before_the_next_segment_ends(
    tiny_endless_model_dir,
):
    """A long whole text's segments hold every row; a one-segment stream sent then takes a
    row back at once and its first audio comes before any of the long text's segments
    finishes. The paused segment resumes where it was: the long text's audio is the audio it
    has alone."""
    with engine_on(tiny_endless_model_dir, max_batch=2, max_segment_chars=40) as engine:
        request = SynthesisRequest(LONG_TEXT, seed=5)
        assert len(engine.segments(request)) >= 4
        alone = engine.start(request, fixed_steps=120).result(120)

        long_run = engine.start(request, fixed_steps=120)
        finished_at: list[float] = []
        for job in long_run.jobs:
            job.future.add_done_callback(lambda _: finished_at.append(time.perf_counter()))
        deadline = time.monotonic() + 30
        while len(engine.scheduler.batch) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(engine.scheduler.batch) == 2 and not finished_at
        sent = time.perf_counter()
        stream = engine.start(SynthesisRequest("你好。", seed=9), fixed_steps=80, stream=True)
        chunks = stream.chunks(timeout=60)
        next(chunks)
        first_audio = time.perf_counter()
        rest = list(chunks)
        mixed = long_run.result(120)

    assert engine.scheduler.preempted >= 1
    assert not [at for at in finished_at if sent < at < first_audio], (
        "a long-text segment finished before the stream's first audio"
    )
    assert rest is not None
    assert mixed.audio.tobytes() == alone.audio.tobytes()


def test_bulk_keeps_its_floor_and_finishes_under_a_steady_flow_of_streams(tiny_endless_model_dir):
    """Streams sent back to back, two at a time, never let a long text marked bulk stop: it
    keeps its one row and finishes while they still come."""
    with engine_on(tiny_endless_model_dir, max_batch=2, bulk_min_rows=1) as engine:
        rows_of: dict = {}
        bulk = engine.start(SynthesisRequest(LONG_TEXT, seed=2), fixed_steps=60, priority=BULK)
        for job in bulk.jobs:
            rows_of[job] = job
        stop = threading.Event()
        streams_done = []

        def listener(seed: int) -> None:
            while not stop.is_set() and len(streams_done) < 200:
                run = engine.start(
                    SynthesisRequest("你好。", seed=seed), fixed_steps=30, stream=True
                )
                list(run.chunks(timeout=60))
                streams_done.append(seed)

        threads = [threading.Thread(target=listener, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        try:
            result = bulk.result(120)
            streams_while_bulk = len(streams_done)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
    assert result.segments == len(bulk.jobs) and result.steps == 60 * len(bulk.jobs)
    assert streams_while_bulk >= 2, "the streams did not run beside the bulk text"


def test_a_long_prompt_is_prefilled_in_pieces_between_steps(tiny_endless_model_dir, monkeypatch):
    """A prompt that arrives while rows step (here a whole answer's: nobody listens to it,
    yet it waits) is prefilled a piece at a time, never more positions than its piece's limit
    (the stall budget at the measured pace), with steps of the running row between the
    pieces; with no rows stepping, a prompt is prefilled whole."""
    monkeypatch.setattr(scheduler_module, "MIN_PIECE", 4)
    with engine_on(
        tiny_endless_model_dir, max_batch=2, max_segment_chars=500, stall_budget_ms=5
    ) as engine:
        batch = engine.scheduler.batch
        events: list = []
        fill = batch.fill

        def recording_fill(sequence, limit=None):
            stepping = len(batch.active)
            positions = fill(sequence, limit)
            # a piece on this tiny model takes microseconds: make it take what a full-size
            # one does (~0.5 ms a position), so the budget holds few positions
            time.sleep(0.0005 * positions)
            events.append(("fill", stepping, limit, positions))
            return positions

        monkeypatch.setattr(batch, "fill", recording_fill)
        engine.scheduler._on_step = lambda rows, seconds: events.append(("step", rows))
        # its text normalised first (by the normalising worker, which may still be starting;
        # the segments are kept): the running row must not end while it waits for them
        long_request = SynthesisRequest(LONG_TEXT * 2, seed=3)
        engine.segments(long_request)
        running = engine.start(SynthesisRequest("你好。", seed=1), fixed_steps=400)
        deadline = time.monotonic() + 60
        while not any(event[0] == "step" for event in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        long = engine.start(long_request, fixed_steps=4)
        assert len(long.jobs) == 1
        long.result(60)
        running.cancel()

    alone = [event for event in events if event[0] == "fill" and event[1] == 0]
    assert alone and all(limit is None for _, _, limit, _ in alone)
    # by position, not by value: pieces of the same size are equal tuples
    at = [i for i, event in enumerate(events) if event[0] == "fill" and event[1] > 0]
    beside = [events[i] for i in at]
    assert len(beside) >= 3, beside
    assert all(limit is not None and 0 < positions <= limit for _, _, limit, positions in beside)
    assert any(event[0] == "step" for event in events[at[0] : at[-1]])


def test_a_stream_arriving_with_a_long_text_steps_before_bulk_prompts_go_in_whole(
    tiny_endless_model_dir, monkeypatch
):
    """A long text's segments and a stream come in one admission with nothing stepping: the
    stream's prompt goes in first and whole; once its row can step, the bulk prompts beside
    it go in pieces (the stream waits on them), and bulk holds no more rows at the stream's
    first step than ``bulk_rows_while_starting``, though it arrived first."""
    monkeypatch.setattr(scheduler_module, "MIN_PIECE", 4)
    with engine_on(
        tiny_endless_model_dir,
        max_batch=8,
        max_segment_chars=60,
        stall_budget_ms=5,
        batch_wait_ms=500,  # both arrive before the scheduler admits either
        bulk_rows_while_starting=1,
    ) as engine:
        scheduler = engine.scheduler
        batch = scheduler.batch
        fills: list[tuple[str, int | None, bool]] = []  # (class, limit, a stream row ready)
        first_step: list[int] = []  # bulk's rows (stepping or filling) at the stream's first
        fill = batch.fill

        def slow_fill(sequence, limit=None):
            ready = any(_is_stream_row(scheduler, other) for other in batch.active)
            positions = fill(sequence, limit)
            time.sleep(0.0005 * positions)  # a full-size model's pace: the budget holds few
            fills.append((scheduler._shares[scheduler._owners[sequence]].priority, limit, ready))
            return positions

        def observe(rows, seconds):
            jobs = [scheduler._owners[sequence] for sequence in batch.active]
            if stream_jobs and stream_jobs[0] in jobs and not first_step:
                holding = [scheduler._owners[s] for s in (*batch.active, *batch.filling)]
                first_step.append(sum(scheduler._shares[job].priority == BULK for job in holding))

        stream_jobs: list = []
        monkeypatch.setattr(batch, "fill", slow_fill)
        scheduler._on_step = observe
        long_request = SynthesisRequest(LONG_TEXT, seed=5)
        assert len(engine.segments(long_request)) >= 3  # normalised (and kept) beforehand
        bulk_run = engine.start(long_request, fixed_steps=30, priority=BULK)
        stream = engine.start(SynthesisRequest("你好。", seed=9), fixed_steps=30, stream=True)
        stream_jobs.append(stream.jobs[0])
        list(stream.chunks(timeout=60))
        bulk_run.result(60)

    assert fills[0][:2] == (INTERACTIVE, None), fills  # the stream's prompt first, whole
    beside = [(limit, ready) for priority, limit, ready in fills if priority == BULK and ready]
    assert beside, fills
    assert all(limit is not None for limit, _ in beside), fills
    assert first_step == [1], first_step


def _is_stream_row(scheduler, sequence) -> bool:
    job = scheduler._owners.get(sequence)
    return job is not None and scheduler._shares[job].priority == INTERACTIVE


def test_rows_paused_for_a_starting_stream_resume_once_no_row_steps(
    tiny_endless_model_dir, monkeypatch
):
    """Bulk holds 3 rows when a stream with a long prompt starts: bulk keeps one
    (``bulk_rows_while_starting``), the others paused, while the prompt goes in pieces. When
    that row's segment ends before the prompt is in, a paused row resumes at once (resuming
    costs nothing) rather than wait through the prompt's pieces with nothing stepping."""
    monkeypatch.setattr(scheduler_module, "MIN_PIECE", 4)
    with engine_on(
        tiny_endless_model_dir,
        max_batch=4,
        max_segment_chars=400,
        stall_budget_ms=5,
        bulk_rows_while_starting=1,
    ) as engine:
        scheduler = engine.scheduler
        batch = scheduler.batch
        pieces: list[tuple[int, int]] = []  # (rows stepping, rows paused) at every piece
        steps = [0]
        midway = threading.Event()
        fill, step = batch.fill, batch.step

        def slow_fill(sequence, limit=None):
            positions = fill(sequence, limit)
            time.sleep(0.001 * positions)  # slower than a full-size model: many pieces
            if limit is not None:
                paused = sum(other.cache is not None for _, other in scheduler._waiting)
                pieces.append((len(batch.active), paused))
            return positions

        def slow_step():
            time.sleep(0.002)
            steps[0] += len(batch.active) == 3
            if steps[0] == 40:
                midway.set()
            return step()

        monkeypatch.setattr(batch, "fill", slow_fill)
        monkeypatch.setattr(batch, "step", slow_step)
        bulk_run = engine.start(
            SynthesisRequest(LONG_TEXT * 6, seed=5), fixed_steps=100, priority=BULK
        )
        assert len(bulk_run.jobs) == 3
        assert midway.wait(60)  # bulk's 3 rows have 60 steps to go
        stream = engine.start(SynthesisRequest(LONG_TEXT * 2, seed=9), fixed_steps=20, stream=True)
        assert len(stream.jobs) == 1
        list(stream.chunks(timeout=60))
        bulk_run.result(120)

    gave_up = [i for i, (_, paused) in enumerate(pieces) if paused == 2]
    assert gave_up, pieces  # bulk gave 2 rows up for the stream
    # the row bulk kept ended while the prompt went in: the paused ones took their turns
    assert any(paused < 2 for _, paused in pieces[gave_up[0] :]), pieces
    assert not [piece for piece in pieces if piece[0] == 0 and piece[1]], pieces


@pytest.mark.parametrize("priority", [None, BULK])
def test_queue_wait_is_observed_per_class(tiny_model_dir, priority):
    """Unmarked, a whole answer of two segments is interactive and a longer one bulk, all its
    segments; marked bulk, both are bulk."""
    short_text = "今天的天气很好。明天也会很好的。"
    waits: list = []
    with engine_on(tiny_model_dir, max_segment_chars=10) as engine:
        assert len(engine.segments(SynthesisRequest(short_text, seed=4))) == SHORT_WHOLE_SEGMENTS
        assert len(engine.segments(SynthesisRequest(LONG_TEXT, seed=4))) > SHORT_WHOLE_SEGMENTS
        engine.scheduler._on_admitted = lambda cls, seconds: waits.append((cls, seconds))
        for text in (short_text, LONG_TEXT):
            run = engine.start(SynthesisRequest(text, seed=4), fixed_steps=3, priority=priority)
            run.result(60)
    classes = [cls for cls, _ in waits]
    short, long = classes[:SHORT_WHOLE_SEGMENTS], classes[SHORT_WHOLE_SEGMENTS:]
    assert set(short) == {INTERACTIVE if priority is None else BULK}
    assert len(long) > SHORT_WHOLE_SEGMENTS and set(long) == {BULK}
    assert all(seconds >= 0 for _, seconds in waits)


# -- over HTTP -----------------------------------------------------------------------------------


def _metric(server, line_start: str) -> float:
    for line in requests.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


def test_requests_mark_bulk_by_field_or_header_and_the_metrics_say_per_class(
    start_server, tiny_endless_model_dir
):
    server = start_server(tiny_endless_model_dir, CHATTTS_MAX_NEW_TOKENS="300")
    server.wait_ready()
    speech = server.url + "/v1/audio/speech"
    body = {"model": "tts-1", "voice": "alloy", "input": "你好。", "response_format": "pcm"}
    # OpenAI's endpoint streams by default, and sends audio before the segment is generated:
    # pieces arrive as they are decoded, not the segment's whole audio at its end
    with requests.post(speech, json=body, stream=True, timeout=60) as response:
        assert response.status_code == 200
        pieces = [piece for piece in response.iter_content(chunk_size=None) if piece]
    whole = requests.post(speech, json={**body, "stream": False}, timeout=60)
    assert whole.headers["X-Cache"] == "HIT"  # the stream was whole: it filled the cache
    assert len(pieces) >= 2 and b"".join(pieces) == whole.content
    bulk = requests.post(speech, json={**body, "priority": "bulk", "seed": 2}, timeout=60)
    marked = requests.post(
        speech, json={**body, "seed": 3}, headers={"X-Priority": "bulk"}, timeout=60
    )
    assert bulk.status_code == marked.status_code == 200
    assert _metric(server, 'chatts_first_audio_seconds_count{priority="bulk"}') == 2
    assert _metric(server, 'chatts_first_audio_seconds_count{priority="interactive"}') == 1
    assert _metric(server, 'chatts_queue_wait_seconds_count{priority="bulk"}') == 2
    assert _metric(server, "chatts_scheduler_stall_max_seconds") >= 0
    wrong = requests.post(speech, json={**body, "priority": "urgent"}, timeout=10)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "priority"
    header = requests.post(speech, json=body, headers={"X-Priority": "urgent"}, timeout=10)
    assert header.status_code == 400 and "X-Priority" in header.json()["error"]["message"]
    marked_whole = requests.post(
        server.url + "/synthesize",
        json={"text": "你好。", "priority": "bulk", "seed": 4},
        timeout=60,
    )
    assert marked_whole.status_code == 200
    assert marked_whole.headers["Content-Type"].startswith("audio/wav")


def _bulk_rows_beside_a_stream(model_dir, mark, listen, bulk_steps: int, stream_steps: int):
    """Bulk filling 4 rows (``bulk_rows_while_starting`` 1), then a stream: at every step the
    stream takes, ``(mark(stream_job), bulk rows)`` where ``mark`` gives something (not
    None); ``listen(scheduler, stream_job, chunks, seen)`` reads the stream's chunks."""
    with engine_on(
        model_dir, max_batch=4, max_segment_chars=40, bulk_rows_while_starting=1
    ) as engine:
        scheduler = engine.scheduler
        seen: list[tuple[bool, int]] = []

        def observe(rows, seconds):
            jobs = [scheduler._owners[sequence] for sequence in scheduler.batch.active]
            marked = mark(stream_job)
            if stream_job in jobs and marked is not None:
                bulk = sum(scheduler._shares[job].priority == BULK for job in jobs)
                seen.append((marked, bulk))

        bulk_run = engine.start(
            SynthesisRequest(LONG_TEXT, seed=5), fixed_steps=bulk_steps, priority=BULK
        )
        deadline = time.monotonic() + 30
        while len(scheduler.batch) < 4 and time.monotonic() < deadline:
            time.sleep(0.005)
        stream = engine.start(
            SynthesisRequest("你好。", seed=9), fixed_steps=stream_steps, stream=True
        )
        stream_job = stream.jobs[0]
        scheduler._on_step = observe
        listen(scheduler, stream_job, stream.chunks(timeout=60), seen)
        bulk_run.result(120)
    return seen


def test_bulk_gives_up_rows_while_a_stream_waits_for_its_first_audio(tiny_endless_model_dir):
    """While a stream waits for its first audio, bulk holds at most
    ``bulk_rows_while_starting`` rows (its steps are slower with every row); once the stream
    has sent audio, bulk takes its rows back."""
    seen = _bulk_rows_beside_a_stream(
        tiny_endless_model_dir,
        lambda job: job.slack() is None,
        lambda scheduler, job, chunks, seen: list(chunks),
        bulk_steps=200,
        stream_steps=150,
    )
    starting = [bulk for waiting, bulk in seen if waiting]
    playing = [bulk for waiting, bulk in seen if not waiting]
    assert starting and max(starting) == 1
    assert playing and max(playing) == 3  # every row the stream left


def test_bulk_gives_up_rows_while_a_streams_listener_runs_short(tiny_endless_model_dir):
    """A stream whose listener holds less than its low water by ``SHORT_SECONDS`` (here: its
    listener made to have played everything, as on a box too busy for it) gets the rows a
    starting stream gets: bulk holds at most ``bulk_rows_while_starting`` until the stream's
    next chunk, then takes its rows back."""
    from chattts_service.inference.scheduler import SHORT_SECONDS

    def short(job):  # None before its first audio: the steps it plays through
        slack = job.slack()
        return None if slack is None else slack < -SHORT_SECONDS

    def listen(scheduler, job, chunks, seen):
        def run_dry():
            job._runs_out = time.monotonic() - 5.0

        next(chunks)  # its first audio: bulk has its rows back
        deadline = time.monotonic() + 30
        while not any(bulk == 3 for _, bulk in seen) and time.monotonic() < deadline:
            time.sleep(0.005)
        scheduler.call(run_dry).result(10)
        list(chunks)

    seen = _bulk_rows_beside_a_stream(
        tiny_endless_model_dir, short, listen, bulk_steps=300, stream_steps=200
    )
    running_short = [bulk for is_short, bulk in seen if is_short]
    healthy = [bulk for is_short, bulk in seen if not is_short]
    assert running_short and max(running_short) == 1
    assert healthy and max(healthy) == 3


def test_a_stream_a_segment_at_a_time_sends_each_segments_whole_audio(tiny_model_dir):
    """``CHATTTS_DEFAULT_STREAM=segments``: a stream nobody asked for gets one piece per
    segment, each the whole answer's segment."""
    with engine_on(tiny_model_dir) as engine:
        request = SynthesisRequest(LONG_TEXT, seed=8)
        whole = engine.start(request, fixed_steps=20).result(60)
        pieces = list(engine.start(request, fixed_steps=20, stream=True, early=False).chunks(60))
    segments = whole.segments
    assert len(pieces) == 2 * segments - 1  # each segment's audio, the pauses between them
    assert b"".join(piece.tobytes() for piece in pieces) == whole.audio.tobytes()
