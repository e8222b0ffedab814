"""End-to-end tests of the exec/exit tracer: ``aperf-trace`` and its teaching version.

Each test starts ``python -m examples.bootstrap_legacy`` (or the packaged tool,
``python -m aperf trace``) from the repository root as a subprocess, makes
processes of its own, and looks for their events.
The tracer sees every process on the machine, so assertions only consider
events of the pids the test spawned (and their children).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import aperf

REPO = Path(__file__).resolve().parents[2]
HEADER = "TIME     EVENT COMM             PID     PPID    FILENAME/EXIT CODE"
# "%-8s %-5s %-16s %-7d %-7d %s": time, event, comm, pid, ppid, filename or [code] (Nms)
ROW = re.compile(r"(\d\d:\d\d:\d\d) (EXEC|EXIT)  (.{16}) (\d+ *) (\d+ *) (.*)")
EXIT_DETAIL = re.compile(r"\[(\d+)\](?: \((\d+)ms\))?")
LOST = re.compile(r"^Lost (\d+) events on CPU #(\d+)!$", re.MULTILINE)
LOST_RINGBUF = re.compile(r"^Lost (\d+) events!$", re.MULTILINE)  # one ring for every CPU
# JSON lines carry the fields that apply to the event's kind, no more.
JSON_COMMON = {"time", "event", "cpu", "pid", "ppid", "comm", "exit_event", "timestamp_ns"}
JSON_KEYS = {
    "EXEC": JSON_COMMON | {"filename"},
    "EXIT": JSON_COMMON | {"exit_code", "duration_ns"},
}
# The two ways to run the tracer: the teaching example, and the tool aperf installs.
COMMANDS = {
    "example": ["-m", "examples.bootstrap_legacy"],
    "tool": ["-m", "aperf", "trace"],
}
TIMEOUT = 10.0  # seconds to wait for an event: generous, CI is a noisy 2-core VM


@dataclass(frozen=True)
class Row:
    event: str
    comm: str
    pid: int
    ppid: int
    detail: str

    @property
    def exit_code(self) -> int:
        m = EXIT_DETAIL.fullmatch(self.detail)
        assert m, f"bad exit detail {self.detail!r}"
        return int(m.group(1))

    @property
    def duration_ms(self) -> int | None:
        m = EXIT_DETAIL.fullmatch(self.detail)
        assert m, f"bad exit detail {self.detail!r}"
        return None if m.group(2) is None else int(m.group(2))


def parse_row(line: str) -> Row:
    """Parse a table line, checking the printf layout column by column."""
    m = ROW.fullmatch(line)
    assert m, f"line does not have the table layout: {line!r}"
    _, event, comm, pid, ppid, detail = m.groups()
    for field in (pid, ppid):
        assert len(field) == max(7, len(field.rstrip())), f"column not %-7d in {line!r}"
    return Row(event, comm.rstrip(), int(pid), int(ppid), detail)


class Tracer:
    """The tracer as a subprocess, its stdout lines readable with timeouts."""

    def __init__(
        self, *args: str, wrapper: Sequence[str] = (), command: str = "example"
    ) -> None:
        self.proc = subprocess.Popen(
            [*wrapper, sys.executable, *COMMANDS[command], *args],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._stderr: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True),
            threading.Thread(target=self._collect_stderr, args=(self.proc.stderr,), daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _collect_stderr(self, stream: Any) -> None:
        for line in stream:
            self._stderr.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def next_line(self, timeout: float) -> str | None:
        """The next stdout line; None at end of output; raises queue.Empty on timeout."""
        line = self.lines.get(timeout=timeout)
        if line is not None:
            self.seen.append(line)
        return line

    def wait_header(self) -> None:
        try:
            line = self.next_line(TIMEOUT)
        except queue.Empty:
            pytest.fail(f"no header within {TIMEOUT}s; stderr:\n{self.stderr}")
        assert line == HEADER, f"first line {line!r}; stderr:\n{self.stderr}"

    def wait_json_ready(self) -> None:
        """No header in JSON mode: the tracer is ready once a probe's exec shows up."""
        true = which("true")
        probes: set[int] = set()

        def probe() -> None:
            proc = subprocess.Popen([true])
            probes.add(proc.pid)
            finished(proc)

        def probe_seen(lines: list[str]) -> bool:
            return any(json.loads(line)["pid"] in probes for line in lines)

        probe()
        self.read_until(probe_seen, poke=probe)

    def read_until(
        self, done: Callable[[list[str]], bool], timeout: float = TIMEOUT,
        poke: Callable[[], None] | None = None,
    ) -> list[str]:
        """Read lines until ``done(lines read so far)``; ``poke`` runs every 0.2 s meanwhile."""
        deadline = time.monotonic() + timeout
        start = len(self.seen)
        while not done(self.seen[start:]):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(
                    f"timed out after {timeout}s; lines read:\n"
                    + "\n".join(self.seen[start:][-60:])
                    + f"\nstderr:\n{self.stderr}"
                )
            if poke is not None:
                poke()
            try:
                if self.next_line(min(remaining, 0.2)) is None:
                    pytest.fail(f"the tracer ended early; stderr:\n{self.stderr}")
            except queue.Empty:
                pass
        return self.seen[start:]

    def stop(self, sig: int = signal.SIGINT, timeout: float = TIMEOUT) -> tuple[int, float]:
        """Send ``sig``; the exit status and how long the tracer took to exit (``timeout``:
        a hang guard, not a speed test)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        elapsed = time.monotonic() - start
        for thread in self._threads:
            thread.join(timeout=5)
        return rc, elapsed

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for thread in self._threads:
            thread.join(timeout=5)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


def which(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not on PATH"
    return path


def same_file(reported: str, expected: str) -> bool:
    """The exec'd filename is the path the shell found on PATH (/bin/sh, /usr/bin/sh...)."""
    return reported == expected or os.path.realpath(reported) == os.path.realpath(expected)


