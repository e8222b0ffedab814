"""Recordings and their replay without root (FakeRingSource): a recording holds every
sample and every loss the stream delivered, in order, in segments each readable on its
own; a replay hands out the same samples and lost notices in the same order in every
reading mode, on asyncio, uvloop and trio; write failures are counted and noted, never
silent; a process killed while recording leaves only the segment it was writing
incomplete; a damaged file is a typed error."""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import aperf
from aperf._recording import files as _files
from aperf.testing import FakeRingSource

QQ = aperf.decoders.from_struct("<QQ", names="seq ts")
RING = 4096  # 127 samples of 16 bytes fit (32-byte records; the 128th slot holds a lost record)


class QQCtypes(ctypes.Structure):  # the same layout as QQ, declared another way
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


def flat(items: list[Any]) -> list[Any]:
    """Items of a stream as (cpu, data) per sample and ("lost", cpu, count) per notice."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, aperf.SampleArray):  # each row's bytes, as Sample.data has them
            columns = item._columns
            raw = columns.raw_column(columns.tabler(raw=True), item).to_pylist()
            out += [(item.cpu, data) for data in raw]
        elif isinstance(item, aperf.Lost):
            out.append(("lost", item.cpu, item.count))
        else:
            out.append((item.cpu, item.data))
    return out


def produce(src: FakeRingSource, plan: list[tuple[int, int]], seq: int = 0) -> list[
        tuple[int, int]]:
    """Write (cpu, count) bursts of sequence-numbered samples (from ``seq``); the
    (cpu, seq) that fitted."""
    kept = []
    for cpu, count in plan:
        for _ in range(count):
            if src.write(cpu, QQ.struct.pack(seq, 1000 + seq)):
                kept.append((cpu, seq))
            seq += 1
    return kept


PLAN = [(0, 50), (1, 30), (0, 200), (1, 10), (0, 5), (1, 150), (0, 1)]


async def record_plan(path: Path, plan: list[tuple[int, int]] = PLAN,
                      **options: Any) -> tuple[FakeRingSource, list[tuple[int, int]], Any]:
    """A stream of ``plan`` recorded with stream.record(); its source, what fitted, stats."""
    src = FakeRingSource(cpus=[0, 1], ring_bytes=RING)
    result: dict[str, Any] = {}
    async with aperf.PerfStream(src, decoder=QQ) as stream:

        async def record() -> None:
            result["stats"] = await stream.record(path, **options)

        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            kept = []
            for burst, (cpu, count) in enumerate(plan):
                kept += produce(src, [(cpu, count)], sum(n for _, n in plan[:burst]))
                with anyio.fail_after(10):
                    while src.pending_bytes(0) or src.pending_bytes(1):  # until read
                        await anyio.sleep(0.001)
            await stream.aclose()
    return src, kept, result["stats"]


@pytest.mark.anyio
async def test_a_recording_holds_every_sample_and_every_loss(tmp_path: Path) -> None:
    src, kept, stats = await record_plan(tmp_path / "rec")
    recording = aperf.Recording(tmp_path / "rec")
    table = recording.samples()
    rows = list(zip(table.column("_cpu").to_pylist(), table.column("seq").to_pylist(),
                    strict=True))
    for cpu in (0, 1):  # per ring, every sample that fitted, in ring order
        assert [s for c, s in rows if c == cpu] == [s for c, s in kept if c == cpu]
    assert table.column("ts").to_pylist() == [s + 1000 for _, s in rows]
    assert table.column("_data").to_pylist() == [
        QQ.struct.pack(s, s + 1000) + bytes(4) for _, s in rows]  # as Sample.data: padded
    losses = recording.losses()
    for cpu in (0, 1):  # every drop, counted on its ring
        lost = [n for c, n in zip(losses.column("_cpu").to_pylist(),
                                  losses.column("count").to_pylist(), strict=True) if c == cpu]
        assert sum(lost) == src.dropped(cpu) > 0
    assert set(losses.column("cause").to_pylist()) == {"ring"}
    assert stats.rows == len(kept) and stats.lost == src.dropped(0) + src.dropped(1)
    assert stats.files == 1 and stats.unwritten == 0 and stats.errors == 0
    assert len(kept) + stats.lost == sum(n for _, n in PLAN)


def tap(path: Path, mode: str) -> list[Any]:
    """What a live stream delivered (flat), its rings drained between bursts (so that
    the kernel-like fake writes lost records in front of later samples), while a
    Recorder wrote it: the items handed to the callbacks, in order."""
    src = FakeRingSource(cpus=[0, 1], ring_bytes=RING, exact_lost=False)
    items: list[Any] = []

    def keep(item: Any) -> None:
        items.append(item)
        recorder.write(item)

    with aperf.Recorder(path, QQ, rings=[(None, 0), (None, 1)]) as recorder:
        on = {"on_array": keep} if mode == "arrays" else {"on_sample": keep}
        with aperf.PerfBuffer(src, decoder=QQ, on_lost=keep, **on) as pb:
            kept = []
            for burst, (cpu, count) in enumerate(PLAN):
                kept += produce(src, [(cpu, count)], sum(n for _, n in PLAN[:burst]))
                pb.consume()
    live = flat(items)
    assert len([i for i in live if i[0] != "lost"]) == len(kept)
    return live


@pytest.mark.anyio
@pytest.mark.parametrize("recorded_as", ["arrays", "events"])
async def test_a_replay_hands_out_what_the_live_stream_delivered(
        tmp_path: Path, recorded_as: str) -> None:
    live = tap(tmp_path / "rec", recorded_as)
    assert any(i[0] == "lost" for i in live)

    async def replayed(mode: str) -> list[Any]:
        source = aperf.replay(tmp_path / "rec")
        out: list[Any] = []
        async with aperf.PerfStream(source, decoder=source.decoder, max_pending=64) as stream:
            if mode == "events":
                out += [e async for e in stream]
            elif mode == "batches":
                async for batch in stream.batches(7):
                    out += batch
            elif mode == "arrays":
                out += [a async for a in stream.arrays(max_rows=40)]
            elif mode == "run":
                await stream.run(out.append, on_lost=out.append)
            elif mode == "run_arrays":
                await stream.run_arrays(out.append, on_lost=out.append)
            elif mode == "lease":
                while not stream.closed:
                    async with stream.lease() as batch:
                        out += [(i.cpu, i.values.copy(), i) if isinstance(
                            i, aperf.SampleArray) else i for i in batch]
                out = [i[2] if isinstance(i, tuple) else i for i in out]
        assert stream.closed  # the end of the recording closed the stream
        return out

    for mode in ("events", "batches", "arrays", "run", "run_arrays"):
        assert flat(await replayed(mode)) == live, mode
    events = await replayed("events")
    assert all(e.value == QQ(e.data) for e in events if isinstance(e, aperf.Sample))


def test_a_sync_buffer_replays_the_same(tmp_path: Path) -> None:
    live = tap(tmp_path / "rec", "arrays")
    for columnar in (False, True):
        out: list[Any] = []
        source = aperf.replay(tmp_path / "rec")
        callbacks: dict[str, Any] = {"on_array": out.append} if columnar else {
            "on_sample": out.append}
        with aperf.PerfBuffer(source, decoder=QQ, on_lost=out.append, **callbacks) as pb:
            while not pb.closed:
                pb.poll(1000)
        assert flat(out) == live
    with aperf.PerfBuffer(aperf.replay(tmp_path / "rec"), decoder=QQ,
                          on_sample=print) as pb:
        leased: list[Any] = []
        while not pb.closed:
            with pb.lease(timeout_ms=1000) as batch:
                leased += flat(batch)
    assert leased == live


@pytest.mark.anyio
async def test_segments_rotate_by_size_and_each_reads_on_its_own(tmp_path: Path) -> None:
    plan = [(i % 2, 60) for i in range(20)]
    src, kept, stats = await record_plan(tmp_path / "rec", plan, max_file_bytes=6000,
                                         row_group_bytes=2000, compression="none")
    recording = aperf.Recording(tmp_path / "rec")
    assert stats.files == len(recording.segments) > 3 and recording.partial == []
    first_row = 0
    all_rows = []
    for segment in recording.segments:  # each file alone: complete, its own metadata
        meta = recording.file_metadata(segment.samples)
        table = pq.read_table(segment.samples)
        assert int(meta["aperf.first_row"]) == first_row
        assert int(pq.read_metadata(segment.samples).metadata[b"aperf.rows"]) == table.num_rows
        first_row += table.num_rows
        all_rows += zip(table.column("_cpu").to_pylist(), table.column("seq").to_pylist(),
                        strict=True)
        losses = pq.read_table(segment.losses)
        assert all(first_row - table.num_rows <= r <= first_row
                   for r in losses.column("_row").to_pylist())
    for cpu in (0, 1):
        assert [s for c, s in all_rows if c == cpu] == [s for c, s in kept if c == cpu]
    assert sum(recording.losses().column("count").to_pylist()) == stats.lost == (
        src.dropped(0) + src.dropped(1))


def test_segments_rotate_by_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10**18]
    monkeypatch.setattr(aperf.Recorder, "now_ns", lambda self: clock[0])
    with aperf.Recorder(tmp_path / "rec", QQ, max_file_seconds=2) as recorder:
        for second in range(7):
            recorder.write(aperf.Sample(0, QQ.struct.pack(second, 0)))
            clock[0] += 10**9
            recorder.tick()  # what a stream with nothing to write calls
    recording = aperf.Recording(tmp_path / "rec")
    sizes = [pq.read_metadata(s.samples).num_rows for s in recording.segments]
    assert sizes == [2, 2, 2, 1]
    times = recording.samples().column("_time").cast(pa.int64()).to_pylist()
    assert times == [10**15 + s * 10**6 for s in range(7)]  # microseconds


def test_closed_files_are_readable_while_recording_goes_on(tmp_path: Path) -> None:
    with aperf.Recorder(tmp_path / "rec", QQ, row_group_bytes=1) as recorder:
        for seq in range(5):
            recorder.write(aperf.Sample(0, QQ.struct.pack(seq, 0)))
        recorder.rotate()
        recorder.write(aperf.Sample(0, QQ.struct.pack(5, 0)))  # segment 2, being written
        names = sorted(os.listdir(tmp_path / "rec"))
        assert names == ["losses-000001.parquet", "samples-000001.parquet",
                         "samples-000002.parquet.partial"]
        during = aperf.Recording(tmp_path / "rec")
        assert during.samples().column("seq").to_pylist() == list(range(5))
        assert during.partial == [str(tmp_path / "rec" / "samples-000002.parquet.partial")]
    assert aperf.Recording(tmp_path / "rec").samples().column("seq").to_pylist() == list(
        range(6))


def test_each_file_says_where_and_how_it_was_recorded(tmp_path: Path) -> None:
    with aperf.Recorder(tmp_path / "rec", QQCtypes, source="fake") as recorder:
        recorder.write(aperf.Sample(0, QQ.struct.pack(1, 2)))
    recording = aperf.Recording(tmp_path / "rec")
    segment = recording.segments[0]
    for path in (segment.samples, segment.losses):
        meta = recording.file_metadata(path)
        assert meta["aperf.host"] == os.uname().nodename
        assert meta["aperf.kernel"].startswith(os.uname().release)
        assert meta["aperf.version"] == aperf.__version__
        assert meta["aperf.source"] == "fake"
    offset = recording.boot_offset_ns
    boot = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    assert offset is not None and abs(boot + offset - time.time_ns()) < 10**9
    assert recording.decoder is not None and recording.decoder.name == "QQCtypes"
    assert recording.decoder(QQ.struct.pack(1, 2)) == (1, 2)  # compiled again from the layout


def test_a_directory_others_could_write_to_or_holding_a_recording_is_refused(
        tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(aperf.RecordingError, match="another user owns it or may write") as err:
        aperf.Recorder(shared, QQ)
    assert err.value.errno == errno.EPERM
    with aperf.Recorder(tmp_path / "rec", QQ):
        pass
    with pytest.raises(aperf.RecordingError, match="already holds a recording") as err:
        aperf.Recorder(tmp_path / "rec", QQ)
    assert err.value.errno == errno.EEXIST
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "samples-000001.parquet.partial").symlink_to(tmp_path / "victim")
    with pytest.raises(aperf.RecordingError, match="already holds"):
        aperf.Recorder(planted, QQ)
    assert not (tmp_path / "victim").exists()


@pytest.mark.anyio
async def test_a_replay_refuses_another_decoder_and_names_both(tmp_path: Path) -> None:
    await record_plan(tmp_path / "rec", [(0, 3)])
    other = aperf.decoders.from_struct("<QI4x", names="seq small")
    with pytest.raises(aperf.DecoderMismatchError) as err:
        aperf.PerfStream(aperf.replay(tmp_path / "rec"), decoder=other)
    assert "struct '<QQ'" in str(err.value) and "struct '<QI4x'" in str(err.value)
    assert isinstance(err.value, TypeError)
    with pytest.raises(aperf.DecoderMismatchError, match="members"):  # fields f0, f1
        aperf.PerfStream(aperf.replay(tmp_path / "rec"), decoder=struct.Struct("<QQ"))
    for same in (QQ, QQCtypes, None):  # one layout, however declared; or raw bytes
        async with aperf.PerfStream(aperf.replay(tmp_path / "rec"), decoder=same) as stream:
            assert len([e async for e in stream]) == 3


def test_a_paced_replay_takes_at_least_the_recorded_time_scaled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [10**18]
    with monkeypatch.context() as patch:
        patch.setattr(aperf.Recorder, "now_ns", lambda self: clock[0])
        with aperf.Recorder(tmp_path / "rec", QQ, rings=[(None, 0)]) as recorder:
            for seq in range(5):
                recorder.write(aperf.Sample(0, QQ.struct.pack(seq, 0)))
                recorder.write(aperf.Lost(0, 1))
                clock[0] += 10**9  # a second apart
    out: list[Any] = []
    start = time.monotonic()
    with aperf.PerfBuffer(aperf.replay(tmp_path / "rec", speed=20), decoder=QQ,
                          on_sample=out.append, on_lost=out.append) as pb:
        while not pb.closed:
            pb.poll(1000)
    assert time.monotonic() - start >= 4 / 20  # the last came 4 recorded seconds in
    assert [e.value.seq if isinstance(e, aperf.Sample) else "lost" for e in out] == [
        0, "lost", 1, "lost", 2, "lost", 3, "lost", 4, "lost"]


@pytest.mark.anyio
async def test_a_replay_waits_for_a_slow_consumer_and_loses_nothing(tmp_path: Path) -> None:
    live = tap(tmp_path / "rec", "arrays")
    source = aperf.replay(tmp_path / "rec")
    out: list[Any] = []
    async with aperf.PerfStream(source, decoder=QQ, max_pending=3) as stream:
        async for event in stream:
            out.append(event)
            await anyio.sleep(0)
        stats = stream.statistics()
    assert flat(out) == live
    assert stats.lost == sum(i[2] for i in live if i[0] == "lost")


def test_damaged_recordings_are_typed_errors(tmp_path: Path) -> None:
    with aperf.Recorder(tmp_path / "rec", QQ) as recorder:
        recorder.write(aperf.Sample(0, QQ.struct.pack(1, 2)))
    samples = tmp_path / "rec" / "samples-000001.parquet"
    good = samples.read_bytes()
    for damaged in (b"not parquet at all", good[: len(good) // 2]):
        samples.write_bytes(damaged)
        with pytest.raises(aperf.RecordingFormatError, match=r"samples-000001\.parquet"):
            aperf.Recording(tmp_path / "rec")
    table = pq.read_table(pa.BufferReader(good))
    for key, value in ((b"aperf.format", b"99"), (b"aperf.decoder", b"{not json"),
                       (b"aperf.decoder", b'{"name": "x", "order": "<", "size": 8, "layout": '
                                          b'{"kind": "array", "count": 99999999, "elem": '
                                          b'{"kind": "int", "size": 8, "signed": false, '
                                          b'"c": "int"}}}')):
        meta = dict(table.schema.metadata)
        meta[key] = value
        pq.write_table(table.replace_schema_metadata(meta), samples)
        with pytest.raises(aperf.RecordingFormatError):
            aperf.Recording(tmp_path / "rec")
    with pytest.raises(aperf.RecordingFormatError, match="no closed segment"):
        aperf.Recording(tmp_path)


def test_a_segment_that_cannot_be_written_is_counted_and_noted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened = []
    real_open = _files.open_new

    def open_new(path: str) -> Any:
        opened.append(path)
        if "samples-000002" in path:  # the second samples file: as if the disk were full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path)

    monkeypatch.setattr("aperf._recording.writer.open_new", open_new)
    with aperf.Recorder(tmp_path / "rec", QQ, row_group_bytes=1,
                        on_write_error="count") as recorder:
        for seq in range(3):
            recorder.write(aperf.Sample(seq % 2, QQ.struct.pack(seq, 0)))
        recorder.write(aperf.Lost(1, 9))
        recorder.rotate()  # segment 1 closed
        for seq in range(3, 8):  # seq 3 begins segment 2, whose samples file cannot be made
            recorder.write(aperf.Sample(seq % 2, QQ.struct.pack(seq, 0)))
        recorder.write(aperf.Lost(0, 4))
        recorder.write(aperf.Sample(0, QQ.struct.pack(8, 0)))
        stats = recorder.statistics()
    assert stats.errors == 1 and stats.unwritten == 1 and "No space left" in stats.last_error
    recording = aperf.Recording(tmp_path / "rec")
    assert recording.partial == []  # the abandoned segment's files were removed
    seqs = recording.samples().column("seq").to_pylist()
    losses = recording.losses().to_pylist()
    # Nothing silent: every sample is a row, or counted where it went missing, per ring.
    notes = [(r["_cpu"], r["count"], r["_row"], r["cause"]) for r in losses]
    assert (1, 9, 3, "ring") in notes and (1, 1, 3, "recorder") in notes
    missing = len(range(9)) - len(seqs)
    assert sum(n for _, n, _, cause in notes if cause == "recorder") == missing == (
        stats.unwritten)
    with pytest.raises(aperf.RecordingError, match="No space left") as err:
        monkeypatch.setattr("aperf._recording.writer.open_new",
                            lambda path: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        with aperf.Recorder(tmp_path / "raising", QQ, row_group_bytes=1) as recorder:
            recorder.write(aperf.Sample(0, QQ.struct.pack(1, 0)))
    assert err.value.errno == errno.ENOSPC and "segment 1 abandoned" in str(err.value)


WRITER = """
import struct, sys, aperf
QQ = aperf.decoders.from_struct("<QQ", names="seq ts")
recorder = aperf.Recorder(sys.argv[1], QQ, max_file_bytes=20000, row_group_bytes=2000)
seq = 0
while True:
    recorder.write([aperf.Sample(seq % 2, QQ.struct.pack(seq + i, 0)) for i in range(50)])
    seq += 50
