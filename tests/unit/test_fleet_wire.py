"""The fleet wire decoder on untrusted bytes: random bytes, mutated valid messages and
forged counts parse or raise FrameError (nothing else), and never cost more than a
small multiple of the message's size (tracemalloc's peak)."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aperf
from aperf.fleet import FrameError, Gap
from aperf.fleet._wire import (
    DROPPED,
    END,
    HEADER,
    MAGIC,
    SAMPLES,
    Framer,
    commit,
    parse,
)

FACTOR = 64  # the most a message may cost, in multiples of its size
SLACK = 2048  # bytes of fixed cost: the Frame, its lists, an exception and its message
V1_HEADER = struct.Struct("<4sBBBxQQQQQII")  # wire version 1, for the old-version checks


def peak_of(work: Callable[[], Any]) -> int:
    """The peak of memory traced while ``work`` runs (its result dropped)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with contextlib.suppress(FrameError):
            work()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def claim(count: int, run: int, *, runs: int = 1, kind: int = SAMPLES) -> bytes:
    """A samples header claiming ``count`` samples, then one run of ``run``: 82 bytes."""
    header = HEADER.pack(MAGIC, kind, 1, 1, 7, 0, 0, 0, 0, count, runs, bytes(8), bytes(8))
    return header + b"hs" + struct.pack("<II", 0, run)


def v1_claim(count: int, run: int) -> bytes:
    """The issue's message: a version-1 header, names, one run of ``run``: 66 bytes."""
    header = V1_HEADER.pack(b"APF1", SAMPLES, 1, 1, 7, 0, 0, 0, 0, count, 1)
    return header + b"hs" + struct.pack("<II", 0, run)


@pytest.mark.parametrize("claimed", [1 << 28, (1 << 32) - 1])
def test_a_forged_count_is_refused_before_anything_is_allocated(claimed: int) -> None:
    # The run table claims the samples, the header claims none, one, or as many.
    for count in (0, 1, claimed):
        for payload, words in ((claim(count, claimed), "claims"),
                               (v1_claim(count, claimed), "wire version 1")):
            with pytest.raises(FrameError, match=words):
                parse(payload)
            peak = peak_of(lambda p=payload: parse(p))
            assert peak < FACTOR * len(payload), (len(payload), peak)
    assert (len(claim(0, claimed)), len(v1_claim(0, claimed))) == (82, 66)


def test_messages_no_sink_frames_are_refused_by_name() -> None:
    empty = HEADER.pack(MAGIC, SAMPLES, 1, 1, 7, 0, 0, 0, 0, 0, 0, bytes(8), bytes(8)) + b"hs"
    for payload, words in (
        (empty, "runs of samples"),  # a well-formed header, zero samples, no runs
        (claim(3, 3, runs=0), "runs of samples"),
        (claim(2, 2, runs=3), "runs"),
        (claim(1, 2) + bytes(2), "add up to 2, not 1"),
        (claim(0, 0, kind=END), "kind-4"),
        (V1_HEADER.pack(b"APF1", SAMPLES, 1, 1, 7, 0, 0, 0, 0, 0, 0) + b"hs", "wire version 1"),
        (b"APF1", "wire version 1"),
        (HEADER.pack(MAGIC, SAMPLES, 0, 1, 7, 0, 0, 0, 0, 1, 1, bytes(8), bytes(8)) + b"s",
         "host name"),
        (HEADER.pack(MAGIC, SAMPLES, 1, 1, 7, 0, 5, 0, 0, 1, 1, bytes(8), bytes(8)) + b"hs",
         "watermark"),
        (HEADER.pack(MAGIC, SAMPLES, 200, 200, 7, 0, 0, 0, 0, 1, 1, bytes(8), bytes(8)),
         "do not fit"),
    ):
        with pytest.raises(FrameError, match=words):
            parse(payload)


def valid_messages() -> list[bytes]:
    framer = Framer("web-1", "exec", 42, max_events=8, max_bytes=100_000, key=b"k" * 32)
    error = aperf.DecodeError(1, b"xy", "too short")
    events: list[Any] = [aperf.Sample(c % 3, bytes([c]) * (c % 20)) for c in range(20)]
    events[5:5] = [aperf.Lost(2, 9), aperf.BadSample(1, b"xy", error)]
    outs = framer.frame(events, 0)
    return [out.payload for out in outs] + [framer.dropped(outs[0]), framer.end()]


VALID = valid_messages()


def test_the_valid_messages_parse_and_chain() -> None:
    frames = [parse(p) for p in VALID]
    *data, dropped, end = frames
    assert end.kind == END and dropped.kind == DROPPED
    for a, b in zip(data, [*data[1:], end], strict=True):
        assert b.first == a.first + a.count and commit(b.tag) == a.next
    # The stand-in of a message given up: its place in the chain, and what it held.
    assert (dropped.first, dropped.count, dropped.tag, dropped.next) == (
        data[0].first, data[0].count, data[0].tag, data[0].next
    )
    assert dropped.events == [Gap(0, data[0].count, data[0].samples, 0)]


def check(payload: bytes) -> None:
    """It parses or raises FrameError; either way within the bound."""
    peak = peak_of(lambda: parse(payload))
    assert peak <= FACTOR * len(payload) + SLACK, (len(payload), peak)
    try:
        frame = parse(payload)
    except FrameError:
        return
    assert frame.samples == len(frame.cpus) <= len(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_parse_or_raise_frame_error(payload: bytes) -> None:
    check(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bodies_after_a_valid_header(body: bytes) -> None:
    check(VALID[0][: HEADER.size + 11] + body)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
    st.integers(-3, 30),
)
def test_mutated_valid_messages_parse_or_raise_frame_error(
    payload: bytes, flips: list[tuple[int, int]], cut: int
) -> None:
    data = bytearray(payload)
    for where, value in flips:
        data[where % len(data)] = value
    if cut > 0:
        data = data[: max(0, len(data) - cut)]
    elif cut < 0:
        data += bytes(-cut)
    check(bytes(data))


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(VALID),
    st.integers(0, 12),  # which of the header's integers
    st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([2**28, 2**31, 2**32 - 1])),
)
def test_forged_header_integers_parse_or_raise_frame_error(
    payload: bytes, field: int, value: int
) -> None:
    fields = list(HEADER.unpack_from(payload))
    if field in (0, 11, 12):  # the magic and the tags are bytes
        fields[field] = value.to_bytes(8, "little")[: 4 if field == 0 else 8]
    elif field in (1, 2, 3):  # u8
        fields[field] = value & 0xFF
    else:
        fields[field] = value
    check(HEADER.pack(*fields) + payload[HEADER.size :])
