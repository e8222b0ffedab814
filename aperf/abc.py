"""The protocols a ring backend implements, for ``PerfStream(source)`` and ``PerfBuffer(source)``.

As ``trio.abc`` and ``anyio.abc`` do, this module only re-exports: the seam
itself is ``aperf/_rings/seam.py``. A backend is a [`RingSource`][aperf.abc.RingSource]
whose `open()` returns [`Ring`][aperf.abc.Ring]s and whose `records` is a
[`RecordFormat`][aperf.abc.RecordFormat] that splits what a ring hands over into
[`Segment`][aperf.abc.Segment]s. These are structural types (`typing.Protocol`):
a backend need not inherit from them, and a stream checks, when it is made, that
the source has every member. docs/architecture.md ("Adding a backend") walks
through one; ``aperf.testing.FakeRingSource`` is a complete one.

What a source may add is a sub-protocol each, as ``trio.abc.HalfCloseableStream``
adds to ``trio.abc.Stream``: [`NoticeSource`][aperf.abc.NoticeSource] (handles of no
ring), [`HotplugSource`][aperf.abc.HotplugSource] (CPUs going offline and online),
[`PausableSource`][aperf.abc.PausableSource] (``pause()``/``resume()``),
[`QuiescingSource`][aperf.abc.QuiescingSource] (stopping the producer before the
close's last drain), [`SnapshotSource`][aperf.abc.SnapshotSource] (flight-recorder
rings), [`GatheringSource`][aperf.abc.GatheringSource] (wakeups only once caught up),
[`MapSource`][aperf.abc.MapSource] (a claimed BPF map) and
[`RecordedSource`][aperf.abc.RecordedSource] (a recording's decoder). A stream uses an
ability when ``isinstance(source, ...)`` says the source has it.
"""

from ._naming import show_public_names as _show_public_names
from ._rings.seam import RING_SOURCE_MEMBERS as RING_SOURCE_MEMBERS
from ._rings.seam import GatheringSource as GatheringSource
from ._rings.seam import HandleKind as HandleKind
from ._rings.seam import HotplugSource as HotplugSource
from ._rings.seam import MapSource as MapSource
from ._rings.seam import NoticeSource as NoticeSource
from ._rings.seam import PausableSource as PausableSource
from ._rings.seam import QuiescingSource as QuiescingSource
from ._rings.seam import RecordedSource as RecordedSource
from ._rings.seam import RecordFormat as RecordFormat
from ._rings.seam import Ring as Ring
from ._rings.seam import RingConfig as RingConfig
from ._rings.seam import RingSource as RingSource
from ._rings.seam import Run as Run
from ._rings.seam import Segment as Segment
from ._rings.seam import SnapshotSource as SnapshotSource

__all__ = [
    "RING_SOURCE_MEMBERS",
    "GatheringSource",
    "HandleKind",
    "HotplugSource",
    "MapSource",
    "NoticeSource",
    "PausableSource",
    "QuiescingSource",
    "RecordFormat",
    "RecordedSource",
    "Ring",
    "RingConfig",
    "RingSource",
    "Run",
    "Segment",
    "SnapshotSource",
]

_show_public_names(globals())  # shown as this module's, not its private one's
