"""The eBPF for Windows backend, tested on Linux against a stand-in ``ebpfapi.dll``
+ ``kernel32``, and on Windows against the real ones.

``fake_ebpfapi.c`` is compiled here with gcc into one shared library that
exports the same names and signatures as ebpfapi.dll's perf buffer API and
kernel32's event and wait calls; aperf loads it through ``APERF_EBPFAPI`` and
``APERF_KERNEL32``, so its real ctypes binding runs unchanged. The ``fake_*``
exports play the BPF program (output on a CPU) and count misuse and leaks.

Markers: ``standin`` tests need the stand-in (its ``fake_*`` probes, or a
simulated platform) and run on Linux only; the tests of ``test_dll.py`` use
only ebpfapi.dll's own exports and run on both: against the stand-in here,
against the installed eBPF for Windows on Windows (see docs/windows.md).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REAL_WINDOWS = sys.platform == "win32"
"""On Windows the tests run against the installed ebpfapi.dll (APERF_EBPFAPI may name it)."""

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_ebpfapi.c"
BPF_MAP_TYPE_PERF_EVENT_ARRAY = 14
BPF_MAP_TYPE_RINGBUF = 13


def build_fake(directory: Path) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.fail("gcc is needed to build the eBPF for Windows stand-in", pytrace=False)
    target = directory / "libfake_ebpfapi.so"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror",
         "-o", str(target), str(SOURCE)],
        check=True,
    )
    return target


class FakeEbpf:
    """The stand-in's test-only exports (the same loaded library aperf uses)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path), use_errno=True)
        lib.fake_map_create.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_char_p]
        lib.fake_map_create.restype = ctypes.c_int
        lib.fake_map_pin.argtypes = [ctypes.c_int, ctypes.c_char_p]
        lib.fake_output.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32]
        lib.fake_output.restype = ctypes.c_int
        lib.fake_ringbuf_reserve.argtypes = [ctypes.c_int, ctypes.c_uint32]
        lib.fake_ringbuf_reserve.restype = ctypes.c_int64
        lib.fake_ringbuf_commit.argtypes = [
            ctypes.c_int, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_int,
        ]
        lib.fake_ringbuf_output.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.fake_lost.argtypes = [ctypes.c_int, ctypes.c_uint32]
        lib.fake_lost.restype = ctypes.c_uint64
        lib.fake_waiters.argtypes = [ctypes.c_void_p]
        lib.ebpf_close_fd.argtypes = [ctypes.c_int32]
        lib.CreateEventW.restype = ctypes.c_void_p
        lib.CreateEventW.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.SetEvent.argtypes = [ctypes.c_void_p]
        lib.CloseHandle.argtypes = [ctypes.c_void_p]
        lib.WaitForSingleObject.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        lib.WaitForSingleObject.restype = ctypes.c_uint32
        self.lib = lib

    def set_cpu_count(self, n: int) -> None:
        self.lib.fake_set_cpu_count(n)

    def create_map(self, max_entries: int = 4096, *, cpus: int = 2,
                   type: int = BPF_MAP_TYPE_PERF_EVENT_ARRAY, name: str = "events") -> int:
        self.set_cpu_count(cpus)
        fd = int(self.lib.fake_map_create(type, max_entries, name.encode()))
        assert fd >= 0, fd
        return fd

    def pin(self, fd: int, path: str) -> None:
        assert self.lib.fake_map_pin(fd, path.encode()) == 0

    def output(self, fd: int, cpu: int, payload: bytes) -> bool:
        """bpf_perf_event_output on ``cpu``: True if written, False if dropped (counted)."""
        result = int(self.lib.fake_output(fd, cpu, payload, len(payload)))
        if result not in (0, -28):  # -ENOSPC: the ring is full
            raise OSError(-result, os.strerror(-result))
        return result == 0

    def ringbuf_output(self, fd: int, payload: bytes) -> bool:
        """bpf_ringbuf_output: True if written, False if the ring was full (not counted)."""
        result = int(self.lib.fake_ringbuf_output(fd, payload, len(payload)))
        if result not in (0, -28):
            raise OSError(-result, os.strerror(-result))
        return result == 0

    def ringbuf_reserve(self, fd: int, length: int) -> int:
        """bpf_ringbuf_reserve: the record's offset (its header locked until committed)."""
        offset = int(self.lib.fake_ringbuf_reserve(fd, length))
        assert offset >= 0, offset
        return offset

    def ringbuf_commit(
        self, fd: int, offset: int, payload: bytes, *, discard: bool = False
    ) -> None:
        assert self.lib.fake_ringbuf_commit(fd, offset, payload, len(payload), int(discard)) == 0

    def lost(self, fd: int, cpu: int) -> int:
        return int(self.lib.fake_lost(fd, cpu))

    def close(self, fd: int) -> None:
        assert self.lib.ebpf_close_fd(fd) == 0

    def misuse(self) -> int:
        return int(self.lib.fake_misuse_count())

    def open_handles(self) -> int:
        return int(self.lib.fake_open_handles())

    def open_fds(self) -> int:
        return int(self.lib.fake_open_fds())

    def live_buffers(self) -> int:
        return int(self.lib.fake_live_buffers())

    def leaked_events(self) -> int:
        """Events whose handle is closed but that a map's ring still references (#5206)."""
        return int(self.lib.fake_leaked_events())

    def set_fixed_5206(self, fixed: bool) -> None:
        """Model a DLL where clearing a ring's wait handle works (#5206 fixed), or not."""
        self.lib.fake_set_fixed_5206(int(fixed))

    def waiters(self, handle: int) -> int:
        return int(self.lib.fake_waiters(handle))

    def signalled(self, handle: int) -> bool:
        return int(self.lib.WaitForSingleObject(handle, 0)) == 0

    def new_event(self, manual: bool = True) -> int:
        return int(self.lib.CreateEventW(None, int(manual), 0, None))

    def set_event(self, handle: int) -> None:
        assert self.lib.SetEvent(handle)

    def close_handle(self, handle: int) -> None:
        assert self.lib.CloseHandle(handle)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError("condition not met in time")
            time.sleep(0.001)



