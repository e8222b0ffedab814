"""User ring buffers: messages from user space to BPF (``BPF_MAP_TYPE_USER_RINGBUF``, Linux 6.1).

The kernel's protocol is the BPF ring buffer's, with the roles swapped
(``kernel/bpf/ringbuf.c``): user space produces, a BPF program consumes with
``bpf_user_ringbuf_drain()``. The map fd maps the consumer page read-only at
offset 0, and the producer page and the data area (mapped twice in a row, so a
record that wraps reads as one run) read-write from one page on. A record is
an 8-byte header (``u32 len`` with the BUSY and DISCARD bits, ``u32`` pad) and
``len`` bytes padded to 8. To send: reserve (header BUSY, then ``producer_pos``
moves on), write the data, then clear BUSY (or set DISCARD). On x86-64 (TSO)
plain stores in that order are what the kernel's acquire loads need.

The memory is mapped with Python's ``mmap`` (libbpf 1.1's
``user_ring_buffer__*`` would map it too, but hand out raw pointers): a
reservation is a ``memoryview`` of the mapping, released at submit or discard,
and an ``mmap`` is never unmapped while any view of it, or a slice of one,
exists, so no view can ever reach unmapped memory.

Waiting for room: the kernel has no wakeup of its own for user space producers,
but the map fd's poll reports EPOLLOUT while the ring is not full and the drain
wakes its waiters after it consumed samples. An epoll fd of our own watches the
map fd edge-triggered, one event per drain; the loop watches that epoll fd for
readability (asyncio, uvloop and trio alike, through anyio), and a waiting
send clears it, tries again, and waits for the next drain. No thread per wait,
no busy loop while the ring has some room but not enough.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import struct
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import anyio

from .._bpf.object import BPFObject, Map
from .._decoding.decode import is_ctypes_structure
from .._decoding.encode import Encoder, from_ctypes, from_layout, from_struct, raw_bytes
from .._errors import (
    AperfError,
    BusyResourceError,
    ClosedResourceError,
    MapTypeError,
    RingFullError,
)
from .._options import PAGE_SIZE
from .._rings import map_spec as maps
from .._rings.map_lock import MapLock, lock_map
from .._rings.map_spec import RING_ACCESS_ENV, ring_access
from .._rings.ringbuf.user_format import UserRingWriter, record_step
from .lifetime import forked_error, track, untrack

BPF_MAP_TYPE_USER_RINGBUF = 31

EncoderSpec = Callable[[Any], bytes] | struct.Struct | str | type | None
"""What ``encoder=`` takes: what ``decoder=`` takes, in the other direction."""

_producers: set[int] = set()  # kernel map ids with a UserRingBuffer in this process
_producers_lock = threading.Lock()


class _Ring:
    """What a UserRingBuffer holds: our map fd, the two mappings, the epoll fd, the writer."""

    __slots__ = ("__weakref__", "claim", "epoll", "fd", "forked", "map_id", "mappings",
                 "name", "writer")

    def __init__(self, spec: maps.MapSpec, name: str) -> None:
        self.name = name
        self.forked = False
        self.fd = -1
        self.map_id = 0
        self.claim: MapLock | None = None
        self.mappings: list[mmap.mmap] = []
        self.epoll: select.epoll | None = None
        self.writer: UserRingWriter | None = None
        try:
            self._open(spec)
        except BaseException:
            self.release()
            raise

    def _open(self, spec: maps.MapSpec) -> None:
        if ring_access() != "direct":
            raise AperfError(
                f"user ring buffer {self.name}: aperf writes user ring buffers straight into "
                "their memory, which is correct only on x86-64 (TSO) "
                f"({RING_ACCESS_ENV}={os.environ.get(RING_ACCESS_ENV, '')!r})"
            )
        self.fd = maps.open_map_fd(spec)
        facts = maps.map_facts(self.fd, f"map {self.name}")
        if facts.type != BPF_MAP_TYPE_USER_RINGBUF:
            raise MapTypeError(
                f"map {self.name} has type {facts.type}, not BPF_MAP_TYPE_USER_RINGBUF "
                f"({BPF_MAP_TYPE_USER_RINGBUF}): aperf.UserRingBuffer sends into user ring "
                "buffers only (read perf event arrays and ring buffers with PerfStream)"
            )
        with _producers_lock:
            if facts.id in _producers:
                raise BusyResourceError(
                    f"map {self.name} (id {facts.id}) already has a UserRingBuffer in this "
                    "process; a second producer would corrupt the ring. Close the first one."
                )
            _producers.add(facts.id)
            self.map_id = facts.id
        # Producers in other processes: the map lock (one byte, as for a ring buffer).
        self.claim = lock_map(facts.id, self.name, [0], purpose="produce")
        size = facts.max_entries
        self.mappings.append(mmap.mmap(self.fd, PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ))
        self.mappings.append(mmap.mmap(
            self.fd, PAGE_SIZE + 2 * size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
            offset=PAGE_SIZE,
        ))
        self.epoll = select.epoll()
        self.epoll.register(self.fd, select.EPOLLOUT | select.EPOLLET)
        self.writer = UserRingWriter(self.mappings[0], self.mappings[1], PAGE_SIZE, size)

    def acknowledge(self) -> None:
        """Take the drains' wakeups off the epoll fd (edge-triggered: reported once)."""
        if self.epoll is not None:
            self.epoll.poll(0)

    def release(self) -> None:
        """Drop pending reservations (not in a forked child: the ring is the parent's),
        release the views, unmap, close the fds, give up the claim. Idempotent."""
        writer, self.writer = self.writer, None
        try:
            if writer is not None:
                writer.release(discard_pending=not self.forked)
        finally:
            for mapping in self.mappings:
                with contextlib.suppress(BufferError):  # a view lives on: it unmaps later
                    mapping.close()
            self.mappings = []
            epoll, self.epoll = self.epoll, None
            if epoll is not None:
                epoll.close()
            fd, self.fd = self.fd, -1
            if fd >= 0:
                os.close(fd)
            claim, self.claim = self.claim, None
            if claim is not None:
                claim.release()  # in a forked child, the child's copies only
            if self.map_id:
                with _producers_lock:
                    _producers.discard(self.map_id)
                self.map_id = 0


