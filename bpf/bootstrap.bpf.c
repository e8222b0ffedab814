// SPDX-License-Identifier: GPL-2.0
/* Process exec/exit tracer reporting through a BPF ring buffer: the twin of
 * bootstrap_legacy.bpf.c, as libbpf-bootstrap's "bootstrap" is the twin of its
 * "bootstrap_legacy". Same programs, same struct event (bootstrap.h), same
 * globals (bootstrap_common.h); the events go to one ring buffer shared by
 * every CPU, reserved in place with bpf_ringbuf_reserve() and committed with
 * bpf_ringbuf_submit().
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
#include "bootstrap_common.h"

char LICENSE[] SEC("license") = "GPL";

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

/* A real (non-inlined) subprogram returning "struct event *": its signature puts
 * struct event into the object's BTF, which user space decodes samples with. */
static __noinline struct event *reserve_event(void)
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

SEC("tp/sched/sched_process_exec")
int handle_exec(struct trace_event_raw_sched_process_exec *ctx)
{
	struct event *e;
	unsigned fname_off;

	if (!exec_to_report())
		return 0;

	e = reserve_event();
	if (!e)
		return 0;
	/* reserved memory is not zeroed: write every field */
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
	u64 duration_ns;

	if (!exit_to_report(&duration_ns))
		return 0;

	e = reserve_event();
	if (!e)
		return 0;
	task = (struct task_struct *)bpf_get_current_task();
	fill_common(e, task, true);
	e->duration_ns = duration_ns;
	e->exit_code = (BPF_CORE_READ(task, exit_code) >> 8) & 0xff;
	e->filename[0] = 0;

	bpf_ringbuf_submit(e, 0);
	return 0;
}
