"""``aperf.closing_on_signals``: a real SIGINT or SIGTERM, sent with ``os.kill`` to a
program reading a kernel ring under asyncio, uvloop, trio and anyio (on both of its
backends), closes the stream; the program prints its final counts and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from ..helpers import REPO

PROGRAM = """
import signal
import sys

import aperf
from aperf.testing import Producer

N = 1000


async def main() -> None:
    seen = lost = 0
    with Producer() as producer:
        async with aperf.PerfStream(producer.map) as stream, \\
                aperf.closing_on_signals(stream) as stop:
            producer.emit(N, size=32, cpu=0)
            async for event in stream:  # ends only when the signal closes the stream
                if isinstance(event, aperf.Sample):
                    seen += 1
                else:
                    lost += event.count
                if seen + lost == N:
                    print("ready", flush=True)
        counters = producer.counters()
    print("final", seen, lost, counters.ok, counters.failed, stream.closed, stop.signal.name)


loop = sys.argv[1]
if loop == "asyncio":
    import asyncio
    asyncio.run(main())
elif loop == "uvloop":
    import uvloop
    uvloop.run(main())
elif loop == "trio":
    import trio
    trio.run(main)
else:
    import anyio
    anyio.run(main, backend=loop.removeprefix("anyio-"))
"""

LOOPS = ["asyncio", "uvloop", "trio", "anyio-asyncio", "anyio-trio"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_signal_closes_the_stream_and_the_program_exits_0(
    kernel: None, loop: str, sig: signal.Signals
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", PROGRAM, loop], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert child.stdout is not None
        ready = child.stdout.readline()
        assert ready == "ready\n", ready + child.communicate(timeout=30)[1]
        os.kill(child.pid, sig)
        out, err = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, err
    assert out.splitlines() == [f"final 1000 0 1000 0 True {sig.name}"], out + err
    assert "Traceback" not in err, err
