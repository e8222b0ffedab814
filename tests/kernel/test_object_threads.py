"""BPFObject, Map, Program and Link closed from one thread while others are inside their
calls, on the real kernel: each call succeeds or raises ClosedResourceError, none reads
freed memory (also run under MALLOC_PERTURB_, which fills freed memory with garbage),
and the close waits for the calls in flight."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

import aperf
from aperf._native import libbpf as lb

from ..helpers import BPF_DIR, REPO

MAPS = str(BPF_DIR / "maps.bpf.o")
BOOTSTRAP = str(BPF_DIR / "bootstrap_legacy.bpf.o")
WORKERS = 8
pytestmark = pytest.mark.usefixtures("kernel")


def _operations(obj: aperf.BPFObject, globals_obj: aperf.BPFObject, worker: int
                ) -> list[Callable[[], object]]:
    hash_map = obj.maps["hash"]
    program = obj.programs["noop"]
    key = worker.to_bytes(4, "little")
    value = bytes([worker]) * 12

    def lookup_update() -> object:
        hash_map.update(key, value)
        assert hash_map.lookup(key) == value  # no other thread writes this key
        return None

    def attach_detach() -> object:
        with program.attach() as link:
            assert link.attached
        return program.fd

    def every_map() -> object:
        return [(m.name, m.fd, m.type, m.key_size) for m in obj.maps.values()]

    def globals_() -> object:
        globals_obj.set_global("min_duration_ns", worker)
        got = globals_obj.get_global("min_duration_ns")
        assert isinstance(got, int) and 0 <= got < WORKERS  # another worker may have set it
        return got

    def decoder() -> object:
        return aperf.decoders.from_btf(obj, "odd")

    return [lookup_update, attach_detach, every_map, globals_, decoder]


def hammer(rounds: int, seed: int = 0) -> dict[str, int]:
    """``rounds`` times: WORKERS threads call everything while the main thread closes both
    objects. Returns how the calls ended: "ok", "closed", or the unexpected errors."""
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    for _ in range(rounds):
        obj = aperf.BPFObject(MAPS)
        obj.load()
        globals_obj = aperf.BPFObject(BOOTSTRAP)
        # Both sides of the race, whatever the machine's load: each worker makes a whole
        # round of calls before the close may come, and one more after it has returned.
        called = threading.Barrier(WORKERS + 1)
        closed = threading.Event()

        def work(
            worker: int, obj: aperf.BPFObject = obj, globals_obj: aperf.BPFObject = globals_obj,
            called: threading.Barrier = called, closed: threading.Event = closed,
        ) -> None:
            ops = _operations(obj, globals_obj, worker)
            seen: Counter[str] = Counter()
            first = True
            while True:
                last = closed.is_set()
                for op in ops:
                    try:
                        op()
                        seen["ok"] += 1
                    except aperf.ClosedResourceError:
                        seen["closed"] += 1
                    except Exception as exc:  # anything else is the defect
                        seen[f"{op.__name__}: {type(exc).__name__}: {exc}"] += 1
                if first:
                    first = False
                    called.wait()
                if last:
                    break
            with lock:
                outcomes.update(seen)

        threads = [threading.Thread(target=work, args=(w,)) for w in range(WORKERS)]
        for t in threads:
            t.start()
        called.wait(60)  # a hang guard: a worker that died raises BrokenBarrierError
        time.sleep(rng.uniform(0.0, 0.02))  # where the close falls among the calls
        obj.close()
        globals_obj.close()
        assert obj.closed and globals_obj.closed
        assert not obj._handle.ptr and not globals_obj._handle.ptr  # freed, not deferred
        closed.set()
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    return dict(outcomes)


def test_calls_racing_a_close_succeed_or_raise_closed() -> None:
    outcomes = hammer(rounds=25)
    unexpected = {k: v for k, v in outcomes.items() if k not in ("ok", "closed")}
    assert not unexpected
    assert outcomes["ok"] > 0 and outcomes["closed"] > 0  # both sides of the race were hit


def test_calls_racing_a_close_under_malloc_perturb() -> None:
    code = (
        "import json; from tests.kernel.test_object_threads import hammer; "
        "print(json.dumps(hammer(rounds=10, seed=1)))"
    )
    env = dict(os.environ, MALLOC_PERTURB_="165", GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout)
    assert set(outcomes) == {"ok", "closed"}, outcomes


def test_close_waits_for_a_call_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    obj = aperf.BPFObject(MAPS)
    obj.load()
    hash_map = obj.maps["hash"]
    inside, release = threading.Event(), threading.Event()
    real_lookup = lb.map_lookup
    freed_during_call: list[bool] = []

    def slow_lookup(fd: int, key: object, *args: object, **kwargs: object) -> bytes:
        inside.set()
        release.wait(10)
        freed_during_call.append(not obj._handle.ptr)
        return real_lookup(fd, key, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lb, "map_lookup", slow_lookup)
    hash_map.update(bytes(4), bytes(12))
    results: list[bytes] = []
    reader = threading.Thread(target=lambda: results.append(hash_map.lookup(bytes(4))))
    reader.start()
    assert inside.wait(10)
    closer = threading.Thread(target=obj.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive(), "close() did not wait for the lookup in flight"
    assert obj.closed  # refused to new calls at once
    with pytest.raises(aperf.ClosedResourceError):
        _ = hash_map.key_size
    release.set()
    reader.join(10)
    closer.join(10)
    assert results == [bytes(12)] and freed_during_call == [False]
    assert not obj._handle.ptr


def test_close_from_inside_a_call_of_its_own_thread_frees_when_the_call_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a signal handler closing the object it interrupted does: close() cannot wait
    # for the call under it, so the call frees on its way out.
    obj = aperf.BPFObject(MAPS)
    obj.load()
    hash_map = obj.maps["hash"]
    hash_map.update(bytes(4), bytes(12))
    real_lookup = lb.map_lookup
    during: list[tuple[bool, bool]] = []

    def closing_lookup(fd: int, key: object, *args: object, **kwargs: object) -> bytes:
        obj.close()
        during.append((obj.closed, bool(obj._handle.ptr)))
        return real_lookup(fd, key, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(lb, "map_lookup", closing_lookup)
    assert hash_map.lookup(bytes(4)) == bytes(12)
    assert during == [(True, True)]  # closed to new calls, not yet freed under the call
    assert not obj._handle.ptr  # freed once the call ended
