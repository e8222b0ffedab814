/* SPDX-License-Identifier: Apache-2.0 */
/* aperf's BPF side: one program for either ring, and per-CPU ring buffers.
 *
 *   #include "vmlinux.h"            (or <linux/bpf.h>)
 *   #include <bpf/bpf_helpers.h>
 *   #include <aperf/buffer.bpf.h>   (clang -I "$(python -m aperf --include-dir)")
 *
 * APERF_BUFFER(events, 256 * 1024);
 *     A buffer: a BPF ring buffer of that many bytes where the loader keeps it one,
 *     or a perf event array (a ring per CPU) where it makes it one.
 *     aperf.BPFObject(path, buffer="auto" | "ringbuf" | "perf") picks the type
 *     before load; aperf.PerfStream(obj.maps["events"]) reads whichever it became.
 *     Loaded by anything else (libbpf alone), it stays a ring buffer.
 *
 *     aperf_buffer_output(events, ctx, &e, sizeof(e))   copy a record out
 *     e = aperf_buffer_reserve(events, sizeof(*e))       fill a record in place, then
 *     aperf_buffer_submit(events, ctx, e, sizeof(*e))    send it, or
 *     aperf_buffer_discard(events, e)                    drop it
 *
 *     ctx is the program's context (a perf event array needs it). reserve's size
 *     must be a constant (a ring buffer reserves exactly that much); a perf event
 *     array takes the record from a per-CPU scratch area of APERF_BUFFER_MAX_RECORD
 *     bytes (define it before the #include to change it), which the reserve of one
 *     program run holds until its submit: a program that nests into another on the
 *     same CPU (a kprobe inside a tracepoint) must not use reserve on both.
 *     Every output that finds no room is counted in the global
 *     aperf_buffer_dropped__events, from which aperf reports a ring buffer's drops
 *     (the kernel counts a perf event array's itself).
 *
 * APERF_RINGBUF_PER_CPU(rings, 256 * 1024);
 *     A BPF ring buffer of that many bytes for each CPU: a BPF_MAP_TYPE_ARRAY_OF_MAPS
 *     that aperf.BPFObject fills when it loads the object (one ring per possible CPU,
 *     at most APERF_MAX_CPUS). aperf.PerfStream(obj.maps["rings"]) reads them all as
 *     one stream, each ring keyed by its CPU.
 *
 *     aperf_ringbuf_output(rings, &e, sizeof(e))         into the running CPU's ring
 *
 *     Every output that finds no room is counted per CPU in the global array
 *     aperf_ringbuf_dropped__rings, from which aperf reports each ring's drops.
 *
 * The names beginning with aperf_buffer_, aperf_ringbuf_ and __aperf are aperf's:
 * the loader finds the buffers by them (docs/own-program.md).
 */
#ifndef APERF_BUFFER_BPF_H
#define APERF_BUFFER_BPF_H

#ifndef APERF_BUFFER_MAX_RECORD
#define APERF_BUFFER_MAX_RECORD 8192
#endif

#ifndef APERF_MAX_CPUS
#define APERF_MAX_CPUS 1024
#endif

struct __aperf_buffer_record {
	__u8 data[APERF_BUFFER_MAX_RECORD];
};

/* Where a perf event array's reserved record is built (a ring buffer needs none). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct __aperf_buffer_record);
} __aperf_buffer_scratch SEC(".maps");

/* The map, and two globals the loader and the reader find by name: whether the
 * map is a ring buffer (read-only: set by the loader before load, a constant to
 * the verifier, which drops the other branch), and the count of drops. */
#define APERF_BUFFER(name, bytes)                                              \
	struct {                                                               \
		__uint(type, BPF_MAP_TYPE_RINGBUF);                            \
		__uint(max_entries, bytes);                                    \
	} name SEC(".maps");                                                   \
	const volatile __u32 aperf_buffer_ringbuf__##name = 1;                 \
	__u64 aperf_buffer_dropped__##name = 0

