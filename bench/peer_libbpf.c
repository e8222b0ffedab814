// SPDX-License-Identifier: Apache-2.0
/* The native peer of aperf's benchmark: a libbpf perf_buffer or ring_buffer consumer in C.
 *
 * Built and run by bench/run.py (gcc -O2 ... -lbpf); it is the ceiling the
 * Python consumers are measured against.
 *
 *   peer_libbpf MAP_PATH PAGES WAKEUP DRAIN_MS LAT_EVERY LAT_PATH
 *
 *   MAP_PATH   a perf event array or a BPF ring buffer pinned in bpffs (bpf_obj_get)
 *   PAGES      data pages per CPU ring (ignored for a ring buffer: its map has a size)
 *   WAKEUP     "default": perf_buffer__new, libbpf's wakeup per sample;
 *              "events:N" or "watermark:BYTES": perf_buffer__new_raw with that
 *              perf_event_attr, as aperf sets it;
 *              "ringbuf": ring_buffer__new + ring_buffer__poll on a BPF ring buffer
 *              (wakeups are the producer's: the kernel's default when the reader
 *              has caught up)
 *   DRAIN_MS   with batched wakeups, consume every ring at least this often, so
 *              that samples below the threshold do not wait for ever (0: never)
 *   LAT_EVERY  take the latency of every LAT_EVERY-th sample (ktime at byte 8)
 *   LAT_PATH   where to write those latencies (int64 ns, native endian)
 *   CHANNELS   optional, perf rings with batched wakeups only: open this many rings,
 *              ring k on CPU k % 2 in map slot k (aperf's cpus= and map_keys=): a host
 *              of many CPUs simulated on two (issue 31)
 *
 * Protocol: prints "ready" once the rings are open; on SIGUSR1 (the producer
 * has finished) consumes what the rings hold, prints one line
 * "result {json}" and exits.
 */
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include <linux/perf_event.h>
#include <bpf/bpf.h>
#include <bpf/libbpf.h>

struct consumer {
	uint64_t samples;
	uint64_t lost;
	uint64_t lat_every;
	uint64_t countdown;
	uint64_t t_last;	/* CLOCK_MONOTONIC ns of the last latency taken */
	int64_t *lat;
	size_t nlat, cap;
};

/* What perf_buffer__new_raw hands to the event callback. */
struct raw_sample {
	struct perf_event_header header;
	__u32 size;
	char data[];
};

struct raw_lost {
	struct perf_event_header header;
	__u64 id;
	__u64 lost;
};

static volatile sig_atomic_t finished;

