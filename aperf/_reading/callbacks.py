"""Callback mode: what a callback is checked for when it is given, and how a batch of
events is handed to the callbacks (plain functions and coroutines alike)."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any

from .._events import Lost, Sample, SampleArray

_RECEIVES = {
    "on_sample": "the aperf.Sample (.cpu, .data, .value)",
    "on_lost": "the aperf.Lost notice (.cpu, .count)",
    "on_decode_error": "the aperf.BadSample (.cpu, .data, .error)",
    "on_array": "the aperf.SampleArray (.cpu, .values, .tails)",
    "on_batch": "the list of events",
}


def check_callback(name: str, callback: object) -> None:
    """TypeError naming ``name`` unless ``callback`` can be called with one argument
    (aperf calls it with one event, never BCC's ``(cpu, data, size)``)."""
    if not callable(callback):
        raise TypeError(f"{name} must be callable, not {type(callback).__name__}")
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to check
    try:
        signature.bind(None)
    except TypeError:
        label = getattr(callback, "__qualname__", None) or repr(callback)
        empty = inspect.Parameter.empty
        signature = signature.replace(  # the names only: what the call would bind
            parameters=[p.replace(annotation=empty) for p in signature.parameters.values()],
            return_annotation=empty,
        )
        raise TypeError(
            f"{name} is called with one argument, {_RECEIVES.get(name, 'the event')}: "
            f"def {name}(event): ...; {label}{signature} cannot take that (a BCC-style "
            "callback(cpu, data, size) reads event.cpu and event.data instead)"
        ) from None


@dataclass(frozen=True)
class Handlers:
    """The callbacks of callback mode, checked when they are given."""

    on_sample: Callable[[Any], Any] | None
    on_lost: Callable[[Any], Any] | None = None
    on_decode_error: Callable[[Any], Any] | None = None
    on_array: Callable[[Any], Any] | None = None  # columnar: SampleArray items

    def __post_init__(self) -> None:
        for name in ("on_sample", "on_lost", "on_decode_error", "on_array"):
            value = getattr(self, name)
            if value is not None:
                check_callback(name, value)
        if (self.on_sample is None) == (self.on_array is None):
            raise ValueError("give on_sample or on_array (columnar), one of them")

    @property
    def columnar(self) -> bool:
        return self.on_array is not None


def dispatch(
    batch: list[Any], handlers: Handlers, put_back: Callable[[list[Any]], None]
) -> Generator[Awaitable[Any], None, None]:
    """Hand each event to its callback; yield what a callback returned to be awaited.

    A driver awaits (or refuses) each yielded awaitable and throws its
    exception back in here. Whatever the failure, the events after the
    failing one are put back, in order, for the next round.
    """
    on_sample = handlers.on_sample
    on_lost = handlers.on_lost
    on_bad = handlers.on_decode_error
    on_array = handlers.on_array
    isawaitable = inspect.isawaitable
    index = 0
    try:
        for index, event in enumerate(batch):  # noqa: B007 - index is used on error
            cls = event.__class__
            # A tagged event (late, or of a named map) is a subclass: its base decides.
            cls = cls if cls is Sample or cls is SampleArray else getattr(cls, "_untagged", cls)
            if cls is Sample:
                result = on_sample(event)  # type: ignore[misc]
            elif cls is Lost:
                if on_lost is None:
                    continue
                result = on_lost(event)
            elif cls is SampleArray:
                result = on_array(event)  # type: ignore[misc]
            elif on_bad is not None:
                result = on_bad(event)
            else:
                raise event.error
            # The callback is called inline and awaited only when it returned an
            # awaitable: a coroutine layer per event cost ~290 ns (measured);
            # `is not None` first, because isawaitable(None) costs ~150 ns.
            if result is not None and isawaitable(result):
                yield result
    except BaseException:
        put_back(batch[index + 1 :])
        raise
