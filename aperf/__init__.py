"""aperf: BPF event rings as async event streams.

The public API is re-exported here; the modules behind it are private. Their
layout, bottom up (nothing imports upward):

- ``_errors``, ``_privileges``, ``_events``, ``_options``: the vocabulary (errors and
  why the kernel refused, events, settings)
- ``_libbpf/``: libbpf's ctypes prototypes (``_prototypes`` is what it shares with
  ``_ebpfwin/``)
- ``_object``, ``_btf``: BPF objects, and everything read from BTF
- ``_perf_format``, ``_ringbuf_format``, ``_decode``, ``_encode``: sans-I/O ring
  arithmetic and records (perf rings, BPF ring buffers), decoders and their inverse
- ``_source``: the ring-source seam (public as ``aperf.abc``); ``_perf_source`` (Linux
  perf event arrays), ``_ringbuf_source`` (BPF ring buffers), ``_ebpfwin`` (eBPF for
  Windows), all on ``_map_spec``, and ``_fake`` (``aperf.testing.FakeRingSource``)
  implement it
- ``_reader``: the one reading policy (queue, dispatch, backpressure), with its parts
  ``_clock`` (drain clock), ``_losses`` (loss ledger), ``_build`` (events from raw pieces),
  ``_callbacks`` (callback checks and dispatch)
- ``_setup``, ``_lifetime``, ``_waiting/`` (how to wait: asyncio, uvloop, trio, epoll),
  ``_stream``, ``_sync``: the drivers (async, sync) that only wait; ``_signals``: closing
  them on SIGINT/SIGTERM on any loop
- ``_user_ringbuf``: ``UserRingBuffer``, the other direction (user space to BPF)
"""

from . import abc as abc
from . import decoders as decoders
from ._errors import AperfError as AperfError
from ._errors import ArgumentError as ArgumentError
from ._errors import BrokenRingError as BrokenRingError
from ._errors import BusyResourceError as BusyResourceError
from ._errors import ClosedResourceError as ClosedResourceError
from ._errors import DecodeError as DecodeError
from ._errors import GlobalValueError as GlobalValueError
from ._errors import LibbpfError as LibbpfError
from ._errors import LibbpfUnavailableError as LibbpfUnavailableError
from ._errors import MapTypeError as MapTypeError
from ._errors import MissingPrivilegesError as MissingPrivilegesError
from ._errors import ObjectError as ObjectError
from ._errors import ObjectFileError as ObjectFileError
from ._errors import ObjectStateError as ObjectStateError
from ._errors import PinnedPathError as PinnedPathError
from ._errors import RingFullError as RingFullError
from ._errors import RingSizeError as RingSizeError
from ._errors import TakenOverError as TakenOverError
from ._errors import UnknownNameError as UnknownNameError
from ._errors import UnsupportedError as UnsupportedError
from ._errors import VerifierError as VerifierError
from ._events import BadSample as BadSample
from ._events import CpuStatistics as CpuStatistics
from ._events import Event as Event
from ._events import Lost as Lost
from ._events import Sample as Sample
from ._events import SampleArray as SampleArray
from ._events import StreamStatistics as StreamStatistics
from ._events import Tails as Tails
from ._libbpf import libbpf_version as libbpf_version
from ._libbpf import set_libbpf_verbose as set_libbpf_verbose
from ._naming import show_public_names as _show_public_names
from ._object import BPFObject as BPFObject
from ._object import Link as Link
from ._object import Map as Map
from ._object import Program as Program
from ._options import DEFAULT_PAGES as DEFAULT_PAGES
from ._options import Wakeup as Wakeup
from ._ringbuf_format import NO_CPU as NO_CPU
from ._ringbuf_source import RingBufferSource as RingBufferSource
from ._signals import SignalCloser as SignalCloser
from ._signals import closing_on_signals as closing_on_signals
from ._stream import PerfStream as PerfStream
from ._sync import PerfBuffer as PerfBuffer
from ._user_ringbuf import UserRingBuffer as UserRingBuffer

__version__ = "0.2.0"  # the one place it is written (pyproject.toml reads it)

__all__ = [
    "DEFAULT_PAGES",
    "NO_CPU",
    "AperfError",
    "ArgumentError",
    "BPFObject",
    "BadSample",
    "BrokenRingError",
    "BusyResourceError",
    "ClosedResourceError",
    "CpuStatistics",
    "DecodeError",
    "Event",
    "GlobalValueError",
    "LibbpfError",
    "LibbpfUnavailableError",
    "Link",
    "Lost",
    "Map",
    "MapTypeError",
    "MissingPrivilegesError",
    "ObjectError",
    "ObjectFileError",
    "ObjectStateError",
    "PerfBuffer",
    "PerfStream",
    "PinnedPathError",
    "Program",
    "RingBufferSource",
    "RingFullError",
    "RingSizeError",
    "Sample",
    "SampleArray",
    "SignalCloser",
    "StreamStatistics",
    "Tails",
    "TakenOverError",
    "UnknownNameError",
    "UnsupportedError",
    "UserRingBuffer",
    "VerifierError",
    "Wakeup",
    "abc",
    "closing_on_signals",
    "decoders",
    "libbpf_version",
    "set_libbpf_verbose",
]

_show_public_names(globals())  # aperf.UnknownNameError, not aperf._errors.UnknownNameError
