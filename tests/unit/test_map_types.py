"""aperf's table of map type names against the running kernel's ``enum bpf_map_type``
(its BTF, /sys/kernel/btf/vmlinux, dumped as C by bpftool; no root needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from aperf._bpf.map_types import MAP_TYPES, map_type_name

from ..helpers import REQUIRE_BPF

VMLINUX = Path("/sys/kernel/btf/vmlinux")


def kernel_map_types() -> dict[int, str]:
    bpftool = shutil.which("bpftool") or shutil.which("bpftool", path="/usr/sbin:/sbin")
    if bpftool is None or not VMLINUX.exists():
        reason = "bpftool or /sys/kernel/btf/vmlinux is missing"
        if REQUIRE_BPF:
            pytest.fail(f"APERF_REQUIRE_BPF=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    dump = subprocess.run(
        [bpftool, "btf", "dump", "file", str(VMLINUX), "format", "c"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout
    body = re.search(r"enum bpf_map_type \{(.*?)\};", dump, re.S)
    assert body is not None, "no enum bpf_map_type in the kernel's BTF"
    found: dict[int, str] = {}
    for name, value in re.findall(r"(BPF_MAP_TYPE_\w+) = (\d+)", body[1]):
        if not name.endswith("_DEPRECATED"):  # an alias kept for old programs
            found.setdefault(int(value), name)
    return found


def test_the_table_is_the_running_kernels_enum() -> None:
    kernel = kernel_map_types()
    assert len(kernel) > 30  # the parse found the enum at all
    # A kernel newer than the table has more types: add them to aperf/_bpf/map_types.py.
    assert kernel == MAP_TYPES


def test_names_and_unknown_numbers() -> None:
    assert map_type_name(1) == "BPF_MAP_TYPE_HASH"
    assert map_type_name(27) == "BPF_MAP_TYPE_RINGBUF"
    assert map_type_name(19) == "BPF_MAP_TYPE_CGROUP_STORAGE"  # not its _DEPRECATED alias
    assert map_type_name(10_000) == "map type 10000"
