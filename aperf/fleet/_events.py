"""What the fleet reader yields, and the statistics of the sink and the reader."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple


class FleetEvent(NamedTuple):
    """One event of one host's stream: ``event`` is an [`aperf.Sample`][aperf.Sample],
    [`aperf.Lost`][aperf.Lost], [`aperf.BadSample`][aperf.BadSample], [`Gap`][aperf.fleet.Gap],
    or a [`Malformed`][aperf.fleet.Malformed] notice."""

    host: str
    stream: str
    event: Any


class Gap(NamedTuple):
    """Events ``first .. first+count-1`` of this host's stream were stored in JetStream
    but never reached this reader (the stream's limits removed them, or the sink had to
    drop them). They held ``samples`` samples and Lost notices totalling ``lost``:
    exact figures, from the cumulative counters every message carries."""

    first: int
    count: int  # type: ignore[assignment]  # shadows tuple.count, as aperf.Lost does
    samples: int
    lost: int


class Malformed(NamedTuple):
    """A message on ``subject`` (stored at ``stream_sequence`` in the JetStream stream)
    that this reader did not hand out as events, and why; or, for a conflict, one it
    did hand out though it may be forged.

    Yielded in the stream, in order, as ``FleetEvent(host, stream, Malformed(...))``
    where ``host`` and ``stream`` are the subject's tokens (``aperf.<host>.<stream>``;
    empty if the subject has another shape): the subject is the identity NATS
    permissions enforce, never what the payload claims. Counted in
    [`ReaderStatistics`][aperf.fleet.ReaderStatistics]: ``malformed`` (not a
    version-2 aperf.fleet message, or inconsistent), ``refused`` (well-formed, but its
    host or stream disagrees with its subject, or it fails its sink run's chain of
    tags: forged), ``conflicts`` (handed out, but it claims events that another
    message claims too, or the chain later showed events handed out to be forged).
    The message is acknowledged once the notice is handed out: it never blocks the
    durable consumer.
    """

    subject: str
    stream_sequence: int
    reason: str


@dataclass(frozen=True)
class SinkStatistics:
    """A snapshot of a sink's counters (messages, unless named samples).

    ``dropped`` maps a reason to the samples the sink gave up on for it: data samples,
    plus the counts of the Lost notices it dropped. ``in_flight_bytes`` never exceeds
    ``window * max_message_bytes``, whatever the outage.
    """

    published: int
    acknowledged: int
    retried: int
    duplicates: int
    samples_published: int
    samples_acknowledged: int
    lost_forwarded: int
    bad_forwarded: int
    dropped: Mapping[str, int]
    in_flight: int
    in_flight_bytes: int
    connected: bool
    reconnects: int

    @property
    def dropped_samples(self) -> int:
        """Samples the sink gave up on, whatever the reason (the sum of ``dropped``)."""
        return sum(self.dropped.values())


@dataclass(frozen=True)
class ReaderStatistics:
    """A snapshot of a [`FleetReader`][aperf.fleet.FleetReader]'s counters since it opened.

    ``short``: samples refused as shorter than their decoder's size (also in ``bad``;
    announced by one notice per message). ``evicted``: runs and ranges of runs the
    reader stopped tracking at its limits (each announced). ``sources``: the sink runs
    (host, stream, run id) it has seen. ``lost``, ``gap_samples`` and ``gap_lost`` add
    up what hosts claim: each stops at 2^63-1.
    """

    messages: int
    samples: int
    lost: int
    bad: int
    gaps: int
    gap_samples: int
    gap_lost: int
    duplicates: int
    malformed: int
    sources: int
    refused: int = 0
    conflicts: int = 0
    short: int = 0
    evicted: int = 0
