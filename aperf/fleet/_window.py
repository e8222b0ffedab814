"""The sink's window: what it numbers, keeps in flight, publishes again and settles.

Sans-I/O, beside ``_intake.py`` and ``_gaps.py``: ``_sink.py`` publishes, receives the
acknowledgements and watches the connection; this module decides what each of those
means. Time is the driver's (``now``, its loop's clock), so every rule here is tested
without a server or a real clock (tests/unit/test_fleet_window.py).

- **Numbering.** ``frame()`` numbers events through the run's ``Framer`` and marks each
  message unsettled. The first event of the lowest message neither acknowledged nor
  given up is the watermark the next message carries: every event below it is settled.
- **In flight.** At most ``size`` messages are published and not settled, and none goes
  while the connection is down (``room()``): memory is bounded by the window whatever
  the outage, and the sink's caller waits instead.
- **Acknowledgements.** ``acknowledged()`` judges JetStream's answer to an attempt:
  stored (settled; a duplicate of an earlier attempt counted), a temporary error or an
  answer it cannot read (published again soon), a refusal (given up).
- **Retries.** An attempt's acknowledgement is due within ``ack_timeout``, doubled per
  attempt of the same message up to ``MAX_BACKOFF`` times. ``retry()`` says whether a
  message is to be published again now: overdue, or last published on a connection
  before the current one (what was on the old socket may be gone); the driver asks in
  order, so a reconnection publishes the whole window again in order.
- **Giving up.** A message given up (refused by JetStream, by the server, or not
  acknowledged when the sink closed) is counted in ``dropped`` by reason, with the
  samples and lost counts it held, and its stand-in (``Framer.dropped``) waits in
  ``bridges`` for the driver to publish: it carries the run's chain over the hole, and
  readers hand it out as a ``Gap``.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ._wire import BAD, Framer, Outgoing

MAX_BACKOFF = 8  # the ack timeout doubles per attempt of one message, up to this factor
RETRY_SOON = 0.1  # seconds (times the attempt's backoff) before retrying a temporary error
INTERRUPTED = "not published: send() was interrupted"


@dataclass
class Counts:
    """The window's counters, as ``SinkStatistics`` shows them."""

    published: int = 0
    acknowledged: int = 0
    retried: int = 0
    duplicates: int = 0
    samples_published: int = 0
    samples_acknowledged: int = 0
    lost_forwarded: int = 0
    bad_forwarded: int = 0


class Pending:
    """A published message waiting for JetStream's acknowledgement."""

    __slots__ = ("attempts", "connection", "deadline", "headers", "out")

    def __init__(self, out: Outgoing, headers: dict[str, str]) -> None:
        self.out = out
        self.headers = headers  # the same for every attempt
        self.attempts = 0
        self.deadline = 0.0
        self.connection = 0  # the connection it was last published on


class Ack(enum.Enum):
    """What an acknowledgement did (``Window.acknowledged``)."""

    IGNORED = "ignored"  # of no message in flight: an earlier attempt's, settled since
    STORED = "stored"  # settled
    RETRY = "retry"  # published again soon: the driver's retry timer has a new deadline
    DROPPED = "dropped"  # given up: settled, and a stand-in waits in ``bridges``


