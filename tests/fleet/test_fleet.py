"""aperf.fleet against a real nats-server with JetStream, started by the tests.

Every kernel test counts exactly: each sample the producer emitted is received
once by the fleet reader, or counted as lost (by the kernel, forwarded as a Lost
notice), as dropped (by the sink), or as a Gap (by the reader). Every asyncio
test runs on the default loop and on uvloop.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import queue
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import nats
import pytest

import aperf
from aperf.fleet import (
    FleetConfigError,
    FleetEvent,
    FleetReader,
    FrameError,
    Gap,
    JetStreamSink,
    Malformed,
    create_stream,
)
from aperf.fleet._gaps import Exposed, Hole, SourceTrack, Verdict
from aperf.fleet._wire import HEADER as WIRE_HEADER
from aperf.fleet._wire import Framer, parse
from aperf.fleet.testing import NatsServer, nats_server_path
from aperf.testing import Producer

from ..helpers import REPO, REQUIRE_BPF, asyncio_only
from ..kernel.test_tracer import HEADER as TRACER_HEADER
from ..kernel.test_tracer import parse_row

CPUS = sorted(os.sched_getaffinity(0))
OTHER_CPU = CPUS[-1]
BIG = 1024  # pages per CPU: room for every sample of the no-loss tests
SEQ_TS = aperf.decoders.from_struct("<QQ", "seq ts")


# --- fixtures and helpers --------------------------------------------------------------


@contextlib.contextmanager
def running_server(directory: Path, **kwargs: Any) -> Iterator[NatsServer]:
    if nats_server_path() is None:
        message = "nats-server is not installed (scripts/setup.sh installs it)"
        if REQUIRE_BPF:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    server = NatsServer(directory, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    with running_server(tmp_path / "nats") as server:
        yield server


async def join(thread: threading.Thread) -> None:
    await asyncio.to_thread(thread.join)


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Wait for ``condition``; fail (not hang) if it never holds. A guard, not a speed test."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def until_async(
    value: Callable[[], Any], expected: Any, what: str, timeout: float = 30.0
) -> None:
    """Wait for the awaitable ``value()`` to give ``expected``; fail (not hang) if it never
    does. A guard, not a speed test."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (got := await value()) != expected:
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {got!r}")
        await asyncio.sleep(0.01)


class Fleet:
    """What a fleet reader handed out, per host: sample sequence numbers, lost, gaps."""

    def __init__(self) -> None:
        self.seqs: dict[str, list[int]] = defaultdict(list)
        self.lost: Counter[str] = Counter()
        self.gap_samples: Counter[str] = Counter()
        self.gap_lost: Counter[str] = Counter()
        self.gaps: list[tuple[str, Gap]] = []
        self.notices: list[tuple[str, str, Malformed]] = []
        self.order: list[str] = []

    def add(self, item: FleetEvent) -> None:
        host, _, event = item
        self.order.append(host)
        if isinstance(event, aperf.Sample):
            self.seqs[host].append(event.value.seq)
        elif isinstance(event, aperf.Lost):
            self.lost[host] += event.count
        elif isinstance(event, Gap):
            self.gaps.append((host, event))
            self.gap_samples[host] += event.samples
            self.gap_lost[host] += event.lost
        elif isinstance(event, Malformed):
            self.notices.append((host, item.stream, event))
        else:  # pragma: no cover - would be a bug
            raise AssertionError(f"unexpected event {item!r}")

    def accounted(self, host: str) -> int:
        """Samples this host's producer emitted that the reader has news of."""
        return (
            len(self.seqs[host]) + self.lost[host] + self.gap_samples[host] + self.gap_lost[host]
        )


