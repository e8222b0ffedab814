"""User ring buffers against the real kernel: Python sends, BPF drains and echoes.

bpf/user_ringbuf.bpf.c drains ``to_bpf`` (a BPF_MAP_TYPE_USER_RINGBUF) with
``bpf_user_ringbuf_drain()`` each time the test runs it, and echoes every message
byte for byte into the BPF ring buffer ``echo``, which a PerfStream reads back.
Every async test runs on asyncio, uvloop and trio.
"""

from __future__ import annotations

import ctypes
import gc
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import anyio
import pytest

import aperf
from aperf._native import libbpf as lb

from ..helpers import BPF_DIR, open_fds, require_kernel, take

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
RING = 16 * 1024


class Echo:
    """The loaded object: ``drain()`` runs the BPF side once; ``counters()`` its counts."""

    def __init__(self) -> None:
        self.obj = aperf.BPFObject(BPF_DIR / "user_ringbuf.bpf.o")
        self.obj.maps["to_bpf"].set_max_entries(RING)
        self.obj.load()
        self.map = self.obj.maps["to_bpf"]
        self._prog = self.obj.programs["drain"].fd

    def drain(self) -> int:
        """Run the drain once; the number of messages it took (or a negative errno)."""
        assert lb.test_run_on_cpu(self._prog, sorted(os.sched_getaffinity(0))[0]) == 0
        return self.counter(2)

    def counter(self, index: int) -> int:
        raw = self.obj.maps["counters"].lookup(struct.pack("<I", index))
        return int(struct.unpack("<q", raw)[0])

    def echoed(self, count: int) -> list[bytes]:
        """The next ``count`` echoed messages (synchronously, from the echo ring buffer)."""
        got: list[bytes] = []
        with aperf.PerfBuffer(self.obj.maps["echo"], on_sample=lambda s: got.append(s.data)) as pb:
            deadline = time.monotonic() + 10
            while len(got) < count and time.monotonic() < deadline:
                pb.poll(50)
            pb.poll(0)
        return got


@pytest.fixture
def echo() -> Iterator[Echo]:
    require_kernel()
    e = Echo()
    try:
        yield e
    finally:
        e.obj.close()


def message(seq: int) -> bytes:
    """Messages of 1 to 300 bytes, each telling its sequence number in its first bytes."""
    size = 1 + (seq * 37) % 300
    return (seq.to_bytes(4, "little") + bytes([seq & 0xFF]) * size)[:size]


async def test_every_message_arrives_once_and_in_order(echo: Echo) -> None:
    n = 3000  # about 15 rings' worth: the sender keeps waiting for the drains
    sent = [message(i) for i in range(n)]
    got: list[bytes] = []
    stop = threading.Event()

    def drain_now_and_then() -> None:
        while not stop.is_set():
            echo.drain()
            time.sleep(0.001)

    async with aperf.PerfStream(echo.obj.maps["echo"]) as stream:
        drainer = threading.Thread(target=drain_now_and_then, daemon=True)
        drainer.start()
        try:
            with aperf.UserRingBuffer(echo.map) as urb:
                with anyio.fail_after(60):
                    for data in sent:
                        await urb.send(data)
                    async for sample in stream:
                        assert isinstance(sample, aperf.Sample)
                        got.append(sample.data)
                        if len(got) == n:
                            break
        finally:
            stop.set()
            await anyio.to_thread.run_sync(drainer.join)
    assert got == sent
    assert echo.counter(0) == n and echo.counter(1) == 0


async def test_a_full_ring_times_out_with_nothing_written_then_drains_make_room(
    echo: Echo,
) -> None:
    with aperf.UserRingBuffer(echo.map) as urb:
        assert urb.size == RING and urb.free_bytes() == RING
        sent = 0
        with pytest.raises(aperf.RingFullError):
            while True:
                urb.send_nowait(message(sent))
                sent += 1
        free = urb.free_bytes()
        assert 0 <= free < 8 + 304 and sent > 50
        start = time.monotonic()
        with pytest.raises(aperf.RingFullError) as info:
            await urb.send(message(sent), timeout=0.3)
        assert isinstance(info.value, TimeoutError) and "nothing was sent" in str(info.value)
        assert time.monotonic() - start >= 0.25
        assert urb.free_bytes() == free  # nothing half written
        assert echo.drain() == sent  # and nothing extra: the BPF side gets the others only
        assert echo.echoed(sent) == [message(i) for i in range(sent)]

        # Full again; a send that waits is served by the next drain (from a thread).
        while urb.free_bytes() >= 8 + 300:
            urb.send_nowait(b"f" * 300)
        filler = echo.counter(0)
        timer = threading.Timer(0.2, echo.drain)
        timer.start()
        with anyio.fail_after(10):
            await urb.send(b"late" * 75)  # 300 bytes: no room until the drain
        timer.join()
        assert echo.drain() == 1
        assert echo.counter(0) - filler > 1 and echo.counter(1) == 0


