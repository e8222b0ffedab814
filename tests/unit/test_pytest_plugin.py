"""aperf's pytest plugin as a user's suite sees it: pytest itself, in a subprocess, with
the plugin loaded from its installed entry point (``pytester``, pytest's own fixture for
testing plugins). Where BPF must be unavailable, the inner suite's conftest says so in
place of the plugin's probe; tests/kernel/test_pytest_plugin.py runs the real probe, as
root and as a process without capabilities."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

import aperf
from aperf.testing import FakeRingSource

pytest_plugins = ["pytester"]

NO_BPF = """
import aperf.pytest_plugin

aperf.pytest_plugin.bpf_unavailable_reason = lambda: "simulated: no BPF here"
"""

NEEDS_BPF = """
import pytest

@pytest.mark.aperf_kernel
def test_marked():
    pass

def test_producer(aperf_producer):
    pass

def test_plain():
    pass
"""


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers", *args)


def test_the_plugin_is_the_pytest11_entry_point_aperf() -> None:
    found = [e.value for e in entry_points(group="pytest11") if e.name == "aperf"]
    assert found == ["aperf.pytest_plugin"]


def test_the_fake_source_fixture_reads_and_is_freed_after_the_test(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("""
        import struct

        import pytest

        import aperf

        LEFT_OPEN = []

        def test_reads(aperf_fake_source):
            assert aperf_fake_source.cpus == [0, 1] and aperf_fake_source.ring_bytes == 4096
            got = []
            pb = aperf.PerfBuffer(aperf_fake_source, decoder=struct.Struct("<Q"),
                                  on_sample=lambda s: got.append((s.cpu, s.value)))
            LEFT_OPEN.append((aperf_fake_source, pb))  # never closed by this test
            assert aperf_fake_source.write(1, struct.pack("<Q", 7))
            pb.poll(1000)
            assert got == [(1, (7,))]

        def test_the_plugin_freed_it():
            source, _ = LEFT_OPEN[0]
            with pytest.raises(aperf.ClosedResourceError):
                source.write(0, b"late")

        @pytest.mark.parametrize(
            "aperf_fake_source", [{"cpus": [3], "ring_bytes": 64}], indirect=True
        )
        def test_configured(aperf_fake_source):
            assert aperf_fake_source.cpus == [3] and aperf_fake_source.ring_bytes == 64
    """)
    run(pytester).assert_outcomes(passed=3)


def test_without_bpf_the_marked_tests_skip_saying_why(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("APERF_REQUIRE_BPF", raising=False)  # CI sets it for aperf's own suite
    pytester.makeconftest(NO_BPF)
    pytester.makepyfile(NEEDS_BPF)
    result = run(pytester, "-rs")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*BPF unavailable: simulated: no BPF here*"])


@pytest.mark.parametrize("how", ["env", "ini", "option"])
def test_where_bpf_is_required_they_fail_instead(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    pytester.makeconftest(NO_BPF)
    pytester.makepyfile(NEEDS_BPF)
    args: list[str] = []
    monkeypatch.delenv("APERF_REQUIRE_BPF", raising=False)
    if how == "env":
        monkeypatch.setenv("APERF_REQUIRE_BPF", "1")
    elif how == "ini":
        pytester.makeini("[pytest]\naperf_require_bpf = true\n")
    else:
        args.append("--aperf-require-bpf")
    result = run(pytester, *args)
    result.assert_outcomes(passed=1, errors=2)  # failed at setup: the run fails
    result.stdout.fnmatch_lines(["*APERF_REQUIRE_BPF=1 but BPF is unavailable: simulated*"])


def test_tests_that_take_the_producer_are_marked_and_can_be_deselected(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(NO_BPF)
    pytester.makepyfile(NEEDS_BPF)
    run(pytester, "-m", "not aperf_kernel").assert_outcomes(passed=1, deselected=2)


def test_a_suite_with_aperfs_own_names_does_not_clash(pytester: pytest.Pytester) -> None:
    # aperf's own tests/conftest.py has a kernel marker and kernel/producer fixtures.
    pytester.makeini("[pytest]\nmarkers =\n    kernel: the suite's own\n")
    pytester.makeconftest("""
        import pytest

        @pytest.fixture
        def kernel():
            return "the suite's kernel"

        @pytest.fixture
        def producer(kernel):
            return "the suite's producer"
    """)
    pytester.makepyfile("""
        import pytest

        @pytest.mark.kernel
        def test_own(kernel, producer, aperf_fake_source):
            assert (kernel, producer) == ("the suite's kernel", "the suite's producer")
            assert aperf_fake_source.cpus == [0, 1]
    """)
    run(pytester).assert_outcomes(passed=1)


def test_p_no_aperf_turns_it_off(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(aperf_fake_source):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:aperf")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'aperf_fake_source' not found*"])


def record(path: Path) -> None:
    """A recording of 10 samples and a loss on CPU 0, made from rings in memory."""
    decoder = aperf.decoders.from_struct("<IQ", names="pid latency_ns")
    src = FakeRingSource(cpus=[0], ring_bytes=256)
    with aperf.Recorder(path, decoder, rings=[(None, 0)]) as recorder, aperf.PerfBuffer(
        src, decoder=decoder, on_sample=recorder, on_lost=recorder
    ) as pb:
        fitted = sum(src.write(0, decoder.struct.pack(i, i * 10)) for i in range(12))
        assert fitted == 10
        pb.consume()
        src.write(0, decoder.struct.pack(12, 120))  # the lost record goes in front of it
        pb.consume()


def test_the_replay_fixture_plays_a_recording_next_to_the_test(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pyarrow")
    record(pytester.path / "recordings" / "run1")
    pytester.makepyfile("""
        import pytest

        import aperf

        @pytest.mark.parametrize("aperf_replay", ["recordings/run1"], indirect=True)
        def test_replayed(aperf_replay):
            got = []
            with aperf.PerfBuffer(aperf_replay, decoder=aperf_replay.decoder,
                                  on_sample=got.append, on_lost=got.append) as pb:
                while not pb.closed:
                    pb.poll(100)
            assert [e.value.pid for e in got if isinstance(e, aperf.Sample)] == [
                *range(10), 12]
            assert [e for e in got if isinstance(e, aperf.Lost)] == [aperf.Lost(0, 2)]

        @pytest.mark.parametrize("aperf_replay", [{"path": "recordings/run1", "speed": 1000}],
                                 indirect=True)
        def test_with_arguments(aperf_replay):
            assert aperf_replay.speed == 1000 and aperf_replay.keys == [0]

        def test_without_a_recording(aperf_replay):
            pass
    """)
    result = run(pytester)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*aperf_replay plays a recording: name it with*"])
