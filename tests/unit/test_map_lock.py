"""The cross-process map lock on its own: real processes, real POSIX locks and
sockets, a made-up map id in a lock directory of the test's own (no BPF needed)."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import aperf
from aperf._rings import map_lock as ml

MAP_ID = 4_000_000_000 + os.getpid()  # far beyond the ids this boot's maps have


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ml.LOCK_DIR_ENV, str(tmp_path))
    return tmp_path


HOLDER = Path(__file__).resolve().parent.parent / "lock_holder.py"


class Other:
    """A process holding slots of the map (tests/lock_holder.py) until told (a line
    on stdin) or killed."""

    def __init__(self, slots: list[int], *, comment: str = "") -> None:
        # With a comment, its command line shows it first: python -c '#comment ...'.
        run = [str(HOLDER)] if not comment else [
            "-c", f"#{comment}\nimport runpy; runpy.run_path({str(HOLDER)!r}, run_name='__main__')"]
        self.proc = subprocess.Popen(
            [sys.executable, *run, str(MAP_ID), ",".join(map(str, slots))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
        )
        self._said = b""
        assert self.line() == "held"

    def line(self, *, notices: bool = False) -> str:
        """Its next line (past ``notice`` lines, unless ``notices``)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()  # read unbuffered: select sees what is left
        while True:
            while b"\n" not in self._said:
                ready, _, _ = select.select([fd], [], [], 30)
                assert ready, f"the other process said nothing more after {self._said!r}"
                more = os.read(fd, 4096)
                assert more, f"the other process ended after {self._said!r}"
                self._said += more
            line, self._said = self._said.split(b"\n", 1)
            if notices or line != b"notice":
                return line.decode().strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def others() -> Iterator[list[Other]]:
    made: list[Other] = []
    yield made
    for other in made:
        other.stop()


