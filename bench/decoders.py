"""Decoder cost per sample, one call at a time: BTF against ctypes (issue 11).

    python bench/decoders.py     # after make -C bpf; no root needed

Decodes one 32-byte and one 256-byte sample of the benchmark's structs
(bpf/bench.h) many times with a BTF decoder and with a ctypes mirror, and
prints the best of five rounds in ns per sample. A micro-benchmark: the
consumer CPU of whole streams is bench/run.py's.
"""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Callable
from pathlib import Path

from worker import CTYPES

import aperf

OBJECT = Path(__file__).resolve().parent.parent / "bpf" / "bench_getpid.bpf.o"
SAMPLES = {
    32: struct.pack("<QQQQ", 1, 2, 3, 4) + bytes(4),  # as padded by the kernel
    256: struct.pack("<QQII16s200sQQ", 1, 2, 3, 4, b"bash", b"/usr/bin/bash", 5, 6) + bytes(4),
}


def per_sample(decode: Callable[[bytes], object], data: bytes, calls: int = 100_000) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(calls):
            decode(data)
        best = min(best, time.process_time() - start)
    return best / calls * 1e9


def main() -> None:
    with aperf.BPFObject(OBJECT) as obj:
        btf = {size: aperf.decoders.from_btf(obj, f"bench_sample{size}") for size in SAMPLES}
    for size, data in SAMPLES.items():
        ctype: type[ctypes.Structure] = CTYPES[size]
        b = per_sample(btf[size], data)
        c = per_sample(aperf.decoders.from_ctypes(ctype), data)
        print(f"{size:>3} B: BTF {b:6.0f} ns, ctypes {c:6.0f} ns per sample, "
              f"ctypes/BTF {c / b:.2f}")


if __name__ == "__main__":
    main()
