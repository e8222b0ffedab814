"""PerfStream and PerfBuffer on FakeRingSource: every driver behaviour without root.

The async tests run on asyncio, uvloop and trio (see conftest). Timers use
millisecond latencies: the drain clock is the reader's, tested in
test_reader.py; here the drivers must only follow it.
"""

from __future__ import annotations

import asyncio
import inspect
import struct
import threading
import time
from functools import partial
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import FakeRingSource

from ..helpers import check_busy, hand_over_the_rest, until

Q = struct.Struct("<Q")
QQ = struct.Struct("<QQ")


def seq(event: Any) -> int:
    return int(Q.unpack_from(event.data)[0])


def write(src: FakeRingSource, cpu: int, first: int, count: int) -> int:
    """Write samples first..first+count-1; how many fitted."""
    return sum(src.write(cpu, QQ.pack(i, cpu)) for i in range(first, first + count))


async def collect(stream: aperf.PerfStream[Any], count: int, timeout: float = 5) -> list[Any]:
    out: list[Any] = []

    async def consume() -> None:
        async for event in stream:
            out.append(event)
            if len(out) == count:
                return

    with anyio.fail_after(timeout):
        await consume()
    return out


# --- the contract of the issue ---------------------------------------------------------


@pytest.mark.anyio
async def test_samples_and_lost_notices_exactly_as_from_the_kernel() -> None:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=4096)
    async with aperf.PerfStream(src, decoder=QQ) as stream:
        assert src.write(0, QQ.pack(1, 2))
        events = await collect(stream, 1)
        assert events == [aperf.Sample(0, QQ.pack(1, 2) + bytes(4), (1, 2))]
        # 4096 / 32-byte records: 128 fit, the rest are dropped and counted.
        written = write(src, 1, 0, 200)
        assert written == 128 and src.dropped(1) == 72
        events = await collect(stream, 129)
        assert [seq(e) for e in events[:128]] == list(range(128))
        assert events[128] == aperf.Lost(1, 72)  # exact, with no sample after the burst
        stats = stream.statistics()
        assert (stats.samples, stats.lost, stats.lost_counter) == (129, 72, "exact")


def test_the_sync_buffer_on_the_same_source() -> None:
    got: list[Any] = []
    src = FakeRingSource(cpus=[0, 1])
    with aperf.PerfBuffer(src, on_sample=got.append, on_lost=got.append) as pb:
        assert pb.poll(0) == 0
        write(src, 1, 0, 10)
        assert pb.poll(1000) == 10
        write(src, 0, 10, 5)
        assert pb.consume_buffer(0) == 5
        write(src, 1, 15, 3)
        assert pb.consume() == 3
        assert pb.buffer_cnt == 2 and pb.cpus == [0, 1]
        assert pb.buffer_fd(1) == src._rings[1].handle
        with pytest.raises(ValueError, match="no ring for CPU 7"):
            pb.buffer_fd(7)
    assert [seq(e) for e in got] == list(range(18))
    with pytest.raises(aperf.ClosedResourceError):
        pb.poll(0)
    # the fake can be opened again by another reader
    with aperf.PerfBuffer(src, on_sample=got.append) as pb:
        assert src.write(0, b"again") and pb.poll(1000) == 1


@pytest.mark.parametrize("call", ["poll", "consume"])
def test_poll_and_consume_return_under_a_producer_faster_than_the_callbacks(call: str) -> None:
    # Each sample handed over writes two more (no timing): before the fix poll() and
    # consume() went on draining the rings as they dispatched and never returned. A call
    # hands over at most what was taken out of the rings when it began (at most
    # max_pending, plus one ring's drain and its lost notices), as libbpf's poll does.
    src = FakeRingSource(cpus=[0], ring_bytes=4096)  # 170 records of an 8-byte sample
    bound = 100 + 4096 // 24 + 2  # and a drain's two lost notices (a record, an exact count)
    state = {"this_call": 0, "written": 0, "calls": 0}
    got: list[Any] = []

    def on_event(event: Any) -> None:
        got.append(event)
        state["this_call"] += 1
        assert state["this_call"] <= bound, f"{call}() handed over more than {bound}"
        if state["written"] < 5000:
            for _ in range(2):
                src.write(0, struct.pack("<Q", state["written"]))
                state["written"] += 1

    with aperf.PerfBuffer(src, max_pending=100, on_sample=on_event, on_lost=on_event) as pb:
        src.write(0, struct.pack("<Q", 0))
        state["written"] = 1
        while state["written"] < 5000:
            state["this_call"] = 0
            assert (pb.poll(1000) if call == "poll" else pb.consume()) == state["this_call"]
            state["calls"] += 1
    assert state["calls"] > 2
    hand_over_the_rest(pb)  # what the close took out of the ring
    samples = sum(1 for e in got if isinstance(e, aperf.Sample))
    lost = sum(e.count for e in got if isinstance(e, aperf.Lost))
    assert samples + lost == state["written"] and lost == src.dropped(0)


