"""How far a stream falls behind a listener playing it from its first audio."""

import pytest

from chattts_service.domain.playback import Playback, waits


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
    assert _behind(arrivals).behind == pytest.approx(sum(waits(arrivals)))


def test_nothing_yet_and_a_single_piece():
    assert (Playback().first, Playback().behind) == (None, 0.0)
    assert _behind([(5.0, 3.0)]).behind == 0.0


def test_waits_split_a_listeners_waits_by_chunk():
    # (arrival, seconds of audio): the player starts at 1.0 with 0.25 s, runs dry at 1.25 and
    # waits 0.25 s for the second chunk; the third arrives while the second plays (to 2.0);
    # the fourth arrives 0.5 s after the third ran out (2.5)
    arrivals = [(1.0, 0.25), (1.5, 0.5), (1.75, 0.5), (3.0, 1.0)]
    assert waits(arrivals) == [0.0, 0.5 - 0.25, 0.0, 0.5]
    assert sum(waits(arrivals)) == 0.75
