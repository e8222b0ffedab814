"""Without root, with some of the capabilities: the errors say what is missing, for real.

Each case runs a child as ``nobody`` through ``setpriv`` with a chosen set of
capabilities (docs/privileges.md), against the real kernel and tracefs (mode
0700 here, as on most systems).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXACT = ["bpf", "perfmon", "dac_read_search"]  # what docs/privileges.md grants


def as_nobody(caps: list[str], *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to drop privileges")
    grant = ",".join(f"+{c}" for c in caps)
    wrapper = [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    if caps:
        wrapper += [f"--inh-caps=-all,{grant}", f"--ambient-caps={grant}",
                    f"--bounding-set=-all,{grant}"]
    else:
        wrapper += ["--inh-caps=-all", "--bounding-set=-all"]
    return subprocess.run([*wrapper, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.fixture
def tracefs_private(tracefs: None) -> None:
    mode = os.stat("/sys/kernel/tracing").st_mode & 0o777
    if mode & 0o005:
        pytest.fail(f"these tests expect tracefs readable by root only; it is {mode:o}")


ATTACH = """
    import aperf
    with aperf.BPFObject("bpf/minimal.bpf.o") as obj:
        obj.load()
        print("loaded", flush=True)
        try:
            obj.attach()
        except aperf.MissingPrivilegesError as exc:
            print(exc)
        else:
            print("attached")
"""


def test_bpf_and_perfmon_load_but_tracefs_is_blamed_for_the_attach(
    tracefs_private: None,
) -> None:
    proc = as_nobody(["bpf", "perfmon"], *python(ATTACH))
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[0] == "loaded", proc.stderr
    assert "[EACCES]" in lines[1]
    assert "tracefs" in lines[1] and "add CAP_DAC_READ_SEARCH" in lines[1], lines[1]
    assert "lacks" not in lines[1]  # the capabilities it holds are not blamed


def test_the_exact_capabilities_attach(tracefs_private: None) -> None:
    proc = as_nobody(EXACT, *python(ATTACH))
    assert proc.stdout.splitlines() == ["loaded", "attached"], proc.stdout + proc.stderr


def test_without_capabilities_the_load_names_them(tracefs: None) -> None:
    proc = as_nobody([], *python("""
        import aperf
        with aperf.BPFObject("bpf/minimal.bpf.o") as obj:
            try:
                obj.load()
            except aperf.MissingPrivilegesError as exc:
                print(exc.hint)
    """))
    assert proc.stdout.strip().endswith("this process lacks CAP_BPF and CAP_PERFMON"), (
        proc.stdout + proc.stderr
    )


def test_the_tracer_says_tracefs_in_one_line(tracefs_private: None) -> None:
    proc = as_nobody(["bpf", "perfmon"], sys.executable, "-m", "aperf", "trace")
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr  # one sentence, no traceback
    assert lines[0].startswith("aperf-trace: cannot read tracefs at /sys/kernel/tracing")
    assert "CAP_DAC_READ_SEARCH" in lines[0]


def test_ring_memory_past_the_lock_limit_says_how_to_fit(kernel: None) -> None:
    # Unprivileged, a user may lock perf_event_mlock_kb per CPU, then RLIMIT_MEMLOCK:
    # rings of 8192 pages (32 MiB per CPU) go past both on any default machine.
    proc = as_nobody(EXACT, *python("""
        import asyncio
        import aperf

        async def main():
            with aperf.BPFObject("bpf/minimal.bpf.o") as obj:
                obj.load()
                try:
                    async with aperf.PerfStream(obj.maps["events"], pages=8192):
                        print("opened")
                except aperf.MissingPrivilegesError as exc:
                    print(exc)

        asyncio.run(main())
    """))
    out = proc.stdout.strip()
    assert "failed to mmap perf buffer" in out, out + proc.stderr
    assert "perf_event_mlock_kb" in out and "CAP_IPC_LOCK" in out, out
    # ... and CAP_IPC_LOCK lifts the limit, as the message says.
    lifted = as_nobody([*EXACT, "ipc_lock"], *python("""
        import asyncio
        import aperf

        async def main():
            with aperf.BPFObject("bpf/minimal.bpf.o") as obj:
                obj.load()
                async with aperf.PerfStream(obj.maps["events"], pages=8192):
                    print("opened")

        asyncio.run(main())
    """))
    assert lifted.stdout.strip() == "opened", lifted.stdout + lifted.stderr
