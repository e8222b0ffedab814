"""The sdist and the wheel, built and installed into a fresh venv (marked
``packaging``: slow, needs the package index)."""
