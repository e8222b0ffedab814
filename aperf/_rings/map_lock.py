"""The lock that keeps two aperf readers in two processes off one map.

A second perf buffer on a perf event array silently takes the map's slots from
the first (the first then receives nothing, and counts nothing as lost); two
consumers of one BPF ring buffer race for its one consumer position. So a
reader, once it knows the map's kernel id, locks the map's slots it will use
in a lock file keyed by that id, ``<APERF_LOCK_DIR or /dev/shm>/aperf-map-<id>.lock``:

- POSIX record locks (``fcntl(F_SETLK)``), one byte per map slot (the slot's
  key: a CPU id for a perf event array, 0 for a ring buffer). Readers of
  disjoint slots of one map (shards) are compatible owners; the kernel drops
  the locks when their holder dies, never hands them to a forked child, and
  ``F_GETLK`` names the holder's pid. The file holds no data: nothing in it is
  trusted, and a stale file (its holder dead) is simply free.
- A holder listens on a datagram socket in the abstract namespace, named
  after the map id and its pid (``\\0aperf-map-<id>-pid-<pid>``). A reader asked
  to ``take_over`` sends it a request there; the kernel adds the sender's
  credentials, and the holder gives up (its stream ends with ``TakenOverError``)
  only for a request from root or from its own user, as ``kill`` would. The
  socket is the holder's notice handle: the driver waits on it with the rings,
  so the holder learns at once, at no cost per sample or per wakeup.

Map ids are global per boot and reused only after their map is freed (the lock
of a freed map is free, its file is removed by its last holder when it can be).
Readers that are not aperf (BCC, a C program) take no lock and are not seen.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Sequence

from .._errors import BusyResourceError, TakenOverError

LOCK_DIR_ENV = "APERF_LOCK_DIR"
"""Where the lock files live (default ``/dev/shm``: tmpfs, emptied at boot, as map ids are)."""
DEFAULT_LOCK_DIR = "/dev/shm"
TAKE_OVER_TIMEOUT = 5.0
"""Seconds a reader asked to take over waits for the holder to give up the map."""

REQUEST = b"aperf take-over 1"
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_MAX_REQUESTS = 64  # datagrams read per notice: a flood costs a bounded look each time

if sys.platform != "win32":
    import fcntl

    # struct flock on Linux, 64-bit off_t: type, whence, start, len, pid (padded to 8).
    _FLOCK = struct.Struct("hhqqi4x")

_live: weakref.WeakSet[MapLock] = weakref.WeakSet()
_live_lock = threading.Lock()


def lock_dir() -> str:
    return os.environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR


def lock_path(map_id: int) -> str:
    """The lock file of the map with kernel id ``map_id``."""
    return os.path.join(lock_dir(), f"aperf-map-{map_id}.lock")


def notice_name(map_id: int, pid: int) -> bytes:
    """The abstract socket where the holder ``pid`` of map ``map_id`` hears take-over requests."""
    return f"\0aperf-map-{map_id}-pid-{pid}".encode()


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive slots: [0, 1, 2, 5] -> [(0, 3), (5, 1)]."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def _describe(pid: int) -> str:
    """``pid 1234 (python3 reader.py)``: the kernel's word on the holder, for messages."""
    if pid <= 0:
        return "a process in another pid namespace"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(200)
    except OSError:
        return f"pid {pid}"
    words = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
    return f"pid {pid} ({words[:80]})" if words else f"pid {pid}"


def _unusable(path: str, err: int | None, reason: str | None) -> OSError:
    return OSError(
        err, f"cannot use the map lock file {path} ({reason}); set {LOCK_DIR_ENV} to a "
        "directory that every aperf reader of this host can write", path,
    )


