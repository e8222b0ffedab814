"""Who makes which syscalls, and how long they take: a live summary, vectorised.

``bpf/syscall_latency.bpf.c`` times every syscall in the kernel (the
``raw_syscalls`` tracepoints) and reports each one that finishes as a
``struct syscall_event`` (``bpf/syscall_latency.h``). This program reads them
as columnar batches, ``PerfStream.arrays()``: a NumPy structured array per run
of one CPU's events, decoded from the object's BTF. :class:`SyscallStats`
folds each array into its counts with NumPy (no Python code per syscall):

- calls per process and per (process, syscall);
- a log2 histogram of latency per syscall, and the time spent in each.

Every ``--interval`` seconds it prints the busiest processes and the latency
histogram of the syscall that took the most time (or of ``--syscall``)::

    $ sudo python -m examples.syscall_latency --top 3 --seconds 5
    PID     COMM              CALLS  TOP SYSCALLS
    4106    python            30923  epoll_pwait 5220, epoll_wait 5147, epoll_ctl 2803
    10458   python3.11        16825  newfstatat 6415, lseek 2969, openat 1396
    10597   python             4804  read 1744, newfstatat 1251, lseek 328
    futex: 294 calls, 6346.0 ms in all, p50 <= 65.5 us, p99 <= 67.1 ms
                      ns : count
           512 -> 1023      : 38       |************                            |
          1024 -> 2047      : 34       |***********                             |
    ...

``--pid PID`` watches one process only (the filter runs in the kernel).
Ctrl-C (or ``--seconds``) stops it; it says on stderr when it has started
watching. ``--plot FILE`` also draws the final latency histograms (the
syscalls that took the most time) into a PNG; it needs matplotlib
(``pip install 'aperf-bpf[plot]'``), and without it the text still prints.
docs/columnar.md walks through this file.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import aperf

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OBJECT = REPO / "bpf" / "syscall_latency.bpf.o"
UNISTD = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
MAX_NR = 512  # syscall numbers at or above it (none on x86-64) count as MAX_NR - 1
BUCKETS = 64  # bucket b holds latencies in [2**(b-1), 2**b) ns


def syscall_names() -> dict[int, str]:
    """Syscall number -> name, from the kernel's headers when they are installed."""
    names: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for match in re.finditer(r"#define __NR_(\w+) (\d+)", UNISTD.read_text()):
            names[int(match.group(2))] = match.group(1)
    return names


