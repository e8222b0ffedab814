/* SPDX-License-Identifier: GPL-2.0 */
/* The exec/exit tracer's two programs, for the objects that send each event from the
 * stack: bootstrap_legacy.bpf.c (a perf event array) and tracer.bpf.c (a buffer of
 * <aperf/buffer.bpf.h>, either ring). Include after bootstrap_common.h and a definition
 * of "static int submit_event(void *ctx, struct event *e)", which sends the event.
 */
#ifndef APERF_BOOTSTRAP_PROGRAMS_H
#define APERF_BOOTSTRAP_PROGRAMS_H

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

#endif /* APERF_BOOTSTRAP_PROGRAMS_H */
