"""aperf's benchmark harness: one command, figures printed and written to docs/benchmarks.md.

    .venv/bin/python bench/run.py            # as root: everything (about 10 minutes)
    .venv/bin/python bench/run.py --quick    # shorter runs, fewer consumers (about 2 minutes)
    .venv/bin/python bench/run.py --only 'flat32/*' --only memory
    .venv/bin/python bench/run.py --list     # scenario names
    .venv/bin/python bench/run.py --report-only   # tables and docs again, from the results

Every scenario is one producer run read by one consumer process. The consumer
is pinned to CPU 0 and the producer to CPU 1, so neither steals the other's CPU
and the consumer's CPU time and peak RSS are its own. Results go to
bench/results.json (raw, gitignored) and to the generated part of
docs/benchmarks.md; ratios are computed between scenarios of the same run.
Benchmarks print figures; nothing here is a pass/fail test.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import fnmatch
import glob
import json
import os
import platform
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import report
from scenarios import Scenario, all_scenarios

import aperf
from aperf.testing import Producer

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
BPF_DIR = REPO / "bpf"
GETPID_OBJECT = BPF_DIR / "bench_getpid.bpf.o"
SPACED_OBJECT = BPF_DIR / "paced.bpf.o"
CONSUMER_CPU = 0
PRODUCER_CPU = 1
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's python3-bpfcc lives there


class BenchError(Exception):
    pass


def percpu_sums(m: aperf.Map, fields: int) -> list[int]:
    """Sums over CPUs of the first ``fields`` u64s of a per-CPU array's value at key 0."""
    raw = m.lookup(bytes(4))
    stride = (m.value_size + 7) & ~7  # one 8-byte-aligned slot per possible CPU
    row = struct.Struct(f"<{fields}Q")
    slots = [row.unpack_from(raw, at) for at in range(0, len(raw), stride)]
    return [sum(column) for column in zip(*slots, strict=True)]


# --- setting up ---------------------------------------------------------------------------


class Environment:
    """Tools built and checked once per run; what could not be set up, and why."""

    def __init__(self, workdir: Path, want_bcc: bool, no_extensions: bool = False) -> None:
        self.workdir = workdir
        self.no_extensions = no_extensions  # --no-extensions: every aperf consumer pure
        self.notes: list[str] = []
        self.bcc_reason: str | None = None
        self._check_kernel_fs()
        self._build_bpf()
        self.peer_libbpf = self._compile("peer_libbpf.c", "-lbpf")
        self.getpid_loop = self._compile("getpid_loop.c")
        self.bcc_version = ""
        if want_bcc:
            self._check_bcc()
        else:
            self.bcc_reason = "skipped with --no-bcc"

    def _check_kernel_fs(self) -> None:
        if not os.path.isdir("/sys/kernel/tracing/events"):
            subprocess.run(["mount", "-t", "tracefs", "tracefs", "/sys/kernel/tracing"],
                           check=False, capture_output=True)
            self.notes.append("mounted tracefs at /sys/kernel/tracing")
        with open("/proc/mounts") as f:
            if not any(line.split()[1:3] == ["/sys/fs/bpf", "bpf"] for line in f):
                subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
                self.notes.append("mounted bpffs at /sys/fs/bpf")

    def _build_bpf(self) -> None:
        done = subprocess.run(["make", "-C", str(BPF_DIR)], capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"make -C bpf failed:\n{done.stdout}{done.stderr}")

    def _compile(self, source: str, *libs: str) -> str:
        out = self.workdir / source.removesuffix(".c")
        cmd = ["gcc", "-O2", "-Wall", "-o", str(out), str(BENCH / source), *libs]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(cmd)} failed:\n{done.stderr}")
        return str(out)

    def _check_bcc(self) -> None:
        if not os.path.exists(SYSTEM_PYTHON):
            self.bcc_reason = f"{SYSTEM_PYTHON} not found"
            return
        probe = subprocess.run([SYSTEM_PYTHON, "-c", "import bcc; print(bcc.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            self.bcc_reason = ("BCC is not importable by /usr/bin/python3 "
                               "(apt-get install -y python3-bpfcc linux-headers-amd64)")
            return
        self.bcc_version = probe.stdout.strip()
        modules = Path("/lib/modules") / os.uname().release
        for link, pattern in (("build", "/usr/src/linux-headers-*-amd64"),
                              ("source", "/usr/src/linux-headers-*-common")):
            target = modules / link
            if target.exists():
                continue
            found = sorted(glob.glob(pattern))
            if not found:
                self.bcc_reason = (f"no kernel headers at {target}, and no Debian headers "
                                   f"({pattern}) to point it at: apt-get install -y "
                                   "linux-headers-amd64")
                return
            modules.mkdir(parents=True, exist_ok=True)
            target.symlink_to(found[-1])
            self.notes.append(f"linked {target} -> {found[-1]} (BCC's kernel headers)")


# --- processes ----------------------------------------------------------------------------


def read_line(proc: subprocess.Popen[str], timeout: float, prefix: str) -> str:
    """The next stdout line of ``proc`` starting with ``prefix`` (others are skipped)."""
    assert proc.stdout is not None
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    who = " ".join(os.path.basename(str(a)) for a in args[:2])
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"no {prefix!r} line from {who} within {timeout:.0f} s")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"{who} exited (code {proc.wait()}) before {prefix!r}")
        if line.startswith(prefix):
            return line[len(prefix):].strip()