# --- the drain timer ---------------------------------------------------------------------


def watermark(**kwargs: float) -> aperf.Wakeup:
    return aperf.Wakeup.watermark(1 << 20, **kwargs)


@pytest.mark.anyio
async def test_drain_timer_finds_samples_below_the_threshold_and_adapts() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 21)
    wakeup = watermark(max_latency=0.001, idle_latency=0.02, idle_after=0.1)
    opened = anyio.current_time()
    async with aperf.PerfStream(src, wakeup=wakeup) as stream:
        check_busy(stream.statistics, opened, anyio.current_time, wakeup)
        await until(lambda: stream.statistics().drain_period == 0.02)  # nothing written: idle
        wrote = anyio.current_time()
        write(src, 0, 0, 3)  # no wakeup (watermark), only the idle tick finds them
        events = await collect(stream, 3, timeout=10)
        assert [seq(e) for e in events] == [0, 1, 2]
        check_busy(stream.statistics, wrote, anyio.current_time, wakeup)  # busy again
        assert stream.statistics().wakeups == 0


@pytest.mark.anyio
async def test_a_wakeup_during_idleness_brings_the_timer_back_at_once() -> None:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=1 << 21)
    wakeup = aperf.Wakeup.every(2, max_latency=0.001, idle_latency=60, idle_after=0.01)
    async with aperf.PerfStream(src, wakeup=wakeup) as stream:
        await until(lambda: stream.statistics().drain_period == 60)  # nothing written: idle
        write(src, 1, 2, 1)  # below the threshold: waits for the timer, a minute away
        write(src, 0, 0, 2)  # wakes the reader: traffic, the timer at max_latency at once
        # (CPU 1's sample went in first: finding it needs no step of the test's after the
        # wakeup, which a loaded machine could bring later than idle_after.)
        events = await collect(stream, 3, timeout=10)
        assert sorted(seq(e) for e in events) == [0, 1, 2]


@pytest.mark.anyio
async def test_flush_hands_over_what_sits_below_the_threshold() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 21)
    async with aperf.PerfStream(src, wakeup=watermark(max_latency=60)) as stream:
        write(src, 0, 0, 4)
        assert stream.flush() == 4
        assert [seq(e) for e in await collect(stream, 4, timeout=1)] == [0, 1, 2, 3]


def test_sync_poll_relaxes_when_idle() -> None:
    got: list[Any] = []
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 21)
    wakeup = watermark(max_latency=0.001, idle_latency=0.02, idle_after=0.1)
    opened = time.monotonic()
    with aperf.PerfBuffer(src, wakeup=wakeup, on_sample=got.append) as pb:
        check_busy(pb.statistics, opened, time.monotonic, wakeup)
        assert pb.poll(150) == 0  # 150 ms and more: past idle_after
        assert pb.statistics().drain_period == 0.02
        wrote = time.monotonic()
        write(src, 0, 0, 1)  # below the watermark: found by looking, not woken
        assert pb.poll(10_000) == 1
        check_busy(pb.statistics, wrote, time.monotonic, wakeup)
    assert [seq(e) for e in got] == [0]