async def read_fleet(
    reader: FleetReader, fleet: Fleet, done: Callable[[], bool], timeout: float = 30.0
) -> None:
    async def consume() -> None:
        if done():
            return
        async for item in reader:
            fleet.add(item)
            if done():
                return

    try:
        await asyncio.wait_for(consume(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"the fleet reader stalled: {reader.statistics()}") from None


async def consumer_info(url: str, durable: str) -> Any:
    nc = await nats.connect(url)
    try:
        return await nc.jetstream().consumer_info("APERF", durable)
    finally:
        await nc.close()


def assert_unique(seqs: list[int]) -> None:
    duplicates = [s for s, n in Counter(seqs).items() if n > 1]
    assert not duplicates, f"received more than once: {duplicates[:10]}"


# --- the wire format and the sequence tracking, without a server -------------------------


def test_frames_round_trip_in_order() -> None:
    framer = Framer("web-1.example", "exec", 7, max_events=3, max_bytes=100_000)
    error = aperf.DecodeError(1, b"xy", "too short")
    events = [
        aperf.Sample(0, b"a" * 12), aperf.Sample(0, b"b" * 20), aperf.Sample(1, b"c"),
        aperf.Sample(1, b"d" * 4),  # the fourth sample starts a new message (max_events=3)
        aperf.Lost(1, 99), aperf.Sample(0, b""), aperf.BadSample(1, b"xy", error),
    ]
    outs = framer.frame(events, watermark=0)
    frames = [parse(out.payload) for out in outs]
    assert [(f.first, f.count) for f in frames] == [(0, 3), (3, 1), (4, 1), (5, 1), (6, 1)]
    got: list[Any] = []
    for f in frames:
        assert (f.host, f.stream, f.epoch) == ("web-1.example", "exec", 7)
        got += [aperf.Sample(c, d) for c, d in zip(f.cpus, f.datas, strict=True)] + f.events
    assert got[:6] == events[:6]
    bad = got[6]
    assert (bad.cpu, bad.data, bad.error.reason) == (1, b"xy", "too short")
    # Cumulative counters: samples and lost counts before each message's first event.
    assert [(f.samples_before, f.lost_before) for f in frames] == [
        (0, 0), (3, 0), (4, 0), (4, 99), (5, 99)
    ]
    end = parse(framer.end())
    assert (end.first, end.watermark, end.samples_before, end.lost_before) == (7, 7, 5, 99)


def test_frames_split_by_bytes_and_refuse_bad_input() -> None:
    framer = Framer("h", "s", 1, max_events=1000, max_bytes=70_000)
    outs = framer.frame([aperf.Sample(0, bytes(30_000))] * 5, watermark=0)
    assert [o.count for o in outs] == [2, 2, 1]
    assert all(len(o.payload) <= 70_000 for o in outs)
    with pytest.raises(TypeError, match=r"aperf\.Sample"):
        framer.frame([("not", "an event")], watermark=0)
    with pytest.raises(ValueError, match="longer than a perf record"):
        framer.frame([aperf.Sample(0, bytes(70_000))], watermark=0)
    small = Framer("h", "s", 1, max_events=1000, max_bytes=1_000)  # below one sample: alone
    assert [o.count for o in small.frame([aperf.Sample(0, bytes(3000))] * 2, 0)] == [1, 1]
    with pytest.raises(ValueError, match="host"):
        Framer("has space", "s", 1, max_events=1, max_bytes=70_000)
    for garbage in (b"", b"APF1" + bytes(10), b"XXXX" + bytes(60), outs[0].payload[:-1]):
        with pytest.raises(FrameError):
            parse(garbage)


def test_without_nats_py_the_import_error_names_the_extra() -> None:
    code = "import sys; sys.modules['nats'] = None; import aperf.fleet"  # as if not installed
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert "ImportError: aperf.fleet needs nats-py" in result.stderr
    assert "pip install 'aperf-bpf[nats]'" in result.stderr


def test_sequence_tracking_reports_each_hole_once_and_exactly() -> None:
    track = SourceTrack()
    new, dup = Verdict.NEW, Verdict.DUPLICATE
    # (first, count, samples_before, lost_before, samples, lost), no tags
    assert track.add(10, 5, 100, 7, 5, 0) is new  # a new reader starts mid-stream: floor 10
    assert track.add(15, 1, 105, 7, 0, 3) is new  # a Lost notice of 3
    assert track.add(10, 5, 100, 7, 5, 0) is dup  # a redelivery
    assert track.add(30, 4, 118, 20, 4, 0) is new  # 16..29 missing for now (a retry may come)
    assert track.holes_below(29) == []  # not yet settled: the hole reaches 30
    assert track.add(20, 2, 109, 12, 2, 0) is new  # a retry arrives late, out of order
    assert track.add(5, 2, 0, 0, 2, 0) is new  # before this reader's floor: no hole below 10
    assert track.add(5, 2, 0, 0, 2, 0) is dup  # ... but tracked: a second copy is one
    assert track.holes_below(30) == [Hole(16, 4, 4, 2), Hole(22, 8, 7, 8)]
    assert track.holes_below(34) == []  # reported once
    assert track.end(40, 128, 30) is new and track.checked(40)
    assert track.holes_below(40) == [Hole(34, 6, 6, 10)]
    assert track.ranges == [(5, 7), (10, 40)]
    # Counters that contradict each other (a forger's) claim nothing below zero, and
    # never more samples than the hole has events.
    odd = SourceTrack()
    assert odd.add(0, 2, 0, 50, 2, 0) is new and odd.add(10, 1, 100, 10, 1, 0) is new
    assert odd.holes_below(10) == [Hole(2, 8, 8, 0)]


def chain(forged_from: int) -> tuple[Framer, list[Any], list[Any]]:
    """A sink's 40 events in messages of 10, and a forger's (its own key) from ``forged_from``."""
    sink = Framer("h", "s", 1, max_events=10, max_bytes=100_000)
    forger = Framer("h", "s", 1, max_events=10, max_bytes=100_000)
    genuine = [parse(o.payload) for o in sink.frame([seq_sample(0, i) for i in range(40)], 0)]
    forger.next_seq = forger.samples_total = forged_from
    events = [seq_sample(0, i) for i in range(40 - forged_from)]
    fake = [parse(o.payload) for o in forger.frame(events, forged_from)]
    return sink, genuine, fake


def add(track: SourceTrack, f: Any, origin: int = 0) -> Verdict:
    return track.add(f.first, f.count, f.samples_before, f.lost_before, f.samples, 0,
                     f.tag, f.next, origin)


def test_the_chain_of_tags_refuses_exposes_and_never_lets_a_watermark_hide_events() -> None:
    """SourceTrack with real tags: what a forger who read the stream can and cannot do."""
    sink, genuine, fake = chain(20)

    track = SourceTrack()
    assert add(track, genuine[0]) is Verdict.NEW  # 0..9: trusted on first use
    assert add(track, genuine[1]) is Verdict.NEW and track.checked(10)
    assert add(track, fake[0]) is Verdict.FORGED  # claims 20..29 right after 10..19
    assert add(track, genuine[2]) is Verdict.NEW and track.ranges == [(0, 30)]
    assert add(track, genuine[2]) is Verdict.DUPLICATE  # a retry stored twice

    track = SourceTrack()
    assert add(track, genuine[0]) is Verdict.NEW
    assert add(track, fake[1], origin=7) is Verdict.NEW  # 30..39, ahead: nothing to check by
    assert not track.checked(30)
    # Its watermark (30) would report 10..29 as a Gap and hide them: not from the unchecked.
    assert track.would_settle(30) and track.ranges == [(0, 10), (30, 40)]
    assert add(track, genuine[1]) is Verdict.NEW  # 10..19
    assert add(track, genuine[2]) is Verdict.NEW  # 20..29: leads elsewhere than 30..39 claims
    assert track.exposed == [Exposed(30, 10, 7)] and track.ranges == [(0, 30)]
    assert add(track, genuine[3]) is Verdict.NEW and track.ranges == [(0, 40)]
    assert track.end(40, 40, 0, parse(sink.end()).tag) is Verdict.NEW and track.checked(40)
    assert track.holes_below(40) == []
    assert track.end(40, 40, 0, parse(sink.end()).tag) is Verdict.DUPLICATE  # a redelivery

    track = SourceTrack()  # a forgery over an unchecked range: handed out, and reported
    assert add(track, genuine[0]) is Verdict.NEW
    assert add(track, genuine[2]) is Verdict.NEW  # 20..29 early (a retry after a reconnect)
    assert add(track, fake[0]) is Verdict.CONFLICT  # also claims 20..29
    assert add(track, genuine[1]) is Verdict.NEW and track.ranges == [(0, 30)]
    # An end of stream nothing leads to is not checked (it settles nothing) ...
    assert track.end(40, 40, 0, b"forged-e") is Verdict.NEW and not track.checked(40)
    assert track.ranges == [(0, 30), (40, 40)]
    assert track.end(30, 30, 0, fake[0].tag) is Verdict.FORGED  # ... one that fails the chain
    assert track.end(25, 25, 0, bytes(8)) is Verdict.FORGED  # ... one inside events seen
    track.anchor(40)  # the reader learnt that JetStream's limits removed messages
    assert track.checked(40) and track.holes_below(40) == [Hole(30, 10, 10, 0)]


def test_a_reader_that_meets_a_run_midway_believes_no_sender_and_drops_nothing() -> None:
    """Trust on first use only from a run's first event: a reader that starts in the
    middle of a run (a restart) cannot tell a forger's continuation from the sink's,
    so it hands out both and reports the conflict; it never drops or refuses the
    genuine messages for the forger's (issue 29). Before: the forgery was trusted,
    the genuine message dropped as a duplicate and the next one refused."""
    _, genuine, fake = chain(10)

    track = SourceTrack()  # a restarted reader: its predecessor handed out 0..9
    assert add(track, fake[0]) is Verdict.NEW and not track.checked(10)  # forged 10..19
    assert add(track, genuine[1]) is Verdict.CONFLICT  # the sink's 10..19: handed out too
    assert add(track, genuine[2]) is Verdict.NEW  # and what follows it is not refused
    assert add(track, genuine[1]) is Verdict.DUPLICATE  # a copy of a message seen

    # Below the first range seen (a retry stored late): tracked, so never twice.
    track = SourceTrack()
    assert add(track, genuine[2]) is Verdict.NEW and track.floor == 20
    assert add(track, genuine[1]) is Verdict.NEW and add(track, genuine[1]) is Verdict.DUPLICATE
    assert add(track, genuine[0]) is Verdict.NEW and track.ranges == [(0, 30)]
    assert not track.would_settle(30)  # no hole is reported below where it came in

    # From the run's first event the chain is checked: the same forgery is refused, and
    # so is another message where a checked one starts.
    track = SourceTrack()
    assert add(track, genuine[0]) is Verdict.NEW and track.checked(0)
    assert add(track, fake[0]) is Verdict.FORGED
    assert add(track, genuine[1]) is Verdict.NEW
    impostor = Framer("h", "s", 1, max_events=10, max_bytes=100_000)
    first = parse(impostor.frame([seq_sample(0, 99)], 0)[0].payload)
    assert add(track, first) is Verdict.FORGED  # event 0 again, another tag

    # Signed (trusted) messages are checked wherever the reader comes in.
    track = SourceTrack()
    f = genuine[1]
    assert track.add(f.first, f.count, f.samples_before, f.lost_before, f.samples, 0, f.tag,
                     f.next, 0, trusted=True) is Verdict.NEW and track.checked(10)
    assert add(track, fake[0]) is Verdict.FORGED  # another message where a checked one starts


def test_the_ranges_of_a_run_are_bounded_and_what_is_dropped_is_said() -> None:
    track = SourceTrack(max_ranges=4)
    assert track.add(0, 1, 0, 0, 1, 0) is Verdict.NEW  # no tags: checked
    for first in range(10, 60, 10):  # disjoint ranges, as a forger ahead could send
        track.add(first, 1, first, 0, 1, 0, b"t%07d" % first, None)
    assert len(track.ranges) == 4 and track.forgotten == [(40, 41)]
    assert track.ranges == [(0, 1), (10, 11), (20, 21), (30, 31)] or (0, 1) in track.ranges


# --- against the server and the kernel --------------------------------------------------


def seq_sample(cpu: int, seq: int) -> aperf.Sample:
    """A sample as the producer makes it: u64 sequence number, u64 time, padding."""
    return aperf.Sample(cpu, struct.pack("<QQ", seq, 0) + bytes(20))


@pytest.mark.anyio
@asyncio_only
async def test_events_keep_their_order_kind_and_host(nats_server: NatsServer) -> None:
    url = nats_server.url
    await create_stream(url)
    forwarded_bad = aperf.BadSample(0, b"zz", aperf.DecodeError(0, b"zz", "not an event"))
    sent = [
        seq_sample(0, 0), seq_sample(1, 1), aperf.Lost(1, 5), aperf.Sample(1, b"short"),
        forwarded_bad, seq_sample(0, 2),
    ]
    async with JetStreamSink(url, host="synthetic", name="kinds") as sink:
        await sink.send(sent)
        await sink.flush()
    stats = sink.statistics()
    assert (stats.published, stats.lost_forwarded, stats.bad_forwarded) == (5, 5, 1)

    got: list[FleetEvent] = []
    async with FleetReader(url, durable="kinds", decoder=SEQ_TS) as reader:
        async for batch in reader.batches(2):
            assert 1 <= len(batch) <= 2
            got += batch
            if len(got) == len(sent):
                break
    assert {(h, s) for h, s, _ in got} == {("synthetic", "kinds")}
    events = [e for _, _, e in got]
    assert [type(e) for e in events] == [
        aperf.Sample, aperf.Sample, aperf.Lost, Malformed, aperf.BadSample, aperf.Sample
    ]
    assert [(e.cpu, e.value.seq) for e in events if isinstance(e, aperf.Sample)] == [
        (0, 0), (1, 1), (0, 2)
    ]
    assert events[2] == aperf.Lost(1, 5)
    short = events[3]  # too short for the reader's decoder: one notice for its message
    assert short.subject == "aperf.synthetic.kinds"
    assert "1 of its 1 samples are shorter than the decoder's 16 bytes" in short.reason
    remote = events[4]  # failed on the host, forwarded as it was
    assert (remote.cpu, remote.data, remote.error.reason) == (0, b"zz", "not an event")
    seen = reader.statistics()
    assert (seen.bad, seen.short, seen.samples) == (2, 1, 3)


@pytest.mark.anyio
@asyncio_only
async def test_a_message_jetstream_refuses_is_dropped_counted_and_seen_as_a_gap(
    nats_server: NatsServer,
) -> None:
    url = nats_server.url
    nc = await nats.connect(url)
    try:  # a stream that refuses messages over 2000 bytes
        await nc.jetstream().add_stream(name="APERF", subjects=["aperf.>"], max_msg_size=2000)
    finally:
        await nc.close()
    big = aperf.Sample(0, struct.pack("<QQ", 100, 0) + bytes(2984))
    async with JetStreamSink(url, host="h", name="big") as sink:
        # The sink fits its messages to the stream's limit: 100 samples go in two.
        await sink.send([seq_sample(0, i) for i in range(100)])
        await sink.send([big])  # a 3000-byte sample cannot fit: sent alone, refused
        await sink.flush()
        await sink.send([seq_sample(0, 101)])
    stats = sink.statistics()
    assert stats.dropped_samples == 1 and stats.samples_acknowledged == 101
    [(reason, count)] = stats.dropped.items()
    assert count == 1 and reason.startswith("rejected by JetStream") and "size" in reason

    fleet = Fleet()
    async with FleetReader(url, durable="gap", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: fleet.accounted("h") >= 102)
    assert fleet.seqs["h"] == [*range(100), 101]
    assert fleet.gaps == [("h", Gap(first=100, count=1, samples=1, lost=0))]


@pytest.mark.anyio
@asyncio_only
async def test_concurrent_senders_never_claim_what_is_not_stored(nats_server: NatsServer) -> None:
    """Messages waiting for room are not settled: no watermark may pass them (no false Gap)."""
    url = nats_server.url
    await create_stream(url)
    tasks, per_task, batch = 20, 5, 4
    async with JetStreamSink(url, host="h", name="many", window=1, batch=batch) as sink:

        async def sender(k: int) -> None:
            for j in range(per_task):
                base = (k * per_task + j) * batch
                await sink.send([seq_sample(0, base + i) for i in range(batch)])

        await asyncio.gather(*(sender(k) for k in range(tasks)))
    total = tasks * per_task * batch
    fleet = Fleet()
    async with FleetReader(url, durable="many", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: fleet.accounted("h") >= total)
    assert fleet.gaps == []
    assert sorted(fleet.seqs["h"]) == list(range(total))


@pytest.mark.anyio
@asyncio_only
async def test_reader_acknowledges_only_what_it_handed_out(nats_server: NatsServer) -> None:
    url = nats_server.url
    await create_stream(url)
    async with JetStreamSink(url, host="h", name="acks") as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])  # one message
        await sink.flush()

    async def take(reader: FleetReader, n: int) -> list[int]:
        seqs: list[int] = []
        async for _, _, event in reader:
            seqs.append(event.value.seq)
            if len(seqs) == n:
                break
        return seqs

    # A consumer that stops mid-message continues there with its next loop.
    async with FleetReader(url, durable="one", decoder=SEQ_TS) as reader:
        assert await take(reader, 3) == [0, 1, 2]
        assert await take(reader, 7) == list(range(3, 10))
    info = await consumer_info(url, "one")
    assert (info.num_ack_pending, info.num_pending) == (0, 0)

    # A reader closed mid-message leaves it unacknowledged: the next one gets it all.
    async with FleetReader(url, durable="two", decoder=SEQ_TS, ack_wait=1.0) as reader:
        assert await take(reader, 3) == [0, 1, 2]
    # The message, and the end of stream fetched behind it: acknowledged in order only.
    assert (await consumer_info(url, "two")).num_ack_pending == 2
    async with FleetReader(url, durable="two", decoder=SEQ_TS, ack_wait=1.0) as reader:
        assert await take(reader, 10) == list(range(10))

    # Iterating on after aclose(): it ends. What the reader still held is the next
    # reader's (unacknowledged), so handing it out here too would give it twice.
    async with FleetReader(url, durable="three", decoder=SEQ_TS, ack_wait=1.0) as reader:
        events, batches = aiter(reader), reader.batches(4)
        assert [(await anext(events)).event.value.seq for _ in range(3)] == [0, 1, 2]
    assert [e async for e in events] == [] and [b async for b in batches] == []
    async with FleetReader(url, durable="three", decoder=SEQ_TS, ack_wait=1.0) as reader:
        assert await take(reader, 10) == list(range(10))