def rows_of(lines: list[str], pids: set[int]) -> list[Row]:
    """Table rows of the given processes and of their children."""
    rows = [parse_row(line) for line in lines]
    return [r for r in rows if r.pid in pids or r.ppid in pids]


def find(rows: list[Row], event: str, comm: str, **fields: int) -> Row | None:
    for row in rows:
        if row.event == event and row.comm == comm and all(
            getattr(row, k) == v for k, v in fields.items()
        ):
            return row
    return None


def finished(proc: subprocess.Popen[Any]) -> int:
    return proc.wait(timeout=TIMEOUT)


# --- the table ----------------------------------------------------------------------------


@pytest.mark.kernel
@pytest.mark.parametrize(
    ("command", "loop", "ring"),
    [
        ("example", "asyncio", "perf"), ("example", "uvloop", "perf"), ("tool", "asyncio", "perf"),
        # the ring buffer twin (bootstrap.bpf.c): the same table
        ("example", "asyncio", "ringbuf"), ("tool", "uvloop", "ringbuf"),
    ],
)
def test_table_shows_exec_and_exit_of_a_pipeline(
    tracefs: None, tmp_path: Path, command: str, loop: str, ring: str
) -> None:
    sh, ls, grep = which("sh"), which("ls"), which("grep")
    ringbuf = ["--ringbuf"] if ring == "ringbuf" else []
    with Tracer("--loop", loop, *ringbuf, command=command) as tracer:
        tracer.wait_header()
        # An empty directory: ls prints nothing, so grep finds no "x" and exits 1.
        proc = subprocess.Popen([sh, "-c", "ls | grep x; exit 3"], cwd=tmp_path)
        assert finished(proc) == 3
        pid, me = proc.pid, os.getpid()

        def complete(lines: list[str]) -> bool:
            rows = rows_of(lines, {pid})
            return all(find(rows, "EXIT", c) for c in ("sh", "ls", "grep"))

        rows = rows_of(tracer.read_until(complete), {pid})
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr

    exec_sh = find(rows, "EXEC", "sh", pid=pid, ppid=me)
    exec_ls = find(rows, "EXEC", "ls", ppid=pid)
    exec_grep = find(rows, "EXEC", "grep", ppid=pid)
    assert exec_sh and exec_ls and exec_grep, rows
    assert same_file(exec_sh.detail, sh)
    assert same_file(exec_ls.detail, ls)
    assert same_file(exec_grep.detail, grep)

    exit_sh = find(rows, "EXIT", "sh", pid=pid, ppid=me)
    exit_ls = find(rows, "EXIT", "ls", pid=exec_ls.pid, ppid=pid)
    exit_grep = find(rows, "EXIT", "grep", pid=exec_grep.pid, ppid=pid)
    assert exit_sh and exit_ls and exit_grep, rows
    assert (exit_sh.exit_code, exit_grep.exit_code, exit_ls.exit_code) == (3, 1, 0)
    # Each process was seen exec'ing, so its exit carries a duration.
    for row in (exit_sh, exit_ls, exit_grep):
        assert row.duration_ms is not None and 0 <= row.duration_ms < 10_000, row
    assert "Traceback" not in tracer.stderr


