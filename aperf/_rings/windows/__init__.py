"""eBPF for Windows' sources, over ``_native/ebpfapi``: ``perf`` (perf event arrays)
and ``ringbuf`` (ring buffers), on one ``base``."""
