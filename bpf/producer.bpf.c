// SPDX-License-Identifier: GPL-2.0
/* Deterministic sample producer for tests and benchmarks.
 *
 * Not attached anywhere: user space runs "produce" with
 * bpf_prog_test_run_opts(.flags = BPF_F_TEST_RUN_ON_CPU, .cpu = N), after
 * writing config[N]. One run emits config[N].count samples of config[N].size
 * bytes on CPU N: into the perf event array "samples" (target 0), or into the
 * BPF ring buffer "ringbuf" (target 1) with bpf_ringbuf_output(..., rb_flags).
 * The config is keyed by CPU so that runs on different CPUs can be set up and
 * run at the same time.
 *
 * Perf event array only: perf_flags is the flags argument of
 * bpf_perf_event_output(): 0 stands for BPF_F_CURRENT_CPU (the slot keyed by
 * the running CPU's id), else the low 32 bits give the slot (BPF_F_INDEX_MASK)
 * plus one, so that 1 is slot 0.
 *
 * Ring buffer only: with discard_every = N > 0, every sample whose sequence
 * number is a multiple of N is reserved (8 bytes) and discarded instead of
 * written, so that readers meet records with the DISCARD bit.
 *
 * Sample layout (little endian):
 *   size >= 8 : bytes 0..7   = u64 sequence number (first_seq + i), i = 0..count-1
 *   size >= 16: bytes 8..15  = u64 bpf_ktime_get_ns() at emission
 *   size <  8 : bytes 0..size-1 = the low `size` bytes of the sequence number
 *   every other byte is zero (bytes 8..15 when size < 16, bytes 16..size-1).
 *
 * Return value of a run: 0 ok, 1 bad config (size not in 1..4096, or an
 * unknown target; nothing is counted), 2 count > 1<<23 (bpf_loop's limit; rejected, not clamped, nothing
 * is counted -- split large counts into several runs).
 *
 * counters: [0] += successful outputs, [1] += failed outputs (helper < 0, or
 *           no room to reserve), [2]  = tag, [3] += 1 per accepted run,
 *           [4] += discarded records. ok + failed + discarded == samples asked for.
 *           [5] += the failed perf outputs that found no ring in the map slot
 *           (-ENOENT: no reader, paused, or closed); the others found it full.
 *
 * failures: where outputs failed, per CPU (a per-CPU array of one struct
 *           failure_log): each run of consecutive failed sequence numbers as
 *           (first, count), in the order they failed (a failure right after the
 *           last run's end extends it, across program runs too); n counts every
 *           run, also those past the FAIL_RUNS recorded.
 */
/* vmlinux.h has "typedef struct config_s config;", which would clash with
 * the map named "config" that user space looks up: rename it away. */
#define config config___vmlinux
#include "vmlinux.h"
#undef config
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

#define MAX_SAMPLE_SIZE 4096
#define MAX_LOOPS (1ULL << 23)
#define MAX_CPUS 1024

enum {
	CNT_OK = 0,
	CNT_FAILED = 1,
	CNT_TAG = 2,
	CNT_RUNS = 3,
	CNT_DISCARDED = 4,
	CNT_NO_RING = 5,
	CNT_MAX,
};

enum {
	TARGET_PERF = 0,
	TARGET_RINGBUF = 1,
};

struct producer_config {
	__u64 count;
	__u64 size;
	__u64 first_seq;
	__u64 target;
	__u64 rb_flags;
	__u64 discard_every;
	__u64 perf_flags;
};

/* A per-CPU map value is at most 32 KiB: 16 + 2047 * 16 bytes. */
#define FAIL_RUNS 2047

struct fail_run {
	__u64 first;
	__u64 count;
};

struct failure_log {
	__u64 n;
	__u64 reserved;
	struct fail_run runs[FAIL_RUNS];
};

struct sample_buf {
	__u8 data[MAX_SAMPLE_SIZE];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(u32));
	__uint(value_size, sizeof(u32));
} samples SEC(".maps");

/* 1 MiB unless user space sets max_entries before load. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} ringbuf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_CPUS);
	__type(key, __u32);
	__type(value, struct producer_config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sample_buf);
} scratch SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct failure_log);
} failures SEC(".maps");

/* Set from user space before load; copied to counters[2] by every run. */
const volatile __u64 tag = 0;

struct loop_ctx {
	void *ctx;
	__u64 size;
	__u64 first_seq;
	__u64 target;
	__u64 rb_flags;
	__u64 discard_every;
	__u64 perf_flags;
	__u64 ok;
	__u64 failed;
	__u64 discarded;
	__u64 no_ring;
};

