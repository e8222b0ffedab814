"""aperf.fleet on a real three-node JetStream cluster (three nats-server processes on
loopback, routed, each with its own store), started by the tests.

The kernel tests count exactly, as tests/fleet/test_fleet.py's restart test does: every
sample the producer emitted is received once by a reader connected to another node
than the sink's, or counted as lost by the kernel (a forwarded Lost notice), as
dropped by the sink, or as a Gap. The faults: the stream's leader SIGKILLed mid-
stream, and two of the three nodes down for a few seconds (no quorum) and back.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

import aperf
from aperf.fleet import (
    FleetConfigError,
    FleetReader,
    FleetUnavailableError,
    JetStreamSink,
    create_stream,
)
from aperf.fleet._wire import parse
from aperf.fleet.testing import NatsCluster, nats_server_path
from aperf.testing import Producer

from ..helpers import REPO, REQUIRE_BPF
from .test_fleet import (
    OTHER_CPU,
    SEQ_TS,
    Fleet,
    assert_unique,
    join,
    paced,
    read_fleet,
    seq_sample,
    until,
)

ONE_LOOP = pytest.mark.anyio  # on asyncio alone (anyio_backend below): the time budget


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """These slow tests run on one loop, asyncio (nats-py is asyncio's)."""
    return ("asyncio", {})


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    if nats_server_path() is None:
        message = "nats-server is not installed (scripts/setup.sh installs it)"
        if REQUIRE_BPF:
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    with NatsCluster(tmp_path / "cluster") as nodes:
        yield nodes


async def stream_config(urls: list[str], name: str = "APERF") -> tuple[int, int, float | None]:
    nc = await nats.connect(urls)
    try:
        config = (await nc.jetstream().stream_info(name)).config
        return config.num_replicas or 1, config.max_bytes or -1, config.max_age
    finally:
        await nc.close()


async def stream_leader(urls: list[str]) -> str:
    """The name of the node leading stream APERF (an election may be under way: wait)."""
    nc = await nats.connect(urls)
    try:
        for _ in range(200):
            info = await nc.jetstream().stream_info("APERF")
            if info.cluster is not None and info.cluster.leader:
                return info.cluster.leader
            await asyncio.sleep(0.05)
        raise AssertionError("stream APERF has no leader")
    finally:
        await nc.close()


def create_stream_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aperf.fleet", "create-stream", *args],
        cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )


def test_replicas_are_kept_by_every_update(cluster: NatsCluster) -> None:
    urls = cluster.urls
    info = asyncio.run(create_stream(urls, replicas=3, max_age=3600.0))
    assert info.config.num_replicas == 3
    # Resizing, as docs/fleet.md says to: nothing else changes (it used to become R1).
    asyncio.run(create_stream(urls, max_bytes=5_000_000))
    assert asyncio.run(stream_config(urls)) == (3, 5_000_000, 3600.0)
    resized = create_stream_cli("--nats", ",".join(urls), "--max-bytes", "6000000")
    assert resized.returncode == 0, resized.stderr
    assert "3 replica(s)" in resized.stderr
    assert asyncio.run(stream_config(urls)) == (3, 6_000_000, 3600.0)
    # Asked explicitly, the replicas change (down too).
    asyncio.run(create_stream(urls, replicas=1))
    assert asyncio.run(stream_config(urls))[0] == 1
    # New streams: 1 replica unless told, --replicas N from the command line.
    new = asyncio.run(create_stream(urls, jetstream="R1", subject_prefix="r1"))
    assert new.config.num_replicas == 1
    made = create_stream_cli("--nats", urls[1], "--jetstream", "R3", "--subject-prefix", "r3",
                             "--replicas", "3")
    assert made.returncode == 0, made.stderr
    assert asyncio.run(stream_config(urls, "R3"))[:2] == (3, 1 << 30)
    with pytest.raises(ValueError, match="replicas"):
        asyncio.run(create_stream(urls, replicas=0))
    refused = create_stream_cli("--nats", urls[0], "--jetstream", "R3", "--memory")
    assert refused.returncode == 1  # JetStream cannot change a stream's storage: one line
    assert len(refused.stderr.strip().splitlines()) == 1 and "R3" in refused.stderr


