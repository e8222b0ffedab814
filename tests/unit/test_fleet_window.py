"""The sink's window without a server or a clock: what it keeps in flight, the watermark it
numbers messages with, which acknowledgements settle, retry or give up a message, when a
message is published again, and what is counted when it is given up."""

from __future__ import annotations

import json
from typing import Any

import aperf
from aperf.fleet._window import INTERRUPTED, MAX_BACKOFF, RETRY_SOON, Ack, Window
from aperf.fleet._wire import DROPPED, Framer, Outgoing, parse

STORED = json.dumps({"stream": "APERF", "seq": 1}).encode()


def window(size: int = 2, ack_timeout: float = 1.0, max_events: int = 2) -> Window:
    w = Window(size, ack_timeout)
    w.opened(Framer("web-1", "exec", 7, max_events=max_events, max_bytes=100_000,
                    key=b"k" * 32))
    return w


def samples(n: int, cpu: int = 0) -> list[Any]:
    return [aperf.Sample(cpu, bytes([i]) * 8) for i in range(n)]


def publish(w: Window, out: Outgoing, now: float = 0.0) -> Any:
    pending = w.put(out, {"Nats-Msg-Id": str(out.first)})
    w.attempt(pending, now)
    return pending


def test_the_window_bounds_what_is_in_flight_and_an_ack_makes_room() -> None:
    w = window(size=2)
    outs = w.frame(samples(6))  # three messages of two samples
    assert [(o.first, o.count) for o in outs] == [(0, 2), (2, 2), (4, 2)]
    publish(w, outs[0])
    publish(w, outs[1])
    assert not w.room()  # two in flight: the third waits
    assert w.inflight_bytes == len(outs[0].payload) + len(outs[1].payload)
    assert w.acknowledged(0, None, STORED, 0.5) is Ack.STORED
    assert w.room() and list(w.inflight) == [2]
    assert w.inflight_bytes == len(outs[1].payload)
    c = w.counts
    assert (c.published, c.acknowledged) == (2, 1)
    assert (c.samples_published, c.samples_acknowledged) == (4, 2)


def test_nothing_goes_while_the_connection_is_down() -> None:
    w = window(size=4)
    assert w.room()
    assert w.disconnected() is True and not w.room()
    assert w.disconnected() is False  # said once
    w.reconnected()
    assert w.room()


def test_the_watermark_is_the_lowest_message_not_settled() -> None:
    w = window(size=4)
    first = w.frame(samples(4))  # events 0..3, both framed with watermark 0
    assert [parse(o.payload).watermark for o in first] == [0, 0]
    a, b = (publish(w, o) for o in first)
    assert w.acknowledged(2, None, STORED, 0.0) is Ack.STORED  # the second first
    assert w.watermark() == 0  # event 0's message is still in flight
    assert w.acknowledged(0, None, STORED, 0.0) is Ack.STORED
    assert w.watermark() == 4  # everything framed is settled: the next event
    later = w.frame(samples(2))
    assert parse(later[0].payload).watermark == 4
    # Framed and waiting for room holds the watermark down too.
    assert w.watermark() == 4 and later[0].first == 4
    assert a.out.first == 0 and b.out.first == 2


def test_an_ack_of_no_message_in_flight_is_ignored() -> None:
    w = window()
    out = w.frame(samples(2))[0]
    publish(w, out)
    assert w.acknowledged(99, None, STORED, 0.0) is Ack.IGNORED
    assert w.acknowledged(0, None, STORED, 0.0) is Ack.STORED
    # The answer to an earlier attempt, after the message settled.
    assert w.acknowledged(0, None, STORED, 0.0) is Ack.IGNORED
    assert w.counts.acknowledged == 1


def test_a_duplicate_is_counted_and_settles() -> None:
    w = window()
    out = w.frame(samples(2))[0]
    publish(w, out)
    reply = json.dumps({"stream": "APERF", "seq": 1, "duplicate": True}).encode()
    assert w.acknowledged(0, None, reply, 0.0) is Ack.STORED
    assert w.counts.duplicates == 1 and not w.inflight


def test_lost_and_bad_messages_are_counted_when_stored() -> None:
    w = window(size=8)
    error = aperf.DecodeError(0, b"x", "why")
    outs = w.frame([aperf.Lost(1, 5), aperf.BadSample(0, b"x", error)])
    for out in outs:
        publish(w, out)
        assert w.acknowledged(out.first, None, STORED, 0.0) is Ack.STORED
    assert (w.counts.lost_forwarded, w.counts.bad_forwarded) == (5, 1)


