// SPDX-License-Identifier: GPL-2.0
/* Real-workload producer of aperf's benchmark (bench/run.py).
 *
 * On every getpid() of the process whose tgid is target_tgid (set before
 * load), emits one struct bench_sample32 into the perf event array "events"
 * on the current CPU, and counts successes and failures per CPU. With no ring
 * in the CPU's slot (no consumer), bpf_perf_event_output() fails at once:
 * that is the benchmark's "no consumer" baseline.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "bench.h"

char LICENSE[] SEC("license") = "GPL";

const volatile __u32 target_tgid = 0;

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(u32));
	__uint(value_size, sizeof(u32));
} events SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_counters);
} counters SEC(".maps");

/* Never used by the program: its value type puts both sample structs into the
 * object's BTF, for the consumers' decoders (a local variable's type would not
 * be recorded there). */
struct bench_layouts {
	struct bench_sample32 s32;
	struct bench_sample256 s256;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bench_layouts);
} layouts SEC(".maps");

SEC("tp/syscalls/sys_enter_getpid")
int on_getpid(void *ctx)
{
	struct bench_sample32 sample;
	struct bench_counters *c;
	__u64 id = bpf_get_current_pid_tgid();
	__u32 zero = 0;

	if ((__u32)(id >> 32) != target_tgid)
		return 0;
	c = bpf_map_lookup_elem(&counters, &zero);
	if (!c)
		return 0;
	bench_fill(&sample, c, id);
	bench_count(c, bpf_perf_event_output(ctx, &events, BPF_F_CURRENT_CPU, &sample,
					     sizeof(sample)));
	return 0;
}