def test_open_without_quorum_waits_then_says_what_the_server_said(
    cluster: NatsCluster, tracefs: None
) -> None:
    asyncio.run(create_stream(cluster.urls, replicas=3))
    # n1 alone, started again after all three stopped: every node runs -js, and there
    # is no quorum to elect a leader. (Right after the two others die, the leaders on
    # n1 may still answer for a while: a cluster noticing is not what is tested here.)
    cluster.kill()
    cluster.node("n1").start()
    url = cluster.node("n1").url

    async def refused() -> None:
        for thing in (JetStreamSink(url, host="h", ready_timeout=1.5),
                      FleetReader(url, ready_timeout=1.5)):
            with pytest.raises(FleetUnavailableError, match=r"did not serve within 1\.5 s") as info:
                await thing.open()
            assert isinstance(info.value, FleetConfigError)
            assert "-js" not in str(info.value) and info.value.argument == "servers"

    asyncio.run(refused())
    for command, status in (("examples.fleet_view", 1), ("aperf", 1)):  # cannot run: 1
        args = [command, "trace"] if command == "aperf" else [command]
        result = subprocess.run(
            [sys.executable, "-m", *args, "--nats", url, "--nats-wait", "1.5"],
            cwd=REPO, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )
        assert result.returncode == status and result.stdout == "", result.stderr
        [line] = result.stderr.strip().splitlines()  # one line, no traceback
        assert "did not serve within 1.5 s" in line and "-js" not in line

    async def waits() -> None:
        # Opened during the outage: it waits, and opens once the quorum is back.
        reader = FleetReader(url, durable="patient", ready_timeout=60)
        opening = asyncio.ensure_future(reader.open())
        await asyncio.sleep(1.0)
        assert not opening.done()
        for name in ("n2", "n3"):
            await asyncio.to_thread(cluster.node(name).start)
        await asyncio.wait_for(opening, 60)
        await reader.aclose()

    asyncio.run(waits())


async def forward_through_faults(
    cluster: NatsCluster, producer: Producer, fault: str
) -> None:
    """A paced producer's samples through a sink on n1 and a reader on n3 (or n2),
    with ``fault`` done once 5 000 samples are acknowledged; exact accounting."""
    await create_stream(cluster.urls, replicas=3)
    sink_node, reader_node = "n1", "n3" if fault != "two-down" else "n2"
    sink_url, reader_url = cluster.node(sink_node).url, cluster.node(reader_node).url
    chunks, chunk = 120, 500  # 60 000 samples over about a second
    produced = chunks * chunk + 1
    seen = Fleet()
    # ack_wait: a delivery lost with its node comes back this soon (60 s by default).
    reader = FleetReader(reader_url, durable="live", decoder=SEQ_TS, ready_timeout=30,
                         ack_wait=5.0)
    await reader.open()
    reading = asyncio.ensure_future(
        read_fleet(reader, seen, lambda: seen.accounted("c") >= produced, 90)
    )
    async with (
        JetStreamSink(sink_url, host="c", window=4, ack_timeout=0.5) as sink,
        aperf.PerfStream(producer.map, pages=64, max_pending=1024) as stream,
    ):
        forward = asyncio.ensure_future(sink.forward(stream))
        emitting = paced(producer, chunks, chunk, 0.005)
        await until(lambda: sink.statistics().samples_acknowledged >= 5_000, "traffic")
        if fault == "leader":
            leader = await stream_leader([sink_url])
            cluster.node(leader).kill()  # mid-stream, no goodbye
            print(f"\nkilled the stream leader {leader}")
        elif fault == "two-down":
            for name in ("n2", "n3"):
                cluster.node(name).kill()
            await asyncio.sleep(2.0)  # no quorum: the sink waits, the kernel counts drops
            for name in ("n2", "n3"):
                await asyncio.to_thread(cluster.node(name).start)
        await join(emitting)
        await until(lambda: stream.statistics().samples == producer.counters().ok, "drain", 60)
        producer.emit(1, size=32, cpu=OTHER_CPU)  # the kernel writes its lost record now
        counters = producer.counters()
        await until(
            lambda: sink.statistics().samples_acknowledged == counters.ok
            and sink.statistics().lost_forwarded == counters.failed,
            "everything acknowledged", 60,
        )
        stream.close()
        await forward
    await reading
    await reader.aclose()
    stats = sink.statistics()
    assert counters.ok + counters.failed == produced
    assert stats.dropped_samples == 0
    # A reader that starts afterwards, from the stream's first message: the R3 stream
    # lost nothing it acknowledged through the fault, so it has every sample the
    # kernel did not count as lost, once, and no Gap.
    after = Fleet()
    running = [server.url for server in cluster.servers if server.running]
    async with FleetReader(running, durable="after", decoder=SEQ_TS) as later:
        await read_fleet(later, after, lambda: after.accounted("c") >= produced)
    for name, fleet, r in (("live", seen, reader), ("after", after, later)):
        seqs = fleet.seqs["c"]
        assert_unique(seqs)  # duplicates (retries, redeliveries) dropped, none handed out twice
        fate = {
            "received": len(seqs),
            "lost in the kernel (Lost notices)": fleet.lost["c"],
            "dropped by the sink": stats.dropped_samples,
            "Gap": fleet.gap_samples["c"] + fleet.gap_lost["c"],
        }
        print(f"\n{fault}, {name} reader: {produced} samples: {fate}; {r.statistics()}")
        assert sum(fate.values()) == produced
        assert fleet.lost["c"] == counters.failed  # the kernel's own count, forwarded
        assert set(seqs) <= set(range(produced))
    assert after.gaps == [] and len(after.seqs["c"]) == counters.ok
    # The live reader too: a fetch in flight when its node died is redelivered, and no
    # Gap is said for it (2 of about 12 runs did before).
    assert seen.gaps == [] and len(seen.seqs["c"]) == counters.ok
    print(f"sink: {stats}")


