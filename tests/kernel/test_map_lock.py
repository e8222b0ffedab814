"""Two aperf readers of one map in two processes: refused, or taken over on request.

Each holder is a real process (tests/kernel/map_holder.py) reading a pinned map; the
test process is the second reader. The kernel produces the samples (Producer).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb
from aperf._rings import map_lock as ml
from aperf.testing import Producer, sample_header

from ..helpers import REPO

HOLDER = Path(__file__).resolve().parent / "map_holder.py"
LOCK_HOLDER = REPO / "tests" / "lock_holder.py"
BUSY_LINE = "is read by pid {pid} "


NOBODY = 65534  # nobody, and its group nogroup


def setpriv(caps: tuple[str, ...] = ()) -> list[str]:
    """The command prefix that runs a program as nobody, with ``caps`` only."""
    wrapper = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    grant = ",".join(f"+{c}" for c in caps)
    if caps:
        return [*wrapper, f"--inh-caps=-all,{grant}", f"--ambient-caps={grant}",
                f"--bounding-set=-all,{grant}"]
    return [*wrapper, "--inh-caps=-all", "--bounding-set=-all"]


class Proc:
    """A child process and its stdout lines, read by a thread."""

    def __init__(self, argv: list[str], *, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, pass_fds=pass_fds,
                                     cwd=REPO)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.strip())
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, *words: str, timeout: float = 30) -> list[str]:
        """The first line that is one of ``words`` or starts with one and a space, split."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if line.startswith("error "):
                        pytest.fail(f"the child failed: {line}")
                    if any(line == word or line.startswith(word + " ") for word in words):
                        return line.split()
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    self.proc.kill()
                    err = self.proc.stderr.read() if self.proc.stderr else ""
                    pytest.fail(f"no {words} from the child; it said {self.lines}, {err}")
                self._changed.wait(min(left, 0.5))

    def tell(self, line: str = "") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


class Holder(Proc):
    """A reader of ``pin`` (a path, or an inherited map fd) in a child process
    (tests/kernel/map_holder.py), started as nobody holding ``caps`` if ``nobody``. With
    ``comment``, its command line starts with it (python -c '#comment ...')."""

    def __init__(self, pin: str, mode: str, *, fork: bool = False, wait: bool = False,
                 comment: str = "", nobody: bool = False, caps: tuple[str, ...] = (),
                 pass_fds: tuple[int, ...] = ()) -> None:
        run = [str(HOLDER)] if not comment else [
            "-c", f"#{comment}\nimport runpy; runpy.run_path({str(HOLDER)!r}, run_name='__main__')"]
        argv = [sys.executable, *run, pin, mode, *(["fork"] if fork else []),
                *(["wait"] if wait else [])]
        super().__init__([*setpriv(caps), *argv] if nobody else argv, pass_fds=pass_fds)
        if wait:
            self.pid = int(self.wait_for("pid")[1])
        else:
            self.wait_for("ready")

    def go(self) -> None:
        """Open the map now (started with ``wait``)."""
        self.tell()
        self.wait_for("ready")


@pytest.fixture
def hold() -> Iterator[Callable[..., Holder]]:
    """``hold(pin, mode, **options)``: a holder process, killed at the end of the test."""
    made: list[Holder] = []

    def start(pin: str, mode: str, **options: Any) -> Holder:
        made.append(Holder(pin, mode, **options))
        return made[-1]

    yield start
    for holder in made:
        holder.kill()


def pinned(producer: Producer, tag: str) -> Iterator[str]:
    pin = f"/sys/fs/bpf/aperf_lock_{tag}_{os.getpid()}"
    producer.map.pin(pin)
    try:
        yield pin
    finally:
        producer.map.unpin(pin)


@pytest.fixture
def perf_pin(producer: Producer) -> Iterator[str]:
    yield from pinned(producer, "perf")


@pytest.fixture
def ringbuf(kernel: None) -> Iterator[Producer]:
    with Producer(ring="ringbuf") as p:
        yield p


@pytest.fixture
def ringbuf_pin(ringbuf: Producer) -> Iterator[str]:
    yield from pinned(ringbuf, "rb")


def source_of(producer: Producer, pin: str, how: str) -> Any:
    return {"pin": pin, "map": producer.map, "fd": producer.map.fd}[how]


