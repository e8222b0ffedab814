"""What tests share besides fixtures: the repository's paths, the loops, the kernel check,
small async helpers, and one fake clock. Fixtures and the test tiers are in conftest.py,
which uses these too."""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest

if TYPE_CHECKING:
    import aperf
    from aperf._reading.reader import Reader
    from aperf.testing import FakeRingSource

REPO = Path(__file__).resolve().parent.parent

# The loops async tests run on, through anyio's pytest plugin (``pytest.mark.anyio`` and
# conftest.py's ``anyio_backend`` fixture): a test of aperf's own code runs on all three.
LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]
asyncio_only = pytest.mark.parametrize("anyio_backend", LOOPS[:2])
"""With ``pytest.mark.anyio``: a test of asyncio-only code (nats-py, the service example,
asyncio's own primitives) runs on asyncio and uvloop, not trio."""
BPF_DIR = REPO / "bpf"
REQUIRE_BPF = os.environ.get("APERF_REQUIRE_BPF", "") not in ("", "0")


def _bpf_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "not root"
    try:
        from aperf.testing import Producer
    except Exception as exc:  # pragma: no cover - import problems are failures anyway
        return f"aperf.testing does not import: {exc}"
    try:
        with Producer():
            pass
    except Exception as exc:
        return f"cannot load the producer: {exc}"
    return None


_reason: list[str | None] = []


def require_kernel() -> None:
    """Skip (or fail under APERF_REQUIRE_BPF=1) when BPF programs cannot be loaded."""
    if not _reason:
        _reason.append(_bpf_unavailable_reason())
    reason = _reason[0]
    if reason is None:
        return
    if REQUIRE_BPF:
        pytest.fail(f"APERF_REQUIRE_BPF=1 but BPF is unavailable: {reason}", pytrace=False)
    pytest.skip(f"BPF unavailable: {reason}")


def open_fds() -> int:
    """The fds this process holds, garbage collected first: an earlier test's garbage
    that the collector happened to free between two counts would change them."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


async def take(stream: Any, count: int) -> AsyncIterator[Any]:
    """The next ``count`` events of an open stream."""
    taken = 0
    async for event in stream:
        yield event
        taken += 1
        if taken == count:
            return


async def until(condition: Callable[[], object], timeout: float = 20) -> None:
    """Wait until ``condition()`` is true: a state the test can observe (a statistics
    counter, a flag), looked at every few milliseconds. ``timeout`` only bounds a hang:
    reaching it fails the test (TimeoutError)."""
    with anyio.fail_after(timeout):
        while not condition():
            await anyio.sleep(0.005)


def check_busy(
    statistics: Callable[[], Any], since: float, clock: Callable[[], float], wakeup: Any
) -> None:
    """The drain period is ``wakeup.max_latency`` while samples flow (after open, or after
    a drain found samples): checked when ``statistics()`` comes less than ``idle_after``
    after ``since``, a ``clock()`` time (the reader's clock: the loop's, or
    ``time.monotonic`` for PerfBuffer) taken before that open or before the samples
    were written. A loaded machine can get there later, and the reader is then rightly
    idle: nothing is checked. The drain clock's rules are test_reader.py's, with a fake
    clock; this checks that a driver's reader follows them."""
    period = statistics().drain_period
    if clock() - since < wakeup.idle_after:
        assert period == wakeup.max_latency


async def past_the_first_look(stream: Any, *sources: Any) -> None:
    """Wait until an open stream of these fake ring sources has looked at each of their
    rings, as it does once its loop armed the ring's handle (the loop gets to that when
    it gets to it; the look takes what the ring holds). For a stream that no wakeup and
    no tick reads in the meantime: a sample written into each ring is then found by
    that look alone, and once they are all taken, every look is over."""
    rings = [(source, cpu) for source in sources for cpu in source.cpus]
    for source, cpu in rings:
        assert source.write(cpu, b"look")
    with anyio.fail_after(10):
        looked = [event async for event in take(stream, len(rings))]
    assert [event.data[:4] for event in looked] == [b"look"] * len(rings)


async def run_until(
    stream: Any, run: Callable[[], Awaitable[None]], done: anyio.Event,
    start: Callable[[], threading.Thread], timeout: float = 20,
) -> None:
    """Callback mode: ``run()`` (e.g. ``partial(stream.run, on_sample)``) until ``done`` is
    set, while the thread ``start()`` returns produces; then close the stream, which ends
    ``run()``."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        thread = start()
        with anyio.fail_after(timeout):
            await done.wait()
        await anyio.to_thread.run_sync(thread.join)
        await stream.aclose()


# --- the reader's unit tests: a fake clock, and a reader on it ---------------------------


class FakeClock:
    """A clock that moves only when the test moves it (trio's ``MockClock``, without its
    autojump): calling it reads ``now``; set ``now``, or ``jump(seconds)``."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def jump(self, seconds: float) -> None:
        self.now += seconds


def fake_reader(
    src: FakeRingSource, wakeup: aperf.Wakeup | None = None, *,
    ring_wakeup: aperf.Wakeup | None = None, **kwargs: Any,
) -> tuple[Reader, FakeClock]:
    """A ``Reader`` of ``src``, opened now (its rings with ``ring_wakeup``, default the
    reader's ``wakeup``, default ``Wakeup.per_sample()``), on a ``FakeClock``; ``kwargs``
    go to the reader."""
    import aperf
    from aperf._reading.reader import Reader
    from aperf._rings.seam import RingConfig

    wakeup = wakeup or aperf.Wakeup.per_sample()
    rings = src.open(RingConfig(None, ring_wakeup or wakeup))
    clock = FakeClock()
    return Reader(src, rings, wakeup=wakeup, clock=clock, **kwargs), clock


def hand_over_the_rest(buffer: Any) -> None:
    """A closed PerfBuffer: hand what its close took out of the rings to its callbacks
    (``consume()`` until it raises ClosedResourceError: none left)."""
    import aperf

    while True:
        try:
            buffer.consume()
        except aperf.ClosedResourceError:
            return


# --- CPU hotplug (tests/kernel/test_hotplug.py): never leave a CPU offline -------------

CPU_SYSFS = Path("/sys/devices/system/cpu")


def bring_cpus_online(cpus: list[str]) -> None:
    """Write 1 to the ``online`` file of each of these CPUs that is offline now."""
    for cpu in cpus:
        path = CPU_SYSFS / cpu / "online"
        try:
            if path.read_text().strip() == "0":
                path.write_text("1")
        except OSError:
            pass
