"""Live globals (issue 33, feature 3): ``read_global``, ``write_global`` and the
``globals`` view read and write a global's current value through its section's map,
decoded with the object's BTF, where ``get_global`` gives the value it was loaded with.
The program (bpf/globals.bpf.c) keeps counters and copies what it reads, so each test
sees both directions on the kernel."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import pytest

import aperf
from aperf._native import libbpf as lb

from ..helpers import BPF_DIR

pytestmark = [pytest.mark.usefixtures("kernel")]
OBJECT = BPF_DIR / "globals.bpf.o"
CPUS = sorted(os.sched_getaffinity(0))


@contextlib.contextmanager
def loaded() -> Iterator[aperf.BPFObject]:
    with aperf.BPFObject(OBJECT) as obj:
        obj.load()
        yield obj


def bump(obj: aperf.BPFObject, times: int = 1, cpu: int = 0, returns: int = 0) -> None:
    """Run the program ``times`` on ``cpu``; it returns 0, or 1 while ``enabled`` is false."""
    fd = obj.programs["bump"].fd
    for _ in range(times):
        assert lb.test_run_on_cpu(fd, cpu) == returns


def test_a_counter_the_program_keeps_is_read_live() -> None:
    with loaded() as obj:
        bump(obj, 3)
        assert obj.read_global("total") == 3
        assert obj.read_global("runs") == 3
        assert obj.globals["runs"] == 3
        # get_global gives what the object was loaded with, as its docs say.
        assert obj.get_global("total") == 0
        bump(obj, 2)
        assert obj.read_global("total") == 5


def test_a_write_is_seen_by_the_program_at_once() -> None:
    with loaded() as obj:
        obj.write_global("step", 5)  # .data
        bump(obj)
        assert obj.read_global("last_step") == 5 and obj.read_global("total") == 5
        obj.globals["total"] = 100  # .bss: reset a counter from user space
        bump(obj)
        assert obj.read_global("total") == 105
        obj.write_global("enabled", False)  # the program returns early from now on
        bump(obj, returns=1)
        assert obj.read_global("runs") == 2


def test_values_are_decoded_with_the_btf() -> None:
    with loaded() as obj:
        first, last = min(CPUS), max(CPUS)
        bump(obj, 2, cpu=first)
        bump(obj, 1, cpu=last)
        stats = obj.read_global("stats")
        assert (stats.calls, stats.delta, stats.sum) == (3, -3, 3)  # a struct
        calls = [0, 0, 0, 0]  # per_cpu_calls[cpu] for CPUs 0 to 3
        for cpu, times in ((first, 2), (last, 1)):
            if cpu < 4:
                calls[cpu] += times
        assert obj.read_global("per_cpu_calls") == tuple(calls)  # an array
        assert obj.read_global("label") == "aperf"  # a char array
        assert obj.read_global("mode") == 1 and obj.read_global("mode").name == "MODE_ON"
        assert obj.read_global("enabled") is True
        assert obj.read_global("offset") == -3
        assert obj.read_global("seen_limit") == obj.read_global("limit") == 1000


def test_rodata_is_read_only_after_load() -> None:
    with loaded() as obj:
        with pytest.raises(aperf.ObjectStateError, match="frozen"):
            obj.write_global("limit", 7)
        with pytest.raises(aperf.ObjectStateError, match="frozen"):
            obj.globals["limit"] = 7
        assert obj.read_global("limit") == 1000


def test_before_load_they_are_the_load_time_image() -> None:
    with aperf.BPFObject(OBJECT) as obj:
        assert obj.read_global("step") == 1 and obj.read_global("total") == 0
        obj.write_global("limit", 50)  # before load: set_global, .rodata included
        obj.globals["step"] = 4
        assert obj.get_global("limit") == 50 and obj.read_global("step") == 4
        obj.load()
        bump(obj)
        assert obj.read_global("seen_limit") == 50 and obj.read_global("total") == 4


def test_the_view_lists_every_global() -> None:
    with loaded() as obj:
        names = set(obj.globals)
        assert {"limit", "step", "label", "mode", "enabled", "offset", "total", "runs",
                "last_step", "seen_limit", "stats", "per_cpu_calls"} == names
        assert len(obj.globals) == len(names)
        assert dict(obj.globals)["step"] == 1
        with pytest.raises(TypeError):
            del obj.globals["step"]


def test_bad_names_and_values_are_typed_errors() -> None:
    with loaded() as obj:
        with pytest.raises(aperf.UnknownNameError):
            obj.read_global("totl")
        with pytest.raises(KeyError):
            obj.globals["nope"]
        with pytest.raises(aperf.GlobalValueError, match="does not fit"):
            obj.write_global("offset", 1 << 20)  # an s16
        with pytest.raises(aperf.GlobalValueError, match="takes an int"):
            obj.write_global("total", "3")  # type: ignore[arg-type]
        with pytest.raises(aperf.GlobalValueError, match="do not fit"):
            obj.write_global("label", b"123456789")
        obj.write_global("label", b"bpf")
        assert obj.read_global("label") == "bpf"
        assert obj.read_global("total") == 0  # nothing else was touched


def test_closed_object_refuses() -> None:
    with loaded() as obj:
        obj.read_global("total")  # the section is mapped now
    with pytest.raises(aperf.ClosedResourceError):
        obj.read_global("total")
    with pytest.raises(aperf.ClosedResourceError):
        obj.write_global("step", 2)


def test_reads_race_a_close_safely() -> None:
    # A read in flight when another thread closes the object ends first (the close
    # waits for it); every later one raises: no read of an unmapped section.
    obj = aperf.BPFObject(OBJECT)
    obj.load()
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                assert obj.read_global("total") == 0
            except aperf.ClosedResourceError:
                return
            except BaseException as exc:  # pragma: no cover - the failure to report
                errors.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    obj.read_global("runs")
    obj.close()
    thread.join(timeout=10)
    stop.set()
    assert not thread.is_alive() and errors == []