@contextlib.contextmanager
def started(cmd: list[str], stderr_path: Path, stdin: bool = False,
            ) -> Iterator[subprocess.Popen[str]]:
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def stderr_tail(path: Path) -> str:
    """The last lines the process wrote to stderr, last line first (it says what went wrong)."""
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()][-15:]
    except OSError:
        return ""
    return " | ".join(reversed(lines))


class Consumer:
    """Starts the consumer process of a scenario, waits for it to be ready, stops it."""

    def __init__(self, env: Environment, sc: Scenario, map_path: str, tmp: Path,
                 tgid: int = 0) -> None:
        self.sc = sc
        self.lat_path = tmp / "lat.bin"
        self.stderr = tmp / "consumer.err"
        lat_every = sc.extra.get("lat_every", 64)
        c = sc.consumer
        if c["impl"] == "aperf":
            spec = dict(c, map=map_path, cpu=CONSUMER_CPU, lat_every=lat_every,
                        lat_path=str(self.lat_path), btf_object=str(GETPID_OBJECT),
                        size=sc.producer.get("size", 32))
            self.cmd = [sys.executable, str(BENCH / "worker.py"), json.dumps(spec)]
            if c.get("pure") or env.no_extensions:  # issue 31: the pure-Python path
                self.cmd = ["env", "APERF_NO_EXTENSIONS=1", *self.cmd]
        elif c["impl"] == "libbpf":
            self.cmd = ["taskset", "-c", str(CONSUMER_CPU), env.peer_libbpf, map_path,
                        str(c["pages"]), c["wakeup"], str(c["drain_ms"]), str(lat_every),
                        str(self.lat_path)]
            if c.get("channels"):
                self.cmd.append(str(c["channels"]))
        elif c["impl"] == "bcc":
            spec = dict(c, tgid=tgid, cpu=CONSUMER_CPU, lat_every=lat_every,
                        lat_path=str(self.lat_path))
            self.cmd = [SYSTEM_PYTHON, str(BENCH / "peer_bcc.py"), json.dumps(spec)]
        else:
            raise ValueError(c["impl"])

    @contextlib.contextmanager
    def running(self) -> Iterator[Consumer]:
        with started(self.cmd, self.stderr) as proc:
            self.proc = proc
            try:
                read_line(proc, 60, "ready")
            except BenchError as exc:
                raise BenchError(f"{exc}: {stderr_tail(self.stderr)}") from None
            yield self

    def finish(self, timeout: float = 120) -> dict[str, Any]:
        """Tell it the producer is done; its report, with the latencies it took."""
        self.proc.send_signal(signal.SIGUSR1)
        try:
            result = json.loads(read_line(self.proc, timeout, "result "))
        except BenchError as exc:
            raise BenchError(f"{exc}: {stderr_tail(self.stderr)}") from None
        self.proc.wait(30)
        lat = array.array("q")
        with open(self.lat_path, "rb") as f:
            lat.frombytes(f.read())
        result["lat"] = lat
        return result


# --- producers ----------------------------------------------------------------------------


