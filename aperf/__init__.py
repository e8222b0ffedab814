"""aperf: BPF perf event arrays as asyncio event streams.

The public API is re-exported here; the modules behind it are private.
"""

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
from ._errors import VerifierError as VerifierError
from ._events import BadSample as BadSample
from ._events import CpuStatistics as CpuStatistics
from ._events import Lost as Lost
from ._events import Sample as Sample
from ._events import StreamStatistics as StreamStatistics
from ._object import BPFObject as BPFObject
from ._object import Link as Link
from ._object import Map as Map
from ._object import Program as Program
from ._options import DEFAULT_PAGES as DEFAULT_PAGES
from ._options import Wakeup as Wakeup
from ._stream import PerfStream as PerfStream
from ._sync import PerfBuffer as PerfBuffer
from ._version import libbpf_version as libbpf_version
from ._version import set_libbpf_verbose as set_libbpf_verbose

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PAGES",
    "AperfError",
    "ArgumentError",
    "BPFObject",
    "BadSample",
    "BrokenRingError",
    "BusyResourceError",
    "ClosedResourceError",
    "CpuStatistics",
    "DecodeError",
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
    "RingSizeError",
    "Sample",
    "StreamStatistics",
    "UnknownNameError",
    "VerifierError",
    "Wakeup",
    "decoders",
    "libbpf_version",
    "set_libbpf_verbose",
]
