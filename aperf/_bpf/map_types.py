"""The kernel's map types by number (``enum bpf_map_type``, include/uapi/linux/bpf.h).

A static table, so that an error can name a map's type without BTF at hand:
"a BPF_MAP_TYPE_HASH", not "type 1". ``tests/unit/test_map_types.py`` checks it
against the running kernel's ``/sys/kernel/btf/vmlinux``. Where two names share a
number (``BPF_MAP_TYPE_CGROUP_STORAGE`` and its ``_DEPRECATED`` alias), the current
name is kept.
"""

from __future__ import annotations

MAP_TYPES: dict[int, str] = {
    0: "BPF_MAP_TYPE_UNSPEC",
    1: "BPF_MAP_TYPE_HASH",
    2: "BPF_MAP_TYPE_ARRAY",
    3: "BPF_MAP_TYPE_PROG_ARRAY",
    4: "BPF_MAP_TYPE_PERF_EVENT_ARRAY",
    5: "BPF_MAP_TYPE_PERCPU_HASH",
    6: "BPF_MAP_TYPE_PERCPU_ARRAY",
    7: "BPF_MAP_TYPE_STACK_TRACE",
    8: "BPF_MAP_TYPE_CGROUP_ARRAY",
    9: "BPF_MAP_TYPE_LRU_HASH",
    10: "BPF_MAP_TYPE_LRU_PERCPU_HASH",
    11: "BPF_MAP_TYPE_LPM_TRIE",
    12: "BPF_MAP_TYPE_ARRAY_OF_MAPS",
    13: "BPF_MAP_TYPE_HASH_OF_MAPS",
    14: "BPF_MAP_TYPE_DEVMAP",
    15: "BPF_MAP_TYPE_SOCKMAP",
    16: "BPF_MAP_TYPE_CPUMAP",
    17: "BPF_MAP_TYPE_XSKMAP",
    18: "BPF_MAP_TYPE_SOCKHASH",
    19: "BPF_MAP_TYPE_CGROUP_STORAGE",
    20: "BPF_MAP_TYPE_REUSEPORT_SOCKARRAY",
    21: "BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE",
    22: "BPF_MAP_TYPE_QUEUE",
    23: "BPF_MAP_TYPE_STACK",
    24: "BPF_MAP_TYPE_SK_STORAGE",
    25: "BPF_MAP_TYPE_DEVMAP_HASH",
    26: "BPF_MAP_TYPE_STRUCT_OPS",
    27: "BPF_MAP_TYPE_RINGBUF",
    28: "BPF_MAP_TYPE_INODE_STORAGE",
    29: "BPF_MAP_TYPE_TASK_STORAGE",
    30: "BPF_MAP_TYPE_BLOOM_FILTER",
    31: "BPF_MAP_TYPE_USER_RINGBUF",
    32: "BPF_MAP_TYPE_CGRP_STORAGE",
    33: "BPF_MAP_TYPE_ARENA",
}


def map_type_name(value: int) -> str:
    """``BPF_MAP_TYPE_HASH`` for 1; for a number newer than the table, ``map type N``."""
    return MAP_TYPES.get(value, f"map type {value}")
