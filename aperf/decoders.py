"""Decoders for ``decoder=``: from BTF, ctypes structures and struct formats; records and
their enums, and ``jsonable`` to turn decoded values into JSON."""

from ._btf import from_btf as from_btf
from ._decode import CEnum as CEnum
from ._decode import Record as Record
from ._decode import SizedDecoder as SizedDecoder
from ._decode import c_string as c_string
from ._decode import from_ctypes as from_ctypes
from ._decode import from_struct as from_struct
from ._decode import jsonable as jsonable
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

_show_public_names(globals())  # shown as this module's, not its private one's
