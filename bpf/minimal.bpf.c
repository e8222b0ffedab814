// SPDX-License-Identifier: GPL-2.0
/* The smallest useful aperf program: one sample per exec, read in Python with
 *     aperf.PerfStream(obj.maps["events"], decoder="exec_event")
 * docs/own-program.md walks through it. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

/* One sample: what user space decodes, by this name, from the object's BTF. */
struct exec_event {
	int pid;
	char comm[16];
};

/* Clang writes a type into the object's BTF only when a global or a function's
 * signature uses it, not a stack variable: this unused global takes it there. */
struct exec_event *unused_exec_event __attribute__((unused));

/* The perf event array: one ring per CPU, which aperf creates and reads. */
struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(int));
	__uint(value_size, sizeof(int));
} events SEC(".maps");

SEC("tp/sched/sched_process_exec")
int on_exec(void *ctx)
{
	struct exec_event e = {};

	e.pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(&e.comm, sizeof(e.comm));
	bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, &e, sizeof(e));
	return 0;
}
