// SPDX-License-Identifier: GPL-2.0
/* aperf-trace's process exec/exit tracer: the programs of bootstrap_legacy.bpf.c
 * (same struct event, same globals), with one difference: the events go to a buffer
 * of <aperf/buffer.bpf.h>, which the loader makes a perf event array (the C
 * original's, the tracer's default) or a BPF ring buffer (--buffer ringbuf, or
 * --buffer auto where the kernel has one) before load. One object for either ring.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include <aperf/buffer.bpf.h>
#include "bootstrap.h"
#include "bootstrap_common.h"

char LICENSE[] SEC("license") = "GPL";

/* 256 KiB as a ring buffer, as libbpf-bootstrap's "bootstrap"; user space resizes it
 * before load (--pages). As a perf event array: a ring per CPU, sized when read. */
APERF_BUFFER(events, 256 * 1024);

/* A real (non-inlined) subprogram taking "struct event *": its signature puts
 * struct event into the object's BTF, which user space decodes samples with. */
static __noinline int submit_event(void *ctx, struct event *e)
{
	return aperf_buffer_output(events, ctx, e, sizeof(*e));
}

/* handle_exec and handle_exit, which send each event with submit_event() */
#include "bootstrap_programs.h"