async def test_the_docs_bpf_side_drains_only_when_its_trigger_is_pulled() -> None:
    """docs/user-ringbuf.md's program (bpf/user_ringbuf_hello.bpf.c) drains at each
    getppid() of the sender, which no event loop calls itself: a full ring times out a
    send on asyncio, uvloop and trio alike (with a getpid() trigger, asyncio's and uvloop's
    own getpid() calls drained it behind the sender's back and the send went through), and
    each getppid() drains and echoes everything, in order."""
    require_kernel()
    with aperf.BPFObject(BPF_DIR / "user_ringbuf_hello.bpf.o") as obj:
        obj.set_global("target_tgid", os.getpid())
        obj.load()
        obj.programs["drain"].attach()
        with aperf.UserRingBuffer(obj.maps["to_bpf"], encoder="message") as urb:
            async with aperf.PerfStream(obj.maps["from_bpf"], decoder="message") as echoed:
                sent = 0
                with pytest.raises(aperf.RingFullError):
                    while True:
                        urb.send_nowait({"seq": sent, "text": f"m{sent}"})
                        sent += 1
                assert sent == 4096 // (8 + 32)  # header and message, each record
                with pytest.raises(aperf.RingFullError):
                    await urb.send({"seq": sent}, timeout=0.3)  # no drain meanwhile
                os.getppid()  # drains all of them
                with anyio.fail_after(10):
                    got = [event.value async for event in take(echoed, sent)]
                    await urb.send({"seq": sent, "text": "last"})  # room again, at once
                    os.getppid()
                    got += [event.value async for event in take(echoed, 1)]
        assert [(m.seq, m.text) for m in got] == [
            *((i, f"m{i}") for i in range(sent)), (sent, "last")
        ]


async def test_waiting_senders_go_in_the_order_they_came(echo: Echo) -> None:
    with aperf.UserRingBuffer(echo.map) as urb:
        while urb.free_bytes() >= 8 + 300:
            urb.send_nowait(b"f" * 300)
        filled = RING // 312
        order = [b"A" * 300, b"B" * 300, b"C" * 300]
        async with anyio.create_task_group() as tg:
            for data in order:
                tg.start_soon(urb.send, data)
                await anyio.sleep(0.02)  # each queues behind the previous one
            for _ in range(50):
                await anyio.to_thread.run_sync(echo.drain)
                await anyio.sleep(0.01)
                if urb.free_bytes() >= RING - 3 * 312:
                    break
        echo.drain()
    got = echo.echoed(filled + 3)
    assert got[-3:] == order


async def test_a_cancelled_or_closed_wait_sends_nothing(echo: Echo) -> None:
    urb = aperf.UserRingBuffer(echo.map)
    try:
        while urb.free_bytes() >= 8 + 300:
            urb.send_nowait(b"f" * 300)
        queued = echo.drain()
        assert queued > 0 and echo.echoed(queued)
        while urb.free_bytes() >= 8 + 300:
            urb.send_nowait(b"f" * 300)
        free = urb.free_bytes()
        with anyio.move_on_after(0.2) as scope:
            await urb.send(b"never" * 60)
        assert scope.cancelled_caught and urb.free_bytes() == free  # nothing reserved

        failed: list[BaseException] = []

        async def waiting() -> None:
            try:
                await urb.send(b"closed" * 50)
            except aperf.ClosedResourceError as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiting)
            await anyio.sleep(0.1)  # it waits for room
            urb.close()
        assert len(failed) == 1 and "closed" in str(failed[0])
    finally:
        urb.close()
    filled = echo.drain()  # what was full before: the close discarded nothing sent
    got = echo.echoed(filled)
    assert len(got) == filled and set(got) == {b"f" * 300}


def test_reserve_submit_discard(echo: Echo) -> None:
    with aperf.UserRingBuffer(echo.map) as urb:
        first = urb.reserve(5)
        assert len(first) == 5 and not first.readonly
        second = urb.reserve(3)
        second[:] = b"xyz"
        first[:] = b"hello"
        urb.discard(second)  # dropped, though reserved after the first
        urb.submit(first)
        with pytest.raises(ValueError):
            first[0] = 1  # released at submit
        with pytest.raises(aperf.ArgumentError) as info:
            urb.submit(first)
        assert info.value.argument == "buffer"
        third = urb.reserve(4)
        third[:] = b"last"
        assert echo.drain() == 1  # the BPF side stops at a reservation not yet submitted
        urb.submit(third)
        assert echo.drain() == 1
        assert echo.echoed(2) == [b"hello", b"last"]
        assert urb.free_bytes() == RING


