"""Things that have rings (the backends), below the reader.

``seam`` is what the reader knows of them (``RingSource``, ``Ring``, ``RecordFormat``,
``Segment``/``Run``); ``map_spec`` and ``map_lock`` are the claim on a map the map-backed
sources share. ``perf/`` (perf event arrays), ``ringbuf/`` (BPF ring buffers) and
``windows/`` (eBPF for Windows' sources) hold the formats and the sources; none of the
sources imports another family's source.
"""
