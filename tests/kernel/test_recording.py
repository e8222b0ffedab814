"""Recordings of kernel-produced samples (docs/recording.md): what the stream delivered,
losses included, read back with pyarrow, DuckDB and Polars, sample by sample; a replay
equal to the live stream it was recorded from; Arrow batches made in a lease; a disk
that fills up; the record command and the tracer's --record, stopped and killed."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

import aperf
from aperf.testing import Producer

from ..helpers import BPF_DIR, REPO

pytestmark = [pytest.mark.usefixtures("kernel")]
OBJECT = BPF_DIR / "bench_getpid.bpf.o"
RECORD32 = 48  # a 32-byte sample's perf record: 8 header + 4 size + 36 raw
PAGE_RECORDS = 4096 // RECORD32  # what a one-page ring holds: 85


def sample32() -> Any:
    with aperf.BPFObject(OBJECT) as bench:
        return aperf.decoders.from_btf(bench, "bench_sample32")


DECODER = sample32()


def flat(items: list[Any]) -> list[Any]:
    """(cpu, data) per sample, ("lost", cpu, count) per notice."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, aperf.SampleArray):
            columns = item._columns
            out += [(item.cpu, d) for d in columns.raw_column(
                columns.tabler(raw=True), item).to_pylist()]
        elif isinstance(item, aperf.Lost):
            out.append(("lost", item.cpu, item.count))
        else:
            out.append((item.cpu, item.data))
    return out


def tap(producer: Producer, path: Path, bursts: int = 6, n: int = 300) -> tuple[list[Any], int]:
    """Bursts of ``n`` samples into a one-page ring drained between them (so the kernel
    drops most and writes lost records), what the stream delivered handed to a Recorder
    as it came. What was delivered (flat), and how many samples were emitted."""
    items: list[Any] = []

    def keep(item: Any) -> None:
        items.append(item)
        recorder.write(item)

    emitted = 0
    with aperf.Recorder(path, DECODER, rings=[(None, 0)]) as recorder, aperf.PerfBuffer(
            producer.map, pages=1, decoder=DECODER, cpus=[0], on_array=keep,
            on_lost=keep) as pb:
        for _ in range(bursts):
            producer.emit(n, size=32, cpu=0)
            emitted += n
            pb.consume()
        producer.emit(1, size=32, cpu=0)  # its lost record announces the last burst's drops
        emitted += 1
        pb.consume()
    return flat(items), emitted


def test_kernel_samples_read_back_with_pyarrow_duckdb_and_polars_as_delivered(
        producer: Producer, tmp_path: Path) -> None:
    live, emitted = tap(producer, tmp_path / "rec")
    rows = [d for d in live if d[0] != "lost"]
    lost = [d for d in live if d[0] == "lost"]
    counters = producer.counters()
    assert len(rows) == counters.ok and sum(c for _, _, c in lost) == counters.failed > 0
    assert len(rows) + counters.failed == emitted  # exact: every sample a row or counted

    recording = aperf.Recording(tmp_path / "rec")
    table = recording.samples()
    assert table.column("_data").to_pylist() == [d for _, d in rows]  # sample by sample
    assert table.column("_cpu").to_pylist() == [c for c, _ in rows]
    assert list(zip(table.column("seq").to_pylist(), table.column("ts").to_pylist(),
                    strict=True)) == [DECODER(d)[:2] for _, d in rows]
    # Each loss where it came: before the row that followed it in the live stream.
    places = []
    seen = 0
    for item in live:
        if item[0] == "lost":
            places.append((item[1], item[2], seen))
        else:
            seen += 1
    losses = recording.losses()
    assert list(zip(losses.column("_cpu").to_pylist(), losses.column("count").to_pylist(),
                    losses.column("_row").to_pylist(), strict=True)) == places

    glob = f"{tmp_path}/rec/samples-*.parquet"
    ducked = duckdb.sql(
        f"SELECT _cpu, seq, ts, _data FROM read_parquet('{glob}', filename=true, "
        "file_row_number=true) ORDER BY filename, file_row_number").fetchall()
    assert ducked == [(c, *DECODER(d)[:2], d) for c, d in rows]
    duck_lost = duckdb.sql(f"SELECT _cpu, sum(count) FROM read_parquet("
                           f"'{tmp_path}/rec/losses-*.parquet') GROUP BY _cpu").fetchall()
    assert duck_lost == [(0, counters.failed)]

    frame = pl.read_parquet(glob)
    assert frame["_data"].to_list() == [d for _, d in rows]
    assert frame["seq"].to_list() == [DECODER(d).seq for _, d in rows]
    assert pl.read_parquet(f"{tmp_path}/rec/losses-*.parquet")["count"].sum() == counters.failed


