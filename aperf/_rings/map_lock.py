"""The lock that keeps two aperf processes off one map.

A second perf buffer on a perf event array silently takes the map's slots from
the first (the first then receives nothing, and counts nothing as lost); two
consumers of one BPF ring buffer race for its one consumer position; two
producers of one user ring buffer tear each other's messages. So a reader (or a
user ring buffer's producer), once it knows the map's kernel id, locks the map's
slots it will use in a lock file keyed by that id, ``aperf-map-<id>.lock`` in the
lock directory (``lock_dir``):

- The directory is one that no other user can write: ``/run/aperf`` for root,
  ``/dev/shm/aperf-<uid>`` for any other user (made 0700 and checked: owned by
  the user, not group- or world-writable), or ``APERF_LOCK_DIR``: an explicit
  directory owned by root or the user, never world-writable; group-writable
  (with the sticky bit) is the opt-in for readers of several users sharing
  locks. aperf creates its files there with ``O_CREAT|O_EXCL|O_NOFOLLOW``, opens
  existing ones without ``O_CREAT`` (``fs.protected_regular`` refuses that in
  sticky directories), uses only a regular file with one link, owned by the user
  (or, in a shared directory, by the directory's group), and changes the mode of
  no file it did not create.
- POSIX record locks (``fcntl(F_SETLK)``), one byte per map slot (the slot's
  key: a CPU id for a perf event array, 0 for a ring buffer). Readers of
  disjoint slots of one map (shards) are compatible owners; the kernel drops
  the locks when their holder dies, never hands them to a forked child, and
  ``F_GETLK`` names the holder's pid. The file holds no data: nothing in it is
  trusted, and a stale file (its holder dead) is simply free.
- A reader listens for take-over requests on a ``SOCK_SEQPACKET`` socket in the
  same directory, ``aperf-map-<id>-<pid>.sock``. A taker connects (each side
  checks the other's credentials: the holder accepts only root or its own
  user, and only root when it runs as the shared ``nobody``; the taker talks
  only to the pid that holds the lock), sends ``request`` and waits, up to its
  timeout, for ``offer``. Only then does it send ``accept``, and from then on it
  waits for the holder, which empties its slots, unlocks and hangs up. A taker
  that timed out closes its connection: that withdraws the request, and a
  holder that reads it later (stopped meanwhile, say) finds nobody to offer the
  map to and keeps it. The socket is behind the holder's notice handle (an
  epoll fd the driver waits on with the rings), so the holder learns at once, at
  no cost per sample or per wakeup.

Map ids are global per boot and reused only after their map is freed (the lock
of a freed map is free, its file is removed by its last holder when it can be).
Readers that are not aperf (BCC, a C program) take no lock and are not seen.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
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
"""An explicit lock directory (the opt-in for sharing locks between users); see ``lock_dir``."""
ROOT_LOCK_DIR = "/run/aperf"
"""Root's lock directory: made 0700 if missing; it must be root's and writable by root only."""
USER_LOCK_DIR = "/dev/shm/aperf-{uid}"
"""Any other user's: made 0700 if missing; it must be the user's and writable by them only."""
TAKE_OVER_TIMEOUT = 5.0
"""Seconds a taker waits for the holder to answer its request (read at each take-over)."""

REQUEST = b"aperf take-over 2 request"
OFFER = b"aperf take-over 2 offer"
ACCEPT = b"aperf take-over 2 accept"
REFUSED = b"aperf take-over 2 refused"
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_MAX_PEERS = 16  # connections a holder keeps open at once; more are hung up on
_MAX_EVENTS = 32  # readiness events handled per notice: a flood costs a bounded look

if sys.platform != "win32":
    import fcntl

    # struct flock on Linux, 64-bit off_t: type, whence, start, len, pid (padded to 8).
    _FLOCK = struct.Struct("hhqqi4x")

_live: weakref.WeakSet[MapLock] = weakref.WeakSet()
_live_lock = threading.Lock()


def lock_dir() -> str:
    """The lock directory this process uses: ``APERF_LOCK_DIR``, else root's or the user's."""
    explicit = os.environ.get(LOCK_DIR_ENV)
    if explicit:
        return explicit
    uid = os.geteuid()
    return ROOT_LOCK_DIR if uid == 0 else USER_LOCK_DIR.format(uid=uid)


def lock_name(map_id: int) -> str:
    return f"aperf-map-{map_id}.lock"


def lock_path(map_id: int) -> str:
    """The lock file of the map with kernel id ``map_id``."""
    return os.path.join(lock_dir(), lock_name(map_id))


def socket_name(map_id: int, pid: int) -> str:
    """Where, in the lock directory, the holder ``pid`` of ``map_id`` hears take-over requests."""
    return f"aperf-map-{map_id}-{pid}.sock"


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive slots: [0, 1, 2, 5] -> [(0, 3), (5, 1)]."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def printable(text: str) -> str:
    """``text`` with every character that is not printable (terminal escapes, bidi
    controls, newlines) shown as ``?``: what another process chose never reaches a
    terminal or a log as anything but text."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _describe(pid: int) -> str:
    """``pid 1234 (python3 reader.py)``: the kernel's word on the holder, for messages."""
    if pid <= 0:
        return "a process in another pid namespace"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(200)
    except OSError:
        return f"pid {pid}"
    words = printable(" ".join(raw.replace(b"\0", b" ").decode(errors="replace").split()))
    return f"pid {pid} ({words[:80]})" if words else f"pid {pid}"


