"""aperf's pytest plugin with the real probe: a user's suite run by pytest in a
subprocess (``pytester``), as root (the kernel produces exactly what the test asks) and as
root holding no capabilities (the ``aperf_kernel`` tests skip, or fail where BPF is
required)."""

from __future__ import annotations

import shutil
import sys

import pytest

pytest_plugins = ["pytester"]

SUITE = """
import pytest

import aperf
from aperf.testing import sample_header


def test_perf(aperf_producer):
    got = []
    with aperf.PerfBuffer(aperf_producer.map, on_sample=got.append) as pb:
        aperf_producer.emit(5, size=32, cpu=0, first_seq=0)
        while len(got) < 5:
            pb.poll(1000)
    assert [sample_header(s.data)[0] for s in got] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("aperf_producer", [{"ring": "ringbuf"}], indirect=True)
def test_ringbuf(aperf_producer):
    got = []
    with aperf.PerfBuffer(aperf_producer.source(), on_sample=got.append) as pb:
        aperf_producer.emit(3, size=16, cpu=0, first_seq=10)
        while len(got) < 3:
            pb.poll(1000)
    assert [sample_header(s.data)[0] for s in got] == [10, 11, 12]


@pytest.mark.aperf_kernel
def test_marked():
    pass
"""


def test_as_root_the_producer_fixture_emits_exact_counts(
    kernel: None, pytester: pytest.Pytester
) -> None:
    pytester.makepyfile(SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--strict-markers")
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize("required", [False, True], ids=["skips", "required-fails"])
def test_without_capabilities_the_kernel_tests_skip_or_fail(
    kernel: None, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, required: bool
) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("setpriv (util-linux) is needed to drop privileges")
    if required:
        monkeypatch.setenv("APERF_REQUIRE_BPF", "1")
    else:
        monkeypatch.delenv("APERF_REQUIRE_BPF", raising=False)
    pytester.makepyfile(SUITE)
    result = pytester.run(
        setpriv, "--inh-caps=-all", "--bounding-set=-all",  # root holding no capabilities
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--strict-markers", "-rs",
        str(pytester.path),
    )
    why = "this process (root without capabilities) lacks CAP_BPF and CAP_PERFMON"
    if required:
        result.assert_outcomes(errors=3)
        result.stdout.fnmatch_lines([f"*APERF_REQUIRE_BPF=1 but BPF is unavailable: {why}*"])
    else:
        result.assert_outcomes(skipped=3)
        result.stdout.fnmatch_lines([f"*BPF unavailable: {why}*"])
