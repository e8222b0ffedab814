"""eBPF for Windows on Linux: aperf's Windows code against a stand-in for ebpfapi.dll
(fake_ebpfapi.c, built by conftest.py with gcc; marked ``standin``)."""
