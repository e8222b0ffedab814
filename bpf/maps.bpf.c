// SPDX-License-Identifier: GPL-2.0
/* Maps of several kinds and sizes, for tests of aperf.Map's size and flag checks. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

struct odd { __u32 a; __u8 b[8]; };	/* 12 bytes: per-CPU slots pad it to 16 */
struct locked { struct bpf_spin_lock lock; __u32 value; };

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16);
	__type(key, __u32);
	__type(value, struct odd);
} hash SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 16);
	__type(key, __u64);
	__type(value, struct odd);
} percpu SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_QUEUE);
	__uint(max_entries, 4);
	__type(value, __u64);
} queue SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, struct locked);
} locked SEC(".maps");

/* Does nothing: a task iterator attaches and detaches quickly (no RCU grace
 * period) and runs only when its link is read, for tests of aperf.Link. */
SEC("iter/task")
int noop(struct bpf_iter__task *ctx)
{
	return 0;
}
