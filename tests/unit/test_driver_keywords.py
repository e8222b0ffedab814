"""The drivers' shared keyword text and overloads (scripts/driver_keywords.py): PerfBuffer's
entries are PerfStream's, each driver's overloads follow its __init__, and a drift fails."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import aperf

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "driver_keywords.py"


def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("driver_keywords", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sources() -> tuple[str, str]:
    return ((REPO / "aperf/_drivers/stream.py").read_text(),
            (REPO / "aperf/_drivers/sync.py").read_text())


def test_the_checked_in_drivers_are_as_generated() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_perfbuffers_entry_edited_alone_is_put_back() -> None:
    stream, sync = sources()
    drifted = sync.replace("ring_bytes: bytes per ring instead", "ring_bytes: bytes per ring", 1)
    assert drifted != sync
    assert script().generate(stream, drifted) == (stream, sync)


def test_an_edit_to_perfstreams_entry_reaches_perfbuffer() -> None:
    stream, sync = sources()
    edited = stream.replace("lateness: seconds an ordered stream holds an event at most",
                            "lateness: seconds an ordered stream holds one event at most", 1)
    assert edited != stream
    _, new_sync = script().generate(edited, sync)
    assert "lateness: seconds an ordered stream holds one event at most" in new_sync


def test_a_substitution_that_no_longer_matches_is_an_error() -> None:
    stream, sync = sources()
    edited = stream.replace("events the stream queues", "events the stream holds", 1)
    module = script()
    try:
        module.generate(edited, sync)
    except module.DriftError as exc:
        assert "max_pending" in str(exc)
    else:
        raise AssertionError("a SUBS entry that matches nothing went unnoticed")


def test_a_new_keyword_of_init_reaches_every_overload() -> None:
    stream, sync = sources()
    marker = "        lateness: float = DEFAULT_LATENESS,\n    ) -> None:\n"
    assert stream.count(marker) == 1
    edited = stream.replace(marker, marker.replace(
        ",\n    )", ",\n        shiny: bool = False,\n    )"))
    new_stream, _ = script().generate(edited, sync)
    assert new_stream.count("        shiny: bool = ...,\n") == 3


def test_both_drivers_describe_every_keyword_in_help() -> None:
    for driver in (aperf.PerfStream, aperf.PerfBuffer):
        doc = inspect.getdoc(driver) or ""
        for name in inspect.signature(driver.__init__).parameters:
            if name != "self":
                assert f"\n    {name}: " in doc, (driver.__name__, name)
    assert "the CPUs to open rings on (a perf event array only; default" in (
        inspect.getdoc(aperf.PerfBuffer) or "")