@pytest.mark.parametrize("how", ["pin", "map", "fd"])
@pytest.mark.parametrize("driver", ["stream", "buffer"])
def test_a_second_reader_in_another_process_is_refused_naming_the_holder(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder], how: str, driver: str
) -> None:
    holder = hold(perf_pin, "iterate")
    source = source_of(producer, perf_pin, how)
    with pytest.raises(aperf.BusyResourceError) as caught:
        if driver == "buffer":
            aperf.PerfBuffer(source, on_sample=print).close()
        else:
            anyio.run(_open_and_close, source)
    message = str(caught.value)
    assert BUSY_LINE.format(pid=holder.proc.pid) in message
    assert f"(id {lb.map_info(producer.map.fd).id})" in message and "take_over=True" in message
    # The holder still has its map: it receives what is produced now.
    producer.emit(300, cpu=0)
    holder.wait_for("count 300")
    assert holder.proc.poll() is None


async def _open_and_close(source: Any, **options: Any) -> None:
    async with aperf.PerfStream(source, **options):
        pass


async def _read(source: Any, count: int, produce: Any, **options: Any) -> list[Any]:
    """Open (with ``options``), call ``produce()`` in a thread, take ``count`` events."""
    events: list[Any] = []
    async with aperf.PerfStream(source, **options) as stream:
        thread = threading.Thread(target=produce)
        thread.start()
        with anyio.fail_after(30):
            async for event in stream:
                events.append(event)
                if len(events) == count:
                    break
        await anyio.to_thread.run_sync(thread.join)
        stream.flush()
        with anyio.move_on_after(0.2):
            async for event in stream:
                events.append(event)  # nothing more may come
    return events


@pytest.mark.parametrize("mode", ["iterate", "run", "trio", "poll"])
def test_take_over_ends_the_holders_stream_after_its_events(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder], mode: str
) -> None:
    holder = hold(perf_pin, mode)
    producer.emit(200, cpu=0)  # in the holder's rings: it must deliver them all first
    producer.emit(100, cpu=1)
    with aperf.PerfBuffer(perf_pin, on_sample=print, take_over=True) as taker:
        cpus = len(taker.cpus)
    taken = holder.wait_for("taken")
    assert taken == ["taken", str(os.getpid()), "300"]
    assert holder.proc.wait(30) == 0
    # The taker (closed at once above) gave it up in turn; a new taker reads all.
    produced = 0

    def produce() -> None:
        nonlocal produced
        for cpu in range(cpus):
            producer.emit(500, cpu=cpu)
            produced += 500

    events = anyio.run(_read, perf_pin, 500 * cpus, produce)
    assert all(isinstance(e, aperf.Sample) for e in events)
    assert len(events) == produced == 500 * cpus
    assert producer.counters().failed == 0


