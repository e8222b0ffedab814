"""What aperf loads, and where it reads perf event arrays from, per platform.

Each check runs in a fresh interpreter, all of aperf's modules imported, with
every ``ctypes.CDLL``/``WinDLL`` load recorded. "win32" is simulated: the
standard library and aperf's dependencies are imported first (as they would
be on Windows), then ``sys.platform`` says "win32" and the Linux-only APIs are
taken away (``select.epoll``, ``os.eventfd``, ``os.sched_*affinity``,
``fcntl``, ``termios``, ``resource``) before aperf is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.standin


REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    r"""
    import asyncio, ctypes, ctypes.util, importlib, json, logging, os, pkgutil, select, sys
    import structlog
    try:
        import trio  # noqa: F401  (imported before the platform changes, as on Windows)
    except ImportError:
        pass

    loads = []

    class SpyCDLL(ctypes.CDLL):
        def __init__(self, name, *args, **kwargs):
            loads.append(str(name))
            super().__init__(name, *args, **kwargs)

    def spy_windll(name, *args, **kwargs):
        loads.append(str(name))
        raise OSError(f"no {name} here")

    ctypes.CDLL = SpyCDLL
    ctypes.WinDLL = spy_windll
    platform = sys.argv[1]
    if platform == "win32":
        sys.platform = "win32"
        for module, names in (
            (select, ("epoll", "EPOLLIN")),
            (os, ("eventfd", "EFD_NONBLOCK", "EFD_CLOEXEC", "sched_setaffinity",
                  "sched_getaffinity")),
        ):
            for name in names:
                if hasattr(module, name):
                    delattr(module, name)
        for name in ("fcntl", "termios", "resource", "pwd", "grp"):
            sys.modules[name] = None

    import aperf
    modules = [m.name for m in pkgutil.walk_packages(aperf.__path__, "aperf.")]
    for name in modules:
        importlib.import_module(name)
    report = {"modules": modules, "at_import": list(loads)}

    from aperf._drivers.setup import resolve_source
    report["source_for_fd"] = type(resolve_source(7)).__name__
    stream = aperf.PerfStream(7)  # everything is checked here, nothing is loaded yet
    report["after_constructor"] = list(loads)

    async def open_stream():
        try:
            await stream.open()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "opened"

    report["open"] = asyncio.run(open_stream())
    try:
        # Any regular file (built objects need not exist): refused before it is read.
        aperf.BPFObject(aperf.__file__)
        report["bpfobject"] = "opened"
    except Exception as exc:
        report["bpfobject"] = f"{type(exc).__name__}: {exc}"
    report["loads"] = loads
    print(json.dumps(report))
    """
)


def run(platform: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("APERF_")}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, platform], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_on_windows_aperf_never_tries_libbpf() -> None:
    report = run("win32")
    assert "aperf._waiting.trio_win32" in report["modules"]  # type: ignore[operator]
    assert report["at_import"] == []  # importing aperf loads no library at all
    assert report["after_constructor"] == []
    assert report["source_for_fd"] == "WindowsMapSource"  # the map's type picks at open
    loads = report["loads"]
    assert loads and all("ebpfapi" in name for name in loads), loads  # type: ignore[union-attr]
    assert not any("libbpf" in name for name in loads)  # type: ignore[union-attr]
    assert str(report["open"]).startswith("LibbpfUnavailableError")
    assert "eBPF for Windows" in str(report["open"])
    assert str(report["bpfobject"]).startswith("LibbpfUnavailableError")
    assert "Linux only" in str(report["bpfobject"])


def test_on_linux_aperf_never_tries_the_dll() -> None:
    report = run("linux")
    assert report["at_import"] == []
    assert report["source_for_fd"] == "PerfEventArraySource"
    assert not any("ebpfapi" in name or "kernel32" in name
                   for name in report["loads"])  # type: ignore[union-attr]


def test_the_dll_is_refused_off_windows_without_a_stand_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aperf._native.ebpfapi import binding as c

    monkeypatch.delenv(c.EBPFAPI_ENV, raising=False)
    with pytest.raises(aperf_unavailable(), match="exists on Windows only"):
        c._load_ebpfapi()
    monkeypatch.delenv(c.KERNEL32_ENV, raising=False)
    with pytest.raises(aperf_unavailable(), match="Windows only"):
        c._load_kernel32()


def aperf_unavailable() -> type[Exception]:
    import aperf

    return aperf.LibbpfUnavailableError


def test_dependencies_install_on_windows() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    windows = {"sys_platform": "win32", "platform_system": "Windows", "os_name": "nt",
               "python_version": "3.12", "extra": ""}

    def wanted(spec: str) -> tuple[str, bool]:
        requirement = Requirement(spec)
        marker = requirement.marker
        return requirement.name, marker is None or marker.evaluate(windows)

    required = dict(map(wanted, project["dependencies"]))
    assert all(required.values()) and "uvloop" not in required
    extras = [wanted(spec) for specs in project["optional-dependencies"].values()
              for spec in specs]
    assert ("uvloop", False) in extras and ("uvloop", True) not in extras  # no Windows build


@pytest.mark.parametrize(("platform", "compiles"), [("linux", True), ("win32", False)])
def test_a_wheel_built_on_windows_compiles_no_bpf_object(
    platform: str, compiles: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO))
    from setuptools import Distribution
    from setuptools.command.build_py import build_py

    from bpf import build_hook

    compiled: list[Path] = []
    monkeypatch.setattr(build_py, "run", lambda self: None)
    monkeypatch.setattr(build_hook, "compile_objects", compiled.append)
    command = build_hook.BuildPy(Distribution({"name": "aperf"}))
    command.build_lib = str(tmp_path)
    command.editable_mode = False
    monkeypatch.setattr(sys, "platform", platform)
    command.run()
    assert compiled == ([tmp_path.resolve() / "aperf" / "_objects"] if compiles else [])
