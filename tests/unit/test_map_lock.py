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


class Other:
    """A process holding slots of the map until told (a line on stdin) or killed; it
    prints ``held``, then ``taken <pid>`` when a genuine take-over request came."""

    def __init__(self, slots: list[int]) -> None:
        code = textwrap.dedent(f"""
            import select, sys
            from aperf._rings import map_lock as ml
            lock = ml.lock_map({MAP_ID}, "test", {slots!r})
            print("held", flush=True)
            while True:
                ready, _, _ = select.select([sys.stdin, lock.notice], [], [])
                if lock.notice in ready:
                    error = lock.taken_over()
                    if error is not None:
                        lock.give_up()
                        print("taken", error.pid, flush=True)
                if sys.stdin in ready:
                    lock.release()
                    print("released", flush=True)
                    break
        """)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=os.environ.copy(),
        )
        assert self.line() == "held"

    def line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert ready, "the other process said nothing"
        return self.proc.stdout.readline().strip()

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


def test_take_over_of_a_holder_that_does_not_answer_times_out(others: list[Other]) -> None:
    other = Other([0])
    others.append(other)
    other.proc.send_signal(signal.SIGSTOP)
    try:
        held = ml.MapLock(MAP_ID, "test", [0])
        with pytest.raises(aperf.BusyResourceError, match=r"did not give it up within 0\.2 s"):
            held.acquire(take_over=True, timeout=0.2)
    finally:
        other.proc.send_signal(signal.SIGCONT)


def test_a_forged_request_ends_nothing(others: list[Other]) -> None:
    lock = ml.lock_map(MAP_ID, "test", [0])
    assert lock is not None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
            out.sendto(b"give it to me", ml.notice_name(MAP_ID, os.getpid()))
            out.sendto(ml.REQUEST + b"x", ml.notice_name(MAP_ID, os.getpid()))
        assert select.select([lock.notice], [], [], 5)[0]
        assert lock.taken_over() is None
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as out:
            out.sendto(ml.REQUEST, ml.notice_name(MAP_ID, os.getpid()))
        error = lock.taken_over()
        assert isinstance(error, aperf.TakenOverError) and error.pid == os.getpid()
        assert error.map_id == MAP_ID
        import anyio

        assert isinstance(error, anyio.BrokenResourceError)
    finally:
        lock.release()


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
