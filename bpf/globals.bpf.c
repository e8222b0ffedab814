// SPDX-License-Identifier: GPL-2.0
/* Globals that a program keeps and user space reads and writes live
 * (BPFObject.read_global / write_global / globals), one of each kind.
 *
 * Not attached anywhere: user space runs "bump" with BPF_PROG_TEST_RUN. Each run
 * adds step (.data, user space may change it after load) to total (.bss), counts
 * itself in runs, copies step into last_step, and records limit (.rodata, fixed at
 * load) in seen_limit: so a test sees that the program reads what user space wrote.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

enum globals_mode { MODE_OFF = 0, MODE_ON = 1, MODE_LOUD = 7 };

struct globals_stats {
	__u32 calls;
	__s32 delta;
	__u64 sum;
};

/* .rodata: frozen when the object loads */
const volatile __u64 limit = 1000;
/* .data: initialised, writable */
__u64 step = 1;
char label[8] = "aperf";
enum globals_mode mode = MODE_ON;
bool enabled = true;
__s16 offset = -3;
/* .bss: zero at load */
__u64 total;
__u64 runs;
__u64 last_step;
__u64 seen_limit;
struct globals_stats stats;
__u32 per_cpu_calls[4];

SEC("raw_tp")
int bump(void *ctx)
{
	__u32 cpu = bpf_get_smp_processor_id();

	if (!enabled)
		return 1;
	__sync_fetch_and_add(&total, step);
	__sync_fetch_and_add(&runs, 1);
	last_step = step;
	seen_limit = limit;
	stats.calls++;
	stats.delta = offset;
	stats.sum += step;
	if (cpu < 4)
		per_cpu_calls[cpu]++;
	return 0;
}
