"""``python -m aperf doctor`` and ``aperf-trace --doctor`` on this machine: as root
everything is there (exit status 0); as an unprivileged user the capabilities are
missing, the advice says what to do, and the exit status is 1. Both as text and as JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

import pytest

from ..helpers import REPO

# Every item issue 33 asks the doctor to report on.
CHECKS = {"kernel", "btf", "libbpf", "perf_event_array", "ringbuf", "user_ringbuf",
          "capabilities", "perf_event_paranoid", "unprivileged_bpf_disabled", "tracefs",
          "bpffs", "memlock", "lock_dir"}
COMMANDS = {
    "doctor": [sys.executable, "-m", "aperf", "doctor"],
    "tracer": [sys.executable, "-m", "aperf", "trace", "--doctor"],
}
# nobody, able to read the interpreter under /root (CAP_DAC_READ_SEARCH grants nothing
# BPF needs: tests/kernel/test_tracer.py explains); and root holding no capabilities.
UNPRIVILEGED = {
    "nobody": ["--reuid=65534", "--regid=65534", "--clear-groups",
               "--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search",
               "--bounding-set=-all,+dac_read_search"],
    "root-without-caps": ["--inh-caps=-all", "--bounding-set=-all"],
}


def run(command: list[str], *extra: str, wrapper: list[str] | None = None) -> Any:
    return subprocess.run([*(wrapper or []), *command, *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_as_root_every_required_check_passes(kernel: None, command: str) -> None:
    text = run(COMMANDS[command])
    assert text.returncode == 0, text.stdout + text.stderr
    assert text.stdout.rstrip().endswith("every required check passed")
    assert "FAIL" not in text.stdout and text.stderr == ""
    as_json = run(COMMANDS[command], "--json")
    assert as_json.returncode == 0
    report = json.loads(as_json.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == CHECKS and report["ok"] is True and report["uid"] == 0
    # This kernel (6.18, BTF) has every map type; root has every capability.
    for name in ("btf", "perf_event_array", "ringbuf", "user_ringbuf", "capabilities",
                 "libbpf", "lock_dir", "tracefs", "bpffs", "memlock"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["tracefs"]["required"] is (command == "tracer")
    assert checks["libbpf"]["found"].startswith("1.")


@pytest.mark.parametrize("who", sorted(UNPRIVILEGED))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_without_capabilities_it_says_what_to_do_and_fails(
    kernel: None, command: str, who: str
) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to drop privileges")
    wrapper = [setpriv, *UNPRIVILEGED[who]]
    text = run(COMMANDS[command], wrapper=wrapper)
    assert text.returncode == 1, text.stdout + text.stderr
    lines = text.stdout.splitlines()
    assert any(line.startswith("  FAIL  capabilities") for line in lines), text.stdout
    assert "fix: run as root, or with CAP_BPF and CAP_PERFMON" in text.stdout
    assert lines[-1] == "1 required check(s) failed: capabilities"
    report = json.loads(run(COMMANDS[command], "--json", wrapper=wrapper).stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False and set(checks) == CHECKS
    assert checks["capabilities"]["status"] == "fail"
    assert "lacks CAP_BPF and CAP_PERFMON" in checks["capabilities"]["found"]
    for probe in ("perf_event_array", "ringbuf", "user_ringbuf"):  # EPERM: cannot tell
        assert checks[probe]["status"] == "skip", checks[probe]
    assert checks["perf_event_paranoid"]["status"] == "warn"
    assert checks["lock_dir"]["status"] == "ok", checks["lock_dir"]
    expected_dir = "/dev/shm/aperf-65534" if who == "nobody" else "/run/aperf"
    assert checks["lock_dir"]["found"].startswith(expected_dir)