"""


def test_a_recording_killed_mid_file_leaves_every_closed_file_intact(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    try:
        deadline = time.monotonic() + 60
        while len(list(path.glob("samples-*.parquet"))) < 3:  # three segments closed
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    recording = aperf.Recording(path)
    numbers = [s.number for s in recording.segments]
    assert numbers == list(range(1, len(numbers) + 1))
    partial = sorted(p.name for p in path.glob("*.partial"))
    assert set(partial) <= {f"samples-{len(numbers) + 1:06d}.parquet.partial",
                            f"losses-{len(numbers) + 1:06d}.parquet.partial"}
    seqs = recording.samples().column("seq").to_pylist()
    assert seqs == list(range(len(seqs)))  # every closed file whole, none missing


class ExecEvent(ctypes.Structure):  # the tracer's struct event (bpf/bootstrap.h)
    _fields_ = [("pid", ctypes.c_int), ("ppid", ctypes.c_int), ("exit_code", ctypes.c_uint),
                ("duration_ns", ctypes.c_ulonglong), ("comm", ctypes.c_char * 16),
                ("filename", ctypes.c_char * 127), ("exit_event", ctypes.c_bool),
                ("timestamp_ns", ctypes.c_ulonglong)]


def test_the_exec_report_example_reports_what_was_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from examples.exec_report import report

    clock = [1_800_000_000 * 10**9]  # 2027-01-15 08:00:00 UTC
    monkeypatch.setattr(aperf.Recorder, "now_ns", lambda self: clock[0])
    monkeypatch.setattr("aperf._recording.writer.boot_offset_ns", lambda: 10**18)
    with aperf.Recorder(tmp_path / "rec", ExecEvent) as recorder:
        for i in range(9):  # 9 execs: 5 sh, 3 git, 1 make; their exits a minute apart
            comm = [b"sh", b"git", b"sh", b"make", b"sh", b"git", b"sh", b"git", b"sh"][i]
            boot = 800_000_000 * 10**9 + i * 30 * 10**9  # boot time; + 10**18: a date
            recorder.write(aperf.Sample(0, bytes(ExecEvent(pid=100 + i, comm=comm,
                                                           timestamp_ns=boot))))
            recorder.write(aperf.Sample(0, bytes(ExecEvent(
                pid=100 + i, comm=comm, exit_event=True, exit_code=i % 3 // 2,
                duration_ns=(i + 1) * 10**9, timestamp_ns=boot + 10**9))))
        recorder.write(aperf.Lost(1, 4))
    out = io.StringIO()
    report(tmp_path / "rec", top=2, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(f"recorded on {os.uname().nodename} (Linux ")
    assert lines[0].endswith("2027-01-15 08:00:00 to 08:04:01 UTC")
    assert lines[1:4] == ["COMMAND            EXECS", "sh                     5",
                          "git                    3"]
    assert lines[4].startswith("MINUTE (UTC)")
    assert lines[5].split() == ["08:00", "2", "2", "0", "(4", "events", "lost", "in", "this",
                                "minute)"]
    assert [line.split() for line in lines[6:10]] == [
        ["08:01", "2", "1", "1", "1:", "1"], ["08:02", "2", "1", "1", "1:", "1"],
        ["08:03", "2", "2", "0"], ["08:04", "1", "0", "1", "1:", "1"]]
    assert lines[-1] == "LOST EVENTS: 4 on CPU 1 at 08:00"
    assert lines[10:13] == ["SLOWEST              PID      SECONDS",
                            "sh                   108        9.000",
                            "git                  107        8.000"]


@pytest.mark.anyio
async def test_a_replay_of_a_damaged_recording_raises_where_the_damage_is(
        tmp_path: Path) -> None:
    with aperf.Recorder(tmp_path / "rec", QQ, rings=[(None, 0)]) as recorder:
        recorder.write(aperf.Sample(0, QQ.struct.pack(1, 0)))
        recorder.write(aperf.Sample(5, QQ.struct.pack(2, 0)))  # a ring the metadata omits
    source = aperf.replay(tmp_path / "rec")
    got: list[Any] = []
    async with aperf.PerfStream(source, decoder=QQ) as stream:
        with pytest.raises(aperf.RecordingFormatError, match="ring 5"):
            async for event in stream:
                got.append(event)
    assert [e.value.seq for e in got] == [1]  # what came before the damage


@pytest.mark.anyio
async def test_a_stream_of_several_maps_is_recorded_with_each_rows_map(tmp_path: Path) -> None:
    a, b = FakeRingSource(cpus=[1], name="a"), FakeRingSource(cpus=[0, 1], name="b")
    result: dict[str, Any] = {}
    async with aperf.PerfStream({"first": a, "second": b}, decoder=QQ) as stream:

        async def record() -> None:
            result["stats"] = await stream.record(tmp_path / "rec")

        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            for seq in range(6):
                (a if seq % 2 else b).write(seq % 2, QQ.struct.pack(seq, 0))
            await stream.aclose()
    recording = aperf.Recording(tmp_path / "rec")
    assert recording.maps == ["first", "second"]
    assert sorted(recording.rings) == [("first", 1), ("second", 0), ("second", 1)]
    rows = recording.samples().to_pylist()
    assert sorted((r["_map"], r["_cpu"], r["seq"]) for r in rows) == [
        ("first", 1, 1), ("first", 1, 3), ("first", 1, 5),
        ("second", 0, 0), ("second", 0, 2), ("second", 0, 4)]
    with pytest.raises(ValueError, match=r"several maps \(first, second\): replay one"):
        aperf.replay(tmp_path / "rec")
    source = aperf.replay(tmp_path / "rec", map="second")
    async with aperf.PerfStream(source, decoder=QQ) as replayed:
        assert [(e.cpu, e.value.seq) async for e in replayed] == [(0, 0), (0, 2), (0, 4)]
