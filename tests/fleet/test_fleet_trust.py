"""What one party can make a fleet reader do (issue 29, "the fleet reader"), against a
real nats-server: the messages come from a connection of their own, as from anyone
allowed to publish on a host's subject, or from a sink.

- memory: no message costs the reader more than a stated multiple of its size,
  whatever it claims (tracemalloc's peak while every event of it is handed out);
- state: what the reader keeps per sink run is bounded, and what it drops is said;
- trust: nothing of a refused message is applied; with host keys only signed
  messages are taken; without, no sender is believed for being seen first;
- subjects: two host names never share a subject;
- lost counts: what a host claims fits a signed 64-bit int, totals too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import shutil
import signal
import struct
import subprocess
import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import nats
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import aperf
from aperf.fleet import (
    FleetConfigError,
    FleetEvent,
    FleetReader,
    FrameError,
    Gap,
    JetStreamSink,
    Malformed,
    create_stream,
)
from aperf.fleet._clock import BOOT_OFFSET_HEADER
from aperf.fleet._signing import SIGNATURE_HEADER, public_line, sign
from aperf.fleet._wire import HEADER, MAGIC, MAX_EVENTS, SAMPLES, Framer, parse, subject_token
from aperf.fleet.testing import NatsServer

from ..helpers import asyncio_only
from .test_fleet import SEQ_TS, Fleet, forged, read_fleet, running_server, seq_sample

ONE_LOOP = pytest.mark.anyio  # asyncio alone (anyio_backend below): slow under tracemalloc


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """asyncio alone for the ONE_LOOP tests (the others say asyncio_only: both of
    asyncio's loops, as nats-py needs)."""
    return ("asyncio", {})


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    with running_server(tmp_path / "nats") as server:
        yield server


def samples_message(host: bytes, stream: bytes, lengths: list[int], epoch: int = 7,
                    first: int = 0) -> bytes:
    """A well-formed samples message (one run, CPU 0) of samples of these lengths, as
    anyone can frame one (the header claims what it likes)."""
    count = len(lengths)
    header = HEADER.pack(MAGIC, SAMPLES, len(host), len(stream), epoch, first, first, first,
                         0, count, 1, bytes(8), bytes(8))
    body = struct.pack("<II", 0, count) + struct.pack(f"<{count}H", *lengths)
    return header + host + stream + body + b"".join(bytes(n) for n in lengths)


async def raw_publish(url: str, messages: Sequence[tuple[str, bytes, dict[str, str] | None]]
                      ) -> list[int]:
    """Publish from a connection of its own, each stored (JetStream's ack awaited)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        return [(await js.publish(s, p, headers=h)).seq for s, p, h in messages]
    finally:
        await nc.close()


async def read_all(reader: FleetReader, done: Callable[[list[FleetEvent]], bool],
                   timeout: float = 60.0) -> list[FleetEvent]:
    got: list[FleetEvent] = []

    async def loop() -> None:
        async for item in reader:
            got.append(item)
            if done(got):
                return

    await asyncio.wait_for(loop(), timeout)
    return got


class _Failing:
    """A decoder without a size that fails on every sample: each is a BadSample."""

    def __call__(self, data: bytes) -> Any:
        raise ValueError("not an event")


# --- memory --------------------------------------------------------------------------------


@ONE_LOOP
async def test_no_message_costs_the_reader_more_than_a_small_multiple_of_its_size(
    nats_server: NatsServer,
) -> None:
    """The issue's message (1 MB of 2-byte zero-length samples: 524,000 of them) cost
    the reader 386 MiB with the tracer's decoder, 3 GiB for eight. Now: refused by
    the wire's limit (a message holds at most 65,535 samples: a sink's largest batch);
    the largest it may hold is built a chunk at a time; samples shorter than a sized
    decoder are one notice per message. Every event is handed out, and tracemalloc's
    peak stays within twice the messages fetched, plus 2 MiB."""
    url = nats_server.url
    await create_stream(url)
    huge = samples_message(b"m", b"s", [0] * 524_000)  # 1,048,091 bytes
    most = samples_message(b"m", b"s", [0] * MAX_EVENTS, epoch=8)  # 131,161 bytes
    wide = samples_message(b"m", b"s", [13] * MAX_EVENTS, epoch=9)  # 983,116 bytes
    payloads = [huge] * 4 + [most, wide]
    await raw_publish(url, [("aperf.m.s", p, None) for p in payloads])
    async with JetStreamSink(url, host="g", name="s") as sink:  # the end marker
        await sink.send([seq_sample(0, 0)])

    async def count(reader: FleetReader, counted: Counter[str], notices: list[Malformed]
                    ) -> None:  # keeps no event: only the reader's count
        async for host, _, event in reader:
            counted[type(event).__name__] += 1
            if isinstance(event, Malformed):
                notices.append(event)
            if host == "g":
                return

    for name, decoder in (("sized", SEQ_TS), ("failing", _Failing()), ("raw", None)):
        counted: Counter[str] = Counter()
        notices: list[Malformed] = []

        gc.collect()
        tracemalloc.start()
        try:
            async with FleetReader(url, durable=f"mem-{name}", decoder=decoder) as reader:
                await asyncio.wait_for(count(reader, counted, notices), 120)
                peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        stats = reader.statistics()
        print(f"\n{name}: {counted}; tracemalloc peak {peak / 2**20:.2f} MiB for "
              f"{sum(map(len, payloads)) / 2**20:.2f} MiB of forged messages")
        # Measured 7.0-7.2 MiB for the 5.06 MiB of messages one fetch brought (every
        # message: its size and under 1 KB; the chunk of events being handed out;
        # nats-py's read buffer). Before: 386 MiB for one 1 MB message.
        assert peak < 2 * sum(map(len, payloads)) + (2 << 20), peak
        # The 524,000-sample messages: refused, each one notice.
        assert sum("a message holds at most 65535" in n.reason for n in notices) == 4
        if name == "sized":  # shorter than the decoder: one notice per message
            assert stats.short == 2 * MAX_EVENTS and len(notices) == 6
            assert counted["Sample"] == 1 and counted["BadSample"] == 0
        else:  # handed out, one event per sample
            kind = "BadSample" if name == "failing" else "Sample"
            assert counted[kind] == 2 * MAX_EVENTS + 1  # and the sink's sample


# --- state ---------------------------------------------------------------------------------


@ONE_LOOP
async def test_state_per_run_is_bounded_and_what_is_forgotten_is_said(
    nats_server: NatsServer,
) -> None:
    """20,000 messages each claiming a run of its own left 15.9 MB behind in the
    reader; a run that ended stayed too. Now at most 8 runs per host stream are kept
    (each one dropped is a notice), and a run is dropped at its end."""
    url = nats_server.url
    await create_stream(url)
    n = 20_000
    nc = await nats.connect(url)
    try:
        for i in range(n):  # fire and forget, then wait for the stream to hold them
            await nc.publish("aperf.m.s", samples_message(b"m", b"s", [16], epoch=1000 + i))
        await nc.flush()
        js = nc.jetstream()
        for _ in range(600):
            if (await js.stream_info("APERF")).state.messages >= n:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    async with JetStreamSink(url, host="g", name="s") as sink:  # a run that ends
        await sink.send([seq_sample(0, 0)])

    gc.collect()
    tracemalloc.start()
    try:
        counted: Counter[str] = Counter()
        reasons: Counter[str] = Counter()

        async def count(reader: FleetReader) -> None:  # keeps no event
            async for host, _, event in reader:
                counted[type(event).__name__] += 1
                if isinstance(event, Malformed):
                    reasons[event.reason.split(" is no longer tracked ")[-1]] += 1
                if host == "g":
                    return

        async with FleetReader(url, durable="state", decoder=SEQ_TS, fetch_timeout=0.5) as r:
            base = tracemalloc.get_traced_memory()[0]
            await asyncio.wait_for(count(r), 300)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
            print(f"\n{n} runs: {counted}; the reader holds {held} bytes after them")
            assert held < 1 << 20  # 15.9 MB before
            # The sink's end of stream comes next: it gives no event, and its run is
            # dropped once settled (the reader asks the consumer at most once a second).
            events = aiter(r)
            for _ in range(5):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(anext(events), 1.0)  # a timeout ends nothing
                if r._intake.runs <= 8:
                    break
            stats = r.statistics()
            runs = r._intake.runs
    finally:
        tracemalloc.stop()
    assert counted["Sample"] == n + 1
    assert reasons == {"(more than 8 runs of this host's stream): a later message of it "
                       "starts the run anew, unchecked, and a hole in it is not reported":
                       n - 8}
    assert stats.evicted == n - 8
    assert stats.sources == n + 1
    assert runs == 8  # the last 8 forged runs; the sink's, ended, dropped


def test_the_runs_and_ranges_a_reader_keeps_are_bounded_without_a_server() -> None:
    """The intake alone, with small limits: runs in all, ranges per run and in all."""
    from aperf.fleet._intake import Delivery, Intake, Limits

    intake = Intake(prefix="aperf", decoder=None,
                    limits=Limits(runs_per_stream=3, runs=5, ranges_per_run=4, ranges=12))
    seq = 0

    def give(payload: bytes, subject: str) -> list[FleetEvent]:
        nonlocal seq
        seq += 1
        intake.accept(Delivery(subject, payload, None, seq, 1, seq))
        out: list[FleetEvent] = []
        while batch := intake.hand(100):
            out += batch
        return out

    for host in "abcdefg":  # 7 hosts, a run each: at most 5 runs in all
        give(samples_message(host.encode(), b"s", [1]), f"aperf.{host}.s")
    assert intake.runs == 5 and intake.counts.evicted == 2
    for first in range(10, 200, 10):  # one run, disjoint ranges: at most 4 kept
        out = give(samples_message(b"g", b"s", [1], first=first), "aperf.g.s")
        assert [type(e.event) for e in out].count(aperf.Sample) == 1
    track = intake._runs[("g", "s", 7)].track
    assert len(track) == 4 and intake._ranges <= 12
    assert intake.counts.evicted > 2


# --- trust ---------------------------------------------------------------------------------


@pytest.mark.anyio
@asyncio_only
async def test_nothing_of_a_refused_message_is_applied(nats_server: NatsServer) -> None:
    """A refused message's Aperf-Boot-Offset-Ns set the host's clock offset (every
    event time of that host moved); its run was created too. Now neither."""
    url = nats_server.url
    await create_stream(url)
    forged_offset = {BOOT_OFFSET_HEADER: "-999999999999"}
    async with JetStreamSink(url, host="web-1", name="perf") as sink:
        await sink.send([seq_sample(0, i) for i in range(6)])
        await sink.flush()
        genuine_offset = sink._headers[BOOT_OFFSET_HEADER]
        run = sink.epoch
        seqs = await raw_publish(url, [
            # on another host's subject: refused
            ("aperf.mallory.x", forged("web-1", "perf", run, 6, range(90, 93)), forged_offset),
            # the run's next events, not following its chain: refused (the last message
            # with an offset: the sink's end of stream has none)
            ("aperf.web-1.perf", forged("web-1", "perf", run, 6, range(90, 93)),
             forged_offset),
        ])
    fleet = Fleet()
    async with FleetReader(url, durable="apply", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: len(fleet.seqs["web-1"]) >= 6
                         and len(fleet.notices) >= 2)
        offset = reader.boot_offset_ns("web-1")
        stats = reader.statistics()
    assert fleet.seqs["web-1"] == list(range(6))
    assert sorted(n.stream_sequence for _, _, n in fleet.notices) == seqs
    assert stats.refused == 2 and stats.sources == 1
    assert offset == int(genuine_offset)  # -999999999999 before


@pytest.mark.anyio
@asyncio_only
async def test_a_restarted_reader_without_keys_drops_no_genuine_message(
    nats_server: NatsServer,
) -> None:
    """The chain bound a run to whichever sender the reader saw first: after a restart
    (the durable consumer goes on mid-run) a forged continuation was trusted, the
    sink's own message dropped as a duplicate and the next one refused. Now a reader
    that meets a run in its middle trusts no sender: both are handed out, and the
    conflict is said."""
    url = nats_server.url
    await create_stream(url)
    async with JetStreamSink(url, host="web-1", name="perf") as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])
        await sink.flush()
        first = Fleet()
        async with FleetReader(url, durable="restart", decoder=SEQ_TS) as reader:
            await read_fleet(reader, first, lambda: len(first.seqs["web-1"]) >= 10)
        # The reader is down; a forger claims the run's next events first.
        await raw_publish(url, [("aperf.web-1.perf",
                                 forged("web-1", "perf", sink.epoch, 10, range(90, 100)), None)])
        await sink.send([seq_sample(0, i) for i in range(10, 20)])
        await sink.flush()
        await sink.send([seq_sample(0, i) for i in range(20, 30)])
    again = Fleet()
    async with FleetReader(url, durable="restart", decoder=SEQ_TS) as reader:
        await read_fleet(reader, again, lambda: 29 in again.seqs["web-1"])
        stats = reader.statistics()
    genuine = [s for s in again.seqs["web-1"] if s < 90]
    assert genuine == list(range(10, 30))  # before: 10..29 dropped and refused
    assert stats.conflicts == 1 and stats.refused == 0
    assert "one of the two is forged" in again.notices[0][2].reason


@pytest.mark.anyio
@asyncio_only
async def test_with_host_keys_only_messages_signed_by_their_host_are_taken(
    nats_server: NatsServer, tmp_path: Path,
) -> None:
    """End-to-end authenticity: the sink signs every message; a reader given the hosts'
    public keys refuses the unsigned, the mis-signed, another host's key, a signature
    moved onto another payload, a fresh run of a forger's, a forged continuation
    after a restart; the genuine events all come, once."""
    url = nats_server.url
    await create_stream(url)
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    key_file = tmp_path / "web-1.key"
    from aperf.fleet._signing import write_key

    write_key(key, str(key_file))
    hosts = tmp_path / "hosts"
    hosts.write_text(f"# fleet hosts\n{public_line('web-1', key)}\n"
                     f"{public_line('web-2', other)}\n")
    subject = "aperf.web-1.perf"
    async with JetStreamSink(url, host="web-1", name="perf", signing_key=key_file) as sink:
        await sink.send([seq_sample(0, i) for i in range(10)])
        await sink.flush()
        run = sink.epoch
        payload = forged("web-1", "perf", run, 10, range(90, 100))
        genuine_sig = sign(key, subject, None, forged("web-1", "perf", run, 0, range(10)))
        fresh = forged("web-1", "perf", 4242, 0, range(80, 90))
        seqs = await raw_publish(url, [
            (subject, payload, None),  # unsigned
            (subject, payload, {SIGNATURE_HEADER: sign(other, subject, None, payload)}),
            (subject, payload, {SIGNATURE_HEADER: genuine_sig}),  # another payload's
            (subject, payload, {SIGNATURE_HEADER: "not base64!"}),
            (subject, fresh, None),  # a run of the forger's own
            (subject, fresh, {SIGNATURE_HEADER: sign(other, subject, None, fresh)}),
            ("aperf.web-3.perf", forged("web-3", "perf", 1, 0, range(3)), None),  # no key
        ])
        await sink.send([seq_sample(0, i) for i in range(10, 20)])
    fleet = Fleet()
    async with FleetReader(url, durable="keyed", decoder=SEQ_TS, host_keys=hosts) as reader:
        await read_fleet(reader, fleet, lambda: len(fleet.seqs["web-1"]) >= 20
                         and len(fleet.notices) >= len(seqs))
        stats = reader.statistics()
    assert fleet.seqs == {"web-1": list(range(20))}
    by_seq = {n.stream_sequence: n.reason for _, _, n in fleet.notices}
    assert sorted(by_seq) == seqs
    reasons = [by_seq[s] for s in seqs]
    assert "it is not signed" in reasons[0] and "it is not signed" in reasons[4]
    assert "does not verify with the host's key" in reasons[1]
    assert "does not verify with the host's key" in reasons[2]
    assert "not base64" in reasons[3]
    assert "does not verify" in reasons[5]
    assert "no key was given for host 'web-3'" in reasons[6]
    assert stats.refused == len(seqs) and stats.conflicts == 0

    # A reader that starts mid-run (a restart) takes the signed run where it meets it.
    async with JetStreamSink(url, host="web-1", name="perf", signing_key=key) as sink:
        await sink.send([seq_sample(0, i) for i in range(100, 110)])
        await sink.flush()
        later = Fleet()
        async with FleetReader(url, durable="keyed", decoder=SEQ_TS, host_keys=hosts) as r:
            await read_fleet(r, later, lambda: len(later.seqs["web-1"]) >= 10)
        await raw_publish(url, [(subject, forged("web-1", "perf", sink.epoch, 10,
                                                  range(90, 100)), None)])
        await sink.send([seq_sample(0, i) for i in range(110, 120)])
    after = Fleet()
    async with FleetReader(url, durable="keyed", decoder=SEQ_TS, host_keys=hosts) as r:
        await read_fleet(r, after, lambda: len(after.seqs["web-1"]) >= 10)
    assert after.seqs == {"web-1": list(range(110, 120))}
    assert len(after.notices) == 1 and "it is not signed" in after.notices[0][2].reason

    # Keys that cannot be used are one clear error, before anything connects.
    loose = tmp_path / "loose.key"
    write_key(key, str(loose))
    loose.chmod(0o644)
    with pytest.raises(FleetConfigError, match="may be read by others") as info:
        JetStreamSink(url, host="web-1", signing_key=loose)
    assert info.value.argument == "signing_key"
    (tmp_path / "bad-hosts").write_text("web-1 ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ\n")
    with pytest.raises(FleetConfigError, match="bad-hosts:1: not an ssh-ed25519") as info:
        FleetReader(url, host_keys=tmp_path / "bad-hosts")
    assert info.value.argument == "host_keys"


@pytest.mark.anyio
@asyncio_only
async def test_a_message_below_where_the_reader_came_in_is_handed_out_once(
    nats_server: NatsServer,
) -> None:
    """A sink's retry stored after later messages (a reconnect) and stored twice (after
    the de-duplication window): below the first message the reader saw, it was
    handed out unchecked, and twice. Now once."""
    url = nats_server.url
    await create_stream(url)
    framer = Framer("web-1", "perf", 77, max_events=5, max_bytes=100_000)
    outs = framer.frame([seq_sample(0, i) for i in range(15)], 0)  # events 0..4, 5..9, 10..14
    subject = "aperf.web-1.perf"
    # Stored in this order: 10..14 (the first the reader sees), 5..9, 5..9 again.
    await raw_publish(url, [(subject, outs[2].payload, None), (subject, outs[1].payload, None),
                            (subject, outs[1].payload, None)])
    async with JetStreamSink(url, host="end", name="perf") as sink:
        await sink.send([seq_sample(0, 0)])
    fleet = Fleet()
    async with FleetReader(url, durable="floor", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: len(fleet.seqs["end"]) >= 1)
        stats = reader.statistics()
    assert fleet.seqs["web-1"] == [10, 11, 12, 13, 14, 5, 6, 7, 8, 9]  # 5..9 twice before
    assert stats.duplicates == 1 and fleet.gaps == []


# --- subjects ------------------------------------------------------------------------------


@pytest.mark.anyio
@asyncio_only
async def test_two_host_names_never_share_a_subject(nats_server: NatsServer) -> None:
    """Every character outside [A-Za-z0-9_-] became "_": hosts web.1 and web_1 shared
    aperf.web_1.*, so either could publish as the other. Now each name has a subject
    of its own (an injective escape: web.1 is aperf.web%2E1.*)."""
    assert subject_token("web.1") == "web%2E1" and subject_token("web_1") == "web_1"
    assert subject_token("a%2E") == "a%252E" and subject_token("ü") == "%C3%BC"
    url = nats_server.url
    await create_stream(url)
    async with JetStreamSink(url, host="web.1", name="perf") as dotted, \
            JetStreamSink(url, host="web_1", name="perf") as plain:
        assert (dotted.subject, plain.subject) == ("aperf.web%2E1.perf", "aperf.web_1.perf")
        await dotted.send([seq_sample(0, 1)])
        await plain.send([seq_sample(0, 2)])
        # web_1, allowed on aperf.web_1.>, publishes a message claiming web.1:
        seq, = await raw_publish(url, [("aperf.web_1.perf",
                                        forged("web.1", "perf", 5, 0, range(900, 903)), None)])
    fleet = Fleet()
    async with FleetReader(url, durable="names", decoder=SEQ_TS) as reader:
        await read_fleet(reader, fleet, lambda: len(fleet.seqs["web.1"]) >= 1
                         and len(fleet.seqs["web_1"]) >= 1 and len(fleet.notices) >= 1)
    assert fleet.seqs == {"web.1": [1], "web_1": [2]}  # 900..902 as web.1's before
    [(host, _, notice)] = fleet.notices
    assert (host, notice.stream_sequence) == ("web_1", seq)
    assert "whose subject is 'aperf.web%2E1.perf'" in notice.reason


# --- lost counts ---------------------------------------------------------------------------


@pytest.mark.anyio
@asyncio_only
async def test_what_a_host_claims_about_its_losses_fits_and_adds_up(
    nats_server: NatsServer,
) -> None:
    """A valid Lost of 2^64-1 was accepted. A host may claim any losses of its own (no
    reader can check them), but a run's lost total now fits a signed 64-bit int: a
    message claiming more is not a frame, and the reader's totals stop at 2^63-1."""
    top = (1 << 63) - 1
    over = HEADER.pack(MAGIC, 2, 1, 1, 3, 0, 0, 0, 1 << 63, 1, 0, bytes(8), bytes(8)) + b"hs" + \
        struct.pack("<IQ", 0, 0)  # a lost total of 2^63 before it
    with pytest.raises(FrameError, match=r"beyond 2\^63-1"):
        parse(over)
    framer = Framer("h", "s", 1, max_events=8, max_bytes=10_000)
    with pytest.raises(ValueError, match=r"past 9223372036854775807"):
        framer.frame([aperf.Lost(0, (1 << 64) - 1)], 0)
    assert framer.next_seq == 0  # refused before anything was numbered
    url = nats_server.url
    await create_stream(url)
    huge = HEADER.pack(MAGIC, 2, 1, 1, 3, 0, 0, 0, 0, 1, 0, bytes(8), bytes(8)) + b"hs" + \
        struct.pack("<IQ", 0, (1 << 64) - 1)
    most = [Framer("h", "s", e, max_events=8, max_bytes=10_000).frame([aperf.Lost(0, top)],
                                                                        0)[0].payload
            for e in (1, 2)]
    seqs = await raw_publish(url, [("aperf.h.s", huge, None)]
                             + [("aperf.h.s", p, None) for p in most])
    got: list[FleetEvent] = []
    async with FleetReader(url, durable="lost") as reader:
        got = await read_all(reader, lambda g: len(g) >= 3)
        stats = reader.statistics()
    assert isinstance(got[0].event, Malformed) and got[0].event.stream_sequence == seqs[0]
    assert "beyond 2^63-1" in got[0].event.reason  # accepted before
    assert [e.event for e in got[1:]] == [aperf.Lost(0, top)] * 2
    assert stats.lost == top  # two runs of 2^63-1 each: the total stops there
    assert all(not isinstance(e.event, Gap) for e in got)