# --- backpressure --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_backpressure_pauses_and_resumes_without_loss() -> None:
    src = FakeRingSource(cpus=[0, 1], ring_bytes=1 << 16)
    async with aperf.PerfStream(src, max_pending=50) as stream:
        write(src, 0, 0, 100)
        # The readiness callback takes the ring: over the bound.
        await until(lambda: stream.statistics().cpus[0].samples == 100)
        write(src, 1, 100, 30)
        await until(lambda: stream.statistics().paused)  # CPU 1's ring is refused
        stats = stream.statistics()
        assert stats.paused and src.pending_bytes(1) > 0  # CPU 1's data waits in its ring
        events = await collect(stream, 130)
        assert sorted(seq(e) for e in events) == list(range(130))
        assert not stream.statistics().paused


@pytest.mark.anyio
async def test_backpressure_is_not_mistaken_for_idleness() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 21)
    wakeup = watermark(max_latency=0.001, idle_latency=60, idle_after=0.01)
    async with aperf.PerfStream(src, wakeup=wakeup, max_pending=10) as stream:
        write(src, 0, 0, 100)
        await until(lambda: stream.statistics().paused)  # nobody reads: the bound is reached
        await anyio.sleep(0.05)  # past idle_after: the timer finds nothing it may take
        stats = stream.statistics()
        assert stats.paused and stats.drain_period == 0.001
        assert [seq(e) for e in await collect(stream, 100)] == list(range(100))


@pytest.mark.anyio
async def test_close_while_paused_hands_over_everything_then_ends() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 16)
    stream = aperf.PerfStream(src, max_pending=100)
    await stream.open()
    write(src, 0, 0, 1000)
    stream.flush()  # past the bound once
    write(src, 0, 1000, 10)
    await until(lambda: stream.statistics().paused)  # its wakeup or the timer: queue full
    await stream.aclose()
    assert [seq(e) async for e in stream] == list(range(1010))


@pytest.mark.anyio
async def test_overflow_with_a_slow_consumer_counts_every_sample() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1024)
    delivered = lost = 0
    written = 0
    async with aperf.PerfStream(src, max_pending=8) as stream:
        for i in range(2000):
            written += 1
            src.write(0, QQ.pack(i, 0))
            if i % 100 == 0:
                await anyio.sleep(0)
        await stream.aclose()
        async for event in stream:
            if isinstance(event, aperf.Sample):
                delivered += 1
            else:
                lost += event.count
    assert delivered + lost == written == 2000 and lost == src.dropped(0) > 0


# --- close, cancel, busy ------------------------------------------------------------------


@pytest.mark.anyio
async def test_close_from_another_task_ends_iteration() -> None:
    src = FakeRingSource(cpus=[0])
    async with aperf.PerfStream(src) as stream:
        seen: list[int] = []

        async def consume() -> None:
            async for event in stream:
                seen.append(seq(event))

        with anyio.fail_after(1):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                write(src, 0, 0, 20)
                while len(seen) < 20:
                    await anyio.sleep(0.001)
                await stream.aclose()  # the consumer ends cleanly, no exception
        await stream.aclose()  # idempotent
    assert seen == list(range(20)) and stream.closed


@pytest.mark.anyio
async def test_close_from_another_thread() -> None:
    src = FakeRingSource(cpus=[0])
    async with aperf.PerfStream(src) as stream:
        counted: list[int] = []

        async def consume() -> None:
            counted.append(len([e async for e in stream]))

        closer = threading.Thread(target=stream.close)
        with anyio.fail_after(2):
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                write(src, 0, 0, 50)
                await anyio.sleep(0.01)
                closer.start()
        assert counted == [50]
        await anyio.to_thread.run_sync(closer.join, 5)  # a hang guard, below CLOSE_TIMEOUT
        assert not closer.is_alive()


def test_close_from_a_thread_after_the_loop_stopped_finishes() -> None:
    src = FakeRingSource(cpus=[0])
    loop = asyncio.new_event_loop()
    stream: aperf.PerfStream[None] = aperf.PerfStream(src)
    loop.run_until_complete(stream.open())
    write(src, 0, 0, 3)
    closer = threading.Thread(target=stream.close)
    closer.start()
    closer.join(5)  # a hang guard: waiting for the stopped loop would take CLOSE_TIMEOUT, 10 s
    assert not closer.is_alive() and stream.closed
    assert [seq(e) for e in loop.run_until_complete(_drain(stream))] == [0, 1, 2]
    loop.close()


