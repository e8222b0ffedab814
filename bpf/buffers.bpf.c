// SPDX-License-Identifier: GPL-2.0
/* A deterministic producer for aperf's BPF header (<aperf/buffer.bpf.h>): one
 * buffer ("events") that the loader makes a BPF ring buffer or a perf event array,
 * and one BPF ring buffer per CPU ("rings").
 *
 * Not attached anywhere: user space writes config[N], then runs "produce" with
 * bpf_prog_test_run_opts(.flags = BPF_F_TEST_RUN_ON_CPU, .cpu = N). One run emits
 * config[N].count samples of config[N].size bytes on CPU N, through
 *   target 0: aperf_buffer_output() into "events",
 *   target 1: aperf_buffer_reserve() + aperf_buffer_submit() into "events"
 *             (every sample whose sequence number is a multiple of discard_every,
 *             if not 0, is reserved and discarded instead),
 *   target 2: aperf_ringbuf_output() into CPU N's ring of "rings",
 *   target 3: bpf_ringbuf_output() into the ring in slot N of "user_rings", which
 *             user space fills (failures counted in user_dropped[N]).
 * Samples are laid out as producer.bpf.c's: u64 sequence number (first_seq + i),
 * u64 bpf_ktime_get_ns(), then zeros; size is 16..MAX_SAMPLE_SIZE.
 *
 * produced_ok += outputs that succeeded, produced_failed += outputs that failed,
 * produced_discarded += discarded records, produced_runs += 1 per accepted run.
 * The header counts the failed ones too, in its own globals.
 * Returns 0, or 1 for a bad config (nothing counted).
 */
#define config config___vmlinux
#include "vmlinux.h"
#undef config
#include <bpf/bpf_helpers.h>
#include <aperf/buffer.bpf.h>

char LICENSE[] SEC("license") = "GPL";

#define MAX_SAMPLE_SIZE 512
#define MAX_CPUS 1024

APERF_BUFFER(events, 64 * 1024);
APERF_RINGBUF_PER_CPU(rings, 16 * 1024);

/* The same, written by hand as Falco's modern probe does: user space puts a ring
 * buffer of its own making in each slot, the program counts its drops per CPU. */
struct user_ring {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, MAX_CPUS);
	__type(key, __u32);
	__array(values, struct user_ring);
} user_rings SEC(".maps");

__u64 user_dropped[MAX_CPUS];

struct buffers_config {
	__u64 count;
	__u64 size;
	__u64 first_seq;
	__u64 target;
	__u64 discard_every;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CPUS);
	__type(key, __u32);
	__type(value, struct buffers_config);
} config SEC(".maps");

/* The program's own counts, read live by user space (BPFObject.read_global). */
__u64 produced_ok, produced_failed, produced_discarded, produced_runs;

struct buffers_sample {
	__u64 seq;
	__u64 ts;
	__u8 rest[MAX_SAMPLE_SIZE - 16];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct buffers_sample);
} scratch SEC(".maps");

struct loop_ctx {
	void *ctx;
	__u32 cpu;
	struct buffers_config cfg;
	__u64 ok;
	__u64 failed;
	__u64 discarded;
};

/* Reserved in place: the record has the sample's full size (a constant), its
 * first 16 bytes set, the rest zero; size is MAX_SAMPLE_SIZE or 16 for this target. */
static __always_inline void reserve_one(struct loop_ctx *lc, __u64 seq)
{
	struct buffers_sample *s = aperf_buffer_reserve(events, sizeof(struct buffers_sample));

	if (!s) {
		lc->failed++;
		return;
	}
	__builtin_memset(s, 0, sizeof(*s));
	s->seq = seq;
	s->ts = bpf_ktime_get_ns();
	if (lc->cfg.discard_every && seq % lc->cfg.discard_every == 0) {
		aperf_buffer_discard(events, s);
		lc->discarded++;
		return;
	}
	if (aperf_buffer_submit(events, lc->ctx, s, sizeof(*s)) < 0)
		lc->failed++;
	else
		lc->ok++;
}

static long emit_one(__u64 i, void *data)
{
	struct loop_ctx *lc = data;
	__u64 seq = lc->cfg.first_seq + i, size = lc->cfg.size;
	struct buffers_sample *s;
	__u32 zero = 0;
	void *ring;
	long ret;

	if (lc->cfg.target == 1) {
		reserve_one(lc, seq);
		return 0;
	}
	s = bpf_map_lookup_elem(&scratch, &zero);
	if (!s || size < 16 || size > MAX_SAMPLE_SIZE)
		return 1;
	s->seq = seq;
	s->ts = bpf_ktime_get_ns();
	if (lc->cfg.target == 2) {
		ret = aperf_ringbuf_output(rings, s, size);
	} else if (lc->cfg.target == 3) {
		ring = bpf_map_lookup_elem(&user_rings, &lc->cpu);
		ret = ring ? bpf_ringbuf_output(ring, s, size, 0) : -2;
		if (ret < 0 && lc->cpu < MAX_CPUS)
			__sync_fetch_and_add(&user_dropped[lc->cpu], 1);
	} else
		ret = aperf_buffer_output(events, lc->ctx, s, size);
	lc->ok += ret >= 0;
	lc->failed += ret < 0;
	return 0;
}

SEC("raw_tp")
int produce(void *ctx)
{
	__u32 cpu = bpf_get_smp_processor_id(), zero = 0;
	struct buffers_config *cfg = bpf_map_lookup_elem(&config, &cpu);
	struct loop_ctx lc = {};
	struct buffers_sample *s = bpf_map_lookup_elem(&scratch, &zero);

	if (!cfg || !s || cfg->target > 3 || cfg->count > (1 << 23))
		return 1;
	if (cfg->target == 1 ? cfg->size != sizeof(struct buffers_sample)
			     : cfg->size < 16 || cfg->size > MAX_SAMPLE_SIZE)
		return 1;
	__builtin_memset(s, 0, sizeof(*s));
	lc.ctx = ctx;
	lc.cpu = cpu;
	lc.cfg = *cfg;
	bpf_loop(cfg->count, emit_one, &lc, 0);
	__sync_fetch_and_add(&produced_ok, lc.ok);
	__sync_fetch_and_add(&produced_failed, lc.failed);
	__sync_fetch_and_add(&produced_discarded, lc.discarded);
	__sync_fetch_and_add(&produced_runs, 1);
	return 0;
}
