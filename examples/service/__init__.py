"""A web service that embeds aperf: live exec/exit events, a live page, metrics, health.

It loads the tracer of ``examples/bootstrap_legacy.py`` when the application
starts and reads its perf stream in the background for the application's whole
lifetime (a Starlette lifespan holding an anyio task group)::

    $ .venv/bin/python -m examples.service --host 127.0.0.1 --port 8000
        Open http://127.0.0.1:8000/?token=...     (a token made at start, in a 0600 file)
    $ H="Authorization: Bearer $(cat /run/aperf-service/token-127.0.0.1-8000)"
    $ curl -N -H "$H" http://127.0.0.1:8000/events    # Server-Sent Events, one JSON event each
    $ curl -H "$H" http://127.0.0.1:8000/metrics      # Prometheus text format
    $ curl -H "$H" http://127.0.0.1:8000/health

The modules, in the order events flow through them:

- ``source``: the BPF object and perf stream; a pump task publishes every
  event, timed by the kernel, to the hub;
- ``hub``: one bounded replay window that every ``/events`` client reads
  through a cursor: the pump never waits for a client, a client that
  reconnects with ``Last-Event-ID`` gets what it missed, or a notice of how
  many events it missed;
- ``metrics``: ``/metrics`` through prometheus_client (``grafana-dashboard.json``
  charts them);
- ``access``: who may ask: the Host names served, the token (made at start unless
  ``--token-file`` or ``--no-token``), browser sessions;
- ``connections``: what connections may cost: a deadline for request heads, a limit,
  file descriptors kept for the rings;
- ``app``: the Starlette routes and lifespan; ``static/``: the live page;
- ``cli``: options, logging, start-up checks (each failure is one line on
  stderr and exit status 1), uvicorn.

Beside the service, ``dashboard_picture`` draws the panels of ``grafana-dashboard.json`` from
Prometheus' answers over a recorded run (docs/service.md's picture; Grafana is not used).

SIGTERM or Ctrl-C stops reading the rings, publishes every event read, ends
every event stream, stops the server, closes the perf stream (the rings are
freed) and the BPF object (the programs are detached), and exits with status 0.
Logs are JSON lines on stdout, written by structlog, for aperf's and uvicorn's
loggers alike. docs/service.md tells the whole story.
"""