class SyscallStats:
    """Counts of finished syscalls, folded in a :class:`aperf.SampleArray` at a time."""

    def __init__(self) -> None:
        self.samples = 0
        self.lost = 0
        self.comms: dict[int, str] = {}  # pid -> the name of its last thread seen
        self.calls: collections.Counter[int] = collections.Counter()  # pid -> calls
        self.pair_calls: collections.Counter[tuple[int, int]] = collections.Counter()
        self.histogram = np.zeros((MAX_NR, BUCKETS), np.int64)  # [nr, log2 bucket]
        self.time_ns = np.zeros(MAX_NR, np.float64)

    def add(self, array: aperf.SampleArray) -> None:
        """Fold one array of ``struct syscall_event`` rows in."""
        rows = array.values
        self.samples += len(rows)
        nr = np.minimum(rows["nr"], MAX_NR - 1).astype(np.int64)
        duration = rows["duration_ns"]
        # frexp's exponent is the bit length: 2**(b-1) <= duration < 2**b.
        bucket = np.minimum(np.frexp(duration.astype(np.float64))[1], BUCKETS - 1)
        self.histogram += np.bincount(
            nr * BUCKETS + bucket, minlength=MAX_NR * BUCKETS
        ).reshape(MAX_NR, BUCKETS)
        self.time_ns += np.bincount(nr, weights=duration, minlength=MAX_NR)
        # (pid, nr) pairs as one int64 key: one np.unique for both counts.
        keys, counts = np.unique((rows["pid"].astype(np.int64) << 32) | nr, return_counts=True)
        for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
            self.pair_calls[key >> 32, key & 0xFFFFFFFF] += count
            self.calls[key >> 32] += count
        pids, last = np.unique(rows["pid"][::-1], return_index=True)  # each pid's last row
        for pid, comm in zip(pids.tolist(), rows["comm"][::-1][last].tolist(), strict=True):
            self.comms[pid] = comm.decode("utf-8", "replace")

    def take(self, item: Any) -> None:
        """One item of ``stream.arrays()``: an array, or a lost notice (counted)."""
        if isinstance(item, aperf.SampleArray):
            self.add(item)
        elif isinstance(item, aperf.Lost):
            self.lost += item.count

    def percentile(self, nr: int, q: float) -> float:
        """The upper bound (ns) of the bucket holding the q-quantile of syscall ``nr``."""
        counts = self.histogram[nr]
        total = counts.sum()
        if not total:
            return 0.0
        bucket = int(np.searchsorted(np.cumsum(counts), q * total))
        return float(2**bucket)

    def report(self, top: int, syscall: int | None, names: dict[int, str]) -> str:
        """The busiest processes, then one syscall's latency histogram."""
        name = lambda nr: names.get(nr, f"syscall_{nr}")  # noqa: E731
        lines = [f"{'PID':<7} {'COMM':<16} {'CALLS':>6}  TOP SYSCALLS"]
        for pid, calls in self.calls.most_common(top):
            mine = sorted(((c, nr) for (p, nr), c in self.pair_calls.items() if p == pid),
                          reverse=True)[:3]
            tops = ", ".join(f"{name(nr)} {c}" for c, nr in mine)
            lines.append(f"{pid:<7} {self.comms.get(pid, '?'):<16} {calls:>6}  {tops}")
        nr = int(self.time_ns.argmax()) if syscall is None else syscall
        counts = self.histogram[nr]
        lines.append(
            f"{name(nr)}: {counts.sum()} calls, {self.time_ns[nr] / 1e6:.1f} ms in all, "
            f"p50 <= {_ns(self.percentile(nr, 0.5))}, p99 <= {_ns(self.percentile(nr, 0.99))}"
        )
        lines.append(f"{'ns':>20} : count")
        used = np.flatnonzero(counts)
        peak = counts.max() if counts.any() else 1
        for bucket in range(int(used.min()) if used.size else 0,
                            int(used.max()) + 1 if used.size else 0):
            low, high = (2 ** (bucket - 1) if bucket else 0), 2**bucket - 1
            bar = "*" * int(40 * counts[bucket] / peak)
            lines.append(f"{low:>10} -> {high:<10}: {counts[bucket]:<8} |{bar:<40}|")
        if self.lost:
            lines.append(f"({self.lost} events lost: the rings overflowed)")
        return "\n".join(lines)


