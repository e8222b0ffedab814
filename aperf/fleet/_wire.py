"""The aperf.fleet wire format: one NATS message = a header, then one kind of body.

Sans-I/O: this module frames events into payloads and parses payloads back; it
knows nothing of NATS. All integers are little-endian.

Header (72 bytes, then the host and stream names)::

    0  4s  magic b"APF2" (format version 2; version 1, b"APF1", is refused by name)
    4  B   kind: 1 samples, 2 lost notice, 3 bad sample, 4 end of stream, 5 dropped
    5  B   H, length of the host name (UTF-8, 1..255 bytes)
    6  B   S, length of the stream name (UTF-8, 1..255 bytes)
    7  x   reserved, 0
    8  Q   run: random, new for every sink, so sequence numbers never collide
    16 Q   first: sequence number of this message's first event (events count from 0)
    24 Q   watermark: every event before it was acknowledged by JetStream (or
           given up by the sink) when this message was framed
    32 Q   samples_before: data samples in the events before ``first``
    40 Q   lost_before: sum of the Lost counts in the events before ``first``
    48 I   count: events in this message
    52 I   runs: CPU runs in a samples body (0 otherwise)
    56 8s  tag: this message's tag, a keyed hash of ``first`` under a key that never
           leaves the sink; its ``Nats-Msg-Id`` ends with it (hex)
    64 8s  next: ``blake2b-64(tag)`` of the message that follows this one (the one whose
           ``first`` is this ``first + count``): a commitment a reader checks the next
           message against, and that no one who only reads the stream can answer
    72     host name (H bytes), stream name (S bytes)

Bodies:

- samples: ``runs`` x (u32 cpu, u32 samples), consecutive samples of one CPU;
  then ``count`` x u16 sample lengths; then the sample bytes, concatenated. The
  bytes are the ring's raw bytes, so a reader decodes them with the same decoder
  as a local ``aperf.PerfStream`` would. At most ``MAX_EVENTS`` samples (a sink's
  largest batch).
- lost notice (count 1): u32 cpu, u64 lost count.
- bad sample (count 1): u32 cpu, u16 data length, the data, then the decoder's
  reason as UTF-8 to the end.
- dropped (count as in the message it stands for): the header of a message the sink
  gave up (JetStream refused it, or it was unacknowledged when the sink closed), same
  tags, then u64 samples, u64 lost count it held: it carries the run's chain across
  the hole, and readers hand it out as a ``Gap``.
- end of stream (count 0): ``first`` is the number of events the sink framed,
  ``samples_before``/``lost_before`` its totals, and ``watermark == first``.

The two cumulative counters let a reader say exactly how many samples and lost
counts a hole in the sequence numbers held (see ``_gaps.py``). They are bounded:
a run never holds more samples than events, and its lost counts add up to at most
``MAX_TOTAL`` (2^63-1), so every total a reader derives fits a signed 64-bit int.
A message that breaks either is not a frame.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import itertools
import operator
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from .. import BadSample, DecodeError, Lost, Sample
from ._args import MAX_NAME_BYTES, check_name, name_problem
from ._errors import FrameError
from ._events import Gap

MAGIC = b"APF2"
OLD_MAGICS = {b"APF1": 1}  # earlier versions, refused with a message that names them
SAMPLES, LOST, BAD, END, DROPPED = 1, 2, 3, 4, 5
_DROPPED = struct.Struct("<QQ")
HEADER = struct.Struct("<4sBBBxQQQQQII8s8s")
TAG_BYTES = 8
_RUN = struct.Struct("<II")
_LOST = struct.Struct("<IQ")
_BAD = struct.Struct("<IH")
MAX_SAMPLE_BYTES = 0xFFFF  # a perf record's size is a u16, so a raw sample always fits
MAX_EVENTS = 0xFFFF  # the most events one message holds: a sink's largest batch
MAX_TOTAL = (1 << 63) - 1  # the most a run's lost counts add up to (a signed 64-bit int)
# Framing overhead bound per message beyond the sample bytes: header, names, one run
# and one length per sample are accounted for as samples are added.
_FIXED = HEADER.size + 2 * MAX_NAME_BYTES
MIN_MESSAGE_BYTES = _FIXED + _RUN.size + 2 + MAX_SAMPLE_BYTES
_CPU = operator.itemgetter(0)  # Sample.cpu
_DATA = operator.itemgetter(1)  # Sample.data


class Outgoing(NamedTuple):
    """One framed message of ``kind``: events ``first .. first+count-1`` holding
    ``samples`` data samples and Lost notices totalling ``lost``."""

    kind: int
    first: int
    count: int  # type: ignore[assignment]
    samples: int
    lost: int
    payload: bytes
    tag: bytes  # the message's tag: its Nats-Msg-Id ends with it


class SampleRuns:
    """A samples body, checked and not copied: its run table and lengths are views of
    the payload, so parsing costs a few hundred bytes whatever the message claims, and
    a reader builds the samples a slice at a time (``pieces``)."""

    __slots__ = ("_data", "_off", "_payload", "count", "lengths", "runs")

    def __init__(self, payload: bytes, runs: Sequence[int], lengths: Sequence[int],
                 data_offset: int) -> None:
        self._payload = payload
        self.runs = runs  # cpu, count, cpu, count, ...
        self.lengths = lengths
        self.count = len(lengths)
        self._data = data_offset

    def pieces(self, start: int, stop: int, at: tuple[int, int, int]
               ) -> tuple[list[tuple[int, list[bytes]]], tuple[int, int, int]]:
        """Samples ``start .. stop-1`` as (CPU, their bytes) per run of one CPU, from a
        cursor ``at`` (run index, samples left in that run, byte offset) that the previous
        call returned (``self.start`` first); and the cursor after them."""
        run, left, off = at
        runs, payload, lengths = self.runs, self._payload, self.lengths
        out: list[tuple[int, list[bytes]]] = []
        while start < stop:
            if not left:
                run += 1
                left = runs[2 * run + 1]
            k = min(stop - start, left)
            ends = list(itertools.accumulate(lengths[start : start + k], initial=off))
            out.append((runs[2 * run], list(map(payload.__getitem__, map(slice, ends, ends[1:])))))
            start += k
            left -= k
            off = ends[-1]
        return out, (run, left, off)

    @property
    def start(self) -> tuple[int, int, int]:
        return (0, self.runs[1], self._data)

    @property
    def cpus(self) -> list[int]:
        pieces = self.pieces(0, self.count, self.start)[0]
        return [cpu for cpu, datas in pieces for _ in datas]

    @property
    def datas(self) -> list[bytes]:
        return [data for _, datas in self.pieces(0, self.count, self.start)[0] for data in datas]


class Frame(NamedTuple):
    """A parsed message. A samples body is ``body``; lost and bad bodies fill
    ``events``; an end of stream has neither."""

    kind: int
    host: str
    stream: str
    epoch: int
    first: int
    watermark: int
    samples_before: int
    lost_before: int
    count: int  # type: ignore[assignment]
    body: SampleRuns | None
    events: list[Any]
    tag: bytes
    next: bytes  # commitment to the next message's tag: commit(next message's tag)

    @property
    def samples(self) -> int:
        return self.body.count if self.body is not None else 0

    @property
    def lost(self) -> int:
        return sum(e.count for e in self.events if e.__class__ is Lost)

    @property
    def cpus(self) -> list[int]:
        return self.body.cpus if self.body is not None else []

    @property
    def datas(self) -> list[bytes]:
        return self.body.datas if self.body is not None else []


class Framer:
    """Numbers the events of one sink and frames them into messages.

    Samples go in runs of up to ``max_events`` per message and ``max_bytes`` per
    payload (a single sample larger than that goes alone); every Lost notice and
    BadSample gets a message of its own, so that the order of the stream is kept
    across messages.
    """

    def __init__(
        self, host: str, stream: str, epoch: int, *, max_events: int, max_bytes: int,
        key: bytes | None = None,
    ) -> None:
        self._host = check_name("host", host)
        self._stream = check_name("name", stream)
        self._names = self._host + self._stream
        self.epoch = epoch
        # The tags' key never leaves this object: no one who reads the stream can tell
        # the tag of a message before the sink publishes it.
        self._key = key if key is not None else os.urandom(32)
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.next_seq = 0
        self.samples_total = 0
        self.lost_total = 0

    def tag(self, first: int) -> bytes:
        """The tag of the message whose first event is ``first``: the same for every retry."""
        return hashlib.blake2b(first.to_bytes(8, "little"), digest_size=TAG_BYTES,
                               key=self._key).digest()

    def _header(self, kind: int, first: int, count: int, runs: int, watermark: int) -> bytes:
        return HEADER.pack(
            MAGIC, kind, len(self._host), len(self._stream), self.epoch, first, watermark,
            self.samples_total, self.lost_total, count, runs, self.tag(first),
            commit(self.tag(first + count)),
        ) + self._names

    def frame(self, events: Sequence[Any], watermark: int) -> list[Outgoing]:
        """Frame ``events`` (Sample, Lost, BadSample) in order; numbers them as it goes.
        Events it cannot frame raise before any is numbered."""
        if list(map(type, events)).count(Sample) != len(events):
            self._check(events)
        out: list[Outgoing] = []
        i, n = 0, len(events)
        while i < n:
            event = events[i]
            cls = event.__class__
            if cls is Sample or isinstance(event, Sample):
                i = self._frame_samples(events, i, watermark, out)
                continue
            if isinstance(event, Lost):
                body = _LOST.pack(event.cpu, event.count)
                out.append(self._single(LOST, body, watermark, 0, event.count))
            elif isinstance(event, BadSample):
                data = event.data[:MAX_SAMPLE_BYTES]
                reason = getattr(event.error, "reason", str(event.error)).encode("utf-8", "replace")
                body = _BAD.pack(event.cpu, len(data)) + data + reason[:4096]
                out.append(self._single(BAD, body, watermark, 0, 0))
            else:
                raise TypeError(
                    "events must be aperf.Sample, aperf.Lost or aperf.BadSample, "
                    f"not {type(event).__name__}"
                )
            i += 1
        return out

    def _check(self, events: Sequence[Any]) -> None:
        lost = self.lost_total
        for event in events:
            if isinstance(event, Lost):
                if not 0 <= event.count <= MAX_TOTAL - lost:
                    raise ValueError(
                        f"events: a Lost count of {event.count} would take this run's lost "
                        f"total past {MAX_TOTAL} (2^63-1; it is {lost})"
                    )
                lost += event.count
            elif not isinstance(event, (Sample, BadSample)):
                raise TypeError(
                    "events must be aperf.Sample, aperf.Lost or aperf.BadSample, "
                    f"not {type(event).__name__}"
                )
            elif isinstance(event, Sample) and len(event.data) > MAX_SAMPLE_BYTES:
                raise ValueError(
                    f"a sample of {len(event.data)} bytes is longer than a perf record can be"
                )

    def _single(self, kind: int, body: bytes, watermark: int, samples: int, lost: int) -> Outgoing:
        first = self.next_seq
        payload = self._header(kind, first, 1, 0, watermark) + body
        self.next_seq += 1
        self.lost_total += lost
        return Outgoing(kind, first, 1, samples, lost, payload, self.tag(first))

    def _frame_samples(
        self, events: Sequence[Any], start: int, watermark: int, out: list[Outgoing]
    ) -> int:
        """Frame the run of samples at ``start``; returns the index after what it took.

        Per-sample work runs in C (map, itemgetter, groupby): this is the sink's hot path.
        """
        chunk = events[start : start + self._max_events]
        if list(map(type, chunk)).count(Sample) != len(chunk):  # a Lost or BadSample ends it
            end = next((k for k, e in enumerate(chunk) if not isinstance(e, Sample)), len(chunk))
            chunk = chunk[:end]
        datas = list(map(_DATA, chunk))
        lengths = list(map(len, datas))
        cpus = list(map(_CPU, chunk))
        runs = _runs(cpus)
        budget = self._max_bytes - _FIXED
        if sum(lengths) + 2 * len(lengths) + 4 * len(runs) > budget:
            # Cut where the bytes run out (counting every run, an upper bound).
            ends = list(itertools.accumulate(map(operator.add, lengths, itertools.repeat(2))))
            cut = bisect.bisect_right(ends, budget - 4 * len(runs))
            if cut == 0:  # one sample over the budget: alone, JetStream may refuse it (counted)
                if lengths[0] > MAX_SAMPLE_BYTES:
                    raise ValueError(
                        f"a sample of {lengths[0]} bytes is longer than a perf record can be"
                    )
                cut = 1
            datas, lengths, cpus = datas[:cut], lengths[:cut], cpus[:cut]
            runs = _runs(cpus)
        count = len(datas)
        first = self.next_seq
        header = self._header(SAMPLES, first, count, len(runs) // 2, watermark)
        payload = b"".join((
            header, struct.pack(f"<{len(runs)}I", *runs), struct.pack(f"<{count}H", *lengths),
            *datas,
        ))
        self.next_seq += count
        self.samples_total += count
        out.append(Outgoing(SAMPLES, first, count, count, 0, payload, self.tag(first)))
        return start + count

    def dropped(self, out: Outgoing) -> bytes:
        """The stand-in of a message given up: its header, as kind dropped, and what it held."""
        fields = list(HEADER.unpack_from(out.payload))
        fields[1], fields[10] = DROPPED, 0  # kind, runs
        names = out.payload[HEADER.size : HEADER.size + len(self._names)]
        return HEADER.pack(*fields) + names + _DROPPED.pack(out.samples, out.lost)

    def end(self) -> bytes:
        """The end-of-stream message: the totals, with every event accounted for."""
        return self._header(END, self.next_seq, 0, 0, self.next_seq)


def _runs(cpus: list[int]) -> list[int]:
    """Consecutive samples of one CPU: [cpu, count, cpu, count, ...]."""
    runs: list[int] = []
    for cpu, group in itertools.groupby(cpus):
        runs.append(cpu)
        runs.append(len(list(group)))
    return runs


def commit(tag: bytes) -> bytes:
    """What a message says the next message's tag hashes to."""
    return hashlib.blake2b(tag, digest_size=TAG_BYTES).digest()


