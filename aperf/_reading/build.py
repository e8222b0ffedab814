"""Events built from the raw pieces a reader's queue hands out.

A piece is part of one drained span of one ring: a ``RunPiece`` (records
``start`` to ``stop`` of a run of identical records, still in the span they
were copied in) or ``Payloads`` (samples parsed one by one). ``EventBuilder``
turns pieces into ``Sample`` events (decoded at C speed where the records
allow) and ``BadSample`` items under the ``decode_errors`` policy. A fleet reader
(``aperf.fleet``) builds the samples of its messages with it too, as ``Payloads``.

A decoder that raises on one record of a run decoded at C speed costs only that
record: the run is decoded again one record at a time, and that one alone is the
decode error.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .._decoding.decode import SizedDecoder
from .._errors import DecodeError
from .._events import BadSample, Event, Lost, Sample, tagged
from .._native import speedups
from .._options import DecodeErrorPolicy
from .._rings.seam import Run

Decoder = Callable[[bytes], Any]

_tuple_new = tuple.__new__
_repeat = itertools.repeat
_starmap = itertools.starmap
_NONES = itertools.repeat(None)
# The compiled fast path's builders (None: pure): the same events, without the zips.
_build_run = speedups.build_run
_build_payloads = speedups.build_payloads


class RunPiece(NamedTuple):
    """Records ``start`` to ``stop`` of ``run``, read on ring ``key``."""

    key: int
    run: Run
    start: int
    stop: int


class Payloads(NamedTuple):
    """Samples of ring ``key`` parsed one by one (``uniform``: all of one length)."""

    key: int
    payloads: list[bytes]
    uniform: bool


Requeue = Callable[[DecodeError, Payloads], None]
"""What a reader does under ``decode_errors="raise"``: put the error, then the samples
after the bad one, back at the front of its queue."""


class EventBuilder:
    """Turns pieces into events for one decoder and policy; counts decode errors per ring.

    In a stream of several maps there is one per map (``multi.MultiBuilder``): its
    events are of the map's tagged classes (``tagged(Sample, map)``) and say the
    ring's real CPU, the ring key less ``offset``. With ``causes=False`` a decode
    error keeps neither the decoder's exception nor a traceback (their frames are most
    of its cost): a fleet reader's samples come from the network.
    """

    __slots__ = ("bad", "causes", "decode_errors", "decoder", "errors", "lost_cls", "map",
                 "offset", "requeue", "sample")

    def __init__(
        self, decoder: Decoder | None, decode_errors: DecodeErrorPolicy, requeue: Requeue, *,
        map: str | None = None, offset: int = 0, errors: dict[int, int] | None = None,
        causes: bool = True,
    ) -> None:
        self.decoder = decoder
        self.decode_errors = decode_errors
        self.requeue = requeue
        self.errors: dict[int, int] = {} if errors is None else errors  # ring key -> count
        self.map = map
        self.offset = offset
        self.causes = causes
        self.sample: type = tagged(Sample, map)
        self.bad: type = tagged(BadSample, map)
        self.lost_cls: type = tagged(Lost, map)

    def cpu_of(self, key: int) -> int:
        """The real CPU of ring ``key`` (-1: a BPF ring buffer)."""
        return key - self.offset

    def map_of(self, key: int) -> str | None:
        """The map of ring ``key``, in a stream of several maps."""
        return self.map

    def key_of(self, event: Lost) -> int:
        """The ring key of a notice this builder made (its ``cpu`` is the real CPU)."""
        return int(event.cpu) + self.offset

    def lost(self, key: int, count: int) -> Lost:
        """The ``Lost`` notice of ``count`` drops on ring ``key``."""
        lost: Lost = _tuple_new(self.lost_cls, (key - self.offset, count))
        return lost

    def run(self, key: int, run: Run, start: int, stop: int, out: list[Any]) -> None:
        """Sample events of records ``start`` to ``stop`` of a run, straight out of its span."""
        decoder = self.decoder
        if decoder is None:
            if _build_run is not None:
                _build_run(self.sample, key - self.offset, run.span, run.start + start * run.stride,
                           stop - start, run.stride, run.skip, run.size, None, None, out)
                return
            rows = zip(_repeat(key - self.offset), run.each_payload(start, stop), _NONES,
                       strict=False)
            out.extend(map(_tuple_new, _repeat(self.sample), rows))
            return
        if isinstance(decoder, SizedDecoder) and run.size >= decoder.size:
            mark = len(out)
            try:
                self._decode_run(decoder, key, run, start, stop, out)
                return
            except Exception:
                # A record did not decode: find it, one record at a time. (Out here, not
                # in this block: an error of the slow path would keep this one as its
                # context, and with it a view of the span that the collector cannot clear
                # on Python before 3.12.7, CPython gh-77894.)
                del out[mark:]
            self._one_by_one(key, run.payloads(start, stop), True, out)
            return
        self.payloads(key, run.payloads(start, stop), True, out)

    def _decode_run(
        self, decoder: SizedDecoder, key: int, run: Run, start: int, stop: int, out: list[Any]
    ) -> None:
        """Fixed-size records, all long enough: decode the whole run at C speed, the fields
        unpacked from the span itself where the format allows. (A function of its own: if
        it raises, its frame, which holds the view, goes with the error.)"""
        fields = decoder.strided(run.skip, run.stride)
        if fields is None:
            listed = run.payloads(start, stop)
            decoded = decoder.decode_many(listed)
            if _build_payloads is not None:
                _build_payloads(self.sample, key - self.offset, listed, decoded, out)
                return
            payloads: Iterable[bytes] = listed
            values: Iterable[Any] = decoded
        else:
            at = run.start + start * run.stride
            view = memoryview(run.span)[at : at + (stop - start) * run.stride]
            if _build_run is not None:
                # The rows straight into records and events, in C: read from the span
                # by the decoder's plan where it has one, else unpacked by struct.
                record = decoder.row_class
                plan = decoder.fields_plan
                source: Any
                if plan is not None and (record is not None or decoder.build is None):
                    source = plan
                else:
                    unpacked = fields.iter_unpack(view)
                    source = unpacked if record is not None else iter(
                        decoder.each_row(unpacked))
                _build_run(self.sample, key - self.offset, run.span, at, stop - start,
                           run.stride, run.skip, run.size, source, record, out)
                return
            # Payloads and values one at a time into the zip: no lists in between.
            payloads = run.each_payload(start, stop)
            values = decoder.each_row(fields.iter_unpack(view))
        # starmap hands zip's (Sample, row) tuple over as the call's arguments: one
        # tuple less per event than map(tuple.__new__, repeat(Sample), rows).
        rows = zip(_repeat(key - self.offset), payloads, values, strict=False)
        out.extend(_starmap(_tuple_new, zip(_repeat(self.sample), rows, strict=False)))

    def payloads(self, key: int, payloads: list[bytes], uniform: bool, out: list[Any]) -> None:
        """Sample events of samples parsed one by one (``BadSample`` where decoding failed).
        ``uniform``: they are known to be all of one length."""
        decoder = self.decoder
        cpu, sample = key - self.offset, self.sample
        if decoder is None:
            if _build_payloads is not None:
                _build_payloads(sample, cpu, payloads, None, out)
                return
            rows = zip(_repeat(cpu), payloads, _NONES, strict=False)
            out.extend(map(_tuple_new, _repeat(sample), rows))
            return
        if isinstance(decoder, SizedDecoder) and payloads and (
            len(payloads[0]) if uniform else min(map(len, payloads))
        ) >= decoder.size:
            # All long enough: decode them all at C speed.
            try:
                values = decoder.decode_many(payloads)
            except Exception:
                pass  # one of them does not decode: find which, one by one
            else:
                if _build_payloads is not None:
                    _build_payloads(sample, cpu, payloads, values, out)
                    return
                rows = zip(_repeat(cpu), payloads, values, strict=False)
                out.extend(map(_tuple_new, _repeat(sample), rows))
                return
        self._one_by_one(key, payloads, uniform, out)

    def _one_by_one(self, key: int, payloads: list[bytes], uniform: bool, out: list[Any]) -> None:
        decoder = self.decoder
        assert decoder is not None
        cpu, sample = key - self.offset, self.sample
        for index, data in enumerate(payloads):
            try:
                value = decoder(data)
            except Exception as exc:
                if not self.failed(key, payloads, uniform, index, exc, out):
                    return  # "raise": the rest went back to the queue behind the error
                continue
            out.append(_tuple_new(sample, (cpu, data, value)))

    def failed(
        self, key: int, payloads: list[bytes], uniform: bool, index: int, exc: Exception,
        out: list[Event[Any]],
    ) -> bool:
        """``payloads[index]`` did not decode: a ``BadSample``, nothing, or (False) under
        "raise" the error and the samples after it requeued."""
        data = payloads[index]
        self.errors[key] = self.errors.get(key, 0) + 1
        cpu = key - self.offset
        error = exc if isinstance(exc, DecodeError) else DecodeError(
            cpu, data, str(exc), map=self.map)
        if not self.causes:
            error = error.with_traceback(None)
        elif error is not exc:
            error.__cause__ = exc
        if self.decode_errors == "skip":
            return True
        if self.decode_errors == "item":
            out.append(_tuple_new(self.bad, (cpu, data, error)))
            return True
        self.requeue(error, Payloads(key, payloads[index + 1 :], uniform))
        return False
