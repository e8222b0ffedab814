"""Test tiers and fixtures (for every folder below; helpers tests import are in helpers.py).

Kernel tests take the ``kernel`` fixture (or a fixture built on it). Where BPF
is unavailable they skip, unless ``APERF_REQUIRE_BPF=1`` (CI sets it), where
they fail instead. Every async test runs on every loop aperf supports: asyncio,
uvloop and trio, through anyio's pytest plugin (``pytest.mark.anyio`` and the
``anyio_backend`` fixture below); a test of asyncio-only code adds
``helpers.asyncio_only`` and runs on asyncio and uvloop.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from .helpers import CPU_SYSFS, LOOPS, bring_cpus_online, require_kernel

# Property tests are never timed: Hypothesis's default deadline (200 ms an example) and
# its too_slow health check fail an example that a loaded machine merely ran late.
settings.register_profile("aperf", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("aperf")


@pytest.fixture(params=LOOPS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """Every ``pytest.mark.anyio`` test runs once per loop."""
    return request.param  # type: ignore[no-any-return]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``kernel`` every test that takes the kernel fixture, even through another
    fixture (producer, tracefs): ``-m "not kernel"`` then selects the tests that need
    no BPF (scripts/check.sh)."""
    for item in items:
        if "kernel" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernel)


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


# --- CPU hotplug (tests/kernel/test_hotplug.py): never leave a CPU offline -------------

_online_at_start: list[str] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _online_at_start.extend(
        p.parent.name for p in CPU_SYSFS.glob("cpu[0-9]*/online")
        if p.read_text().strip() == "1"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Whatever a hotplug test did, every CPU online at the start is online again."""
    bring_cpus_online(_online_at_start)
