"""The fleet reader's judgement of each message, and the events it makes of them.

Sans-I/O: the driver (``_reader.py``) fetches messages from the durable consumer,
hands them here one at a time (``accept``), takes events out (``hand``) and
acknowledges the messages this module releases (``released``), once their last
event is handed out. Nothing here awaits.

Every message is untrusted (anyone allowed on the subjects can publish), so what
one costs is bounded, whatever it claims:

- **Memory.** A message is parsed without copying its samples (``_wire.py``: at
  most ``MAX_EVENTS`` of them, views of the payload), and its events are built a
  chunk at a time as they are handed out (``chunk`` events, or what ``batches()``
  asks for), never a whole message's, let alone a fetch's. They are built by the
  core's ``EventBuilder``, as a stream builds them (decoded at C speed where the
  samples allow; a sample that does not decode is a ``BadSample``), keeping no
  decoder's traceback (``causes=False``). Samples shorter than
  the decoder's size (its ``size`` attribute: ``aperf.decoders`` have one) are
  refused with one notice per message, not one ``BadSample`` each. So a message
  costs its payload, a fixed few hundred bytes, and one chunk of events.
- **State.** Per run (host, stream, epoch) a ``SourceTrack`` of at most
  ``ranges_per_run`` ranges; at most ``runs_per_stream`` runs per (host, stream)
  and ``runs`` in all, least recently used dropped first; a run that ended (its
  sink's end of stream, checked) is dropped once settled and remembered in a
  bounded list of ended runs. Whatever is dropped is announced (a ``Malformed``
  notice) and counted (``evicted``).
- **Trust.** Nothing of a message that is refused is applied: not its events, not
  its run, not its ``Aperf-Boot-Offset-Ns``. With host keys, a message must carry
  its host's signature (``_signing.py``); without, see ``_gaps.py`` for what the
  chain of tags does and does not prove.

Holes are settled (reported as ``Gap``) only when the driver says nothing delivered
to this reader is still on its way (``settle``): a message the consumer delivered
and the reader never received (its server died in between) is redelivered later,
and may fill the hole.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import repeat as _repeat
from typing import TYPE_CHECKING, Any, NamedTuple

from .._reading.build import EventBuilder
from ._clock import BOOT_OFFSET_HEADER, parse_boot_offset
from ._errors import FrameError
from ._events import FleetEvent, Gap, Malformed
from ._gaps import Hole, SourceTrack, Verdict
from ._signing import SIGNATURE_HEADER, verify
from ._wire import BAD, DROPPED, END, MAX_TOTAL, SAMPLES, Frame, parse, subject_token, token_name

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

Decoder = Callable[[bytes], Any]
DecoderChoice = Decoder | Mapping[str, Decoder | None] | None
_Key = tuple[str, str, int]  # host, stream, epoch
_tuple_new = tuple.__new__
_NEVER = 1 << 62
_BUILDERS = 64  # decoders whose builders are kept (a mapping's values)


def _never_requeued(*_: Any) -> None:  # pragma: no cover - only under decode_errors="raise"
    raise AssertionError("a fleet reader builds with decode_errors='item'")


class Limits(NamedTuple):
    """The most a reader keeps; see the module's docstring."""

    runs_per_stream: int = 8
    runs: int = 4096
    ranges_per_run: int = 64
    ranges: int = 32768  # in all runs
    ended: int = 4096  # ended runs remembered, so that their late copies are known
    hosts: int = 4096  # hosts whose boot clock offset is kept
    chunk: int = 256  # events built at once for ``async for``


LIMITS = Limits()

class Delivery(NamedTuple):
    """One message as the consumer delivered it; ``handle`` is what the driver
    acknowledges once ``released`` gives it back."""

    subject: str
    data: bytes
    headers: Mapping[str, str] | None
    stream_seq: int
    delivered: int  # times JetStream delivered it (1: the first time)
    handle: Any


@dataclass
class Counts:
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
    short: int = 0
    evicted: int = 0
    sources: int = 0  # runs seen

    def add_lost(self, lost: int, gap_samples: int = 0, gap_lost: int = 0) -> None:
        # Hosts claim these: each run's total fits an int64 (``_wire.py``); the sums
        # over runs stop at 2^63-1 rather than overflow whoever reads them.
        self.lost = min(self.lost + lost, MAX_TOTAL)
        self.gap_samples = min(self.gap_samples + gap_samples, MAX_TOTAL)
        self.gap_lost = min(self.gap_lost + gap_lost, MAX_TOTAL)