def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not REAL_WINDOWS:
        return
    skip = pytest.mark.skip(reason="needs the Linux stand-in of ebpfapi.dll (gcc)")
    for item in items:
        if "standin" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fake_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fake(tmp_path_factory.mktemp("ebpfwin"))


@pytest.fixture(scope="session")
def fake_session(fake_library: Path) -> Iterator[FakeEbpf]:
    from aperf._native.ebpfapi.binding import EBPFAPI_ENV, KERNEL32_ENV

    saved = {k: os.environ.get(k) for k in (EBPFAPI_ENV, KERNEL32_ENV)}
    os.environ[EBPFAPI_ENV] = str(fake_library)
    os.environ[KERNEL32_ENV] = str(fake_library)
    try:
        fake = FakeEbpf(fake_library)
        # aperf's one parking event (#5206) lives as long as the process: made now, it is
        # in every test's count of open handles from the start.
        from aperf._native.ebpfapi.api import parking_handle

        parking_handle()
        yield fake
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def fake(fake_session: FakeEbpf) -> Iterator[FakeEbpf]:
    """The stand-in; the test must leave no buffer, handle or fd behind, and misuse nothing."""
    handles, fds, buffers = (
        fake_session.open_handles(), fake_session.open_fds(), fake_session.live_buffers()
    )
    misuse = fake_session.misuse()
    yield fake_session
    assert fake_session.misuse() == misuse, "a handle closed while waited on, or a freed pb used"
    assert fake_session.live_buffers() == buffers, "a perf buffer was not freed"
    assert fake_session.open_handles() == handles, "an event handle leaked"
    assert fake_session.open_fds() == fds, "a map fd leaked"


@pytest.fixture
def ringbuf_map(fake: FakeEbpf) -> Iterator[int]:
    """A ring buffer of 4 KiB (one ring for every CPU), closed after the test."""
    fd = fake.create_map(4096, type=BPF_MAP_TYPE_RINGBUF, name="ringbuf")
    yield fd
    fake.close(fd)


@pytest.fixture
def perf_map(fake: FakeEbpf) -> Iterator[int]:
    """A perf event array of 4 KiB per CPU on 2 CPUs, closed after the test."""
    fd = fake.create_map(4096, cpus=2)
    yield fd
    fake.close(fd)
