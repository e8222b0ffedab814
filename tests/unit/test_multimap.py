"""Several maps in one stream, on FakeRingSource: the options, the tags, the composite
ring keys kept inside aperf (real CPUs out), failures that name their map."""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
from typing import Any

import anyio
import pytest

import aperf
from aperf._events import tagged
from aperf._rings.perf.fake import _FakeRing
from aperf._rings.seam import MAP_KEY_STRIDE as STRIDE
from aperf._rings.seam import SourceEnded
from aperf._rings.seam import map_key_offset as offset_of
from aperf.testing import FakeRingSource

from ..helpers import past_the_first_look

REC = struct.Struct("<QQ")

pytestmark = pytest.mark.anyio


def fakes(ring_bytes: int = 4096) -> tuple[FakeRingSource, FakeRingSource]:
    return FakeRingSource([0, 1], name="a"), FakeRingSource([0, 1], ring_bytes, name="b")


# --- options -------------------------------------------------------------------------


def test_an_unknown_decoder_name_is_a_value_error_naming_it() -> None:
    a, b = fakes()
    with pytest.raises(aperf.ArgumentError, match=r"no map named 'c'.*'a', 'b'"):
        aperf.PerfStream({"a": a, "b": b}, decoder={"c": REC})
    with pytest.raises(ValueError, match="no map named 'c'"):
        aperf.PerfBuffer({"a": a, "b": b}, decoder={"c": REC}, on_sample=print)


def test_map_names_must_be_distinct_strings() -> None:
    a, _ = fakes()
    with pytest.raises(ValueError, match="empty"):
        aperf.PerfStream({})
    with pytest.raises(TypeError, match="non-empty strings"):
        aperf.PerfStream({1: a})  # type: ignore[dict-item]


