"""The web service example (examples/service): its HTTP endpoints, its access rules,
and its page in a real headless Chromium; most need the kernel too (marked ``kernel``)."""
