// SPDX-License-Identifier: GPL-2.0
/* Process exec/exit tracer reporting through a BPF ring buffer: the twin of
 * bootstrap_legacy.bpf.c, as libbpf-bootstrap's "bootstrap" is the twin of its
 * "bootstrap_legacy". Same programs, same struct event (bootstrap.h), same
 * globals; the events go to one ring buffer shared by every CPU, reserved in
 * place with bpf_ringbuf_reserve() and committed with bpf_ringbuf_submit().
 *
 * The kernel keeps no count of ring buffer drops (a reservation that finds no
 * room just fails), so the programs count them in "dropped", which the reader
 * turns into Lost events.
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

/* 256 KiB, as libbpf-bootstrap's; user space may resize it before load. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} rb SEC(".maps");

/* dropped[0]: events that found no room in the ring buffer. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, u64);
} dropped SEC(".maps");

/* As in bootstrap_legacy.bpf.c. */
const volatile unsigned long long min_duration_ns = 0;
const volatile u32 event_comm_offset = __builtin_offsetof(struct event, comm);
const volatile u32 event_comm_size = sizeof(((struct event *)0)->comm);
const volatile u32 event_filename_offset = __builtin_offsetof(struct event, filename);
const volatile u32 event_filename_size = sizeof(((struct event *)0)->filename);

static struct event *reserve_event(void)
{
	struct event *e = bpf_ringbuf_reserve(&rb, sizeof(*e), 0);
	u32 zero = 0;
	u64 *count;

	if (!e) {
		count = bpf_map_lookup_elem(&dropped, &zero);
		if (count)
			__sync_fetch_and_add(count, 1);
	}
	return e;
}

/* A real (non-inlined) subprogram taking "struct event *": its signature puts
 * struct event into the object's BTF, which user space decodes samples with.
 * It fills what both events share, in the reserved record itself. */
static __noinline void fill_common(struct event *e, struct task_struct *task, bool exit_event)
{
	e->exit_event = exit_event;
	e->timestamp_ns = bpf_ktime_get_boot_ns();
	e->pid = bpf_get_current_pid_tgid() >> 32;
	e->ppid = BPF_CORE_READ(task, real_parent, tgid);
	bpf_get_current_comm(&e->comm, sizeof(e->comm));
}

SEC("tp/sched/sched_process_exec")
int handle_exec(struct trace_event_raw_sched_process_exec *ctx)
{
	struct event *e;
	unsigned fname_off;
	pid_t pid;
	u64 ts;

	pid = bpf_get_current_pid_tgid() >> 32;
	ts = bpf_ktime_get_ns();
	bpf_map_update_elem(&exec_start, &pid, &ts, BPF_ANY);

	if (min_duration_ns)
		return 0;

	e = reserve_event();
	if (!e)
		return 0;
	/* reserved memory is not zeroed: clear what fill_common does not write */
	e->exit_code = 0;
	e->duration_ns = 0;
	fill_common(e, (struct task_struct *)bpf_get_current_task(), false);
	fname_off = ctx->__data_loc_filename & 0xFFFF;
	if (bpf_probe_read_str(&e->filename, sizeof(e->filename), (void *)ctx + fname_off) < 0)
		e->filename[0] = 0;

	bpf_ringbuf_submit(e, 0);
	return 0;
}

SEC("tp/sched/sched_process_exit")
int handle_exit(struct trace_event_raw_sched_process_template *ctx)
{
	struct task_struct *task;
	struct event *e;
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

	e = reserve_event();
	if (!e)
		return 0;
	task = (struct task_struct *)bpf_get_current_task();
	e->duration_ns = duration_ns;
	e->exit_code = (BPF_CORE_READ(task, exit_code) >> 8) & 0xff;
	e->filename[0] = 0;
	fill_common(e, task, true);

	bpf_ringbuf_submit(e, 0);
	return 0;
}
