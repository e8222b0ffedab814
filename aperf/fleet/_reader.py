"""The fleet reader: one async stream of every host's events, from a durable JetStream consumer.

It pulls messages in batches, parses them, decodes samples with the decoder a
local ``PerfStream`` would use, and hands out ``FleetEvent``
tuples. A message is acknowledged once its last event has been handed out and
the consumer came back for the next one (or closed the reader): what a reader
stops in the middle of is redelivered to the next reader of the durable consumer.

Sequence numbers make it exact: duplicates (redeliveries, retries stored twice)
are dropped, and holes that can no longer fill are handed out as ``Gap``
events with the samples and lost counts they held (see ``_gaps.py``).

Every message is untrusted (anyone allowed on the subjects can publish): one
that does not parse, whose names disagree with its subject, or that fails its
run's chain of tags is acknowledged, counted and announced as a ``Malformed``
notice in the stream, never raised and never left to block the consumer. The gap
report assumes one reader per durable consumer; readers sharing one durable
each see only their share of the messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from itertools import repeat as _repeat
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .._decoding.decode import SizedDecoder
from .._errors import DecodeError
from .._events import BadSample, Sample
from .._log import log
from ._args import check_int, check_name, check_seconds
from ._clock import BOOT_OFFSET_HEADER, parse_boot_offset
from ._connect import (
    DEFAULT_JETSTREAM,
    DEFAULT_PREFIX,
    Path,
    Refusals,
    Servers,
    connect,
    credentials,
    ready,
    server_list,
    stream_info,
)
from ._errors import FleetClosedError, FleetConfigError, FrameError
from ._events import FleetEvent, Gap, Malformed, ReaderStatistics
from ._gaps import Hole, SourceTrack, Verdict
from ._wire import BAD, DROPPED, END, SAMPLES, Frame, parse, subject_token

Decoder = Callable[[bytes], Any]
DecoderChoice = Decoder | Mapping[str, Decoder | None] | None
_Key = tuple[str, str, int]  # host, stream, epoch
_Which = tuple[Any, ...]  # (key, first, tag) of a message, or ("notice", stream sequence)
_Done = tuple[Msg, _Which]  # a message, and which one, once its events are out
_RETRY_PAUSE = 0.2  # seconds between fetches while the server is away
_NEVER = 1 << 62
_tuple_new = tuple.__new__


@dataclass
class _Counts:
    messages: int = 0
    samples: int = 0
    lost: int = 0
    bad: int = 0
    gaps: int = 0
    gap_samples: int = 0
    gap_lost: int = 0
    duplicates: int = 0
    malformed: int = 0
    refused: int = 0
    conflicts: int = 0


class FleetReader:
    """Every host's events from JetStream stream ``jetstream``, as one async iterator.

    <!-- not run: a fragment, against a server at nats://nats:4222 (tests/fleet/test_fleet.py) -->
    ```python
    decoder = aperf.decoders.from_btf(aperf.BPFObject("tracer.bpf.o"), "event")
    async with FleetReader("nats://nats:4222", durable="viewer", decoder=decoder) as r:
        async for host, stream, event in r:
            ...
    ```

    ``decoder`` decodes the samples of every stream, or maps stream names to
    decoders (a missing name: raw bytes, ``value`` None). ``durable`` names the
    consumer (created on first use with ``ack_wait`` and ``max_ack_pending``, kept
    by JetStream across restarts of the reader and the server). ``subject`` filters
    (default ``<subject_prefix>.>``, every host and stream); ``batch`` is the most
    messages per fetch.

    A message the reader cannot use or refuses (not aperf's, a payload whose host or
    stream disagrees with its subject, a forgery its sink run's chain of tags shows)
    is yielded as a [`Malformed`][aperf.fleet.Malformed] notice, counted, and
    acknowledged: it never raises out of ``async for`` and never blocks the consumer.

    ``user``, ``password``, ``token``, ``creds``, the ``tls_*`` files,
    ``tls_handshake_first``, ``allow_insecure``, ``connect_timeout`` and
    ``ready_timeout`` are as for
    [`JetStreamSink`][aperf.fleet.JetStreamSink]: ``open()`` waits for a cluster
    electing a leader, up to ``ready_timeout``. A reader's user needs the JetStream
    API subjects of its stream and durable, and nothing on ``<subject_prefix>.>``
    (docs/fleet.md). A permission the server refuses while reading raises
    [`FleetAuthError`][aperf.fleet.FleetAuthError] out of the iteration.
    """

    def __init__(
        self,
        servers: Servers,
        *,
        jetstream: str = DEFAULT_JETSTREAM,
        durable: str = "aperf-fleet",
        subject: str | None = None,
        subject_prefix: str = DEFAULT_PREFIX,
        decoder: DecoderChoice = None,
        batch: int = 64,
        fetch_timeout: float = 1.0,
        ack_wait: float = 60.0,
        max_ack_pending: int = 1024,
        connect_timeout: float = 5.0,
        connect_options: Mapping[str, Any] | None = None,
        user: str | None = None,
        password: str | None = None,
        token: str | None = None,
        creds: Path | None = None,
        tls_ca: Path | None = None,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        ready_timeout: float = 10.0,
        tls_handshake_first: bool = False,
        allow_insecure: bool = False,
    ) -> None:
        self._servers = server_list(servers)
        check_name("jetstream", jetstream)
        check_name("durable", durable)
        self._max_ack_pending = check_int("max_ack_pending", max_ack_pending, 1, 1 << 20)
        self._batch = check_int("batch", batch, 1, max_ack_pending)
        self._fetch_timeout = check_seconds("fetch_timeout", fetch_timeout)
        self._ack_wait = check_seconds("ack_wait", ack_wait)
        self._connect_timeout = check_seconds("connect_timeout", connect_timeout)
        if decoder is not None and not callable(decoder) and not isinstance(decoder, Mapping):
            raise TypeError(
                f"decoder must be a callable, a mapping of stream names to them, or None, "
                f"not {type(decoder).__name__}"
            )
        self._jetstream = jetstream
        self._durable = durable
        self._subject = subject or f"{subject_prefix}.>"
        self._prefix = subject_prefix
        self._decoder = decoder
        self._connect_options = dict(connect_options or {})
        self._ready_timeout = check_seconds("ready_timeout", ready_timeout)
        self._auth = credentials(
            user=user, password=password, token=token, creds=creds,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
            tls_handshake_first=tls_handshake_first, allow_insecure=allow_insecure,
        )
        self._refusals = Refusals()
        self._nc: Client | None = None
        self._psub: JetStreamContext.PullSubscription | None = None
        self._sources: dict[_Key, SourceTrack] = {}
        self._subjects: dict[tuple[str, str], str] = {}  # the subject of (host, stream)
        # Events built and not yet handed out. The last event of a message carries
        # the message, to be acknowledged when the consumer is done with the event.
        self._held: deque[FleetEvent] = deque()
        # Where each held message ends, counted in events ever queued, so a message is
        # known done when that many events have been handed out.
        self._ends: deque[tuple[int, _Done]] = deque()
        self._queued = 0
        self._handed = 0
        self._next_end = _NEVER
        self._held_messages: set[_Which] = set()
        self._to_ack: list[_Done] = []
        self._closed = False
        self._boot_offsets: dict[str, int] = {}  # host -> its sinks' latest offset
        self._n = _Counts()
        self._last_problem = ""
        self._first_seq, self._first_seq_at = 0, -1e9  # the stream's oldest message, when

    # --- opening and closing -----------------------------------------------------------

    async def open(self) -> None:
        """Connect, check the stream, create or bind the durable consumer."""
        if self._closed:
            raise FleetClosedError("this FleetReader was closed; make a new one")
        if self._nc is not None:
            return
        nc = await connect(
            self._servers, timeout=self._connect_timeout, name=f"aperf-reader {self._durable}",
            on_error=self._on_error, options=self._connect_options, auth=self._auth,
            refusals=self._refusals,
        )
        try:
            js = nc.jetstream()
            await stream_info(
                nc, js, self._jetstream, timeout=self._ready_timeout, refusals=self._refusals
            )
            config = ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=self._ack_wait,
                max_ack_pending=self._max_ack_pending,
            )
            try:
                self._psub = await ready(
                    nc, lambda: js.pull_subscribe(
                        self._subject, durable=self._durable, stream=self._jetstream,
                        config=config,
                    ), timeout=self._ready_timeout, refusals=self._refusals,
                )
            except nats.js.errors.BadRequestError as exc:
                raise FleetConfigError(
                    "subject", f"JetStream refused a consumer on {self._subject!r} in stream "
                    f"{self._jetstream!r}: {exc.description}"
                ) from None
        except BaseException:
            await nc.close()
            raise
        self._nc = nc
        log.info(
            "fleet reader opened", jetstream=self._jetstream, durable=self._durable,
            subject=self._subject,
        )

    async def __aenter__(self) -> FleetReader:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Acknowledge what was handed out, and disconnect. Events still held are not
        acknowledged: JetStream redelivers their messages to the next reader."""
        if self._closed:
            return
        self._closed = True
        nc = self._nc
        if nc is None:
            return
        try:
            await self._ack_done()
        finally:
            await nc.close()
        log.info("fleet reader closed", durable=self._durable, messages=self._n.messages)

    # --- iterating ---------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[FleetEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[FleetEvent]:
        # The held events live on the reader, not in this generator: a consumer that
        # breaks out of its loop continues where it stopped with the next loop.
        self._require_open()
        held = self._held
        while True:
            if self._to_ack:
                await self._ack_done()
            if held:
                self._handed += 1
                if self._handed >= self._next_end:
                    self._settle_ends()
                yield held.popleft()
                continue
            if self._closed:
                return
            await self._fill()

    async def batches(self, max_items: int = 1024) -> AsyncIterator[list[FleetEvent]]:
        """Yield lists of up to ``max_items`` events, in order, without a per-item await.

        Acknowledgement works as for ``async for``: a message is acknowledged when the
        batch holding its last event has been handled (the next batch is asked for).
        """
        check_int("max_items", max_items, 1, 1 << 30)
        self._require_open()
        held = self._held
        while True:
            if self._to_ack:
                await self._ack_done()
            if held:
                n = min(len(held), max_items)
                batch = [held.popleft() for _ in range(n)]
                self._handed += n
                if self._handed >= self._next_end:
                    self._settle_ends()
                yield batch
                continue
            if self._closed:
                return
            await self._fill()

    def _require_open(self) -> None:
        if self._psub is None:
            raise FleetClosedError("open the FleetReader first (async with, or await open())")

    def _settle_ends(self) -> None:
        """Messages whose last event is now handed out: acknowledged at the next step."""
        ends = self._ends
        while ends and ends[0][0] <= self._handed:
            self._to_ack.append(ends.popleft()[1])
        self._next_end = ends[0][0] if ends else _NEVER

    async def _ack_done(self) -> None:
        done, self._to_ack = self._to_ack, []
        for msg, which in done:
            self._held_messages.discard(which)
            try:
                await msg.ack()
            except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError):
                # Not acknowledged: JetStream redelivers it after ack_wait, and this
                # reader (if still running) drops the copy as a duplicate.
                log.debug("fleet reader: ack not sent", durable=self._durable)

    async def _fill(self) -> None:
        psub = self._psub
        assert psub is not None
        try:
            msgs = await psub.fetch(self._batch, timeout=self._fetch_timeout)
        except nats.errors.TimeoutError:
            # Nothing new (or the server is away; the client reconnects), unless the
            # server refused the fetch or an acknowledgement: that lasts.
            self._refusals.check("servers")
            return
        except nats.errors.ConnectionClosedError:
            if self._closed:
                return
            raise FleetClosedError("the NATS connection of the fleet reader closed") from None
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            if self._closed:
                return
            self._note_problem(exc)
            await asyncio.sleep(_RETRY_PAUSE)
            return
        for msg in msgs:
            await self._accept(msg)

    async def _accept(self, msg: Msg) -> None:
        # Every message is untrusted: whatever any NATS user may publish on the
        # subjects reaches this point. What cannot be used is acknowledged (once its
        # notice is handed out), counted and announced, never raised.
        self._n.messages += 1
        try:
            meta = msg.metadata
            seq, redelivered = meta.sequence.stream, meta.num_delivered > 1
        except (nats.errors.Error, ValueError, IndexError):  # not a JetStream delivery
            seq, redelivered = 0, False
        try:
            frame = parse(msg.data)
        except FrameError as exc:
            self._n.malformed += 1
            self._notice(msg, seq, str(exc))
            return
        names = (frame.host, frame.stream)
        subject = self._subjects.get(names)
        if subject is None:
            subject = f"{self._prefix}.{subject_token(names[0])}.{subject_token(names[1])}"
            if len(self._subjects) < 1 << 16:  # (names the payloads claim: bounded)
                self._subjects[names] = subject
        if msg.subject != subject:
            self._n.refused += 1
            self._notice(msg, seq, f"it claims host {frame.host!r} and stream {frame.stream!r}, "
                         f"whose subject is {subject!r}")
            return
        offset = parse_boot_offset(msg.headers.get(BOOT_OFFSET_HEADER) if msg.headers else None)
        if offset is not None:
            self._boot_offsets[frame.host] = offset
        key = (frame.host, frame.stream, frame.epoch)
        track = self._sources.get(key)
        if track is None:
            track = self._sources[key] = SourceTrack()
        if frame.kind == END:
            if track.floor is not None and not track.checked(frame.first) and \
                    await self._limits_removed(track):
                track.anchor(frame.first)
            holes = track.end(
                frame.first, frame.samples_before, frame.lost_before, frame.tag, seq
            )
            if holes is None:
                self._n.refused += 1
                self._notice(msg, seq, f"an end of stream at {frame.first} that its run's "
                             "chain of tags or the events already seen contradict")
                return
            self._hand_gaps(frame, holes)
            await msg.ack()
            return
        lost = frame.lost
        held = frame.samples
        if frame.kind == DROPPED:  # the sink gave these up: a Gap, with what they held
            held, lost = frame.events[0].samples, frame.events[0].lost
        verdict = track.add(
            frame.first, frame.count, frame.samples_before, frame.lost_before, held,
            lost, frame.tag, frame.next, seq, redelivered,
        )
        for exposed in track.exposed:
            self._n.conflicts += 1
            last = exposed.first + exposed.count - 1
            self._notice(None, exposed.origin, f"events {exposed.first}..{last} of run "
                         f"{frame.epoch:016x}, handed out earlier, were forged: the run's "
                         "chain of tags leads elsewhere", subject)
        which = (key, frame.first, frame.tag)
        if verdict is Verdict.DUPLICATE:
            self._n.duplicates += 1
            if which not in self._held_messages:
                await msg.ack()  # else the first copy is acknowledged when handed out
            return
        if verdict is Verdict.FORGED:
            self._n.refused += 1
            self._notice(msg, seq, f"events from {frame.first} of run {frame.epoch:016x} that "
                         "do not follow the run's chain of tags: forged")
            return
        if track.would_settle(frame.watermark) and not track.checked(frame.first) and \
                await self._limits_removed(track):
            track.anchor(frame.first)  # a hole JetStream's limits made: nothing to check by
        if track.checked(frame.first):  # a forger's watermark would hide what comes later
            self._hand_gaps(frame, track.holes_below(frame.watermark))
        if frame.kind == DROPPED:
            self._hand_gaps(frame, [Hole(frame.first, frame.count, held, lost)])
        else:
            self._n.samples += frame.samples
            self._n.lost += lost
            self._hold(frame, self._build(frame))
        if verdict is Verdict.CONFLICT:
            self._n.conflicts += 1
            last = frame.first + frame.count - 1
            self._notice(None, seq, f"events {frame.first}..{last} of run {frame.epoch:016x}, "
                         "just handed out, overlap events another message claimed: one of "
                         "the two is forged", subject)
        self._held_messages.add(which)
        self._end_at(msg, which)

    async def _limits_removed(self, track: SourceTrack) -> bool:
        """Whether JetStream removed messages stored after this source's last checked
        one: only then may a hole below an unchecked message be one the stream's limits
        made, and its watermark be trusted. Asked at most once a second."""
        loop = asyncio.get_running_loop()
        if loop.time() - self._first_seq_at > 1.0:
            assert self._nc is not None
            try:
                info = await self._nc.jetstream().stream_info(self._jetstream)
            except (nats.errors.Error, asyncio.TimeoutError):
                return False  # asked again with the next message that needs it
            self._first_seq, self._first_seq_at = info.state.first_seq, loop.time()
        return self._first_seq > track.last_checked + 1

    def _end_at(self, msg: Msg, which: _Which) -> None:
        """``msg`` is acknowledged once the events held so far are handed out."""
        self._ends.append((self._queued, (msg, which)))
        if len(self._ends) == 1:
            self._next_end = self._queued

    def _notice(self, msg: Msg | None, seq: int, reason: str, subject: str | None = None) -> None:
        """Hold a Malformed notice; ``msg`` is acknowledged once it is handed out."""
        subject = msg.subject if msg is not None else subject or ""
        log.debug("fleet reader: message not used", subject=subject, stream_sequence=seq,
                  reason=reason)
        host, stream = "", ""
        if subject.startswith(self._prefix + "."):
            tokens = subject[len(self._prefix) + 1 :].split(".")
            if len(tokens) == 2:
                host, stream = tokens
        self._held.append(FleetEvent(host, stream, Malformed(subject, seq, reason)))
        self._queued += 1
        if msg is not None:
            self._end_at(msg, ("notice", seq, id(msg)))

    def _hold(self, frame: Frame, events: list[Any]) -> None:
        # FleetEvents built at C speed: tuple.__new__ skips the named tuple's Python __new__.
        rows = zip(_repeat(frame.host), _repeat(frame.stream), events)
        self._held.extend(map(_tuple_new, _repeat(FleetEvent), rows))
        self._queued += len(events)

    def _hand_gaps(self, frame: Frame, holes: list[Hole]) -> None:
        for hole in holes:
            self._n.gaps += 1
            self._n.gap_samples += hole.samples
            self._n.gap_lost += hole.lost
        self._hold(frame, [Gap(*hole) for hole in holes])

    def _build(self, frame: Frame) -> list[Any]:
        if frame.kind != SAMPLES:
            self._n.bad += frame.kind == BAD
            return frame.events
        decoder = self._decoder_for(frame.stream)
        cpus, datas = frame.cpus, frame.datas
        if decoder is None:
            return list(map(_tuple_new, _repeat(Sample), zip(cpus, datas, _repeat(None))))
        if isinstance(decoder, SizedDecoder) and min(map(len, datas)) >= decoder.size:
            try:
                values = decoder.decode_many(datas)
            except Exception:
                pass  # one of them does not decode: find which, one by one
            else:
                rows = zip(cpus, datas, values, strict=True)
                return list(map(_tuple_new, _repeat(Sample), rows))
        events: list[Any] = []
        for cpu, data in zip(cpus, datas, strict=True):
            try:
                events.append(Sample(cpu, data, decoder(data)))
            except Exception as exc:
                self._n.bad += 1
                error = exc if isinstance(exc, DecodeError) else DecodeError(cpu, data, str(exc))
                # Without its traceback (the decoder's frames, most of its cost): a
                # message of tiny samples that all fail costs a few times its size.
                events.append(BadSample(cpu, data, error.with_traceback(None)))
        return events

    def _decoder_for(self, stream: str) -> Decoder | None:
        decoder = self._decoder
        if isinstance(decoder, Mapping):
            return decoder.get(stream)
        return decoder

    def _on_error(self, exc: Exception) -> None:
        log.debug("fleet reader: NATS error", durable=self._durable, error=str(exc))

    def _note_problem(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if text != self._last_problem:  # once per kind of trouble, not once per retry
            self._last_problem = text
            log.warning("fleet reader: fetch failed, retrying", durable=self._durable,
                        error=text)

    # --- introspection -----------------------------------------------------------------

    def boot_offset_ns(self, host: str) -> int | None:
        """``host``'s wall clock minus its kernel's boot-time clock, in ns, as its sinks
        last sent it; None until a message from ``host`` carried one.

        A BPF timestamp from ``bpf_ktime_get_boot_ns()`` (CLOCK_BOOTTIME) plus this
        is the event's wall-clock time, in ns since the epoch: each host boots at its
        own time, so a reader cannot use its own clock for another host's events.
        Exact to the hosts' clock sync; every [`JetStreamSink`][aperf.fleet.JetStreamSink]
        sends it (taken when the sink opens).
        """
        return self._boot_offsets.get(host)

    def statistics(self) -> ReaderStatistics:
        """Messages, samples, lost counts, bad samples, gaps, duplicates, and the messages
        malformed, refused or conflicting, seen so far."""
        return ReaderStatistics(**dataclasses.asdict(self._n), sources=len(self._sources))


