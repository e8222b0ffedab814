"""aperf.fleet: forward perf streams into NATS JetStream, and read a fleet back as one stream.

Needs the ``nats`` extra: ``pip install 'aperf[nats]'``. See docs/fleet.md.

- :class:`JetStreamSink` forwards an :class:`aperf.PerfStream` (or events you
  give it) to subject ``aperf.<host>.<stream>``, in batches, with message ids,
  a bounded window of unacknowledged messages and backpressure into the stream.
- :class:`FleetReader` reads a JetStream stream through a durable consumer and
  yields :class:`FleetEvent` ``(host, stream, event)`` tuples: the same
  ``Sample``/``Lost``/``BadSample`` events, decoded with the same decoders, and
  :class:`Gap` notices for anything JetStream no longer holds.
- :func:`create_stream` makes the JetStream stream both sides use.
"""

try:
    import nats as _nats  # noqa: F401  # only to fail early with a useful message
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "aperf.fleet needs nats-py, which is not installed: pip install 'aperf[nats]'"
    ) from _exc

from ._connect import create_stream as create_stream
from ._errors import FleetClosedError as FleetClosedError
from ._errors import FleetConfigError as FleetConfigError
from ._errors import FleetError as FleetError
from ._errors import FrameError as FrameError
from ._events import FleetEvent as FleetEvent
from ._events import Gap as Gap
from ._events import ReaderStatistics as ReaderStatistics
from ._events import SinkStatistics as SinkStatistics
from ._reader import FleetReader as FleetReader
from ._sink import JetStreamSink as JetStreamSink

__all__ = [
    "FleetClosedError",
    "FleetConfigError",
    "FleetError",
    "FleetEvent",
    "FleetReader",
    "FrameError",
    "Gap",
    "JetStreamSink",
    "ReaderStatistics",
    "SinkStatistics",
    "create_stream",
]