def produce(p: Any, spec: dict[str, Any]) -> tuple[int, int]:
    """Run the deterministic producer on PRODUCER_CPU as ``spec`` says; (start, end) ns."""
    times: list[int] = []
    failure: list[BaseException] = []

    def burst() -> None:
        times.append(time.monotonic_ns())
        p.emit(spec["count"], size=spec["size"], cpu=PRODUCER_CPU)
        times.append(time.monotonic_ns())

    def paced() -> None:
        # Emit what is due at every period boundary; a late tick catches up.
        rate, period, size = spec["rate"], spec["period"], spec["size"]
        total = int(rate * spec["seconds"])
        sent = 0
        start = time.monotonic()
        times.append(time.monotonic_ns())
        tick = 0
        # "cpus": "both": every period's samples alternate between the two CPUs' rings.
        cpus = (PRODUCER_CPU, CONSUMER_CPU) if spec.get("cpus") == "both" else (PRODUCER_CPU,)
        slot = spec.get("map_key")  # a channel of its own (the ring in that slot is on cpus[0])
        while sent < total:
            due = min(total, int((time.monotonic() - start) * rate) + 1)
            if due > sent:
                p.emit(due - sent, size=size, cpu=cpus[tick % len(cpus)], map_key=slot)
                sent = due
            tick += 1
            pause = start + tick * period - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        times.append(time.monotonic_ns())

    def spaced() -> None:
        times.append(time.monotonic_ns())
        p.emit(spec["rate"], spec["seconds"], PRODUCER_CPU)
        times.append(time.monotonic_ns())

    def idle() -> None:
        times.append(time.monotonic_ns())
        time.sleep(spec["seconds"])
        times.append(time.monotonic_ns())

    def run() -> None:
        os.sched_setaffinity(0, {PRODUCER_CPU})
        try:
            {"burst": burst, "paced": paced, "spaced": spaced, "idle": idle}[spec["kind"]]()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="bench-producer")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return times[0], times[1]


@contextlib.contextmanager
def pinned(m: aperf.Map) -> Iterator[str]:
    """``m`` pinned in bpffs for the consumer process to open by path."""
    path = f"/sys/fs/bpf/aperf_bench_{os.getpid()}_{time.monotonic_ns()}"
    m.pin(path)
    try:
        yield path
    finally:
        m.unpin(path)


class SpacedCounts:
    def __init__(self, ok: int, failed: int) -> None:
        self.ok, self.failed = ok, failed


class SpacedProducer:
    """bpf/paced.bpf.c: 16-byte records into its 1 MiB BPF ring buffer, spaced by the BPF
    program itself, each with the kernel's default wakeup rule (flags 0, as most programs
    do): a reader that caught up is woken by the next record. A batch emitted at once
    (``Producer``) wakes it once; records spaced 10 us apart can wake it 100 k times a second.
    """

    RUN = 1000  # records per program run: 10 ms at 100 k/s, then back to user space

    def __init__(self) -> None:
        self._obj = aperf.BPFObject(SPACED_OBJECT)
        self._obj.load()
        self.map = self._obj.maps["ringbuf"]
        self._pace = self._obj.maps["pace"]
        self._prog = self._obj.programs["paced"].fd

    def __enter__(self) -> SpacedProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._obj.close()

    def counters(self) -> SpacedCounts:
        ok, failed = (struct.unpack("<Q", self._obj.maps["counters"].lookup(
            struct.pack("<I", i)))[0] for i in range(2))
        return SpacedCounts(ok, failed)

    def emit(self, rate: float, seconds: float, cpu: int) -> None:
        from aperf._native import libbpf as lb

        total, gap_ns, sent = int(rate * seconds), int(1e9 / rate), 0
        while sent < total:
            count = min(self.RUN, total - sent)
            self._pace.update(struct.pack("<I", 0), struct.pack("<QQQ", count, gap_ns, sent))
            if lb.test_run_on_cpu(self._prog, cpu) != 0:
                raise BenchError("bpf/paced.bpf.c refused its configuration")
            sent += count


