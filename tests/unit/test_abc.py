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
