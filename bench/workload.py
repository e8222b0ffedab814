"""The traced workload of aperf's benchmark: ``os.getpid()`` in a tight Python loop.

Run by bench/run.py, pinned to the producer's CPU: prints "ready", waits for a
line on stdin, calls ``os.getpid()`` for the given number of seconds, then prints
``result {json}`` with the number of calls, the time they took, and the
CLOCK_MONOTONIC start and end in ns. CPython does
not cache the pid: every call is a getpid(2) system call, and so a firing of the
``syscalls/sys_enter_getpid`` tracepoint (run.py checks the BPF side's count
against the number of calls).

usage: python bench/workload.py SECONDS
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    seconds = float(sys.argv[1])
    print("ready", flush=True)
    sys.stdin.readline()
    getpid = os.getpid
    clock = time.monotonic
    calls = 0
    start_ns = time.monotonic_ns()
    start = clock()
    deadline = start + seconds
    while True:
        for _ in range(1000):
            getpid()
        calls += 1000
        end = clock()
        if end >= deadline:
            break
    end_ns = time.monotonic_ns()
    result = {"calls": calls, "seconds": end - start, "start_ns": start_ns, "end_ns": end_ns}
    print("result " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