@pytest.mark.anyio
@asyncio_only
async def test_a_cancelled_or_timed_out_anext_does_not_end_the_reader(
    nats_server: NatsServer,
) -> None:
    """Iterating was an async generator: a timeout around ``anext()`` (cancelling it
    while it waited for messages) finished the generator, and its next ``anext()``
    said the reader had ended. The iterator is now a class and the fetch the reader's
    own: the same iterator goes on, and what the cut-short fetch brought is kept."""
    url = nats_server.url
    await create_stream(url)
    async with FleetReader(url, durable="patient", decoder=SEQ_TS, fetch_timeout=3.0) as reader:
        events, batches = aiter(reader), reader.batches(4)
        for it in (events, batches, events):  # nothing there: each wait is cut short
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(anext(it), 0.2)
        async with JetStreamSink(url, host="h", name="s", batch=5) as sink:
            await sink.send([seq_sample(0, i) for i in range(10)])  # two messages
        got = [(await asyncio.wait_for(anext(events), 30)).event.value.seq]
        got += [e.event.value.seq for e in await asyncio.wait_for(anext(batches), 30)]
        while len(got) < 10:
            got.append((await asyncio.wait_for(anext(events), 30)).event.value.seq)
    assert got == list(range(10))  # each once, in order, from the same iterators
    assert reader.statistics().samples == 10