def test_close_from_a_thread_after_the_trio_run_ended_finishes() -> None:
    import trio  # a test dependency
    src = FakeRingSource(cpus=[0])
    stream: aperf.PerfStream[None] = aperf.PerfStream(src)
    trio.run(stream.open)  # the run ends with the stream open: its system task is gone
    write(src, 0, 0, 3)
    closer = threading.Thread(target=stream.close)
    closer.start()
    closer.join(5)  # a hang guard: waiting for the ended run would take CLOSE_TIMEOUT, 10 s
    assert not closer.is_alive() and stream.closed
    assert [seq(e) for e in trio.run(_drain, stream)] == [0, 1, 2]


async def _drain(stream: aperf.PerfStream[Any]) -> list[Any]:
    return [e async for e in stream]


@pytest.mark.anyio
async def test_cancelling_the_consumer_loses_nothing() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 16)
    seen: list[int] = []
    async with aperf.PerfStream(src) as stream:
        cancelled: list[bool] = []

        async def consume(limit: int) -> None:
            try:
                async for event in stream:
                    seen.append(seq(event))
                    await anyio.sleep(0)  # a cancellation point inside the loop body
                    if len(seen) >= limit:
                        await anyio.sleep(3600)
            except anyio.get_cancelled_exc_class():
                cancelled.append(True)
                raise

        write(src, 0, 0, 1000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(consume, 300)
            while len(seen) < 300:
                await anyio.sleep(0.001)
            tg.cancel_scope.cancel()  # the loop's own cancellation (trio: a cancel scope)
        assert cancelled == [True]
        write(src, 0, 1000, 500)
        rest = await collect(stream, 1200)
    assert seen + [seq(e) for e in rest] == list(range(1500))


def seqs_of(item: Any) -> list[int]:
    """Sequence numbers in what an iterator handed out: an event, a batch, an array."""
    if isinstance(item, list):
        return [seq(e) for e in item]
    if isinstance(item, aperf.SampleArray):
        return [int(s) for s in item.values["seq"]]
    return [seq(item)]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["async for", "batches", "arrays"])
async def test_a_timed_out_anext_leaves_the_iterator_going(
    anyio_backend: tuple[str, Any], kind: str
) -> None:
    src = FakeRingSource(cpus=[0])
    decoder = aperf.decoders.from_struct("<QQ", names="seq cpu")
    async with aperf.PerfStream(src, decoder=decoder) as stream:
        it = {"async for": aiter(stream), "batches": stream.batches(),
              "arrays": stream.arrays()}[kind]
        for _ in range(2):  # each loop's own timeout around anext(), twice
            if anyio_backend[0] == "trio":
                import trio

                with trio.move_on_after(0.02) as scope:
                    await anext(it)
                assert scope.cancelled_caught
            else:
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(anext(it), 0.02)
        write(src, 0, 0, 3)
        got: list[int] = []
        with anyio.fail_after(5):
            while len(got) < 3:  # the same iterator: the samples, not "the stream ended"
                got.extend(seqs_of(await anext(it)))
        assert got == [0, 1, 2]


@pytest.mark.anyio
async def test_a_second_reader_is_refused() -> None:
    src = FakeRingSource(cpus=[0])
    async with aperf.PerfStream(src) as stream:
        with anyio.fail_after(1):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_drain, stream)
                await anyio.wait_all_tasks_blocked()  # it reads: parked, waiting for events
                with pytest.raises(aperf.BusyResourceError, match="already reading"):
                    await _drain(stream)
                with pytest.raises(aperf.BusyResourceError):
                    await aperf.PerfStream(src).open()  # the source is taken, as a kernel map is
                await stream.aclose()


@pytest.mark.anyio
async def test_not_open_and_reopen() -> None:
    src = FakeRingSource(cpus=[0])
    stream = aperf.PerfStream(src)
    with pytest.raises(aperf.ClosedResourceError, match="not open"):
        stream.statistics()
    async with stream:
        pass
    with pytest.raises(aperf.ClosedResourceError, match="closed"):
        await stream.open()