def _overflow_uid() -> int:
    """The uid of ``nobody`` (the kernel's overflow uid, 65534 unless changed)."""
    try:
        with open("/proc/sys/kernel/overflowuid", "rb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65534


def _unusable(path: str, err: int | None, reason: str | None) -> OSError:
    return OSError(
        err, f"cannot use the map lock file {printable(path)} ({reason}); see "
        f"{LOCK_DIR_ENV} in docs/rings.md", path,
    )


def _cpus(runs: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{s}" if n == 1 else f"{s}-{s + n - 1}" for s, n in runs)


class LockDir:
    """The lock directory, open and checked: an fd that every file operation goes
    through (``dir_fd``), so that nothing is looked up twice by path."""

    def __init__(self) -> None:
        self.path = lock_dir()
        explicit = bool(os.environ.get(LOCK_DIR_ENV))
        euid = os.geteuid()
        if not explicit:
            try:
                os.mkdir(self.path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise self._refused(exc.errno, f"cannot make it: {exc.strerror}") from None
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if explicit else os.O_NOFOLLOW)
        try:
            self.fd = os.open(self.path, flags)
        except OSError as exc:
            raise self._refused(exc.errno, exc.strerror or "cannot open it") from None
        try:
            info = os.fstat(self.fd)
            mode = stat.S_IMODE(info.st_mode)
            owners = (0, euid) if explicit else (euid,)
            if info.st_uid not in owners:
                raise self._refused(errno.EPERM, f"it belongs to uid {info.st_uid}, who could "
                                    "remove or replace its lock files")
            if mode & stat.S_IWOTH:
                raise self._refused(errno.EPERM, f"mode {mode:04o}: every user could plant or "
                                    "hold its lock files")
            self.shared = bool(mode & stat.S_IWGRP)
            if self.shared and not explicit:
                raise self._refused(errno.EPERM, f"mode {mode:04o}: aperf's own directory is "
                                    f"private; share locks through {LOCK_DIR_ENV}")
            if self.shared and not mode & stat.S_ISVTX:
                raise self._refused(errno.EPERM, f"mode {mode:04o}: group-writable without the "
                                    "sticky bit, so any member could remove the others' locks "
                                    "(chmod 3770)")
            self.gid = info.st_gid
        except BaseException:
            os.close(self.fd)
            raise

    def _refused(self, err: int | None, reason: str) -> OSError:
        return OSError(
            err, f"cannot use {printable(self.path)} as the map lock directory ({reason}); "
            f"set {LOCK_DIR_ENV} to a directory owned by root or by this user that no other "
            "user can write (docs/rings.md)", self.path,
        )

    def at(self, name: str) -> str:
        """A path to ``name`` in this very directory, for calls that take no dir_fd (bind)."""
        return f"/proc/self/fd/{self.fd}/{name}"

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Peer:
    """A taker's connection to a holder, and how far their exchange got."""

    __slots__ = ("conn", "offered", "pid")

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn = conn
        self.pid = pid
        self.offered = False


class MapLock:
    """This process's lock on some slots of one map, and the socket where it hears
    take-over requests. ``acquire`` takes it (all or nothing); ``release`` is idempotent.

    ``purpose`` is what the holder does with the map (``read`` or ``produce``): it
    words the errors; a producer does not listen for take-over requests."""

    def __init__(self, map_id: int, name: str, slots: Iterable[int], *,
                 purpose: str = "read") -> None:
        self.map_id = map_id
        self.name = printable(name)
        self.runs = slot_runs(slots)
        self.purpose = purpose
        self._dir: LockDir | None = None
        self._fd = -1
        self._held = False
        self._listener: socket.socket | None = None
        self._socket_ino = 0
        self._epoll: select.epoll | None = None
        self._peers: dict[int, _Peer] = {}
        self._taker: socket.socket | None = None

    @property
    def notice(self) -> int:
        """The fd that turns readable when a taker talks to us (-1 when none)."""
        return self._epoll.fileno() if self._epoll is not None else -1

    # --- taking the lock ---------------------------------------------------------------

    def acquire(self, *, take_over: bool = False, timeout: float | None = None) -> None:
        """Lock the slots, or raise BusyResourceError naming the holder. With
        ``take_over``, ask the holders to give the map up: wait up to ``timeout``
        seconds (``TAKE_OVER_TIMEOUT``) for them to agree, then for them to finish."""
        if not self.runs:
            return
        with _live_lock:
            if any(other.map_id == self.map_id for other in _live):
                # POSIX locks belong to the process: a second one would succeed, and
                # closing its fd would drop the first's.
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}) is already locked in this process"
                )
        try:
            self._dir = LockDir()
            self._open()
            holders = self._try_lock()
            if holders and take_over:
                self._take_over(holders, TAKE_OVER_TIMEOUT if timeout is None else timeout)
            elif holders:
                raise BusyResourceError(self._busy(holders))
            if self.purpose == "read":
                self._listen()
        except BaseException:
            self.release()
            raise
        with _live_lock:
            _live.add(self)

    def _busy(self, holders: list[tuple[int, list[tuple[int, int]]]]) -> str:
        where = f"Lock file: {printable(lock_path(self.map_id))}"
        if self.purpose == "produce":
            return (
                f"user ring buffer {self.name} (id {self.map_id}) has a producer in "
                f"{'; '.join(_describe(pid) for pid, _ in holders)}: a second producer would "
                f"lose and tear messages (the ring has one producer). Close that one. {where}"
            )
        readers = "; ".join(
            f"{_describe(pid)} on {'its ring' if runs == [(0, 1)] else 'CPUs ' + _cpus(runs)}"
            for pid, runs in holders
        )
        return (
            f"map {self.name} (id {self.map_id}) is read by {readers}: a second reader would "
            "silently take it from that one. Close that reader, or pass take_over=True to take "
            f"the map over (that reader's stream then ends with TakenOverError). {where}"
        )

    def _open(self) -> None:
        """Open the lock file, or make it: never through a symlink, never anything but a
        regular file of one link that is ours (or, shared, our group's)."""
        assert self._dir is not None
        name, dfd = lock_name(self.map_id), self._dir.fd
        shared = self._dir.shared
        base = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        for _ in range(100):
            created = False
            try:
                # Without O_CREAT first: fs.protected_regular refuses O_CREAT on another
                # user's file in a sticky directory, even when the file exists.
                fd = os.open(name, base, dir_fd=dfd)
            except FileNotFoundError:
                try:
                    fd = os.open(name, base | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=dfd)
                except FileExistsError:
                    continue  # made meanwhile: open that one
                except OSError as exc:
                    raise _unusable(lock_path(self.map_id), exc.errno, exc.strerror) from None
                created = True
            except OSError as exc:
                raise _unusable(lock_path(self.map_id), exc.errno, exc.strerror) from None
            try:
                if created and shared:
                    # Ours, so ours to set: the group's readers lock it too.
                    with contextlib.suppress(OSError):
                        os.fchown(fd, -1, self._dir.gid)
                    os.fchmod(fd, 0o660)
                info = os.fstat(fd)
                if info.st_nlink == 0:
                    os.close(fd)  # removed by its last holder meanwhile: again
                    continue
                self._check(info)
            except BaseException:
                os.close(fd)
                raise
            self._fd = fd
            return
        raise BusyResourceError(f"the lock file of map {self.name} keeps changing")

    def _check(self, info: os.stat_result) -> None:
        assert self._dir is not None
        path = lock_path(self.map_id)
        if not stat.S_ISREG(info.st_mode):
            raise _unusable(path, errno.EINVAL, "not a regular file")
        if info.st_nlink != 1:
            raise _unusable(path, errno.EMLINK, f"it has {info.st_nlink} links: a hard link to "
                            "another file, not a lock file aperf made")
        ours = info.st_uid == os.geteuid() or (self._dir.shared and info.st_gid == self._dir.gid)
        if not ours:
            raise _unusable(path, errno.EPERM, f"it belongs to uid {info.st_uid}, not to this "
                            "user" + (" nor to the directory's group" if self._dir.shared else ""))

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

    # --- the taker's side -------------------------------------------------------------------

    def _take_over(
        self, holders: list[tuple[int, list[tuple[int, int]]]], timeout: float
    ) -> None:
        """Ask every holder; once all offered (before the deadline), accept and wait for
        them to hang up. At the deadline, withdraw: close every connection unaccepted."""
        deadline = time.monotonic() + timeout
        conns: dict[int, socket.socket] = {}
        try:
            for pid, _ in holders:
                conn = self._ask(pid)
                if conn is None:
                    if self._try_lock() == []:
                        return  # it died meanwhile, and nobody else came
                    raise BusyResourceError(
                        f"map {self.name} (id {self.map_id}) is read by {_describe(pid)}, "
                        "which cannot be asked to give it up (it listens for no take-over "
                        "request here: another pid namespace, another lock directory, or an "
                        "older aperf)"
                    )
                conns[pid] = conn
            waiting = dict(conns)
            while waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BusyResourceError(
                        f"map {self.name} (id {self.map_id}): "
                        f"{', '.join(_describe(pid) for pid in waiting)} did not give it up "
                        f"within {timeout} s of the take-over request (a reader learns of it "
                        "while its event loop runs, or in PerfBuffer.poll()); the request is "
                        "withdrawn, the map stays with that reader"
                    )
                for pid in self._readable(waiting, left):
                    answer = self._receive(waiting.pop(pid))
                    if answer == REFUSED:
                        raise BusyResourceError(
                            f"map {self.name} (id {self.map_id}): {_describe(pid)} accepts a "
                            "take-over only from root or its own user (only from root when it "
                            "runs as nobody)"
                        )
                    if answer != OFFER:
                        del conns[pid]  # hung up unasked: it died, or gave the map up
            for conn in conns.values():
                with contextlib.suppress(OSError):  # died meanwhile: its locks are gone too
                    conn.send(ACCEPT, socket.MSG_NOSIGNAL)
            for conn in conns.values():
                # Agreed: the holder is emptying its slots in its event loop. It hangs up
                # when done (or dies): no deadline here, for it may not give up to no one.
                conn.setblocking(True)
                with contextlib.suppress(OSError):
                    conn.recv(64)
        finally:
            for conn in conns.values():
                conn.close()
        still = self._try_lock()
        if still:
            raise BusyResourceError(
                f"map {self.name} (id {self.map_id}) is still read by "
                f"{', '.join(_describe(pid) for pid, _ in still)} after the take-over (it "
                "hung up on the request, or another reader came first)"
            )

    def _ask(self, pid: int) -> socket.socket | None:
        """A connection to the holder ``pid``, its credentials checked, our request sent;
        None if nobody listens for it."""
        assert self._dir is not None
        if pid <= 0:
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            conn.setblocking(False)
            try:
                conn.connect(self._dir.at(socket_name(self.map_id, pid)))
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                return None
            except PermissionError:
                conn.close()
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}): {_describe(pid)} accepts a take-over "
                    "only from root or its own user"
                ) from None
            except BlockingIOError:
                conn.close()
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}): {_describe(pid)} has too many "
                    "take-over requests waiting"
                ) from None
            peer, _, _ = _CRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            if peer != pid:
                conn.close()
                raise BusyResourceError(
                    f"map {self.name} (id {self.map_id}) is read by {_describe(pid)}, but its "
                    f"take-over socket belongs to pid {peer}: not asked"
                )
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                conn.send(REQUEST, socket.MSG_NOSIGNAL)  # refused already: its answer waits
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _readable(conns: dict[int, socket.socket], timeout: float) -> list[int]:
        poller = select.poll()
        by_fd = {conn.fileno(): pid for pid, conn in conns.items()}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        return [by_fd[fd] for fd, _ in poller.poll(max(1, int(timeout * 1000)))]

    @staticmethod
    def _receive(conn: socket.socket) -> bytes:
        """The holder's answer, b"" if it hung up: a holder that hung up before it read
        our request makes the kernel report ECONNRESET first, then what it said."""
        for _ in range(2):
            try:
                return conn.recv(64)
            except ConnectionResetError:
                continue
            except OSError:
                break
        return b""

    # --- the holder's side ----------------------------------------------------------------

    def _listen(self) -> None:
        """Listen for take-over requests (not when the name cannot be had: the lock holds,
        and a taker is told that this reader cannot be asked)."""
        assert self._dir is not None
        name = socket_name(self.map_id, os.getpid())
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            try:
                sock.bind(self._dir.at(name))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                # Left by a dead process that had our pid (live ones all differ).
                os.unlink(name, dir_fd=self._dir.fd)
                sock.bind(self._dir.at(name))
            self._socket_ino = os.stat(name, dir_fd=self._dir.fd, follow_symlinks=False).st_ino
            sock.listen(8)
            sock.setblocking(False)
            epoll = select.epoll()
            epoll.register(sock.fileno(), select.EPOLLIN)
        except OSError:
            sock.close()
            return
        self._listener, self._epoll = sock, epoll

    def taken_over(self) -> TakenOverError | None:
        """Answer the takers that talked to us: the error to end the stream with once a
        taker accepted our offer (from root or from our own user), else None. Call
        when ``notice`` is readable."""
        epoll, listener = self._epoll, self._listener
        if epoll is None or listener is None:
            return None
        genuine: TakenOverError | None = None
        for fd, _ in epoll.poll(0, _MAX_EVENTS):
            if fd == listener.fileno():
                genuine = self._admit(listener) or genuine
            else:
                genuine = self._hear(fd) or genuine
        return genuine

    def _allowed(self, uid: int) -> bool:
        """Root, or our own user (as ``kill`` would): not when that is the shared nobody."""
        euid = os.geteuid()
        return uid == 0 or (uid == euid and euid != _overflow_uid())

    def _admit(self, listener: socket.socket) -> TakenOverError | None:
        """Take the new connections: refuse whom we may not give the map to, hear the others."""
        assert self._epoll is not None
        genuine: TakenOverError | None = None
        for _ in range(_MAX_EVENTS):
            try:
                conn, _ = listener.accept()
            except OSError:
                break  # none left (EAGAIN), or a taker that hung up meanwhile
            conn.setblocking(False)
            pid, uid, _ = _CRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            if not self._allowed(uid) or len(self._peers) >= _MAX_PEERS:
                with contextlib.suppress(OSError):
                    conn.send(REFUSED, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
                conn.close()
                continue
            self._peers[conn.fileno()] = _Peer(conn, pid)
            self._epoll.register(conn.fileno(), select.EPOLLIN)
            # Its request is there already, unless it hung up (and a fast taker may even
            # have accepted our offer: we read on as far as it got).
            genuine = self._hear(conn.fileno()) or genuine
        return genuine

    def _hear(self, fd: int) -> TakenOverError | None:
        """Read a taker's messages: offer on request; the map is its on accept."""
        peer = self._peers.get(fd)
        if peer is None:
            return None
        for _ in range(4):
            try:
                data = peer.conn.recv(64)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                data = b""
            if data == REQUEST and not peer.offered:
                try:
                    peer.conn.send(OFFER, socket.MSG_NOSIGNAL | socket.MSG_DONTWAIT)
                except OSError:
                    break  # gone: the request was withdrawn
                peer.offered = True
            elif data == ACCEPT and peer.offered and self._taker is None:
                self._drop(fd, close=False)
                self._taker = peer.conn  # hung up on once we gave up: the taker waits for that
                return TakenOverError(self.name, self.map_id, peer.pid)
            else:
                break  # hung up (withdrawn), or said what the protocol does not
        self._drop(fd)
        return None

    def _drop(self, fd: int, *, close: bool = True) -> None:
        peer = self._peers.pop(fd, None)
        if peer is None:
            return
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        if close:
            peer.conn.close()

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
        """Taken over: unlock our slots now, then hang up on the taker, which waits for
        that. We stop listening; the (now idle) epoll fd stays open until ``release``:
        the driver still watches it."""
        if self._held and self._fd >= 0:
            self._unlock(self.runs)
            self._held = False
        self._stop_listening()

    def _stop_listening(self) -> None:
        taker, self._taker = self._taker, None
        if taker is not None:
            taker.close()
        for fd in list(self._peers):
            self._drop(fd)
        listener, self._listener = self._listener, None
        if listener is None:
            return
        if self._epoll is not None:
            with contextlib.suppress(OSError):
                self._epoll.unregister(listener.fileno())
        listener.close()
        if self._dir is not None and self._dir.fd >= 0:
            self._unlink_if_same(socket_name(self.map_id, os.getpid()), self._socket_ino)

    def _unlink_if_same(self, name: str, ino: int) -> None:
        assert self._dir is not None
        with contextlib.suppress(OSError):  # gone, or not ours to remove (sticky dir)
            if os.stat(name, dir_fd=self._dir.fd, follow_symlinks=False).st_ino == ino:
                os.unlink(name, dir_fd=self._dir.fd)

    def release(self) -> None:
        """Unlock our slots, stop listening, remove the lock file if nobody else holds it."""
        self._stop_listening()
        epoll, self._epoll = self._epoll, None
        if epoll is not None:
            epoll.close()
        fd, self._fd = self._fd, -1
        try:
            if fd >= 0:
                try:
                    if self._held:
                        self._unlock(self.runs, fd)
                        self._held = False
                    self._remove_if_unused(fd)
                finally:
                    os.close(fd)  # closing drops this process's locks on the file in any case
        finally:
            folder, self._dir = self._dir, None
            if folder is not None:
                folder.close()
            with _live_lock:
                _live.discard(self)

    def _unlock(self, runs: Iterable[tuple[int, int]], fd: int | None = None) -> None:
        for start, length in runs:
            fcntl.lockf(self._fd if fd is None else fd, fcntl.LOCK_UN, length, start)

    def _remove_if_unused(self, fd: int) -> None:
        """Unlink the file if no slot of it is locked (a whole-file lock succeeds), and if
        the name is still our file: those who opened it meanwhile see st_nlink 0 once
        locked and open the name again. (Whoever removed ours held this lock to do it.)"""
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)
        except OSError:
            return
        try:
            info = os.fstat(fd)
            if self._dir is not None and info.st_nlink:
                self._unlink_if_same(lock_name(self.map_id), info.st_ino)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 0, 0)

    def forget_after_fork(self) -> None:
        """In a forked child: close the child's copies. The child holds no POSIX lock
        (they are never inherited), and must not remove the parent's socket name nor
        answer its takers."""
        closing = [self._listener, self._taker, self._epoll, self._dir,
                   *(peer.conn for peer in self._peers.values())]
        self._listener = self._taker = self._epoll = self._dir = None
        self._peers = {}
        self._held = False
        for each in closing:
            if each is not None:
                each.close()  # the child's copy: the name stays bound, never unlinked here
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _forget_all_after_fork() -> None:
    for held in list(_live):
        held.forget_after_fork()
    _live.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all_after_fork)


def lock_map(
    map_id: int, name: str, slots: Iterable[int], *, take_over: bool = False,
    purpose: str = "read",
) -> MapLock | None:
    """Lock ``slots`` of map ``map_id`` for this process (None where there is no such
    lock: not on Linux). BusyResourceError names the holder; see ``MapLock.acquire``."""
    if sys.platform == "win32":
        return None
    held = MapLock(map_id, name, slots, purpose=purpose)
    held.acquire(take_over=take_over)
    return held
