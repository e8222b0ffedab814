"""What a UserRingBuffer send costs, Python side (issue 22).

    sudo python bench/user_ringbuf.py     # after make -C bpf; needs root

Loads bpf/user_ringbuf.bpf.o with a 1 MiB user ring buffer, fills it with
32-byte messages by ``send_nowait`` (bytes, then a ``struct.Struct`` encoder,
then a BTF struct encoder), times the fill, and lets the BPF side drain it
between rounds. Best of five rounds, ns per message. Figures only.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import aperf
from aperf._native import libbpf as lb

OBJECT = Path(__file__).resolve().parent.parent / "bpf" / "user_ringbuf.bpf.o"
RING = 1 << 20
ROUNDS = 5


def main() -> None:
    with aperf.BPFObject(OBJECT) as obj:
        obj.maps["to_bpf"].set_max_entries(RING)
        obj.load()
        prog = obj.programs["drain"].fd
        cpu = sorted(os.sched_getaffinity(0))[0]
        cases = {
            "bytes": (None, bytes(32)),
            "struct.Struct": (struct.Struct("<QQQQ"), (1, 2, 3, 4)),
            "BTF user_message (mapping)": ("user_message", {"seq": 1, "name": "x"}),
        }
        for label, (encoder, value) in cases.items():
            with aperf.UserRingBuffer(obj.maps["to_bpf"], encoder=encoder) as urb:
                size = len(urb.encode(value))
                count = RING // ((size + 8 + 7) & ~7)
                best = float("inf")
                for _ in range(ROUNDS):
                    start = time.perf_counter_ns()
                    for _ in range(count):
                        urb.send_nowait(value)
                    best = min(best, (time.perf_counter_ns() - start) / count)
                    lb.test_run_on_cpu(prog, cpu)  # the BPF side drains (and echoes) it all
                print(f"{label:28} {size:3} B  {best:6.0f} ns per send_nowait")


if __name__ == "__main__":
    main()