def test_a_temporary_error_or_an_unreadable_answer_is_retried_soon() -> None:
    for status, data in [("503", b""), (None, b"not json"),
                         (None, json.dumps({"error": {"code": 503}}).encode()),
                         (None, json.dumps({"error": {"code": 408}}).encode())]:
        w = window(ack_timeout=5.0)
        pending = publish(w, w.frame(samples(2))[0], now=10.0)
        assert pending.deadline == 15.0
        assert w.acknowledged(0, status, data, 11.0) is Ack.RETRY
        assert pending.deadline == 11.0 + RETRY_SOON  # first attempt: backoff 1
        assert list(w.inflight) == [0] and not w.bridges
        assert not w.retry(pending, 11.0) and w.retry(pending, 11.0 + RETRY_SOON)
        assert w.counts.retried == 1


def test_a_refusal_gives_the_message_up_with_a_stand_in_for_readers() -> None:
    w = window()
    out = w.frame(samples(2))[0]
    publish(w, out)
    reply = json.dumps({"error": {"code": 400, "description": "message size exceeds maximum"}})
    assert w.acknowledged(0, None, reply.encode(), 0.0) is Ack.DROPPED
    assert not w.inflight and w.watermark() == 2
    assert dict(w.dropped) == {"rejected by JetStream: message size exceeds maximum": 2}
    [(given_up, stand_in)] = w.bridges
    frame = parse(stand_in)
    assert given_up is out and frame.kind == DROPPED and (frame.first, frame.count) == (0, 2)


def test_an_ack_overdue_is_published_again_with_a_doubling_timeout() -> None:
    w = window(ack_timeout=1.0)
    pending = publish(w, w.frame(samples(2))[0], now=0.0)
    deadlines = []
    now = 0.0
    for _ in range(6):
        assert w.next_deadline() == pending.deadline
        assert not w.retry(pending, pending.deadline - 0.01)
        now = pending.deadline
        assert w.retry(pending, now)
        w.attempt(pending, now)
        deadlines.append(pending.deadline - now)
    assert deadlines == [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]  # up to MAX_BACKOFF times
    assert MAX_BACKOFF == 8 and w.counts.retried == 6 and pending.attempts == 7


def test_after_a_reconnection_every_message_in_flight_goes_again_in_order() -> None:
    w = window(size=3, ack_timeout=60.0)
    pendings = [publish(w, out) for out in w.frame(samples(6))]
    assert not any(w.retry(p, 1.0) for p in pendings)  # nothing overdue
    w.disconnected()
    assert w.next_deadline() is None  # the driver waits for the connection, not a timer
    w.reconnected()
    assert [p.out.first for p in w.inflight.values() if w.retry(p, 1.0)] == [0, 2, 4]
    for p in pendings:
        w.attempt(p, 1.0)
    assert not any(w.retry(p, 1.0) for p in pendings)  # published on this connection


def test_a_message_settled_meanwhile_is_not_published_again() -> None:
    w = window(size=2)
    a, b = (publish(w, out) for out in w.frame(samples(4)))
    w.reconnected()
    assert w.acknowledged(0, None, STORED, 0.0) is Ack.STORED  # while b was being sent
    assert not w.retry(a, 0.0) and w.retry(b, 0.0)


def test_what_a_close_or_a_refusal_gives_up_is_counted_with_what_it_held() -> None:
    w = window(size=4)
    outs = w.frame([*samples(2), aperf.Lost(3, 40), *samples(1)])
    for out in outs:
        publish(w, out)
    assert w.give_up_all("unacknowledged when the sink closed") is True
    assert dict(w.dropped) == {"unacknowledged when the sink closed": 2 + 40 + 1}
    assert [o.first for o, _ in w.bridges] == [0, 2, 3]
    assert not w.inflight and w.inflight_bytes == 0 and w.watermark() == 4
    assert w.give_up_all("again") is False  # nothing left


def test_framed_and_never_published_is_counted_as_interrupted() -> None:
    w = window(size=1)
    outs = w.frame([*samples(2), aperf.Lost(0, 3), *samples(2)])
    publish(w, outs[0])
    w.abandon(outs[1:])  # send() cancelled while waiting for room
    assert dict(w.dropped) == {INTERRUPTED: 3 + 2}
    assert w.watermark() == 0  # the first is still in flight
    assert w.acknowledged(0, None, STORED, 0.0) is Ack.STORED
    assert w.watermark() == 5 and not w.bridges  # a hole readers report as a Gap
