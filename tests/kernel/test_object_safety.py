"""BPF objects under misuse, on the real kernel: use after close, sizes and flags handed
to map syscalls, paths that reach C, the Mapping protocol, and 1000-cycle soaks.

``bpf/maps.bpf.o`` holds maps of several kinds and sizes and a task iterator
program (``noop``) whose link attaches and detaches in microseconds.
"""

from __future__ import annotations

import array
import errno
import gc
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import aperf
from aperf._native import libbpf as lb
from aperf.testing import Producer

from ..helpers import BPF_DIR, REPO, open_fds

MAPS = str(BPF_DIR / "maps.bpf.o")
BOOTSTRAP = str(BPF_DIR / "bootstrap_legacy.bpf.o")
pytestmark = pytest.mark.usefixtures("kernel")


@pytest.fixture
def maps_obj(kernel: None) -> Iterator[aperf.BPFObject]:
    with aperf.BPFObject(MAPS) as obj:
        obj.load()
        yield obj


@pytest.fixture
def bpffs(kernel: None) -> str:
    if not os.path.ismount("/sys/fs/bpf"):
        subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)
    return "/sys/fs/bpf"


def _pin_path(name: str) -> str:
    return f"/sys/fs/bpf/aperf_objsafe_{name}_{os.getpid()}"


# --- use after close -------------------------------------------------------------------

# Public names that stay readable once the object is closed: Python copies taken at
# open (no C memory behind them) and the state flags. Everything else must raise.
READABLE_AFTER_CLOSE = {
    "BPFObject": {"path", "name", "closed", "loaded", "maps", "programs"},
    "Map": {"name", "closed", "object"},
    "Program": {"name", "section", "closed"},
    "Link": {"program"},
}
RELEASES = {"close", "detach"}  # idempotent, so a no-op once closed (like file.close())
ARGS: dict[str, tuple[object, ...]] = {  # how to call each public method
    "lookup": (bytes(4),),
    "update": (bytes(4), bytes(12)),
    "pin": ("/sys/fs/bpf/aperf_objsafe_never",),
    "unpin": ("/sys/fs/bpf/aperf_objsafe_never",),
    "set_max_entries": (4096,),
    "set_global": ("anything", 1),
    "get_global": ("anything",),
    "read_global": ("anything",),
    "write_global": ("anything", 1),
    "set_inner_max_entries": (4096,),
    "btf": (),
    "load": (),
    "attach": (),
    "test_run": (),
    "close": (),
    "detach": (),
}


def _outcome(part: object, name: str) -> str:
    static = inspect.getattr_static(part, name)
    is_method = callable(static) and not isinstance(static, property | type)
    try:
        if is_method:
            if name not in ARGS:
                return f"method {name} has no entry in ARGS: add one (and guard it)"
            getattr(part, name)(*ARGS[name])
        else:
            getattr(part, name)
    except aperf.ClosedResourceError:
        return "closed"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def closed_outcomes() -> dict[str, object]:
    """What every public name of a closed object, map, program and link does.

    Also run in a child process under MALLOC_PERTURB_ (see below), so it only
    prints through its return value.
    """
    obj = aperf.BPFObject(MAPS)
    obj.load()
    program = obj.programs["noop"]
    link = program.attach()
    parts: dict[str, object] = {
        "BPFObject": obj, "Map": obj.maps["hash"], "Program": program, "Link": link,
    }
    open_values = {"program_type": program.type, "map_type": obj.maps["hash"].type}
    obj.close()
    outcomes = {
        f"{kind}.{name}": _outcome(part, name)
        for kind, part in parts.items()
        for name in dir(part)
        if not name.startswith("_")
    }
    reprs = [repr(part) for part in parts.values()]
    return {"outcomes": outcomes, "open_values": open_values, "reprs": reprs}


def _expected(outcomes: dict[str, str]) -> dict[str, str]:
    expected = {}
    for key in outcomes:
        kind, name = key.split(".")
        ok = name in READABLE_AFTER_CLOSE[kind] or name in RELEASES
        expected[key] = "ok" if ok else "closed"
    return expected


