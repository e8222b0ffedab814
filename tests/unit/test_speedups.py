"""The compiled fast path (aperf/_native/_speedups.c) against the pure functions it stands
for: the same results on random and adversarial rings (torn headers, sizes past the end,
wraps, lost records, zero-length records), the same events, the same iterator protocol.

The differential tests (``test_differential_*``) also run once under AddressSanitizer
(``test_the_fast_path_passes_them_under_address_sanitizer``): the module is compiled
with ``-fsanitize=address`` into a temporary directory and a subprocess, with the ASan
runtime preloaded and ``PYTHONMALLOC=malloc``, runs them against it. Spans are handed to
the C code in buffers of their exact size (ctypes arrays), so that a read one byte past
the end lands in ASan's red zone.

Under ``APERF_NO_EXTENSIONS=1`` (the pure path's run, scripts/check.sh) these tests skip;
anywhere else a checkout whose compiled module did not load fails here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import pickle
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aperf
from aperf._native import speedups
from aperf._native.libbpf.perf_buffer import RingMemory
from aperf._reading import build
from aperf._reading.build import EventBuilder
from aperf._reading.looks import _pure_busy_rings
from aperf._rings.perf.format import PerfRing, encode_lost, encode_sample, pure_split_span
from aperf._rings.ringbuf.format import RingBufferRing, encode_record
from aperf._rings.ringbuf.format import pure_split_span as pure_ringbuf_split
from aperf._rings.seam import Run
from aperf.testing import FakeRingSource

REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "aperf" / "_native" / "_speedups.c"
EXAMPLES = int(os.environ.get("APERF_DIFFERENTIAL_EXAMPLES", "300"))
DIFFERENTIAL = settings(max_examples=EXAMPLES, deadline=None,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def compiled() -> Any:
    """The compiled module; a failure where it should have loaded and did not."""
    if speedups.FORCED_PURE:
        pytest.skip("APERF_NO_EXTENSIONS is set: this run tests the pure path")
    if not speedups.EXTENSIONS:
        pytest.fail(f"the compiled fast path did not load: {speedups.WHY_PURE}. "
                    "bash scripts/setup.sh builds it (gcc); APERF_NO_EXTENSIONS=1 runs pure")
    wanted = os.environ.get("APERF_TEST_SPEEDUPS")  # the AddressSanitizer run's build
    if wanted:
        assert speedups._speedups.__file__ == wanted
    return speedups._speedups


def exact(data: bytes) -> Any:
    """``data`` in a buffer of exactly its size (no NUL after it, as bytes have)."""
    return (ctypes.c_char * len(data)).from_buffer_copy(data)


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """What a call did: its result, or the error it raised (type, message, partial)."""
    try:
        result = call()
    except aperf.BrokenRingError as exc:
        return "broken", (str(exc), exc.cpu, shapes(exc.partial))
    except Exception as exc:
        return "error", (type(exc).__name__, str(exc))
    return "ok", result


def shapes(segments: list[Any]) -> list[tuple[type, Any]]:
    """Segments with their types: a Run must be a Run, a count an int, a list a list."""
    out: list[tuple[type, Any]] = []
    for segment in segments:
        if isinstance(segment, tuple) and not isinstance(segment, Run):
            payloads, uniform = segment
            out.append((tuple, (type(payloads), [(type(p), p) for p in payloads],
                                type(uniform), uniform)))
        else:
            out.append((type(segment), segment))
    return out


def split_outcome(call: Callable[[], tuple[list[Any], int]]) -> tuple[str, Any]:
    kind, value = outcome(call)
    return (kind, (shapes(value[0]), type(value[1]), value[1])) if kind == "ok" else (kind, value)


# --- perf records ---------------------------------------------------------------------------

HEADER = struct.Struct("<IHH")


def raw_header(kind: int, size: int, misc: int = 0) -> bytes:
    return HEADER.pack(kind, misc, size)


samples = st.binary(max_size=120).map(encode_sample)
runs = st.tuples(st.binary(max_size=64), st.integers(2, 40)).map(
    lambda pair: encode_sample(pair[0]) * pair[1])
losts = st.integers(0, 2**64 - 1).map(encode_lost)
others = st.binary(max_size=40).map(lambda b: raw_header(3, 8 + len(b)) + b)
damaged = st.one_of(
    st.just(raw_header(9, 0)),  # a zero-length record
    st.integers(0, 7).map(lambda n: raw_header(9, n)),  # shorter than a header
    st.integers(8, 11).map(lambda n: raw_header(9, n) + bytes(n - 8)),  # a sample without raw size
    st.integers(13, 0xFFFF).map(lambda raw: raw_header(9, 16) + struct.pack("<I", raw) + bytes(4)),
    st.integers(8, 23).map(lambda n: raw_header(2, n) + bytes(n - 8)),  # a short lost record
    st.integers(64, 0xFFFF).map(lambda n: raw_header(9, n) + bytes(8)),  # size past the end
    st.binary(min_size=1, max_size=16),  # torn bytes
    # A run whose records differ only in misc, or whose type byte says LOST (0x102).
    st.integers(2, 8).map(lambda k: (raw_header(9, 16) + struct.pack("<I", 4) + bytes(4)) * k
                          + raw_header(9, 16, misc=1) + struct.pack("<I", 4) + bytes(4)),
    st.integers(1, 4).map(lambda k: (raw_header(0x102, 16) + bytes(8)) * k),
)
perf_records = st.one_of(samples, runs, losts, others, damaged)


@st.composite
def perf_spans(draw: st.DrawFn) -> bytes:
    span = bytearray(b"".join(draw(st.lists(perf_records, max_size=30))))
    if span and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 6))):  # flipped bytes: headers torn anywhere
            span[draw(st.integers(0, len(span) - 1))] = draw(st.integers(0, 255))
    if span and draw(st.booleans()):
        del span[draw(st.integers(0, len(span))):]  # cut short: a record past the end
    return bytes(span)


@DIFFERENTIAL
@given(span=perf_spans(), key=st.integers(-1, 300))
def test_differential_perf_scan(compiled: Any, span: bytes, key: int) -> None:
    buffer = exact(span)
    assert split_outcome(lambda: compiled.perf_split(key, buffer, Run)) == split_outcome(
        lambda: pure_split_span(key, buffer))


def test_differential_perf_scan_on_the_edge_cases(compiled: Any) -> None:
    """Fixed examples hypothesis may not draw: every refusal, once each."""
    cases = [
        b"", b"\x09", raw_header(9, 0), raw_header(9, 12) + struct.pack("<I", 1),
        encode_sample(b"x" * 32) * 3 + encode_lost(5) + encode_sample(b"x" * 32) * 2,
        encode_sample(b"") * 2, raw_header(7, 8) * 3, encode_lost(2**64 - 1) + b"\0" * 7,
        (raw_header(9, 16) + struct.pack("<I", 4) + bytes(4)) * 2 + raw_header(2, 24),
    ]
    for span in cases:
        buffer = exact(span)
        assert split_outcome(lambda b=buffer: compiled.perf_split(3, b, Run)) == split_outcome(
            lambda b=buffer: pure_split_span(3, b))


# --- BPF ring buffer records -----------------------------------------------------------------

BUSY, DISCARD = 1 << 31, 1 << 30
rb_records = st.one_of(
    st.builds(encode_record, st.binary(max_size=80), discard=st.booleans()),
    st.tuples(st.binary(max_size=40), st.integers(2, 30), st.booleans()).map(
        lambda t: encode_record(t[0], discard=t[2]) * t[1]),
    st.builds(encode_record, st.binary(max_size=16), busy=st.just(True)),
    st.integers(0, 2**32 - 1).map(lambda word: struct.pack("<II", word, 0)),  # any header
    st.binary(min_size=1, max_size=12),
)


@st.composite
def ringbuf_spans(draw: st.DrawFn) -> bytes:
    span = bytearray(b"".join(draw(st.lists(rb_records, max_size=30))))
    if span and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 6))):
            span[draw(st.integers(0, len(span) - 1))] = draw(st.integers(0, 255))
    if span and draw(st.booleans()):
        del span[draw(st.integers(0, len(span))):]
    return bytes(span)


@DIFFERENTIAL
@given(span=ringbuf_spans())
def test_differential_ringbuf_scan(compiled: Any, span: bytes) -> None:
    buffer = exact(span)
    assert split_outcome(lambda: compiled.ringbuf_split(-1, buffer)) == split_outcome(
        lambda: pure_ringbuf_split(-1, buffer))


PAGE = 4096


class Mirror(bytearray):
    """Mapped memory: slicing copies out bytes, as slicing an mmap does."""

    def __getitem__(self, key):  # type: ignore[no-untyped-def,override]
        got = super().__getitem__(key)
        return bytes(got) if isinstance(key, slice) else got


@st.composite
def ring_buffers(draw: st.DrawFn) -> tuple[RingBufferRing, int, int]:
    """A ring buffer's mapping (data area twice) holding records from a position that may
    wrap, some headers damaged; (ring, consumer position, producer position)."""
    size = draw(st.sampled_from([64, 256, 1024]))
    memory = Mirror(PAGE + 2 * size)
    records = b"".join(draw(st.lists(rb_records, max_size=12)))[:size]
    start = draw(st.integers(0, 2**40)) & ~(7 if draw(st.booleans()) else 0)
    data = bytearray(records)
    if data and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    for index, byte in enumerate(data):  # both mappings of each byte, wrapped at the end
        at = (start + index) % size
        memory[PAGE + at] = memory[PAGE + size + at] = byte
    prod = start + draw(st.integers(0, size))
    ring = RingBufferRing(0, bytearray(PAGE), memory, PAGE, size)
    return ring, start, prod


@DIFFERENTIAL
@given(case=ring_buffers())
def test_differential_ringbuf_header_walk(compiled: Any, case: tuple[Any, int, int]) -> None:
    ring, pos, prod = case
    words, offset, mask = ring._words, ring._offset, ring._mask
    assert outcome(lambda: compiled.ringbuf_committed_end(words, offset, mask, pos, prod)) == (
        outcome(lambda: ring.pure_committed_end(pos, prod)))


def test_differential_ringbuf_header_walk_from_an_unaligned_position(compiled: Any) -> None:
    """A consumer position off the 8-byte grid (a corrupt page): the header is the word the
    pure walk reads (``words[at >> 2]``), and the run is compared from the first record on
    (found by the differential test under AddressSanitizer: the C walk skipped record 0)."""
    memory = Mirror(PAGE + 2 * 64)
    memory[PAGE : PAGE + 4] = struct.pack("<I", 8)  # the word read for position 3
    memory[PAGE + 4] = 1  # the 4 bytes at position 3 are not that word...
    memory[PAGE + 19 : PAGE + 23] = struct.pack("<I", 8)  # ...but those 16 bytes on are
    ring = RingBufferRing(0, bytearray(PAGE), memory, PAGE, 64)
    words, offset, mask = ring._words, ring._offset, ring._mask
    assert outcome(lambda: compiled.ringbuf_committed_end(words, offset, mask, 3, 67)) == (
        outcome(lambda: ring.pure_committed_end(3, 67)))


# --- a perf ring's take ----------------------------------------------------------------------


class ControlPage:
    """A perf ring in memory as the kernel lays it out: the control page, then the data."""

    def __init__(self, size: int, data: bytes) -> None:
        self.size = size
        self.memory = (ctypes.c_uint8 * (PAGE + size))()
        struct.pack_into("<QQ", self.memory, 1040, PAGE, size)
        ctypes.memmove(ctypes.addressof(self.memory) + PAGE, data, len(data))
        self.base = ctypes.addressof(self.memory)

    def set(self, head: int, tail: int) -> None:
        struct.pack_into("<QQ", self.memory, 1024, head, tail)

    def tail(self) -> int:
        return int(struct.unpack_from("<Q", self.memory, 1032)[0])


@DIFFERENTIAL
@given(size=st.sampled_from([64, 512, 4096]), tail=st.integers(0, 2**64 - 1),
       ahead=st.one_of(st.integers(0, 5000), st.integers(-5000, -1), st.integers(0, 2**64 - 1)),
       seed=st.integers(0, 2**32))
def test_differential_perf_take(compiled: Any, size: int, tail: int, ahead: int,
                                seed: int) -> None:
    head = (tail + ahead) % 2**64
    ring = ControlPage(size, random.Random(seed).randbytes(size))
    cell = compiled.RingCell(ring.base)
    pure = PerfRing(4, 0, RingMemory(ring.base))
    pure._cell = None
    ring.set(head, tail)
    fast = (outcome(lambda: cell.take(4)), ring.tail())
    ring.set(head, tail)
    assert fast == (outcome(pure.take), ring.tail())
    ring.set(head, tail)
    assert outcome(cell.positions) == outcome(pure.memory.positions)


def test_a_released_cell_reads_nothing(compiled: Any) -> None:
    ring = ControlPage(64, bytes(64))
    memory = RingMemory(ring.base)
    perf = PerfRing(0, 0, memory)
    ring.set(16, 0)
    memory.release()
    for call in (lambda: perf.take(), memory.cell.positions, memory.cell.pending_bytes):
        with pytest.raises(aperf.ClosedResourceError, match="released"):
            call()
    with pytest.raises(ValueError, match="control page"):
        compiled.RingCell(ctypes.addressof((ctypes.c_uint8 * PAGE)()))  # data size 0


# --- the tick's look at every ring -----------------------------------------------------------


def test_differential_ring_watch(compiled: Any) -> None:
    """One C call says which rings hold something, as asking each one does: kernel-like
    rings through their cells, fakes by asking them, released rings raising, the set of
    rings changing between calls."""
    source = FakeRingSource(cpus=[0, 1, 2], ring_bytes=1024)
    fakes = source.open(aperf.abc.RingConfig(None, aperf.Wakeup.per_sample()))
    pages = [ControlPage(64, bytes(64)) for _ in range(5)]
    perf = [PerfRing(10 + i, 0, RingMemory(p.base)) for i, p in enumerate(pages)]
    watch = compiled.RingWatch()
    rings: dict[int, Any] = {r.key: r for r in [*fakes, *perf]}
    rng = random.Random(7)
    for _ in range(200):
        for page in pages:
            tail = rng.randrange(2**63)
            page.set(tail + rng.choice([0, 0, 8, 64]), tail)
        for fake in fakes:
            if rng.random() < 0.3:
                source.write(fake.key, b"x" * 8)
            elif rng.random() < 0.3:
                fake.take()
        if len(rings) > 1 and rng.random() < 0.2:  # rings leave and come back, reordered
            key = rng.choice(list(rings))
            ring = rings.pop(key)
            if rng.random() < 0.5:
                rings[key] = ring
        assert watch.busy(rings) == _pure_busy_rings(rings)
    perf[0].memory.release()
    rings[perf[0].key] = perf[0]
    with pytest.raises(aperf.ClosedResourceError):
        _pure_busy_rings(rings)
    with pytest.raises(aperf.ClosedResourceError):
        watch.busy(rings)
    assert watch.busy({}) == []
    source.free()


def test_a_ring_asking_the_watch_again_is_refused(compiled: Any) -> None:
    """A ring's ``pending_bytes()`` is Python code: a nested ``busy()`` (or ``forget()``)
    from there would swap the entries the outer walk is reading (on another dict, its
    keys: a wrong answer, or memory freed under it). The watch refuses it instead."""
    watch = compiled.RingWatch()
    pages = [ControlPage(64, bytes(64)) for _ in range(3)]  # kept: the rings' memory
    other = {k: PerfRing(k, 0, RingMemory(pages[k].base)) for k in range(3)}
    nested: list[Any] = []

    class Asking:
        def __init__(self, call: Callable[[], Any]) -> None:
            self.call = call

        def pending_bytes(self) -> int:
            try:
                nested.append(self.call())
            except RuntimeError as exc:
                nested.append(exc)
            return 0

    page = ControlPage(64, bytes(64))
    page.set(8, 0)
    busy = PerfRing(9, 0, RingMemory(page.base))
    for call in (lambda: watch.busy(other), watch.forget):
        nested.clear()
        assert watch.busy({1: Asking(call), 9: busy}) == [9]
        assert len(nested) == 1 and isinstance(nested[0], RuntimeError), nested
        assert "called from a ring it asks" in str(nested[0])
    assert watch.busy(other) == []  # the watch works again after the refusal


# --- events ----------------------------------------------------------------------------------


class Pair(ctypes.Structure):
    _fields_ = (("a", ctypes.c_uint32), ("name", ctypes.c_char * 4))


class Tailed(ctypes.Structure):
    _fields_ = (("n", ctypes.c_uint32), ("rest", ctypes.c_uint8 * 0))


class Plain(ctypes.Structure):
    _fields_ = (("a", ctypes.c_int16), ("b", ctypes.c_uint32), ("c", ctypes.c_int64))


DECODERS: dict[str, Any] = {
    "raw": None,
    "struct": aperf.decoders.from_struct("<II"),
    "named": aperf.decoders.from_struct("<II", "a b"),
    "ctypes": aperf.decoders.from_ctypes(Pair),  # a str field: not a plain record
    "tail": aperf.decoders.from_ctypes(Tailed),  # a flexible member: per payload
    "callable": lambda data: len(data),
    # Read by the fast path's plan (SizedDecoder.fields_plan): every integer code, both
    # byte orders, pads, bools and doubles; a float left to struct.
    "every_code": aperf.decoders.from_struct("<bBhHiIlLqQ?d"),
    "big_named": aperf.decoders.from_struct(">hIq?", "a b c d"),
    "padded": aperf.decoders.from_struct("<2xHi3xb", "a b c"),
    "native": aperf.decoders.from_ctypes(Plain),  # "=": the CPU's order, standard sizes
    "float": aperf.decoders.from_struct("<fd", "f d"),
}


@contextlib.contextmanager
def pure_builders() -> Iterator[None]:
    """The builder's pure zips for a while (its compiled builders set aside)."""
    saved = build._build_run, build._build_payloads
    build._build_run = build._build_payloads = None
    try:
        yield
    finally:
        build._build_run, build._build_payloads = saved


