"""One BPF object, either ring (issue 33, feature 1): a program declares its buffer with
``APERF_BUFFER`` from ``<aperf/buffer.bpf.h>``; ``BPFObject(path, buffer=...)`` makes it a
BPF ring buffer or a perf event array before load, and ``PerfStream(obj.maps[name])``
reads whichever it became. Each way is forced here, and the kernel produces the samples
(bpf/buffers.bpf.c): exact counts, drops included, on every loop."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import object_path

from ..helpers import REPO, require_kernel
from . import test_ringbuf
from .buffers_producer import OBJECT, RESERVED_SIZE, Buffers, seq
from .test_ringbuf import read_until

pytestmark = [pytest.mark.usefixtures("kernel")]
CPU = sorted(os.sched_getaffinity(0))[-1]
BPF_MAP_TYPE_PERF_EVENT_ARRAY, BPF_MAP_TYPE_RINGBUF = 4, 27
EITHER = pytest.mark.parametrize("buffer", ["ringbuf", "perf"])
# Room for a whole burst (the kernel emits faster than anyone reads): a 4 MiB ring
# buffer, or 2 MiB per CPU.
ROOMY: dict[str, dict[str, int]] = {"ringbuf": {"events_bytes": 1 << 22}, "perf": {}}
PAGES: dict[str, int | None] = {"ringbuf": None, "perf": 512}


@contextlib.contextmanager
def opened(buffer: str, **kwargs: int) -> Iterator[Buffers]:
    require_kernel()
    with Buffers(buffer, **kwargs) as buffers:
        yield buffers


class Seen(test_ringbuf.Seen):
    """A ring buffer's Seen that also takes perf rings' samples (any CPU), and notes
    their CPUs and sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.cpus: set[int] = set()
        self.sizes: set[int] = set()

    def add(self, event: object) -> None:
        if isinstance(event, aperf.Sample):
            self.seqs.append(seq(event))
            self.cpus.add(event.cpu)
            self.sizes.add(len(event.data))
        elif isinstance(event, aperf.Lost):
            self.lost += event.count
        else:  # pragma: no cover - would be a bug
            raise AssertionError(f"unexpected event {event!r}")


def delivered(buffer: str, size: int) -> int:
    """A sample's length as read: exact from a ring buffer; a perf record pads its raw
    data so that the record ends 8-aligned (docs/rings.md)."""
    return size if buffer == "ringbuf" else ((size + 4 + 7) & ~7) - 4


def expected_keys(buffer: str) -> list[int]:
    """The stream's rings: one ring buffer for every CPU, or a perf ring per online CPU."""
    return [aperf.NO_CPU] if buffer == "ringbuf" else sorted(os.sched_getaffinity(0))


@pytest.mark.anyio
@EITHER
@pytest.mark.parametrize("target", ["output", "reserve"])
async def test_the_loader_picks_the_ring_and_the_stream_reads_it(buffer: str, target: str) -> None:
    n = 3000
    with opened(buffer, **ROOMY[buffer]) as buffers:
        events = buffers.obj.maps["events"]
        assert buffers.obj.buffer == buffer
        assert events.type == (BPF_MAP_TYPE_RINGBUF if buffer == "ringbuf"
                               else BPF_MAP_TYPE_PERF_EVENT_ARRAY)
        assert buffers.obj.read_global("aperf_buffer_ringbuf__events") == (buffer == "ringbuf")
        seen = Seen()
        async with aperf.PerfStream(events, pages=PAGES[buffer]) as stream:
            assert stream.cpus == expected_keys(buffer)
            thread = buffers.spawn(n, cpu=CPU, target=target)
            await read_until(stream, seen, n)
            await anyio.to_thread.run_sync(thread.join)
            stats = stream.statistics()
        counts = buffers.counts()
    assert seen.seqs == list(range(n))  # one CPU's samples: in order, none missing
    assert seen.lost == 0 and (counts.ok, counts.failed) == (n, 0)
    assert seen.cpus == {aperf.NO_CPU if buffer == "ringbuf" else CPU}
    assert seen.sizes == {delivered(buffer, RESERVED_SIZE if target == "reserve" else 32)}
    assert stats.samples == n and stats.lost == 0
    # The header's drop count is read for a ring buffer; a perf ring's drops the kernel counts.
    assert stats.lost_counter == "exact"


