"""The one reading policy, sans I/O: what every driver calls, and it never waits.

``reader`` (one Reader: the queue, drains, backpressure, dispatch) and its rooms:
``rings`` (the ring set), ``clock`` (the drain clock), ``losses`` (the loss ledger),
``stats`` (what it counted), ``build`` (events), ``callbacks`` (checked, dispatched),
``columnar`` (NumPy arrays, imported on demand); the features a stream may not use:
``gather`` (gathered wakeups), ``ordering`` (an ordered take, over ``order``'s orderers)
and ``multi`` (several maps, one stream); and ``snapshot`` (flight-recorder rings'
newest records as events).
"""
