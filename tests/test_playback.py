"""How far a stream falls behind a listener playing it from its first audio."""

import pytest

from chattts_service.domain.playback import Playback


def _behind(arrivals):
    playback = Playback()
    for now, seconds in arrivals:
        playback.arrived(now, seconds)
    return playback


def test_a_stream_that_keeps_ahead_of_its_listener_is_not_behind():
    playback = _behind([(10.0, 1.0), (10.5, 1.0), (11.9, 2.0), (13.0, 0.5)])
    assert (playback.first, playback.audio, playback.behind) == (10.0, 4.5, 0.0)


def test_behind_is_the_time_the_listener_waited_in_all():
    # 1 s of audio at 0; the next at 1.5 (the listener waits 0.5 s); at 2.0 it has 2 s for the
    # 2 s passed; at 4.0 the next, 1 s after its 3 s ran out: waited 0.5 + 0.5 = 1.0 s
    arrivals = [(0.0, 1.0), (1.5, 1.0), (2.0, 1.0), (4.0, 0.5)]
    assert _behind(arrivals).behind == pytest.approx(1.0)
    # the same as summing each wait of a listener who pauses while nothing is there
    clock, waited = arrivals[0][0], 0.0
    for now, seconds in arrivals:
        waited += max(0.0, now - clock)
        clock = max(clock, now) + seconds
    assert _behind(arrivals).behind == pytest.approx(waited)


def test_nothing_yet_and_a_single_piece():
    assert (Playback().first, Playback().behind) == (None, 0.0)
    assert _behind([(5.0, 3.0)]).behind == 0.0
