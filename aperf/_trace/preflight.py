"""What the tracer checks before it opens anything: privileges, and tracefs mounted."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from .._log import log

TRACEFS = Path("/sys/kernel/tracing")
# libbpf reads tracepoint ids under debugfs when it is mounted, else under tracefs.
TRACING_DIRS = (Path("/sys/kernel/debug/tracing"), TRACEFS)

# Capability bits (linux/capability.h).
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


class SetupError(Exception):
    """Something the tracer needs is missing. The message says what; it is printed as one line."""


def effective_capabilities() -> int | None:
    """The CapEff bit mask of this process, or None if /proc cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def missing_privileges() -> str | None:
    """Why this process cannot load and attach the tracer, or None if it can.

    Loading tracing programs needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN,
    which root has). Checked before anything is opened, so that the usual
    mistake (forgetting sudo) gets a plain sentence, not an errno.
    """
    caps = effective_capabilities()
    if caps is None:
        if os.geteuid() == 0:
            return None
    elif caps >> CAP_SYS_ADMIN & 1 or (caps >> CAP_BPF & 1 and caps >> CAP_PERFMON & 1):
        return None
    euid = os.geteuid()
    who = "root without capabilities" if euid == 0 else f"uid {euid}"
    return (
        "loading BPF programs needs root (CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN), "
        f"and this process runs as {who}; run it with sudo"
    )


def ensure_tracefs() -> None:
    """Mount tracefs at /sys/kernel/tracing if no tracing directory is there.

    libbpf attaches ``tp/...`` programs by reading the tracepoint's id from
    ``<tracefs>/events/<category>/<name>/id``; minimal systems (containers, VMs
    booted without systemd) often have tracefs unmounted.
    """
    if any((d / "events").is_dir() for d in TRACING_DIRS):
        return
    try:
        result = subprocess.run(
            ["mount", "-t", "tracefs", "tracefs", str(TRACEFS)],
            capture_output=True, text=True, check=False,
        )
    except OSError as exc:
        raise SetupError(f"tracefs is not mounted and running mount failed: {exc}") from None
    if result.returncode != 0 or not (TRACEFS / "events").is_dir():
        why = result.stderr.strip() or f"mount exited with status {result.returncode}"
        raise SetupError(
            f"tracefs is not mounted at {TRACEFS} and mounting it failed ({why}); "
            f"mount it with: mount -t tracefs tracefs {TRACEFS}"
        )
    log.info("mounted tracefs", path=str(TRACEFS))
