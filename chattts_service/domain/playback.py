"""How a listener hears a stream: playing from its first audio, pausing when the audio runs out.

The service's ``chatts_stream_behind_seconds`` (from when it hands each chunk over) and
``bench.py``'s streams (from when each piece arrives) measure the same thing this way: how far
a stream fell behind such a listener, which is the time the listener spent waiting in all;
``waits`` splits that time by chunk (``benchmarks/streams.py`` reports where it falls).
"""

from __future__ import annotations


class Playback:
    """Feed it each piece of a stream as it comes (``arrived``); ``behind`` is then how far
    the stream fell behind a player that started at its first piece: at any moment the player
    has needed as much audio as time has passed since then, and ``behind`` is the most that it
    needed beyond what had come (0 for a stream that always came ahead of its playback)."""

    def __init__(self) -> None:
        self.first: float | None = None  # when the first piece came
        self.audio = 0.0  # seconds of audio that have come
        self.behind = 0.0

    def arrived(self, now: float, seconds: float) -> None:
        """A piece of ``seconds`` of audio came at ``now`` (a monotonic clock's seconds)."""
        if self.first is None:
            self.first = now
        else:
            self.behind = max(self.behind, (now - self.first) - self.audio)
        self.audio += seconds


def waits(arrivals: list[tuple[float, float]]) -> list[float]:
    """Seconds the same listener waits for each chunk (their sum is ``Playback.behind``):
    ``arrivals`` are each chunk's (arrival time, seconds of audio)."""
    clock, waited = arrivals[0][0], []
    for arrived, seconds in arrivals:
        waited.append(max(0.0, arrived - clock))
        clock = max(clock, arrived) + seconds
    return waited
