"""The uevents aperf hears for CPU hotplug, parsed without a kernel."""

from __future__ import annotations

from aperf._rings.perf.hotplug import parse_uevent


def test_cpu_online_and_offline_are_parsed() -> None:
    assert parse_uevent(b"offline@/devices/system/cpu/cpu1\0ACTION=offline\0") == ("offline", 1)
    assert parse_uevent(b"online@/devices/system/cpu/cpu12\0ACTION=online\0") == ("online", 12)


def test_other_uevents_are_ignored() -> None:
    for message in (
        b"add@/devices/virtual/cpuid/cpu1\0ACTION=add\0",  # the cpuid device, not the CPU
        b"remove@/devices/virtual/cpuid/cpu1\0",
        b"online@/devices/system/memory/memory3\0",
        b"online@/devices/system/cpu/cpufreq\0",
        b"online@/devices/system/cpu/cpu99999999999\0",
        b"libudev\0\xfe\xed\xca\xfe",
        b"",
    ):
        assert parse_uevent(message) is None, message
