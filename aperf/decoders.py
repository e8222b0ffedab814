"""Decoders for ``decoder=``: from BTF, ctypes structures and struct formats; records and
their enums, and ``jsonable`` to turn decoded values into JSON."""

from __future__ import annotations

from ._bpf.object import BPFObject
from ._decoding.decode import CEnum as CEnum
from ._decoding.decode import Record as Record
from ._decoding.decode import SizedDecoder as SizedDecoder
from ._decoding.decode import c_string as c_string
from ._decoding.decode import from_ctypes as from_ctypes
from ._decoding.decode import from_struct as from_struct
from ._decoding.decode import jsonable as jsonable
from ._naming import show_public_names as _show_public_names

__all__ = [
    "CEnum",
    "Record",
    "SizedDecoder",
    "c_string",
    "from_btf",
    "from_ctypes",
    "from_struct",
    "jsonable",
]


def from_btf(obj: BPFObject, type_name: str) -> SizedDecoder:
    """Decode samples as the C struct ``type_name`` described by ``obj``'s BTF.

    ``obj`` is an open [`BPFObject`][aperf.BPFObject]; ``type_name`` a struct name
    (``"event"`` or ``"struct event"``) or a typedef of a struct (``"event_t"``).
    Integers of every width and signedness, bool, enums (members of an
    ``IntEnum``, see docs/decoding.md), floats, pointers (ints), nested and
    anonymous structs and unions, fixed arrays and a trailing flexible array
    are supported; ``char[N]`` becomes ``str``, other 1-byte arrays ``bytes``.
    """
    return obj._btf_decoder(type_name)


_show_public_names(globals())  # shown as this module's, not its private one's
