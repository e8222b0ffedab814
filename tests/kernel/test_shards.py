"""Shards: processes each reading a disjoint set of CPUs of one perf event array.

Each shard is a real process reading the pinned map with ``cpus=``; the kernel
produces the samples (Producer), on each CPU in turn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import aperf
from aperf.testing import Producer

from .test_map_lock import pinned

# A shard: opens PIN with cpus=CPUS, says "ready", waits for "go" on stdin (the
# samples are then in its rings), takes everything and prints its count per CPU.
SHARD = """
import json, sys, aperf
pin, cpus = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
counts = dict.fromkeys(cpus, 0)
def on_sample(sample):
    counts[sample.cpu] += 1
def on_lost(lost):
    print("lost", lost.cpu, lost.count, flush=True)
with aperf.PerfBuffer(pin, pages=64, cpus=cpus, on_sample=on_sample, on_lost=on_lost) as pb:
    print("ready", flush=True)
    sys.stdin.readline()
    pb.consume()
print(json.dumps(counts), flush=True)
"""


class Shard:
    def __init__(self, pin: str, cpus: list[int]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SHARD, pin, ",".join(map(str, cpus))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            pytest.fail(f"the shard did not start: {line!r} {self.proc.communicate()[1]}")

    def counts(self) -> dict[int, int]:
        out, err = self.proc.communicate("go\n", timeout=60)
        assert self.proc.returncode == 0, err
        return {int(cpu): n for cpu, n in json.loads(out.strip().splitlines()[-1]).items()}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@pytest.fixture
def pin(producer: Producer) -> Iterator[str]:
    yield from pinned(producer, "shards")


@pytest.fixture
def two_cpus() -> None:
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("two shards need CPUs 0 and 1")


@pytest.mark.kernel
def test_two_shards_in_two_processes_get_exactly_their_cpus_samples(
    producer: Producer, pin: str, two_cpus: None
) -> None:
    shards = [Shard(pin, [0]), Shard(pin, [1])]
    try:
        producer.emit(1000, cpu=0)
        producer.emit(700, cpu=1)
        counts = [shard.counts() for shard in shards]
    finally:
        for shard in shards:
            shard.kill()
    assert counts == [{0: 1000}, {1: 700}]
    assert sum(n for c in counts for n in c.values()) == 1700
    assert producer.counters().failed == 0  # every sample found its CPU's ring


@pytest.mark.kernel
def test_disjoint_shards_open_and_an_overlapping_one_is_refused_naming_the_holder(
    producer: Producer, pin: str, two_cpus: None
) -> None:
    holder = Shard(pin, [0])
    try:
        # CPU 1 is free: a second shard of the map, in this process, is a compatible owner.
        with aperf.PerfBuffer(pin, pages=8, cpus=[1], on_sample=lambda s: None) as other:
            producer.emit(5, cpu=1)
            assert other.consume() == 5
        with pytest.raises(aperf.BusyResourceError) as caught:
            aperf.PerfBuffer(pin, pages=8, cpus=[0, 1], on_sample=lambda s: None).close()
        assert f"is read by pid {holder.proc.pid} " in str(caught.value)
        producer.emit(3, cpu=0)  # the holder still has CPU 0
        assert holder.counts() == {0: 3}
    finally:
        holder.kill()