@pytest.mark.anyio
async def test_a_replay_equals_the_live_stream_it_was_recorded_from(
        producer: Producer, tmp_path: Path) -> None:
    live, _ = tap(producer, tmp_path / "rec")
    source = aperf.replay(tmp_path / "rec")
    async with aperf.PerfStream(source, decoder=DECODER) as stream:
        replayed = [event async for event in stream]
    assert flat(replayed) == live
    assert [e.value for e in replayed if isinstance(e, aperf.Sample)] == [
        DECODER(item[1]) for item in live if item[0] != "lost"]


@pytest.mark.anyio
async def test_stream_record_holds_exactly_what_the_kernel_produced(
        producer: Producer, tmp_path: Path) -> None:
    emitted = 0
    result: dict[str, Any] = {}
    async with aperf.PerfStream(producer.map, pages=1, decoder=DECODER, cpus=[0]) as stream:

        async def record() -> None:
            result["stats"] = await stream.record(tmp_path / "rec", max_file_bytes=8192,
                                                  row_group_bytes=4096)

        async with anyio.create_task_group() as tg:
            tg.start_soon(record)
            for _ in range(8):
                producer.emit(300, size=32, cpu=0)
                emitted += 300
                with anyio.fail_after(20):  # until the stream took the burst (or counted it)
                    while (s := stream.statistics()).samples + s.lost < emitted:
                        await anyio.sleep(0.001)
            await stream.aclose()
    stats = result["stats"]
    counters = producer.counters()
    recording = aperf.Recording(tmp_path / "rec")
    seqs = recording.samples().column("seq").to_pylist()
    assert stats.rows == len(seqs) == counters.ok and stats.lost == counters.failed
    assert len(seqs) + stats.lost == emitted and seqs == sorted(set(seqs))
    assert stats.files == len(recording.segments) > 1 and stats.unwritten == 0


@pytest.mark.anyio
async def test_an_arrow_batch_made_in_a_lease_outlives_it_and_holds_no_ring_space(
        producer: Producer) -> None:
    async with aperf.PerfStream(producer.map, pages=1, decoder=DECODER, cpus=[0]) as stream:
        producer.emit(PAGE_RECORDS - 1, size=32, cpu=0)  # the ring, nearly full
        batches = []
        with anyio.fail_after(10):
            while sum(b.num_rows for b in batches) < PAGE_RECORDS - 1:
                async with stream.lease() as lease:
                    batches += [i.to_arrow() for i in lease if isinstance(i, aperf.SampleArray)]
        # The lease ended: its arrays are off, the batches are whole and the ring is free.
        seqs = [s for b in batches for s in b.column("seq").to_pylist()]
        assert seqs == list(range(PAGE_RECORDS - 1))
        producer.emit(PAGE_RECORDS - 1, size=32, cpu=0)
        assert producer.counters().failed == 0  # the whole ring was given back


