"""What the tracer checks before it opens anything: privileges, and tracefs mounted."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from ..._log import log
from ..._privileges import CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, effective_capabilities

TRACEFS = Path("/sys/kernel/tracing")
# libbpf reads tracepoint ids under debugfs when it is mounted, else under tracefs.
TRACING_DIRS = (Path("/sys/kernel/debug/tracing"), TRACEFS)


class SetupError(Exception):
    """Something the tracer needs is missing. The message says what; it is printed as one line."""


class OptionError(SetupError):
    """An option is wrong (``--shards`` more than the CPUs, ``--nats`` credentials the server
    refused): one line, and exit status 2 as for any bad option."""


CAPABILITIES = "CAP_BPF, CAP_PERFMON and CAP_DAC_READ_SEARCH"  # docs/privileges.md


def missing_privileges() -> str | None:
    """Why this process cannot load and attach the tracer, or None if it can.

    Loading tracing programs needs CAP_BPF and CAP_PERFMON (or CAP_SYS_ADMIN,
    which root has); tracefs access is checked by ``ensure_tracefs()``. Checked
    before anything is opened, so that the usual mistake (not being root) gets a
    plain sentence, not an errno.
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
        f"and this process runs as {who}; run it as root, or with {CAPABILITIES}"
    )


def tracefs_unreadable(path: Path) -> str:
    """The sentence for a tracefs that this process may not read."""
    try:
        mode = f" (mode {path.stat().st_mode & 0o7777:04o})"
    except OSError:
        mode = ""
    return (
        f"cannot read tracefs at {path}{mode}: attaching the tracepoints "
        f"reads their ids there; run as root, or with {CAPABILITIES}"
    )


def ensure_tracefs() -> None:
    """Mount tracefs at /sys/kernel/tracing if no tracing directory is there.

    libbpf attaches ``tp/...`` programs by reading the tracepoint's id from
    ``<tracefs>/events/<category>/<name>/id``; minimal systems (containers, VMs
    booted without systemd) often have tracefs unmounted.
    """
    unreadable = None
    for directory in TRACING_DIRS:
        try:  # os.stat, not Path.is_dir(), which hides EACCES in newer Pythons
            if stat.S_ISDIR(os.stat(directory / "events").st_mode):
                return
        except PermissionError:  # there, but 0700 and this process is not root
            unreadable = directory
        except OSError:
            pass
    if unreadable is not None:
        raise SetupError(tracefs_unreadable(unreadable))
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