def _release_dropped(ring: _Ring) -> None:
    """The user ring buffer was garbage-collected without being closed."""
    warnings.warn(
        f"unclosed UserRingBuffer on {ring.name}: use 'with' or close(); its pending "
        "reservations were discarded and its memory released at garbage collection",
        ResourceWarning,
        stacklevel=2,
    )
    ring.release()


def resolve_encoder(spec: EncoderSpec, source: object) -> Encoder:
    """The encoder for ``encoder=``: the inverse of what ``decoder=`` makes of ``spec``."""
    if spec is None:
        return raw_bytes
    if is_ctypes_structure(spec):
        return from_ctypes(spec)  # type: ignore[arg-type]
    if isinstance(spec, struct.Struct):
        return from_struct(spec)
    if isinstance(spec, str):
        owner = source.object if isinstance(source, Map) else None
        if not isinstance(owner, BPFObject):
            raise TypeError(
                f"encoder={spec!r} names a BTF type, but the map is not an aperf.Map of a "
                "BPFObject: pass a ctypes structure or a struct.Struct"
            )
        decoder = owner._btf_decoder(spec)  # the BTF stays valid for the call
        assert decoder.layout is not None
        return from_layout(decoder.layout, decoder.name, "<")
    if callable(spec):
        return _checked(spec)
    raise TypeError(
        "encoder must be a callable, a struct.Struct, a ctypes.Structure subclass or a BTF "
        f"type name, not {type(spec).__name__}"
    )


def _checked(encode: Callable[[Any], Any]) -> Encoder:
    def checked(value: Any) -> bytes:
        return raw_bytes(encode(value))

    return checked


