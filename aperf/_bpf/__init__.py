"""BPF objects and BTF: ``object`` (BPFObject, Map, Program, Link), ``btf`` (BTF, by
handle) and ``map_types`` (the kernel's map type names)."""