# --- callbacks ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_callback_exceptions_propagate_and_the_rest_stays_queued() -> None:
    src = FakeRingSource(cpus=[0])
    got: list[int] = []

    async def on_sample(event: aperf.Sample[Any]) -> None:
        await anyio.sleep(0)
        if seq(event) == 5 and -1 not in got:
            got.append(-1)
            raise KeyError("async boom")
        got.append(seq(event))

    async with aperf.PerfStream(src) as stream:
        write(src, 0, 0, 10)
        with pytest.raises(KeyError, match="async boom"), anyio.fail_after(2):
            await stream.run(on_sample)
        with anyio.fail_after(1):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run, on_sample)
                while len(got) < 10:
                    await anyio.sleep(0.001)
                await stream.aclose()  # run() returns once the stream is closed
    assert got == [0, 1, 2, 3, 4, -1, 6, 7, 8, 9]


@pytest.mark.anyio
async def test_sync_and_async_callbacks_and_on_batch() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=256)
    samples: list[int] = []
    lost: list[int] = []

    async def on_lost(event: aperf.Lost) -> None:
        lost.append(event.count)

    async with aperf.PerfStream(src) as stream:
        write(src, 0, 0, 20)  # 8 fit in 256 bytes
        async with anyio.create_task_group() as tg:
            tg.start_soon(partial(stream.run, lambda e: samples.append(seq(e)), on_lost=on_lost))
            while len(samples) < 8 or not lost:
                await anyio.sleep(0.001)
            await stream.aclose()
    assert samples == list(range(8)) and lost == [12]
    batches: list[int] = []

    async def on_batch(batch: list[Any]) -> None:
        batches.append(len(batch))

    async with aperf.PerfStream(src) as stream:
        write(src, 0, 0, 5)
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream.run_batches, on_batch)
            while sum(batches) < 5:
                await anyio.sleep(0.001)
            await stream.aclose()
    assert batches == [5]


@pytest.mark.anyio
@pytest.mark.parametrize("old", ["on_sample", "on_batch"])
async def test_constructor_callbacks_still_work_and_warn(old: str) -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=256)
    got: list[Any] = []
    callbacks = ({"on_sample": got.append, "on_lost": got.append} if old == "on_sample"
                 else {"on_batch": got.extend})
    with pytest.warns(DeprecationWarning, match=r"run\(on_sample") as record:
        stream = aperf.PerfStream(src, **callbacks)
    assert record[0].filename == __file__  # the warning points at the caller
    async with stream:
        write(src, 0, 0, 20)  # 8 fit
        with pytest.warns(DeprecationWarning, match="constructor's callbacks"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream.run)  # a bare run(): the constructor's callbacks
                while len(got) < 9:
                    await anyio.sleep(0.001)
                await stream.aclose()
    assert [seq(e) for e in got[:8]] == list(range(8)) and got[8] == aperf.Lost(0, 12)


def bcc_style(cpu: int, data: bytes, size: int) -> None:
    pass


@pytest.mark.anyio
async def test_run_methods_check_their_callbacks_at_the_call() -> None:
    src = FakeRingSource(cpus=[0])
    async with aperf.PerfStream(src, decoder=QQ) as stream:
        with pytest.raises(TypeError, match=r"on_sample is called with one argument, the "
                           r"aperf\.Sample .*def on_sample\(event\).*bcc_style\(cpu, data, "
                           r"size\) cannot"):
            await stream.run(bcc_style)
        with pytest.raises(TypeError, match=r"on_lost is called with one argument"):
            await stream.run(print, on_lost=lambda cpu, count: None)
        with pytest.raises(TypeError, match="on_batch must be callable"):
            await stream.run_batches(3)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"on_array is called with one argument"):
            await stream.run_arrays(bcc_style)
        with pytest.raises(ValueError, match="max_rows"):
            await stream.run_arrays(print, max_rows=0)
        with pytest.raises(TypeError, match="run\\(\\) needs on_sample"):
            await stream.run()
    with pytest.raises(TypeError, match="on_sample is called with one argument"):
        aperf.PerfBuffer(src, on_sample=bcc_style)


