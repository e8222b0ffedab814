"""aperf.fleet: forward perf streams into NATS JetStream, and read a fleet back as one stream.

Needs the ``nats`` extra: ``pip install 'aperf-bpf[nats]'``. See docs/fleet.md.

- [`JetStreamSink`][aperf.fleet.JetStreamSink] forwards an
  [`aperf.PerfStream`][aperf.PerfStream] (or events you give it) to subject
  ``aperf.<host>.<stream>``, in batches, with message ids, a bounded window of
  unacknowledged messages and backpressure into the stream.
- [`FleetReader`][aperf.fleet.FleetReader] reads a JetStream stream through a
  durable consumer and yields [`FleetEvent`][aperf.fleet.FleetEvent]
  ``(host, stream, event)`` tuples: the same ``Sample``/``Lost``/``BadSample``
  events, decoded with the same decoders, and [`Gap`][aperf.fleet.Gap] notices
  for anything JetStream no longer holds, and [`Malformed`][aperf.fleet.Malformed]
  notices for messages it refused (not aperf's, or forged).
- [`create_stream()`][aperf.fleet.create_stream] makes the JetStream stream both
  sides use.
- [`NatsOptions`][aperf.fleet.NatsOptions] says how all three reach the NATS servers
  (URLs, credentials, TLS, timeouts), in one checked value.
"""

try:
    import nats as _nats  # noqa: F401  # only to fail early with a useful message
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "aperf.fleet needs nats-py, which is not installed: pip install 'aperf-bpf[nats]'"
    ) from _exc

from .._naming import show_public_names as _show_public_names
from ._connect import NatsOptions as NatsOptions
from ._connect import create_stream as create_stream
from ._errors import FleetAuthError as FleetAuthError
from ._errors import FleetClosedError as FleetClosedError
from ._errors import FleetConfigError as FleetConfigError
from ._errors import FleetError as FleetError
from ._errors import FleetInsecureError as FleetInsecureError
from ._errors import FleetInsecureWarning as FleetInsecureWarning
from ._errors import FleetUnavailableError as FleetUnavailableError
from ._errors import FrameError as FrameError
from ._events import FleetEvent as FleetEvent
from ._events import Gap as Gap
from ._events import Malformed as Malformed
from ._events import ReaderStatistics as ReaderStatistics
from ._events import SinkStatistics as SinkStatistics
from ._reader import FleetReader as FleetReader
from ._sink import JetStreamSink as JetStreamSink

__all__ = [
    "FleetAuthError",
    "FleetClosedError",
    "FleetConfigError",
    "FleetError",
    "FleetEvent",
    "FleetInsecureError",
    "FleetInsecureWarning",
    "FleetReader",
    "FleetUnavailableError",
    "FrameError",
    "Gap",
    "JetStreamSink",
    "Malformed",
    "NatsOptions",
    "ReaderStatistics",
    "SinkStatistics",
    "create_stream",
]

_show_public_names(globals())  # aperf.fleet.FleetError, not aperf.fleet._errors.FleetError