def test_bad_sizes_are_refused_by_name(echo: Echo) -> None:
    with aperf.UserRingBuffer(echo.map) as urb:
        for size in (0, -1, RING, RING - 7, 1 << 31):
            with pytest.raises(aperf.ArgumentError) as info:
                urb.reserve(size)
            assert info.value.argument == "size"
        assert urb.reserve(RING - 8) is not None  # the largest: the whole ring
        with pytest.raises(TypeError):
            urb.reserve("8")  # type: ignore[arg-type]
        for value in (b"", b"x" * RING):
            with pytest.raises(aperf.ArgumentError) as info:
                urb.send_nowait(value)
            assert info.value.argument == "value"
        with pytest.raises(aperf.ArgumentError):
            urb.send_nowait("text")  # no encoder: bytes only


def test_maps_of_another_type_are_refused(echo: Echo) -> None:
    for name in ("echo", "counters"):
        with pytest.raises(aperf.MapTypeError, match="USER_RINGBUF"):
            aperf.UserRingBuffer(echo.obj.maps[name])
    with pytest.raises(aperf.MapTypeError):
        aperf.UserRingBuffer(echo.obj.programs["drain"].fd)  # not a map at all
    with pytest.raises(TypeError):
        aperf.UserRingBuffer(3.5)  # type: ignore[arg-type]


class Message(ctypes.Structure):
    _fields_ = (
        ("seq", ctypes.c_uint64), ("kind", ctypes.c_uint32), ("delta", ctypes.c_int16),
        ("flags", ctypes.c_uint8 * 2), ("name", ctypes.c_char * 12),
        ("values", ctypes.c_uint32 * 3),
    )


@pytest.mark.parametrize("spec", ["user_message", "ctypes", "struct"])
def test_values_are_encoded_by_the_specs_decoders_take(echo: Echo, spec: str) -> None:
    fmt = struct.Struct("<QIh2s12s3I")
    chosen: object = {"user_message": "user_message", "ctypes": Message, "struct": fmt}[spec]
    decoder = aperf.decoders.from_btf(echo.obj, "user_message")
    with aperf.UserRingBuffer(echo.map, encoder=chosen) as urb:
        if spec == "struct":
            values = [(7, 1, -3, b"\x01\x02", b"ping", 1, 2, 3),
                      (8, 2, 5, b"ab", b"x" * 12, 0, 0, 9)]
        else:
            values = [(7, 1, -3, b"\x01\x02", "ping", (1, 2, 3)),
                      {"seq": 8, "kind": 2, "name": "stop"}]  # the other fields are zero
        for value in values:
            urb.send_nowait(value)
        if spec == "ctypes":
            urb.send_nowait(Message(seq=9, name=b"ct"))
        sent = len(values) + (spec == "ctypes")
        assert echo.drain() == sent
    got = [decoder(data) for data in echo.echoed(sent)]
    assert [r.seq for r in got] == [7, 8, 9][:sent]
    first = got[0]
    assert (first.kind, first.delta, first.flags, first.values) == (1, -3, b"\x01\x02", (1, 2, 3))
    assert got[0].name == "ping" and got[1].name == ("x" * 12 if spec == "struct" else "stop")
    if spec != "struct":
        assert got[1].delta == 0 and got[1].values == (0, 0, 0)
        with aperf.UserRingBuffer(echo.map, encoder=chosen) as urb:
            assert decoder(urb.encode(got[0])) == got[0]  # a decoded record re-encodes


class Chunk(ctypes.Structure):
    """A message with a flexible tail: sizeof 16, the tail at 10."""

    _fields_ = (("seq", ctypes.c_uint64), ("len", ctypes.c_uint16), ("data", ctypes.c_uint8 * 0))


def test_flexible_tails_arrive_as_sent_and_decode_to_the_value(echo: Echo) -> None:
    """Short tails (0 and 1 byte: ending in what would be sizeof's padding) and long
    ones: the BPF side gets the fixed part and the tail, byte for byte, and what it
    echoes decodes to the value sent."""
    decode = aperf.decoders.from_ctypes(Chunk)
    values = [(seq, len(tail), tail) for seq, tail in
              enumerate([b"", b"x", b"abcdef", b"abcdefg", bytes(range(40))])]
    with aperf.UserRingBuffer(echo.map, encoder=Chunk) as urb:
        sent = [urb.encode(value) for value in values]
        for value in values:
            urb.send_nowait(value)
        assert echo.drain() == len(values)
    got = echo.echoed(len(values))
    assert got == sent
    assert [len(data) for data in got] == [10 + len(tail) for _, _, tail in values]
    assert [decode(data) for data in got] == values