def lock_elsewhere(slots: list[int]) -> str:
    """What another process gets when it locks ``slots``: "ok" or the error's message."""
    code = textwrap.dedent(f"""
        import aperf
        from aperf._rings import map_lock as ml
        try:
            ml.lock_map({MAP_ID}, "test", {slots!r}).release()
        except aperf.BusyResourceError as exc:
            print(exc)
        else:
            print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def test_a_second_lock_in_this_process_is_refused() -> None:
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    try:
        # POSIX locks are the process's: a second one would succeed, and its close
        # would drop the first.
        with pytest.raises(aperf.BusyResourceError, match="in this process"):
            ml.lock_map(MAP_ID, "test", [1])
        assert "is read by pid" in lock_elsewhere([0])
    finally:
        lock.release()
    assert lock_elsewhere([0]) == "ok"


def test_slot_runs() -> None:
    assert ml.slot_runs([5, 0, 2, 1]) == [(0, 3), (5, 1)]
    assert ml.slot_runs([]) == []


def test_overlapping_slots_are_refused_naming_the_holder(others: list[Other]) -> None:
    other = Other([0, 1])
    others.append(other)
    with pytest.raises(aperf.BusyResourceError) as caught:
        ml.lock_map(MAP_ID, "test", [1, 2])
    assert f"is read by pid {other.proc.pid} " in str(caught.value)
    assert "CPUs 1" in str(caught.value) and f"(id {MAP_ID})" in str(caught.value)


def test_disjoint_slots_are_compatible_owners(others: list[Other]) -> None:
    others.append(Other([0, 1]))
    lock = ml.lock_map(MAP_ID, "test", [2, 3])
    assert lock is not None
    try:
        assert lock_elsewhere([4, 5]) == "ok"
        refused = lock_elsewhere([1, 2])  # one held there, one here
        assert f"pid {others[0].proc.pid} " in refused and "on CPUs 1" in refused
        assert f"pid {os.getpid()} " in refused and "on CPUs 2" in refused
    finally:
        lock.release()


def test_a_killed_holder_leaves_a_stale_file_that_is_free(
    others: list[Other], lock_dir: Path
) -> None:
    other = Other([0])
    others.append(other)
    other.proc.send_signal(signal.SIGKILL)
    other.proc.wait(30)
    path = Path(ml.lock_path(MAP_ID))
    assert path.exists()  # left behind by the dead holder
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    lock.release()
    assert not path.exists()  # the last holder removes it


def test_a_release_unlocks_and_removes_the_file(others: list[Other]) -> None:
    other = Other([0])
    others.append(other)
    assert other.proc.stdin is not None
    other.proc.stdin.write("\n")
    other.proc.stdin.flush()
    assert other.line() == "released"
    assert not os.path.exists(ml.lock_path(MAP_ID))
    ml.lock_map(MAP_ID, "test", [0]).release()  # type: ignore[union-attr]


def test_take_over_asks_the_holder_and_waits_for_it(others: list[Other]) -> None:
    other = Other([0, 1])
    others.append(other)
    lock = ml.lock_map(MAP_ID, "test", [1], take_over=True)
    assert lock is not None
    try:
        assert other.line() == f"taken {os.getpid()}"
        assert f"is read by pid {os.getpid()} " in lock_elsewhere([1])
        assert lock_elsewhere([0]) == "ok"  # the holder gave up all it had
    finally:
        lock.release()


def talk(path: str, *messages: bytes) -> socket.socket:
    """A connection to a holder's take-over socket that sent ``messages``."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    for message in messages:
        conn.send(message)
    return conn


def heard(lock: ml.MapLock) -> aperf.TakenOverError | None:
    """What the holder makes of what came (its notice fd turned readable first)."""
    assert select.select([lock.notice], [], [], 5)[0], "no notice"
    return lock.taken_over()


def test_only_an_accepted_offer_takes_the_map(lock_dir: Path) -> None:
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    try:
        path = str(lock_dir / ml.socket_name(MAP_ID, os.getpid()))
        with talk(path, b"give it to me") as out:
            assert heard(lock) is None
            assert out.recv(64) == b""  # hung up on
        with talk(path, ml.ACCEPT) as out:  # accepting what was never offered
            assert heard(lock) is None
            assert out.recv(64) == b""
        with talk(path, ml.REQUEST) as out:
            assert heard(lock) is None
            assert out.recv(64) == ml.OFFER
            assert select.select([lock.notice], [], [], 0)[0] == []  # nothing more to hear
            out.send(ml.ACCEPT)
            error = heard(lock)
            assert isinstance(error, aperf.TakenOverError) and error.pid == os.getpid()
            assert error.map_id == MAP_ID
            import anyio

            assert isinstance(error, anyio.BrokenResourceError)
            assert "is read by pid" in lock_elsewhere([0])  # not before it gives up
            lock.give_up()
            assert out.recv(64) == b""  # hung up once the map is free
            assert lock_elsewhere([0]) == "ok"
            assert not os.path.exists(path)  # it listens no more
    finally:
        lock.release()


def test_a_take_over_withdrawn_at_its_timeout_is_never_honoured(others: list[Other]) -> None:
    other = Other([0])
    others.append(other)
    other.proc.send_signal(signal.SIGSTOP)  # it cannot answer now
    try:
        held = ml.MapLock(MAP_ID, "test", [0])
        with pytest.raises(aperf.BusyResourceError, match=r"did not give it up within 0\.2 s"):
            held.acquire(take_over=True, timeout=0.2)
    finally:
        other.proc.send_signal(signal.SIGCONT)
    # Running again, it reads the request of a taker that is gone: it keeps the map.
    assert other.line(notices=True) == "notice"
    assert f"is read by pid {other.proc.pid} " in lock_elsewhere([0])
    # A taker that waits is still served.
    lock = ml.lock_map(MAP_ID, "test", [0], take_over=True)
    assert lock is not None
    try:
        assert other.line() == f"taken {os.getpid()}"
    finally:
        lock.release()


def test_a_take_over_socket_of_another_process_is_not_asked(
    others: list[Other], lock_dir: Path
) -> None:
    other = Other([0])
    others.append(other)
    path = lock_dir / ml.socket_name(MAP_ID, other.proc.pid)
    path.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as impostor:
        impostor.bind(str(path))
        impostor.listen(1)
        with pytest.raises(aperf.BusyResourceError,
                           match=f"its take-over socket belongs to pid {os.getpid()}"):
            ml.lock_map(MAP_ID, "test", [0], take_over=True)
    assert f"is read by pid {other.proc.pid} " in lock_elsewhere([0])


def test_a_holders_command_line_reaches_messages_as_printable_text(
    others: list[Other],
) -> None:
    other = Other([0], comment="\x1b]0;owned\x07\x1b[2J\u202eevil\x9b31m")
    others.append(other)
    with pytest.raises(aperf.BusyResourceError) as caught:
        ml.lock_map(MAP_ID, "test", [0])
    message = str(caught.value)
    assert f"is read by pid {other.proc.pid} (" in message
    assert "#?]0;owned??[2J?evil?31m import runpy;" in message, message
    assert message.isprintable(), repr(message)


def test_a_forked_child_holds_nothing() -> None:
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the lock's fds are closed; it lives on, holding no slot
        os.close(done_w)
        os.read(done_r, 1)
        os._exit(0 if lock.notice == -1 else 1)
    os.close(done_r)
    try:
        assert "is read by pid" in lock_elsewhere([0])
        lock.release()
        assert lock_elsewhere([0]) == "ok"  # the child, alive, does not hold it
    finally:
        lock.release()
        os.write(done_w, b"x")
        os.close(done_w)
        assert os.waitpid(pid, 0)[1] == 0


def test_the_lock_file_is_never_followed_through_a_symlink(lock_dir: Path) -> None:
    target = lock_dir / "elsewhere"
    target.write_text("keep me")
    os.symlink(target, ml.lock_path(MAP_ID))
    with pytest.raises(OSError):
        ml.lock_map(MAP_ID, "test", [0])
    assert target.read_text() == "keep me"


def test_take_over_is_checked_when_the_stream_is_made() -> None:
    from aperf.testing import FakeRingSource

    with pytest.raises(TypeError, match="take_over must be True or False"):
        aperf.PerfStream(FakeRingSource(cpus=[0]), take_over="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="only a map"):
        aperf.PerfBuffer(FakeRingSource(cpus=[0]), on_sample=print, take_over=True)


def test_lock_files_are_made_0600_and_nobody_elses_mode_is_changed(lock_dir: Path) -> None:
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    path = Path(ml.lock_path(MAP_ID))
    try:
        assert path.stat().st_mode & 0o7777 == 0o600  # not readable, let alone lockable, by others
    finally:
        lock.release()
    path.write_bytes(b"")  # one of ours that aperf did not make: used, its mode left alone
    path.chmod(0o640)
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    try:
        assert path.stat().st_mode & 0o7777 == 0o640
    finally:
        lock.release()


def test_a_hard_link_is_refused_and_its_file_left_alone(lock_dir: Path) -> None:
    precious = lock_dir / "precious"
    precious.write_text("root's")
    precious.chmod(0o600)
    os.link(precious, ml.lock_path(MAP_ID))
    with pytest.raises(OSError, match="it has 2 links"):
        ml.lock_map(MAP_ID, "test", [0])
    assert precious.stat().st_mode & 0o7777 == 0o600
    assert precious.read_text() == "root's"


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o2770])
def test_a_lock_directory_others_may_write_is_refused(
    lock_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    shared = lock_dir / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv(ml.LOCK_DIR_ENV, str(shared))
    reason = "every user could" if mode & 0o002 else "without the sticky bit"
    with pytest.raises(OSError, match=f"cannot use {shared} as the map lock directory .*{reason}"):
        ml.lock_map(MAP_ID, "test", [0])
    assert os.listdir(shared) == []


def test_the_old_default_dev_shm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ml.LOCK_DIR_ENV, "/dev/shm")  # world-writable: anyone could squat
    with pytest.raises(OSError, match="mode 1777: every user could plant or hold"):
        ml.lock_map(MAP_ID, "test", [0])
    assert not os.path.exists(f"/dev/shm/aperf-map-{MAP_ID}.lock")


def test_a_group_directory_with_the_sticky_bit_shares_the_locks(
    lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = lock_dir / "shared"
    shared.mkdir()
    shared.chmod(0o3770)  # setgid: files get its group; sticky: members keep their files
    monkeypatch.setenv(ml.LOCK_DIR_ENV, str(shared))
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    try:
        info = (shared / f"aperf-map-{MAP_ID}.lock").stat()
        assert info.st_mode & 0o7777 == 0o660 and info.st_gid == shared.stat().st_gid
        assert "is read by pid" in lock_elsewhere([0])
    finally:
        lock.release()


def test_the_default_directory_is_private_to_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ml.LOCK_DIR_ENV)
    uid = os.geteuid()
    expected = "/run/aperf" if uid == 0 else f"/dev/shm/aperf-{uid}"
    assert ml.lock_dir() == expected
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    try:
        info = os.lstat(expected)
        assert info.st_uid == uid and info.st_mode & 0o022 == 0
        assert os.path.exists(f"{expected}/aperf-map-{MAP_ID}.lock")
    finally:
        lock.release()
    assert not os.path.exists(f"{expected}/aperf-map-{MAP_ID}.lock")
