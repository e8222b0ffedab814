"""libc's pieces: its functions declared on first use, a timer on an fd, and a perf
ring mapped a second time. No library is loaded at import time."""