@pytest.mark.kernel
def test_min_duration_reports_only_long_exits(tracefs: None) -> None:
    sleep = which("sleep")
    with Tracer("-d", "1000") as tracer:
        tracer.wait_header()
        short = subprocess.Popen([sleep, "0.01"])
        long = subprocess.Popen([sleep, "1.2"])
        assert finished(short) == 0
        assert finished(long) == 0

        def long_exit_seen(lines: list[str]) -> bool:
            return find(rows_of(lines, {long.pid}), "EXIT", "sleep", pid=long.pid) is not None

        # The short sleep exited over a second before the long one: had it been
        # reported, it would be in the output by now.
        rows = rows_of(tracer.read_until(long_exit_seen), {short.pid, long.pid})
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr
    assert [r.pid for r in rows] == [long.pid], rows  # no exec events, no short exit
    exit_long = rows[0]
    assert exit_long.exit_code == 0
    assert exit_long.duration_ms is not None and exit_long.duration_ms >= 1000


# --- shards: one load, N reading processes ------------------------------------------------


@pytest.mark.kernel
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_shards_print_exec_and_exit_of_a_probe_and_stop_cleanly(
    tracefs: None, sig: int
) -> None:
    true = which("true")
    with Tracer("--shards", "2", "-v", command="tool") as tracer:
        tracer.wait_header()
        # Each CPU in turn: whichever shard's CPU the probe runs on, both shards are tried.
        probes = []
        for cpu in (0, 1):
            proc = subprocess.Popen(["taskset", "-c", str(cpu), true] if shutil.which("taskset")
                                    else [true])
            assert finished(proc) == 0
            probes.append(proc.pid)

        def complete(lines: list[str]) -> bool:
            rows = rows_of(lines, set(probes))
            return all(find(rows, "EXIT", "true", pid=pid) for pid in probes)

        rows = rows_of(tracer.read_until(complete), set(probes))
        rc, _ = tracer.stop(sig)
    assert rc == 0, tracer.stderr
    shards = shard_pids(tracer.stderr)
    for pid in probes:
        assert find(rows, "EXEC", "true", pid=pid), rows
        assert len([r for r in rows if r.pid == pid and r.event == "EXIT"]) == 1, rows
    assert tracer.stderr.count("perf stream closed") == 2, tracer.stderr  # each shard's
    assert len(shards) == 2 and all(map(gone, shards)), tracer.stderr  # none outlives it
    assert "Traceback" not in tracer.stderr
    # The output ends, in whole lines: others' processes may have run meanwhile.
    while (line := tracer.lines.get(timeout=5)) is not None:
        parse_row(line)


def shard_pids(stderr: str) -> set[int]:
    return {int(pid) for pid in re.findall(r"shard (\d+) reads CPUs", stderr)}


def gone(pid: int) -> bool:
    try:
        return "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return True


