"""The fleet reader's intake on untrusted messages, without a server: whatever arrives,
it never raises, releases every message exactly once, and hands out no more events
than the message holds, a chunk at a time."""

from __future__ import annotations

import contextlib
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


def test_samples_are_built_as_a_stream_builds_them_and_a_bad_one_costs_only_itself() -> None:
    # The intake builds with the core's EventBuilder, per run of one CPU: values decoded
    # at C speed, a sample its decoder refuses a BadSample (no traceback kept: the bytes
    # came from the network), in order, whichever way the events are taken.
    def build(row: tuple[int, int]) -> tuple[int, int]:
        if row[0] == 13:
            raise ValueError("thirteen")
        return row

    decoder = aperf.decoders.SizedDecoder("seq ts", DECODER.struct, build)
    framer = Framer("web-1", "exec", 42, max_events=64, max_bytes=100_000, key=b"k" * 32)
    # Three runs of CPUs, and samples of two lengths (a tail past the 16 bytes decoded).
    events = [aperf.Sample(i // 7, DECODER.struct.pack(i, 2 * i) + b"t" * 8 * (i % 2))
              for i in range(20)]
    [out] = framer.frame(events, 0)

    def taken(how: str) -> tuple[list[Any], list[int]]:
        intake = Intake(prefix="aperf", decoder=decoder, limits=Limits(chunk=6))
        intake.accept(Delivery("aperf.web-1.exec", out.payload, None, 1, 1, "m1"))
        got: list[Any] = []
        released = []
        while True:
            if how == "hand":
                batch = intake.hand(4)
            else:
                batch = []
                with contextlib.suppress(IndexError):
                    batch = [intake.next_event()]
                if not batch and intake.fill():
                    batch = [intake.next_event()]
            released += intake.released()
            if not batch:
                break
            got += [event for _, _, event in batch]
        assert intake.counts.bad == 1 and intake.counts.samples == 20
        return got, released

    got, released = taken("hand")
    assert released == ["m1"]
    assert [e.cpu for e in got] == [i // 7 for i in range(20)]
    assert [e.data for e in got] == [e.data for e in events]
    assert [getattr(e, "value", None) for e in got] == [
        None if i == 13 else (i, 2 * i) for i in range(20)]
    bad = got[13]
    assert isinstance(bad, aperf.BadSample) and "thirteen" in str(bad.error)
    assert bad.error.__cause__ is None and bad.error.__traceback__ is None
    again, released_again = taken("next_event")  # errors are equal only to themselves
    assert [(type(e), e.cpu, e.data, str(e[2])) for e in again] == [
        (type(e), e.cpu, e.data, str(e[2])) for e in got] and released_again == released