@pytest.mark.anyio
@EITHER
@pytest.mark.parametrize("target", ["output", "reserve"])
async def test_drops_are_counted_exactly_either_way(buffer: str, target: str) -> None:
    n = 2000
    # A one-page ring buffer, or one page per CPU: far too small for the burst.
    sizes = {"events_bytes": 4096} if buffer == "ringbuf" else {}
    with opened(buffer, **sizes) as buffers:
        seen = Seen()
        pages = None if buffer == "ringbuf" else 1
        async with aperf.PerfStream(buffers.obj.maps["events"], pages=pages) as stream:
            buffers.emit(n, cpu=CPU, target=target)  # on this thread: nobody reads meanwhile
            await read_until(stream, seen, n)
            stats = stream.statistics()
        counts = buffers.counts()
        header_drops = buffers.obj.read_global("aperf_buffer_dropped__events")
    assert counts.ok + counts.failed == n and counts.failed > 0
    assert len(seen.seqs) == counts.ok and seen.seqs == sorted(seen.seqs)
    assert seen.lost == counts.failed == header_drops == stats.lost
    assert stats.lost_counter == "exact"


@pytest.mark.anyio
@EITHER
async def test_a_discarded_reservation_sends_nothing_either_way(buffer: str) -> None:
    n = 1000
    with opened(buffer, **ROOMY[buffer]) as buffers:
        seen = Seen()
        async with aperf.PerfStream(buffers.obj.maps["events"], pages=PAGES[buffer]) as stream:
            thread = buffers.spawn(n, cpu=CPU, target="reserve", discard_every=10)
            await read_until(stream, seen, n - n // 10)
            await anyio.to_thread.run_sync(thread.join)
        counts = buffers.counts()
    assert counts.discarded == n // 10 and counts.ok == n - n // 10
    assert seen.seqs == [s for s in range(n) if s % 10]


def test_sync_buffer_reads_either_way() -> None:
    for buffer in ("ringbuf", "perf"):
        with opened(buffer) as buffers:
            seen = Seen()
            pages = None if buffer == "ringbuf" else 16
            with aperf.PerfBuffer(buffers.obj.maps["events"], pages=pages,
                                  on_sample=seen.add, on_lost=seen.add) as pb:
                buffers.emit(500, cpu=CPU)
                while seen.total < 500:
                    pb.poll(1000)
            assert seen.seqs == list(range(500)), buffer


def test_auto_makes_a_ring_buffer_where_the_kernel_has_one() -> None:
    require_kernel()
    assert lb.map_type_supported(BPF_MAP_TYPE_RINGBUF)  # Linux 6.18 has ring buffers
    with aperf.BPFObject(OBJECT, buffer="auto") as obj:
        assert obj.buffer == "ringbuf"
        assert obj.maps["events"].type == BPF_MAP_TYPE_RINGBUF


@pytest.mark.anyio
async def test_auto_falls_back_to_a_perf_event_array(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kernel before 5.8 has no ring buffers: libbpf's probe says so, and "auto" retypes
    # the map. The probe is the one thing faked; the load and the samples are the kernel's.
    from aperf._bpf import object as bpf_object

    asked: list[int] = []

    def no_ring_buffers(map_type: int) -> bool:
        asked.append(map_type)
        return False

    monkeypatch.setattr(bpf_object.lb, "map_type_supported", no_ring_buffers)
    with opened("auto") as buffers:
        assert asked == [BPF_MAP_TYPE_RINGBUF]
        assert buffers.obj.buffer == "perf"
        seen = Seen()
        async with aperf.PerfStream(buffers.obj.maps["events"], pages=8) as stream:
            buffers.emit(100, cpu=CPU)
            await read_until(stream, seen, 100)
        assert seen.seqs == list(range(100)) and seen.cpus == {CPU}


def test_declared_type_without_a_choice() -> None:
    # buffer=None: the map stays as the program declared it, as any libbpf loader leaves it.
    with aperf.BPFObject(OBJECT) as obj:
        assert obj.buffer == "ringbuf"
        assert obj.maps["events"].type == BPF_MAP_TYPE_RINGBUF
    with aperf.BPFObject(object_path("producer")) as plain:
        assert plain.buffer is None  # it declares no APERF_BUFFER


def test_a_bad_choice_names_the_argument() -> None:
    with pytest.raises(aperf.ArgumentError, match="buffer='ring'") as info:
        aperf.BPFObject(OBJECT, buffer="ring")  # type: ignore[arg-type]
    assert info.value.argument == "buffer"
    with pytest.raises(aperf.ArgumentError, match="declares no buffer") as info:
        aperf.BPFObject(object_path("producer"), buffer="perf")
    assert info.value.argument == "buffer"


def test_the_include_dir_holds_the_header() -> None:
    include = aperf.include_dir()
    assert os.path.isfile(os.path.join(include, "aperf", "buffer.bpf.h"))
    printed = subprocess.run([sys.executable, "-m", "aperf", "--include-dir"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    assert printed == include + "\n"