def run_deterministic(env: Environment, sc: Scenario, tmp: Path) -> dict[str, Any]:
    ring = sc.producer.get("ring", "perf")
    maker: Any = (SpacedProducer if sc.producer["kind"] == "spaced" else
                  lambda: Producer(ring=ring, ringbuf_bytes=sc.producer.get("ringbuf_bytes"),
                                   perf_slots=sc.producer.get("channels")))
    with maker() as p, pinned(p.map) as map_path:
        consumer = Consumer(env, sc, map_path, tmp)
        with consumer.running():
            before = p.counters()
            t_start, t_end = produce(p, sc.producer)
            after = p.counters()
            time.sleep(0.02)
            result = consumer.finish()
    result.update(ok=after.ok - before.ok, failed=after.failed - before.failed,
                  t_start=t_start, t_end=t_end)
    return result


def run_getpid(env: Environment, sc: Scenario, tmp: Path) -> dict[str, Any]:
    seconds = str(sc.producer["seconds"])
    if sc.producer["driver"] == "c":
        cmd = [env.getpid_loop, seconds]
    else:
        cmd = [sys.executable, str(BENCH / "workload.py"), seconds]
    # The workload inherits this process's affinity: the producer CPU.
    with started(cmd, tmp / "workload.err", stdin=True) as workload:
        read_line(workload, 30, "ready")
        with contextlib.ExitStack() as stack:
            counters: aperf.Map | None = None
            consumer: Consumer | None = None
            if sc.impl == "bcc":
                consumer = Consumer(env, sc, "", tmp, tgid=workload.pid)
                stack.enter_context(consumer.running())
            elif sc.impl != "noprog":
                obj = stack.enter_context(aperf.BPFObject(GETPID_OBJECT))
                obj.set_global("target_tgid", workload.pid)
                obj.load()
                stack.enter_context(obj.programs["on_getpid"].attach())
                counters = obj.maps["counters"]
                if sc.impl != "none":
                    map_path = stack.enter_context(pinned(obj.maps["events"]))
                    consumer = Consumer(env, sc, map_path, tmp)
                    stack.enter_context(consumer.running())
            before = percpu_sums(counters, 3) if counters is not None else [0, 0, 0]
            assert workload.stdin is not None
            workload.stdin.write("go\n")
            workload.stdin.flush()
            work = json.loads(read_line(workload, sc.producer["seconds"] + 30, "result "))
            after = percpu_sums(counters, 3) if counters is not None else [0, 0, 0]
            time.sleep(0.02)
            result: dict[str, Any] = {}
            if consumer is not None:
                result = consumer.finish()
            if counters is not None:
                result.update(ok=after[1] - before[1], failed=after[2] - before[2])
    result.update(workload_calls=work["calls"], workload_seconds=work["seconds"],
                  t_start=work["start_ns"], t_end=work["end_ns"])
    return result


def run_scenario(env: Environment, sc: Scenario) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="aperf-bench-", dir=env.workdir) as tmpdir:
        tmp = Path(tmpdir)
        if sc.producer["kind"] == "getpid":
            return run_getpid(env, sc, tmp)
        return run_deterministic(env, sc, tmp)


# --- the command ----------------------------------------------------------------------------


def machine_facts(env: Environment) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True).stdout
    import importlib.metadata

    import trio
    import uvloop

    return {
        "uname": " ".join(platform.uname()),
        "cpu_model": model,
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "uvloop": uvloop.__version__,
        "trio": trio.__version__,
        "anyio": importlib.metadata.version("anyio"),
        "libbpf": aperf.libbpf_version(),
        "bcc": env.bcc_version or None,
        "gcc": gcc.splitlines()[0] if gcc else "",
        "aperf_default_pages": aperf.DEFAULT_PAGES,
    }


def select_scenarios(patterns: list[str], quick: bool) -> list[Scenario]:
    scenarios = all_scenarios(quick)
    if not patterns:
        return scenarios
    chosen = [sc for sc in scenarios
              if any(fnmatch.fnmatch(sc.name, p) or fnmatch.fnmatch(sc.group, p)
                     for p in patterns)]
    if not chosen:
        raise SystemExit(f"no scenario matches {patterns}; see --list")
    return chosen


