// SPDX-License-Identifier: GPL-2.0
/* Process exec/exit tracer reporting through a perf event array
 * (the "legacy" variant of the classic bootstrap example).
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "bootstrap.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, pid_t);
	__type(value, u64);
} exec_start SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(u32));
	__uint(value_size, sizeof(u32));
} perf_buffer SEC(".maps");

/* Set before load; when non-zero, exec events are not reported and only
 * processes living at least this long are reported on exit. */
const volatile unsigned long long min_duration_ns = 0;

/* Where comm and filename lie in struct event, for readers that want those
 * bytes as they are: the kernel gives them no encoding, and aperf's BTF decoder
 * turns char arrays into text (bytes that are not UTF-8 replaced). The tracer
 * reads these with get_global() and shows the raw bytes escaped. */
const volatile u32 event_comm_offset = __builtin_offsetof(struct event, comm);
const volatile u32 event_comm_size = sizeof(((struct event *)0)->comm);
const volatile u32 event_filename_offset = __builtin_offsetof(struct event, filename);
const volatile u32 event_filename_size = sizeof(((struct event *)0)->filename);

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
	struct task_struct *task;
	struct event e;
	unsigned fname_off;
	pid_t pid;
	u64 ts;

	pid = bpf_get_current_pid_tgid() >> 32;
	ts = bpf_ktime_get_ns();
	bpf_map_update_elem(&exec_start, &pid, &ts, BPF_ANY);

	if (min_duration_ns)
		return 0;

	__builtin_memset(&e, 0, sizeof(e));
	task = (struct task_struct *)bpf_get_current_task();
	e.exit_event = false;
	e.timestamp_ns = bpf_ktime_get_boot_ns();
	e.pid = pid;
	e.ppid = BPF_CORE_READ(task, real_parent, tgid);
	bpf_get_current_comm(&e.comm, sizeof(e.comm));

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
	u64 id, *start_ts, duration_ns = 0;
	pid_t pid, tid;

	id = bpf_get_current_pid_tgid();
	pid = id >> 32;
	tid = (u32)id;

	/* only whole processes, not individual threads */
	if (pid != tid)
		return 0;

	start_ts = bpf_map_lookup_elem(&exec_start, &pid);
	if (start_ts)
		duration_ns = bpf_ktime_get_ns() - *start_ts;
	else if (min_duration_ns)
		return 0;
	bpf_map_delete_elem(&exec_start, &pid);

	if (min_duration_ns && duration_ns < min_duration_ns)
		return 0;

	__builtin_memset(&e, 0, sizeof(e));
	task = (struct task_struct *)bpf_get_current_task();
	e.exit_event = true;
	e.timestamp_ns = bpf_ktime_get_boot_ns();
	e.duration_ns = duration_ns;
	e.pid = pid;
	e.ppid = BPF_CORE_READ(task, real_parent, tgid);
	e.exit_code = (BPF_CORE_READ(task, exit_code) >> 8) & 0xff;
	bpf_get_current_comm(&e.comm, sizeof(e.comm));

	submit_event(ctx, &e);
	return 0;
}