@pytest.mark.anyio
@asyncio_only
async def test_an_anext_cancelled_at_any_point_loses_nothing_and_ends_nothing(
    nats_server: NatsServer,
) -> None:
    """A cancel scope (anyio's, as trio users write them) cut short before every other
    ``anext()``: each one cancelled wherever it waits (a fetch, its acknowledgements,
    the question about the end of stream) while the messages arrive one fetch at a
    time. Each cancelled call is followed by one that may wait: together they hand out
    every event once, in order, from the same iterators."""
    url = nats_server.url
    await create_stream(url)
    async with JetStreamSink(url, host="h", name="s", batch=3) as sink:
        await sink.send([seq_sample(0, i) for i in range(12)])  # four messages
    got: list[int] = []
    cancelled = 0

    def seqs(it: Any, item: Any) -> list[int]:
        return [e.event.value.seq for e in item] if it is batches else [item.event.value.seq]

    async with FleetReader(url, durable="scoped", decoder=SEQ_TS, batch=1) as reader:
        events, batches = aiter(reader), reader.batches(2)
        while len(got) < 12:
            it = events if len(got) % 5 else batches
            with anyio.move_on_after(0) as scope:  # cancelled at its first wait
                got += seqs(it, await anext(it))
            cancelled += scope.cancelled_caught
            if len(got) == 12:
                break
            with anyio.fail_after(30):  # a guard: the same iterator goes on
                got += seqs(it, await anext(it))
    assert cancelled  # the scopes did cut waits short
    assert got == list(range(12))  # each once, in order
    assert reader.statistics().samples == 12


@pytest.mark.anyio
@asyncio_only
async def test_async_for_acknowledges_a_message_when_the_consumer_comes_back(
    nats_server: NatsServer,
) -> None:
    """``async for`` takes events one at a time straight from the intake's front, without
    the reader's steps in between. A message is still acknowledged as soon as the
    consumer comes back for the event after its last one (docs/fleet.md): here the first
    of two while the second's events are being handed out."""
    url = nats_server.url
    await create_stream(url)
    async with JetStreamSink(url, host="h", name="s", batch=5) as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])  # two messages
        await sink.flush()
    async with FleetReader(url, durable="prompt", decoder=SEQ_TS) as reader:
        events = aiter(reader)
        for i in range(6):  # the first message, and back for the second's first event
            assert (await asyncio.wait_for(anext(events), 30)).event.value.seq == i

        async def acked() -> int:  # the stream sequence number all below which are acked
            return int((await consumer_info(url, "prompt")).ack_floor.stream_seq)

        # The acknowledgement is sent in the reader's task: wait for it (a guard against
        # hanging, no speed test).
        await until_async(acked, 1, "the first message acknowledged")
        assert await acked() == 1  # and the second is not: it is still being handed out


