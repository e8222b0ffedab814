"""aperf's pytest plugin: fixtures of `aperf.testing` for your own tests.

Installed with aperf (the ``pytest11`` entry point ``aperf``), so pytest loads it by
itself; ``-p no:aperf`` turns it off. Every name it adds starts with ``aperf_``, so it
does not clash with a suite's own fixtures and markers (aperf's own has a ``kernel``
marker and ``kernel``/``producer`` fixtures of its own).

- ``aperf_fake_source``: a [`FakeRingSource`][aperf.testing.FakeRingSource] (CPUs 0 and
  1, 4096-byte rings), freed after the test; other arguments by indirect
  parametrization: ``@pytest.mark.parametrize("aperf_fake_source", [{"cpus": [0, 1, 2]}],
  indirect=True)``. No root needed.
- ``aperf_producer``: the kernel [`Producer`][aperf.testing.Producer] (``Producer()``, or
  the arguments of an indirect parametrization), closed after the test. A test that takes
  it is marked ``aperf_kernel``.
- ``aperf_replay``: a recording played back (``aperf.replay()``, docs/recording.md), of
  the directory given by indirect parametrization (relative to the test's file), or of
  ``replay()``'s arguments as a dict: ``@pytest.mark.parametrize("aperf_replay",
  ["recordings/run1"], indirect=True)``; ``PerfStream(aperf_replay,
  decoder=aperf_replay.decoder)`` reads it as the live stream was read. Freed after the test.
- ``@pytest.mark.aperf_kernel``: the test needs a kernel that loads BPF programs. Where
  this process cannot (not root, or without CAP_BPF and CAP_PERFMON; a kernel that
  refuses aperf's producer), the test is skipped, saying why; under
  ``APERF_REQUIRE_BPF=1`` (or the ini option ``aperf_require_bpf = true``, or
  ``--aperf-require-bpf``) it fails instead, so that CI cannot pass by skipping. The
  ``aperf_bpf`` fixture does the same for a fixture of your own.

docs/testing.md shows all of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from . import ReplaySource
    from .testing import FakeRingSource, Producer

__all__ = ["aperf_bpf", "aperf_fake_source", "aperf_producer", "aperf_replay"]

MARKER = "aperf_kernel"
REQUIRE_ENV = "APERF_REQUIRE_BPF"
INI_REQUIRE = "aperf_require_bpf"
_REASON = pytest.StashKey[list[str | None]]()  # the session's answer, computed once


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("aperf")
    group.addoption(
        "--aperf-require-bpf", action="store_true", default=None,
        help="fail (not skip) aperf_kernel tests where BPF is unavailable "
        f"(also {REQUIRE_ENV}=1 or the ini option {INI_REQUIRE})",
    )
    parser.addini(INI_REQUIRE, type="bool", default=False,
                  help="fail (not skip) aperf_kernel tests where BPF is unavailable")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: needs a kernel that loads BPF programs (root, or CAP_BPF and "
        f"CAP_PERFMON): skipped where it cannot, failing instead under {REQUIRE_ENV}=1",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that takes ``aperf_producer`` or ``aperf_bpf`` (even through another fixture)
    is marked ``aperf_kernel``: ``-m "not aperf_kernel"`` deselects it."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if ("aperf_producer" in names or "aperf_bpf" in names) and not item.get_closest_marker(
            MARKER
        ):
            item.add_marker(MARKER)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker(MARKER) is not None:
        require_bpf(item.config)


def bpf_required(config: pytest.Config) -> bool:
    """Whether a test that cannot have BPF fails rather than skips."""
    if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
        return True
    return bool(config.getoption("aperf_require_bpf") or config.getini(INI_REQUIRE))


def bpf_unavailable_reason() -> str | None:
    """Why this process cannot load BPF programs (None: it can): its capabilities first,
    then whether aperf's own producer loads."""
    from ._privileges import CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, effective_capabilities

    caps = effective_capabilities()
    if caps is not None and not (caps >> CAP_SYS_ADMIN & 1 or (
        caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1
    )):
        who = "root without capabilities" if os.geteuid() == 0 else f"uid {os.geteuid()}"
        return f"this process ({who}) lacks CAP_BPF and CAP_PERFMON: run the tests as root"
    try:
        from .testing import Producer

        with Producer():
            pass
    except Exception as exc:  # a kernel without BPF, a missing libbpf, a security module
        return f"aperf's producer does not load: {exc}"
    return None


def require_bpf(config: pytest.Config) -> None:
    """Skip the running test where BPF is unavailable, or fail it where it is required."""
    answer = config.stash.setdefault(_REASON, [])
    if not answer:
        answer.append(bpf_unavailable_reason())
    reason = answer[0]
    if reason is None:
        return
    if bpf_required(config):
        pytest.fail(f"{REQUIRE_ENV}=1 but BPF is unavailable: {reason}", pytrace=False)
    pytest.skip(f"BPF unavailable: {reason}")


@pytest.fixture
def aperf_bpf(request: pytest.FixtureRequest) -> None:
    """Nothing, once this process can load BPF programs (skips or fails otherwise)."""
    require_bpf(request.config)


@pytest.fixture
def aperf_fake_source(request: pytest.FixtureRequest) -> Iterator[FakeRingSource]:
    """A ``FakeRingSource`` (CPUs 0 and 1, 4096-byte rings, or ``request.param``'s
    arguments), freed after the test."""
    from .testing import FakeRingSource

    kwargs = dict(getattr(request, "param", None) or {"cpus": [0, 1]})
    source = FakeRingSource(**kwargs)
    try:
        yield source
    finally:
        source.free()


@pytest.fixture
def aperf_producer(request: pytest.FixtureRequest, aperf_bpf: None) -> Iterator[Producer]:
    """The kernel ``Producer`` (``Producer()``, or ``request.param``'s arguments), closed
    after the test; skips (or fails) where BPF is unavailable."""
    from .testing import Producer

    with Producer(**dict(getattr(request, "param", None) or {})) as producer:
        yield producer


@pytest.fixture
def aperf_replay(request: pytest.FixtureRequest) -> Iterator[ReplaySource]:
    """A recording played back (``aperf.replay()``): the recording's directory (relative
    to the test's file), or a dict of ``replay()``'s arguments (``path``, ``speed``,
    ``map``), by indirect parametrization; freed after the test. No root needed."""
    from . import replay

    param = getattr(request, "param", None)
    if param is None:
        pytest.fail(
            "aperf_replay plays a recording: name it with @pytest.mark.parametrize("
            '"aperf_replay", ["path/to/recording"], indirect=True)', pytrace=False,
        )
    kwargs = dict(param) if isinstance(param, Mapping) else {"path": param}
    path = Path(kwargs["path"])
    if not path.is_absolute() and (request.path.parent / path).exists():
        kwargs["path"] = request.path.parent / path
    source = replay(**kwargs)
    try:
        yield source
    finally:
        source.free()
