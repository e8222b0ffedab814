"""aperf on eBPF for Windows through ebpfapi.dll's own API only: these tests run
against the stand-in here, and unchanged against the installed ebpfapi.dll on
Windows (as Administrator; see docs/windows.md), where the default event loop is
the Proactor and ``ProactorHandleBinding`` waits through the IOCP.

Samples are written with ``ebpf_perf_event_array_map_write`` (the user-mode
write into a perf event array, on the calling thread's CPU, as eBPF for
Windows' own tests do) from threads pinned to each CPU. Exactness: per CPU,
written = delivered + lost, and what was delivered is what was written, in order.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import aperf
from aperf._rings.windows.perf import WindowsPerfSource
from aperf._waiting.asyncio import ProactorHandleBinding, ThreadedHandleBinding

from .conftest import BPF_MAP_TYPE_PERF_EVENT_ARRAY, REAL_WINDOWS

SEQ = struct.Struct("<Q16x")  # 24 bytes: 32-byte records on an eBPF for Windows ring
EBPF_SUCCESS, EBPF_OUT_OF_SPACE = 0, 29


def _pin_thread(cpu: int) -> None:
    if REAL_WINDOWS:
        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
        kernel32.GetCurrentThread.restype = ctypes.c_void_p
        kernel32.SetThreadAffinityMask.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        kernel32.SetThreadAffinityMask.restype = ctypes.c_size_t
        if not kernel32.SetThreadAffinityMask(kernel32.GetCurrentThread(), 1 << cpu):
            raise ctypes.WinError(ctypes.get_last_error())  # type: ignore[attr-defined]
    else:
        os.sched_setaffinity(0, {cpu})


class Dll:
    """Maps and samples through ebpfapi.dll's exports (the real DLL, or the stand-in)."""

    def __init__(self, lib: Any, cpus: list[int]) -> None:
        lib.bpf_map_create.argtypes = [
            ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
            ctypes.c_void_p,
        ]
        lib.bpf_map_create.restype = ctypes.c_int
        if not hasattr(lib, "ebpf_perf_event_array_map_write"):
            pytest.skip(
                "this ebpfapi.dll no longer exports ebpf_perf_event_array_map_write "
                "(deprecated in eBPF for Windows v1.5.0, #5354; removal planned, #5348): verify "
                "with a BPF program that writes instead (docs/windows.md, step 4)"
            )
        lib.ebpf_perf_event_array_map_write.argtypes = [
            ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t,
        ]
        lib.ebpf_perf_event_array_map_write.restype = ctypes.c_int
        lib.ebpf_close_fd.argtypes = [ctypes.c_int32]
        lib.ebpf_close_fd.restype = ctypes.c_int
        self.lib = lib
        self.cpus = cpus

    def create_map(self, max_entries: int) -> int:
        fd = int(self.lib.bpf_map_create(
            BPF_MAP_TYPE_PERF_EVENT_ARRAY, b"aperf_test", 0, 0, max_entries, None
        ))
        assert fd >= 0, f"bpf_map_create failed: {fd}"
        return fd

    def close(self, fd: int) -> None:
        assert self.lib.ebpf_close_fd(fd) == EBPF_SUCCESS

    def write(self, fd: int, payload: bytes) -> bool:
        result = int(self.lib.ebpf_perf_event_array_map_write(fd, payload, len(payload)))
        assert result in (EBPF_SUCCESS, EBPF_OUT_OF_SPACE), result
        return result == EBPF_SUCCESS

    def writer(self, fd: int, cpu: int, seqs: range) -> Writer:
        return Writer(self, fd, cpu, seqs)


class Writer(threading.Thread):
    """Writes numbered samples from a thread pinned to ``cpu``; keeps what was written."""

    def __init__(self, dll: Dll, fd: int, cpu: int, seqs: range) -> None:
        super().__init__(name=f"writer-cpu{cpu}")
        self.dll, self.fd, self.cpu, self.seqs = dll, fd, cpu, seqs
        self.written: list[int] = []
        self.dropped = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _pin_thread(self.cpu)
            for seq in self.seqs:
                if self.dll.write(self.fd, SEQ.pack(seq)):
                    self.written.append(seq)
                else:
                    self.dropped += 1
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error


@pytest.fixture
def dll(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Dll]:
    if REAL_WINDOWS:
        from aperf._native.ebpfapi import binding as _binding

        lib = _binding.ebpfapi()
        lib.libbpf_num_possible_cpus.restype = ctypes.c_int
        yield Dll(lib, list(range(int(lib.libbpf_num_possible_cpus()))))
        return
    fake = request.getfixturevalue("fake")  # and its checks: no leak, no misuse
    cpus = sorted(os.sched_getaffinity(0))
    fake.set_cpu_count(max(cpus) + 1)
    monkeypatch.setattr(sys, "platform", "win32")  # a map fd resolves as on Windows
    yield Dll(fake.lib, cpus)