@ONE_LOOP
async def test_cluster_a_gap_is_said_only_for_what_jetstream_no_longer_holds(
    cluster: NatsCluster,
) -> None:
    """A message the consumer delivered that the reader never received (its node died
    with the delivery on the way; here a connection on another node takes it and never
    acknowledges it) is still in the stream, and comes back after ack_wait. Meanwhile
    the stream's limits remove older messages (of another host), and the reader, told
    so, took the hole below the next message's watermark for one the limits made: a
    Gap for events JetStream still held, and the redelivery dropped as a duplicate.
    Now it asks the consumer first whether a delivery is on its way, and waits for it."""
    urls = cluster.urls
    await create_stream(urls, replicas=3, max_msgs=9)

    async def pad(n: int) -> None:  # another host's messages: what the limits remove
        async with JetStreamSink(urls, host="pad", batch=1) as other:
            for _ in range(n):
                await other.send([seq_sample(0, 0)])
                await other.flush()

    async with JetStreamSink(cluster.node("n1").url, host="c", batch=10) as sink:
        async def messages(start: int, stop: int) -> None:
            for i in range(start, stop):  # each framed once the one before is stored
                await sink.send([seq_sample(0, 10 * i + k) for k in range(10)])
                await sink.flush()

        await messages(0, 2)  # stream sequences 1, 2
        async with JetStreamSink(urls, host="pad", batch=1) as other:  # 3 and its end, 4
            await other.send([seq_sample(0, 0)])
        await messages(2, 6)  # 5..8: events 20..29 at 5, then watermarks 30, 40, 50; end 9
    seen = Fleet()
    async with FleetReader(cluster.node("n3").url, durable="live", decoder=SEQ_TS, batch=2,
                           subject="aperf.c.>", ack_wait=3.0, ready_timeout=30) as reader:
        await read_fleet(reader, seen, lambda: len(seen.seqs["c"]) >= 20)  # the first two
        thief = await nats.connect(cluster.node("n2").url)
        try:
            inbox = thief.new_inbox()
            sub = await thief.subscribe(inbox)
            await thief.publish("$JS.API.CONSUMER.MSG.NEXT.APERF.live",
                                json.dumps({"batch": 1}).encode(), reply=inbox)
            stolen = parse((await sub.next_msg(timeout=10)).data)
            assert (stolen.first, stolen.count) == (20, 10)  # never acknowledged
            await pad(3)  # 10..13; the stream keeps 9: sequences 1..4 go, 5 (20..29) stays
            await read_fleet(reader, seen, lambda: seen.accounted("c") >= 60)
        finally:
            await thief.close()
        stats = reader.statistics()
    assert seen.gaps == []  # Gap(first=20, count=10, samples=10, lost=0) before
    assert sorted(seen.seqs["c"]) == list(range(60))
    assert seen.seqs["c"][-10:] == list(range(20, 30))  # redelivered, after the rest
    assert (stats.gaps, stats.duplicates) == (0, 0)


@ONE_LOOP
async def test_cluster_leader_killed_mid_stream(
    cluster: NatsCluster, producer: Producer
) -> None:
    await forward_through_faults(cluster, producer, "leader")


@ONE_LOOP
async def test_cluster_two_of_three_nodes_down_and_back(
    cluster: NatsCluster, producer: Producer
) -> None:
    await forward_through_faults(cluster, producer, "two-down")


@ONE_LOOP
async def test_cluster_reader_on_another_node_than_the_sink(
    cluster: NatsCluster, producer: Producer
) -> None:
    await forward_through_faults(cluster, producer, "none")
