"""Commands built on the public API: ``trace/`` (``aperf-trace``) and ``nats_options``
(the ``--nats`` options of the commands, without nats-py)."""
