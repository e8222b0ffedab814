"""The columnar example (examples/syscall_latency.py) on the real kernel: it must count a
workload's syscalls exactly and place their latencies in the right log2 buckets."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from examples.syscall_latency import BUCKETS, DEFAULT_OBJECT, SyscallStats, watch

from ..helpers import REPO, asyncio_only

NR_GETPID, NR_CLOCK_NANOSLEEP = 39, 230  # x86-64
GETPIDS, SLEEPS = 3000, 40  # 2 ms each: at least 2**21 ns... minus 97 us, so bucket >= 21
WORKLOAD = f"""
import os, sys, time
sys.stdin.readline()
for _ in range({GETPIDS}):
    os.getpid()
for _ in range({SLEEPS}):
    time.sleep(0.002)
print("done", flush=True)
sys.stdin.readline()
"""


@contextmanager
def workload() -> Iterator[subprocess.Popen[str]]:
    """A process that, once told, calls getpid() and sleeps a known number of times."""
    with subprocess.Popen([sys.executable, "-c", WORKLOAD], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:  # closes the pipes
        try:
            yield proc
        finally:
            proc.kill()


def go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"


@pytest.mark.anyio
@asyncio_only
@pytest.mark.usefixtures("tracefs")
async def test_counts_and_latency_buckets_of_a_known_workload() -> None:
    assert DEFAULT_OBJECT.exists(), "make -C bpf"
    stats = SyscallStats()
    with workload() as proc:
        stop, ready = asyncio.Event(), asyncio.Event()
        watching = asyncio.ensure_future(watch(stats, pid=proc.pid, stop=stop, ready=ready))
        await asyncio.wait_for(ready.wait(), 10)
        await asyncio.to_thread(go, proc)
        stop.set()
        await asyncio.wait_for(watching, 10)
    assert stats.lost == 0
    # Every syscall of the loops, exactly, and only the workload's.
    assert stats.pair_calls[proc.pid, NR_GETPID] == GETPIDS
    assert stats.pair_calls[proc.pid, NR_CLOCK_NANOSLEEP] == SLEEPS
    assert set(stats.calls) == {proc.pid} and stats.comms[proc.pid].startswith("python")
    assert stats.samples == sum(stats.calls.values())
    # A 2 ms sleep lasts at least 2**21 - 97152 ns: bucket 21 ([2**20, 2**21)) or above.
    sleeps = stats.histogram[NR_CLOCK_NANOSLEEP]
    assert sleeps.sum() == SLEEPS and sleeps[:21].sum() == 0 and len(sleeps) == BUCKETS
    assert stats.percentile(NR_CLOCK_NANOSLEEP, 0.5) >= 2**21
    assert stats.histogram[NR_GETPID].sum() == GETPIDS
    assert stats.time_ns[NR_CLOCK_NANOSLEEP] >= SLEEPS * 2_000_000


@pytest.mark.usefixtures("tracefs")
def test_the_command_prints_the_workload_and_its_histogram() -> None:
    with workload() as proc, subprocess.Popen(
        [sys.executable, "-m", "examples.syscall_latency", "--pid", str(proc.pid),
         "--seconds", "2", "--interval", "10", "--syscall", "getpid"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    ) as cli:
        try:
            assert cli.stderr is not None
            assert "watching process" in cli.stderr.readline()  # attached
            go(proc)
            out, err = cli.communicate(timeout=30)
        finally:
            cli.kill()
    assert cli.returncode == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["PID", "COMM", "CALLS", "TOP", "SYSCALLS"]
    assert lines[1].split()[0] == str(proc.pid) and f"getpid {GETPIDS}" in lines[1]
    assert lines[2].startswith(f"getpid: {GETPIDS} calls")


def run_command(proc: subprocess.Popen[str], *extra: str,
                env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The command on the workload (getpid's histogram), for two seconds."""
    with subprocess.Popen(
        [sys.executable, "-m", "examples.syscall_latency", "--pid", str(proc.pid),
         "--seconds", "2", "--interval", "10", "--syscall", "getpid", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    ) as cli:
        before = ""
        try:
            assert cli.stderr is not None
            while "watching process" not in (line := cli.stderr.readline()):  # attached
                assert line, "the command ended before it attached"
                before += line
            go(proc)
            out, err = cli.communicate(timeout=30)
        finally:
            cli.kill()
    return cli.returncode, out, before + err


def png_text(data: bytes) -> dict[str, str]:
    """The PNG's tEXt chunks, after checking its signature and every chunk's CRC."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    texts, offset = {}, 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            texts[key.decode("latin-1")] = value.decode("latin-1")
        offset += 12 + length
    assert kind == b"IEND"
    return texts


@pytest.mark.usefixtures("tracefs")
def test_plot_writes_the_latency_histograms_as_a_png(tmp_path: Path) -> None:
    from matplotlib.image import imread

    picture = tmp_path / "latency.png"
    with workload() as proc:
        code, out, err = run_command(proc, "--plot", str(picture))
    assert code == 0, err
    assert out.splitlines()[2].startswith(f"getpid: {GETPIDS} calls")  # the text, as ever
    assert f"histograms written to {picture}" in err
    data = picture.read_bytes()
    description = png_text(data)["Description"]
    assert description.startswith(f"getpid: {GETPIDS} calls")  # the chosen syscall first
    assert f"clock_nanosleep: {SLEEPS} calls" in description  # then the busiest by time
    pixels = imread(picture)
    height, width = pixels.shape[:2]
    assert width >= 600 and height >= 400
    # Drawn, not blank: bars (the default blue, #1f77b4) and a good share of non-white.
    rgb = (pixels[..., :3] * 255).round().astype(int)
    blue = ((abs(rgb - [31, 119, 180]).sum(axis=-1)) < 10).mean()
    assert blue > 0.01
    assert (rgb.sum(axis=-1) < 700).mean() > 0.03


@pytest.mark.usefixtures("tracefs")
def test_without_matplotlib_the_text_still_prints(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"  # a matplotlib that cannot be imported, first on the path
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text("raise ImportError('hidden')\n")
    env = {**os.environ, "PYTHONPATH": str(hidden)}
    with workload() as proc:
        code, out, err = run_command(proc, env=env)  # no --plot: matplotlib is not needed
    assert code == 0, err
    assert out.splitlines()[2].startswith(f"getpid: {GETPIDS} calls")
    picture = tmp_path / "latency.png"
    with workload() as proc:
        code, out, err = run_command(proc, "--plot", str(picture), env=env)
    assert out.splitlines()[2].startswith(f"getpid: {GETPIDS} calls")  # the text still prints
    assert "--plot needs matplotlib, which is not installed: pip install 'aperf-bpf[plot]'" in err
    assert code == 1 and not picture.exists()