def parse(payload: bytes) -> Frame:
    """Parse one message; raises ``FrameError`` if it is not a version-2 frame.

    Untrusted input: every count is checked against the payload's length before
    anything is allocated for it, so a message costs a small multiple of its size.
    """
    size = len(payload)
    if size < HEADER.size:
        if payload[:4] in OLD_MAGICS:
            raise _old_version(payload[:4])
        raise FrameError(f"a {size}-byte message is too short for an aperf.fleet header")
    (magic, kind, hlen, slen, epoch, first, watermark, samples_before, lost_before, count,
     runs, tag, next_tag) = HEADER.unpack_from(payload)
    if magic != MAGIC:
        if magic in OLD_MAGICS:
            raise _old_version(magic)
        raise FrameError(f"not an aperf.fleet message (magic {magic!r}, expected {MAGIC!r})")
    off = HEADER.size
    if off + hlen + slen > size:
        raise FrameError(f"names of {hlen} + {slen} bytes do not fit a {size}-byte message")
    host = _name("host", payload[off : off + hlen])
    stream = _name("stream", payload[off + hlen : off + hlen + slen])
    off += hlen + slen
    if watermark > first:
        raise FrameError(f"watermark {watermark} is beyond the message's first event {first}")
    if count > MAX_EVENTS:
        raise FrameError(f"claims {count} events: a message holds at most {MAX_EVENTS}")
    body: SampleRuns | None = None
    events: list[Any] = []
    samples = lost = 0
    if kind == SAMPLES:
        body = _samples_body(payload, off, count, runs)
        samples = count
    elif kind == LOST:
        _expect(kind, count, runs, 1, size - off == _LOST.size)
        cpu, lost = _LOST.unpack_from(payload, off)
        events.append(Lost(cpu, lost))
    elif kind == BAD:
        _expect(kind, count, runs, 1, size - off >= _BAD.size)
        cpu, length = _BAD.unpack_from(payload, off)
        off += _BAD.size
        if off + length > size:
            raise FrameError(f"a bad sample of {length} bytes does not fit its message")
        data = payload[off : off + length]
        reason = payload[off + length :].decode("utf-8", "replace")
        events.append(BadSample(cpu, data, DecodeError(cpu, data, reason)))
    elif kind == DROPPED:
        _expect(kind, count, runs, max(count, 1), size - off == _DROPPED.size)
        samples, lost = _DROPPED.unpack_from(payload, off)
        if samples > count:
            raise FrameError(f"a dropped message of {count} events cannot hold {samples} samples")
        events.append(Gap(first, count, samples, lost))
    elif kind == END:
        _expect(kind, count, runs, 0, size == off)
        if watermark != first:
            raise FrameError("an end of stream whose watermark is not its total")
    else:
        raise FrameError(f"unknown message kind {kind}")
    # What a host may claim about itself is bounded: no more samples than events, and
    # lost counts whose total fits a signed 64-bit int (so no total a reader adds up
    # from them can overflow one).
    if samples_before + samples > first + count:
        raise FrameError(f"claims {samples_before + samples} samples in the run's first "
                         f"{first + count} events")
    if lost_before + lost > MAX_TOTAL:
        raise FrameError(f"claims a lost total of {lost_before + lost}, beyond 2^63-1")
    return Frame(
        kind, host, stream, epoch, first, watermark, samples_before, lost_before, count,
        body, events, tag, next_tag,
    )