@pytest.mark.anyio
@asyncio_only
async def test_a_timeout_around_anext_holds_while_the_reader_asks_the_consumer(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader asks the consumer about holes (here: the run's end of stream is to be
    settled) with nats-py requests, which wait with ``asyncio.wait_for``: on Python
    3.11 a cancellation that meets their answer is swallowed, and the consumer's
    timeout never fired (``fleet_view`` ignored SIGTERM). The question now runs in the
    reader's own task; here one that swallows every cancellation, as that race does."""
    url = nats_server.url
    await create_stream(url)
    async with JetStreamSink(url, host="h", name="s") as sink:
        await sink.send([seq_sample(0, 0)])
    asked = asyncio.Event()
    original = nats.js.JetStreamContext.consumer_info

    async def swallowing(self: Any, *args: Any, **kwargs: Any) -> Any:
        asked.set()
        with contextlib.suppress(asyncio.CancelledError):  # as wait_for can
            await asyncio.sleep(1.0)
        return await original(self, *args, **kwargs)

    async with FleetReader(url, durable="asks", decoder=SEQ_TS) as reader:
        events = aiter(reader)
        assert (await asyncio.wait_for(anext(events), 30)).event.value.seq == 0
        monkeypatch.setattr(nats.js.JetStreamContext, "consumer_info", swallowing)

        async def cut_short() -> str:
            with pytest.raises(asyncio.TimeoutError):  # the end of stream: nothing to hand
                await asyncio.wait_for(anext(events), 0.3)
            return "the timeout held"

        assert await asyncio.wait_for(cut_short(), 30) == "the timeout held"
        assert asked.is_set()  # it was asking when the timeout came


@pytest.mark.anyio
@asyncio_only
async def test_samples_arrive_exactly_once(producer: Producer, nats_server: NatsServer) -> None:
    url = nats_server.url
    await create_stream(url)
    n = 80_000  # 48-byte records: 3.8 MB, the ring (4 MiB) takes them all
    async with (
        JetStreamSink(url, host="one", name="producer") as sink,
        aperf.PerfStream(producer.map, pages=BIG) as stream,
    ):
        forward = asyncio.ensure_future(sink.forward(stream))
        await join(producer.spawn(n, size=32, cpu=OTHER_CPU))
        assert producer.counters().failed == 0
        await until(lambda: sink.statistics().samples_acknowledged == n, "all acknowledged")
        stream.close()
        await forward
    stats = sink.statistics()
    assert (stats.samples_published, stats.retried, stats.dropped_samples) == (n, 0, 0)

    fleet = Fleet()
    async with FleetReader(url, durable="once", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: fleet.accounted("one") >= n)
    assert sorted(fleet.seqs["one"]) == list(range(n))  # each exactly once
    assert fleet.gaps == [] and reader.statistics().duplicates == 0
    # published = received + counted lost
    assert stats.samples_published + stats.lost_forwarded == n + fleet.lost["one"]
    # What was handed out was acknowledged (a later END message may still wait).
    assert (await consumer_info(url, "once")).num_ack_pending == 0


@pytest.mark.anyio
@asyncio_only
async def test_several_hosts_read_back_as_one_stream(nats_server: NatsServer, kernel: None) -> None:
    url = nats_server.url
    await create_stream(url)
    hosts = ["db-1", "web-1", "web-2.example.com"]
    n = 20_000

    async def host(name: str, producer: Producer) -> None:
        async with (
            JetStreamSink(url, host=name, name="producer", batch=64) as sink,
            aperf.PerfStream(producer.map, pages=BIG) as stream,
        ):
            forward = asyncio.ensure_future(sink.forward(stream))
            await join(producer.spawn(n, size=32, cpu=OTHER_CPU))
            await until(lambda: stream.statistics().samples == n, f"{name} read")
            stream.close()
            await forward

    producers = [Producer() for _ in hosts]
    try:
        fleet = Fleet()
        async with FleetReader(url, durable="all", decoder={"producer": SEQ_TS}) as reader:
            reading = asyncio.ensure_future(
                read_fleet(reader, fleet, lambda: all(fleet.accounted(h) >= n for h in hosts))
            )
            await asyncio.gather(*(host(h, p) for h, p in zip(hosts, producers, strict=True)))
            await reading
    finally:
        for p in producers:
            p.close()
    for h in hosts:
        assert sorted(fleet.seqs[h]) == list(range(n)), h
    assert set(fleet.order) == set(hosts)
    assert reader.statistics().sources == len(hosts)


def paced(producer: Producer, chunks: int, chunk: int, pause: float) -> threading.Thread:
    """Emit ``chunks`` bursts of ``chunk`` samples, ``pause`` seconds apart (started)."""

    def run() -> None:
        os.sched_setaffinity(0, {OTHER_CPU})
        for _ in range(chunks):
            producer.emit(chunk, size=32, cpu=OTHER_CPU)
            time.sleep(pause)

    thread = threading.Thread(target=run, name="paced-producer", daemon=True)
    thread.start()
    return thread


@pytest.mark.anyio
@asyncio_only
async def test_server_killed_and_restarted_mid_stream(
    producer: Producer, nats_server: NatsServer
) -> None:
    """Every sample is received, or counted: lost by the kernel while the sink waited."""
    url = nats_server.url
    await create_stream(url)
    window, max_pending = 4, 1024
    chunks, chunk = 200, 500  # 100k samples over a second or more; 64 pages hold 5461
    produced = chunks * chunk + 1
    # A reader that stays connected through the crash, next to one that comes after.
    live = Fleet()
    live_reader = FleetReader(url, durable="live", decoder=SEQ_TS)
    await live_reader.open()
    reading = asyncio.ensure_future(
        read_fleet(live_reader, live, lambda: live.accounted("crashy") >= produced, 60)
    )
    async with (
        JetStreamSink(url, host="crashy", window=window, ack_timeout=0.5) as sink,
        aperf.PerfStream(producer.map, pages=64, max_pending=max_pending) as stream,
    ):
        forward = asyncio.ensure_future(sink.forward(stream))
        emitting = paced(producer, chunks, chunk, 0.005)
        await until(lambda: sink.statistics().samples_acknowledged >= 10_000, "traffic")

        nats_server.kill()  # mid-stream: messages in flight, the producer going on
        await until(lambda: not sink.statistics().connected, "the sink to notice")
        # The outage: the sink holds its window and no more; aperf's queue fills; the
        # kernel drops what the ring cannot take (the producer goes on: it gets there).
        await until(lambda: stream.statistics().paused and producer.counters().failed > 0,
                    "a full queue and the kernel's drops")
        s, q = sink.statistics(), stream.statistics()
        assert s.in_flight <= window
        assert s.in_flight_bytes <= window * (1 << 20)
        assert q.paused and q.pending <= max_pending + q.ring_bytes * len(q.cpus) // 48
        assert producer.counters().failed > 0

        nats_server.start()
        await join(emitting)
        # Once everything the ring took is read, one more sample makes the kernel
        # write its lost record (it does so only in front of a sample that fits).
        await until(lambda: stream.statistics().samples == producer.counters().ok, "drain")
        producer.emit(1, size=32, cpu=OTHER_CPU)
        counters = producer.counters()
        await until(
            lambda: sink.statistics().samples_acknowledged == counters.ok
            and sink.statistics().lost_forwarded == counters.failed,
            "everything acknowledged after the restart",
        )
        stream.close()
        await forward
    stats = sink.statistics()
    assert counters.ok + counters.failed == produced
    assert stats.reconnects == 1

    fleet = Fleet()
    async with FleetReader(url, durable="after-crash", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: fleet.accounted("crashy") >= produced)
    await reading
    await live_reader.aclose()
    for name, seen, r in (("after", fleet, reader), ("live", live, live_reader)):
        seqs = seen.seqs["crashy"]
        assert_unique(seqs)
        fate = {
            "received": len(seqs),
            "lost in the kernel (Lost notices)": seen.lost["crashy"],
            "dropped by the sink": stats.dropped_samples,
            "gone from JetStream (Gap)": seen.gap_samples["crashy"] + seen.gap_lost["crashy"],
        }
        print(f"\nrestart test, {produced} samples, {name} reader: {fate}; {r.statistics()}")
        assert sum(fate.values()) == produced
        assert seen.lost["crashy"] == counters.failed  # the kernel's own count, forwarded
        assert set(seqs) <= set(range(produced))
    print(f"sink: {stats}")


@pytest.mark.anyio
@asyncio_only
async def test_stalled_reader_does_not_stall_the_sink(
    producer: Producer, nats_server: NatsServer
) -> None:
    """The stream's limits decide: the sink goes on, the reader is told what was removed."""
    url = nats_server.url
    await create_stream(url, max_msgs=20)
    n_first, n_more = 1_000, 60_000
    fleet = Fleet()
    async with FleetReader(url, durable="slow", decoder=SEQ_TS, batch=2) as reader:
        async with (
            JetStreamSink(url, host="busy", batch=256) as sink,
            aperf.PerfStream(producer.map, pages=BIG) as stream,
        ):
            forward = asyncio.ensure_future(sink.forward(stream))
            await join(producer.spawn(n_first, size=32, cpu=OTHER_CPU))
            await read_fleet(reader, fleet, lambda: len(fleet.seqs["busy"]) >= 1)
            # The reader stalls now, holding part of a fetch, while the host goes on.
            await join(producer.spawn(n_more, size=32, cpu=OTHER_CPU))
            await until(lambda: stream.statistics().samples == n_first + n_more, "read")
            await asyncio.wait_for(sink.flush(), 30)  # never waits for the reader
            stream.close()
            await forward
        stats = sink.statistics()
        assert stats.samples_acknowledged == n_first + n_more and stats.dropped_samples == 0
        total = n_first + n_more
        await read_fleet(reader, fleet, lambda: fleet.accounted("busy") >= total)
    seqs = fleet.seqs["busy"]
    assert_unique(seqs)
    assert fleet.gap_samples["busy"] > 0  # the limit removed messages: reported, exactly
    assert len(seqs) + fleet.gap_samples["busy"] == total
    assert sum(g.count for _, g in fleet.gaps) == fleet.gap_samples["busy"]
    assert producer.counters().failed == 0


async def open_fails(thing: JetStreamSink | FleetReader, match: str) -> FleetConfigError:
    """Opening ``thing`` raises one FleetConfigError matching ``match``; it is returned."""
    with pytest.raises(FleetConfigError, match=match) as info:
        async with thing:
            pass
    return info.value


@pytest.mark.anyio
@asyncio_only
@pytest.mark.filterwarnings("ignore::aperf.fleet.FleetInsecureWarning")  # a password, loopback
async def test_bad_configuration_gives_one_clear_error(tmp_path: Path) -> None:
    with _closed_port() as port:
        url = f"nats://127.0.0.1:{port}"
        for thing in (
            JetStreamSink(url, connect_timeout=1), FleetReader(url, connect_timeout=1)
        ):
            error = await open_fails(thing, "no NATS server answered")
            assert error.argument == "servers"

    with running_server(tmp_path / "auth", user="aperf", password="right") as server:
        wrong = server.url.replace("right", "wrong")
        for thing in (JetStreamSink(wrong), FleetReader(wrong)):
            error = await open_fails(thing, "refused the credentials")
            assert error.argument == "servers"
            assert "wrong" not in str(error)  # no password in the message
        for thing in (JetStreamSink(server.url), FleetReader(server.url)):
            error = await open_fails(thing, "JetStream stream 'APERF' does not exist")
            assert error.argument == "jetstream"
        await create_stream(server.url, subject_prefix="other")
        error = await open_fails(JetStreamSink(server.url), "does not take subject")
        assert error.argument == "jetstream"

    with running_server(tmp_path / "nojs", jetstream=False) as server:
        error = await open_fails(JetStreamSink(server.url), "no JetStream")
        assert error.argument == "servers"

    with pytest.raises(ValueError, match="window"):
        JetStreamSink("nats://127.0.0.1:1", window=0)
    with pytest.raises(TypeError, match="servers"):
        JetStreamSink(4222)  # type: ignore[arg-type]


class _closed_port:
    """A loopback port nothing listens on (bound, never listening, for the test's length)."""

    def __enter__(self) -> int:
        import socket

        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        port: int = self._sock.getsockname()[1]
        return port

    def __exit__(self, *exc: object) -> None:
        self._sock.close()



# --- untrusted messages: forged, malformed, from a third connection ------------------------


def v2_claim(count: int, run: int, runs: int = 1) -> bytes:
    """A samples header claiming ``count`` samples, then one run of ``run`` samples."""
    header = WIRE_HEADER.pack(b"APF2", 1, 1, 1, 7, 0, 0, 0, 0, count, runs, bytes(8), bytes(8))
    return header + b"hs" + struct.pack("<II", 0, run)[: 8 * runs]


def v1_claim(count: int, run: int, runs: int = 1) -> bytes:
    """The same in wire version 1: with one run, the issue's 66-byte message."""
    header = struct.pack("<4sBBBxQQQQQII", b"APF1", 1, 1, 1, 7, 0, 0, 0, 0, count, runs)
    return header + b"hs" + struct.pack("<II", 0, run)[: 8 * runs]


async def publish(url: str, *messages: tuple[str, bytes, str | None]) -> list[int]:
    """Publish (subject, payload, Nats-Msg-Id) from a connection of its own, as anyone
    allowed on the subject could; the stream sequence of each."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        seqs = []
        for subject, payload, msg_id in messages:
            headers = {"Nats-Msg-Id": msg_id} if msg_id else None
            ack = await js.publish(subject, payload, headers=headers)
            assert not ack.duplicate
            seqs.append(ack.seq)
        return seqs
    finally:
        await nc.close()


def forged(host: str, stream: str, epoch: int, first: int, seqs: range) -> bytes:
    """A well-formed message of events ``first..`` holding samples numbered ``seqs``, as
    a forger who read the stream (and knows the run id) frames it: its own tags."""
    framer = Framer(host, stream, epoch, max_events=1024, max_bytes=1 << 20)
    framer.next_seq = framer.samples_total = first
    [out] = framer.frame([seq_sample(0, s) for s in seqs], watermark=first)
    return out.payload


@pytest.mark.anyio
@asyncio_only
async def test_messages_a_reader_cannot_use_are_announced_and_never_block_the_consumer(
    nats_server: NatsServer,
) -> None:
    url = nats_server.url
    await create_stream(url)
    bad = [
        (v2_claim(0, 1 << 28), "claims 0 samples in 1 runs"),  # the run table claims 2^28
        (v2_claim(1 << 28, 1 << 28), "claims 268435456 events"),
        (v2_claim(0, (1 << 32) - 1), "claims 0 samples in 1 runs"),
        (v1_claim(0, 1 << 28), "wire version 1"),  # 66 bytes: 2 GiB before the fix
        (v2_claim(0, 0, runs=0), "claims 0 samples in 0 runs"),  # zero samples, no runs
        (v1_claim(0, 0, runs=0), "wire version 1"),  # ValueError: min() before the fix
        (b"not an aperf message", "too short"),
    ]
    seqs = await publish(url, *((("aperf.h.s", payload, None)) for payload, _ in bad))
    assert len(bad[3][0]) == 66
    async with JetStreamSink(url, host="h", name="s") as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])

    # The first reader hands out one notice and stops: the rest goes to the next one.
    async with FleetReader(url, durable="d", decoder=SEQ_TS, ack_wait=1.0) as first:
        async for item in first:
            assert item == FleetEvent("h", "s", Malformed("aperf.h.s", seqs[0], item.event.reason))
            assert bad[0][1] in item.event.reason
            break
    # The second reader gets the rest, redelivered: read until every notice and sample
    # is in (JetStream redelivers in its own time and order: a message it redelivered
    # to a reader that was closing comes one ack_wait later), then check that each came
    # exactly once. Stopping at the last sample instead was what made this test flaky.
    got: list[FleetEvent] = []

    def notices() -> list[Malformed]:
        return [e for _, _, e in got if isinstance(e, Malformed)]

    def samples() -> list[int]:
        return [e.value.seq for _, _, e in got if isinstance(e, aperf.Sample)]

    async def read_all(reader: FleetReader) -> None:
        async for item in reader:
            got.append(item)
            seen = {n.stream_sequence for n in notices()}
            if len(samples()) >= 10 and seen >= set(seqs[1:]):
                return

    tracemalloc.start()
    try:
        async with FleetReader(url, durable="d", decoder=SEQ_TS, ack_wait=1.0) as reader:
            await asyncio.wait_for(read_all(reader), 60)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"\nthe second reader, 6 bad messages and 10 samples: tracemalloc peak {peak} bytes")
    assert peak < 4 << 20  # 2 GiB before the fix
    by_seq = {n.stream_sequence: n for n in notices()}
    assert sorted(n.stream_sequence for n in notices()) == seqs[1:]  # each once
    assert {n.subject for n in notices()} == {"aperf.h.s"}
    for seq, (_, words) in zip(seqs[1:], bad[1:], strict=True):
        assert words in by_seq[seq].reason, by_seq[seq]
    assert samples() == list(range(10))
    assert {(h, s) for h, s, _ in got} == {("h", "s")}
    stats = reader.statistics()
    assert (stats.malformed, stats.refused, stats.samples) == (len(bad) - 1, 0, 10)
    info = await consumer_info(url, "d")
    assert info.num_ack_pending == 0 and info.num_redelivered <= len(bad)


@pytest.mark.anyio
@asyncio_only
async def test_the_subject_is_the_identity(nats_server: NatsServer) -> None:
    url = nats_server.url
    await create_stream(url)
    seqs = await publish(
        url,
        # a publisher allowed on aperf.mallory.> claims to be web-1 ...
        ("aperf.mallory.x", forged("web-1", "perf", 5, 0, range(1000, 1010)), None),
        # ... and a payload claiming mallory arrives on web-1's subject
        ("aperf.web-1.perf", forged("mallory", "x", 5, 0, range(2000, 2010)), None),
    )
    async with JetStreamSink(url, host="web-1", name="perf") as sink:
        await sink.send([seq_sample(0, i) for i in range(5)])
    fleet = Fleet()
    async with FleetReader(url, durable="who", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: len(fleet.seqs["web-1"]) >= 5)
    assert fleet.seqs == {"web-1": [0, 1, 2, 3, 4]}
    assert [(h, s, n.subject, n.stream_sequence) for h, s, n in fleet.notices] == [
        ("mallory", "x", "aperf.mallory.x", seqs[0]),
        ("web-1", "perf", "aperf.web-1.perf", seqs[1]),
    ]
    assert "claims host 'web-1' and stream 'perf'" in fleet.notices[0][2].reason
    stats = reader.statistics()
    assert (stats.refused, stats.malformed, stats.samples, stats.sources) == (2, 0, 5, 1)


@pytest.mark.anyio
@asyncio_only
async def test_forged_sequence_numbers_never_hide_the_genuine_events(
    nats_server: NatsServer,
) -> None:
    """A forger who reads the stream and may publish on the host's subject claims the
    live sink's next events: refused; further ahead: handed out, then shown forged."""
    url = nats_server.url
    await create_stream(url)
    subject = "aperf.web-1.perf"
    async with JetStreamSink(url, host="web-1", name="perf") as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])  # events 0..9
        await sink.flush()
        nc = await nats.connect(url)
        try:
            stored = await nc.jetstream().get_last_msg("APERF", subject)
        finally:
            await nc.close()
        run = parse(stored.data).epoch
        seen_id = (stored.headers or {})["Nats-Msg-Id"]
        prefix = seen_id.split(".0.")[0]  # <host>.<stream>.<run>
        assert prefix == f"web-1.perf.{run:016x}"
        fake = await publish(
            url,
            # the next events, 10..19, on the host's own subject (the server let it) ...
            (subject, forged("web-1", "perf", run, 10, range(1000, 1010)), f"{prefix}.10.x"),
            # ... and under the message id the sink's next message had before: a
            # publisher on its own subject made JetStream drop the genuine one as a copy
            ("aperf.mallory.x", forged("web-1", "perf", run, 10, range(1000, 1010)),
             f"{prefix}.10"),
            # events 20..29, before the reader has seen 10..19: nothing to check them by yet
            (subject, forged("web-1", "perf", run, 20, range(2000, 2010)), None),
        )
        await sink.send([seq_sample(0, i) for i in range(10, 20)])  # the genuine 10..19
        await sink.send([seq_sample(0, i) for i in range(20, 30)])  # and 20..29
    stats = sink.statistics()
    assert (stats.samples_acknowledged, stats.duplicates, stats.dropped_samples) == (30, 0, 0)

    fleet = Fleet()
    async with FleetReader(url, durable="forged", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: 29 in fleet.seqs["web-1"])
        seen = reader.statistics()
    genuine = [s for s in fleet.seqs["web-1"] if s < 1000]
    assert genuine == list(range(30))  # every genuine event, once, in order
    assert fleet.gaps == []
    # The forgery ahead was handed out (nothing could tell yet), then flagged.
    assert [s for s in fleet.seqs["web-1"] if s >= 1000] == list(range(2000, 2010))
    notices = [(n.subject, n.stream_sequence, n.reason) for _, _, n in fleet.notices]
    assert [(s, q) for s, q, _ in notices] == [
        (subject, fake[0]), ("aperf.mallory.x", fake[1]), (subject, fake[2])
    ]
    assert "do not follow the run's chain of tags: forged" in notices[0][2]
    assert "events 20..29" in notices[2][2] and "were forged" in notices[2][2]
    assert (seen.refused, seen.conflicts, seen.duplicates, seen.gaps) == (2, 1, 0, 0)
    assert seen.samples == 30 + 10


