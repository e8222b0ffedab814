"""aperf.abc: the backend protocols are public, and a source is checked against every
member of RingSource when a stream is made (not with an AttributeError later)."""

from __future__ import annotations

import struct
from typing import Any

import pytest

import aperf
import aperf.abc
from aperf.testing import FakeRingSource

PROTOCOL = ("name", "handle_kind", "records", "open", "ring_bytes", "memory_bytes",
            "acknowledge", "free", "after_fork")


def test_the_check_knows_every_member_of_the_protocol() -> None:
    assert aperf.abc.RING_SOURCE_MEMBERS == PROTOCOL


def _delegate(name: str) -> Any:
    """A class member forwarding ``name`` to the wrapped FakeRingSource."""
    if name in ("ring_bytes", "memory_bytes"):
        return property(lambda self: getattr(self.inner, name))
    if name in ("name", "handle_kind", "records"):
        return property(lambda self: getattr(self.inner, name))
    return lambda self, *args: getattr(self.inner, name)(*args)


def source_class(without: str | None) -> type:
    """A backend of its own (not a FakeRingSource subclass) with every member but ``without``."""
    members: dict[str, Any] = {m: _delegate(m) for m in PROTOCOL if m != without}
    members["__init__"] = lambda self, inner: setattr(self, "inner", inner)
    return type(f"Without_{without}", (), members)


@pytest.mark.parametrize("member", PROTOCOL)
@pytest.mark.parametrize("driver", [aperf.PerfStream, aperf.PerfBuffer])
def test_a_source_lacking_any_member_is_refused_naming_it(driver: Any, member: str) -> None:
    inner = FakeRingSource()
    with pytest.raises(TypeError, match=rf"lacks {member} \(see aperf.abc.RingSource\)"):
        if driver is aperf.PerfBuffer:
            driver(source_class(member)(inner), on_sample=print)
        else:
            driver(source_class(member)(inner))
    inner.free()


@pytest.mark.anyio
async def test_a_source_with_every_member_reads_as_the_fake_does() -> None:
    inner = FakeRingSource(cpus=[0])
    source = source_class(None)(inner)
    async with aperf.PerfStream(source, decoder=struct.Struct("<Q")) as stream:
        for value in range(3):
            assert inner.write(0, struct.pack("<Q", value))
        got = []
        async for event in stream:
            assert isinstance(event, aperf.Sample)
            got.append(event.value)
            if len(got) == 3:
                break
    assert got == [(0,), (1,), (2,)]


def test_what_is_no_source_at_all_keeps_its_message() -> None:
    with pytest.raises(TypeError, match=r"source must be an aperf\.Map"):
        aperf.PerfStream({1, 2})  # type: ignore[arg-type]
    # A list is several maps now; each one is checked as a single source is.
    with pytest.raises(TypeError, match=r"source must be an aperf\.Map.*not float"):
        aperf.PerfStream([1.5, 2])  # type: ignore[list-item]


# --- what a source may add: declared, each a protocol --------------------------------

ABILITIES = (aperf.abc.NoticeSource, aperf.abc.HotplugSource, aperf.abc.PausableSource,
             aperf.abc.QuiescingSource, aperf.abc.SnapshotSource, aperf.abc.GatheringSource,
             aperf.abc.MapSource, aperf.abc.RecordedSource)


def abilities(source: object) -> set[str]:
    return {p.__name__ for p in ABILITIES if isinstance(source, p)}


def test_each_ability_is_a_ring_source_protocol_public_in_abc() -> None:
    for protocol in ABILITIES:
        assert aperf.abc.RingSource in protocol.__mro__, protocol  # as trio.abc's are
        assert protocol.__name__ in aperf.abc.__all__
        assert getattr(protocol, "_is_runtime_protocol", False), protocol
    # A backend of its own with every RingSource member and nothing more has none.
    assert abilities(source_class(None)(FakeRingSource())) == set()


def test_every_source_aperf_ships_declares_what_it_has_and_no_more(tmp_path: Any) -> None:
    from aperf._rings.perf.source import PerfEventArraySource
    from aperf._rings.windows.perf import WindowsPerfSource
    from aperf._rings.windows.ringbuf import WindowsMapSource, WindowsRingBufferSource

    map_sources = {"NoticeSource", "MapSource"}  # the map lock's notice; the claim, the object
    expected: dict[object, set[str]] = {
        aperf.testing.FakeRingSource(): set(),
        PerfEventArraySource("/nonexistent"): map_sources | {
            "HotplugSource", "PausableSource", "QuiescingSource", "SnapshotSource"},
        aperf.RingBufferSource("/nonexistent"): map_sources | {"GatheringSource"},
        aperf.RingBufferArraySource("/nonexistent"): map_sources | {"GatheringSource"},
        WindowsPerfSource("/nonexistent"): map_sources,
        WindowsRingBufferSource("/nonexistent"): map_sources,
        WindowsMapSource("/nonexistent"): map_sources,  # the chosen source's
    }
    pytest.importorskip("pyarrow")
    recorder = aperf.Recorder(tmp_path / "rec")
    recorder.write(aperf.Sample(0, b"x", None))
    recorder.close()
    expected[aperf.replay(tmp_path / "rec")] = {"NoticeSource", "RecordedSource"}
    for source, declared in expected.items():
        assert abilities(source) == declared, type(source).__name__


def test_several_maps_can_do_what_their_maps_can() -> None:
    from aperf._rings.multi import Member, several_maps
    from aperf._rings.perf.source import PerfEventArraySource
    from aperf._rings.seam import SeveralMapsSource

    def of(*sources: Any) -> Any:
        return several_maps([Member(f"m{i}", s, None, sized=True, laid_out=True)
                             for i, s in enumerate(sources)])

    fake, perf = FakeRingSource(), PerfEventArraySource("/nonexistent")
    ringbuf = aperf.RingBufferSource("/nonexistent")
    assert abilities(of(fake, FakeRingSource())) == set()
    # Notices and hotplug if any map has them; pausing only if every map can pause.
    assert abilities(of(fake, ringbuf)) == {"NoticeSource"}
    assert abilities(of(perf, ringbuf)) == {"NoticeSource", "HotplugSource",
                                           "QuiescingSource"}
    assert abilities(of(perf, PerfEventArraySource("/nonexistent"))) == {
        "NoticeSource", "HotplugSource", "PausableSource", "QuiescingSource"}
    for source in (of(fake), of(perf, ringbuf)):
        assert isinstance(source, SeveralMapsSource)
    assert type(of(perf, ringbuf)) is type(of(perf, ringbuf))  # one class per set of them
