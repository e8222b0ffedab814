"""What every Python consumer process of the benchmark shares: bench/worker.py (aperf)
and bench/peer_bcc.py (BCC). Standard library only: peer_bcc.py runs under Debian's
/usr/bin/python3, where aperf is not installed.

Protocol with bench/run.py: the consumer is started with one JSON argument (its
spec), pins itself to ``spec["cpu"]``, prints ``ready`` once its rings are open
(its CPU time counts from there), takes samples until SIGUSR1 (the producer has
finished), takes what the rings still hold, writes the latencies it took to
``spec["lat_path"]`` (``array('q')``, native endian) and prints one line
``result {json}``.
"""

from __future__ import annotations

import array
import json
import os
import resource
import sys
from typing import Any


def start() -> dict[str, Any]:
    """The consumer's spec, from argv; the process pinned to its CPU."""
    spec: dict[str, Any] = json.loads(sys.argv[1])
    os.sched_setaffinity(0, {spec["cpu"]})
    return spec


class Tally:
    """What a consumer counts: samples, lost samples, and the latency of every
    ``lat_every``-th sample (a power of two; ``mask`` tests the count)."""

    def __init__(self, lat_every: int) -> None:
        self.samples = 0
        self.lost = 0
        self.mask = lat_every - 1
        self.lat = array.array("q")
        self.t_last = 0  # time.monotonic_ns() of the last latency taken
        self._ready: resource.struct_rusage | None = None

    def ready(self) -> None:
        """The rings are open: start counting CPU time, tell the harness."""
        self._ready = resource.getrusage(resource.RUSAGE_SELF)
        print("ready", flush=True)

    def report(self, lat_path: str, consumed: bool = True, **extra: Any) -> None:
        """Write the latencies, print the result line: the counts and CPU time, and
        ``extra`` fields (only these when nothing was ``consumed``: a baseline)."""
        end = resource.getrusage(resource.RUSAGE_SELF)
        begin = self._ready or end
        with open(lat_path, "wb") as f:
            self.lat.tofile(f)
        result = extra if not consumed else {
            "samples": self.samples,
            "lost_reported": self.lost,
            "cpu_user": end.ru_utime - begin.ru_utime,
            "cpu_sys": end.ru_stime - begin.ru_stime,
            "maxrss_kb": peak_rss_kb(),
            "t_last": self.t_last,
            "latencies": len(self.lat),
            **extra,
        }
        print("result " + json.dumps(result), flush=True)


def rss_kb() -> int:
    """The current RSS of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def peak_rss_kb() -> int:
    """VmHWM: the peak RSS of this process image (ru_maxrss would carry over the
    parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0
