"""BPF objects against the real kernel: open, globals, load, attach, close."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import Producer, object_path

from ..helpers import BPF_DIR, open_fds

BOOTSTRAP = str(BPF_DIR / "bootstrap_legacy.bpf.o")
REJECTED = str(BPF_DIR / "rejected.bpf.o")
pytestmark = pytest.mark.usefixtures("kernel")


def _next_object_still_works() -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        obj.load()
        assert obj.maps["perf_buffer"].fd >= 0


def test_contract_from_the_issue(tracefs: None) -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        obj.set_global("min_duration_ns", 5_000_000)
        obj.load()
        obj.attach()
        m = obj.maps["perf_buffer"]
        assert (m.name, m.type) == ("perf_buffer", 4)
        assert m.fd >= 0
        p = obj.programs["handle_exec"]
        assert p.name == "handle_exec" and p.fd >= 0
        assert all(len(prog.links) == 1 for prog in obj.programs.values())
        assert obj.get_global("min_duration_ns") == 5_000_000


def test_attach_one_program_and_detach(tracefs: None) -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        obj.load()
        link = obj.programs["handle_exec"].attach()
        assert link.attached and obj.programs["handle_exec"].links == (link,)
        assert obj.programs["handle_exit"].links == ()
        link.detach()
        link.detach()  # idempotent
        assert not link.attached and obj.programs["handle_exec"].links == ()
        obj.attach()
        obj.detach()
        assert all(prog.links == () for prog in obj.programs.values())


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(aperf.ObjectFileError, match="no such file") as info:
        aperf.BPFObject(tmp_path / "absent.bpf.o")
    assert isinstance(info.value, FileNotFoundError) or info.value.errno == 2
    _next_object_still_works()


@pytest.mark.parametrize("content", [b"just some text\n", b""])
def test_not_an_elf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "text.bpf.o"
    path.write_bytes(content)
    with pytest.raises(aperf.ObjectFileError, match="not a loadable ELF BPF object"):
        aperf.BPFObject(path)
    _next_object_still_works()


def test_elf_that_is_not_bpf() -> None:
    with pytest.raises(aperf.ObjectFileError):
        aperf.BPFObject("/bin/true")
    _next_object_still_works()


def test_unknown_global_lists_known_ones() -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        with pytest.raises(aperf.UnknownNameError, match="min_duration_ns") as info:
            obj.set_global("min_duration", 1)
        assert isinstance(info.value, LookupError)
    _next_object_still_works()


@pytest.mark.parametrize("value", [-1, 1 << 64, b"x" * 9, "text"])
def test_value_that_does_not_fit(value: object) -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        with pytest.raises(aperf.GlobalValueError, match="min_duration_ns"):
            obj.set_global("min_duration_ns", value)  # type: ignore[arg-type]
        assert obj.get_global("min_duration_ns") == 0
        obj.set_global("min_duration_ns", (1 << 64) - 1)  # the edge fits
        obj.load()
    _next_object_still_works()


def test_set_global_after_load() -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        obj.load()
        with pytest.raises(aperf.ObjectStateError, match="after load"):
            obj.set_global("min_duration_ns", 1)
    _next_object_still_works()


def test_unknown_map_and_program_names() -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        with pytest.raises(aperf.UnknownNameError, match="perf_buffer"):
            obj.maps["events"]
        with pytest.raises(aperf.UnknownNameError, match="handle_exec"):
            obj.programs["handle_fork"]
    _next_object_still_works()


def test_close_names_are_suggested_first() -> None:
    with aperf.BPFObject(BOOTSTRAP) as obj:
        with pytest.raises(aperf.UnknownNameError) as info:
            obj.maps["perf_bufer"]
        assert str(info.value) == "no map named 'perf_bufer'; did you mean 'perf_buffer'?"
        with pytest.raises(aperf.UnknownNameError) as info:
            obj.programs["handle_exit_"]
        assert info.value.suggestions[0] == "handle_exit"
        with pytest.raises(aperf.UnknownNameError) as info:
            obj.set_global("min_duration", 1)
        assert info.value.suggestions == ["min_duration_ns"]
        with pytest.raises(aperf.UnknownNameError) as info:
            obj.maps["zzz"]  # nothing close: no suggestion, only the list
        assert info.value.suggestions == []
        assert "did you mean" not in str(info.value)


def test_verifier_rejection_names_the_program_and_keeps_the_log() -> None:
    with aperf.BPFObject(REJECTED) as obj:
        with pytest.raises(aperf.VerifierError) as info:
            obj.load()
        err = info.value
        assert err.program == "unchecked_lookup"
        assert "rejected program 'unchecked_lookup'" in str(err)
        assert "invalid mem access" in err.log
        assert not obj.loaded
    _next_object_still_works()


def test_closed_object_refuses_use() -> None:
    obj = aperf.BPFObject(BOOTSTRAP)
    obj.load()
    m = obj.maps["perf_buffer"]
    obj.close()
    obj.close()  # idempotent
    with pytest.raises(aperf.ClosedResourceError):
        m.fd  # noqa: B018
    with pytest.raises(aperf.ClosedResourceError):
        obj.load()


def test_global_reaches_the_program() -> None:
    with Producer(tag=0xC0FFEE) as producer:
        assert producer.counters().tag == 0  # no run yet
        producer.emit(1)
        counters = producer.counters()
        assert counters.tag == 0xC0FFEE
        assert counters.runs == 1


def test_producer_without_rings_counts_every_output_as_failed() -> None:
    with Producer() as producer:
        producer.emit(10_000, size=32, cpu=0)
        producer.emit(5, size=4096, cpu=os.cpu_count() - 1 if os.cpu_count() else 0)
        counters = producer.counters()
        assert counters.failed == 10_005
        assert counters.ok == 0


def test_map_lookup_update_and_pin(tmp_path: Path) -> None:
    if not os.path.ismount("/sys/fs/bpf"):
        import subprocess

        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
    with Producer(tag=5) as producer:
        producer.emit(3)
        counters = producer.object.maps["counters"]
        assert int.from_bytes(counters.lookup((2).to_bytes(4, "little")), "little") == 5
        counters.update((1).to_bytes(4, "little"), (77).to_bytes(8, "little"))
        assert producer.counters().failed == 77
        scratch = producer.object.maps["scratch"]
        assert scratch.per_cpu
        assert len(scratch.lookup(bytes(4))) == 4096 * lb.libbpf_num_possible_cpus()
        pin = f"/sys/fs/bpf/aperf_pin_{os.getpid()}"
        producer.map.pin(pin)
        try:
            assert os.path.exists(pin)
        finally:
            producer.map.unpin(pin)
        assert not os.path.exists(pin)


def test_a_program_runs_through_test_run() -> None:
    with Producer() as producer:
        producer.emit(2, cpu=0)  # the run's settings, for CPU 0, stay in the config map
        program = producer.object.programs["produce"]
        assert program.test_run(cpu=0) == 0  # the same run again: two more outputs
        assert (producer.counters().failed, producer.counters().runs) == (4, 2)
        with pytest.raises(aperf.ArgumentError, match="cpu=-1"):
            program.test_run(cpu=-1)
        with pytest.raises(TypeError, match="cpu must be an int"):
            program.test_run(cpu="0")  # type: ignore[arg-type]
    with pytest.raises(aperf.ClosedResourceError):
        program.test_run(cpu=0)


def test_a_program_of_an_object_not_loaded_is_not_run() -> None:
    with aperf.BPFObject(object_path("producer")) as obj, pytest.raises(
        aperf.ObjectStateError, match="load the object"
    ):
        obj.programs["produce"].test_run(cpu=0)


def test_a_closed_producer_emits_nothing() -> None:
    # Its program's fd was closed with the object (the number may name another file by
    # now): nothing may run it; emit() meets the closed config map, or the program.
    producer = Producer()
    producer.close()
    with pytest.raises(aperf.ClosedResourceError):
        producer.emit(1, cpu=0)


def test_producer_rejects_bad_sizes() -> None:
    with Producer() as producer:
        for size in (0, 4097):
            with pytest.raises(ValueError):
                producer.emit(1, size=size)


def test_open_close_releases_every_fd(tracefs: None) -> None:
    def cycle() -> None:
        with aperf.BPFObject(BOOTSTRAP) as obj:
            obj.load()
            obj.attach()
        with aperf.BPFObject(object_path("producer")) as obj:
            obj.set_global("tag", 1)
            obj.load()

    cycle()  # warm up: libbpf's one-time probes may keep an fd
    before = open_fds()
    # A leak of one fd a cycle shows after one; test_object_safety's soak runs 1000.
    for _ in range(25):
        cycle()
    assert open_fds() == before
