// SPDX-License-Identifier: GPL-2.0
/* A paced ring buffer producer for the consumer-position fence test.
 *
 * Not attached anywhere: user space runs "paced" with bpf_prog_test_run_opts()
 * on its own CPU (so that the ring buffer's wakeups, irq_work on this CPU, run
 * as they would for a real producer). One run writes config.count records of
 * 16 bytes (u64 sequence number, u64 bpf_ktime_get_ns()) into "ringbuf", one
 * every config.gap_ns nanoseconds (spinning in between), each with the default
 * wakeup rule: the reader is woken when the record sits at its consumer position.
 *
 * counters: [0] += records written, [1] += records that found no room.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

struct paced_config {
	__u64 count;
	__u64 gap_ns;
	__u64 first_seq;
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} ringbuf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct paced_config);
} pace SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

struct pacing {
	struct paced_config *cfg;
	__u64 until;
};

static void add(__u32 key)
{
	__u64 *slot = bpf_map_lookup_elem(&counters, &key);

	if (slot)
		__sync_fetch_and_add(slot, 1);
}

static long spin(__u64 index, struct pacing *s)
{
	return bpf_ktime_get_ns() >= s->until; /* 1 stops the loop */
}

static long one(__u64 index, struct pacing *s)
{
	__u64 record[2];

	record[0] = s->cfg->first_seq + index;
	record[1] = bpf_ktime_get_ns();
	if (bpf_ringbuf_output(&ringbuf, record, sizeof(record), 0))
		add(1);
	else
		add(0);
	s->until = record[1] + s->cfg->gap_ns;
	bpf_loop(1 << 20, spin, s, 0);
	return 0;
}

SEC("raw_tp")
int paced(void *ctx)
{
	__u32 zero = 0;
	struct pacing s = {};

	s.cfg = bpf_map_lookup_elem(&pace, &zero);
	if (!s.cfg || s.cfg->count > (1 << 20))
		return 1;
	bpf_loop(s.cfg->count, one, &s, 0);
	return 0;
}
