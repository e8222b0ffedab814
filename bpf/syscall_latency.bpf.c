// SPDX-License-Identifier: GPL-2.0
/* Times every syscall (of one process, or of all) and reports each one that
 * finishes as a struct syscall_event in the perf event array "events".
 *
 * raw_syscalls/sys_enter stores the entry time per thread; raw_syscalls/sys_exit
 * looks it up, and outputs the duration with the syscall number, its return
 * value and the thread's ids and name. Syscalls that entered before the
 * programs were attached have no entry time and are not reported.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "syscall_latency.h"

char LICENSE[] SEC("license") = "GPL";

const volatile __u32 target_tgid = 0;	/* 0: every process */

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(u32));
	__uint(value_size, sizeof(u32));
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);	/* tid */
	__type(value, __u64);	/* bpf_ktime_get_ns() at entry */
} entered SEC(".maps");

/* Never used by the programs: it puts struct syscall_event into the object's BTF. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct syscall_event);
} event_type SEC(".maps");

SEC("tracepoint/raw_syscalls/sys_enter")
int on_enter(struct trace_event_raw_sys_enter *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	__u64 now;

	if (target_tgid && (id >> 32) != target_tgid)
		return 0;
	now = bpf_ktime_get_ns();
	bpf_map_update_elem(&entered, &tid, &now, BPF_ANY);
	return 0;
}

SEC("tracepoint/raw_syscalls/sys_exit")
int on_exit(struct trace_event_raw_sys_exit *ctx)
{
	__u64 id = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)id;
	struct syscall_event e;
	__u64 *start;

	if (target_tgid && (id >> 32) != target_tgid)
		return 0;
	start = bpf_map_lookup_elem(&entered, &tid);
	if (!start)
		return 0;
	e.duration_ns = bpf_ktime_get_ns() - *start;
	bpf_map_delete_elem(&entered, &tid);
	e.ret = ctx->ret;
	e.pid = id >> 32;
	e.tid = tid;
	e.nr = (__u32)ctx->id;
	e.cpu = bpf_get_smp_processor_id();
	bpf_get_current_comm(e.comm, sizeof(e.comm));
	bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, &e, sizeof(e));
	return 0;
}