@contextlib.contextmanager
def small_disk(path: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the block (as root)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_full_disk_is_a_typed_error_and_the_closed_files_stay_whole(
        producer: Producer, tmp_path: Path) -> None:
    delivered: list[int] = []
    with small_disk(tmp_path / "disk") as disk:
        recorder = aperf.Recorder(disk / "rec", DECODER, max_file_bytes=64 << 10,
                                  row_group_bytes=16 << 10, compression="none")

        def keep(item: aperf.SampleArray) -> None:
            delivered.extend(item.values["seq"].tolist())
            recorder.write(item)

        with aperf.PerfBuffer(producer.map, pages=64, decoder=DECODER, cpus=[0],
                              on_array=keep) as pb, pytest.raises(aperf.RecordingError) as err:
            for _ in range(200):  # about 2 MB of samples for a 1 MiB disk
                producer.emit(500, size=32, cpu=0)
                pb.consume()
        assert err.value.errno == errno.ENOSPC and "segment" in str(err.value)
        stats = recorder.statistics()
        recording = aperf.Recording(disk / "rec")
        assert recording.partial == []  # the segment that did not fit: removed
        seqs = recording.samples().column("seq").to_pylist()
        assert seqs == delivered[: len(seqs)] and stats.files == len(recording.segments) > 0
        assert stats.unwritten == len(delivered) - len(seqs) > 0 and stats.errors == 1
        # Room again: the recording goes on, and says where the samples went missing.
        for segment in recording.segments[:-2]:
            os.unlink(segment.samples)
        recorder.write(aperf.Lost(0, 1))
        recorder.close()
        notes = aperf.Recording(disk / "rec").losses().to_pylist()
        assert [(n["_cpu"], n["count"], n["cause"]) for n in notes][-2:] == [
            (0, stats.unwritten, "recorder"), (0, 1, "ring")]


WORKLOAD = textwrap.dedent("""
    import os, sys
    sys.stdin.readline()  # go
    for _ in range(int(sys.argv[1])):
        os.getpid()
    print("done", flush=True)
    sys.stdin.readline()  # end
""")


class Workload:
    """A process that calls getpid() exactly ``n`` times when told to (the bench object
    emits a sample on each, as --set target_tgid=PID says)."""

    def __init__(self, n: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(n)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "done\n"

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.communicate()  # waits, and closes the pipes


def record_command(out: Path, pid: int, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aperf", "record", str(OBJECT), "--map", "events",
         "--decoder", "bench_sample32", "--out", str(out), "--set", f"target_tgid={pid}",
         "--pages", "64", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()  # says it records once the rings are open
    assert line.startswith("recording map events"), line + proc.stderr.read()
    return proc


def test_the_record_command_records_a_map_until_sigint(tmp_path: Path) -> None:
    n = 20_000
    with Workload(n) as workload:
        proc = record_command(tmp_path / "rec", workload.proc.pid)
        workload.run()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    recording = aperf.Recording(tmp_path / "rec")
    table = recording.samples()
    lost = sum(recording.losses().column("count").to_pylist())
    assert table.num_rows + lost == n  # each getpid a sample, or counted lost
    pid = workload.proc.pid
    assert set(table.column("pid_tgid").to_pylist()) <= {pid << 32 | pid}
    assert f"recorded {table.num_rows} samples and {lost} lost" in err
    assert recording.metadata["aperf.source"] == "events"
    assert recording.decoder is not None and recording.decoder.name == "struct bench_sample32"


KEEP_BUSY = "import os\nwhile True:\n    os.getpid()\n"


def test_a_recording_killed_mid_file_keeps_every_closed_file_whole(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", KEEP_BUSY])
    try:
        proc = record_command(tmp_path / "rec", busy.pid, "--max-file-seconds", "0.2")
        deadline = time.monotonic() + 60
        while len(list((tmp_path / "rec").glob("samples-*.parquet"))) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    finally:
        busy.kill()
        busy.wait()
    recording = aperf.Recording(tmp_path / "rec")
    numbers = [s.number for s in recording.segments]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 3
    assert {p.name for p in (tmp_path / "rec").glob("*.partial")} <= {
        f"samples-{len(numbers) + 1:06d}.parquet.partial",
        f"losses-{len(numbers) + 1:06d}.parquet.partial"}
    for segment in recording.segments:  # each whole: its footer says its rows
        rows = pq.read_metadata(segment.samples).metadata[b"aperf.rows"]
        assert int(rows) == pq.read_table(segment.samples).num_rows
    # None missing: on each CPU, every sequence number between its first row and any later
    # one is a row or counted by a lost notice before that row (the producer numbers every
    # try). Before, not between: an exact count read from the kernel may include drops
    # made after samples still in the ring, so a notice can come early, never late.
    samples = recording.samples(["_cpu", "seq"])
    notes = recording.losses()
    events = sorted(
        [(row, 1, cpu, seq) for row, (cpu, seq) in enumerate(zip(
            samples.column("_cpu").to_pylist(), samples.column("seq").to_pylist(),
            strict=True))] +
        [(row, 0, cpu, count) for row, cpu, count in zip(
            notes.column("_row").to_pylist(), notes.column("_cpu").to_pylist(),
            notes.column("count").to_pylist(), strict=True)])
    first: dict[int, tuple[int, int]] = {}  # per CPU: its first row's seq, drops before it
    rows: dict[int, int] = {}
    dropped: dict[int, int] = {}
    for _, is_row, cpu, value in events:
        if not is_row:
            dropped[cpu] = dropped.get(cpu, 0) + value
            continue
        if cpu not in first:
            first[cpu] = (value, dropped.get(cpu, 0))
            rows[cpu] = 0
        seq0, before = first[cpu]
        rows[cpu] += 1
        gap = value - seq0 + 1 - rows[cpu]  # tries since the first row that are no row
        assert 0 <= gap <= dropped.get(cpu, 0) - before, (cpu, value, gap)


def test_the_tracer_records_its_events(tracefs: None, tmp_path: Path) -> None:
    from .test_tracer import Tracer, finished, which

    true = which("true")
    with Tracer("--record", str(tmp_path / "rec"), command="tool") as tracer:
        tracer.wait_header()
        pids: set[int] = set()

        def spawn() -> None:
            proc = subprocess.Popen([true])
            pids.add(proc.pid)
            finished(proc)

        for _ in range(3):
            spawn()

        def both_seen(lines: list[str]) -> bool:  # each one's EXEC and EXIT lines
            return all(sum(f" {pid} " in line for line in lines) >= 2 for pid in pids)

        tracer.read_until(both_seen)
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr
    recording = aperf.Recording(tmp_path / "rec")
    events = recording.samples(["pid", "comm", "exit_event", "exit_code"]).to_pylist()
    mine = [e for e in events if e["pid"] in pids]
    assert {(e["comm"], e["exit_event"]) for e in mine} == {("true", False), ("true", True)}
    top = duckdb.sql(
        f"SELECT comm, count(*) AS execs FROM read_parquet('{tmp_path}/rec/samples-*.parquet') "
        "WHERE NOT exit_event GROUP BY comm ORDER BY execs DESC").fetchall()
    assert dict(top)["true"] >= len(pids)  # top commands by exec count
