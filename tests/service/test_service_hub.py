"""Unit tests of the service's hub (examples/service/hub.py): ids, replay window, notices.

No kernel, no server: events are published by the test, and a cursor's chunks are read
as a client's writer reads them, then parsed as SSE.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from examples.service.hub import BadEventIdError, Hub, Message

from ..helpers import asyncio_only
from .test_service import Message as SSEMessage
from .test_service import parse_sse

RUN = "r1"


def publish(hub: Hub, count: int) -> None:
    start = hub.next_seq
    hub.publish(Message(f'{{"n": {n}}}') for n in range(start, start + count))


async def take(chunks: AsyncIterator[bytes], count: int) -> list[SSEMessage]:
    """The next ``count`` SSE messages (events and notices) of a client's stream."""
    messages: list[SSEMessage] = []
    while len(messages) < count:
        chunk = await asyncio.wait_for(anext(chunks), 1.0)
        messages += parse_sse(iter(chunk.decode().split("\n")))
    assert len(messages) == count, messages
    return messages


def seqs(messages: list[SSEMessage]) -> list[int]:
    return [int(m.id.rpartition("-")[2]) for m in messages if m.id is not None]


async def connected(hub: Hub, last_event_id: str | None = None) -> AsyncIterator[bytes]:
    chunks = hub.subscribe(last_event_id, "test").chunks()
    greeting = await anext(chunks)
    assert greeting.startswith(b": connected\nretry: 2000\n\n")
    rest = greeting.removeprefix(b": connected\nretry: 2000\n\n")
    if rest:  # a notice comes with the greeting
        async def with_rest() -> AsyncIterator[bytes]:
            yield rest
            async for chunk in chunks:
                yield chunk
        return with_rest()
    return chunks


@pytest.mark.anyio
@asyncio_only
async def test_a_new_client_gets_what_is_published_after_it_came() -> None:
    hub = Hub(8, run=RUN)
    publish(hub, 3)
    chunks = await connected(hub)
    publish(hub, 2)
    messages = await take(chunks, 2)
    assert [m.id for m in messages] == [f"{RUN}-4", f"{RUN}-5"]
    assert [m.json() for m in messages] == [{"n": 4}, {"n": 5}]
    assert all(m.event == "message" for m in messages)
    hub.publish([Message('{"cpu": 1, "count": 9}', "lost")])
    (lost,) = await take(chunks, 1)
    assert (lost.event, lost.id, lost.json()) == ("lost", f"{RUN}-6", {"cpu": 1, "count": 9})


@pytest.mark.anyio
@asyncio_only
async def test_reconnect_in_the_window_replays_exactly_what_was_missed() -> None:
    hub = Hub(8, run=RUN)
    publish(hub, 6)
    chunks = await connected(hub, f"{RUN}-2")
    assert seqs(await take(chunks, 4)) == [3, 4, 5, 6]
    assert hub.replayed == 4
    assert hub.missed == {"slow": 0, "reconnect": 0, "shutdown": 0}
    publish(hub, 1)
    assert seqs(await take(chunks, 1)) == [7]


@pytest.mark.anyio
@asyncio_only
async def test_reconnect_behind_the_window_gets_a_notice_of_how_many() -> None:
    hub = Hub(8, run=RUN)
    publish(hub, 20)  # 13 to 20 are kept
    chunks = await connected(hub, f"{RUN}-3")
    notice, *events = await take(chunks, 9)
    assert (notice.event, notice.id) == ("missed", None)
    assert notice.json() == {"missed": 9, "reason": "reconnect"}  # 4 to 12
    assert seqs(events) == list(range(13, 21))
    assert hub.missed["reconnect"] == 9


@pytest.mark.anyio
@asyncio_only
async def test_a_slow_client_skips_ahead_and_is_told() -> None:
    hub = Hub(8, run=RUN)
    chunks = await connected(hub)
    publish(hub, 3)
    assert seqs(await take(chunks, 3)) == [1, 2, 3]
    publish(hub, 30)  # the client read nothing meanwhile: 4 to 25 left the window
    assert hub.max_lag() == 30
    notice, *events = await take(chunks, 9)
    assert notice.json() == {"missed": 22, "reason": "slow"}
    assert seqs(events) == list(range(26, 34))
    assert hub.missed == {"slow": 22, "reconnect": 0, "shutdown": 0}
    assert hub.max_lag() == 0


