"""The doctor's checks one by one, on inputs made here (no root needed): each failure says
what is wrong and what to do, and only a required failure makes the exit status 1.
tests/kernel/test_doctor.py runs the command itself, as root and as an unprivileged user."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from aperf._errors import LibbpfError, MissingPrivilegesError
from aperf._privileges import (
    CAP_BPF,
    CAP_DAC_READ_SEARCH,
    CAP_IPC_LOCK,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
)
from aperf._tools import doctor
from aperf._tools.doctor import Check


def mask(*bits: int) -> int:
    return sum(1 << bit for bit in bits)


def test_capabilities_decide_between_fail_warn_and_ok() -> None:
    none = doctor.check_capabilities(0)
    assert none.status == "fail" and none.failed
    assert "lacks CAP_BPF and CAP_PERFMON" in none.found
    assert "run as root, or with CAP_BPF and CAP_PERFMON" in none.fix
    # Enough to load, not to read tracefs: it works, with a warning that says why.
    bpf_only = doctor.check_capabilities(mask(CAP_BPF, CAP_PERFMON))
    assert bpf_only.status == "warn" and not bpf_only.failed
    assert "CAP_DAC_READ_SEARCH" in bpf_only.fix
    assert doctor.check_capabilities(mask(CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH)).status == "ok"
    assert doctor.check_capabilities(mask(CAP_SYS_ADMIN)).status == "ok"
    assert doctor.check_capabilities(mask(CAP_BPF)).found.endswith("lacks CAP_PERFMON")
    assert doctor.check_capabilities(None).status == "skip"


def refusing(err: int) -> Callable[[int, str, int, int, int], int]:
    def create(map_type: int, name: str, key: int, value: int, entries: int) -> int:
        if err in (errno.EPERM, errno.EACCES):
            raise MissingPrivilegesError(err, "bpf_map_create")
        raise LibbpfError(err, "bpf_map_create")

    return create


def test_a_map_type_the_kernel_refuses_names_the_kernel_it_needs() -> None:
    check = doctor.check_map_type("ringbuf", "BPF ring buffers", doctor.RINGBUF, False, "5.8",
                                  create=refusing(errno.EINVAL))
    assert check.status == "fail" and not check.failed  # optional: exit status stays 0
    assert "BPF_MAP_TYPE_RINGBUF" in check.found and "Linux 5.8" in check.fix
    required = doctor.check_map_type("perf_event_array", "perf event arrays",
                                     doctor.PERF_EVENT_ARRAY, True, "4.4",
                                     create=refusing(errno.EINVAL))
    assert required.failed
    no_bpf = doctor.check_map_type("ringbuf", "x", doctor.RINGBUF, False, "5.8",
                                   create=refusing(errno.ENOSYS))
    assert "CONFIG_BPF_SYSCALL" in no_bpf.fix


def test_without_privileges_the_map_types_are_not_probed() -> None:
    check = doctor.check_map_type("perf_event_array", "perf event arrays",
                                  doctor.PERF_EVENT_ARRAY, True, "4.4",
                                  create=refusing(errno.EPERM))
    assert check.status == "skip" and not check.failed
    assert "not probed" in check.found and "capabilities" in check.fix


def test_a_created_map_is_closed_at_once() -> None:
    read, write = os.pipe()
    os.close(write)
    check = doctor.check_map_type("ringbuf", "x", doctor.RINGBUF, False, "5.8",
                                  create=lambda *args: read)
    assert check.status == "ok"
    with pytest.raises(OSError):
        os.fstat(read)  # the doctor closed the fd it was handed


def test_tracefs_missing_says_how_to_mount_it(tmp_path: Path) -> None:
    nowhere = (tmp_path / "tracing",)
    plain = doctor.check_tracefs(0, required=True, dirs=nowhere)
    assert plain.status == "fail" and plain.failed and plain.found == "not mounted"
    assert f"mount -t tracefs tracefs {nowhere[0]}" in plain.fix
    # Root's tracer mounts it itself: a warning, not a failure.
    assert doctor.check_tracefs(mask(CAP_SYS_ADMIN), required=True, dirs=nowhere).status == "warn"
    (tmp_path / "tracing" / "events").mkdir(parents=True)
    assert doctor.check_tracefs(0, required=True, dirs=nowhere).status == "ok"


def test_bpffs_is_found_in_mountinfo(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"
        "41 22 0:33 / /sys/fs/bpf rw,nosuid shared:15 - bpf bpf rw,mode=700\n"
    )
    assert doctor.check_bpffs(doctor.mounts(str(mountinfo))).status == "ok"
    missing = doctor.check_bpffs({"/sys": "sysfs"})
    assert missing.status == "warn" and "mount -t bpf bpf /sys/fs/bpf" in missing.fix


def test_locked_memory_counts_the_default_streams_that_fit(tmp_path: Path) -> None:
    mlock = tmp_path / "perf_event_mlock_kb"
    mlock.write_text("516\n")
    assert doctor.check_memlock(mask(CAP_IPC_LOCK), 2, str(mlock)).found.endswith("CAP_IPC_LOCK")
    check = doctor.check_memlock(0, 2, str(mlock))
    import resource

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft == resource.RLIM_INFINITY:
        assert check.status == "ok"
    else:
        # 516 KiB per CPU for the user's perf rings, then RLIMIT_MEMLOCK; a default stream
        # takes 129 pages per CPU (docs/privileges.md: 8 fit with 8 MiB, on 2 CPUs).
        expected = (516 * 2 + soft // 1024) // (129 * 4 * 2)
        assert f"room for {expected} stream(s)" in check.found


def test_lock_directory_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "everyone"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("APERF_LOCK_DIR", str(shared))
    open_to_all = doctor.check_lock_dir()
    assert open_to_all.failed and "mode 0777" in open_to_all.found
    assert "APERF_LOCK_DIR" in open_to_all.fix
    monkeypatch.setenv("APERF_LOCK_DIR", str(tmp_path / "missing"))
    missing = doctor.check_lock_dir()
    assert missing.failed and "does not exist" in missing.found
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    monkeypatch.setenv("APERF_LOCK_DIR", str(mine))
    good = doctor.check_lock_dir()
    assert good.status == "ok" and "mode 0700" in good.found and not mine.joinpath("x").exists()


def test_exit_status_is_1_only_for_a_required_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    optional = Check("bpffs", "BPF file system", "warn", False, "not mounted", "mount it")
    required = Check("capabilities", "capabilities", "fail", True, "none", "run as root")
    monkeypatch.setattr(doctor, "run_checks", lambda tracer=False: [optional])
    assert doctor.main([]) == 0
    assert "every required check passed" in capsys.readouterr().out
    monkeypatch.setattr(doctor, "run_checks", lambda tracer=False: [optional, required])
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "FAIL  capabilities" in out and "fix: run as root" in out
    assert "1 required check(s) failed: capabilities" in out
    assert doctor.main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert report["checks"][1] == {"name": "capabilities", "title": "capabilities",
                                   "status": "fail", "required": True, "found": "none",
                                   "fix": "run as root"}
    with pytest.raises(SystemExit) as exited:
        doctor.main(["--jsn"])
    assert exited.value.code == 2


def test_kernel_versions_are_read_from_the_release() -> None:
    assert doctor.kernel_version("6.18.44-fc-v1272") == (6, 18)
    assert doctor.kernel_version("5.10.0-28-amd64") == (5, 10)
    assert doctor.kernel_version("weird") == (0, 0)