static __always_inline long __aperf_buffer_output(void *map, __u32 ringbuf, __u64 *dropped,
						   void *ctx, void *data, __u64 size)
{
	long ret;

	if (ringbuf)
		ret = bpf_ringbuf_output(map, data, size, 0);
	else
		ret = bpf_perf_event_output(ctx, map, BPF_F_CURRENT_CPU, data, size);
	if (ret < 0)
		__sync_fetch_and_add(dropped, 1);
	return ret;
}

static __always_inline void *__aperf_buffer_reserve(void *map, __u32 ringbuf, __u64 *dropped,
						     __u64 size)
{
	__u32 zero = 0;
	void *record;

	if (ringbuf) {
		record = bpf_ringbuf_reserve(map, size, 0);
		if (!record)
			__sync_fetch_and_add(dropped, 1);
		return record;
	}
	if (size > APERF_BUFFER_MAX_RECORD) {
		__sync_fetch_and_add(dropped, 1);
		return (void *)0;
	}
	return bpf_map_lookup_elem(&__aperf_buffer_scratch, &zero);
}

static __always_inline long __aperf_buffer_submit(void *map, __u32 ringbuf, __u64 *dropped,
						   void *ctx, void *record, __u64 size)
{
	long ret;

	if (ringbuf) {
		bpf_ringbuf_submit(record, 0);
		return 0;
	}
	ret = bpf_perf_event_output(ctx, map, BPF_F_CURRENT_CPU, record, size);
	if (ret < 0)
		__sync_fetch_and_add(dropped, 1);
	return ret;
}

static __always_inline void __aperf_buffer_discard(__u32 ringbuf, void *record)
{
	if (ringbuf)
		bpf_ringbuf_discard(record, 0);
}

#define aperf_buffer_output(name, ctx, data, size)                            \
	__aperf_buffer_output(&name, aperf_buffer_ringbuf__##name,              \
			      &aperf_buffer_dropped__##name, ctx, data, size)
#define aperf_buffer_reserve(name, size)                                       \
	__aperf_buffer_reserve(&name, aperf_buffer_ringbuf__##name,             \
			       &aperf_buffer_dropped__##name, size)
#define aperf_buffer_submit(name, ctx, record, size)                          \
	__aperf_buffer_submit(&name, aperf_buffer_ringbuf__##name,              \
			      &aperf_buffer_dropped__##name, ctx, record, size)
#define aperf_buffer_discard(name, record)                                     \
	__aperf_buffer_discard(aperf_buffer_ringbuf__##name, record)

/* One ring buffer per CPU: the outer map's slots are filled by the loader. The
 * read-only global marks the map as aperf's and says how many slots the program
 * was built for; the array counts each CPU's drops. */
#define APERF_RINGBUF_PER_CPU(name, bytes)                                     \
	struct {                                                               \
		__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);                      \
		__uint(max_entries, APERF_MAX_CPUS);                           \
		__type(key, __u32);                                            \
		__array(values, struct {                                       \
			__uint(type, BPF_MAP_TYPE_RINGBUF);                    \
			__uint(max_entries, bytes);                            \
		});                                                            \
	} name SEC(".maps");                                                   \
	const volatile __u32 aperf_ringbuf_per_cpu__##name = APERF_MAX_CPUS;   \
	__u64 aperf_ringbuf_dropped__##name[APERF_MAX_CPUS] = {}

static __always_inline long __aperf_ringbuf_output(void *rings, __u64 *dropped, void *data,
						    __u64 size)
{
	__u32 cpu = bpf_get_smp_processor_id();
	void *ring = bpf_map_lookup_elem(rings, &cpu);
	long ret = -2; /* -ENOENT: no ring for this CPU */

	if (ring)
		ret = bpf_ringbuf_output(ring, data, size, 0);
	if (ret < 0 && cpu < APERF_MAX_CPUS)
		__sync_fetch_and_add(&dropped[cpu], 1);
	return ret;
}

#define aperf_ringbuf_output(name, data, size)                                 \
	__aperf_ringbuf_output(&name, aperf_ringbuf_dropped__##name, data, size)

#endif /* APERF_BUFFER_BPF_H */