def test_sync_callback_exception_propagates_and_nothing_is_lost() -> None:
    src = FakeRingSource(cpus=[0])
    seen: list[int] = []

    def on_sample(event: aperf.Sample[Any]) -> None:
        if seq(event) == 3 and -1 not in seen:
            seen.append(-1)
            raise RuntimeError("boom in callback")
        seen.append(seq(event))

    with aperf.PerfBuffer(src, on_sample=on_sample) as pb:
        write(src, 0, 0, 10)
        with pytest.raises(RuntimeError, match="boom in callback"):
            pb.consume()
        assert pb.consume() == 6
    assert seen == [0, 1, 2, -1, 4, 5, 6, 7, 8, 9]


def test_sync_buffer_refuses_coroutine_callbacks_without_losing_events() -> None:
    src = FakeRingSource(cpus=[0])
    seen: list[int] = []

    async def on_sample(event: aperf.Sample[Any]) -> None:
        seen.append(seq(event))

    with aperf.PerfBuffer(src, on_sample=on_sample) as pb:
        write(src, 0, 0, 3)
        with pytest.raises(TypeError, match="use PerfStream"):
            pb.consume()
    assert seen == []


# --- decoding and broken rings ----------------------------------------------------------------


def picky(data: bytes) -> int:
    value = int(Q.unpack_from(data)[0])
    if value == 2:
        raise ValueError("two is bad")
    return value


@pytest.mark.anyio
@pytest.mark.parametrize("policy", ["item", "skip", "raise"])
async def test_decode_error_policies(policy: Any) -> None:
    src = FakeRingSource(cpus=[0])
    async with aperf.PerfStream(src, decoder=picky, decode_errors=policy) as stream:
        write(src, 0, 0, 4)
        if policy == "raise":
            with pytest.raises(aperf.DecodeError, match="two is bad"):
                await collect(stream, 4)
            assert [e.value for e in await collect(stream, 1)] == [3]
            return
        events = await collect(stream, 4 if policy == "item" else 3)
    kinds = [type(e).__name__ for e in events]
    if policy == "item":
        assert kinds == ["Sample", "Sample", "BadSample", "Sample"]
        assert events[2].error.cpu == 0 and isinstance(events[2].error.__cause__, ValueError)
    else:
        assert [e.value for e in events] == [0, 1, 3]


def test_sync_decode_error_without_a_handler_raises() -> None:
    src = FakeRingSource(cpus=[0])
    got: list[Any] = []
    with aperf.PerfBuffer(src, decoder=picky, on_sample=got.append) as pb:
        write(src, 0, 0, 4)
        with pytest.raises(aperf.DecodeError):
            pb.consume()
        assert pb.consume() == 1
    assert [e.value for e in got] == [0, 1, 3]


