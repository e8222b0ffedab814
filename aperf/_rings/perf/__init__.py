"""Perf event arrays: ``format`` (perf records), ``runs`` (their runs found by NumPy, for
columnar consumers), ``backward`` (an overwritable ring read
newest to oldest), ``hotplug`` (CPUs going offline and online), ``source`` (the kernel's
perf event array) and ``fake`` (perf rings in memory: ``aperf.testing.FakeRingSource``)."""