def built(builder: EventBuilder, pieces: list[tuple[Any, ...]], out: Any) -> list[Any]:
    for piece in pieces:
        if isinstance(piece[1], Run):
            builder.run(*piece, out)
        else:
            builder.payloads(*piece, out)
    return list(out)


def comparable(event: Any) -> Any:
    """An event as compared: a BadSample's error by its class and message, a NaN by its
    bits (it equals nothing, itself included)."""
    if isinstance(event, aperf.BadSample):
        return type(event), event.cpu, event.data, type(event.error), str(event.error)
    if isinstance(event, float) and event != event:
        return "nan", struct.pack("<d", event)
    if isinstance(event, tuple):
        return type(event), tuple(comparable(item) for item in event)
    return event


def contains_nan(value: Any) -> bool:
    if isinstance(value, float):
        return value != value
    return isinstance(value, tuple) and any(contains_nan(item) for item in value)


def compare_events(fast: list[Any], pure: list[Any]) -> None:
    assert [comparable(e) for e in fast] == [comparable(e) for e in pure]
    if any(isinstance(e, aperf.BadSample) for e in fast):
        return  # errors neither hash nor compare by value
    assert [type(e) for e in fast] == [type(e) for e in pure]
    if any(contains_nan(e) for e in fast):  # equal as bits above, hashed by identity
        return
    assert [type(e.value) for e in fast] == [type(e.value) for e in pure]
    assert [hash(e) for e in fast] == [hash(e) for e in pure]
    assert [repr(e) for e in fast] == [repr(e) for e in pure]
    assert pickle.loads(pickle.dumps(fast)) == pure