@pytest.mark.anyio
async def test_a_broken_ring_fails_in_order_and_the_others_go_on() -> None:
    src = FakeRingSource(cpus=[0, 1])
    async with aperf.PerfStream(src) as stream:
        write(src, 0, 0, 2)
        src.inject(0, struct.pack("<IHH", 9, 0, 0) + bytes(8))
        got = await collect(stream, 2)
        assert [seq(e) for e in got] == [0, 1]
        with pytest.raises(aperf.BrokenRingError, match="CPU 0"):
            await collect(stream, 1)
        write(src, 1, 10, 1)
        write(src, 0, 20, 1)  # the broken ring is no longer read
        assert [seq(e) for e in await collect(stream, 1)] == [10]
        stats = stream.statistics()
        assert stats.cpus[0].broken and not stats.cpus[1].broken


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_pending": 0}, ValueError, "max_pending"),
        ({"max_pending": "10"}, ValueError, "max_pending"),
        ({"decode_errors": "ignore"}, ValueError, "decode_errors"),
        ({"pages": 3}, aperf.RingSizeError, "power of two"),
        ({"pages": 1 << 20}, aperf.RingSizeError, "too large"),
        ({"pages": 1 << 64}, aperf.RingSizeError, "too large"),
        ({"ring_bytes": 1 << 40}, aperf.RingSizeError, "too large"),
        ({"wakeup": 3}, TypeError, "wakeup"),
        ({"on_sample": 3}, TypeError, "on_sample must be callable"),
        ({"on_sample": print, "on_lost": "x"}, TypeError, "on_lost must be callable"),
        ({"on_lost": print}, ValueError, "on_sample"),
        ({"on_batch": 3}, TypeError, "on_batch"),
        ({"decoder": 3}, TypeError, "decoder"),
        ({"decoder": "event"}, TypeError, "from_btf"),
        ({"decoder": "my-event"}, ValueError, "not a C identifier"),
    ],
)
def test_bad_arguments_fail_in_the_constructor(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    src = FakeRingSource(cpus=[0])
    with pytest.raises(error, match=match):
        aperf.PerfStream(src, **kwargs)


@pytest.mark.parametrize(
    "wakeup",
    [
        lambda: aperf.Wakeup.every(8, max_latency=float("nan")),
        lambda: aperf.Wakeup.every(8, max_latency=float("inf")),
        lambda: aperf.Wakeup.watermark(4096, max_latency=-1),
        lambda: aperf.Wakeup.balanced(idle_after=0),
        lambda: aperf.Wakeup.every(2.5),
    ],
)
def test_bad_wakeups(wakeup: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        wakeup()


def test_deprecated_format_strings_still_decode() -> None:
    src = FakeRingSource(cpus=[0])
    got: list[Any] = []
    with pytest.warns(DeprecationWarning, match=r"struct\.Struct\('<QQ'\)") as record:
        pb = aperf.PerfBuffer(src, decoder="<QQ", on_sample=got.append)
    assert record[0].filename == __file__  # the warning points at the caller
    with pb:
        src.write(0, QQ.pack(4, 5))
        pb.consume()
    assert got[0].value == (4, 5)


def test_both_drivers_take_the_same_keywords_in_the_same_order() -> None:
    def names(cls: type) -> list[str]:
        return list(inspect.signature(cls.__init__).parameters)[1:]  # type: ignore[misc]

    shared = ["source", "pages", "ring_bytes", "decoder", "wakeup", "max_pending", "decode_errors"]
    callbacks = ["on_sample", "on_lost", "on_decode_error", "on_array"]
    rings = ["cpus", "map_keys", "memory_bytes", "take_over", "overwritable"]  # which rings, whose
    order = ["order_by", "lateness"]
    assert names(aperf.PerfBuffer) == shared + callbacks + rings + order
    assert names(aperf.PerfStream)[: len(shared)] == shared
    assert names(aperf.PerfStream)[-len(rings + order):] == rings + order


def test_the_sync_buffer_bounds_its_queue_with_max_pending() -> None:
    src = FakeRingSource(cpus=[0], ring_bytes=1 << 16)
    got: list[Any] = []
    with aperf.PerfBuffer(src, max_pending=10, on_sample=got.append) as pb:
        assert pb.statistics().max_pending == 10
        write(src, 0, 0, 30)
        assert pb.consume() == 30  # a consume takes everything, past the bound
    assert [seq(e) for e in got] == list(range(30))
    with pytest.raises(ValueError, match="max_pending"):
        aperf.PerfBuffer(src, max_pending=0, on_sample=got.append)


def test_an_interrupt_during_the_waiters_close_writes_into_no_closed_fd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two PerfBuffer.close() at once: one closes the waiter while the other interrupts
    it. An interrupt landing just after the eventfd was closed (simulated: right in
    its os.close) must not write into it: the number may be another file's already."""
    from aperf._waiting import epoll

    waiter = epoll.EpollWaiter([])
    wake_fd = waiter.wake_fd
    real_close = epoll.os.close
    interrupted: list[int] = []

    def close_then_interrupt(fd: int) -> None:
        real_close(fd)
        if fd == wake_fd:
            waiter.interrupt()  # the other thread's close, at the worst moment
            interrupted.append(fd)

    monkeypatch.setattr(epoll.os, "close", close_then_interrupt)
    waiter.close()
    assert interrupted == [wake_fd] and waiter.wake_fd == -1
    waiter.interrupt()  # and after the close: nothing to wake, no error
