"""``aperf-trace``: the exec/exit tracer, shipped as a tool (``python -m aperf trace``).

The Python counterpart of libbpf-bootstrap's ``bootstrap_legacy``. Private
modules, one concern each: ``preflight`` (privileges, tracefs), ``render``
(events as table lines or JSON, raw bytes escaped), ``output`` (stdout that never
blocks the event loop), ``cli`` (options, the trace loop, one-line errors).
``examples/bootstrap_legacy.py`` is the teaching version built on these pieces.
"""