@pytest.mark.anyio
@asyncio_only
async def test_ids_of_another_run_or_never_handed_out() -> None:
    hub = Hub(8, run=RUN)
    publish(hub, 5)
    chunks = await connected(hub, "r0-3")  # a restart: how many is unknown
    (notice,) = await take(chunks, 1)
    assert notice.json() == {"missed": None, "reason": "restart"}
    # 5 is the newest; every other id is malformed (Unicode digits, 5000 digits, signs...).
    for bad in ("", "3", "r1-x", f"{RUN}-6", f"{RUN}-99", f"{RUN}-0", f"{RUN}--3", f"{RUN}-²",
                f"{RUN}-" + "9" * 5000, f"{RUN}-" + "9" * 20, f"{RUN}-03", f" {RUN}-3",
                f"{RUN}-3 ", f"-{RUN}-3", "-3", f"{RUN}-", f"{RUN}-3.0", f"{RUN}-\uff13"):
        with pytest.raises(BadEventIdError, match="Last-Event-ID"):
            hub.subscribe(bad, "test")
    with pytest.raises(ValueError, match="window"):
        Hub(1)


@pytest.mark.anyio
@asyncio_only
async def test_close_ends_every_stream_after_what_is_left() -> None:
    hub = Hub(8, run=RUN)
    chunks = await connected(hub)
    waiting = asyncio.ensure_future(anext(chunks))
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing to send: the writer waits
    publish(hub, 2)
    hub.close()
    assert seqs(list(parse_sse(iter((await waiting).decode().split("\n"))))) == [1, 2]
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(chunks), 1.0)
    publish(hub, 1)  # after close: not published, but counted
    assert hub.published == 2 and not hub.cursors
    assert hub.unpublished == 1


async def with_history(hub: Hub, history: int, last_event_id: str | None = None
                       ) -> AsyncIterator[bytes]:
    chunks = hub.subscribe(last_event_id, "test", history).chunks()
    greeting = await anext(chunks)
    assert greeting == b": connected\nretry: 2000\n\n"
    return chunks


@pytest.mark.anyio
@asyncio_only
async def test_history_then_ready_exactly_where_the_client_came() -> None:
    hub = Hub(8, run=RUN)
    publish(hub, 5)
    chunks = await with_history(hub, 3)
    publish(hub, 2)  # after it came, before it read: after `ready`
    *history, ready = await take(chunks, 4)
    assert seqs(history) == [3, 4, 5]
    assert (ready.event, ready.id, ready.json()) == ("ready", None, {"clients": 1})
    assert seqs(await take(chunks, 2)) == [6, 7]
    assert hub.replayed == 0  # nothing sent again to a reconnecting client

    # More than the window holds: the window. None: `ready` at once.
    publish(hub, 20)
    *history, ready = await take(await with_history(hub, 100), 9)
    assert seqs(history) == list(range(20, 28)) and ready.event == "ready"
    (ready,) = await take(await with_history(hub, 0), 1)
    assert ready.json() == {"clients": 3}  # the three clients, this one among them


@pytest.mark.anyio
@asyncio_only
async def test_history_longer_than_a_write_and_a_reconnect_with_it() -> None:
    hub = Hub(1024, run=RUN)
    publish(hub, 600)
    chunks = await with_history(hub, 500)
    *history, ready = await take(chunks, 501)
    assert seqs(history) == list(range(101, 601)) and ready.event == "ready"
    # The browser reconnects with the same URL and its Last-Event-ID: what it missed, then
    # `ready` again.
    publish(hub, 3)
    *missed, ready = await take(await with_history(hub, 500, f"{RUN}-600"), 4)
    assert seqs(missed) == [601, 602, 603] and ready.json() == {"clients": 2}
    assert hub.replayed == 3
