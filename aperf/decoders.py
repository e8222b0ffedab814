"""Decoders for ``decoder=``: from BTF, ctypes structures and struct formats."""

from ._btf import from_btf as from_btf
from ._decode import SizedDecoder as SizedDecoder
from ._decode import c_string as c_string
from ._decode import from_ctypes as from_ctypes
from ._decode import from_struct as from_struct

__all__ = ["SizedDecoder", "c_string", "from_btf", "from_ctypes", "from_struct"]
