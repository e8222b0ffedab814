"""Tests that need no root, no kernel and no server: fakes, formats, the reader, the
drivers on FakeRingSource, the public API, the layers (libbpf must be installed)."""