def test_a_list_names_its_maps_by_position() -> None:
    a, b = fakes()
    stream = aperf.PerfStream([a, b])
    assert [m.name for m in stream._options.source.members] == ["map0", "map1"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("option", [{"memory_bytes": 1 << 20}, {"overwritable": True}])
def test_one_budget_or_flight_recorder_rings_are_for_one_map(option: dict[str, Any]) -> None:
    a, b = fakes()
    with pytest.raises(aperf.UnsupportedError, match="several maps"):
        aperf.PerfStream({"a": a, "b": b}, **option)


def test_options_only_some_maps_take_need_one_that_takes_them() -> None:
    a, b = fakes()
    with pytest.raises(aperf.UnsupportedError, match="none of these maps"):
        aperf.PerfStream({"a": a, "b": b}, cpus=[0])


def test_a_decoder_mapping_goes_with_several_maps() -> None:
    with pytest.raises(TypeError, match="several maps"):
        aperf.PerfStream(FakeRingSource(), decoder={"a": REC})


def test_arrays_need_a_layout_for_every_map_named() -> None:
    pytest.importorskip("numpy")
    a, b = fakes()
    with pytest.raises(TypeError, match="map 'b'"):
        aperf.PerfBuffer({"a": a, "b": b}, decoder={"a": REC}, on_array=print)


# --- the tags --------------------------------------------------------------------------


def test_tagged_events_pickle_with_their_map() -> None:
    error = aperf.DecodeError(1, b"x", "short", map="a")
    for event in (tagged(aperf.Sample, "a")(1, b"x", (1, 2)), tagged(aperf.Lost, "b")(-1, 3),
                  tagged(aperf.BadSample, "a")(0, b"x", error)):
        again = pickle.loads(pickle.dumps(event))
        assert type(again) is type(event) and again.map == event.map
        assert again[:2] == event[:2]
        if isinstance(event, aperf.Sample):
            assert again == event
    bad = pickle.loads(pickle.dumps(error))
    assert (bad.cpu, bad.data, bad.map, str(bad)) == (1, b"x", "a", str(error))


def test_composite_keys_fit_a_ring_buffer_and_any_cpu() -> None:
    for index in range(3):
        for cpu in (-1, 0, 5, STRIDE - 2):
            key = cpu + offset_of(index)
            assert key // STRIDE == index and key - offset_of(key // STRIDE) == cpu


# --- a stream of two fakes -------------------------------------------------------------


async def test_events_say_their_map_and_real_cpu() -> None:
    a, b = fakes(ring_bytes=256)
    async with aperf.PerfStream({"a": a, "b": b}, decoder={"a": REC}) as stream:
        assert stream.cpus == [0, 1]
        a.write(1, REC.pack(7, 8))
        b.write(1, REC.pack(9, 9))
        for _ in range(20):
            b.write(0, bytes(28))  # 40-byte records: 6 fit in 256 bytes
        events: list[Any] = []
        async for event in stream:
            events.append(event)
            if len(events) == 9:
                break
        stats = stream.statistics()
    by_ring: dict[tuple[str | None, int], list[Any]] = {}
    for event in events:  # in ring order per ring; the rings' order is the wakeups'
        by_ring.setdefault((event.map, event.cpu), []).append(event)
    assert [e.value for e in by_ring["a", 1]] == [(7, 8)]
    assert [e.value for e in by_ring["b", 1]] == [None]
    samples, lost = by_ring["b", 0][:6], by_ring["b", 0][6]
    assert all(isinstance(e, aperf.Sample) and e.value is None for e in samples)
    assert lost == (0, 14) and isinstance(lost, aperf.Lost)  # the exact count, after them
    by = {(c.map, c.cpu): (c.samples, c.lost) for c in stats.cpus}
    assert by == {("a", 0): (0, 0), ("a", 1): (1, 0), ("b", 0): (6, 14), ("b", 1): (1, 0)}
    per_map = stats.by_map()
    assert (per_map["a"].samples, per_map["b"].samples, per_map["b"].lost) == (1, 7, 14)
    assert stats.samples == 8


async def test_a_decode_error_names_its_map_and_cpu() -> None:
    a, b = fakes()
    async with aperf.PerfStream({"a": a, "b": b}, decoder={"b": REC}) as stream:
        b.write(1, b"short")
        event = await stream.__aiter__().__anext__()
        assert isinstance(event, aperf.BadSample) and (event.map, event.cpu) == ("b", 1)
        assert event.error.cpu == 1 and event.error.map == "b"
        assert "CPU 1 of map 'b'" in str(event.error)
        assert [(c.map, c.decode_errors) for c in stream.statistics().cpus if c.cpu == 1] == [
            ("a", 0), ("b", 1)]


async def test_decode_errors_raise_in_order_with_several_maps() -> None:
    a, b = fakes()
    stream = aperf.PerfStream({"a": a, "b": b}, decoder={"b": REC}, decode_errors="raise")
    async with stream:
        b.write(0, REC.pack(1, 1))
        b.write(0, b"bad")
        b.write(0, REC.pack(2, 2))
        stream._require_open().flush()
        got: list[Any] = []
        with pytest.raises(aperf.DecodeError, match="map 'b'"):
            async for event in stream:
                got.append(event.value)
        async for event in stream:
            got.append(event.value)
            break
    assert got == [(1, 1), (2, 2)]


async def test_a_broken_ring_names_its_map_and_cpu() -> None:
    a, b = fakes()
    async with aperf.PerfStream({"a": a, "b": b}) as stream:
        b.inject(1, b"\xff" * 16)  # a record header claiming more than the span
        with pytest.raises(aperf.BrokenRingError) as caught:
            async for _ in stream:
                pass
    assert caught.value.cpu == 1 and caught.value.map == "b"
    assert "map 'b'" in str(caught.value)


async def test_arrays_and_events_turn_into_each_other_per_map() -> None:
    pytest.importorskip("numpy")
    a, b = fakes()
    other = struct.Struct("<QQQ")
    async with aperf.PerfStream({"a": a, "b": b}, decoder={"a": REC, "b": other}) as stream:
        a.write(0, REC.pack(1, 2))
        a.write(0, REC.pack(3, 4))
        b.write(0, other.pack(5, 6, 7))
        stream._require_open().flush()
        async for event in stream:  # one event of a; the rest waits in the front
            assert (event.map, event.value) == ("a", (1, 2))
            break
        items = [item async for item in _take(stream.arrays(), 2)]
        assert [(i.map, i.cpu, i.values.tolist()) for i in items] == [
            ("a", 0, [(3, 4)]), ("b", 0, [(5, 6, 7)])]
        a.write(1, REC.pack(8, 9))
        stream._require_open().flush()
        reader = stream._require_open()
        reader.put_back(reader.take_arrays())  # arrays at the front, back to events
        event = await stream.__aiter__().__anext__()
        assert (event.map, event.cpu, event.value) == ("a", 1, (8, 9))


async def _take(items: Any, count: int) -> Any:
    async for item in items:
        yield item
        count -= 1
        if not count:
            return


async def test_pause_is_all_or_nothing() -> None:
    a, b = fakes()
    async with aperf.PerfStream({"a": a, "b": b}) as stream:
        with pytest.raises(aperf.UnsupportedError, match="'a', 'b'"):
            stream.pause()


async def test_an_open_that_fails_frees_the_maps_opened_before() -> None:
    a, b = fakes()
    b.open(aperf.abc.RingConfig(None, aperf.Wakeup.per_sample()))  # busy: the stream's fails
    with pytest.raises(aperf.BusyResourceError):
        await aperf.PerfStream({"a": a, "b": b}).open()
    a.open(aperf.abc.RingConfig(None, aperf.Wakeup.per_sample()))  # a was freed
    a.free()
    b.free()


def test_perf_buffer_by_real_cpu() -> None:
    a, b = fakes()
    seen: list[Any] = []
    with aperf.PerfBuffer({"a": a, "b": b}, on_sample=seen.append) as pb:
        assert pb.cpus == [0, 1] and pb.buffer_cnt == 4
        with pytest.raises(ValueError, match="several maps"):
            pb.buffer_fd(0)
        a.write(1, b"x" * 12)
        b.write(1, b"y" * 12)
        a.write(0, b"z" * 12)
        assert pb.consume_buffer(1) == 2  # both maps' rings of CPU 1
        assert [(e.map, e.cpu) for e in seen] == [("a", 1), ("b", 1)]
        assert pb.consume() == 1
    assert seen[-1].map == "a" and seen[-1].cpu == 0


# --- notices: a map taken over, CPU hotplug --------------------------------------------


class _Noticed(FakeRingSource):
    """A fake with a notice handle (an eventfd), as a map's lock and hotplug socket are."""

    def __init__(self, name: str) -> None:
        super().__init__(cpus=[0, 1], name=name)
        self.notice = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @property
    def notices(self) -> list[int]:
        return [self.notice]

    def fire(self) -> None:
        os.eventfd_write(self.notice, 1)

    def _clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.notice)