def report_only(path: Path, write: bool) -> int:
    try:
        saved = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"no results to report: {path} does not exist yet; a run writes it "
            "(.venv/bin/python bench/run.py, as root)"
        ) from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot read the results in {path}: {exc}") from None
    print(report.text_tables(saved["results"]))
    if write:
        doc = REPO / "docs" / "benchmarks.md"
        partial = len({e.get("run_id") for e in saved["results"]}) > 1
        report.write_doc(doc, saved["results"], saved["machine"], saved["setup_notes"],
                         saved["bcc"], saved["run_id"], saved["quick"], partial)
        print(f"\nwrote {doc}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="shorter runs and fewer consumers (about 2 minutes)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="run the scenarios whose name or group matches (shell pattern); "
                             "results merge into the previous ones")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the scenarios this many times, one round after another, "
                             "and report each figure's median (with the CPU spread)")
    parser.add_argument("--list", action="store_true", help="list scenario names and exit")
    parser.add_argument("--no-bcc", action="store_true", help="skip the BCC peer")
    parser.add_argument("--no-extensions", action="store_true",
                        help="run every aperf consumer on the pure-Python path "
                             "(APERF_NO_EXTENSIONS=1; scenarios named .pure always are)")
    parser.add_argument("--no-doc", action="store_true", help="do not touch docs/benchmarks.md")
    parser.add_argument("--results", default=str(BENCH / "results.json"),
                        help="raw results file (default: bench/results.json)")
    parser.add_argument("--report-only", action="store_true",
                        help="print the tables and rewrite the doc from the results file")
    args = parser.parse_args()
    if args.report_only:
        return report_only(Path(args.results), write=not args.no_doc)
    patterns = [p for item in args.only for p in item.split(",") if p]
    scenarios = select_scenarios(patterns, args.quick)
    if args.list:
        for sc in scenarios:
            print(f"{sc.name:48} {sc.label}")
        return 0
    if os.geteuid() != 0:
        raise SystemExit("the benchmark loads BPF programs: run it as root")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("the benchmark needs two CPUs (consumer on 0, producer on 1)")
    os.sched_setaffinity(0, {PRODUCER_CPU})

    workdir = Path(tempfile.mkdtemp(prefix="aperf-bench-"))
    try:
        env = Environment(workdir, want_bcc=not args.no_bcc, no_extensions=args.no_extensions)
        run_id = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        machine = machine_facts(env)
        print(f"aperf benchmark {'(quick) ' if args.quick else ''}{run_id}")
        print(f"  {machine['uname']}\n  {machine['cpu_model']}, {machine['nproc']} CPUs")
        for note in env.notes:
            print(f"  setup: {note}")
        if env.bcc_reason:
            print(f"  BCC peer skipped: {env.bcc_reason}")
        results: list[dict[str, Any]] = []
        started_at = time.monotonic()
        rounds = max(1, args.rounds)
        # Rounds one after another (not each scenario N times in a row), so that a slow
        # minute of the shared machine falls on every consumer alike.
        order = [(r, i, sc) for r in range(rounds) for i, sc in enumerate(scenarios, 1)]
        for round_no, index, sc in order:
            entry: dict[str, Any] = {"name": sc.name, "group": sc.group, "label": sc.label,
                                     "impl": sc.impl, "consumer": sc.consumer,
                                     "producer": sc.producer, "run_id": run_id,
                                     "quick": args.quick}
            if sc.impl == "bcc" and env.bcc_reason:
                entry["skipped"] = env.bcc_reason
            else:
                try:
                    raw = run_scenario(env, sc)
                    entry.update(report.summarize(raw))
                except (BenchError, aperf.AperfError, OSError) as exc:
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                    if sc.impl == "bcc" and "BPF" in str(exc):
                        env.bcc_reason = f"BCC failed here: {str(exc).splitlines()[-1]}"
            results.append(entry)
            print(f"[{round_no + 1}:{index:2}/{len(scenarios)} "
                  f"{time.monotonic() - started_at:5.0f}s] " + report.one_line(entry),
                  flush=True)
        if rounds > 1:
            results = report.medians(results)
        merged = report.merge(Path(args.results), results, partial=bool(patterns))
        Path(args.results).write_text(json.dumps(
            {"machine": machine, "setup_notes": env.notes, "bcc": env.bcc_reason,
             "run_id": run_id, "quick": args.quick, "results": merged}, indent=1))
        print()
        print(report.text_tables(merged))
        if not args.no_doc:
            doc = REPO / "docs" / "benchmarks.md"
            report.write_doc(doc, merged, machine, env.notes, env.bcc_reason, run_id,
                             args.quick, partial=bool(patterns))
            print(f"\nwrote {args.results} and {doc}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