@pytest.mark.anyio
@asyncio_only
async def test_a_url_that_is_not_one_gives_fleet_config_error() -> None:
    for url in ("nats://[::1", "nats://127.0.0.1:99999", ["nats://127.0.0.1:4222", "tls://:1"]):
        for make in (JetStreamSink, FleetReader):
            with pytest.raises(FleetConfigError, match="is not a NATS URL") as info:
                async with make(url, connect_timeout=1):
                    pass
            assert info.value.argument == "servers"


@pytest.mark.parametrize(
    "args, words",
    [
        (["--nats", "nats://[::1"], "argument --nats: 'nats://[::1' is not a NATS URL"),
        (["--nats", "nats://127.0.0.1:99999"], "port out of range"),
        (["--nats", "nats://127.0.0.1:4222", "--host", ""], "argument --host: the host name"),
        (["--nats", "nats://127.0.0.1:4222", "--host", "h" * 300], "not 300"),
        (["--nats", "nats://127.0.0.1:4222", "--host", "two words"], "spaces"),
    ],
    ids=["ipv6", "port", "empty-host", "long-host", "space-host"],
)
def test_tracer_with_a_bad_nats_option_says_so_in_one_line(args: list[str], words: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "aperf", "trace", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m aperf trace: error: ") and words in lines[0]


# --- the tracer as a fleet ---------------------------------------------------------------


class Lines:
    """A ``python -m <module>`` subprocess from the repository root; stdout line by line."""

    def __init__(self, module: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], cwd=REPO, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def read_until(self, done: Callable[[list[str]], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.seen):
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.fail(f"timed out after {timeout} s")
            if line is None:
                self.fail("it ended early")
            self.seen.append(line)

    def fail(self, why: str) -> None:
        self.proc.kill()
        _, err = self.proc.communicate()
        pytest.fail(f"{why}; stdout:\n" + "\n".join(self.seen[-40:]) + f"\nstderr:\n{err}")

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=20)

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def test_tracers_publish_and_the_viewer_merges_hosts(
    tracefs: None, nats_server: NatsServer, tmp_path: Path
) -> None:
    url = nats_server.url
    asyncio.run(create_stream(url))
    probe = tmp_path / "fleetprobe"
    shutil.copy("/bin/true", probe)
    hosts = ("alpha", "beta")
    header = "HOST             " + TRACER_HEADER
    with (
        Lines("examples.fleet_view", "--nats", url) as viewer,
        Lines("aperf", "trace", "--nats", url, "--host", hosts[0]) as a,
        # The teaching tracer (what scripts/tracer.sh runs) publishes the same way.
        Lines("examples.bootstrap_legacy", "--nats", url, "--host", hosts[1]) as b,
    ):
        for tracer in (a, b):
            tracer.read_until(lambda seen: TRACER_HEADER in seen)
        viewer.read_until(lambda seen: header in seen)
        probe_proc = subprocess.Popen([probe])
        probe_proc.wait()
        pid = probe_proc.pid

        def rows() -> list[tuple[str, Any]]:
            return [
                (line[:16].rstrip(), parse_row(line[17:]))
                for line in viewer.seen[viewer.seen.index(header) + 1 :]
            ]

        def both_hosts_saw_it(_: list[str]) -> bool:
            mine = {(h, r.event) for h, r in rows() if r.pid == pid and r.comm == "fleetprobe"}
            return mine == {(h, e) for h in hosts for e in ("EXEC", "EXIT")}

        viewer.read_until(both_hosts_saw_it)
        exec_rows = [r for h, r in rows() if r.pid == pid and r.event == "EXEC"]
        assert {r.detail for r in exec_rows} == {str(probe)}
        assert {r.exit_code for h, r in rows() if r.pid == pid and r.event == "EXIT"} == {0}
        assert {h for h, _ in rows()} <= set(hosts)
        assert a.stop(signal.SIGINT) == 0 and b.stop(signal.SIGTERM) == 0
        assert viewer.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize("tracer", [["aperf", "trace"], ["examples.bootstrap_legacy"]])
def test_tracer_with_a_missing_jetstream_stream_says_so_in_one_line(
    tracefs: None, nats_server: NatsServer, tracer: list[str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", *tracer, "--nats", nats_server.url],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nats" in lines[0] and "'APERF' does not exist" in lines[0]


EVENT_LINE = re.compile(r"\d\d:\d\d:\d\d (EXEC|EXIT) ")


def test_tracer_stops_at_once_while_jetstream_is_away(
    tracefs: None, nats_server: NatsServer
) -> None:
    """Ctrl-C must not wait for the server: the sink gives up, counting what it held."""
    asyncio.run(create_stream(nats_server.url))
    with Lines("aperf", "trace", "--nats", nats_server.url, "--host", "h") as tracer:
        tracer.read_until(lambda seen: TRACER_HEADER in seen)
        shown = len(tracer.seen)
        nats_server.kill()
        subprocess.run(["/bin/true"], check=True)  # an event after the kill, at least
        # A batch is printed, then sent; once the sink knows the server is gone its send()
        # waits, and the tracer prints nothing more. That batch may be another process's
        # exec (a busy machine has many): then ours is never printed. So any event line.
        tracer.read_until(lambda seen: any(EVENT_LINE.match(line) for line in seen[shown:]))
        time.sleep(0.5)  # the tracer is waiting in send() by now; it must stop either way
        assert tracer.stop(signal.SIGINT) == 0


# --- the events' own time ----------------------------------------------------------------


def exec_event_bytes(decode: Callable[[bytes], Any], pid: int, boot_ns: int) -> bytes:
    """A ``struct event`` exec of ``pid`` stamped ``boot_ns``, checked with the decoder."""
    data = bytearray(176)  # bpf/bootstrap.h: pid, ppid, exit_code, duration, comm, ...
    struct.pack_into("<ii", data, 0, pid, 1)
    data[24:28] = b"old\0"
    data[40:49] = b"/bin/old\0"
    struct.pack_into("<Q", data, 168, boot_ns)  # timestamp_ns, the last field
    value = decode(bytes(data))
    assert (value.pid, value.comm, value.filename, value.timestamp_ns) == (
        pid, "old", "/bin/old", boot_ns
    )
    return bytes(data)


@pytest.mark.anyio
@asyncio_only
async def test_the_reader_has_each_hosts_boot_clock_offset(nats_server: NatsServer) -> None:
    url = nats_server.url
    await create_stream(url)
    before = time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    async with JetStreamSink(url, host="timed", name="t") as sink:
        await sink.send([seq_sample(0, 0)])
        await sink.flush()
    after = time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    async with FleetReader(url, durable="timed", decoder=SEQ_TS) as reader:
        assert reader.boot_offset_ns("timed") is None  # nothing read yet
        async for host, _stream, _event in reader:
            assert host == "timed"
            break
        offset = reader.boot_offset_ns("timed")
        assert offset is not None
        # This host's own offset, measured around the sink's (the clocks read apart).
        assert min(before, after) - 50_000_000 <= offset <= max(before, after) + 50_000_000
        assert reader.boot_offset_ns("elsewhere") is None


def test_the_viewer_shows_when_the_event_happened(kernel: None, nats_server: NatsServer) -> None:
    """An exec stamped ten minutes ago is shown ten minutes ago, not when it was read.

    The sender runs in a time namespace whose boot clock is an hour ahead, so that
    "ten minutes ago" exists on a machine booted a minute ago too; its sink announces
    that namespace's boot offset, as a sender on another host would announce its own.
    (``kernel``: the tier where the tracer's object is built; it is opened, not loaded.)"""
    url = nats_server.url
    asyncio.run(create_stream(url))
    ago = 600 * 10**9
    sender = f"""
import asyncio, time
import aperf
from aperf.fleet import JetStreamSink
from aperf._tools.trace.cli import FLEET_STREAM, shipped_object
from aperf._tools.trace.render import event_decoder
from tests.fleet.test_fleet import exec_event_bytes

boot_now = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
assert boot_now > {ago}, boot_now
with aperf.BPFObject(shipped_object()) as obj:
    data = exec_event_bytes(event_decoder(obj), 4242, boot_now - {ago})

async def publish() -> None:
    async with JetStreamSink({url!r}, host="past", name=FLEET_STREAM) as sink:
        await sink.send([aperf.Sample(0, data)])
        await sink.flush()

asyncio.run(publish())
"""
    subprocess.run(
        ["unshare", "--time", "--boottime", "3600", "--fork", sys.executable, "-c", sender],
        cwd=REPO, check=True, timeout=120,
    )
    with Lines("examples.fleet_view", "--nats", url) as viewer:
        viewer.read_until(lambda seen: any(" EXEC  old " in line for line in seen))
        (line,) = [line for line in viewer.seen if " EXEC  old " in line]
        shown = datetime.datetime.strptime(line[17:25], "%H:%M:%S").time()
        assert viewer.stop(signal.SIGTERM) == 0
    expected = datetime.datetime.now() - datetime.timedelta(seconds=600)
    distance = abs(
        datetime.datetime.combine(expected.date(), shown) - expected
    ).total_seconds()
    assert min(distance, 86_400 - distance) < 30, (line, expected)
    assert line.startswith("past ") and parse_row(line[17:]).pid == 4242