class _TakenOver(_Noticed):
    def acknowledge(self, handle: int) -> None:
        if handle != self.notice:
            super().acknowledge(handle)
            return
        self._clear()
        raise SourceEnded(aperf.TakenOverError(self.name, 7, 1234), drain=False)


class _Hotplugged(_Noticed):
    """Its notice says CPU 1 went offline and CPU 2 came online."""

    changed = False

    def acknowledge(self, handle: int) -> None:
        if handle != self.notice:
            super().acknowledge(handle)
            return
        self._clear()
        self.changed = True

    def cpus_changed(self) -> tuple[list[int], list[Any]]:
        if not self.changed:
            return [], []
        self.changed = False
        ring = _FakeRing(2, self.ring_bytes, self._lock, True)
        self._rings[2] = ring
        return [1], [ring]


async def test_a_map_taken_over_ends_the_stream_after_the_others_are_drained() -> None:
    a, taken = FakeRingSource([0, 1], name="a"), _TakenOver("t")
    got: list[Any] = []
    try:
        wakeup = aperf.Wakeup.every(1000, max_latency=60)  # nothing read before the notice
        async with aperf.PerfStream({"a": a, "t": taken}, wakeup=wakeup) as stream:
            await past_the_first_look(stream, a, taken)
            for i in range(10):
                assert a.write(i % 2, i.to_bytes(4, "little"))
                assert taken.write(i % 2, i.to_bytes(4, "little"))
            taken.fire()
            with pytest.raises(aperf.TakenOverError), anyio.fail_after(10):
                async for event in stream:
                    got.append(event)
    finally:
        os.close(taken.notice)
    # The other map's samples, all of them; none of the map that is no longer ours.
    assert sorted(int.from_bytes(e.data[:4], "little") for e in got) == list(range(10))
    assert {e.map for e in got} == {"a"}


