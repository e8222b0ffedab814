"""Why the kernel may have refused a BPF call: this process's capabilities, read
from ``/proc/self/status``, and a hint naming what it lacks.

Diagnosis, not vocabulary: ``MissingPrivilegesError`` (``_errors.py``) carries
the capabilities and ends its message with the hint; ``aperf-trace``'s
preflight (``_tools/trace/preflight.py``) checks them before it loads anything.
"""

from __future__ import annotations

# Capability bits (linux/capability.h) that BPF tracing needs.
CAP_DAC_READ_SEARCH = 2
CAP_IPC_LOCK = 14
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39
_TRACEFS_PATHS = ("/sys/kernel/tracing", "/sys/kernel/debug/tracing")


def effective_capabilities() -> int | None:
    """The CapEff mask of this process (``/proc/self/status``), or None if it cannot tell."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _has(caps: int, bit: int) -> bool:
    return bool(caps >> bit & 1)


def privileges_hint(caps: int | None, context: str = "") -> str:
    """Why the kernel may have refused, given the effective capabilities ``caps``.

    ``context`` is what libbpf said: a refused read under tracefs names its
    path, and the fix is then access to tracefs, not more BPF capabilities.
    """
    tracefs = "attaching a tracepoint reads its id from tracefs (/sys/kernel/tracing)"
    if caps is None:
        return (
            f"BPF needs root, or CAP_BPF and CAP_PERFMON; {tracefs}, which takes root "
            "or CAP_DAC_READ_SEARCH"
        )
    lacking = [] if _has(caps, CAP_SYS_ADMIN) else [
        name for bit, name in ((CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"))
        if not _has(caps, bit)
    ]
    if lacking:
        missing = " and ".join(lacking)
        return f"BPF needs root, or CAP_BPF and CAP_PERFMON; this process lacks {missing}"
    if any(path in context for path in _TRACEFS_PATHS) and not _has(caps, CAP_DAC_READ_SEARCH):
        return (
            f"this process has the BPF capabilities, but {tracefs}, which it cannot read: "
            "run as root, or add CAP_DAC_READ_SEARCH"
        )
    if "mmap" in context and not _has(caps, CAP_IPC_LOCK):
        return (
            "the rings are over the memory an unprivileged process may lock for perf rings "
            "(kernel.perf_event_mlock_kb per CPU for each user, then RLIMIT_MEMLOCK): use "
            "smaller rings (pages=), raise 'ulimit -l', or add CAP_IPC_LOCK"
        )
    return (
        "this process has the BPF capabilities (CAP_BPF and CAP_PERFMON), so something else "
        "refused, e.g. a security module, kernel lockdown or a file's permissions; libbpf's "
        "log (.log, or APERF_LIBBPF_VERBOSE=1) names the call"
    )