# --- the commands --------------------------------------------------------------------------


def test_the_tracer_signs_and_the_viewer_shows_only_what_its_host_signed(
    tracefs: None, nats_server: NatsServer, tmp_path: Path,
) -> None:
    """``python -m aperf.fleet keygen``, ``aperf-trace --nats-signing-key`` and
    ``fleet_view --nats-host-keys``: the probe's exec and exit from the signing tracer
    are shown; an unsigned exec published on the same host's subject is not (a line
    on stderr says why); a key others may read is one line and status 2."""
    from aperf._tools.trace.cli import FLEET_STREAM, shipped_object
    from aperf._tools.trace.render import event_decoder

    from ..helpers import REPO
    from ..kernel.test_tracer import HEADER as TRACER_HEADER
    from ..kernel.test_tracer import parse_row
    from .test_fleet import Lines, exec_event_bytes

    url = nats_server.url
    asyncio.run(create_stream(url))
    key = tmp_path / "alpha.key"
    made = subprocess.run([sys.executable, "-m", "aperf.fleet", "keygen", "--host", "alpha",
                           "--key", str(key)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0 and made.stdout.startswith("alpha ssh-ed25519 "), made.stderr
    assert key.stat().st_mode & 0o777 == 0o600
    hosts = tmp_path / "fleet-hosts"
    hosts.write_text(made.stdout)
    with aperf.BPFObject(shipped_object()) as obj:
        forged_exec = exec_event_bytes(event_decoder(obj), 4242, 1)
    payload = Framer("alpha", FLEET_STREAM, 99, max_events=8, max_bytes=100_000).frame(
        [aperf.Sample(0, forged_exec)], 0)[0].payload
    probe = tmp_path / "signedprobe"
    shutil.copy("/bin/true", probe)
    header = "HOST             " + TRACER_HEADER
    with (
        Lines("examples.fleet_view", "--nats", url, "--nats-host-keys", str(hosts)) as viewer,
        Lines("aperf", "trace", "--nats", url, "--host", "alpha",
              "--nats-signing-key", str(key)) as tracer,
    ):
        tracer.read_until(lambda seen: TRACER_HEADER in seen)
        viewer.read_until(lambda seen: header in seen)
        seq, = asyncio.run(raw_publish(url, [(f"aperf.alpha.{FLEET_STREAM}", payload, None)]))
        probe_proc = subprocess.Popen([probe])
        probe_proc.wait()

        def rows() -> list[tuple[str, Any]]:
            return [(line[:16].rstrip(), parse_row(line[17:]))
                    for line in viewer.seen[viewer.seen.index(header) + 1:]]

        viewer.read_until(lambda _: {r.event for h, r in rows() if r.pid == probe_proc.pid}
                          == {"EXEC", "EXIT"})
        assert {h for h, _ in rows()} == {"alpha"}
        assert not any(r.pid == 4242 for _, r in rows())  # the unsigned exec
        assert tracer.stop(signal.SIGINT) == 0 and viewer.stop(signal.SIGTERM) == 0
        assert viewer.proc.stderr is not None
        said = viewer.proc.stderr.read()
    assert f"message {seq} not shown: it is not signed: refused (host_keys)" in said

    key.chmod(0o644)
    loose = subprocess.run([sys.executable, "-m", "aperf", "trace", "--nats", url, "--host",
                            "alpha", "--nats-signing-key", str(key)], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert loose.returncode == 2 and loose.stdout == ""
    [line] = loose.stderr.strip().splitlines()
    assert "--nats-signing-key" in line and "may be read by others" in line