@pytest.fixture
def perf_fd(dll: Dll) -> Iterator[int]:
    fd = dll.create_map(16 * 1024)  # 512 records of 32 bytes per CPU
    yield fd
    dll.close(fd)


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "default": asyncio.new_event_loop,  # the Proactor on Windows
    "selector": asyncio.SelectorEventLoop,
}


@pytest.mark.parametrize("loop_name", LOOPS)
def test_stream_delivers_or_counts_every_sample(dll: Dll, perf_fd: int, loop_name: str) -> None:
    n = 20_000

    async def main() -> tuple[dict[int, list[int]], dict[int, int], list[Writer]]:
        seqs: dict[int, list[int]] = {cpu: [] for cpu in dll.cpus}
        lost: dict[int, int] = dict.fromkeys(dll.cpus, 0)
        async with aperf.PerfStream(perf_fd, decoder=SEQ) as stream:
            assert isinstance(stream._options.source._chosen, WindowsPerfSource)  # by map type
            proactor = hasattr(asyncio.get_running_loop(), "_proactor")
            binding = ProactorHandleBinding if proactor else ThreadedHandleBinding
            assert isinstance(stream._loop, binding)
            writers = [dll.writer(perf_fd, cpu, range(n)) for cpu in dll.cpus]
            for writer in writers:
                writer.start()
            total = n * len(writers)

            async def consume() -> None:
                taken = 0
                async for event in stream:
                    if isinstance(event, aperf.Lost):
                        lost[event.cpu] += event.count
                        taken += event.count
                    else:
                        seqs[event.cpu].append(event.value[0])
                        taken += 1
                    if taken == total:
                        return

            await asyncio.wait_for(consume(), 60)
            for writer in writers:
                await asyncio.to_thread(writer.finish)
            stats = stream.statistics()
        assert stats.samples == sum(len(w.written) for w in writers)
        assert stats.lost == sum(w.dropped for w in writers)
        return seqs, lost, writers

    loop = LOOPS[loop_name]()
    try:
        seqs, lost, writers = loop.run_until_complete(main())
    finally:
        loop.close()
    for writer in writers:
        assert seqs[writer.cpu] == writer.written
        assert lost[writer.cpu] == writer.dropped
        assert len(writer.written) + writer.dropped == n


def test_perf_buffer_poll_and_close_from_another_thread(dll: Dll, perf_fd: int) -> None:
    got: list[int] = []
    lost: list[int] = []
    pb = aperf.PerfBuffer(
        perf_fd, decoder=SEQ, on_sample=lambda s: got.append(s.value[0]),
        on_lost=lambda e: lost.append(e.count),
    )
    try:
        cpu = dll.cpus[-1]
        writer = dll.writer(perf_fd, cpu, range(600))  # 512 fit
        writer.start()
        writer.finish()
        assert writer.dropped == 88
        while len(got) + sum(lost) < 600:
            assert pb.poll(5000) > 0
        assert got == writer.written and sum(lost) == 88

        outcome: list[BaseException | int] = []

        def poll_forever() -> None:
            try:
                outcome.append(pb.poll(-1))
            except BaseException as exc:
                outcome.append(exc)

        poller = threading.Thread(target=poll_forever)
        poller.start()
        poller.join(0.2)  # let it park in WaitForMultipleObjects
    finally:
        pb.close()
    poller.join(5)
    assert not poller.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], aperf.ClosedResourceError)


def test_the_wait_handle_is_manual_reset(dll: Dll, perf_fd: int) -> None:
    from aperf._native.ebpfapi import api as win
    from aperf._options import Wakeup
    from aperf._rings.seam import RingConfig

    source = WindowsPerfSource(perf_fd)
    rings = source.open(RingConfig(None, Wakeup.per_sample()))
    try:
        handle = rings[0].handle
        assert not win.is_signalled(handle)
        writer = dll.writer(perf_fd, dll.cpus[0], range(1))
        writer.start()
        writer.finish()
        assert win.wait_one(handle, 5000)
        assert win.is_signalled(handle)  # stays signalled: nobody reset it
        source.acknowledge(handle)
        assert not win.is_signalled(handle)
        assert rings[dll.cpus[0]].take()  # the record is still there to read
    finally:
        source.free()
