"""The one reading policy, sans I/O: what every driver calls, and it never waits.

``reader`` (one Reader: rings, queue, backpressure, dispatch) and its parts: ``clock``
(the drain clock), ``losses`` (the loss ledger), ``build`` (events), ``callbacks``
(checked, dispatched), ``columnar`` (NumPy arrays, imported on demand), ``order`` (time
order across rings), ``multi`` (several maps, one stream) and ``snapshot`` (flight-recorder
rings' newest records as events).
"""
