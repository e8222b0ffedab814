// SPDX-License-Identifier: GPL-2.0
/* Process exec/exit tracer reporting through a perf event array
 * (the "legacy" variant of the classic bootstrap example; bootstrap.bpf.c is
 * its ring buffer twin).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "bootstrap.h"
#include "bootstrap_common.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(u32));
	__uint(value_size, sizeof(u32));
} perf_buffer SEC(".maps");

/* A real (non-inlined) subprogram taking "struct event *": its signature puts
 * struct event into the object's BTF, which user space uses to decode samples
 * (clang emits no BTF for the types of plain stack variables). */
static __noinline int submit_event(void *ctx, struct event *e)
{
	return bpf_perf_event_output(ctx, &perf_buffer, BPF_F_CURRENT_CPU, e, sizeof(*e));
}

/* handle_exec and handle_exit, which send each event with submit_event() */
#include "bootstrap_programs.h"