@pytest.mark.kernel
def test_shards_end_when_their_parent_is_killed(tracefs: None) -> None:
    with Tracer("--shards", "2", "-v", "-d", "86400000", command="tool") as tracer:
        tracer.wait_header()
        deadline = time.monotonic() + TIMEOUT
        while len(shard_pids(tracer.stderr)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        shards = shard_pids(tracer.stderr)
        assert len(shards) == 2, tracer.stderr
        tracer.proc.kill()
        tracer.proc.wait(timeout=TIMEOUT)
        while not all(map(gone, shards)) and time.monotonic() < deadline + TIMEOUT:
            time.sleep(0.05)
        left = [pid for pid in shards if not gone(pid)]
        for pid in left:  # else they would hold the tracer's stderr open
            os.kill(pid, signal.SIGKILL)
        assert not left, f"shards {left} outlived their parent"


@pytest.mark.kernel
def test_more_shards_than_cpus_says_how_many(tracefs: None) -> None:
    cpus = len(os.sched_getaffinity(0))
    proc = subprocess.run(
        [sys.executable, *COMMANDS["tool"], "--shards", str(cpus + 1)],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2  # a bad option, as every other one
    assert proc.stderr.splitlines() == [
        f"aperf-trace: --shards {cpus + 1}: give 1 to {cpus} (a shard reads at least one of "
        f"the {cpus} online CPUs)"
    ], proc.stderr


@pytest.mark.parametrize("other", [["--ringbuf"], ["--nats", "nats://127.0.0.1:4222"]])
def test_shards_with_ringbuf_or_nats_is_a_usage_error(other: list[str]) -> None:
    proc = subprocess.run(
        [sys.executable, *COMMANDS["tool"], "--shards", "2", *other],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2
    assert "--shards reads a perf event array in several processes" in proc.stderr


# --- one object, either ring (--buffer) ---------------------------------------------------


@pytest.mark.kernel
@pytest.mark.parametrize(("options", "ring"), [
    ([], "perf"), (["--buffer", "perf"], "perf"), (["--buffer", "ringbuf"], "ringbuf"),
    (["--ringbuf"], "ringbuf"),
    (["--buffer", "auto"], "ringbuf"),  # Linux 6.18 has ring buffers
])
def test_the_loader_makes_the_tracers_buffer_either_ring(
    tracefs: None, options: list[str], ring: str
) -> None:
    # The tool's one object (tracer.bpf.c, APERF_BUFFER): the ring is the loader's choice.
    with Tracer("--json", *options, command="tool") as tracer:
        tracer.wait_json_ready()
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr
    cpus = {json.loads(line)["cpu"] for line in tracer.seen}
    if ring == "ringbuf":
        assert cpus == {aperf.NO_CPU}  # one ring for every CPU
    else:
        assert cpus and aperf.NO_CPU not in cpus and cpus <= set(range(os.cpu_count() or 1))


@pytest.mark.parametrize(("options", "message"), [
    (["--ringbuf", "--buffer", "perf"], "--ringbuf is --buffer ringbuf"),
    (["--shards", "2", "--buffer", "auto"], "--shards reads a perf event array"),
])
def test_buffer_options_that_do_not_go_together(options: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, *COMMANDS["tool"], *options],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr


def test_the_example_keeps_its_twin_and_takes_no_buffer_choice() -> None:
    proc = subprocess.run([sys.executable, *COMMANDS["example"], "--buffer", "auto"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "ring buffer twin is --ringbuf" in proc.stderr


@pytest.mark.kernel
def test_a_buffer_choice_for_an_object_without_a_buffer_is_an_option_error(
    tracefs: None,
) -> None:
    legacy = REPO / "bpf" / "bootstrap_legacy.bpf.o"  # a plain perf event array
    proc = subprocess.run(
        [sys.executable, *COMMANDS["tool"], "--buffer", "ringbuf", "--object", str(legacy)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"aperf-trace: --buffer chooses the ring of an object declaring APERF_BUFFER "
        f"(<aperf/buffer.bpf.h>); {legacy} has none: leave --buffer out"
    ]


# --- JSON --------------------------------------------------------------------------------


@pytest.mark.kernel
def test_json_lines_carry_every_field(tracefs: None, tmp_path: Path) -> None:
    sh, ls = which("sh"), which("ls")
    with Tracer("--json") as tracer:
        tracer.wait_json_ready()

        proc = subprocess.Popen([sh, "-c", "ls >/dev/null; exit 7"], cwd=tmp_path)
        assert finished(proc) == 7
        pid = proc.pid

        def records_of(lines: list[str]) -> list[dict[str, Any]]:
            records = [json.loads(line) for line in lines]  # every line is one JSON object
            return [r for r in records if pid in (r["pid"], r["ppid"])]

        def complete(lines: list[str]) -> bool:
            # Every record asserted on below, whatever order they come in: ls's exec is
            # on whichever CPU ran ls, and may be printed after sh's exit (an ordered
            # stream releases an event it finds late after the ones it released).
            kinds = {(r["event"], r["comm"]) for r in records_of(lines)}
            return {("EXEC", "sh"), ("EXEC", "ls"), ("EXIT", "sh")} <= kinds

        records = records_of(tracer.read_until(complete))
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr

    for record in records:
        assert record["event"] == ("EXIT" if record["exit_event"] else "EXEC")
        assert set(record) == JSON_KEYS[record["event"]], record
        assert datetime.datetime.fromisoformat(record["time"]).tzinfo is not None
        assert isinstance(record["cpu"], int)
    by_kind = {(r["event"], r["comm"]): r for r in records}
    exec_sh = by_kind["EXEC", "sh"]
    assert exec_sh["pid"] == pid and exec_sh["ppid"] == os.getpid()
    assert same_file(exec_sh["filename"], sh)
    assert exec_sh["exit_event"] is False
    exec_ls = by_kind["EXEC", "ls"]
    assert exec_ls["ppid"] == pid and same_file(exec_ls["filename"], ls)
    exit_sh = by_kind["EXIT", "sh"]
    assert exit_sh["exit_code"] == 7 and exit_sh["exit_event"] is True
    assert 0 < exit_sh["duration_ns"] < 10 * 10**9


# --- names a process chooses ----------------------------------------------------------------

# A file name and a comm that try to start a line of their own, with a byte that is
# not UTF-8 and a terminal escape. The kernel keeps the first 15 bytes of a comm.
FORGED = b"12:00:00 EXIT  evil 1 1 [0]"
FILE_NAME = b"x\n" + FORGED + b"\xff\x1b"
COMM = b"y\n12:00 EXIT\xff"  # 13 bytes, written to /proc/self/comm


@pytest.mark.kernel
@pytest.mark.parametrize("fmt", ["table", "json"])
def test_names_are_escaped_so_no_line_can_be_forged(tracefs: None, fmt: str) -> None:
    sh = which("sh")
    # A short directory: the BPF side keeps 126 bytes of the exec'd path.
    with tempfile.TemporaryDirectory(prefix="aperf-") as tmp:
        path = os.path.join(os.fsencode(tmp), FILE_NAME)
        os.symlink(sh, path)  # exec'd through the link: comm is the link's name
        script = r"printf 'y\n12:00 EXIT\377' > /proc/self/comm; exit 5"
        with Tracer(*(["--json"] if fmt == "json" else []), command="tool") as tracer:
            if fmt == "table":
                tracer.wait_header()
            else:
                tracer.wait_json_ready()
            proc = subprocess.Popen([path, "-c", script])
            assert finished(proc) == 5
            me = os.getpid()
            columns = f" {proc.pid:<7} {me:<7} "  # pid and ppid, as the table prints them

            def event_of(line: str) -> str | None:
                """EXEC or EXIT if the line is about our process, else None."""
                if fmt == "json":
                    record = json.loads(line)
                    return record["event"] if record["pid"] == proc.pid else None
                return line[9:13] if columns in line else None

            lines = tracer.read_until(lambda lines: "EXIT" in map(event_of, lines))
            rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr

    exec_comm = r"x\n12:00:00 EXIT"  # the link's name, cut at 15 bytes
    exec_file = tmp + "/" + r"x\n" + FORGED.decode() + r"\xff\x1b"
    exit_comm = r"y\n12:00 EXIT\xff"
    mine = [line for line in lines if event_of(line)]
    if fmt == "json":
        records = [json.loads(line) for line in mine]
        assert [(r["event"], r["comm"]) for r in records] == [
            ("EXEC", exec_comm), ("EXIT", exit_comm)
        ]
        assert records[0]["filename"] == exec_file
        assert records[1]["exit_code"] == 5
        return
    for line in lines:  # every line is a table row: none starts with the forged text
        assert re.fullmatch(r"\d\d:\d\d:\d\d (EXEC|EXIT)  \S.*", line), line
    assert len(mine) == 2, lines
    exec_line, exit_line = (line[9:] for line in mine)
    assert exec_line == f"EXEC  {exec_comm:<16}{columns}{exec_file}"
    assert re.fullmatch(re.escape(f"EXIT  {exit_comm:<16}{columns}[5] (") + r"\d+ms\)", exit_line)


# --- stdout that nobody reads -----------------------------------------------------------------


def pipe_bytes(read_end: int) -> int:
    """How many bytes wait in a pipe (FIONREAD)."""
    size = fcntl.ioctl(read_end, termios.FIONREAD, b"\0\0\0\0")
    return int.from_bytes(size, sys.byteorder)


@pytest.mark.kernel
@pytest.mark.parametrize("command", COMMANDS)
def test_sigterm_stops_it_while_stdout_pipe_is_full(tracefs: None, command: str) -> None:
    # As `tracer | sleep 1000`: a reader that never reads. One page of pipe, so
    # that the events of 1000 short processes fill it many times over.
    sh, true = which("sh"), which("true")
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
    capacity = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ)
    try:
        proc = subprocess.Popen(
            [sys.executable, *COMMANDS[command]], cwd=REPO, stdin=subprocess.DEVNULL,
            stdout=write_end, stderr=subprocess.PIPE, text=True,
        )
        os.close(write_end)
        write_end = -1
        deadline = time.monotonic() + TIMEOUT
        while pipe_bytes(read_end) == 0:  # the header: the tracer is attached
            assert proc.poll() is None and time.monotonic() < deadline, "no header"
            time.sleep(0.05)
        burst = subprocess.run([sh, "-c", f"for i in $(seq 1000); do {true}; done"], check=False)
        assert burst.returncode == 0
        # The tracer prints the burst's events at its own pace (later than the burst, on
        # a loaded machine): wait until they fill the pipe, which then blocks its writes.
        while (waiting := pipe_bytes(read_end)) <= capacity - 200:
            assert proc.poll() is None, "the tracer ended early"
            assert time.monotonic() < deadline + TIMEOUT, (
                f"the pipe holds only {waiting} of {capacity} bytes")
            time.sleep(0.05)
        assert proc.poll() is None, "the tracer ended early"

        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=TIMEOUT)  # a hang guard: blocked on stdout, it never ends
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            pytest.fail(f"still running {TIMEOUT} s after SIGTERM, its stdout pipe full")
        elapsed = time.monotonic() - start
        assert proc.stderr is not None
        stderr = proc.stderr.read()
        proc.stderr.close()
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert rc == 0, stderr
    assert "Traceback" not in stderr, stderr
    print(f"exited {elapsed:.3f} s after SIGTERM")  # seen with -s; no timed assertion


@pytest.mark.kernel
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_reader_going_away_ends_it_quietly(tracefs: None, loop: str) -> None:
    # As `tracer | head -1`: the reader closes its end after the first line.
    true = which("true")
    proc = subprocess.Popen(
        [sys.executable, *COMMANDS["tool"], "--loop", loop], cwd=REPO,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        assert proc.stdout.readline().rstrip("\n") == HEADER
        proc.stdout.close()
        deadline = time.monotonic() + TIMEOUT
        while proc.poll() is None:  # each exec makes a line the tracer fails to write
            assert time.monotonic() < deadline, "still running after its reader went away"
            subprocess.run([true], check=True)
            time.sleep(0.05)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == 0, stderr
    assert stderr == ""  # no traceback, no warning about the closed pipe


# --- stopping, losing, refusing -----------------------------------------------------------


@pytest.mark.kernel
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_stops_cleanly(tracefs: None, sig: int) -> None:
    # -v: aperf logs "perf stream closed" when the stream is closed in order
    # (rings freed); libbpf's debug output goes to stderr too. -d: only exits of
    # processes that ran for a day, so other processes on the machine print nothing,
    # and the tracer (lowest-latency wakeups: no timer) has nothing to wake it but the
    # signal: a tracer the signal did not stop runs into stop()'s timeout, TIMEOUT.
    with Tracer("-v", "-d", "86400000") as tracer:
        tracer.wait_header()
        rc, elapsed = tracer.stop(sig)
    print(f"exited {elapsed:.3f} s after {signal.Signals(sig).name}")  # no timed assertion
    assert rc == 0, tracer.stderr
    assert "perf stream closed" in tracer.stderr
    assert "Traceback" not in tracer.stderr
    assert tracer.lines.get(timeout=1) is None  # nothing after the header but the end


@pytest.mark.kernel
def test_lost_events_are_reported_on_stderr(tracefs: None) -> None:
    sh, true, taskset = which("sh"), which("true"), shutil.which("taskset")
    if taskset is None:
        pytest.skip("taskset is not installed")
    cpus = sorted(os.sched_getaffinity(0))
    with Tracer("--pages", "1") as tracer:  # 4 KiB per CPU: about 22 events
        tracer.wait_header()
        # A stopped reader cannot drain: 400 events overflow every CPU's ring.
        tracer.proc.send_signal(signal.SIGSTOP)
        try:
            for cpu in cpus:
                burst = subprocess.Popen(
                    [taskset, "-c", str(cpu), sh, "-c", f"for i in $(seq 100); do {true}; done"]
                )
                assert finished(burst) == 0
        finally:
            tracer.proc.send_signal(signal.SIGCONT)

        # The kernel writes a CPU's lost record in front of the next sample that
        # fits (after the reader made room): make one sample on each CPU.
        def flush() -> None:
            for cpu in cpus:
                subprocess.run([taskset, "-c", str(cpu), true], check=True)

        tracer.read_until(lambda _: bool(LOST.search(tracer.stderr)), poke=flush)
        rc, _ = tracer.stop()
    assert rc == 0
    reports = [(int(n), int(cpu)) for n, cpu in LOST.findall(tracer.stderr)]
    assert reports and all(n > 0 and cpu in cpus for n, cpu in reports), tracer.stderr


@pytest.mark.kernel
@pytest.mark.parametrize("command", ["tool", "example"])
def test_ring_buffer_losses_are_counted_by_the_programs_and_reported(
    tracefs: None, command: str
) -> None:
    sh, true = which("sh"), which("true")
    # One 4 KiB ring buffer for every CPU: 22 events of 184 bytes fit.
    with Tracer("--ringbuf", "--pages", "1", "--json", command=command) as tracer:
        tracer.wait_json_ready()
        tracer.proc.send_signal(signal.SIGSTOP)  # a stopped reader cannot drain
        try:
            burst = subprocess.Popen([sh, "-c", f"for i in $(seq 100); do {true}; done"])
            assert finished(burst) == 0
        finally:
            tracer.proc.send_signal(signal.SIGCONT)
        # No lost record to wait for (the kernel writes none): the programs' count is
        # read when a drain finds the ring full, and at the latest when the stream closes.
        tracer.read_until(lambda _: bool(LOST_RINGBUF.search(tracer.stderr)),
                          poke=lambda: subprocess.run([true], check=True))
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr
    reports = [int(n) for n in LOST_RINGBUF.findall(tracer.stderr)]
    assert reports and all(n > 0 for n in reports), tracer.stderr
    assert not LOST.search(tracer.stderr)  # no CPU is named: the ring serves them all
    records = [json.loads(line) for line in tracer.seen if line.startswith("{")]
    assert records and {r["cpu"] for r in records} == {-1}


def _unprivileged_wrappers() -> list[Any]:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0:
        return [pytest.param([], id="as-is")]  # already unprivileged
    if setpriv is None:
        return [pytest.param(None, id="no-setpriv")]
    return [
        # A real non-root user. /root is 0700 here and the interpreter lives under
        # /root/.pyenv, so plain nobody cannot even start it (execve and the stdlib
        # imports fail with EACCES). The ambient CAP_DAC_READ_SEARCH lets nobody read
        # (and only read) files; it grants nothing BPF needs.
        pytest.param(
            [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups",
             "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search",
             "--bounding-set=-all,+dac_read_search"],
            id="nobody",
        ),
        # Root (uid 0) holding no capabilities at all: a uid check alone would pass.
        pytest.param(
            [setpriv, "--inh-caps=-all", "--bounding-set=-all"], id="root-without-caps"
        ),
    ]


@pytest.mark.parametrize("wrapper", _unprivileged_wrappers())
def test_unprivileged_run_says_what_is_missing(wrapper: list[str] | None) -> None:
    if wrapper is None:
        pytest.skip("setpriv (util-linux) is needed to drop privileges")
    proc = subprocess.run(
        [*wrapper, sys.executable, "-m", "examples.bootstrap_legacy"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr  # one sentence, no traceback
    assert lines[0].startswith("bootstrap_legacy: ")
    assert "root" in lines[0] and "CAP_BPF" in lines[0]


def test_missing_object_says_how_to_build_it(kernel: None, tmp_path: Path) -> None:
    # (as root: for anyone else the privilege check comes first)
    missing = tmp_path / "nope.bpf.o"
    proc = subprocess.run(
        [sys.executable, "-m", "examples.bootstrap_legacy", "--object", str(missing)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"bootstrap_legacy: BPF object {missing} does not exist; build it with: make -C bpf"
    ]


@pytest.mark.parametrize("pages", ["16384", "3", "0", "-8", "many"])
def test_pages_out_of_range_is_a_usage_error(pages: str) -> None:
    # Checked while parsing the options, before privileges or any BPF call.
    proc = subprocess.run(
        [sys.executable, *COMMANDS["tool"], "--pages", pages],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines()[-1].startswith(
        "python -m aperf trace: error: argument --pages: "
    ), proc.stderr
    assert "Traceback" not in proc.stderr


# --- scripts/tracer.sh passes every option of aperf-trace ------------------------------------

OPTION = re.compile(r"(?<![\w-])(--?[a-z][a-z-]*)")


def tracer_sh_command() -> list[str]:
    """What scripts/tracer.sh runs after the set-up, with ``"$@"`` left out."""
    lines = (REPO / "scripts" / "tracer.sh").read_text().splitlines()
    (exec_line,) = [line for line in lines if line.startswith("exec ")]
    words = exec_line.split()[1:]
    assert words[0] == ".venv/bin/python" and words[-1] == '"$@"', exec_line
    return words[1:-1]


def help_options(args: Sequence[str]) -> set[str]:
    proc = subprocess.run(
        [sys.executable, *args, "--help"], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    options = proc.stdout.split("options:", 1)[1]
    return set(OPTION.findall(options))


def test_tracer_sh_accepts_every_option_of_aperf_trace() -> None:
    tool = help_options(COMMANDS["tool"])
    assert {"--nats", "--host", "--pages", "--ringbuf", "--json", "-d", "--loop"} <= tool
    assert help_options(tracer_sh_command()) == tool


# --- time order across CPUs -----------------------------------------------------------------


@pytest.mark.parametrize("command", ["example", "tool"])
def test_events_come_in_time_order_across_cpus(tracefs: None, command: str) -> None:
    """Processes that exec on one CPU and exit on another: a pid's EXIT never comes
    before its EXEC, and the kernel timestamps of the lines never go back."""
    sh, true, taskset = which("sh"), which("true"), shutil.which("taskset")
    cpus = sorted(os.sched_getaffinity(0))
    if taskset is None or len(cpus) < 2:
        pytest.skip("needs taskset and two CPUs")
    a, b = cpus[0], cpus[-1]
    with Tracer("--json", command=command) as tracer:
        tracer.wait_json_ready()
        start = len(tracer.seen)
        parents = []
        for i in range(20):
            first, then = (a, b) if i % 2 else (b, a)
            # sh execs on one CPU; its child execs taskset there, then true on the other
            # CPU, and exits there.
            script = f"{taskset} -c {then} {true}; {taskset} -c {then} {true}"
            proc = subprocess.Popen([taskset, "-c", str(first), sh, "-c", script])
            assert finished(proc) == 0
            parents.append(proc.pid)

        def complete(lines: list[str]) -> bool:
            exits = {r["pid"] for r in map(json.loads, lines) if r["exit_event"]}
            return exits >= set(parents)

        tracer.read_until(complete)
        rc, _ = tracer.stop()
    assert rc == 0, tracer.stderr
    records = [json.loads(line) for line in tracer.seen[start:]]
    stamps = [r["timestamp_ns"] for r in records]
    assert stamps == sorted(stamps), "lines out of time order"
    assert {r["cpu"] for r in records} >= {a, b}
    first_exec: dict[int, int] = {}
    checked = 0
    for index, record in enumerate(records):
        pid = record["pid"]
        if not record["exit_event"]:
            first_exec.setdefault(pid, index)
        elif pid in first_exec or pid in parents:
            assert first_exec.get(pid, index) < index, f"EXIT of {pid} before its EXEC"
            checked += 1
    assert checked >= 3 * len(parents)  # each sh and its two children
