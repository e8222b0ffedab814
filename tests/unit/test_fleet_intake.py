"""The fleet reader's intake on untrusted messages, without a server: whatever arrives,
it never raises, releases every message exactly once, and hands out no more events
than the message holds, a chunk at a time."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aperf
from aperf.fleet import FleetEvent
from aperf.fleet._intake import Delivery, Intake, Limits
from aperf.fleet._wire import Framer

DECODER = aperf.decoders.from_struct("<QQ", "seq ts")


def messages() -> list[bytes]:
    framer = Framer("web-1", "exec", 42, max_events=8, max_bytes=100_000, key=b"k" * 32)
    error = aperf.DecodeError(1, b"xy", "too short")
    events: list[Any] = [aperf.Sample(c % 3, bytes([c]) * (c % 20)) for c in range(20)]
    events[5:5] = [aperf.Lost(2, 9), aperf.BadSample(1, b"xy", error)]
    outs = framer.frame(events, 0)
    return [out.payload for out in outs] + [framer.dropped(outs[0]), framer.end()]


VALID = messages()


def drain(intake: Intake, n: int) -> list[FleetEvent]:
    out: list[FleetEvent] = []
    while batch := intake.hand(n):
        assert len(batch) <= n
        out += batch
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(range(len(VALID))),
            st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
            st.sampled_from(["aperf.web-1.exec", "aperf.web-2.exec", "other"]),
        ),
        min_size=1, max_size=12,
    ),
    st.sampled_from([None, DECODER]),
    st.sampled_from([1, 3, 1000]),
)
def test_whatever_arrives_every_message_is_released_once_and_nothing_raises(
    plan: list[tuple[int, list[tuple[int, int]], str]], decoder: Any, n: int,
) -> None:
    intake = Intake(prefix="aperf", decoder=decoder,
                    limits=Limits(runs_per_stream=2, runs=3, ranges_per_run=2, ranges=4,
                                  chunk=4))
    released: list[int] = []
    for handle, (which, flips, subject) in enumerate(plan):
        data = bytearray(VALID[which])
        for where, value in flips:
            data[where % len(data)] = value
        assert not intake.busy
        intake.accept(Delivery(subject, bytes(data), None, handle + 1, 1, handle))
        drain(intake, n)
        released += intake.released()
        intake.settle(None)
        drain(intake, n)
        released += intake.released()
    assert released == list(range(len(plan)))
    counts = intake.counts
    assert counts.messages == len(plan) and intake.runs <= 3