def test_take_over_from_a_live_holder_gets_exactly_what_is_produced(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate")
    producer.emit(100, cpu=0)
    events = anyio.run(
        lambda: _read(producer.map, 1000, lambda: producer.emit(1000, cpu=1), take_over=True)
    )
    assert holder.wait_for("taken") == ["taken", str(os.getpid()), "100"]
    samples = [e for e in events if isinstance(e, aperf.Sample)]
    assert len(samples) == len(events) == 1000
    assert [sample_header(s.data)[0] for s in samples] == list(range(100, 1100))
    assert producer.counters().failed == 0


def test_a_killed_holder_leaves_the_map_free(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate")
    holder.kill()
    events = anyio.run(lambda: _read(perf_pin, 400, lambda: producer.emit(400, cpu=0)))
    assert len(events) == 400 and all(isinstance(e, aperf.Sample) for e in events)


def test_a_forked_child_does_not_inherit_the_claim(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate", fork=True)
    child = int(holder.wait_for("child")[1])
    try:
        with pytest.raises(aperf.BusyResourceError, match=BUSY_LINE.format(pid=holder.proc.pid)):
            anyio.run(_open_and_close, perf_pin)
        # The holder dies; the child lives on, with its inherited copy of the stream (and
        # of the holder's stdout: the pipe is closed after the child is gone, in `hold`).
        holder.proc.kill()
        holder.proc.wait(30)
        os.kill(child, 0)
        events = anyio.run(lambda: _read(perf_pin, 200, lambda: producer.emit(200, cpu=0)))
        assert len(events) == 200
    finally:
        os.kill(child, signal.SIGKILL)


def test_two_ring_buffer_consumers_are_refused_and_taken_over_exactly(
    ringbuf: Producer, ringbuf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(ringbuf_pin, "iterate")
    with pytest.raises(aperf.BusyResourceError, match=BUSY_LINE.format(pid=holder.proc.pid)):
        anyio.run(_open_and_close, ringbuf_pin)
    ringbuf.emit(300, cpu=0)
    holder.wait_for("count")  # it reads
    # The ring is shared: what the holder took is its own, the rest is the taker's.
    events = anyio.run(
        lambda: _read(ringbuf.map, 300, lambda: ringbuf.emit(300, cpu=1), take_over=True),
    )
    taken = holder.wait_for("taken")
    assert taken[:2] == ["taken", str(os.getpid())]
    had = int(taken[2])
    seqs = [sample_header(e.data)[0] for e in events if isinstance(e, aperf.Sample)]
    assert len(seqs) == len(events)
    assert seqs[: 600 - had] == list(range(had, 600))
    assert len(seqs) == 600 - had
    assert ringbuf.counters().failed == 0


# --- another user on the same host: nobody, without or with aperf's capabilities ---------


@contextlib.contextmanager
def sysctl(name: str, value: int) -> Iterator[None]:
    """Set a sysctl for the block (the machine's own value back afterwards)."""
    path = Path("/proc/sys") / name.replace(".", "/")
    old = path.read_text().strip()
    path.write_text(str(value))
    try:
        yield
    finally:
        path.write_text(old)


def as_nobody(code: str, *args: str, caps: tuple[str, ...] = ()) -> Proc:
    """Python ``code`` run as nobody (holding ``caps``), with ``args``."""
    return Proc([*setpriv(caps), sys.executable, "-c", textwrap.dedent(code), *args])


@pytest.fixture
def others() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for proc in made:
        proc.kill()


@pytest.fixture
def default_lock_dir(monkeypatch: pytest.MonkeyPatch) -> str:
    """No APERF_LOCK_DIR: root's own directory."""
    monkeypatch.delenv(ml.LOCK_DIR_ENV, raising=False)
    return "/run/aperf"


@pytest.fixture
def shared_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The opt-in for sharing locks with nobody: root's, group nogroup, mode 3770,
    as APERF_LOCK_DIR (in a directory nobody can reach: pytest's tmp_path is root's)."""
    parent = Path(tempfile.mkdtemp(prefix="aperf-lock-test-"))
    parent.chmod(0o755)
    shared = parent / "locks"
    shared.mkdir()
    os.chown(shared, 0, NOBODY)
    shared.chmod(0o3770)
    monkeypatch.setenv(ml.LOCK_DIR_ENV, str(shared))
    try:
        yield shared
    finally:
        shutil.rmtree(parent)


def remove(*paths: str) -> None:
    """Remove what the test left in shared places (some may never have been made)."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def map_id_of(producer: Producer) -> int:
    return lb.map_info(producer.map.fd).id


def read_all(producer: Producer, count: int, **options: Any) -> None:
    """Read the map: ``count`` samples produced, exactly ``count`` delivered, none lost."""
    events = anyio.run(lambda: _read(producer.map, count,
                                     lambda: producer.emit(count, cpu=0), **options))
    assert len(events) == count and all(isinstance(e, aperf.Sample) for e in events)
    assert producer.counters().failed == 0


SQUAT = """
    import fcntl, os, sys
    for path in sys.argv[1:]:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)  # every slot
            print("held", path, flush=True)
        except OSError as exc:
            print("refused", path, exc.errno, flush=True)
    print("done", flush=True)
    sys.stdin.read()
"""


def test_a_squatter_as_nobody_cannot_deny_root_a_map(
    producer: Producer, default_lock_dir: str, others: list[Proc]
) -> None:
    map_id = map_id_of(producer)
    # This map's lock file and the next maps' ones, where aperf kept them (/dev/shm),
    # and where it keeps them now.
    old = [f"/dev/shm/aperf-map-{i}.lock" for i in range(map_id, map_id + 4)]
    new = f"{default_lock_dir}/aperf-map-{map_id}.lock"
    squatter = as_nobody(SQUAT, *old, new)
    others.append(squatter)
    try:
        squatter.wait_for("done")
        assert [line.split()[:2] for line in squatter.lines[:-1]] == [
            *(["held", path] for path in old), ["refused", new]]
        read_all(producer, 300)
        read_all(producer, 300, take_over=True)
    finally:
        remove(*old)


def test_a_file_left_by_another_user_stops_nothing_under_protected_regular(
    producer: Producer, default_lock_dir: str, others: list[Proc]
) -> None:
    map_id = map_id_of(producer)
    old = f"/dev/shm/aperf-map-{map_id}.lock"
    with sysctl("fs.protected_regular", 1):  # systemd's default
        try:
            leaver = as_nobody("import sys; open(sys.argv[1], 'w').close(); print('left')", old)
            others.append(leaver)
            leaver.wait_for("left")
            read_all(producer, 300)
        finally:
            remove(old)


TAKE = """
    import sys
    import aperf
    from aperf._rings import map_lock as ml
    try:  # argv: the map id, then "take" (take it over) or "lock"
        ml.lock_map(int(sys.argv[1]), "events", [0], take_over=sys.argv[2] == "take").release()
    except aperf.BusyResourceError as exc:
        print("busy", exc, flush=True)
    else:
        print("took", flush=True)
"""


def test_sharing_locks_with_another_user_is_an_opt_in_that_works(
    producer: Producer, shared_dir: Path, others: list[Proc]
) -> None:
    map_id = map_id_of(producer)
    with sysctl("fs.protected_regular", 2):  # also group-writable sticky directories
        # nobody holds the map's lock there: root sees it, by pid.
        holder = Proc([*setpriv(), sys.executable, str(LOCK_HOLDER), str(map_id), "0,1"])
        others.append(holder)
        holder.wait_for("held")
        lock_file = shared_dir / f"aperf-map-{map_id}.lock"
        assert lock_file.stat().st_uid == NOBODY
        assert lock_file.stat().st_mode & 0o7777 == 0o660
        with pytest.raises(aperf.BusyResourceError,
                           match=BUSY_LINE.format(pid=holder.proc.pid)):
            anyio.run(_open_and_close, producer.map)
        # Killed, it leaves its file behind (nobody's, in a sticky directory): free.
        holder.kill()
        assert lock_file.exists()
        read_all(producer, 300)
    # Root holds it: nobody sees root, by pid.
    with aperf.PerfBuffer(producer.map, on_sample=lambda sample: None):
        for mode in ("lock", "take"):
            other = as_nobody(TAKE, str(map_id), mode)
            others.append(other)
            answer = " ".join(other.wait_for("busy", "took"))
            assert answer.startswith("busy ") and f"pid {os.getpid()} " in answer, answer


PLANT = """
    import os, sys
    for target, path in zip(sys.argv[1::2], sys.argv[2::2]):
        try:
            os.link(target, path)
            print("planted", path, flush=True)
        except OSError as exc:
            print("refused", path, exc.errno, flush=True)
    print("done", flush=True)
"""


def test_a_hard_link_planted_as_a_lock_file_is_never_chmodded(
    producer: Producer, shared_dir: Path, others: list[Proc], monkeypatch: pytest.MonkeyPatch
) -> None:
    map_id = map_id_of(producer)
    # Root's files, 0600, in directories nobody can read, on each file system (a hard
    # link stays on its own): /dev/shm, and the one of the shared directory.
    shm = Path(tempfile.mkdtemp(prefix="aperf-lock-test-", dir="/dev/shm"))
    shm.chmod(0o755)
    precious = [shm / "precious", shared_dir.parent / "precious"]
    for each in precious:
        each.write_text("root's secret")
        each.chmod(0o600)
    old = f"/dev/shm/aperf-map-{map_id}.lock"
    new = f"/run/aperf/aperf-map-{map_id}.lock"
    shared = str(shared_dir / f"aperf-map-{map_id}.lock")
    try:
        with sysctl("fs.protected_hardlinks", 0):
            planter = as_nobody(PLANT, str(precious[0]), old, str(precious[0]), new,
                                str(precious[1]), shared)
            others.append(planter)
            planter.wait_for("done")
            assert [line.split()[:2] for line in planter.lines[:-1]] == [
                ["planted", old], ["refused", new], ["planted", shared]]
            # Root's own directory: nobody could plant there.
            monkeypatch.delenv(ml.LOCK_DIR_ENV)
            read_all(producer, 200)
            # The directory shared with nobody: the planted link is refused, untouched.
            monkeypatch.setenv(ml.LOCK_DIR_ENV, str(shared_dir))
            with pytest.raises(OSError, match="it has 2 links"):
                anyio.run(_open_and_close, producer.map)
            for each in precious:
                assert each.stat().st_mode & 0o7777 == 0o600, each
                assert each.read_text() == "root's secret"
    finally:
        remove(old)
        shutil.rmtree(shm)


BIND_ABSTRACT = """
    import socket, sys
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\\0" + sys.argv[1].encode())
    print("bound", flush=True)
    sys.stdin.read()
"""


def test_socket_names_taken_first_by_another_user_do_not_stop_a_take_over(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder], others: list[Proc]
) -> None:
    holder = hold(perf_pin, "iterate", wait=True)
    # The name the holder will listen on, as aperf named it: taken first, by nobody.
    squatter = as_nobody(BIND_ABSTRACT, f"aperf-map-{map_id_of(producer)}-pid-{holder.pid}")
    others.append(squatter)
    squatter.wait_for("bound")
    holder.go()
    producer.emit(100, cpu=0)
    with aperf.PerfBuffer(perf_pin, on_sample=lambda sample: None, take_over=True):
        assert holder.wait_for("taken") == ["taken", str(os.getpid()), "100"]


@pytest.mark.parametrize("mode", ["iterate", "poll"])
def test_a_take_over_whose_taker_gave_up_is_never_honoured(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder],
    monkeypatch: pytest.MonkeyPatch, mode: str,
) -> None:
    monkeypatch.setattr(ml, "TAKE_OVER_TIMEOUT", 0.5)
    holder = hold(perf_pin, mode)
    holder.proc.send_signal(signal.SIGSTOP)  # it cannot answer now
    try:
        with pytest.raises(aperf.BusyResourceError, match="did not give it up within"):
            aperf.PerfBuffer(perf_pin, on_sample=lambda sample: None, take_over=True)
    finally:
        holder.proc.send_signal(signal.SIGCONT)
    # Running again, it finds the request of a taker that is gone: it keeps the map
    # (the notice was pending before it ran: it sees it before these samples).
    producer.emit(300, cpu=0)
    assert holder.wait_for("count 300", "taken")[0] == "count"
    producer.emit(300, cpu=1)
    assert holder.wait_for("count 600", "taken")[0] == "count"
    assert producer.counters().failed == 0  # no output failed with -ENOENT
    assert not [line for line in holder.lines if line.startswith("taken")]
    # It still holds the map; a taker that waits is still served.
    with pytest.raises(aperf.BusyResourceError, match=BUSY_LINE.format(pid=holder.proc.pid)):
        anyio.run(_open_and_close, perf_pin)
    read_all(producer, 300, take_over=True)
    assert holder.wait_for("taken") == ["taken", str(os.getpid()), "600"]


def test_a_holders_command_line_reaches_root_as_printable_text(
    producer: Producer, perf_pin: str, hold: Callable[..., Holder]
) -> None:
    holder = hold(perf_pin, "iterate", comment="\x1b]0;owned\x07\x1b[2J\x1b[31m\u202e")
    with pytest.raises(aperf.BusyResourceError) as caught:
        anyio.run(_open_and_close, perf_pin)
    message = str(caught.value)
    assert BUSY_LINE.format(pid=holder.proc.pid) in message
    assert "#?]0;owned??[2J?[31m? import runpy;" in message, message
    assert message.isprintable(), repr(message)


def test_a_reader_running_as_nobody_is_taken_over_by_root_only(
    producer: Producer, shared_dir: Path, hold: Callable[..., Holder], others: list[Proc]
) -> None:
    fd = producer.map.fd
    holder = hold(str(fd), "iterate", nobody=True, caps=("bpf", "perfmon"), pass_fds=(fd,))
    producer.emit(100, cpu=0)
    holder.wait_for("count 100")
    # Any other process of nobody: refused at once (it is not "the same user").
    taker = as_nobody(TAKE, str(map_id_of(producer)), "take")
    others.append(taker)
    answer = " ".join(taker.wait_for("busy", "took"))
    assert answer.startswith("busy ") and "accepts a take-over only from root" in answer, answer
    producer.emit(100, cpu=1)
    holder.wait_for("count 200")
    # Root: taken over, exactly.
    read_all(producer, 300, take_over=True)
    assert holder.wait_for("taken") == ["taken", str(os.getpid()), "200"]
