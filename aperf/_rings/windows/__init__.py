"""eBPF for Windows' sources, over ``_native/ebpfapi``: ``perf`` (perf event arrays)
and ``ringbuf`` (ring buffers, which share the perf source's base)."""