static void on_usr1(int sig)
{
	(void)sig;
	finished = 1;
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static double seconds(struct timeval tv)
{
	return (double)tv.tv_sec + (double)tv.tv_usec / 1e6;
}

/* VmHWM: the peak RSS of this process image (ru_maxrss would carry over the
 * parent's peak across fork and exec). */
static long peak_rss_kb(void)
{
	char line[256];
	long kb = 0;
	FILE *f = fopen("/proc/self/status", "r");

	if (!f)
		return 0;
	while (fgets(line, sizeof(line), f))
		if (sscanf(line, "VmHWM: %ld", &kb) == 1)
			break;
	fclose(f);
	return kb;
}

static void got_sample(struct consumer *c, const void *data, __u32 size)
{
	uint64_t ts, now;

	c->samples++;
	if (--c->countdown)
		return;
	c->countdown = c->lat_every;
	if (size < 16)
		return;
	memcpy(&ts, (const char *)data + 8, sizeof(ts));
	now = now_ns();
	c->t_last = now;
	if (c->nlat == c->cap) {
		size_t cap = c->cap ? c->cap * 2 : 65536;
		int64_t *grown = realloc(c->lat, cap * sizeof(*grown));

		if (!grown)
			return;	/* out of memory: keep counting, stop recording */
		c->lat = grown;
		c->cap = cap;
	}
	c->lat[c->nlat++] = (int64_t)(now - ts);
}

static void on_sample(void *ctx, int cpu, void *data, __u32 size)
{
	(void)cpu;
	got_sample(ctx, data, size);
}

static void on_lost(void *ctx, int cpu, __u64 count)
{
	struct consumer *c = ctx;

	(void)cpu;
	c->lost += count;
}

static enum bpf_perf_event_ret on_raw_event(void *ctx, int cpu, struct perf_event_header *event)
{
	struct consumer *c = ctx;

	(void)cpu;
	if (event->type == PERF_RECORD_SAMPLE) {
		struct raw_sample *s = (struct raw_sample *)event;

		got_sample(c, s->data, s->size);
	} else if (event->type == PERF_RECORD_LOST) {
		c->lost += ((struct raw_lost *)event)->lost;
	}
	return LIBBPF_PERF_EVENT_CONT;
}

static int on_ringbuf_sample(void *ctx, void *data, size_t size)
{
	got_sample(ctx, data, (__u32)size);
	return 0;
}

/* libbpf's two consumers behind one poll/consume pair. */
struct rings {
	struct perf_buffer *pb;
	struct ring_buffer *rb;
};

static int rings_poll(struct rings *r, int timeout_ms)
{
	return r->rb ? ring_buffer__poll(r->rb, timeout_ms) : perf_buffer__poll(r->pb, timeout_ms);
}

static void rings_consume(struct rings *r)
{
	if (r->rb)
		ring_buffer__consume(r->rb);
	else
		perf_buffer__consume(r->pb);
}

static struct perf_buffer *open_rings(int map_fd, size_t pages, const char *wakeup,
				      int channels, struct consumer *c)
{
	LIBBPF_OPTS(perf_buffer_raw_opts, opts);
	struct perf_event_attr attr;
	struct perf_buffer *pb;
	unsigned long value;
	int *cpus = NULL, *keys = NULL;

	if (strcmp(wakeup, "default") == 0)
		return perf_buffer__new(map_fd, pages, on_sample, on_lost, c, NULL);

	memset(&attr, 0, sizeof(attr));
	attr.size = sizeof(attr);
	attr.type = PERF_TYPE_SOFTWARE;
	attr.config = PERF_COUNT_SW_BPF_OUTPUT;
	attr.sample_type = PERF_SAMPLE_RAW;
	attr.sample_period = 1;
	if (sscanf(wakeup, "events:%lu", &value) == 1) {
		attr.wakeup_events = (__u32)value;
	} else if (sscanf(wakeup, "watermark:%lu", &value) == 1) {
		attr.watermark = 1;
		attr.wakeup_watermark = (__u32)value;
	} else {
		fprintf(stderr, "peer_libbpf: unknown wakeup %s\n", wakeup);
		errno = EINVAL;
		return NULL;
	}
	if (channels > 0) {
		cpus = calloc(channels, sizeof(*cpus));
		keys = calloc(channels, sizeof(*keys));
		if (!cpus || !keys) {
			free(cpus);
			free(keys);
			errno = ENOMEM;
			return NULL;
		}
		for (int k = 0; k < channels; k++) {
			cpus[k] = k % 2;
			keys[k] = k;
		}
		opts.cpu_cnt = channels;
		opts.cpus = cpus;
		opts.map_keys = keys;
	}
	pb = perf_buffer__new_raw(map_fd, pages, &attr, on_raw_event, c, &opts);
	free(cpus);
	free(keys);
	return pb;
}

int main(int argc, char **argv)
{
	struct consumer c = {0};
	struct sigaction sa;
	struct rusage ready, end;
	struct rings rings = {0};
	uint64_t drain_ns, next_drain, now;
	FILE *out;
	int map_fd, err = 0;

	if (argc != 7 && argc != 8) {
		fprintf(stderr,
			"usage: %s MAP_PATH PAGES WAKEUP DRAIN_MS LAT_EVERY LAT_PATH [CHANNELS]\n",
			argv[0]);
		return 2;
	}
	drain_ns = strtoull(argv[4], NULL, 10) * 1000000ull;
	c.lat_every = strtoull(argv[5], NULL, 10);
	if (c.lat_every == 0)
		c.lat_every = 1;
	c.countdown = c.lat_every;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_usr1;	/* no SA_RESTART: the epoll wait returns EINTR */
	sigaction(SIGUSR1, &sa, NULL);

	map_fd = bpf_obj_get(argv[1]);
	if (map_fd < 0) {
		fprintf(stderr, "peer_libbpf: bpf_obj_get(%s): %s\n", argv[1], strerror(errno));
		return 1;
	}
	if (strcmp(argv[3], "ringbuf") == 0)
		rings.rb = ring_buffer__new(map_fd, on_ringbuf_sample, &c, NULL);
	else
		rings.pb = open_rings(map_fd, strtoul(argv[2], NULL, 10), argv[3],
				      argc == 8 ? atoi(argv[7]) : 0, &c);
	if (!rings.pb && !rings.rb) {
		fprintf(stderr, "peer_libbpf: %s: %s\n",
			strcmp(argv[3], "ringbuf") ? "perf_buffer__new" : "ring_buffer__new",
			strerror(errno));
		return 1;
	}
	getrusage(RUSAGE_SELF, &ready);
	printf("ready\n");
	fflush(stdout);

	next_drain = now_ns() + drain_ns;
	while (!finished) {
		int timeout = 100;

		if (drain_ns) {
			now = now_ns();
			timeout = now >= next_drain ? 0 : (int)((next_drain - now + 999999) / 1000000);
		}
		err = rings_poll(&rings, timeout);
		if (err < 0 && err != -EINTR) {
			fprintf(stderr, "peer_libbpf: poll: %s\n", strerror(-err));
			break;
		}
		err = 0;
		if (drain_ns) {
			now = now_ns();
			if (now >= next_drain) {
				rings_consume(&rings);	/* what sits below the threshold */
				next_drain = now + drain_ns;
			}
		}
	}
	rings_consume(&rings);
	getrusage(RUSAGE_SELF, &end);

	out = fopen(argv[6], "wb");
	if (out) {
		fwrite(c.lat, sizeof(*c.lat), c.nlat, out);
		fclose(out);
	}
	printf("result {\"samples\": %llu, \"lost_reported\": %llu, \"cpu_user\": %.6f, "
	       "\"cpu_sys\": %.6f, \"maxrss_kb\": %ld, \"t_last\": %llu, \"latencies\": %zu}\n",
	       (unsigned long long)c.samples, (unsigned long long)c.lost,
	       seconds(end.ru_utime) - seconds(ready.ru_utime),
	       seconds(end.ru_stime) - seconds(ready.ru_stime), peak_rss_kb(),
	       (unsigned long long)c.t_last, c.nlat);
	fflush(stdout);
	perf_buffer__free(rings.pb);
	ring_buffer__free(rings.rb);
	free(c.lat);
	return err ? 1 : 0;
}