/* Log a failed output: it extends the last run if it follows it, else starts one.
 * The log lives in the map, not on the stack: the verifier then need not follow a
 * count through every iteration of the loop (it would never converge). This CPU's
 * log has no other writer. */
static void failed_at(struct loop_ctx *lc, __u64 seq)
{
	struct failure_log *log;
	__u32 zero = 0;
	__u64 n, last;

	lc->failed++;
	log = bpf_map_lookup_elem(&failures, &zero);
	if (!log)
		return;
	n = log->n;
	if (n > 0 && n <= FAIL_RUNS) {
		last = n - 1;
		if (log->runs[last].first + log->runs[last].count == seq) {
			log->runs[last].count++;
			return;
		}
	}
	if (n < FAIL_RUNS) {
		log->runs[n].first = seq;
		log->runs[n].count = 1;
	}
	log->n = n + 1;
}

static long discard_one(struct loop_ctx *lc, __u64 seq)
{
	__u64 *rec = bpf_ringbuf_reserve(&ringbuf, sizeof(*rec), 0);

	if (!rec)
		return -1;
	*rec = seq;
	bpf_ringbuf_discard(rec, lc->rb_flags);
	lc->discarded++;
	return 0;
}

static long emit_one(__u64 i, void *data)
{
	struct loop_ctx *lc = data;
	struct sample_buf *buf;
	__u32 zero = 0;
	__u64 size = lc->size;
	__u64 seq = lc->first_seq + i;
	long ret;
	int j;

	/* re-checked here so the verifier sees a bounded size */
	if (size == 0 || size > MAX_SAMPLE_SIZE)
		return 1;

	buf = bpf_map_lookup_elem(&scratch, &zero);
	if (!buf)
		return 1;

	if (size >= 8) {
		*(__u64 *)&buf->data[0] = seq;
	} else {
		for (j = 0; j < 7; j++) {
			if (j >= size)
				break;
			buf->data[j] = seq >> (8 * j);
		}
	}
	/* when no timestamp fits, clear its slot so bytes 8..size-1 are zero
	 * rather than left over from an earlier run with a larger size */
	if (size >= 16)
		*(__u64 *)&buf->data[8] = bpf_ktime_get_ns();
	else
		*(__u64 *)&buf->data[8] = 0;

	if (lc->target == TARGET_RINGBUF) {
		if (lc->discard_every && seq % lc->discard_every == 0) {
			if (discard_one(lc, seq) < 0)
				failed_at(lc, seq);
			return 0;
		}
		ret = bpf_ringbuf_output(&ringbuf, buf, size, lc->rb_flags);
	} else {
		ret = bpf_perf_event_output(lc->ctx, &samples, lc->perf_flags, buf, size);
		if (ret == -2) /* -ENOENT: vmlinux.h has no errno values */
			lc->no_ring++;
	}
	if (ret < 0)
		failed_at(lc, seq);
	else
		lc->ok++;
	return 0;
}

static __always_inline void counter_add(__u32 key, __u64 val)
{
	__u64 *p = bpf_map_lookup_elem(&counters, &key);

	if (p)
		__sync_fetch_and_add(p, val);
}

SEC("raw_tp")
int produce(void *ctx)
{
	struct producer_config *cfg;
	struct loop_ctx lc = {};
	__u32 cpu = bpf_get_smp_processor_id(), key;
	__u64 *p;

	cfg = bpf_map_lookup_elem(&config, &cpu);
	if (!cfg)
		return 1;
	if (cfg->size < 1 || cfg->size > MAX_SAMPLE_SIZE)
		return 1;
	if (cfg->count > MAX_LOOPS)
		return 2;
	if (cfg->target > TARGET_RINGBUF)
		return 1;

	lc.ctx = ctx;
	lc.size = cfg->size;
	lc.first_seq = cfg->first_seq;
	lc.target = cfg->target;
	lc.rb_flags = cfg->rb_flags;
	lc.discard_every = cfg->discard_every;
	lc.perf_flags = cfg->perf_flags ? (cfg->perf_flags - 1) & BPF_F_INDEX_MASK : BPF_F_CURRENT_CPU;
	bpf_loop(cfg->count, emit_one, &lc, 0);

	counter_add(CNT_OK, lc.ok);
	counter_add(CNT_FAILED, lc.failed);
	counter_add(CNT_DISCARDED, lc.discarded);
	counter_add(CNT_NO_RING, lc.no_ring);
	key = CNT_TAG;
	p = bpf_map_lookup_elem(&counters, &key);
	if (p)
		*p = tag;
	counter_add(CNT_RUNS, 1);
	return 0;
}