PLOT_SYSCALLS = 4  # histograms in the --plot picture
PLOT_HINT = "pip install 'aperf-bpf[plot]'"


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(stats: SyscallStats, path: Path, syscall: int | None, names: dict[int, str]) -> None:
    """The latency histograms of ``syscall`` and of the syscalls that took the most time,
    one panel each (calls per log2 bucket), as a PNG at ``path``."""
    from matplotlib.figure import Figure  # no pyplot: no display, no global state

    name = lambda nr: names.get(nr, f"syscall_{nr}")  # noqa: E731
    busiest = [int(nr) for nr in np.argsort(stats.time_ns)[::-1] if stats.histogram[nr].any()]
    chosen = ([syscall] if syscall is not None else []) + [n for n in busiest if n != syscall]
    chosen = chosen[:PLOT_SYSCALLS]
    figure = Figure(figsize=(8, 2.4 * max(len(chosen), 1)), layout="constrained")
    axes = figure.subplots(max(len(chosen), 1), 1, squeeze=False)[:, 0]
    for ax, nr in zip(axes, chosen, strict=False):
        counts = stats.histogram[nr]
        used = np.flatnonzero(counts)
        buckets = np.arange(int(used.min()), int(used.max()) + 1)
        ax.bar(buckets, counts[buckets], width=0.9, color="tab:blue")
        ax.set_xticks(buckets, [_ns(2.0 ** (b - 1) if b else 0.0) for b in buckets],
                      rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("calls")
        ax.set_title(
            f"{name(nr)}: {counts.sum()} calls, {stats.time_ns[nr] / 1e6:.1f} ms in all, "
            f"p50 <= {_ns(stats.percentile(nr, 0.5))}, p99 <= {_ns(stats.percentile(nr, 0.99))}",
            fontsize=9,
        )
    if not chosen:
        axes[0].set_title("no syscall was seen")
    axes[-1].set_xlabel("latency, at least (log2 buckets)")
    # The titles as text too, in the PNG's Description: readable without looking.
    description = "; ".join(ax.get_title() for ax in axes)
    figure.savefig(path, format="png", dpi=100,
                   metadata={"Title": "syscall latency", "Description": description})


def _ns(value: float) -> str:
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("us", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} ns"


async def watch(
    stats: SyscallStats,
    *,
    pid: int = 0,
    stop: asyncio.Event,
    obj_path: Path = DEFAULT_OBJECT,
    every: float | None = None,
    on_interval: Callable[[], None] | None = None,
    ready: asyncio.Event | None = None,
) -> None:
    """Load and attach the programs (only ``pid``'s syscalls, if given; ``ready`` is set
    once they are attached), fold every array into ``stats`` until ``stop`` is set, then
    what the rings still hold."""
    with aperf.BPFObject(obj_path) as obj:
        if pid:
            obj.set_global("target_tgid", pid)
        obj.load()
        with obj.programs["on_enter"].attach(), obj.programs["on_exit"].attach():
            async with aperf.PerfStream(obj.maps["events"], decoder="syscall_event") as stream:
                loop = asyncio.get_running_loop()

                async def close_when_stopped() -> None:
                    while True:
                        try:
                            await asyncio.wait_for(stop.wait(), every)
                            break
                        except asyncio.TimeoutError:
                            if on_interval is not None:
                                on_interval()
                    await stream.aclose()  # hands over what the rings still hold

                closer = loop.create_task(close_when_stopped())
                if ready is not None:
                    ready.set()
                try:
                    async for item in stream.arrays():
                        stats.take(item)
                finally:
                    closer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await closer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pid", type=int, default=0, help="only this process (tgid)")
    parser.add_argument("--top", type=int, default=10, help="processes to show")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reports")
    parser.add_argument("--seconds", type=float, default=0, help="stop after (0: Ctrl-C)")
    parser.add_argument("--syscall", help="histogram of this syscall (name or number)")
    parser.add_argument("--object", type=Path, default=DEFAULT_OBJECT, help="the BPF object")
    parser.add_argument("--plot", type=Path, metavar="FILE",
                        help=f"also write the latency histograms as a PNG ({PLOT_HINT})")
    args = parser.parse_args(argv)
    if args.plot is not None and not plot_available():
        print(f"syscall_latency: --plot needs matplotlib, which is not installed: {PLOT_HINT}; "
              "printing text only", file=sys.stderr, flush=True)
    names = syscall_names()
    chosen = None
    if args.syscall is not None:
        numbers = {v: k for k, v in names.items()}
        if args.syscall.isdigit() or args.syscall in numbers:
            chosen = int(args.syscall) if args.syscall.isdigit() else numbers[args.syscall]
        else:
            parser.error(f"--syscall: unknown syscall {args.syscall!r}")
    if not args.object.exists():
        print(f"{args.object} is missing: build it with 'make -C bpf'", file=sys.stderr)
        return 1
    stats = SyscallStats()

    def show() -> None:
        print(stats.report(args.top, chosen, names), end="\n\n", flush=True)

    async def run() -> None:
        stop, ready = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        with aperf.closing_on_signals(stop.set):  # SIGINT, SIGTERM: stop, report, exit 0
            watching = loop.create_task(watch(
                stats, pid=args.pid, stop=stop, obj_path=args.object, every=args.interval,
                on_interval=show, ready=ready,
            ))
            await asyncio.wait([watching, loop.create_task(ready.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
            if ready.is_set():  # diagnostics on stderr: stdout holds the reports only
                what = f"process {args.pid}" if args.pid else "every process"
                print(f"syscall_latency: watching {what}", file=sys.stderr, flush=True)
                if args.seconds:
                    loop.call_later(args.seconds, stop.set)
            await watching

    try:
        asyncio.run(run())
    except aperf.AperfError as exc:
        print(f"syscall_latency: {exc}", file=sys.stderr)
        return 1
    show()
    if args.plot is not None:
        if not plot_available():
            return 1  # the text is out; the picture asked for is not (said at the start)
        plot(stats, args.plot, chosen, names)
        print(f"syscall_latency: histograms written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
