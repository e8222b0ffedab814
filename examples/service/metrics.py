"""``/metrics`` through prometheus_client: a collector that reads aperf's and the hub's counters.

The collector keeps no state of its own: at each scrape it reads ``stream.statistics()`` (an
immutable snapshot) and the hub's counters. Labels are bounded: ``cpu`` (one per ring) and
``reason`` (a few values); nothing is labelled per client. The registry also holds
prometheus_client's process, platform and GC collectors, so ``process_*`` (CPU, memory, fds)
and ``python_gc_*`` come for free.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

import aperf

from .connections import ConnectionGuard
from .hub import Hub
from .source import TraceSource

# (family, CpuStatistics field, help) of the per-CPU counters.
PER_CPU_COUNTERS = (
    ("aperf_samples", "samples", "Samples read from each CPU's perf ring."),
    ("aperf_bytes", "bytes", "Bytes read from each CPU's perf ring."),
    ("aperf_wakeups", "wakeups", "Kernel wakeups of the reader per CPU."),
    ("aperf_decode_errors", "decode_errors", "Samples that did not decode."),
)
# (family, CpuStatistics field, help) of the per-CPU gauges of ring occupancy.
PER_CPU_GAUGES = (
    ("aperf_ring_backlog_bytes", "backlog_bytes",
     "Bytes waiting in each CPU's ring now, written and not yet read."),
    ("aperf_ring_high_water_ratio", "high_water",
     "The fullest each CPU's ring was found at a drain, as a fraction of its size."),
)
# reason label of aperf_lost_total -> CpuStatistics field; the two add up to all drops.
LOST_REASONS = (("queue", "queue_lost"), ("ring", "ring_lost"))


def by_reason(name: str, text: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter family with one ``reason`` label per key of ``counts`` (a fixed few)."""
    family = CounterMetricFamily(name, text, labels=["reason"])
    for reason, count in counts.items():
        family.add_metric([reason], count)
    return family


class ServiceCollector(Collector):
    """aperf's stream statistics and the hub's counters, read at each scrape."""

    def __init__(self, source: TraceSource, hub: Hub, guard: ConnectionGuard) -> None:
        self.source = source
        self.hub = hub
        self.guard = guard

    def collect(self) -> Iterator[Metric]:
        source, hub = self.source, self.hub
        yield GaugeMetricFamily("aperf_stream_open", "1 while the perf stream is open and read.",
                                value=int(source.stream_open))
        if source.stream is not None:
            yield from self._stream(source.stream.statistics())
        yield GaugeMetricFamily("aperf_sse_clients", "Connected /events clients.",
                                value=len(hub.cursors))
        yield CounterMetricFamily("aperf_sse_events_published",
                                  "Events published to the /events clients.",
                                  value=hub.published)
        yield by_reason(
            "aperf_sse_missed",
            "Events that clients did not get, all clients together: they read too slowly "
            "(slow) or reconnected after the events had left the replay window (reconnect).",
            hub.missed)
        yield CounterMetricFamily("aperf_sse_replayed",
                                  "Events sent again to clients that reconnected.",
                                  value=hub.replayed)
        yield GaugeMetricFamily("aperf_sse_replay_window",
                                "Events kept for reconnecting and slow clients.",
                                value=hub.window)
        yield GaugeMetricFamily("aperf_sse_max_lag",
                                "Events the slowest connected client has yet to take.",
                                value=hub.max_lag())
        yield from self._connections()

    def _connections(self) -> Iterator[Metric]:
        """What connections cost (connections.py), and the event streams refused."""
        guard = self.guard
        for name, text, value in (
            ("aperf_http_connections", "HTTP connections held now.", len(guard.held)),
            ("aperf_http_connections_limit", "Connections held at most (--max-connections).",
             guard.max_connections),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        yield by_reason(
            "aperf_http_connections_dropped",
            "Connections the service closed: no request head in time (header_timeout), "
            "pushed out by a newer one at the limit (pushed_out), or closed at once with "
            "every connection busy (refused).", guard.dropped)
        yield CounterMetricFamily("aperf_sse_refused",
                                  "Event streams refused with 503: as many as --max-clients "
                                  "were open.", value=self.hub.refused)

    @staticmethod
    def _stream(stats: aperf.StreamStatistics) -> Iterator[Metric]:
        for name, field, text in PER_CPU_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["cpu"])
            for c in stats.cpus:
                family.add_metric([str(c.cpu)], getattr(c, field))
            yield family
        lost = CounterMetricFamily(
            "aperf_lost",
            "Samples the kernel dropped because a ring was full: while the service's queue "
            "was full and held the ring back (queue), or otherwise (ring).",
            labels=["cpu", "reason"])
        for c in stats.cpus:
            for reason, field in LOST_REASONS:
                lost.add_metric([str(c.cpu), reason], getattr(c, field))
        yield lost
        for name, field, text in PER_CPU_GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["cpu"])
            for c in stats.cpus:
                gauge.add_metric([str(c.cpu)], getattr(c, field))
            yield gauge
        broken = GaugeMetricFamily("aperf_ring_broken",
                                   "1 if the CPU's ring was stopped as corrupt.", labels=["cpu"])
        for c in stats.cpus:
            broken.add_metric([str(c.cpu)], int(c.broken))
        yield broken
        yield GaugeMetricFamily("aperf_stream_pending",
                                "Events read from the rings, not yet taken.", value=stats.pending)
        yield GaugeMetricFamily("aperf_stream_max_pending", "Bound of the stream's queue.",
                                value=stats.max_pending)
        yield GaugeMetricFamily("aperf_ring_bytes", "Data bytes of each CPU's ring.",
                                value=stats.ring_bytes)


def registry(source: TraceSource, hub: Hub, guard: ConnectionGuard) -> CollectorRegistry:
    """A registry of the service's own: the service's collector and the standard ones."""
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    reg.register(ServiceCollector(source, hub, guard))
    return reg


def endpoint(reg: CollectorRegistry) -> Callable[[Request], Awaitable[Response]]:
    """The ``/metrics`` handler: the format the scraper asks for (Accept), 0.0.4 by default."""

    async def metrics(request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(reg), headers={"Content-Type": content_type})

    return metrics