@pytest.mark.parametrize("name", list(DECODERS))
@pytest.mark.parametrize("out_kind", [list, collections.deque])
@pytest.mark.parametrize("map_name", [None, "events"])
@given(payload=st.binary(min_size=24, max_size=60), count=st.integers(2, 30),
       cuts=st.tuples(st.integers(0, 30), st.integers(0, 30)), loose=st.lists(
           st.binary(max_size=24), max_size=6))
@settings(max_examples=max(EXAMPLES // 10, 5), deadline=None)
def test_differential_events(
    compiled: Any, name: str, out_kind: type, map_name: str | None, payload: bytes, count: int,
    cuts: tuple[int, int], loose: list[bytes],
) -> None:
    """The builders make the events the pure zips make: equal, of the same classes,
    hashing, printing and pickling the same, into a list or the front deque."""
    (run,), _ = compiled.perf_split(0, encode_sample(payload) * count, Run)
    assert isinstance(run, Run)
    start, stop = sorted((min(cuts[0], count), min(cuts[1], count)))
    uniform = [p.ljust(40, b"\0") for p in loose]
    pieces = [(3, run, start, stop), (3, run, 0, count), (1, uniform, True),
              (2, loose, False)]
    pieces = [p for p in pieces if (p[2] < p[3] if len(p) == 4 else p[1])]  # none empty

    def events() -> list[Any]:
        builder = EventBuilder(DECODERS[name], "item", lambda *a: None, map=map_name, offset=1)
        return built(builder, pieces, out_kind())

    fast = events()
    with pure_builders():
        pure = events()
    compare_events(fast, pure)


def test_records_are_made_as_their_class_makes_them(compiled: Any) -> None:
    decoder = aperf.decoders.from_struct("<II", "a b")
    record = decoder.row_class
    rows = [(1, 2), (3, 4)]
    made = compiled.records(record, rows)
    assert made == [record(r) for r in rows] and {type(r) for r in made} == {record}
    assert [hash(r) for r in made] == [hash(record(r)) for r in rows]

    class Odd(tuple):  # type: ignore[type-arg]  # a class of its own __new__: called
        def __new__(cls, row: Any) -> Any:
            return tuple.__new__(cls, (*row, "odd"))

    assert compiled.records(Odd, rows) == [(1, 2, "odd"), (3, 4, "odd")]


def test_the_builders_check_what_they_are_given(compiled: Any) -> None:
    span = exact(encode_sample(b"x" * 8) * 2)
    sample = aperf.Sample
    with pytest.raises(ValueError, match="past the end"):
        compiled.build_run(sample, 0, span, 0, 3, 24, 12, 12, None, None, [])
    with pytest.raises(ValueError, match="payload past"):
        compiled.build_run(sample, 0, span, 0, 1, 24, 12, 13, None, None, [])
    with pytest.raises(ValueError, match="negative"):
        compiled.build_run(sample, 0, span, -1, 1, 24, 12, 12, None, None, [])
    with pytest.raises(TypeError, match="tuple subclass"):
        compiled.build_payloads(dict, 0, [b"x"], None, [])
    out: list[Any] = []
    compiled.build_run(sample, 0, span, 0, 2, 24, 12, 12, iter([1]), None, out)
    assert out == [(0, b"x" * 8 + bytes(4), 1)]  # as zip: the shortest ends it


# --- the iterator of async for ---------------------------------------------------------------


def make_items(compiled: Any, front: collections.deque[Any],
               refill: Callable[[], Any]) -> Any:
    async def slow() -> Any:
        try:
            return front.popleft()
        except IndexError:
            pass
        return await refill()

    return compiled.Items(front.popleft, slow)


def test_the_iterator_hands_out_the_front_then_waits_in_python(compiled: Any) -> None:
    async def main() -> list[Any]:
        front: collections.deque[Any] = collections.deque([1, 2])
        arrived = asyncio.Event()

        async def refill() -> Any:
            await arrived.wait()
            arrived.clear()
            if not front:
                raise StopAsyncIteration
            return front.popleft()

        items = make_items(compiled, front, refill)
        got = [await anext(items), await anext(items)]
        waiting = asyncio.ensure_future(anext(items))
        await asyncio.sleep(0)
        assert not waiting.done()
        front.extend([3, 4])
        arrived.set()
        got.append(await waiting)
        got.append(await anext(items))
        arrived.set()
        async for item in items:  # the front is empty, refill ends it
            got.append(item)
        return got

    assert asyncio.run(main()) == [1, 2, 3, 4]


def test_an_anext_cancelled_before_it_ran_takes_nothing(compiled: Any) -> None:
    async def main() -> list[Any]:
        front: collections.deque[Any] = collections.deque([1, 2, 3])

        async def refill() -> Any:
            raise StopAsyncIteration

        items = make_items(compiled, front, refill)
        first = anext(items)
        second = anext(items)  # two outstanding: each its own awaitable
        task = asyncio.ensure_future(anext(items))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert list(front) == [1, 2, 3]  # nothing was taken by the cancelled one
        assert [await second, await first] == [1, 2]
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(anext(items), 0)
        return [item async for item in items]

    assert asyncio.run(main()) == [3]


def test_the_awaitable_follows_the_generator_protocol(compiled: Any) -> None:
    front: collections.deque[Any] = collections.deque(["a"])
    step = {"n": 0}

    async def refill() -> Any:
        step["n"] += 1
        await asyncio.sleep(0)  # yields None once
        return "b"

    items = make_items(compiled, front, refill)
    ready = items.__anext__()
    with pytest.raises(StopIteration) as stop:
        ready.send(None)
    assert stop.value.value == "a"
    with pytest.raises(RuntimeError, match="reuse"):
        ready.send(None)
    waiting = items.__anext__().__await__()
    assert next(waiting) is None  # the refill's own yield, passed through
    with pytest.raises(StopIteration) as stop:
        waiting.send(None)
    assert stop.value.value == "b"
    thrown = items.__anext__()
    assert thrown.send(None) is None
    with pytest.raises(KeyError):
        thrown.throw(KeyError("into the refill"))
    fresh = items.__anext__()
    with pytest.raises(ValueError, match="not started"):
        fresh.throw(ValueError("not started"))
    closing = items.__anext__()
    closing.send(None)
    closing.close()
    with pytest.raises(RuntimeError, match="reuse"):
        closing.send(None)

    def broken() -> Any:
        raise OSError("not IndexError")

    with pytest.raises(OSError, match="not IndexError"):
        compiled.Items(broken, refill).__anext__().send(None)
    tuple_item = make_items(compiled, collections.deque([(1, 2)]), refill)
    with pytest.raises(StopIteration) as stop:
        tuple_item.__anext__().send(None)
    assert stop.value.value == (1, 2)  # a tuple is returned whole, never unpacked


# --- AddressSanitizer ------------------------------------------------------------------------


def asan_runtime() -> str | None:
    found = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                           text=True, check=False).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def compile_asan(source: Path, out: Path, *, shared_python: bool) -> None:
    include = sysconfig.get_paths()["include"]
    cmd = ["gcc", "-shared", "-fPIC", "-O1", "-g", "-fsanitize=address",
           "-fno-omit-frame-pointer", "-o", str(out), str(source)]
    if shared_python:
        cmd[1:1] = [f"-I{include}"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def run_asan(code: str, runtime: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = dict(os.environ, LD_PRELOAD=runtime, PYTHONMALLOC="malloc",
                   ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0", **env)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=900, check=False)


def test_the_fast_path_passes_them_under_address_sanitizer(tmp_path: Path) -> None:
    if speedups.FORCED_PURE:
        pytest.skip("APERF_NO_EXTENSIONS is set: this run tests the pure path")
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the fast path under AddressSanitizer")
    runtime = asan_runtime()
    assert runtime is not None, "gcc's libasan is missing (Debian: libasan8, with gcc)"
    # The harness first shows that it catches a read past a buffer Python allocated.
    probe = tmp_path / "overread.c"
    probe.write_text("int overread(const unsigned char *p, int n) { return p[n]; }\n")
    compile_asan(probe, tmp_path / "overread.so", shared_python=False)
    library = str(tmp_path / "overread.so")
    caught = run_asan(f"import ctypes; lib = ctypes.CDLL({library!r}); "
                      "buf = (ctypes.c_char * 24)(); lib.overread(buf, 24)", runtime)
    assert "heap-buffer-overflow" in caught.stderr, caught.stderr[-2000:]
    module = tmp_path / "_speedups.abi3.so"
    compile_asan(SOURCE, module, shared_python=True)
    code = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("aperf._native._speedups", {str(module)!r})
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
import pytest
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", "-k", "test_differential_",
                      {str(Path(__file__))!r}]))
"""
    done = run_asan(code, runtime, APERF_TEST_SPEEDUPS=str(module),
                    APERF_DIFFERENTIAL_EXAMPLES="100")
    assert "AddressSanitizer" not in done.stderr, done.stderr[-4000:]
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert " passed" in done.stdout and "skipped" not in done.stdout.split("\n")[-2], done.stdout


PATH_PROBE = """
import aperf
from aperf._drivers import items
from aperf._native import speedups
from aperf._reading import build, looks
from aperf._rings.perf import format as perf_format
from aperf._rings.ringbuf import format as ringbuf_format
from aperf.testing import FakeRingSource

hooks = [perf_format._perf_split, ringbuf_format._ringbuf_split, build._build_run,
         build._build_payloads, items._FastItems, speedups.RingCell]
with aperf.PerfBuffer(FakeRingSource(cpus=[0]), on_sample=print) as pb:
    fast = pb.statistics().fast_path
print(aperf.EXTENSIONS, fast, sum(h is not None for h in hooks),
      looks.watcher() is looks._pure_busy_rings)
print(speedups.status())
"""


@pytest.mark.parametrize(("value", "pure"), [("1", True), ("yes", True), ("0", False),
                                             ("false", False), ("", False)])
def test_aperf_no_extensions_forces_the_pure_path(value: str, pure: bool) -> None:
    """``APERF_NO_EXTENSIONS`` (anything but empty, 0, false, no) takes every compiled hook
    out, and the stream's statistics and ``status()`` say so; unset or ``0``, a checkout
    with the module built runs it (this fails where it was not built)."""
    env = dict(os.environ, APERF_NO_EXTENSIONS=value)
    done = subprocess.run([sys.executable, "-c", PATH_PROBE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    said, status = done.stdout.splitlines()
    if pure:
        assert said == "False False 0 True"
        assert status == "pure Python: APERF_NO_EXTENSIONS is set"
    else:
        assert said == "True True 6 False", status
        assert status == "compiled fast path (_speedups.abi3.so)"


def test_the_compiled_path_runs_in_this_checkout(compiled: Any) -> None:
    """What ``aperf.EXTENSIONS`` says is what runs: the hooks are the compiled ones."""
    from aperf._drivers import items
    from aperf._rings.perf import format as perf_format

    assert aperf.EXTENSIONS and perf_format._perf_split is compiled.perf_split
    assert build._build_run is compiled.build_run and items._FastItems is compiled.Items
