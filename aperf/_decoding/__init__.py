"""Bytes to values and back, sans I/O: ``layout`` (C layouts: what BTF, ctypes and
struct compile to), ``decode`` (decoders) and ``encode`` (its inverse)."""