def test_every_accessor_refuses_after_close() -> None:
    result = closed_outcomes()
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict)
    assert outcomes == _expected(outcomes)
    # the guard covers the accessors named in the issue, so the list above is not empty
    for name in ("Program.type", "Program.fd", "Map.fd", "Map.lookup", "Map.update",
                 "Map.pin", "Map.key_size", "Link.attached", "Program.attach"):
        assert outcomes[name] == "closed"
    assert all("closed" in r for r in result["reprs"][1:3])  # Map, Program


def test_accessors_after_close_under_malloc_perturb() -> None:
    # glibc fills freed memory with 0xa5 bytes (with no tcache, every size of
    # chunk): a read of freed libbpf memory would show garbage or crash.
    code = (
        "import json; from tests.kernel.test_object_safety import closed_outcomes; "
        "print(json.dumps(closed_outcomes()))"
    )
    env = dict(os.environ, MALLOC_PERTURB_="165", GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outcomes"] == _expected(result["outcomes"])
    assert result["open_values"] == {"program_type": 26, "map_type": 1}  # TRACING, HASH


def test_closed_object_refuses_globals_and_load() -> None:
    obj = aperf.BPFObject(BOOTSTRAP)
    obj.close()
    for call in (lambda: obj.set_global("min_duration_ns", 1),
                 lambda: obj.get_global("min_duration_ns"), obj.load, obj.attach):
        with pytest.raises(aperf.ClosedResourceError, match="is closed"):
            call()


def test_link_detached_by_close_stays_detachable(maps_obj: aperf.BPFObject) -> None:
    program = maps_obj.programs["noop"]
    with program.attach() as link:
        assert link.attached and program.links == (link,)
        maps_obj.close()
    link.detach()  # a no-op: closing already detached it
    with pytest.raises(aperf.ClosedResourceError):
        link.attached  # noqa: B018


def test_dropped_object_releases_its_links() -> None:
    def attached_and_dropped() -> None:
        obj = aperf.BPFObject(MAPS)
        obj.load()
        obj.programs["noop"].attach()  # links and programs refer to each other: a cycle

    attached_and_dropped()  # warm up: libbpf's one-time probes may keep an fd
    gc.collect()
    before = open_fds()
    for _ in range(20):
        attached_and_dropped()
    gc.collect()
    assert open_fds() == before  # the finalizer destroyed the links, then the object


# --- sizes and flags handed to map syscalls ----------------------------------------------


def test_config_update_with_short_value_fails_cleanly(producer: Producer) -> None:
    config = producer.object.maps["config"]  # u32 -> struct producer_config: seven u64s
    key = bytes(4)
    before = config.lookup(key)
    short_value = "value is 1 bytes; map 'config' takes 56-byte values"
    with pytest.raises(aperf.ArgumentError, match=short_value) as info:
        config.update(b"\0" * 4, b"\x07")
    assert info.value.argument == "value" and isinstance(info.value, ValueError)
    assert config.lookup(key) == before  # nothing reached the kernel
    with pytest.raises(aperf.ArgumentError, match="key is 0 bytes") as info:
        config.lookup(b"")
    assert info.value.argument == "key"
    with pytest.raises(aperf.ArgumentError, match="key is 5 bytes"):
        config.lookup(bytes(5))
    with pytest.raises(aperf.ArgumentError, match="value is 25 bytes"):
        config.update(key, bytes(25))
    producer.emit(3)  # the producer still works
    assert producer.counters().ok == 0 and producer.counters().failed == 3


def test_hash_map_round_trip_and_sizes(maps_obj: aperf.BPFObject) -> None:
    hash_map = maps_obj.maps["hash"]
    assert (hash_map.key_size, hash_map.value_size) == (4, 12)
    value = bytes(range(12))
    hash_map.update(bytearray(b"\1\0\0\0"), memoryview(value))  # buffers accepted
    assert hash_map.lookup(memoryview(array.array("I", [1]))) == value  # 4 bytes, 1 item
    with pytest.raises(aperf.ArgumentError, match="value is 11 bytes"):
        hash_map.update(bytes(4), value[:11])
    missing = bytes([9, 0, 0, 0])
    with pytest.raises(aperf.LibbpfError) as info:
        hash_map.lookup(missing)
    assert info.value.errno == errno.ENOENT


@pytest.mark.parametrize("bad", ["1234", 1234, None, [0, 0, 0, 0], array.array("I", [0])])
def test_keys_and_values_that_are_not_bytes(maps_obj: aperf.BPFObject, bad: object) -> None:
    hash_map = maps_obj.maps["hash"]
    with pytest.raises(TypeError, match="key must be bytes, bytearray or memoryview"):
        hash_map.lookup(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="value must be bytes"):
        hash_map.update(bytes(4), bad)  # type: ignore[arg-type]


def test_per_cpu_values_take_an_aligned_slot_per_possible_cpu(
    maps_obj: aperf.BPFObject,
) -> None:
    percpu = maps_obj.maps["percpu"]
    cpus = lb.libbpf_num_possible_cpus()
    assert percpu.per_cpu and percpu.value_size == 12
    slot = 16  # 12 bytes rounded up to 8
    key = (7).to_bytes(8, "little")
    with pytest.raises(aperf.ArgumentError, match=f"takes {slot * cpus}-byte values"):
        percpu.update(key, bytes(12))  # one CPU's value: the kernel would read past it
    values = b"".join(bytes([cpu + 1]) * 12 + bytes(4) for cpu in range(cpus))
    percpu.update(key, values)
    assert percpu.lookup(key) == values


def test_queue_map_has_no_key(maps_obj: aperf.BPFObject) -> None:
    queue = maps_obj.maps["queue"]
    assert queue.key_size == 0
    queue.update(b"", (42).to_bytes(8, "little"))
    assert queue.lookup(b"") == (42).to_bytes(8, "little")  # a peek
    with pytest.raises(aperf.ArgumentError, match="key is 4 bytes"):
        queue.update(bytes(4), bytes(8))


def test_update_flags(maps_obj: aperf.BPFObject) -> None:
    hash_map, key = maps_obj.maps["hash"], bytes(4)
    hash_map.update(key, bytes(12), 1)  # BPF_NOEXIST
    with pytest.raises(aperf.LibbpfError) as info:
        hash_map.update(key, bytes(12), 1)
    assert info.value.errno == errno.EEXIST
    hash_map.update(key, b"\1" * 12, 2)  # BPF_EXIST
    assert hash_map.lookup(key) == b"\1" * 12
    for bad in (3, -1, 8, 1 << 64, 0x104):
        with pytest.raises(aperf.ArgumentError, match="flags=") as flag_info:
            hash_map.update(key, bytes(12), bad)
        assert flag_info.value.argument == "flags"
    for wrong in (True, 1.0, "0"):
        with pytest.raises(TypeError, match="flags must be an int"):
            hash_map.update(key, bytes(12), wrong)  # type: ignore[arg-type]
    assert hash_map.lookup(key) == b"\1" * 12
    locked = maps_obj.maps["locked"]  # struct {bpf_spin_lock; u32}
    locked.update(key, bytes(4) + (5).to_bytes(4, "little"), 4)  # BPF_F_LOCK
    assert locked.lookup(key)[4:] == (5).to_bytes(4, "little")
    with pytest.raises(aperf.LibbpfError) as info:
        hash_map.update(key, bytes(12), 4)  # no spin lock in this value: the kernel says no
    assert info.value.errno == errno.EINVAL


def test_fd_level_calls_check_sizes_against_the_kernel(producer: Producer) -> None:
    counters_fd = producer.object.maps["counters"].fd  # u32 -> u64
    assert lb.map_lookup(counters_fd, bytes(4), 8) == bytes(8)
    with pytest.raises(aperf.ArgumentError, match="writes 8 bytes") as info:
        lb.map_lookup(counters_fd, bytes(4), 4)  # the kernel would write past a 4-byte buffer
    assert info.value.argument == "value_size"
    with pytest.raises(aperf.ArgumentError, match="value is 4 bytes; map fd"):
        lb.map_update(counters_fd, bytes(4), bytes(4))
    with pytest.raises(aperf.LibbpfError, match="not a BPF map"):
        lb.map_lookup(producer.object.programs["produce"].fd, bytes(4))
    with pytest.raises(aperf.LibbpfError, match="not a BPF map"):
        lb.map_info(producer.object.programs["produce"].fd)


def test_map_before_load_has_no_elements() -> None:
    with aperf.BPFObject(MAPS) as obj:
        with pytest.raises(aperf.ObjectStateError, match="before the object is loaded"):
            obj.maps["hash"].lookup(bytes(4))
        with pytest.raises(aperf.ObjectStateError, match="before the object is loaded"):
            obj.maps["hash"].pin(_pin_path("early"))


# --- paths that reach C ----------------------------------------------------------------


def test_object_path_with_nul_byte() -> None:
    with pytest.raises(aperf.ArgumentError, match="NUL byte") as info:
        aperf.BPFObject(BOOTSTRAP + "\0.txt")  # C would have opened BOOTSTRAP
    assert info.value.argument == "path"
    with pytest.raises(TypeError, match="path must be a path"):
        aperf.BPFObject(3)  # type: ignore[arg-type]
    with aperf.BPFObject(os.fsencode(MAPS)) as obj:  # type: ignore[arg-type]
        assert obj.path == MAPS


def test_directory_is_refused_without_leaking_an_fd() -> None:
    with pytest.raises(aperf.ObjectFileError, match="a directory") as info:
        aperf.BPFObject(".")
    assert info.value.errno == errno.EISDIR
    before = open_fds()
    for _ in range(1000):
        with pytest.raises(aperf.ObjectFileError):
            aperf.BPFObject(".")
    assert open_fds() == before


def test_fifo_and_device_are_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.bpf.o"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):  # libbpf would block on the FIFO for ever
        with pytest.raises(aperf.ObjectFileError, match="not a regular file"):
            aperf.BPFObject(path)


def test_failed_pin_does_not_poison_later_pins(bpffs: str, tmp_path: Path) -> None:
    with aperf.BPFObject(MAPS) as obj:
        obj.load()
        hash_map = obj.maps["hash"]
        with pytest.raises(aperf.PinnedPathError, match="not on a BPF filesystem") as info:
            hash_map.pin(tmp_path / "pin")
        assert not isinstance(info.value, aperf.MissingPrivilegesError)
        assert not (tmp_path / "pin").exists()
        with pytest.raises(aperf.PinnedPathError, match="directory that does not exist"):
            hash_map.pin(f"{bpffs}/aperf_objsafe_nodir_{os.getpid()}/pin")
        first, second = _pin_path("first"), _pin_path("second")
        hash_map.pin(first)  # libbpf's bpf_map__pin kept the failed path: EINVAL here
        try:
            with pytest.raises(aperf.PinnedPathError, match="already exists") as info:
                hash_map.pin(first)
            assert info.value.errno == errno.EEXIST
            hash_map.unpin(first)
            assert not os.path.exists(first)
            hash_map.pin(second)  # and after an unpin, a pin elsewhere works too
            fd = lb.pinned_object_fd(second)
            try:
                assert lb.object_id(fd) == lb.object_id(hash_map.fd)
            finally:
                os.close(fd)
            hash_map.unpin(second)
        finally:
            for path in (first, second):
                if os.path.exists(path):
                    os.unlink(path)


def test_pin_and_unpin_paths_with_nul_byte(bpffs: str, maps_obj: aperf.BPFObject) -> None:
    pin = _pin_path("nul")
    hash_map = maps_obj.maps["hash"]
    with pytest.raises(aperf.ArgumentError, match="NUL byte"):
        hash_map.pin(pin + "\0suffix")
    assert not os.path.exists(pin)  # C would have pinned at the truncated path
    hash_map.pin(pin)
    try:
        with pytest.raises(aperf.ArgumentError, match="NUL byte"):
            hash_map.unpin(pin + "\0suffix")
        assert os.path.exists(pin)
    finally:
        hash_map.unpin(pin)


def test_unpin_leaves_another_maps_pin_alone(bpffs: str, maps_obj: aperf.BPFObject) -> None:
    pin = _pin_path("other")
    maps_obj.maps["hash"].pin(pin)
    try:
        with pytest.raises(aperf.PinnedPathError, match="another BPF object than map 'locked'"):
            maps_obj.maps["locked"].unpin(pin)
        assert os.path.exists(pin)
    finally:
        maps_obj.maps["hash"].unpin(pin)
    with pytest.raises(aperf.LibbpfError) as info:
        maps_obj.maps["hash"].unpin(pin)  # nothing pinned there any more
    assert info.value.errno == errno.ENOENT


def test_load_after_failed_pin_pins_nothing(bpffs: str, maps_obj: aperf.BPFObject) -> None:
    # bpf_map__pin() before load would record the path and make load() pin there.
    pin = _pin_path("preload")
    with aperf.BPFObject(MAPS) as obj:
        with pytest.raises(aperf.ObjectStateError):
            obj.maps["hash"].pin(pin)
        obj.load()
        assert not os.path.exists(pin)


def test_non_bpf_files_as_pinned_maps(bpffs: str, tmp_path: Path) -> None:
    regular = tmp_path / "not-a-map"
    regular.write_text("x")
    directory = f"{bpffs}/aperf_objsafe_dir_{os.getpid()}"
    os.mkdir(directory)
    try:
        cases = [
            (str(regular), "not on a BPF filesystem"),
            ("/dev/null", "not on a BPF filesystem"),
            (directory, "is a directory"),
        ]
        for path, reason in cases:
            with pytest.raises(aperf.PinnedPathError, match=reason) as info:
                lb.pinned_object_fd(path)
            assert not isinstance(info.value, aperf.MissingPrivilegesError)
            assert "needs root" not in str(info.value)
            assert info.value.errno == errno.EACCES  # what bpf_obj_get says on 6.18
        # and through the public API, which opens pinned maps by path
        with pytest.raises(aperf.PinnedPathError, match="not on a BPF filesystem"):
            aperf.PerfBuffer(regular, on_sample=print)
    finally:
        os.rmdir(directory)
    with pytest.raises(aperf.LibbpfError) as missing:
        lb.pinned_object_fd(f"{bpffs}/aperf_objsafe_absent_{os.getpid()}")
    assert missing.value.errno == errno.ENOENT


def test_pinned_path_with_nul_byte(bpffs: str, maps_obj: aperf.BPFObject) -> None:
    pin = _pin_path("open")
    maps_obj.maps["hash"].pin(pin)
    try:
        with pytest.raises(aperf.ArgumentError, match="NUL byte") as info:
            lb.pinned_object_fd(pin + "\0ignored", argument="source")
        assert info.value.argument == "source"
        with pytest.raises(aperf.ArgumentError, match="NUL byte"):
            aperf.PerfBuffer(pin + "\0ignored", on_sample=print)
    finally:
        maps_obj.maps["hash"].unpin(pin)


# --- the Mapping protocol ----------------------------------------------------------------


def test_maps_and_programs_follow_the_mapping_protocol(maps_obj: aperf.BPFObject) -> None:
    maps, programs = maps_obj.maps, maps_obj.programs
    assert "nope" not in maps and "hash" in maps and 3 not in maps
    assert maps.get("nope") is None and maps.get("nope", 1) == 1
    assert maps.get("hash") is maps["hash"]
    assert "noop" in programs and programs.get("nope") is None
    assert dict(maps) == {m.name: m for m in maps.values()}
    with pytest.raises(aperf.UnknownNameError) as info:
        maps["nope"]
    err = info.value
    assert isinstance(err, KeyError) and isinstance(err, LookupError)
    assert str(err) == "no map named 'nope'; known: hash, locked, percpu, queue"
    with pytest.raises(KeyError, match="no program named 'nope'"):
        programs["nope"]
    with pytest.raises(KeyError, match="no global named 'nope'"):
        maps_obj.get_global("nope")


# --- soak ------------------------------------------------------------------------------

SOAK = """
import json, os, aperf

def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))

def cycle(i):
    with aperf.BPFObject({path!r}) as obj:
        obj.load()
        obj.maps["hash"].update(i.to_bytes(4, "little") if i < 16 else bytes(4), bytes(12))
        link = obj.programs["noop"].attach()
        if i % 2:
            link.detach()  # the other half stay attached until close

for i in range(50):  # warm up: allocator arenas, libbpf's one-time probes
    cycle(i)
fds, rss = len(os.listdir("/proc/self/fd")), rss_kib()
for i in range(1000):
    cycle(i)
print(json.dumps({{"fds": [fds, len(os.listdir("/proc/self/fd"))], "rss_kib": [rss, rss_kib()]}}))
"""


def test_soak_open_load_attach_close_1000_cycles() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SOAK.format(path=MAPS)], cwd=REPO, capture_output=True,
        text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    before, after = result["fds"]
    assert after == before
    rss_before, rss_after = result["rss_kib"]
    assert rss_after - rss_before < 5 * 1024, result
