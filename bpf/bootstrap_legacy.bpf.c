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

SEC("tp/sched/sched_process_exec")
int handle_exec(struct trace_event_raw_sched_process_exec *ctx)
{
	struct event e;
	unsigned fname_off;

	if (!exec_to_report())
		return 0;

	__builtin_memset(&e, 0, sizeof(e));
	fill_common(&e, (struct task_struct *)bpf_get_current_task(), false);
	fname_off = ctx->__data_loc_filename & 0xFFFF;
	bpf_probe_read_str(&e.filename, sizeof(e.filename), (void *)ctx + fname_off);

	submit_event(ctx, &e);
	return 0;
}

SEC("tp/sched/sched_process_exit")
int handle_exit(struct trace_event_raw_sched_process_template *ctx)
{
	struct task_struct *task;
	struct event e;
	u64 duration_ns;

	if (!exit_to_report(&duration_ns))
		return 0;

	__builtin_memset(&e, 0, sizeof(e));
	task = (struct task_struct *)bpf_get_current_task();
	fill_common(&e, task, true);
	e.duration_ns = duration_ns;
	e.exit_code = (BPF_CORE_READ(task, exit_code) >> 8) & 0xff;

	submit_event(ctx, &e);
	return 0;
}
