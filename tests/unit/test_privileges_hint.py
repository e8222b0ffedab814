"""What a MissingPrivilegesError says, for each capability set: blame what is missing.

The kernel tier runs the same cases for real (tests/kernel/test_privileges.py); here
the capability mask is given, so every branch is checked as any user.
"""

from __future__ import annotations

import errno

import aperf
from aperf._privileges import (
    CAP_BPF,
    CAP_DAC_READ_SEARCH,
    CAP_IPC_LOCK,
    CAP_PERFMON,
    CAP_SYS_ADMIN,
    privileges_hint,
)

BPF = 1 << CAP_BPF | 1 << CAP_PERFMON
TRACEFS_LOG = (
    "libbpf: failed to open '/sys/kernel/tracing/events/sched/sched_process_exec/id': "
    "Permission denied\n"
)
MMAP_LOG = "libbpf: failed to mmap perf buffer on cpu #0: Operation not permitted\n"


def test_no_capabilities_names_both() -> None:
    hint = privileges_hint(0)
    assert "lacks CAP_BPF and CAP_PERFMON" in hint


def test_one_missing_capability_is_named_alone() -> None:
    assert privileges_hint(1 << CAP_BPF).endswith("lacks CAP_PERFMON")
    assert privileges_hint(1 << CAP_PERFMON).endswith("lacks CAP_BPF")


def test_cap_sys_admin_covers_bpf_and_perfmon() -> None:
    assert "lacks" not in privileges_hint(1 << CAP_SYS_ADMIN)


def test_unreadable_tracefs_is_blamed_not_the_capabilities_held() -> None:
    hint = privileges_hint(BPF, TRACEFS_LOG)
    assert "tracefs" in hint and "CAP_DAC_READ_SEARCH" in hint
    assert "lacks" not in hint
    # With CAP_DAC_READ_SEARCH the tracefs read was not the cause: say so differently.
    assert "add CAP_DAC_READ_SEARCH" not in privileges_hint(BPF | 1 << CAP_DAC_READ_SEARCH,
                                                             TRACEFS_LOG)


def test_ring_memory_over_the_lock_limit_says_how_to_fit() -> None:
    hint = privileges_hint(BPF | 1 << CAP_DAC_READ_SEARCH, MMAP_LOG)
    assert "perf_event_mlock_kb" in hint and "pages=" in hint and "CAP_IPC_LOCK" in hint
    assert "perf_event_mlock_kb" not in privileges_hint(BPF | 1 << CAP_IPC_LOCK, MMAP_LOG)


def test_all_capabilities_held_points_elsewhere() -> None:
    hint = privileges_hint(BPF | 1 << CAP_DAC_READ_SEARCH)
    assert "has the BPF capabilities" in hint and "lacks" not in hint


def test_unknown_capabilities_give_the_whole_rule() -> None:
    hint = privileges_hint(None)
    assert "CAP_BPF and CAP_PERFMON" in hint and "CAP_DAC_READ_SEARCH" in hint


def test_the_error_message_ends_with_the_hint_for_its_detail() -> None:
    err = aperf.MissingPrivilegesError(errno.EACCES, "bpf_program__attach", "attaching x")
    err.log = TRACEFS_LOG  # as Program.attach() sets it, after construction
    err.capabilities = BPF
    assert str(err).startswith("bpf_program__attach() failed: [EACCES] Permission denied")
    assert str(err).endswith(f"({err.hint})")
    assert "tracefs" in err.hint