class UserRingBuffer:
    """Sends messages to BPF through a ``BPF_MAP_TYPE_USER_RINGBUF`` map (Linux 6.1+).

    ``map`` is an [`aperf.Map`][aperf.Map], a map fd or a pinned map path; the BPF
    side reads each message with ``bpf_user_ringbuf_drain()``, in the order sent.
    ``encoder`` turns values into message bytes and takes what ``decoder=`` takes:
    the name of a struct in the map's object's BTF, a ``ctypes.Structure``
    subclass, a ``struct.Struct``, or a callable returning bytes; with none, send
    bytes. A struct takes a tuple of every field (a decoded record is one) or a
    mapping of some fields, the others zero (see docs/user-ringbuf.md).

    - ``send_nowait(value)`` sends at once or raises
      [`aperf.RingFullError`][aperf.RingFullError], sending nothing;
    - ``await send(value, timeout=None)`` waits on the event loop (asyncio,
      uvloop, trio) until a drain makes room, in the order the senders came,
      or raises ``RingFullError`` at the timeout, sending nothing;
    - ``reserve(size)`` gives a writable ``memoryview`` into the ring itself, for
      ``submit(view)`` or ``discard(view)``, which release it: it must not be
      kept (aperf never unmaps memory a view still reaches, but a slice kept past
      its submit would write into later messages).

    One producer per ring: a second UserRingBuffer on the same map, in this
    process or another (through the map lock, docs/rings.md), raises
    ``BusyResourceError`` naming the first. Not thread-safe: use it from one thread
    (or one event loop). A context manager; ``close()`` discards pending
    reservations. In a child process after ``fork()`` it refuses every call.
    """

    MAP_TYPE = BPF_MAP_TYPE_USER_RINGBUF
    """``BPF_MAP_TYPE_USER_RINGBUF`` (31): the ``aperf.Map.type`` of the maps it writes."""

    def __init__(self, map: maps.MapSpec, *, encoder: EncoderSpec = None) -> None:
        spec = maps.check_map_source(map)
        self.name = maps.source_name(spec)
        self._encode = resolve_encoder(encoder, spec)
        self._lock: anyio.Lock | None = None
        ring = _Ring(spec, self.name)
        self._ring: _Ring | None = ring
        track(ring)
        self._finalizer = weakref.finalize(self, _release_dropped, ring)

    @property
    def size(self) -> int:
        """The ring's data bytes (the map's ``max_entries``)."""
        return self._writer().size

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called (or the ``with`` block ended)."""
        return self._ring is None

    def free_bytes(self) -> int:
        """Bytes of room now; a message of N bytes takes ``(N + 8)`` rounded up to 8."""
        return self._writer().free_bytes()

    def _writer(self) -> UserRingWriter:
        ring = self._ring
        if ring is None or ring.writer is None:
            raise ClosedResourceError(f"user ring buffer {self.name} is closed")
        if ring.forked:
            raise ClosedResourceError(forked_error("UserRingBuffer"))
        return ring.writer

    def encode(self, value: Any) -> bytes:
        """The message bytes ``send`` would write for ``value``."""
        return self._encode(value)

    def reserve(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes in the ring; ``submit`` or ``discard`` it.

        Raises ``ArgumentError`` (argument ``size``) for a size the ring can never
        hold, ``RingFullError`` when it has no room now.
        """
        writer = self._writer()
        writer.check_size(size)
        view = writer.reserve(size)
        if view is None:
            raise self._full(size)
        return view

    def submit(self, buffer: memoryview) -> None:
        """Hand a reservation to the BPF side; the view is released."""
        self._writer().commit(buffer)

    def discard(self, buffer: memoryview) -> None:
        """Drop a reservation: the BPF side skips it; the view is released."""
        self._writer().commit(buffer, discard=True)

    def _full(self, length: int) -> RingFullError:
        writer = self._writer()
        return RingFullError(
            f"user ring buffer {self.name} has {writer.free_bytes()} of {writer.size} bytes "
            f"free, a {length}-byte message needs {record_step(length)}: nothing was sent"
        )

    def _message(self, value: Any) -> bytes:
        data = self._encode(value)
        self._writer().check_size(len(data), "value")
        return data

    def _try_send(self, data: bytes) -> bool:
        writer = self._writer()
        view = writer.reserve(len(data))
        if view is None:
            return False
        view[:] = data
        writer.commit(view)
        return True

    def send_nowait(self, value: Any) -> None:
        """Encode ``value`` and send it now, or raise ``RingFullError`` with nothing sent."""
        data = self._message(value)
        if not self._try_send(data):
            raise self._full(len(data))

    async def send(self, value: Any, *, timeout: float | None = None) -> None:
        """Encode ``value`` and send it, waiting on the event loop for room.

        Senders are served in the order they came. At ``timeout`` seconds
        ``RingFullError`` (a ``TimeoutError``) is raised and nothing was sent;
        cancelling the wait sends nothing either, and ``close()`` (from the loop's
        thread) ends it with ``ClosedResourceError``.
        """
        data = self._message(value)
        if self._lock is None:
            self._lock = anyio.Lock()
        if not self._lock.locked() and self._try_send(data):
            return
        try:
            with anyio.fail_after(timeout):
                async with self._lock:
                    while True:
                        ring = self._ring
                        self._writer()
                        assert ring is not None and ring.epoll is not None
                        ring.acknowledge()  # before trying: a drain after it wakes us
                        if self._try_send(data):
                            return
                        try:
                            await anyio.wait_readable(ring.epoll.fileno())
                        except anyio.ClosedResourceError:
                            self._writer()  # closed meanwhile: aperf's error says so
                            raise
        except TimeoutError as exc:
            if isinstance(exc, RingFullError):
                raise
            raise self._full(len(data)) from None

    def close(self) -> None:
        """Discard pending reservations, release the views and the map (idempotent)."""
        ring, self._ring = self._ring, None
        if ring is None:
            return
        self._finalizer.detach()
        untrack(ring)
        if ring.epoll is not None:
            with contextlib.suppress(Exception):  # outside an event loop: nobody waits there
                anyio.notify_closing(ring.epoll.fileno())
        ring.release()

    def __enter__(self) -> UserRingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ring is None else f"{self.size} bytes"
        return f"<aperf.UserRingBuffer {self.name} ({state})>"