def _cpus(runs: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{s}" if n == 1 else f"{s}-{s + n - 1}" for s, n in runs)


class MapLock:
    """This process's lock on some slots of one map, and the socket where it hears
    take-over requests. ``acquire`` takes it (all or nothing); ``release`` is idempotent."""

    def __init__(self, map_id: int, name: str, slots: Iterable[int]) -> None:
        self.map_id = map_id
        self.name = name
        self.runs = slot_runs(slots)
        self._fd = -1
        self._notice: socket.socket | None = None
        self._held = False

    @property
    def notice(self) -> int:
        """The fd that turns readable when a take-over request arrives (-1 when none)."""
        return self._notice.fileno() if self._notice is not None else -1

    # --- taking the lock ---------------------------------------------------------------

    def acquire(self, *, take_over: bool = False, timeout: float = TAKE_OVER_TIMEOUT) -> None:
        """Lock the slots, or raise BusyResourceError naming the holder. With
        ``take_over``, ask the holders to give the map up and wait for them
        (up to ``timeout`` seconds)."""
        if not self.runs:
            return
        with _live_lock:
            if any(other.map_id == self.map_id for other in _live):
                # POSIX locks belong to the process: a second one would succeed, and
                # closing its fd would drop the first's.
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}) is already locked in this process"
                )
        self._open()
        try:
            holders = self._try_lock()
            if holders and take_over:
                self._take_over(holders, timeout)
            elif holders:
                readers = "; ".join(
                    f"{_describe(pid)} on "
                    f"{'its ring' if runs == [(0, 1)] else 'CPUs ' + _cpus(runs)}"
                    for pid, runs in holders
                )
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}) is read by {readers}: a second "
                    "reader would silently take it from that one. Close that reader, or pass "
                    "take_over=True to take the map over (that reader's stream then ends "
                    f"with TakenOverError). Lock file: {lock_path(self.map_id)}"
                )
            self._listen()
        except BaseException:
            self.release()
            raise
        with _live_lock:
            _live.add(self)

    def _open(self) -> None:
        """Open (or make) the lock file; never through a symlink, never anything but a file."""
        path = lock_path(self.map_id)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as exc:
            raise _unusable(path, exc.errno, exc.strerror) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise _unusable(path, errno.EINVAL, "not a regular file")
            if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o666:
                os.fchmod(fd, 0o666)  # readers of other users lock it too (umask aside)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _try_lock(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """Lock every run; on a conflict unlock ours and return the holders and their runs."""
        for attempt in range(20):
            taken: list[tuple[int, int]] = []
            conflict = False
            for start, length in self.runs:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
                except OSError as exc:
                    if exc.errno not in (errno.EACCES, errno.EAGAIN):
                        raise
                    conflict = True
                    break
                taken.append((start, length))
            if not conflict:
                if os.fstat(self._fd).st_nlink == 0:
                    # Its last holder removed the file meanwhile: lock the one at the path.
                    self._unlock(taken)
                    os.close(self._fd)
                    self._fd = -1
                    self._open()
                    continue
                self._held = True
                return []
            self._unlock(taken)
            holders = self.holders()
            if holders:
                return holders
            time.sleep(0.001 * attempt)  # the holder let go between our two calls: again
        raise BusyResourceError(f"the lock of map {self.name} (id {self.map_id}) keeps changing")

    def holders(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """Who holds which of our slots, by pid (the kernel's answer, F_GETLK)."""
        found: dict[int, list[tuple[int, int]]] = {}
        for start, length in self.runs:
            end = start + length
            while start < end:
                probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, start, end - start, 0)
                kind, _, lo, size, pid = _FLOCK.unpack(fcntl.fcntl(self._fd, fcntl.F_GETLK, probe))
                if kind == fcntl.F_UNLCK:
                    break
                hi = end if size == 0 else min(end, lo + size)
                found.setdefault(pid, []).append((max(start, lo), hi - max(start, lo)))
                start = hi
        return list(found.items())

    def _take_over(
        self, holders: list[tuple[int, list[tuple[int, int]]]], timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as out:
            for pid, _ in holders:
                try:
                    out.sendto(REQUEST, notice_name(self.map_id, pid))
                except OSError as exc:
                    if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                        raise
                    if self._try_lock() == []:
                        return  # it died meanwhile
                    raise BusyResourceError(
                        f"map {self.name} (id {self.map_id}) is read by {_describe(pid)}, "
                        "which cannot be asked to give it up (it listens for no take-over "
                        "request: another network namespace, or an older aperf)"
                    ) from None
        while True:
            left = self._try_lock()
            if not left:
                return
            if time.monotonic() >= deadline:
                pids = ", ".join(_describe(pid) for pid, _ in left)
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}): {pids} did not give it up within "
                    f"{timeout} s of the take-over request (a reader learns of it while its "
                    "event loop runs, or in PerfBuffer.poll())"
                )
            time.sleep(0.005)

    def _listen(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(notice_name(self.map_id, os.getpid()))
            sock.setblocking(False)
        except OSError:
            # E.g. the name is taken (by whom, we cannot tell): the lock holds, but a
            # take-over request cannot reach us (the taker says so).
            sock.close()
            return
        self._notice = sock

    # --- the holder's side ----------------------------------------------------------------

    def taken_over(self) -> TakenOverError | None:
        """Read the pending requests: the error to end the stream with, if one is genuine
        (from root or from our own user), else None. Call when ``notice`` is readable."""
        sock = self._notice
        if sock is None:
            return None
        genuine: TakenOverError | None = None
        for _ in range(_MAX_REQUESTS):
            try:
                data, ancillary, _, _ = sock.recvmsg(64, socket.CMSG_SPACE(_CRED.size))
            except (BlockingIOError, InterruptedError):
                break
            pid = uid = -1
            for level, kind, value in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, uid, _ = _CRED.unpack(value[: _CRED.size])
            if data == REQUEST and uid in (0, os.geteuid()) and genuine is None:
                genuine = TakenOverError(self.name, self.map_id, pid)
        return genuine

    def add_slot(self, slot: int) -> bool:
        """Lock one more slot (a CPU that came online); False if another process holds it."""
        if not self._held or self._fd < 0 or any(s <= slot < s + n for s, n in self.runs):
            return self._held
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            return False
        self.runs.append((slot, 1))
        return True

    def give_up(self) -> None:
        """Taken over: unlock our slots now, for the taker waiting on them. The socket
        stays open until ``release``: the driver still watches it."""
        if self._held and self._fd >= 0:
            self._unlock(self.runs)
            self._held = False

    def release(self) -> None:
        """Unlock our slots, stop listening, remove the lock file if nobody else holds it."""
        sock, self._notice = self._notice, None
        if sock is not None:
            sock.close()
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            if self._held:
                self._unlock(self.runs, fd)
                self._held = False
            self._remove_if_unused(fd)
        finally:
            os.close(fd)  # closing drops this process's locks on the file in any case
            with _live_lock:
                _live.discard(self)

    def _unlock(self, runs: Iterable[tuple[int, int]], fd: int | None = None) -> None:
        for start, length in runs:
            fcntl.lockf(self._fd if fd is None else fd, fcntl.LOCK_UN, length, start)

    def _remove_if_unused(self, fd: int) -> None:
        """Unlink the file if no slot of it is locked (a whole-file lock succeeds): those
        who opened it meanwhile see st_nlink 0 once locked and open the path again."""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)
        except OSError:
            return
        try:
            with contextlib.suppress(OSError):  # not ours to remove (sticky dir), or gone
                os.unlink(lock_path(self.map_id))
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 0, 0)

    def forget_after_fork(self) -> None:
        """In a forked child: close the child's copies. The child holds no POSIX lock
        (they are never inherited), and its copy of the socket must not keep the
        parent's name bound after the parent is gone."""
        sock, self._notice = self._notice, None
        if sock is not None:
            sock.close()
        fd, self._fd = self._fd, -1
        self._held = False
        if fd >= 0:
            os.close(fd)


def _forget_all_after_fork() -> None:
    for held in list(_live):
        held.forget_after_fork()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_after_fork)


def lock_map(
    map_id: int, name: str, slots: Iterable[int], *, take_over: bool = False
) -> MapLock | None:
    """Lock ``slots`` of map ``map_id`` for this process (None where there is no such
    lock: not on Linux). BusyResourceError names the holder; see ``MapLock.acquire``."""
    if sys.platform == "win32":
        return None
    held = MapLock(map_id, name, slots)
    held.acquire(take_over=take_over)
    return held
