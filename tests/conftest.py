"""Test tiers and fixtures.

Kernel tests take the ``kernel`` fixture (or a fixture built on it). Where BPF
is unavailable they skip, unless ``APERF_REQUIRE_BPF=1`` (CI sets it), where
they fail instead. Every async test runs on every loop aperf supports: asyncio,
uvloop and trio, through anyio's pytest plugin (``pytest.mark.anyio`` and the
``anyio_backend`` fixture below). Tests still marked ``pytest.mark.asyncio``
(pytest-asyncio) run on asyncio and uvloop.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

REPO = Path(__file__).resolve().parent.parent
BPF_DIR = REPO / "bpf"
REQUIRE_BPF = os.environ.get("APERF_REQUIRE_BPF", "") not in ("", "0")


LOOPS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """Every ``pytest.mark.anyio`` test runs once per loop."""
    return request.param  # type: ignore[no-any-return]


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    try:
        import uvloop
    except ImportError:  # Windows: uvloop does not exist there
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``kernel`` every test that takes the kernel fixture, even through another
    fixture (producer, tracefs): ``-m "not kernel"`` then selects the tests that need
    no BPF (scripts/check.sh)."""
    for item in items:
        if "kernel" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernel)


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


@pytest.fixture
def kernel() -> None:
    require_kernel()


def mount_tracefs() -> None:
    if not os.path.exists("/sys/kernel/tracing/events"):
        subprocess.run(
            ["mount", "-t", "tracefs", "tracefs", "/sys/kernel/tracing"], check=False
        )


@pytest.fixture
def tracefs(kernel: None) -> None:
    mount_tracefs()
    if not os.path.exists("/sys/kernel/tracing/events"):
        pytest.fail("tracefs is not mounted and could not be mounted")


@pytest.fixture
def producer(kernel: None) -> Iterator[object]:
    from aperf.testing import Producer

    with Producer() as p:
        yield p


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def take(stream: Any, count: int) -> AsyncIterator[Any]:
    """The next ``count`` events of an open stream."""
    taken = 0
    async for event in stream:
        yield event
        taken += 1
        if taken == count:
            return


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


# --- CPU hotplug (tests/test_hotplug.py): never leave a CPU offline -------------------

CPU_SYSFS = Path("/sys/devices/system/cpu")
_online_at_start: list[str] = []


def bring_cpus_online(cpus: list[str]) -> None:
    """Write 1 to the ``online`` file of each of these CPUs that is offline now."""
    for cpu in cpus:
        path = CPU_SYSFS / cpu / "online"
        try:
            if path.read_text().strip() == "0":
                path.write_text("1")
        except OSError:
            pass


def pytest_sessionstart(session: pytest.Session) -> None:
    _online_at_start.extend(
        p.parent.name for p in CPU_SYSFS.glob("cpu[0-9]*/online")
        if p.read_text().strip() == "1"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Whatever a hotplug test did, every CPU online at the start is online again."""
    bring_cpus_online(_online_at_start)
