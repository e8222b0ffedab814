"""BCC, the Python peer of aperf's benchmark (run by bench/run.py with /usr/bin/python3).

usage: /usr/bin/python3 bench/peer_bcc.py SPEC_JSON

BCC compiles its BPF program at run time from C source held in a Python string:
that is BCC's idiom, kept here as the peer's way of doing things (aperf's own
producers are .bpf.c files built ahead of time). The program does what
bpf/bench_getpid.bpf.c does, with the same code: it includes bpf/bench.h, whose
bench_fill() and bench_count() build the 32-byte sample (per-CPU sequence number,
ktime, pid_tgid, cpu) and count the outputs that succeeded and failed per CPU.
Only the map declarations and accesses are written in BCC's dialect.

SPEC_JSON fields:
  mode       "count" (callback counts), "event" (callback decodes with
             b["events"].event(data), BCC's usual idiom), "attach-only" (the program
             runs, no ring is opened: BCC's no-consumer baseline)
  tgid       the traced process
  pages      page_cnt per CPU ring
  wakeup     wakeup_events (1 is BCC's default)
  drain_ms   with wakeup > 1, perf_buffer_consume() at least this often (0: never)
  cpu, lat_every, lat_path  as for bench/worker.py

Protocol: that of bench/common.py; the result line also carries the program's
counters (ok, failed), and only those in attach-only mode.
"""

from __future__ import annotations

import ctypes
import signal
import time
from pathlib import Path

from bcc import BPF
from common import Tally, start

BPF_INCLUDE = Path(__file__).resolve().parent.parent / "bpf"

# ---- BCC's idiom: the BPF program as C source in a string ---------------------------------
BCC_PROGRAM = r"""
#include "bench.h"

BPF_PERF_OUTPUT(events);
BPF_PERCPU_ARRAY(counters, struct bench_counters, 1);

TRACEPOINT_PROBE(syscalls, sys_enter_getpid) {
    u64 id = bpf_get_current_pid_tgid();
    u32 zero = 0;
    struct bench_sample32 sample;
    struct bench_counters *c = counters.lookup(&zero);

    if (c && (u32)(id >> 32) == TARGET_TGID) {
        bench_fill(&sample, c, id);
        bench_count(c, events.perf_submit(args, &sample, sizeof(sample)));
    }
    return 0;
}
"""
# ---------------------------------------------------------------------------------------------

_TS_AT_8 = ctypes.c_uint64


def main() -> None:
    spec = start()
    mode = spec["mode"]
    b = BPF(text=BCC_PROGRAM,
            cflags=[f"-DTARGET_TGID={int(spec['tgid'])}", f"-I{BPF_INCLUDE}"])
    t = Tally(spec.get("lat_every", 64))
    mask, lat, mono = t.mask, t.lat, time.monotonic_ns

    def count(cpu, data, size):
        t.samples += 1
        if not t.samples & mask:
            # the timestamp at byte 8 of the raw sample, without building the struct
            t.t_last = now = mono()
            lat.append(now - _TS_AT_8.from_address(data + 8).value)

    def decode(cpu, data, size):
        event = b["events"].event(data)
        t.samples += 1
        if not t.samples & mask:
            t.t_last = now = mono()
            lat.append(now - event.ts)

    def lost(count):
        t.lost += count

    consuming = mode != "attach-only"
    if consuming:
        b["events"].open_perf_buffer(count if mode == "count" else decode,
                                     page_cnt=spec["pages"], lost_cb=lost,
                                     wakeup_events=spec["wakeup"])
    finished = []
    signal.signal(signal.SIGUSR1, lambda *_: finished.append(True))
    t.ready()

    drain_s = spec.get("drain_ms", 0) / 1000 if spec["wakeup"] > 1 else 0
    next_drain = time.monotonic() + drain_s
    while not finished:
        if not consuming:
            time.sleep(0.01)
        elif drain_s:
            b.perf_buffer_poll(timeout=max(1, int((next_drain - time.monotonic()) * 1000)))
            now = time.monotonic()
            if now >= next_drain:
                b.perf_buffer_consume()
                next_drain = now + drain_s
        else:
            b.perf_buffer_poll(timeout=10)
    if consuming:
        b.perf_buffer_consume()
    per_cpu = b["counters"].getvalue(0)
    t.report(spec["lat_path"], consumed=consuming,
             ok=sum(v.ok for v in per_cpu), failed=sum(v.failed for v in per_cpu))


if __name__ == "__main__":
    main()
