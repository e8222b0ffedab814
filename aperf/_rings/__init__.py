"""Things that have rings (the backends), below the reader.

``seam`` is what the reader knows of them (``RingSource``, ``Ring``, ``RecordFormat``,
``Segment``/``Run``, and a protocol for each ability a source may add); ``map_spec`` and
``map_lock`` are the claim on a map the map-backed sources share; ``multi`` is a source
made of several maps' sources. ``perf/`` (perf event arrays), ``ringbuf/`` (BPF ring buffers) and
``windows/`` (eBPF for Windows' sources) hold the formats and the sources; none of the
sources imports another family's source.
"""
