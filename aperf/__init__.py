"""aperf: BPF event rings as async event streams.

The public API is re-exported here; the modules behind it are private. Their
layout, bottom up (nothing imports upward):

- ``_errors``, ``_events``, ``_options``: the vocabulary (errors, events, settings)
- ``_libbpf/``: the only package that speaks ctypes (libbpf's prototypes)
- ``_object``, ``_btf``: BPF objects, and everything read from BTF
- ``_perf_format``, ``_ringbuf_format``, ``_decode``: sans-I/O ring arithmetic and
  records (perf rings, BPF ring buffers), decoders
- ``_source``: the ring-source seam; ``_perf_source`` (Linux perf event arrays),
  ``_ringbuf_source`` (BPF ring buffers, on ``_map_spec``) and ``_fake``
  (``aperf.testing.FakeRingSource``) implement it
- ``_reader``: the one reading policy (queue, drain clock, dispatch, backpressure)
- ``_setup``, ``_loops`` (asyncio, uvloop), ``_trio``, ``_stream``, ``_sync``: the drivers
  (async, sync) that only wait
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
from ._errors import RingSizeError as RingSizeError
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
from ._object import BPFObject as BPFObject
from ._object import Link as Link
from ._object import Map as Map
from ._object import Program as Program
from ._options import DEFAULT_PAGES as DEFAULT_PAGES
from ._options import Wakeup as Wakeup
from ._ringbuf_format import NO_CPU as NO_CPU
from ._ringbuf_source import RingBufferSource as RingBufferSource
from ._stream import PerfStream as PerfStream
from ._sync import PerfBuffer as PerfBuffer

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
    "RingSizeError",
    "Sample",
    "SampleArray",
    "StreamStatistics",
    "Tails",
    "UnknownNameError",
    "UnsupportedError",
    "VerifierError",
    "Wakeup",
    "abc",
    "decoders",
    "libbpf_version",
    "set_libbpf_verbose",
]
