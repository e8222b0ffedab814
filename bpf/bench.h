/* SPDX-License-Identifier: GPL-2.0 */
/* Sample layouts and per-sample work of aperf's benchmark producers (bench/).
 *
 * The Python consumers decode the layouts from the BTF of bench_getpid.bpf.o
 * with aperf.decoders.from_btf(obj, "bench_sample32"), so nothing mirrors them
 * by hand. The deterministic producer (producer.bpf.c) writes the same first
 * two fields (seq, ts) and zeros after them, so its samples decode with these
 * too. The BCC peer (bench/peer_bcc.py) includes this header in its program
 * text, so both getpid programs build their samples with the same code.
 */
#ifndef APERF_BENCH_H
#define APERF_BENCH_H

struct bench_sample32 {
	u64 seq;	/* per-CPU sequence number */
	u64 ts;	/* bpf_ktime_get_ns() at emission */
	u64 pid_tgid;
	u64 cpu;
};

/* A larger event of the usual tracing-tool shape (ids, comm, a path). */
struct bench_sample256 {
	u64 seq;
	u64 ts;
	u32 pid;
	u32 tgid;
	char comm[16];
	char path[200];
	u64 a;
	u64 b;
};

/* Per-CPU counters of the getpid producer. */
struct bench_counters {
	u64 seq;	/* next sequence number */
	u64 ok;	/* bpf_perf_event_output() succeeded */
	u64 failed;	/* it failed: ring full, or no ring in the CPU's slot */
};

/* The next sample of this CPU, from the thread pid_tgid. */
static __always_inline void bench_fill(struct bench_sample32 *s, struct bench_counters *c,
				       u64 pid_tgid)
{
	s->seq = c->seq++;
	s->ts = bpf_ktime_get_ns();
	s->pid_tgid = pid_tgid;
	s->cpu = bpf_get_smp_processor_id();
}

/* Counts what bpf_perf_event_output() returned. */
static __always_inline void bench_count(struct bench_counters *c, long err)
{
	if (err < 0)
		c->failed++;
	else
		c->ok++;
}

#endif /* APERF_BENCH_H */
