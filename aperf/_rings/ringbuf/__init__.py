"""BPF ring buffers: ``format`` (the ring buffer protocol), ``source`` (the kernel's
ring buffer) and ``user_format`` (the producer's side of a user ring buffer)."""