class _Run:
    """What a reader keeps of one sink run."""

    __slots__ = ("candidate", "ending", "key", "settle_to", "subject", "track")

    def __init__(self, key: _Key, subject: str, max_ranges: int) -> None:
        self.key = key
        self.subject = subject
        self.track = SourceTrack(max_ranges)
        self.settle_to = -1  # the highest watermark of a checked message
        # (first, watermark) of the latest unchecked message whose watermark passes a
        # hole: trusted if JetStream's limits removed messages (``settle``)
        self.candidate: tuple[int, int] | None = None
        self.ending: int | None = None  # a checked end of stream: dropped once settled

    def pending(self) -> bool:
        return (self.candidate is not None or self.ending is not None
                or self.track.would_settle(self.settle_to))


class _Samples:
    """A samples message's events, built a slice at a time."""

    __slots__ = ("at", "body", "builder", "done", "host", "min_size", "stream")

    def __init__(self, frame: Frame, builder: EventBuilder, min_size: int) -> None:
        assert frame.body is not None
        self.body = frame.body
        self.at = frame.body.start
        self.done = 0
        self.builder = builder
        self.min_size = min_size  # shorter samples were refused (one notice)
        self.host, self.stream = frame.host, frame.stream


class Intake:
    """Messages in, events out; see the module's docstring."""

    def __init__(
        self, *, prefix: str, decoder: DecoderChoice = None,
        host_keys: Mapping[str, Ed25519PublicKey] | None = None, limits: Limits = LIMITS,
    ) -> None:
        self._prefix = prefix
        self._decoder = decoder
        self._keys = host_keys
        self._limits = limits
        self.counts = Counts()
        self._runs: OrderedDict[_Key, _Run] = OrderedDict()  # least recently used first
        self._per_stream: dict[tuple[str, str], OrderedDict[int, None]] = {}
        self._ended: OrderedDict[_Key, None] = OrderedDict()
        self._unsettled: dict[_Key, None] = {}
        self._ranges = 0  # ranges in all runs
        self._boot_offsets: OrderedDict[str, int] = OrderedDict()
        self._builders: dict[int, tuple[Decoder | None, EventBuilder]] = {}  # by id(decoder)
        # What is to be handed out, in order: lists of events, samples to build, and
        # the handles of messages whose events come before them.
        self._todo: deque[Any] = deque()
        self._front: deque[FleetEvent] = deque()  # events built, not handed out
        # The front's next event (IndexError: none built): an iterator hands them out
        # one at a time through this, and ``fill()`` builds the next chunk.
        self.next_event: Callable[[], FleetEvent] = self._front.popleft
        self._queued = 0  # events ever put in front (handed out: those less the front's)
        self._ends: deque[tuple[int, Any]] = deque()  # (events queued before it, handle)
        self._next_end = _NEVER
        self._released: list[Any] = []

    # --- messages in ----------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Whether events or releases are still to come out of what was accepted
        (``released()`` gives the releases due)."""
        return bool(self._todo or self._front or self._ends)

    def accept(self, d: Delivery) -> None:
        """Judge one message and queue what it gives (events, notices, its release)."""
        self.counts.messages += 1
        try:
            self._judge(d)
        finally:
            self._todo.append(_Release(d.handle))

    def _judge(self, d: Delivery) -> None:
        counts = self.counts
        try:
            frame = parse(d.data)
        except FrameError as exc:
            counts.malformed += 1
            self._notice(d.subject, d.stream_seq, str(exc))
            return
        subject = self._subject(frame.host, frame.stream)
        if d.subject != subject:
            counts.refused += 1
            self._notice(d.subject, d.stream_seq, f"it claims host {frame.host!r} and stream "
                         f"{frame.stream!r}, whose subject is {subject!r}")
            return
        headers = d.headers or {}
        offset = headers.get(BOOT_OFFSET_HEADER)
        trusted = False
        if self._keys is not None:
            key = self._keys.get(frame.host)
            why = (f"no key was given for host {frame.host!r}" if key is None else
                   verify(key, headers.get(SIGNATURE_HEADER), d.subject, offset, d.data))
            if why:
                counts.refused += 1
                self._notice(d.subject, d.stream_seq, f"{why}: refused (host_keys)")
                return
            trusted = True
        key_ = (frame.host, frame.stream, frame.epoch)
        if key_ in self._ended:
            if d.delivered > 1:
                counts.duplicates += 1
            else:
                counts.refused += 1
                self._notice(d.subject, d.stream_seq, f"events from {frame.first} of run "
                             f"{frame.epoch:016x}, which had ended")
            return
        run = self._runs.get(key_)
        fresh = run is None
        if run is None:
            run = _Run(key_, subject, self._limits.ranges_per_run)
        track = run.track
        size = len(track)
        if frame.kind == END:
            verdict = track.end(frame.first, frame.samples_before, frame.lost_before,
                                frame.tag, d.stream_seq, trusted)
        else:
            held, lost = frame.samples, frame.lost
            if frame.kind == DROPPED:  # the sink gave these up: a Gap, with what they held
                held, lost = frame.events[0].samples, frame.events[0].lost
            verdict = track.add(frame.first, frame.count, frame.samples_before,
                                frame.lost_before, held, lost, frame.tag, frame.next,
                                d.stream_seq, trusted)
        for exposed in track.exposed:
            self._conflict(subject, exposed.origin, exposed.first, exposed.count, frame.epoch,
                           "handed out earlier, were forged: the run's chain of tags leads "
                           "elsewhere")
        if verdict is Verdict.DUPLICATE:
            counts.duplicates += 1
            return
        if verdict is Verdict.FORGED:
            counts.refused += 1
            if frame.kind == END:
                why = (f"an end of stream at {frame.first} of run {frame.epoch:016x} that its "
                       "run's chain of tags or the events already seen contradict: forged")
            else:
                why = (f"events from {frame.first} of run {frame.epoch:016x} that do not "
                       "follow the run's chain of tags: forged")
            self._notice(d.subject, d.stream_seq, why)
            return
        # Accepted: from here on the message counts.
        self._ranges += len(track) - size
        if fresh:
            self._remember(run, d.stream_seq)
        else:  # the least recently used go first
            self._runs.move_to_end(key_)
            self._per_stream[key_[:2]].move_to_end(key_[2])
        while self._ranges > self._limits.ranges and len(self._runs) > 1:
            self._drop(next(iter(self._runs)), d.stream_seq,
                       f"more than {self._limits.ranges} ranges in all runs")
        for first, end in track.forgotten:
            self._evicted(subject, d.stream_seq, f"events {first}..{end - 1} of run "
                          f"{frame.epoch:016x} are no longer tracked (more than "
                          f"{self._limits.ranges_per_run} separate ranges)")
        value = parse_boot_offset(offset)
        if value is not None:
            self._boot_offsets[frame.host] = value
            self._boot_offsets.move_to_end(frame.host)
            if len(self._boot_offsets) > self._limits.hosts:
                self._boot_offsets.popitem(last=False)
        checked = track.checked(frame.first)
        watermark = frame.first if frame.kind == END else frame.watermark
        if checked:
            run.settle_to = max(run.settle_to, watermark)
            if frame.kind == END:
                run.ending = frame.first
        elif track.would_settle(watermark):
            run.candidate = (frame.first, watermark)
        if run.pending():
            self._unsettled[key_] = None
        if frame.kind == END:
            return
        if frame.kind == DROPPED:
            self._gaps(frame.host, frame.stream, [Hole(frame.first, frame.count, held, lost)])
        elif frame.kind == SAMPLES:
            self._samples(frame, d)
        else:
            counts.add_lost(lost)
            counts.bad += frame.kind == BAD
            self._todo.append([FleetEvent(frame.host, frame.stream, e) for e in frame.events])
        if verdict is Verdict.CONFLICT:
            self._conflict(subject, d.stream_seq, frame.first, frame.count, frame.epoch,
                           "just handed out, overlap events another message claimed: one of "
                           "the two is forged")

    def _conflict(self, subject: str, seq: int, first: int, count: int, epoch: int,
                  what: str) -> None:
        self.counts.conflicts += 1
        self._notice(subject, seq, f"events {first}..{first + count - 1} of run {epoch:016x}, "
                     + what)

    def _samples(self, frame: Frame, d: Delivery) -> None:
        assert frame.body is not None
        decoder = self._decoder_for(frame.stream)
        size = getattr(decoder, "size", 0)
        size = size if isinstance(size, int) and size > 0 else 0
        short = sum(map(size.__gt__, frame.body.lengths)) if size else 0
        self.counts.samples += frame.samples - short
        if short:
            self.counts.short += short
            self.counts.bad += short
            self._notice(d.subject, d.stream_seq, f"{short} of its {frame.samples} samples "
                         f"are shorter than the decoder's {size} bytes: refused")
        if short < frame.samples:
            self._todo.append(_Samples(frame, self._builder(decoder), size if short else 0))

    def _subject(self, host: str, stream: str) -> str:
        return f"{self._prefix}.{subject_token(host)}.{subject_token(stream)}"

    def _remember(self, run: _Run, seq: int) -> None:
        """Keep a new run, dropping the least recently used beyond the limits."""
        host, stream, epoch = run.key
        mine = self._per_stream.setdefault((host, stream), OrderedDict())
        limits = self._limits
        while len(mine) >= limits.runs_per_stream:
            old = next(iter(mine))
            self._drop((host, stream, old), seq, f"more than {limits.runs_per_stream} runs "
                       "of this host's stream")
        while len(self._runs) >= limits.runs:
            self._drop(next(iter(self._runs)), seq, f"more than {limits.runs} runs in all")
        self._runs[run.key] = run
        mine[epoch] = None
        self.counts.sources += 1

    def _drop(self, key: _Key, seq: int, why: str | None) -> None:
        """Forget a run: evicted (``why``, announced), or ended and settled (``None``)."""
        run = self._runs.pop(key)
        self._ranges -= len(run.track)
        self._unsettled.pop(key, None)
        mine = self._per_stream[key[:2]]
        del mine[key[2]]
        if not mine:
            del self._per_stream[key[:2]]
        if why is None:
            self._ended[key] = None
            if len(self._ended) > self._limits.ended:
                self._ended.popitem(last=False)
            return
        self._evicted(run.subject, seq, f"run {key[2]:016x} is no longer tracked ({why}): "
                      "a later message of it starts the run anew, unchecked, and a hole "
                      "in it is not reported")

    def _evicted(self, subject: str, seq: int, reason: str) -> None:
        self.counts.evicted += 1
        self._notice(subject, seq, reason)

    # --- holes --------------------------------------------------------------------------------

    def unsettled(self) -> bool:
        """Whether holes (or ended runs) wait for ``settle``."""
        return bool(self._unsettled)

    def wants_stream_state(self) -> bool:
        """Whether ``settle`` needs the stream's first sequence (an unchecked watermark
        passes a hole)."""
        return any(self._runs[k].candidate is not None for k in self._unsettled)

    def settle(self, stream_first_seq: int | None) -> None:
        """Nothing delivered to this reader is on its way any more (the driver asked the
        consumer): report the holes the watermarks passed as Gaps, and drop the runs that
        ended. ``stream_first_seq`` is the stream's first sequence now (None: unknown):
        if JetStream's limits removed messages stored after a run's last checked one, the
        hole below an unchecked watermark is one they made, and is reported too."""
        for key in list(self._unsettled):
            run = self._runs[key]
            track = run.track
            if run.candidate is not None and stream_first_seq is not None and \
                    stream_first_seq > track.last_checked + 1:
                first, watermark = run.candidate
                track.anchor(first)
                run.settle_to = max(run.settle_to, watermark)
            run.candidate = None
            host, stream, _ = key
            size = len(track)
            self._gaps(host, stream, track.holes_below(run.settle_to))
            self._ranges += len(track) - size
            if run.ending is not None and run.settle_to >= run.ending:
                self._drop(key, 0, None)
            elif not run.pending():
                del self._unsettled[key]

    def _gaps(self, host: str, stream: str, holes: list[Hole]) -> None:
        if not holes:
            return
        for hole in holes:
            self.counts.gaps += 1
            self.counts.add_lost(0, hole.samples, hole.lost)
        self._todo.append([FleetEvent(host, stream, Gap(*hole)) for hole in holes])

    def _notice(self, subject: str, seq: int, reason: str) -> None:
        """Queue a Malformed notice, under the subject's host and stream."""
        host = stream = ""
        if subject.startswith(self._prefix + "."):
            tokens = subject[len(self._prefix) + 1 :].split(".")
            if len(tokens) == 2:
                host, stream = (token_name(t) or t for t in tokens)
        self._todo.append([FleetEvent(host, stream, Malformed(subject, seq, reason))])

    def withhold(self) -> None:
        """The reader closed: hand nothing more out. What was accepted and not handed
        out stays unacknowledged (its messages are never released), so JetStream gives
        it to the next reader: handing it out here too would give it twice."""
        self._todo.clear()
        self._front.clear()
        self._ends.clear()
        self._next_end = _NEVER

    # --- events out ---------------------------------------------------------------------------

    def hand(self, n: int) -> list[FleetEvent]:
        """Up to ``n`` events, in order (none: nothing accepted is left to hand out). A
        message whose last event is among them is released (``released``)."""
        front = self._front
        if not front:
            self._build(max(n, self._limits.chunk))
        if n == 1 and front:
            return [front.popleft()]
        return [front.popleft() for _ in range(min(n, len(front)))]

    def fill(self) -> bool:
        """Build the next chunk of events into the front if it is empty (``next_event``
        hands them out); whether it holds any."""
        if not self._front:
            self._build(self._limits.chunk)
        return bool(self._front)

    def released(self) -> list[Any]:
        """The handles of messages whose events are all handed out (each once)."""
        self._release_handed()
        todo = self._todo
        if not self._front:  # the last message handed out may not have been reached yet
            while todo and todo[0].__class__ is _Release and not self._ends:
                self._released.append(todo.popleft().handle)
        out, self._released = self._released, []
        return out

    def _release_handed(self) -> None:
        """Release the messages whose last event is handed out."""
        handed = self._queued - len(self._front)
        if handed >= self._next_end:
            ends = self._ends
            while ends and ends[0][0] <= handed:
                self._released.append(ends.popleft()[1])
            self._next_end = ends[0][0] if ends else _NEVER

    def _build(self, n: int) -> None:
        """Move up to about ``n`` events from what is to come into the front."""
        todo, front = self._todo, self._front
        while todo and len(front) < n:
            item = todo[0]
            if item.__class__ is _Release:
                todo.popleft()
                self._ends.append((self._queued, item.handle))
                if len(self._ends) == 1:
                    self._next_end = self._queued
                continue
            if item.__class__ is list:
                todo.popleft()
                events = item
            else:
                events = self._build_samples(item, n - len(front))
                if item.done == item.body.count:
                    todo.popleft()
            front.extend(events)
            self._queued += len(events)
        self._release_handed()  # messages with no events left to hand out

    def _build_samples(self, item: _Samples, n: int) -> list[FleetEvent]:
        start = item.done
        stop = min(item.body.count, start + max(n, 1))
        pieces, item.at = item.body.pieces(start, stop, item.at)
        item.done = stop
        builder, min_size = item.builder, item.min_size
        events: list[Any] = []
        for cpu, datas in pieces:  # a run of one CPU's samples each
            if min_size:
                datas = [data for data in datas if len(data) >= min_size]
                if not datas:
                    continue
            builder.payloads(cpu, datas, False, events)
        errors = builder.errors  # by CPU: emptied here, so it stays small
        if errors:
            self.counts.bad += sum(errors.values())
            errors.clear()
        rows = zip(_repeat(item.host), _repeat(item.stream), events)
        return list(map(_tuple_new, _repeat(FleetEvent), rows))

    def _builder(self, decoder: Decoder | None) -> EventBuilder:
        """The builder of ``decoder``'s events: a sample that does not decode is a
        BadSample, without the decoder's traceback."""
        kept = self._builders.get(id(decoder))
        if kept is not None and kept[0] is decoder:
            return kept[1]
        if len(self._builders) >= _BUILDERS:  # a mapping that makes decoders as asked
            self._builders.clear()
        builder = EventBuilder(decoder, "item", _never_requeued, causes=False)
        self._builders[id(decoder)] = (decoder, builder)
        return builder

    def _decoder_for(self, stream: str) -> Decoder | None:
        decoder = self._decoder
        if isinstance(decoder, Mapping):
            return decoder.get(stream)
        return decoder

    # --- introspection ------------------------------------------------------------------------

    def boot_offset_ns(self, host: str) -> int | None:
        return self._boot_offsets.get(host)

    @property
    def runs(self) -> int:
        """The runs tracked now."""
        return len(self._runs)


class _Release(NamedTuple):
    handle: Any