class Window:
    """One sink's messages from framing to settling; see the module's docstring.

    It has no ``framer`` until the sink opens (``opened``): the message size comes from
    the server.
    """

    def __init__(self, size: int, ack_timeout: float) -> None:
        self.size = size
        self.ack_timeout = ack_timeout
        self.framer: Framer | None = None
        self.inflight: dict[int, Pending] = {}  # by first sequence number, in order
        # First sequence numbers of every message framed and neither acknowledged nor
        # given up, in order: its first key is the watermark the next message carries.
        self._unsettled: dict[int, None] = {}
        self.inflight_bytes = 0
        self.counts = Counts()
        self.dropped: Counter[str] = Counter()  # reason -> samples and lost counts
        self.bridges: list[tuple[Outgoing, bytes]] = []  # stand-ins of the messages given up
        self.connected = False
        self.connection = 0  # counts reconnections

    def opened(self, framer: Framer) -> None:
        """The sink connected: ``framer`` numbers and frames its messages from now on."""
        self.framer = framer
        self.connected = True

    # --- sending ----------------------------------------------------------------------------

    def frame(self, events: Sequence[Any]) -> list[Outgoing]:
        """Number and frame ``events``; each message is unsettled until ``put`` and an
        acknowledgement, ``give_up`` or ``abandon`` settles it."""
        assert self.framer is not None, "the window has no framer before the sink opens"
        outs = self.framer.frame(events, self.watermark())
        for out in outs:
            self._unsettled[out.first] = None
        return outs

    def watermark(self) -> int:
        """Every event below this is acknowledged or given up: the first event of the
        first message framed and not settled (in flight, or waiting for room)."""
        framer = self.framer
        return next(iter(self._unsettled), framer.next_seq if framer is not None else 0)

    def room(self) -> bool:
        """Whether another message may be published now."""
        return self.connected and len(self.inflight) < self.size

    def put(self, out: Outgoing, headers: dict[str, str]) -> Pending:
        """``out`` is in flight from now on, with the headers of its every attempt."""
        pending = Pending(out, headers)
        self.inflight[out.first] = pending
        self.inflight_bytes += len(out.payload)
        self.counts.published += 1
        self.counts.samples_published += out.samples
        return pending

    def attempt(self, pending: Pending, now: float) -> None:
        """``pending`` is being published (again) now, on the current connection."""
        pending.attempts += 1
        pending.deadline = now + self.ack_timeout * _backoff(pending)
        pending.connection = self.connection

    def abandon(self, outs: Sequence[Outgoing]) -> None:
        """Framed and numbered, never published (``send()`` was cancelled, or the sink
        failed): counted as dropped; readers will see a Gap for them."""
        for out in outs:
            self.dropped[INTERRUPTED] += out.samples + out.lost
            del self._unsettled[out.first]

    # --- acknowledgements -------------------------------------------------------------------

    def acknowledged(self, first: int, status: str | None, data: bytes, now: float) -> Ack:
        """JetStream's answer (``status`` header, body) to an attempt of the message whose
        first event is ``first``."""
        pending = self.inflight.get(first)
        if pending is None:
            return Ack.IGNORED
        if status == "503":  # no responders: JetStream not (yet) listening
            self._retry_soon(pending, now)
            return Ack.RETRY
        try:
            reply = json.loads(data)
        except ValueError:
            self._retry_soon(pending, now)
            return Ack.RETRY
        error = reply.get("error") if isinstance(reply, dict) else None
        if error:
            code = error.get("code", 0) if isinstance(error, dict) else 0
            if code >= 500 or code == 408:  # stream full with discard new, store busy ...
                self._retry_soon(pending, now)
                return Ack.RETRY
            why = error.get("description", error) if isinstance(error, dict) else error
            self.give_up(pending, f"rejected by JetStream: {why}")
            return Ack.DROPPED
        self._settle(pending)
        counts, out = self.counts, pending.out
        counts.acknowledged += 1
        counts.samples_acknowledged += out.samples
        counts.lost_forwarded += out.lost
        if out.kind == BAD:
            counts.bad_forwarded += 1
        if isinstance(reply, dict) and reply.get("duplicate"):
            counts.duplicates += 1
        return Ack.STORED

    def _retry_soon(self, pending: Pending, now: float) -> None:
        pending.deadline = min(pending.deadline, now + RETRY_SOON * _backoff(pending))

    def _settle(self, pending: Pending) -> None:
        del self.inflight[pending.out.first]
        del self._unsettled[pending.out.first]
        self.inflight_bytes -= len(pending.out.payload)

    def give_up(self, pending: Pending, reason: str) -> None:
        """Settle ``pending`` without an acknowledgement: counted, and its stand-in queued."""
        self._settle(pending)
        self.dropped[reason] += pending.out.samples + pending.out.lost
        if self.framer is not None:
            self.bridges.append((pending.out, self.framer.dropped(pending.out)))

    def give_up_all(self, reason: str) -> bool:
        """Give up every message in flight; whether there was any."""
        pending = list(self.inflight.values())
        for one in pending:
            self.give_up(one, reason)
        return bool(pending)

    # --- retries and the connection ---------------------------------------------------------

    def retry(self, pending: Pending, now: float) -> bool:
        """Whether ``pending`` is to be published again now (counted as a retry): still in
        flight, and overdue or last published on an earlier connection."""
        if pending.out.first not in self.inflight or not (
            pending.connection < self.connection or pending.deadline <= now
        ):
            return False
        self.counts.retried += 1
        return True

    def next_deadline(self) -> float | None:
        """When the earliest acknowledgement in flight is overdue (None: nothing waits)."""
        if not (self.connected and self.inflight):
            return None
        return min(p.deadline for p in self.inflight.values())

    def disconnected(self) -> bool:
        """The connection went down; whether it was up."""
        was, self.connected = self.connected, False
        return was

    def reconnected(self) -> None:
        """A new connection: everything in flight is to be published again, in order."""
        self.connected = True
        self.connection += 1


def _backoff(pending: Pending) -> int:
    return min(1 << (pending.attempts - 1), MAX_BACKOFF)
