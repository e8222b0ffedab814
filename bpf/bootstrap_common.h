/* SPDX-License-Identifier: GPL-2.0 */
/* What the exec/exit tracer's two BPF twins share: bootstrap_legacy.bpf.c (perf
 * event array) and bootstrap.bpf.c (BPF ring buffer) differ only in where the
 * events go. Include after vmlinux.h, the libbpf headers and bootstrap.h.
 */
#ifndef APERF_BOOTSTRAP_COMMON_H
#define APERF_BOOTSTRAP_COMMON_H

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8192);
	__type(key, pid_t);
	__type(value, u64);
} exec_start SEC(".maps");

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

/* An exec: remember when it happened; whether to report it. */
static __always_inline bool exec_to_report(void)
{
	pid_t pid = bpf_get_current_pid_tgid() >> 32;
	u64 ts = bpf_ktime_get_ns();

	bpf_map_update_elem(&exec_start, &pid, &ts, BPF_ANY);
	return !min_duration_ns;
}

/* An exit: whether to report it (whole processes only, long enough), and how
 * long the process ran since its exec (0 if its exec was not seen). */
static __always_inline bool exit_to_report(u64 *duration_ns)
{
	u64 id = bpf_get_current_pid_tgid(), *start_ts;
	pid_t pid = id >> 32, tid = (u32)id;

	*duration_ns = 0;
	if (pid != tid)
		return false;
	start_ts = bpf_map_lookup_elem(&exec_start, &pid);
	if (start_ts)
		*duration_ns = bpf_ktime_get_ns() - *start_ts;
	else if (min_duration_ns)
		return false;
	bpf_map_delete_elem(&exec_start, &pid);
	return !(min_duration_ns && *duration_ns < min_duration_ns);
}

/* What every event carries. */
static __always_inline void fill_common(struct event *e, struct task_struct *task,
					bool exit_event)
{
	e->exit_event = exit_event;
	e->timestamp_ns = bpf_ktime_get_boot_ns();
	e->pid = bpf_get_current_pid_tgid() >> 32;
	e->ppid = BPF_CORE_READ(task, real_parent, tgid);
	bpf_get_current_comm(&e->comm, sizeof(e->comm));
}

#endif /* APERF_BOOTSTRAP_COMMON_H */
