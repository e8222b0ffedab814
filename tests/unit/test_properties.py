"""Property-based tests: the record parser and the decoders on random and corrupted
spans (they parse, or raise BrokenRingError/DecodeError, nothing else, and never hang),
and the reader's accounting under any interleaving of writes, wakeups, ticks and takes."""

from __future__ import annotations

import ctypes
import struct
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import aperf
from aperf._rings.perf.format import PerfRing, split_span
from aperf._rings.seam import payloads_of
from aperf.testing import FakeRingMemory, FakeRingSource, encode_lost, encode_sample

from ..helpers import fake_reader

records = st.one_of(
    st.binary(max_size=300).map(encode_sample),
    st.integers(0, 2**64 - 1).map(encode_lost),
    st.binary(min_size=8, max_size=40).map(lambda b: struct.pack("<IHH", 3, 0, 8 + len(b)) + b),
)


@given(st.binary(max_size=2000))
def test_random_bytes_parse_or_break(span: bytes) -> None:
    try:
        _segments, other = split_span(0, span)
    except aperf.BrokenRingError as exc:
        assert all(isinstance(s, int) or s[0] for s in exc.partial)
    else:
        assert other >= 0


@given(st.lists(records, max_size=40), st.data())
def test_corrupted_record_streams_keep_what_precedes_the_damage(
    parts: list[bytes], data: st.DataObject
) -> None:
    span = bytearray(b"".join(parts))
    if span:
        for _ in range(data.draw(st.integers(0, 4))):
            span[data.draw(st.integers(0, len(span) - 1))] = data.draw(st.integers(0, 255))
    try:
        split_span(1, bytes(span))
    except aperf.BrokenRingError as exc:
        assert exc.cpu == 1


@given(st.lists(records, min_size=1, max_size=40))
def test_intact_record_streams_parse_in_order(parts: list[bytes]) -> None:
    segments, _ = split_span(0, b"".join(parts))
    flat = [p for s in segments for p in ([s] if isinstance(s, int) else payloads_of(s))]
    assert len(flat) == sum(1 for p in parts if struct.unpack_from("<I", p)[0] in (2, 9))


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_any_head_and_tail_read_or_break(head: int, tail: int) -> None:
    memory = FakeRingMemory(256)
    memory.head, memory.tail = head, tail
    try:
        span = PerfRing(0, -1, memory).take()
    except aperf.BrokenRingError:
        return
    assert len(span) == head - tail


class Event(ctypes.Structure):
    _fields_ = (("pid", ctypes.c_uint32), ("comm", ctypes.c_char * 8), ("ts", ctypes.c_uint64))


DECODERS: list[Any] = [
    struct.Struct("<IQ"),
    aperf.decoders.from_struct("<Ih8s", names="pid level name"),
    Event,
    lambda data: data.decode("ascii"),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DECODERS), st.lists(st.binary(max_size=64), max_size=30))
def test_decoders_on_random_samples_yield_samples_or_bad_samples(
    decoder: Any, payloads: list[bytes]
) -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 14)
    got: list[Any] = []
    with aperf.PerfBuffer(src, decoder=decoder, on_sample=got.append,
                          on_decode_error=got.append) as pb:
        for payload in payloads:
            src.write(0, payload)
        pb.consume()
    assert len(got) == len(payloads)
    for event in got:
        assert isinstance(event, aperf.Sample | aperf.BadSample)
        if isinstance(event, aperf.BadSample):
            assert isinstance(event.error, aperf.DecodeError)


class ReaderAccounting(RuleBasedStateMachine):
    """Whatever happens in whatever order, every sample written is delivered once, in
    order per CPU, or counted as lost."""

    def __init__(self) -> None:
        super().__init__()
        self.src = FakeRingSource(cpus=[0, 1], ring_bytes=512)
        wakeup = aperf.Wakeup.every(3, max_latency=0.001, idle_latency=0.01, idle_after=0.005)
        self.reader, self.clock = fake_reader(self.src, wakeup, max_pending=7)
        self.clock.now = 0.0
        self.next_seq = {0: 0, 1: 0}
        self.seen: dict[int, list[int]] = {0: [], 1: []}
        self.lost = {0: 0, 1: 0}

    def _absorb(self, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, aperf.Lost):
                self.lost[event.cpu] += event.count
            else:
                self.seen[event.cpu].append(struct.unpack_from("<Q", event.data)[0])

    @rule(cpu=st.sampled_from([0, 1]), count=st.integers(1, 20), size=st.sampled_from([8, 20, 60]))
    def write(self, cpu: int, count: int, size: int) -> None:
        for _ in range(count):
            self.src.write(cpu, struct.pack("<Q", self.next_seq[cpu]).ljust(size, b"\0"))
            self.next_seq[cpu] += 1

    @rule(cpu=st.sampled_from([0, 1]))
    def wakeup(self, cpu: int) -> None:
        self.reader.on_ready(self.src._rings[cpu].handle)

    @rule(dt=st.floats(0, 0.02))
    def tick(self, dt: float) -> None:
        self.clock.jump(dt)
        if self.reader.deadline is not None and self.clock.now >= self.reader.deadline:
            self.reader.tick()

    @rule(n=st.integers(1, 10), back=st.integers(0, 3))
    def take(self, n: int, back: int) -> None:
        batch = self.reader.take(n)
        keep = max(0, len(batch) - back)
        self._absorb(batch[:keep])
        self.reader.put_back(batch[keep:])

    @precondition(lambda self: not self.reader.closed)
    @rule()
    def flush(self) -> None:
        self.reader.flush()

    @invariant()
    def per_cpu_order(self) -> None:
        for seqs in self.seen.values():
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    def teardown(self) -> None:
        self.reader.close()
        self._absorb(self.reader.take(1 << 20))
        for cpu in (0, 1):
            assert len(self.seen[cpu]) + self.lost[cpu] == self.next_seq[cpu]
            assert self.lost[cpu] == self.src.dropped(cpu)
        self.src.free()


TestReaderAccounting = ReaderAccounting.TestCase
TestReaderAccounting.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
