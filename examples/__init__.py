"""Runnable examples of aperf (run them from the repository root, as root).

- ``.venv/bin/python -m examples.bootstrap_legacy``: the exec/exit tracer (docs/tutorial.md).
- ``.venv/bin/python -m examples.service``: a web service streaming its events (docs/service.md).
"""
