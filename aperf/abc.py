"""The protocols a ring backend implements, for ``PerfStream(source)`` and ``PerfBuffer(source)``.

As ``trio.abc`` and ``anyio.abc`` do, this module only re-exports: the seam
itself is ``aperf/_rings/seam.py``. A backend is a [`RingSource`][aperf.abc.RingSource]
whose `open()` returns [`Ring`][aperf.abc.Ring]s and whose `records` is a
[`RecordFormat`][aperf.abc.RecordFormat] that splits what a ring hands over into
[`Segment`][aperf.abc.Segment]s. These are structural types (`typing.Protocol`):
a backend need not inherit from them, and a stream checks, when it is made, that
the source has every member. docs/architecture.md ("Adding a backend") walks
through one; ``aperf.testing.FakeRingSource`` is a complete one.
"""

from ._naming import show_public_names as _show_public_names
from ._rings.seam import RING_SOURCE_MEMBERS as RING_SOURCE_MEMBERS
from ._rings.seam import HandleKind as HandleKind
from ._rings.seam import RecordFormat as RecordFormat
from ._rings.seam import Ring as Ring
from ._rings.seam import RingConfig as RingConfig
from ._rings.seam import RingSource as RingSource
from ._rings.seam import Run as Run
from ._rings.seam import Segment as Segment

__all__ = [
    "RING_SOURCE_MEMBERS",
    "HandleKind",
    "RecordFormat",
    "Ring",
    "RingConfig",
    "RingSource",
    "Run",
    "Segment",
]

_show_public_names(globals())  # shown as this module's, not its private one's
