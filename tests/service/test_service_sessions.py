"""The browser sessions of the service (examples/service/access.py ``Sessions``), on a fake clock.

No kernel, no server: ``tests/service/test_service_access.py`` and the page's test in Chromium check
the same on the real service; here every rule is checked at its exact edges.
"""

from __future__ import annotations

import pytest

from examples.service.access import KEPT_IDS, Sessions

from ..helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


def test_an_id_is_replaced_after_rotate_and_the_old_one_kept_for_the_grace(
    clock: FakeClock,
) -> None:
    sessions = Sessions(60, grace=5, clock=clock)
    first = sessions.open()
    assert len(first) >= 40
    clock.now += 59.9
    assert sessions.check(first) == (True, None)
    clock.now += 0.1
    ok, second = sessions.check(first)
    assert ok and second is not None and second != first
    clock.now += 4.9
    assert sessions.check(first) == (True, None)  # a request already under way
    assert sessions.check(second) == (True, None)
    assert len(sessions) == 1


def test_a_replaced_id_used_after_the_grace_ends_the_session_for_both(clock: FakeClock) -> None:
    sessions = Sessions(60, grace=5, clock=clock)
    copied = sessions.open()
    clock.now += 60
    _, kept = sessions.check(copied)  # the page moves on; a copy stays behind
    assert kept is not None
    clock.now += 5
    assert sessions.check(copied) == (False, None)
    assert sessions.check(kept) == (False, None)
    assert len(sessions) == 0 and sessions.ended["replayed"] == 1


def test_the_thief_moving_on_first_ends_the_session_too(clock: FakeClock) -> None:
    sessions = Sessions(60, grace=5, clock=clock)
    page = sessions.open()
    clock.now += 61
    _, thief = sessions.check(page)  # the copy's holder asks first and gets the new id
    assert thief is not None
    for _ in range(3):
        clock.now += 61
        _, renewed = sessions.check(thief)
        assert renewed is not None
        thief = renewed
    assert sessions.check(page) == (False, None)  # the page shows the old one again
    assert sessions.check(thief) == (False, None)


def test_an_id_unused_for_twice_rotate_is_dead(clock: FakeClock) -> None:
    sessions = Sessions(60, clock=clock)
    idle = sessions.open()
    clock.now += 119.9
    assert sessions.check(idle)[0]  # replaced now
    closed_page = sessions.open()
    clock.now += 120
    assert sessions.check(closed_page) == (False, None)
    assert sessions.ended["expired"] == 1


def test_a_session_ends_at_max_age_whatever_its_use(clock: FakeClock) -> None:
    sessions = Sessions(60, max_age=600, clock=clock)
    current = sessions.open()
    while clock.now + 59 < 1000 + 600:
        clock.now += 59
        ok, renewed = sessions.check(current)
        assert ok
        current = renewed or current
    clock.now = 1600
    assert sessions.check(current) == (False, None)


def test_sessions_and_ids_are_bounded(clock: FakeClock) -> None:
    sessions = Sessions(60, max_sessions=3, clock=clock)
    ids = [sessions.open() for _ in range(4)]
    assert len(sessions) == 3 and sessions.ended["dropped"] == 1
    assert not sessions.check(ids[0])[0] and sessions.check(ids[3])[0]
    # A session knows its last KEPT_IDS ids; an older one is merely unknown (refused).
    chain = [ids[3]]
    for _ in range(KEPT_IDS + 2):
        clock.now += 60
        _, renewed = sessions.check(chain[-1])
        assert renewed is not None
        chain.append(renewed)
    assert sessions.check(chain[0]) == (False, None)
    assert sessions.check(chain[-1]) == (True, None)  # the session goes on
    # Sessions whose page closed long ago go at the next open().
    clock.now += 1000
    sessions.open()
    assert len(sessions) == 1


def test_unknown_and_empty_ids_are_refused(clock: FakeClock) -> None:
    sessions = Sessions(60, clock=clock)
    sessions.open()
    for given in (None, "", "x" * 43):
        assert sessions.check(given) == (False, None)
    with pytest.raises(ValueError, match="positive"):
        Sessions(0)
