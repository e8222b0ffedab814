"""Ordered streams (``order_by=``) against the kernel: two CPUs write interleaved
timestamps (bytes 8..15 of every producer sample are ``bpf_ktime_get_ns()``); the
stream hands them out in time order, exactly once each, on asyncio, uvloop and trio,
as events, as arrays and through the sync ``PerfBuffer``; a sample that comes after
later ones were released is delivered, flagged late and counted."""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

import aperf
from aperf.testing import Producer

pytestmark = [pytest.mark.usefixtures("kernel"), pytest.mark.anyio]
CPUS = sorted(os.sched_getaffinity(0))
A, B = CPUS[0], CPUS[-1]
ROUNDS, N = 6, 300  # per round: N on A, N on B, N on A, N on B; read between rounds
PER_ROUND = 4 * N


class Ev(ctypes.Structure):
    _fields_ = [("seq", ctypes.c_uint64), ("ts", ctypes.c_uint64)]


@pytest.fixture
def producer() -> Iterator[Producer]:
    if A == B:
        pytest.skip("needs two CPUs")
    with Producer() as p:
        yield p


def emit_round(producer: Producer) -> None:
    for cpu in (A, B, A, B):
        producer.emit(N, size=32, cpu=cpu)


def check_in_order(stamps: list[int], seqs: list[int], cpus: list[int], total: int) -> None:
    assert len(stamps) == total
    assert all(a <= b for a, b in itertools.pairwise(stamps)), "out of time order"
    assert sorted(seqs) == list(range(total))  # every sample exactly once
    # Time order is not ring order here: the CPUs alternate within each batch read.
    switches = sum(a != b for a, b in itertools.pairwise(cpus))
    assert switches >= 4 * ROUNDS - 1


def check_stats(stats: aperf.StreamStatistics, total: int, late: int = 0) -> None:
    assert stats.samples == total and stats.lost == 0 and stats.late == late
    assert stats.pending == 0


async def test_two_cpus_interleaved_come_out_in_time_order(producer: Producer) -> None:
    got: list[Any] = []
    async with aperf.PerfStream(producer.map, decoder=Ev, order_by="ts", pages=256) as stream:
        for r in range(ROUNDS):
            emit_round(producer)
            with anyio.fail_after(10):
                async for event in stream:
                    got.append(event)
                    if len(got) == (r + 1) * PER_ROUND:
                        break
        stats = stream.statistics()
    assert all(isinstance(e, aperf.Sample) and not e.late for e in got)
    check_in_order([e.value.ts for e in got], [e.value.seq for e in got],
                   [e.cpu for e in got], ROUNDS * PER_ROUND)
    check_stats(stats, ROUNDS * PER_ROUND)


async def test_two_cpus_interleaved_come_out_in_time_order_as_arrays(
    producer: Producer,
) -> None:
    pytest.importorskip("numpy")
    stamps: list[int] = []
    seqs: list[int] = []
    cpus: list[int] = []
    async with aperf.PerfStream(producer.map, decoder=Ev, order_by="ts", pages=256) as stream:
        for r in range(ROUNDS):
            emit_round(producer)
            with anyio.fail_after(10):
                async for array in stream.arrays():
                    assert isinstance(array, aperf.SampleArray) and not array.late
                    stamps.extend(array.values["ts"].tolist())
                    seqs.extend(array.values["seq"].tolist())
                    cpus.extend(array.cpus.tolist() if array.cpus is not None
                                else [array.cpu] * len(array))
                    if len(stamps) == (r + 1) * PER_ROUND:
                        break
        stats = stream.statistics()
    check_in_order(stamps, seqs, cpus, ROUNDS * PER_ROUND)
    check_stats(stats, ROUNDS * PER_ROUND)


def test_two_cpus_interleaved_come_out_in_time_order_from_the_sync_buffer(
    producer: Producer,
) -> None:
    got: list[Any] = []
    with aperf.PerfBuffer(producer.map, decoder=Ev, order_by="ts", pages=256,
                          on_sample=got.append) as pb:
        for r in range(ROUNDS):
            emit_round(producer)
            for _ in range(100):
                if len(got) == (r + 1) * PER_ROUND:
                    break
                pb.poll(100)
        stats = pb.statistics()
    check_in_order([e.value.ts for e in got], [e.value.seq for e in got],
                   [e.cpu for e in got], ROUNDS * PER_ROUND)
    check_stats(stats, ROUNDS * PER_ROUND)


async def test_a_sample_behind_released_ones_is_delivered_late_and_counted(
    producer: Producer,
) -> None:
    # Ordered by the sequence number, which the test chooses: CPU A's 100..109 are
    # released (CPU B is idle), then CPU B brings 0..4: behind them, late.
    async with aperf.PerfStream(producer.map, decoder=Ev, order_by="seq") as stream:
        producer.emit(10, cpu=A, first_seq=100)
        with anyio.fail_after(10):
            first = [e async for e in _take(stream, 10)]
        producer.emit(5, cpu=B, first_seq=0)
        producer.emit(3, cpu=A, first_seq=110)
        with anyio.fail_after(10):
            then = [e async for e in _take(stream, 8)]
        stats = stream.statistics()
    assert [e.value.seq for e in first] == list(range(100, 110))
    assert not any(e.late for e in first)
    late = [e for e in then if e.late]
    assert [e.value.seq for e in late] == list(range(5)) and {e.cpu for e in late} == {B}
    assert all(isinstance(e, aperf.Sample) for e in late)
    assert [e.value.seq for e in then if not e.late] == [110, 111, 112]
    assert stats.late == 5 and {c.cpu: c.late for c in stats.cpus}[B] == 5
    check_stats(stats, 18, late=5)


async def test_late_rows_come_as_their_own_array(producer: Producer) -> None:
    pytest.importorskip("numpy")
    async with aperf.PerfStream(producer.map, decoder=Ev, order_by="seq") as stream:
        producer.emit(10, cpu=A, first_seq=100)
        rows: list[Any] = []
        with anyio.fail_after(10):
            async for array in stream.arrays():
                rows.append(array)
                if sum(len(a) for a in rows) == 10:
                    break
            producer.emit(5, cpu=B, first_seq=0)
            async for array in stream.arrays():
                late = array
                break
        stats = stream.statistics()
    assert not any(a.late for a in rows)
    assert late.late and late.cpu == B and late.values["seq"].tolist() == list(range(5))
    check_stats(stats, 15, late=5)


async def _take(stream: Any, count: int) -> Any:
    async for event in stream:
        yield event
        count -= 1
        if not count:
            return
