"""What the benchmark runs: producers, consumers, and the scenarios pairing them.

A scenario is one producer run read by one consumer process. Names read
``GROUP/CONSUMER``, e.g. ``flat32/aperf.aiter.btf@uvloop``; ``--only`` takes
shell patterns over names and group names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PEER_PAGES = 128  # aperf's default ring (aperf.DEFAULT_PAGES): every consumer gets the same
BALANCED_WATERMARK = 128 * 4096 // 4  # aperf's default wakeup: a quarter of the ring
DRAIN_MS = 1  # aperf's default drain timer period (Wakeup.balanced: max_latency=1 ms)


@dataclass(frozen=True)
class Scenario:
    group: str
    consumer: dict[str, Any]
    producer: dict[str, Any]
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def impl(self) -> str:
        return str(self.consumer["impl"])

    @property
    def key(self) -> str:
        c = self.consumer
        if c["impl"] == "aperf":
            key = f"aperf.{c['mode']}{c.get('max_items') or ''}.{c.get('decoder') or 'raw'}"
            if c.get("wakeup"):
                key += f".{c['wakeup']}"
            if c.get("order_by"):
                key += ".ordered"
            if c.get("pure"):
                key += ".pure"  # APERF_NO_EXTENSIONS=1: the pure-Python path
            if c["mode"].startswith("sync"):
                return key
            return key + f"@{c.get('loop', 'asyncio')}"
        if c["impl"] == "libbpf":
            if c["wakeup"] == "ringbuf":
                return "libbpf.ringbuf"
            if c.get("preset"):
                return f"libbpf.{c['preset']}"
            return f"libbpf.{'per-sample' if c['wakeup'] == 'default' else 'watermark'}"
        if c["impl"] == "bcc":
            return f"bcc.{c['mode']}.w{c['wakeup']}" if c["mode"] != "attach-only" else "bcc.none"
        return str(c["impl"])

    @property
    def name(self) -> str:
        return f"{self.group}/{self.key}"

    @property
    def label(self) -> str:
        return consumer_label(self.consumer)


MODE_LABELS = {
    "aiter": "async for",
    "batches": "batches()",  # aperf's default max_items unless the scenario names one
    "callback": "callback on_sample",
    "on_batch": "callback on_batch",
    "sync": "sync PerfBuffer.poll",
    "slow": "slow async for",
    "arrays": "columnar arrays()",
    "on_array": "columnar callback on_array",
    "sync_array": "columnar sync PerfBuffer(on_array=).poll",
    "lease": "columnar lease() (in place)",
    "sync_lease": "columnar sync PerfBuffer.lease() (in place)",
}


WAKEUP_LABELS = {"strict": "default with idle_latency=1 ms (Wakeup.balanced(idle_latency=0.001))"}


def consumer_label(c: dict[str, Any]) -> str:
    impl = c["impl"]
    if impl == "aperf":
        decoder = {None: "raw", "btf": "BTF", "struct": "struct", "ctypes": "ctypes"}[
            c.get("decoder")]
        mode = MODE_LABELS[c["mode"]]
        if c.get("max_items"):
            mode = mode.replace("()", f"(max_items={c['max_items']})")
        text = f"aperf {mode}, {decoder}"
        if not c["mode"].startswith("sync"):
            text += f", {c.get('loop', 'asyncio')}"
        wakeup = c.get("wakeup") or "default"
        text += f", wakeup {WAKEUP_LABELS.get(wakeup, wakeup)}"
        if c.get("channels"):
            text += f", {c['channels']} rings ({c['pages']} pages each)"
        text += f", ordered by {c['order_by']}" if c.get("order_by") else ""
        return text + (", pure Python path (APERF_NO_EXTENSIONS=1)" if c.get("pure") else "")
    if impl == "libbpf":
        if c["wakeup"] == "ringbuf":
            return "libbpf C ring_buffer__poll on the BPF ring buffer (producer's wakeups)"
        if c["wakeup"] == "default":
            return "libbpf C perf_buffer__poll, wakeup per sample"
        rings = f", {c['channels']} rings" if c.get("channels") else ""
        return f"libbpf C perf_buffer__poll, {c['wakeup']} + {c['drain_ms']} ms drain{rings}"
    if impl == "bcc":
        if c["mode"] == "attach-only":
            return "BCC program, no consumer (baseline)"
        how = "counting" if c["mode"] == "count" else 'b["events"].event()'
        drain = f" + {DRAIN_MS} ms drain" if c["wakeup"] > 1 else ""
        return f"BCC perf_buffer_poll, {how}, wakeup_events={c['wakeup']}{drain}"
    if impl == "none":
        return "program attached, no consumer (baseline)"
    if impl == "noprog":
        return "no BPF program (bare workload)"
    raise ValueError(impl)


def aperf(mode: str, decoder: str | None = None, loop: str = "asyncio",
          wakeup: str | None = None, max_items: int | None = None,
          order_by: str | None = None, pure: bool = False) -> dict[str, Any]:
    c = {"impl": "aperf", "mode": mode, "decoder": decoder, "loop": loop, "wakeup": wakeup}
    if max_items:
        c["max_items"] = max_items  # batches(): aperf's default when absent
    if order_by:
        c["order_by"] = order_by  # an ordered stream (docs/ordering.md)
    if pure:
        c["pure"] = True  # issue 31: the consumer runs with APERF_NO_EXTENSIONS=1
    return c


def pure(c: dict[str, Any]) -> dict[str, Any]:
    """The same aperf consumer on the pure-Python path."""
    return dict(c, pure=True)


# Issue 21: ordered streams (order_by="ts") next to the same consumers unordered.
ORDERED = [aperf("aiter", "btf", order_by="ts"), aperf("arrays", "btf", order_by="ts")]


LIBBPF_PER_SAMPLE = {"impl": "libbpf", "wakeup": "default", "pages": PEER_PAGES, "drain_ms": 0}
LIBBPF_MATCHED = {
    "impl": "libbpf",
    "wakeup": f"watermark:{BALANCED_WATERMARK}",
    "pages": PEER_PAGES,
    "drain_ms": DRAIN_MS,
}


LIBBPF_RINGBUF = {"impl": "libbpf", "wakeup": "ringbuf", "pages": 0, "drain_ms": 0}
RINGBUF_BYTES = 2 * PEER_PAGES * 4096  # as much memory as the perf rows' two 512 KiB rings


def bcc(mode: str, wakeup: int = 1) -> dict[str, Any]:
    return {"impl": "bcc", "mode": mode, "wakeup": wakeup, "pages": PEER_PAGES,
            "drain_ms": DRAIN_MS}


# aperf's "throughput" preset in C: a wakeup per half ring, a 10 ms drain.
LIBBPF_THROUGHPUT = {
    "impl": "libbpf",
    "preset": "throughput",
    "wakeup": f"watermark:{PEER_PAGES * 4096 // 2}",
    "pages": PEER_PAGES,
    "drain_ms": 10,
}

# Issue 11: columnar consumers (NumPy arrays) and the compiled ctypes decoder, on every
# producer its targets name, next to the per-item decoded consumers; the columnar
# consumer also with the throughput preset, against libbpf C with the same settings.
COLUMNAR = [aperf("arrays", "btf"), aperf("arrays", "btf", loop="uvloop"),
            aperf("on_array", "btf"), aperf("sync_array", "btf"),
            aperf("arrays", "btf", wakeup="throughput"),
            aperf("arrays", "btf", loop="uvloop", wakeup="throughput"), LIBBPF_THROUGHPUT]
CTYPES_DECODED = [aperf("aiter", "ctypes")]
# Issue 23: leases, columnar batches viewing the rings in place, next to arrays().
LEASES = [aperf("lease", "btf"), aperf("lease", "btf", loop="uvloop"),
          aperf("sync_lease", "btf"), aperf("lease", "btf", wakeup="throughput")]


# Issue 31: the consumers its targets name, each also on the pure path, in the same run.
NATIVE_TARGETS = [aperf("lease", "btf"), aperf("lease", "btf", loop="uvloop"),
                  aperf("arrays", "btf"), aperf("arrays", "btf", loop="uvloop")]
# Issue 31 §4: a many-CPU host simulated with map_keys= channels (ring k on CPU k % 2,
# in slot k), small rings, the 1 ms drain timer kept (strict): idle, and one ring busy.
RING_COUNTS = (2, 16, 64, 128, 256)
CHANNEL_PAGES = 8


def channel_consumers(n: int) -> list[dict[str, Any]]:
    mine = [aperf("aiter", wakeup="strict"), aperf("aiter", wakeup="strict", loop="uvloop"),
            aperf("aiter", wakeup="strict", pure=True)]
    peer = dict(LIBBPF_MATCHED, wakeup=f"watermark:{CHANNEL_PAGES * 4096 // 4}")
    return [dict(c, channels=n, pages=CHANNEL_PAGES) for c in [*mine, peer]]


def per_sample(c: dict[str, Any]) -> bool:
    """Does this consumer ask for a wakeup per sample?"""
    return c.get("wakeup") in ("lowest-latency", "default", 1)


def all_scenarios(quick: bool) -> list[Scenario]:
    out: list[Scenario] = []

    # 1. The deterministic producer flat out (issues 3 and 5): every consumer kind.
    for size, count in ((32, 2_000_000 if quick else 8_000_000),
                        (256, 1_000_000 if quick else 4_000_000)):
        producer = {"kind": "burst", "count": count, "size": size}
        group = f"flat{size}"
        consumers = [
            aperf("aiter"),
            aperf("aiter", loop="uvloop"),
            aperf("aiter", loop="trio"),
            aperf("aiter", "struct"),
            aperf("aiter", "btf"),
            aperf("aiter", "btf", loop="uvloop"),
            aperf("batches"),
            aperf("batches", "btf"),
            aperf("batches", "btf", max_items=256),
            aperf("batches", loop="trio"),
            aperf("callback"),
            aperf("callback", loop="trio"),
            aperf("on_batch"),
            aperf("on_batch", "btf"),
            aperf("sync"),
            aperf("sync", "btf"),
            aperf("aiter", wakeup="lowest-latency"),
            LIBBPF_MATCHED,
            LIBBPF_PER_SAMPLE,
        ]
        consumers += COLUMNAR + CTYPES_DECODED + ORDERED + LEASES
        consumers += [pure(c) for c in NATIVE_TARGETS] + [pure(aperf("aiter", "btf"))]
        if quick and size == 256:
            consumers = [aperf("aiter"), aperf("aiter", "btf"), aperf("batches", "btf"),
                         aperf("callback"), aperf("sync"), LIBBPF_MATCHED, *COLUMNAR[:2],
                         *LEASES, *(pure(c) for c in NATIVE_TARGETS)]
        if size == 256:
            consumers = [c for c in consumers if c.get("loop") != "trio"]
        # A wakeup per sample holds the producer near 110 k/s: fewer samples for those.
        slow = dict(producer, count=150_000 if quick else 300_000)
        out += [Scenario(group, c, slow if per_sample(c) else producer) for c in consumers]

    # 2. Paced at 2.5 M/s: the rate issues 3 and 5 name, below the producer's peak.
    producer = {"kind": "paced", "rate": 2_500_000, "seconds": 1.0 if quick else 2.0,
                "size": 32, "period": 0.001}
    consumers = [aperf("aiter"), aperf("aiter", loop="uvloop"), aperf("aiter", loop="trio"),
                 aperf("aiter", "btf"), aperf("aiter", "btf", loop="uvloop"),
                 aperf("aiter", "btf", loop="trio"), aperf("batches", "btf"),
                 aperf("batches", "btf", max_items=256), LIBBPF_MATCHED]
    out += [Scenario("paced2.5M", c, producer) for c in consumers]

    # 3. Paced at 1 k/s and 100 k/s: latency (issue 6), every sample timed.
    for group, rate, seconds in (("paced1k", 1_000, 2.0 if quick else 5.0),
                                 ("paced100k", 100_000, 1.0 if quick else 3.0)):
        producer = {"kind": "paced", "rate": rate, "seconds": seconds, "size": 32,
                    "period": 0.001}
        consumers = [
            aperf("aiter"),
            aperf("aiter", loop="uvloop"),
            aperf("aiter", loop="trio"),
            aperf("aiter", "btf"),
            aperf("callback"),
            aperf("sync"),
            aperf("aiter", wakeup="lowest-latency"),
            aperf("aiter", wakeup="lowest-latency", loop="uvloop"),
            aperf("aiter", wakeup="lowest-latency", loop="trio"),
            aperf("aiter", wakeup="throughput"),
            LIBBPF_PER_SAMPLE,
            LIBBPF_MATCHED,
        ]
        if quick:
            consumers = [aperf("aiter"), aperf("aiter", loop="uvloop"),
                         aperf("aiter", loop="trio"), aperf("aiter", "btf"),
                         aperf("aiter", wakeup="lowest-latency"), LIBBPF_PER_SAMPLE,
                         LIBBPF_MATCHED]
        if group == "paced1k":
            consumers += [aperf("aiter", "btf", order_by="ts"),
                          pure(aperf("aiter", wakeup="lowest-latency"))]
            uvloop_low = aperf("aiter", wakeup="lowest-latency", loop="uvloop")
            consumers += [] if uvloop_low in consumers else [uvloop_low]
        else:
            consumers += [pure(aperf("aiter")), pure(aperf("aiter", loop="uvloop"))]
        out += [Scenario(group, c, producer, extra={"lat_every": 1}) for c in consumers]

    # 3a. Issue 21: 1 k/s alternating between both CPUs' rings, every ring busy: the
    # latency an ordered stream adds (it holds a sample until the other ring has passed it).
    both = {"kind": "paced", "rate": 1_000, "seconds": 2.0 if quick else 5.0, "size": 32,
            "period": 0.001, "cpus": "both"}
    out += [Scenario("paced1k-2cpu", c, both, extra={"lat_every": 1})
            for c in (aperf("aiter", "btf"), aperf("aiter", "btf", order_by="ts"))]

    # 3b. The same producer into its BPF ring buffer (issue 12): flat out and paced, aperf's
    # consumers on asyncio and trio against libbpf's ring_buffer__poll. One ring for both CPUs.
    ringbuf = [aperf("aiter"), aperf("aiter", loop="trio"), aperf("batches"),
               aperf("batches", loop="trio"), aperf("callback"), aperf("sync"),
               aperf("aiter", wakeup="lowest-latency"), LIBBPF_RINGBUF]
    if quick:
        ringbuf = [aperf("aiter"), aperf("aiter", loop="trio"), aperf("batches"),
                   aperf("aiter", wakeup="lowest-latency"), LIBBPF_RINGBUF]
    rb = {"ring": "ringbuf", "ringbuf_bytes": RINGBUF_BYTES}
    out += [Scenario("ringbuf32", c, {"kind": "burst", "count": 2_000_000 if quick else 8_000_000,
                                      "size": 32, **rb}) for c in ringbuf]
    out += [Scenario("ringbuf-paced100k", c,
                     {"kind": "paced", "rate": 100_000, "seconds": 1.0 if quick else 3.0,
                      "size": 32, "period": 0.001, **rb}, extra={"lat_every": 1})
            for c in ringbuf]

    # 3c. Issue 23: records spaced 10 us apart by the BPF program (bpf/paced.bpf.c), each
    # with the kernel's default ring buffer wakeup (flags 0): a reader that catches up is
    # woken by the next record, up to 100 k wakeups a second. libbpf C reads at each one.
    spaced = [aperf("aiter"), aperf("aiter", loop="uvloop"), aperf("aiter", loop="trio"),
              aperf("batches"), aperf("sync"), aperf("aiter", wakeup="lowest-latency"),
              LIBBPF_RINGBUF]
    out += [Scenario("ringbuf-spaced100k", c,
                     {"kind": "spaced", "rate": 100_000, "seconds": 1.0 if quick else 3.0,
                      "size": 16, "ring": "ringbuf"}, extra={"lat_every": 1})
            for c in spaced]

    # 4. A real workload: getpid() traced by a tracepoint program (issue 6: its slowdown).
    seconds = 1.0 if quick else 2.0
    py_consumers = [
        {"impl": "noprog"},
        {"impl": "none"},
        aperf("aiter"),
        aperf("aiter", "btf"),
        aperf("aiter", wakeup="lowest-latency"),
        LIBBPF_PER_SAMPLE,
        LIBBPF_MATCHED,
        bcc("attach-only"),
        bcc("count", 1),
        bcc("event", 1),
        bcc("event", 64),
    ]
    c_consumers = [
        {"impl": "noprog"},
        {"impl": "none"},
        aperf("aiter"),
        aperf("aiter", "btf"),
        aperf("aiter", "btf", loop="uvloop"),
        aperf("batches", "btf"),
        aperf("sync", "btf"),
        aperf("aiter", wakeup="lowest-latency"),
        LIBBPF_MATCHED,
        LIBBPF_PER_SAMPLE,
        bcc("attach-only"),
        bcc("count", 64),
        bcc("event", 64),
        bcc("count", 1),
        bcc("event", 1),
        *COLUMNAR,
        *CTYPES_DECODED,
        aperf("arrays", "ctypes"),
        *LEASES,
        *(pure(c) for c in [*NATIVE_TARGETS, aperf("aiter", "btf"), aperf("batches", "btf")]),
    ]
    if quick:
        py_consumers = [c for c in py_consumers if c not in (bcc("count", 1),)]
        c_consumers = [c for c in c_consumers
                       if c not in (aperf("aiter", "btf", loop="uvloop"), aperf("sync", "btf"),
                                    bcc("count", 1))]
    out += [Scenario("getpid-py", c, {"kind": "getpid", "driver": "python", "seconds": seconds})
            for c in py_consumers]
    out += [Scenario("getpid-c", c, {"kind": "getpid", "driver": "c", "seconds": seconds})
            for c in c_consumers]

    # 5. Idle: what an open stream costs when nothing happens (the drain timer's price).
    # The default timer stretches its period to idle_latency after 1 s with nothing found;
    # "strict" keeps the 1 ms period (Wakeup.balanced(idle_latency=0.001)).
    producer = {"kind": "idle", "seconds": 3.0 if quick else 10.0}
    consumers = [aperf("aiter"), aperf("aiter", loop="uvloop"), aperf("aiter", loop="trio"),
                 aperf("aiter", wakeup="lowest-latency"),
                 aperf("aiter", wakeup="lowest-latency", loop="trio"),
                 aperf("aiter", wakeup="strict"),
                 aperf("aiter", wakeup="throughput"), LIBBPF_MATCHED, LIBBPF_PER_SAMPLE]
    if quick:
        consumers = [aperf("aiter"), aperf("aiter", loop="trio"),
                     aperf("aiter", wakeup="lowest-latency"),
                     aperf("aiter", wakeup="strict"), LIBBPF_MATCHED]
    consumers += [pure(aperf("aiter")), pure(aperf("aiter", wakeup="strict"))]
    out += [Scenario("idle", c, producer) for c in consumers]

    # 5a. Issue 31 §4: what an open stream costs as its rings grow in number, idle with the
    # 1 ms timer running, and with one ring busy at 100 k/s, against libbpf C's.
    for n in RING_COUNTS:
        idle = {"kind": "idle", "seconds": 2.0 if quick else 5.0, "channels": n}
        busy = {"kind": "paced", "rate": 100_000, "seconds": 1.0 if quick else 3.0,
                "size": 32, "period": 0.001, "channels": n, "map_key": 1}
        out += [Scenario(f"rings{n}-idle", c, idle) for c in channel_consumers(n)]
        out += [Scenario(f"rings{n}-busy100k", c, busy) for c in channel_consumers(n)]

    # 6. Memory: a consumer slower than the producer for a long time; RSS must stay flat.
    out.append(Scenario(
        "memory",
        aperf("slow"),
        {"kind": "paced", "rate": 1_000_000, "seconds": 20.0 if quick else 300.0, "size": 32,
         "period": 0.001},
        extra={"lat_every": 1024},
    ))
    return out
