"""Public classes show the name users import: ``aperf.UnknownNameError`` in reprs and
tracebacks, not ``aperf._errors.UnknownNameError``; and they still pickle."""

from __future__ import annotations

import importlib
import inspect
import pickle
import subprocess
import sys

import pytest

import aperf
import aperf.fleet

from .test_public_api import public_modules


def public_classes() -> list[tuple[str, type]]:
    found = []
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found.append((module_name, obj))
    return found


def test_every_public_class_is_shown_under_its_public_module() -> None:
    classes = public_classes()
    assert len(classes) > 40
    wrong = [
        (module, cls.__qualname__, cls.__module__)
        for module, cls in classes
        if cls.__module__ != module and not (
            module == "aperf.testing" and cls.__module__ == "aperf"  # re-exported twice
        )
    ]
    assert wrong == []
    assert repr(aperf.UnknownNameError) == "<class 'aperf.UnknownNameError'>"
    assert repr(aperf.fleet.FleetConfigError) == "<class 'aperf.fleet.FleetConfigError'>"


def test_a_traceback_names_aperf_x() -> None:
    code = "import aperf; raise aperf.MapTypeError('map m is a BPF_MAP_TYPE_HASH')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.stderr.splitlines()[-1] == "aperf.MapTypeError: map m is a BPF_MAP_TYPE_HASH"


@pytest.mark.parametrize(
    "value",
    [
        aperf.AperfError("a"),
        aperf.MapTypeError("map m is a BPF_MAP_TYPE_HASH"),
        aperf.RingSizeError("pages"),
        aperf.ObjectStateError("after load"),
        aperf.ClosedResourceError("closed"),
        aperf.LibbpfUnavailableError("no libbpf"),
        aperf.fleet.FleetError("f"),
        aperf.fleet.FrameError("frame"),
        aperf.Sample(1, b"ab", (1, 2)),
        aperf.Lost(0, 5),
        aperf.Wakeup.named("balanced"),
    ],
    ids=lambda value: type(value).__name__,
)
def test_pickling_still_finds_the_class(value: object) -> None:
    data = pickle.dumps(value)
    assert f"{type(value).__module__}".encode() in data  # by its public name
    back = pickle.loads(data)
    assert type(back) is type(value)
    if isinstance(value, BaseException):
        assert isinstance(back, BaseException) and back.args == value.args
    else:
        assert back == value