def _old_version(magic: bytes) -> FrameError:
    return FrameError(
        f"an aperf.fleet message of wire version {OLD_MAGICS[magic]} ({magic!r}): this "
        f"reader reads version 2 ({MAGIC!r}) only; upgrade aperf on the sending host"
    )


def _name(what: str, raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(f"the {what} name is not UTF-8") from None
    problem = name_problem(text)
    if problem:
        raise FrameError(f"the {what} name {text!r} {problem}")
    return text


def _expect(kind: int, count: int, runs: int, events: int, fits: bool) -> None:
    if count != events or runs != 0 or not fits:
        raise FrameError(
            f"a kind-{kind} message must hold {events} event(s), no runs and a body of its "
            f"size; this one claims {count} events and {runs} runs"
        )


def _table(payload: bytes, off: int, n: int, code: Literal["H", "I"]) -> Sequence[int]:
    """``n`` little-endian integers at ``off``: a view of the payload where the
    machine is little-endian, else a copy."""
    size = struct.calcsize(code)
    if sys.byteorder == "little":
        view: Sequence[int] = memoryview(payload)[off : off + n * size].cast(code)
        return view
    table = array.array(code, payload[off : off + n * size])
    table.byteswap()
    return table


def _samples_body(payload: bytes, off: int, count: int, runs: int) -> SampleRuns:
    """A samples body, its tables checked against what is left of the payload."""
    room = len(payload) - off
    if count == 0 or not 1 <= runs <= count:
        raise FrameError(f"a samples message must hold 1..{count or 1} runs of samples; this "
                         f"one claims {count} samples in {runs} runs")
    tables = _RUN.size * runs + 2 * count
    if tables > room:  # checked before unpacking: the claim costs nothing
        raise FrameError(
            f"claims {count} samples in {runs} runs: {tables} bytes of tables, but only "
            f"{room} bytes follow the header"
        )
    pairs = _table(payload, off, 2 * runs, "I")
    off += _RUN.size * runs
    total = sum(pairs[1::2])
    if total != count or 0 in pairs[1::2]:
        raise FrameError(f"the runs of a samples message add up to {total}, not {count}")
    lengths = _table(payload, off, count, "H")
    off += 2 * count
    if off + sum(lengths) != len(payload):
        raise FrameError("samples body does not match its header")
    return SampleRuns(payload, pairs, lengths, off)


_PLAIN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def subject_token(name: str) -> str:
    """``name`` as one NATS subject token, one to one: ASCII letters, digits, ``-`` and
    ``_`` are kept, every other character is ``%XX`` per UTF-8 byte (``web.1`` is
    ``web%2E1``, ``%`` is ``%25``), so two names never share a subject."""
    if _PLAIN.issuperset(name):
        return name
    return "".join(
        c if c in _PLAIN else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
        for c in name
    )


def token_name(token: str) -> str | None:
    """The name whose subject token is ``token``; None if no name has it."""
    if "%" not in token:
        return token if _PLAIN.issuperset(token) else None
    raw = bytearray()
    i = 0
    try:
        while i < len(token):
            if token[i] == "%":
                raw.append(int(token[i + 1 : i + 3], 16))
                i += 3
            else:
                raw += token[i].encode("ascii")
                i += 1
        name = raw.decode("utf-8")
    except (ValueError, UnicodeError):
        return None
    return name if subject_token(name) == token else None
