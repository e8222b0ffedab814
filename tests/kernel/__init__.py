"""Tests of the features that read rings from the kernel: the kernel produces the samples
and the counts are exact. A test that loads BPF takes the ``kernel`` fixture (and is marked
``kernel``): it skips without BPF (root), and fails instead under APERF_REQUIRE_BPF=1."""
