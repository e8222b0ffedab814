"""``python -m aperf doctor`` (and ``aperf-trace --doctor``): what this machine and this
process have of what aperf needs, one check per line, each failure with what to do.

Nothing is changed: the checks read ``/proc`` and ``/sys``, create (and close at once)
one tiny map of each type the kernel is asked about, and look at the lock directory
without making it. Exit status: 0 when every required check passed, 1 when one did not,
2 for bad options. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import platform
import stat
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .._errors import AperfError, LibbpfError, LibbpfUnavailableError
from .._options import DEFAULT_PAGES
from .._privileges import (
    CAP_BPF,
    CAP_DAC_READ_SEARCH,
    CAP_IPC_LOCK,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    effective_capabilities,
)
from .._rings.map_lock import LOCK_DIR_ENV, LockDir, lock_dir
from .._rings.perf.source import online_cpus

Status = Literal["ok", "fail", "warn", "skip"]
"""``ok``; ``fail``: missing and required (exit status 1) or, if not required, missing;
``warn``: works, with a limit worth knowing; ``skip``: could not be checked (says why)."""

PRIVILEGES_DOC = "docs/privileges.md"
BTF_PATH = Path("/sys/kernel/btf/vmlinux")
TRACING_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
BPFFS = Path("/sys/fs/bpf")
PAGE = 4096
# (map type, its name, key size, value size, max_entries): the smallest map the kernel takes.
PERF_EVENT_ARRAY = (4, "BPF_MAP_TYPE_PERF_EVENT_ARRAY", 4, 4, 1)
RINGBUF = (27, "BPF_MAP_TYPE_RINGBUF", 0, 0, PAGE)
USER_RINGBUF = (31, "BPF_MAP_TYPE_USER_RINGBUF", 0, 0, PAGE)


@dataclass(frozen=True)
class Check:
    """One check: ``found`` says what is there, ``fix`` what to do when it is not ok."""

    name: str  # a stable identifier, for --json
    title: str
    status: Status
    required: bool
    found: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        """A required check that did not pass: the exit status is then 1."""
        return self.required and self.status == "fail"


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _has(caps: int | None, bit: int) -> bool:
    return caps is not None and bool(caps >> bit & 1)


def _can_bpf(caps: int | None) -> bool:
    return _has(caps, CAP_SYS_ADMIN) or (_has(caps, CAP_BPF) and _has(caps, CAP_PERFMON))


def kernel_version(release: str) -> tuple[int, int]:
    """(major, minor) of a release string such as ``6.18.0-1-amd64`` ((0, 0) if unknown)."""
    parts = release.split(".", 2)
    try:
        return int(parts[0]), int("".join(c for c in parts[1][:3] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return 0, 0


# --- the checks --------------------------------------------------------------------------


def check_kernel() -> Check:
    uname = platform.uname()
    if uname.system != "Linux":
        return Check("kernel", "kernel", "fail", True, f"{uname.system} {uname.release}",
                     "aperf.BPFObject and the Linux rings need Linux; on Windows, eBPF for "
                     "Windows (docs/windows.md)")
    found = f"Linux {uname.release} ({uname.machine})"
    version = kernel_version(uname.release)
    missing = [what for need, what in (
        ((5, 8), "BPF ring buffers (5.8)"),
        ((6, 0), "exact perf loss counts, PERF_FORMAT_LOST (6.0)"),
        ((6, 1), "user ring buffers (6.1)"),
    ) if version < need]
    if missing:
        return Check("kernel", "kernel", "warn", False, f"{found}: older than {missing[0]}",
                     "these need a newer kernel: " + ", ".join(missing))
    return Check("kernel", "kernel", "ok", False, found)


def check_btf(path: Path = BTF_PATH) -> Check:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            f.read(1)
    except PermissionError:
        return Check("btf", "kernel BTF", "fail", True, f"{path} is not readable",
                     "CO-RE programs (aperf's own, libbpf-bootstrap's) load with the kernel's "
                     "BTF: make it readable (it is 0444 on most distributions)")
    except OSError:
        return Check("btf", "kernel BTF", "fail", True, f"no {path}",
                     "CO-RE programs load with the kernel's BTF: boot a kernel built with "
                     "CONFIG_DEBUG_INFO_BTF=y (most distributions' since 2020)")
    return Check("btf", "kernel BTF", "ok", True, f"{path} ({size / 2**20:.1f} MiB)")


def _create_map(map_type: int, name: str, key_size: int, value_size: int,
                max_entries: int) -> int:
    from .._native.libbpf import create_map

    return create_map(map_type, name, key_size, value_size, max_entries)


def check_map_type(
    name: str, title: str, spec: tuple[int, str, int, int, int], required: bool, since: str,
    create: Callable[[int, str, int, int, int], int] | None = None,
) -> Check:
    """Whether the kernel creates a map of this type: one is made, then closed at once."""
    map_type, type_name, key_size, value_size, max_entries = spec
    try:
        fd = (create or _create_map)(map_type, "aperf_doctor", key_size, value_size, max_entries)
    except LibbpfUnavailableError:
        return Check(name, title, "skip", required, "not probed: libbpf is not available",
                     "see the libbpf check")
    except LibbpfError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            return Check(name, title, "skip", required,
                         f"not probed: this process may not create BPF maps ({exc.strerror})",
                         "see the capabilities check")
        if exc.errno == errno.ENOSYS:
            return Check(name, title, "fail", required, "the kernel has no bpf() system call",
                         "boot a kernel built with CONFIG_BPF_SYSCALL=y")
        return Check(name, title, "fail", required,
                     f"the kernel refused a {type_name} ({exc.strerror})",
                     f"{type_name} needs Linux {since} or later")
    os.close(fd)
    return Check(name, title, "ok", required, f"the kernel creates a {type_name}")


def check_capabilities(caps: int | None) -> Check:
    title = "capabilities"
    if caps is None:
        return Check("capabilities", title, "skip", True,
                     "cannot read CapEff in /proc/self/status", f"see {PRIVILEGES_DOC}")
    names = [name for bit, name in (
        (CAP_SYS_ADMIN, "CAP_SYS_ADMIN"), (CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"),
        (CAP_DAC_READ_SEARCH, "CAP_DAC_READ_SEARCH"), (CAP_IPC_LOCK, "CAP_IPC_LOCK"),
    ) if _has(caps, bit)]
    found = f"CapEff {caps:#x}: " + (", ".join(names) if names else "none that BPF uses")
    if _can_bpf(caps):
        if not (_has(caps, CAP_SYS_ADMIN) or _has(caps, CAP_DAC_READ_SEARCH)):
            return Check("capabilities", title, "warn", True, found,
                         "attaching tracepoints reads tracefs (mode 0700): add "
                         f"CAP_DAC_READ_SEARCH to attach SEC(\"tp/...\") programs "
                         f"({PRIVILEGES_DOC})")
        return Check("capabilities", title, "ok", True, found)
    lacking = " and ".join(n for b, n in ((CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON"))
                           if not _has(caps, b))
    return Check("capabilities", title, "fail", True, f"{found}; lacks {lacking}",
                 "run as root, or with CAP_BPF and CAP_PERFMON (and CAP_DAC_READ_SEARCH to "
                 "attach tracepoints), e.g. setpriv --ambient-caps or systemd's "
                 f"AmbientCapabilities= ({PRIVILEGES_DOC})")


def check_sysctl_paranoid(caps: int | None, path: str = "/proc/sys/kernel/perf_event_paranoid",
                          ) -> Check:
    title = "perf_event_paranoid"
    value = _read(path)
    if value is None:
        return Check("perf_event_paranoid", title, "skip", False, f"cannot read {path}")
    if _has(caps, CAP_PERFMON) or _has(caps, CAP_SYS_ADMIN):
        return Check("perf_event_paranoid", title, "ok", False,
                     f"{value}; does not apply to this process (it has CAP_PERFMON or "
                     "CAP_SYS_ADMIN)")
    if value.lstrip("-").isdigit() and int(value) <= -1:
        return Check("perf_event_paranoid", title, "ok", False, f"{value}: perf events for all")
    return Check("perf_event_paranoid", title, "warn", False,
                 f"{value}: without CAP_PERFMON this process may not open the per-CPU perf "
                 "events behind every ring",
                 "give the process CAP_PERFMON (better than lowering the sysctl for everyone: "
                 f"{PRIVILEGES_DOC})")


def check_sysctl_unprivileged_bpf(
    caps: int | None, path: str = "/proc/sys/kernel/unprivileged_bpf_disabled",
) -> Check:
    title = "unprivileged_bpf_disabled"
    value = _read(path)
    if value is None:
        return Check("unprivileged_bpf_disabled", title, "skip", False, f"cannot read {path}")
    meaning = {"0": "unprivileged users may call bpf()",
               "1": "bpf() needs CAP_BPF (until reboot)",
               "2": "bpf() needs CAP_BPF (root may set 0)"}.get(value, "bpf() needs CAP_BPF")
    if _has(caps, CAP_BPF) or _has(caps, CAP_SYS_ADMIN) or value == "0":
        return Check("unprivileged_bpf_disabled", title, "ok", False, f"{value}: {meaning}")
    return Check("unprivileged_bpf_disabled", title, "warn", False, f"{value}: {meaning}",
                 "give the process CAP_BPF (tracing programs need CAP_BPF and CAP_PERFMON "
                 f"whatever this says: {PRIVILEGES_DOC})")


def mounts(path: str = "/proc/self/mountinfo") -> dict[str, str]:
    """Mount point -> file system type, from mountinfo."""
    found: dict[str, str] = {}
    for line in (_read(path) or "").splitlines():
        fields = line.split(" ")
        if " - " in line and len(fields) > 4:
            after = line.split(" - ", 1)[1].split(" ")
            found[fields[4]] = after[0]
    return found


def check_tracefs(caps: int | None, required: bool,
                  dirs: Sequence[Path] = TRACING_DIRS) -> Check:
    title = "tracefs"
    unreadable = None
    for directory in dirs:
        try:
            if stat.S_ISDIR(os.stat(directory / "events").st_mode):
                return Check("tracefs", title, "ok", required, f"mounted at {directory}")
        except PermissionError:
            unreadable = directory
        except OSError:
            pass
    if unreadable is not None:
        return Check("tracefs", title, "fail", required,
                     f"{unreadable} is there but this process may not read it",
                     "attaching SEC(\"tp/...\") programs reads tracepoint ids there: run as "
                     f"root, or add CAP_DAC_READ_SEARCH ({PRIVILEGES_DOC})")
    fix = f"mount -t tracefs tracefs {dirs[0]}"
    if _has(caps, CAP_SYS_ADMIN):
        return Check("tracefs", title, "warn", required,
                     f"not mounted; aperf-trace mounts it at {dirs[0]} itself", fix)
    return Check("tracefs", title, "fail", required, "not mounted",
                 f"attaching SEC(\"tp/...\") programs needs it: {fix} (as root)")


def check_bpffs(mounted: dict[str, str], where: Path = BPFFS) -> Check:
    title = "BPF file system"
    points = sorted(point for point, kind in mounted.items() if kind == "bpf")
    if str(where) in points:
        return Check("bpffs", title, "ok", False, f"mounted at {where}")
    found = f"mounted at {', '.join(points)}, not at {where}" if points else "not mounted"
    return Check("bpffs", title, "warn", False, found,
                 f"pinning maps (aperf-trace --shards, readers in other processes) needs it: "
                 f"mount -t bpf bpf {where}")


def check_memlock(caps: int | None, cpus: int,
                  mlock_kb_path: str = "/proc/sys/kernel/perf_event_mlock_kb") -> Check:
    title = "locked memory"
    try:
        import resource  # not on Windows
    except ImportError:
        return Check("memlock", title, "skip", False, "no RLIMIT_MEMLOCK on this platform")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def shown(limit: int) -> str:
        return "unlimited" if limit == resource.RLIM_INFINITY else f"{limit // 1024} KiB"

    found = f"RLIMIT_MEMLOCK {shown(soft)} (hard {shown(hard)})"
    if _has(caps, CAP_IPC_LOCK):
        return Check("memlock", title, "ok", False, f"{found}; no limit: CAP_IPC_LOCK")
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", title, "ok", False, found)
    mlock_kb = _read(mlock_kb_path)
    per_user_kib = int(mlock_kb) * cpus if mlock_kb and mlock_kb.isdigit() else 0
    stream_kib = (DEFAULT_PAGES + 1) * PAGE // 1024 * cpus  # rings and control pages
    streams = (per_user_kib + soft // 1024) // stream_kib if stream_kib else 0
    found += (f"; perf_event_mlock_kb {mlock_kb or '?'} per CPU: room for {streams} "
              f"stream(s) of default rings on {cpus} CPU(s)")
    fix = ("raise 'ulimit -l' (LimitMEMLOCK= in a systemd unit), add CAP_IPC_LOCK, or use "
           f"smaller rings (pages=) ({PRIVILEGES_DOC})")
    return Check("memlock", title, "ok" if streams >= 2 else "warn", False, found,
                 "" if streams >= 2 else fix)


def _libbpf_file() -> str | None:
    """The libbpf this process mapped (from /proc/self/maps), once it is loaded."""
    for line in (_read("/proc/self/maps") or "").splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if "/libbpf" in path:
            return path
    return None


def check_libbpf() -> Check:
    try:
        from .._native.libbpf import libbpf_version

        major, minor = libbpf_version()
    except AperfError as exc:  # LibbpfUnavailableError: says what to install
        return Check("libbpf", "libbpf", "fail", True, str(exc).split(";", 1)[0],
                     "apt-get install libbpf1 (Debian 12, Ubuntu 22.10 and later), or point "
                     "APERF_LIBBPF at a libbpf.so.1 of version 1.0 or later")
    where = _libbpf_file()
    found = f"{major}.{minor}" + (f" ({where})" if where else "")
    return Check("libbpf", "libbpf", "ok", True, found)


def check_lock_dir() -> Check:
    """The map lock directory (aperf/_rings/map_lock.py): usable as it is, or makeable."""
    title = "map lock directory"
    path = lock_dir()
    explicit = bool(os.environ.get(LOCK_DIR_ENV))
    try:
        os.lstat(path)
    except FileNotFoundError:
        if explicit:
            return Check("lock_dir", title, "fail", True, f"{LOCK_DIR_ENV}={path} does not exist",
                         f"make it (owned by root or this user, not writable by others), or "
                         f"unset {LOCK_DIR_ENV}")
        parent = os.path.dirname(path)
        if os.access(parent, os.W_OK | os.X_OK):
            return Check("lock_dir", title, "ok", True,
                         f"{path}: not there yet; made mode 0700 at the first map read")
        return Check("lock_dir", title, "fail", True,
                     f"{path}: not there, and this process may not make it in {parent}",
                     f"set {LOCK_DIR_ENV} to a directory owned by this user that no other "
                     "user can write (docs/rings.md)")
    except OSError as exc:
        return Check("lock_dir", title, "fail", True, f"{path}: {exc.strerror}",
                     f"set {LOCK_DIR_ENV} to a directory of this user's (docs/rings.md)")
    try:
        directory = LockDir()
    except OSError as exc:
        reason, _, fix = str(exc.strerror or exc).partition("; ")
        return Check("lock_dir", title, "fail", True, reason, fix)
    try:
        info = os.fstat(directory.fd)
    finally:
        directory.close()
    mode = stat.S_IMODE(info.st_mode)
    shared = f", shared with group {info.st_gid}" if directory.shared else ""
    return Check("lock_dir", title, "ok", True,
                 f"{path}: owned by uid {info.st_uid}, mode {mode:04o}{shared}")


def run_checks(*, tracer: bool = False) -> list[Check]:
    """Every check, in the order shown. ``tracer``: tracefs is required (aperf-trace)."""
    caps = effective_capabilities()
    cpus = len(online_cpus()) or 1  # the kernel's perf memory limit counts online CPUs
    return [
        check_kernel(),
        check_btf(),
        check_libbpf(),
        check_map_type("perf_event_array", "perf event arrays", PERF_EVENT_ARRAY, True, "4.4"),
        check_map_type("ringbuf", "BPF ring buffers", RINGBUF, False, "5.8"),
        check_map_type("user_ringbuf", "user ring buffers", USER_RINGBUF, False, "6.1"),
        check_capabilities(caps),
        check_sysctl_paranoid(caps),
        check_sysctl_unprivileged_bpf(caps),
        check_tracefs(caps, required=tracer),
        check_bpffs(mounts()),
        check_memlock(caps, cpus),
        check_lock_dir(),
    ]


# --- the command ---------------------------------------------------------------------------


def report(checks: Sequence[Check]) -> dict[str, object]:
    """What ``--json`` prints."""
    from .. import __version__

    return {
        "ok": not any(c.failed for c in checks),
        "aperf": __version__,
        "python": platform.python_version(),
        "uid": os.geteuid(),
        "checks": [dataclasses.asdict(c) for c in checks],
    }


MARKS = {"ok": "ok", "fail": "FAIL", "warn": "warn", "skip": "skip"}


def text(checks: Sequence[Check], prog: str) -> str:
    """The human-readable report: a line per check, ``fix:`` under those not ok."""
    from .. import __version__

    width = max(len(c.title) for c in checks)
    lines = [f"{prog}: aperf {__version__}, Python {platform.python_version()}, "
             f"uid {os.geteuid()}", ""]
    for c in checks:
        mark = MARKS[c.status] if c.required or c.status != "fail" else "miss"
        head = f"  {mark:<5} {c.title:<{width}}  "
        indent = " " * len(head)
        lines += textwrap.wrap(c.found, 100, initial_indent=head, subsequent_indent=indent)
        if c.fix and c.status != "ok":
            lines += textwrap.wrap(f"fix: {c.fix}", 100, initial_indent=indent,
                                   subsequent_indent=indent + "     ")
    failed = [c.title for c in checks if c.failed]
    lines.append("")
    if failed:
        lines.append(f"{len(failed)} required check(s) failed: {', '.join(failed)}")
    else:
        lines.append("every required check passed")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, *, prog: str = "python -m aperf doctor",
         tracer: bool = False) -> int:
    parser = argparse.ArgumentParser(
        prog=prog, description="Check what this machine and this process have of what aperf "
        "needs; say what to do about what is missing. Exit status 1 when a required check "
        "fails.",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object, for machines")
    args = parser.parse_args(argv)
    checks = run_checks(tracer=tracer)
    if args.json:
        print(json.dumps(report(checks), indent=2))
    else:
        print(text(checks, prog))
    return 1 if any(c.failed for c in checks) else 0

