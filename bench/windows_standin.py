"""What aperf's eBPF for Windows path costs per sample, on the Linux stand-in DLL.

    python bench/windows_standin.py [--samples N] [--rounds R]

Builds tests/windows/fake_ebpfapi.c with gcc, fills one 16 MiB ring with N
24-byte samples, then times (1) ``take()``: ``perf_buffer__consume_buffer`` with
its ctypes callbacks copying each sample, and aperf's framing; (2) the record
split; (3) ``PerfBuffer.consume()`` end to end with a counting callback. Then
the same for a ring buffer map, read straight from its mapped memory
(``WindowsRingBufferSource``: one copy of the committed span, no callback). This
is aperf's Python side only: the stand-in's C is not eBPF for Windows, and
nothing here ran on Windows. Figures only; no pass/fail.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import struct
import subprocess
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAYLOAD = struct.pack("<Q16x", 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        library = Path(tmp) / "libfake_ebpfapi.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-pthread", "-o", str(library),
                        str(REPO / "tests" / "windows" / "fake_ebpfapi.c")], check=True)
        os.environ["APERF_EBPFAPI"] = os.environ["APERF_KERNEL32"] = str(library)
        run(library, args.samples, args.rounds)


def run(library: Path, n: int, rounds: int) -> None:
    import aperf
    from aperf._options import Wakeup
    from aperf._rings.seam import RingConfig
    from aperf._rings.windows.perf import WINDOWS_RECORDS, WindowsPerfSource

    lib = ctypes.CDLL(str(library))
    lib.fake_map_create.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_char_p]
    lib.fake_output.argtypes = [ctypes.c_int, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32]
    lib.fake_set_cpu_count(1)
    fd = lib.fake_map_create(14, 1 << 24, b"bench")  # room for 524288 samples of 24 bytes
    if n > 1 << 19:
        raise SystemExit("at most 524288 samples fit the ring")

    def fill() -> None:
        for _ in range(n):
            lib.fake_output(fd, 0, PAYLOAD, len(PAYLOAD))

    count = 0

    def on_sample(sample: object) -> None:
        nonlocal count
        count += 1

    print(f"{n} samples of {len(PAYLOAD)} bytes, ns per sample:")
    print("round  take(copy+frame)  split  PerfBuffer.consume()")
    for index in range(rounds):
        source = WindowsPerfSource(fd)
        (ring,) = source.open(RingConfig(None, Wakeup.per_sample()))
        fill()
        t0 = time.perf_counter()
        span = ring.take()
        t1 = time.perf_counter()
        WINDOWS_RECORDS.split(0, span)
        t2 = time.perf_counter()
        source.free()
        with aperf.PerfBuffer(WindowsPerfSource(fd), on_sample=on_sample,
                              wakeup="lowest-latency") as pb:
            fill()
            count = 0
            t3 = time.perf_counter()
            handled = pb.consume()
            t4 = time.perf_counter()
        assert handled == count == n
        print(f"{index:5}  {(t1 - t0) / n * 1e9:16.0f}  {(t2 - t1) / n * 1e9:5.0f}  "
              f"{(t4 - t3) / n * 1e9:20.0f}")
    run_ringbuf(lib, n, rounds, on_sample)


def run_ringbuf(lib: ctypes.CDLL, n: int, rounds: int, on_sample: object) -> None:
    import aperf
    from aperf._options import Wakeup
    from aperf._rings.ringbuf.format import RINGBUF_RECORDS
    from aperf._rings.seam import RingConfig
    from aperf._rings.windows.ringbuf import WindowsRingBufferSource

    lib.fake_ringbuf_output.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
    fd = lib.fake_map_create(13, 1 << 24, b"bench_rb")  # BPF_MAP_TYPE_RINGBUF on Windows

    def fill() -> None:
        for _ in range(n):
            lib.fake_ringbuf_output(fd, PAYLOAD, len(PAYLOAD))

    print("ring buffer, ns per sample:")
    print("round  take(copy)  split  PerfBuffer.consume()")
    for index in range(rounds):
        source = WindowsRingBufferSource(fd)
        (ring,) = source.open(RingConfig(None, Wakeup.per_sample()))
        fill()
        t0 = time.perf_counter()
        span = ring.take()
        t1 = time.perf_counter()
        RINGBUF_RECORDS.split(-1, span)
        t2 = time.perf_counter()
        source.free()
        with aperf.PerfBuffer(WindowsRingBufferSource(fd), on_sample=on_sample,
                              wakeup="lowest-latency") as pb:
            fill()
            t3 = time.perf_counter()
            handled = pb.consume()
            t4 = time.perf_counter()
        assert handled == n
        print(f"{index:5}  {(t1 - t0) / n * 1e9:10.0f}  {(t2 - t1) / n * 1e9:5.0f}  "
              f"{(t4 - t3) / n * 1e9:20.0f}")


if __name__ == "__main__":
    main()
