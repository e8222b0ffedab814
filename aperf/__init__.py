"""aperf: BPF event rings as async event streams.

The public API is re-exported here; the modules behind it are private, in one
package per job. Bottom up (nothing imports upward; docs/architecture.md draws it):

- ``_errors``, ``_privileges``, ``_events``, ``_options``, ``_log``, ``_naming``: the
  vocabulary (errors and why the kernel refused, events, settings)
- ``_native/``: the only ctypes (libbpf, eBPF for Windows' ebpfapi.dll, libc: a timer
  on an fd, a second mapping of perf rings)
- ``_waiting/``: how a driver waits (asyncio, uvloop, trio, epoll, Windows handles)
- ``_decoding/``: C layouts, decoders and their inverse, sans I/O
- ``_bpf/``: BPF objects, and everything read from BTF
- ``_arrow/``: a decoder's layout as an Arrow schema; arrays and events as record batches
- ``_rings/``: the ring-source seam (public as ``aperf.abc``) and the sources with their
  record formats: ``perf/``, ``ringbuf/``, ``windows/`` (and ``FakeRingSource``)
- ``_recording/``: streams written to Parquet files, read back, and replayed as a source
- ``_reading/``: the one reading policy (queue, dispatch, backpressure) and its parts
- ``_drivers/``: ``PerfStream``, ``PerfBuffer``, ``UserRingBuffer`` and what they share;
  they only wait, then call the reader
- ``_tools/``: the commands (``aperf-trace``), built on the public API
"""

from . import abc as abc
from . import decoders as decoders
from ._arrow.builder import ArrowBuilder as ArrowBuilder
from ._bpf.header import include_dir as include_dir
from ._bpf.object import BPFObject as BPFObject
from ._bpf.object import BufferChoice as BufferChoice
from ._bpf.object import Link as Link
from ._bpf.object import Map as Map
from ._bpf.object import Program as Program
from ._drivers.signals import SignalCloser as SignalCloser
from ._drivers.signals import closing_on_signals as closing_on_signals
from ._drivers.stream import PerfStream as PerfStream
from ._drivers.sync import PerfBuffer as PerfBuffer
from ._drivers.user_ringbuf import UserRingBuffer as UserRingBuffer
from ._errors import AperfError as AperfError
from ._errors import ArgumentError as ArgumentError
from ._errors import BrokenRingError as BrokenRingError
from ._errors import BusyResourceError as BusyResourceError
from ._errors import ClosedResourceError as ClosedResourceError
from ._errors import DecodeError as DecodeError
from ._errors import DecoderMismatchError as DecoderMismatchError
from ._errors import GlobalValueError as GlobalValueError
from ._errors import LibbpfError as LibbpfError
from ._errors import LibbpfUnavailableError as LibbpfUnavailableError
from ._errors import MapTypeError as MapTypeError
from ._errors import MissingExtraError as MissingExtraError
from ._errors import MissingPrivilegesError as MissingPrivilegesError
from ._errors import ObjectError as ObjectError
from ._errors import ObjectFileError as ObjectFileError
from ._errors import ObjectStateError as ObjectStateError
from ._errors import PinnedPathError as PinnedPathError
from ._errors import RecordingError as RecordingError
from ._errors import RecordingFormatError as RecordingFormatError
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
from ._naming import show_public_names as _show_public_names
from ._native.libbpf import libbpf_version as libbpf_version
from ._native.libbpf import set_libbpf_verbose as set_libbpf_verbose
from ._options import DEFAULT_PAGES as DEFAULT_PAGES
from ._options import Wakeup as Wakeup
from ._recording.files import Recording as Recording
from ._recording.replay import ReplaySource as ReplaySource
from ._recording.replay import replay as replay
from ._recording.writer import Recorder as Recorder
from ._recording.writer import RecorderStatistics as RecorderStatistics
from ._rings.ringbuf.array import RingBufferArraySource as RingBufferArraySource
from ._rings.ringbuf.format import NO_CPU as NO_CPU
from ._rings.ringbuf.source import RingBufferSource as RingBufferSource

__version__ = "0.2.0"  # the one place it is written (pyproject.toml reads it)

__all__ = [
    "DEFAULT_PAGES",
    "NO_CPU",
    "AperfError",
    "ArgumentError",
    "ArrowBuilder",
    "BPFObject",
    "BadSample",
    "BrokenRingError",
    "BufferChoice",
    "BusyResourceError",
    "ClosedResourceError",
    "CpuStatistics",
    "DecodeError",
    "DecoderMismatchError",
    "Event",
    "GlobalValueError",
    "LibbpfError",
    "LibbpfUnavailableError",
    "Link",
    "Lost",
    "Map",
    "MapTypeError",
    "MissingExtraError",
    "MissingPrivilegesError",
    "ObjectError",
    "ObjectFileError",
    "ObjectStateError",
    "PerfBuffer",
    "PerfStream",
    "PinnedPathError",
    "Program",
    "Recorder",
    "RecorderStatistics",
    "Recording",
    "RecordingError",
    "RecordingFormatError",
    "ReplaySource",
    "RingBufferArraySource",
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
    "include_dir",
    "libbpf_version",
    "replay",
    "set_libbpf_verbose",
]

_show_public_names(globals())  # aperf.UnknownNameError, not aperf._errors.UnknownNameError
