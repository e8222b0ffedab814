"""Drivers: wait (through ``_waiting``), then call the reader.

``setup`` (options checked once; source and decoder resolved), ``lifetime`` (one open,
fork check, finalizer and close: ``OpenReader``), ``stream`` (``PerfStream``, async),
``sync`` (``PerfBuffer``), ``signals`` (closing them on SIGINT or SIGTERM), ``lease``
(perf rings viewed in place) and ``user_ringbuf`` (``UserRingBuffer``: user space to BPF).
"""