def test_bad_values_name_the_field(echo: Echo) -> None:
    with aperf.UserRingBuffer(echo.map, encoder="user_message") as urb:
        for value, field in (
            ({"seq": -1}, "seq"), ({"name": "x" * 12}, "name"), ({"values": (1, 2)}, "values"),
            ({"nope": 1}, "nope"), ((1, 2), "6 fields"),
        ):
            with pytest.raises(aperf.ArgumentError, match=field) as info:
                urb.send_nowait(value)
            assert info.value.argument == "value"
        assert urb.free_bytes() == RING  # nothing was sent


def test_a_second_producer_is_refused_and_close_releases_everything(echo: Echo) -> None:
    before = open_fds()
    urb = aperf.UserRingBuffer(echo.map)
    with pytest.raises(aperf.BusyResourceError):
        aperf.UserRingBuffer(echo.map)
    view = urb.reserve(8)
    urb.close()
    urb.close()  # idempotent
    with pytest.raises(ValueError):
        view[0] = 1  # the view died with the ring
    with pytest.raises(aperf.ClosedResourceError):
        urb.send_nowait(b"x")
    assert open_fds() == before
    assert echo.drain() == 0 and echo.counter(2) == 0  # the pending one was discarded
    with aperf.UserRingBuffer(echo.map) as again:
        again.send_nowait(b"after")
    assert echo.drain() == 1 and echo.echoed(1) == [b"after"]


def test_garbage_collection_warns_and_releases(echo: Echo) -> None:
    before = open_fds()
    urb = aperf.UserRingBuffer(echo.map)
    urb.reserve(16)  # pending: discarded at collection, or it would block the BPF side
    with pytest.warns(ResourceWarning, match="unclosed UserRingBuffer"):
        del urb
        gc.collect()
    assert open_fds() == before
    with aperf.UserRingBuffer(echo.map) as urb:
        urb.send_nowait(b"next")
    assert echo.drain() == 1 and echo.echoed(1) == [b"next"]


def test_a_forked_child_cannot_send_and_leaves_the_parents_ring_alone(echo: Echo) -> None:
    with aperf.UserRingBuffer(echo.map) as urb:
        held = urb.reserve(4)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            code = 1
            try:
                try:
                    urb.send_nowait(b"child")
                except aperf.ClosedResourceError:
                    urb.close()  # releases the child's copies only
                    code = 0
            finally:
                os.write(write, bytes([code]))
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"\0"
        os.close(read)
        os.waitpid(pid, 0)
        held[:] = b"mine"
        urb.submit(held)  # the child's close discarded nothing of the parent's
        urb.send_nowait(b"parent")
        assert echo.drain() == 2
    assert echo.echoed(2) == [b"mine", b"parent"]


PRODUCER = """
import sys
import aperf

# A producer in a process of its own: sends the messages it is told to, then closes.
with aperf.UserRingBuffer(int(sys.argv[1])) as urb:
    print("open", flush=True)
    for line in sys.stdin:
        first, count = map(int, line.split())
        for seq in range(first, first + count):
            size = 1 + (seq * 37) % 300  # tests/test_user_ringbuf.py's message()
            urb.send_nowait((seq.to_bytes(4, "little") + bytes([seq & 0xFF]) * size)[:size])
        print("sent", count, flush=True)
print("closed", flush=True)
"""


def test_a_producer_in_another_process_is_refused_and_nothing_is_lost_or_torn(
    echo: Echo,
) -> None:
    fd = echo.map.fd
    first = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, str(fd)], pass_fds=[fd], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )
    assert first.stdin is not None and first.stdout is not None
    try:
        assert first.stdout.readline() == "open\n"
        # The second producer (this process) is refused, naming the first: two would
        # lose and tear messages and jam the ring (the protocol has one producer).
        with pytest.raises(aperf.BusyResourceError,
                           match=f"has a producer in pid {first.pid} "):
            aperf.UserRingBuffer(echo.map)
        for batch in range(3):
            first.stdin.write(f"{batch * 40} 40\n")
            first.stdin.flush()
            assert first.stdout.readline() == "sent 40\n"
            assert echo.drain() == 40
        assert echo.echoed(120) == [message(i) for i in range(120)]
        assert echo.counter(1) == 0
        first.stdin.close()
        assert first.stdout.readline() == "closed\n"
        assert first.wait(30) == 0
    finally:
        first.kill()
        first.wait(30)
        first.stdout.close()
    # Closed: the map is free for the next producer.
    with aperf.UserRingBuffer(echo.map) as urb:
        urb.send_nowait(b"next")
    assert echo.drain() == 1 and echo.echoed(1) == [b"next"]