async def test_hotplug_notices_go_to_their_map_with_its_keys() -> None:
    a, hot = FakeRingSource([0, 1], name="a"), _Hotplugged("h")
    got: list[Any] = []
    try:
        async with aperf.PerfStream({"a": a, "h": hot}) as stream:
            assert hot.write(1, b"before")
            assert a.write(1, b"a-cpu1")
            hot.fire()
            with anyio.fail_after(10):
                while stream.cpus != [0, 1, 2]:
                    await anyio.sleep(0.01)
            assert hot.write(2, b"after!")
            async for event in stream:
                got.append(event)
                if len(got) == 3:
                    break
            stats = {(c.map, c.cpu): c.samples for c in stream.statistics().cpus}
    finally:
        os.close(hot.notice)
    assert sorted((e.map, e.cpu, e.data[:6]) for e in got) == [
        ("a", 1, b"a-cpu1"), ("h", 1, b"before"), ("h", 2, b"after!")]
    assert stats == {("a", 0): 0, ("a", 1): 1, ("h", 0): 0, ("h", 1): 1, ("h", 2): 1}


# --- several maps in time order ------------------------------------------------------


def test_an_order_by_field_one_map_lacks_names_that_map() -> None:
    a, b = fakes()
    both = aperf.decoders.from_struct(REC, names=("seq", "ts"))
    other = aperf.decoders.from_struct(REC, names=("seq", "stamp"))
    with pytest.raises(aperf.ArgumentError) as info:
        aperf.PerfStream({"a": a, "b": b}, decoder={"a": both, "b": other}, order_by="ts")
    assert isinstance(info.value, ValueError) and info.value.argument == "order_by"
    assert str(info.value) == (
        "map 'b': order_by='ts': the decoder's records have no field 'ts' (fields: seq, stamp)"
    )
    with pytest.raises(aperf.ArgumentError, match=r"^map 'a': order_by='t-s' is not a field"):
        aperf.PerfBuffer({"a": a, "b": b}, decoder=both, order_by="t-s", on_sample=print)



async def test_several_maps_merge_in_time_order_with_losses_in_place() -> None:
    a, b = fakes(ring_bytes=256)
    decoder = aperf.decoders.from_struct(REC, names=("seq", "ts"))
    async with aperf.PerfStream({"a": a, "b": b}, decoder=decoder, order_by="ts") as stream:
        for ts in (1, 4, 7):
            a.write(0, REC.pack(ts, ts))
        for ts in (2, 5):
            b.write(1, REC.pack(ts, ts))
        for ts in range(10, 20):
            b.write(0, REC.pack(ts, ts))  # 32-byte records: 8 fit in 256, 2 dropped
        events: list[Any] = []
        async for event in stream:
            events.append(event)
            if len(events) == 14:  # 13 samples and one Lost notice
                break
        stats = stream.statistics()
    samples = [e for e in events if isinstance(e, aperf.Sample)]
    assert [e.value.ts for e in samples] == sorted(e.value.ts for e in samples)
    assert [(e.map, e.cpu) for e in samples[:5]] == [
        ("a", 0), ("b", 1), ("a", 0), ("b", 1), ("a", 0)]
    lost = [e for e in events if isinstance(e, aperf.Lost)]
    assert lost == [(0, 2)] and lost[0].map == "b"
    # The notice follows the last sample of its ring that made it (ts 17).
    assert events.index(lost[0]) == len(events) - 1 and events[-2].value.ts == 17
    assert stats.late == 0 and stats.lost == 2


async def test_ordered_arrays_of_several_maps_are_refused_naming_why() -> None:
    pytest.importorskip("numpy")
    a, b = fakes()
    decoder = aperf.decoders.from_struct(REC, names=("seq", "ts"))
    async with aperf.PerfStream({"a": a, "b": b}, decoder=decoder, order_by="ts") as stream:
        with pytest.raises(aperf.UnsupportedError, match="several maps"):
            stream.arrays()
        a.write(0, REC.pack(1, 1))  # the stream goes on: events in order still
        async for event in stream:
            assert event.value.ts == 1
            break
