"""Tests of your own code with aperf's pytest plugin (docs/testing.md): here, code that
reads the exec/exit tracer's events. No conftest is needed: pytest loads the plugin.

    .venv/bin/python -m pytest examples/test_with_aperf.py              # as root: 4 passed
    .venv/bin/python -m pytest -m "not aperf_kernel" examples/test_with_aperf.py

As a user without the capabilities the two kernel tests are skipped, saying why (or fail
under APERF_REQUIRE_BPF=1); the first two need no root at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

import aperf
from aperf.decoders import SizedDecoder
from aperf.testing import FakeRingSource, Producer, object_path, sample_header

TRACER = object_path("bootstrap_legacy")  # the tracer's BPF object, shipped with aperf


def commands_run(events: Iterable[Any]) -> list[str]:
    """The code under test: the commands that were executed, from the tracer's events."""
    names = []
    for event in events:
        if isinstance(event, aperf.Sample) and not event.value.exit_event:
            names.append(event.value.comm)
    return names


@pytest.fixture
def event() -> SizedDecoder:
    # Opened, never loaded: reading an object's BTF needs no root.
    with aperf.BPFObject(TRACER) as obj:
        return aperf.decoders.from_btf(obj, "event")


def test_commands_run(aperf_fake_source: FakeRingSource, event: SizedDecoder) -> None:
    # A record as the BPF side writes it: struct event's fields in order (pid, ppid,
    # exit_code, duration_ns, comm, filename, exit_event, timestamp_ns), packed by the
    # decoder's own struct, padding and all.
    exec_sh = event.struct.pack(42, 1, 0, 0, b"sh", b"/bin/sh", False, 100)
    exit_sh = event.struct.pack(42, 1, 0, 5_000_000, b"sh", b"", True, 200)
    got: list[Any] = []
    with aperf.PerfBuffer(aperf_fake_source, decoder=event, on_sample=got.append) as pb:
        assert aperf_fake_source.write(0, exec_sh) and aperf_fake_source.write(1, exit_sh)
        pb.poll(1000)
    assert commands_run(got) == ["sh"]


def test_a_short_record_is_a_bad_sample(
    aperf_fake_source: FakeRingSource, event: SizedDecoder
) -> None:
    got: list[Any] = []
    with aperf.PerfBuffer(aperf_fake_source, decoder=event, on_sample=got.append,
                          on_decode_error=got.append) as pb:
        aperf_fake_source.write(0, event.struct.pack(1, 1, 0, 0, b"x", b"", False, 0)[:100])
        pb.poll(1000)
    assert [type(e).__name__ for e in got] == ["BadSample"] and commands_run(got) == []


@pytest.mark.aperf_kernel
def test_the_tracer_loads() -> None:
    with aperf.BPFObject(TRACER) as obj:
        obj.load()  # the verifier accepts it on this kernel


def test_the_kernel_delivers_exactly_what_was_emitted(aperf_producer: Producer) -> None:
    got: list[Any] = []
    with aperf.PerfBuffer(aperf_producer.map, on_sample=got.append) as pb:
        aperf_producer.emit(3, size=32, cpu=0, first_seq=0)
        while len(got) < 3:
            pb.poll(1000)
    assert [sample_header(s.data)[0] for s in got] == [0, 1, 2]
