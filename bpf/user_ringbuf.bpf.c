// SPDX-License-Identifier: GPL-2.0
/* The kernel side of aperf's user ring buffer tests: drains what user space sent
 * into the BPF_MAP_TYPE_USER_RINGBUF "to_bpf" and echoes every message, byte for
 * byte, into the BPF ring buffer "echo" that aperf reads back.
 *
 * "drain" is not attached anywhere: user space runs it with bpf_prog_test_run_opts()
 * (docs/user-ringbuf.md's example, bpf/user_ringbuf_hello.bpf.c, attaches its drain).
 * One run calls bpf_user_ringbuf_drain() once; it hands the callback every
 * submitted message in order and frees their space.
 *
 * counters: [0] += messages drained (the helper's return values),
 *           [1] += messages that could not be echoed (no room, or too big),
 *           [2]  = the last run's drain return value (negative errno on error),
 *           [3] += runs.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "user_ringbuf.h"

char LICENSE[] SEC("license") = "GPL";

#define MAX_MESSAGE 1024 /* echoed whole: larger messages are counted, not echoed */

extern __u32 bpf_dynptr_size(const struct bpf_dynptr *ptr) __ksym;

struct {
	__uint(type, BPF_MAP_TYPE_USER_RINGBUF);
	__uint(max_entries, 16 * 1024); /* user space may set it before load */
} to_bpf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 22);
} echo SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 4);
	__type(key, __u32);
	__type(value, __s64);
} counters SEC(".maps");

struct scratch {
	__u8 data[2 * MAX_MESSAGE]; /* room for the verifier's bound, size & (2 * MAX - 1) */
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct scratch);
} buffer SEC(".maps");

/* The layout the BTF encoding test sends (user_ringbuf.h). */
struct user_message keep_user_message = {};

static void add(__u32 key, __s64 value)
{
	__s64 *slot = bpf_map_lookup_elem(&counters, &key);

	if (slot)
		__sync_fetch_and_add(slot, value);
}

static long echo_one(struct bpf_dynptr *message, void *ctx)
{
	__u32 zero = 0;
	struct scratch *buf = bpf_map_lookup_elem(&buffer, &zero);
	__u32 size = bpf_dynptr_size(message);

	if (!buf || size > MAX_MESSAGE) {
		add(1, 1);
		return 0;
	}
	/* The check above, in a form the verifier follows (clang would drop a C mask). */
	asm volatile("%[size] &= 0x7ff" : [size] "+r"(size));
	if (bpf_dynptr_read(buf->data, size, message, 0, 0) ||
	    bpf_ringbuf_output(&echo, buf->data, size, 0))
		add(1, 1);
	return 0; /* go on with the next message */
}

static void drain_once(void)
{
	long got = bpf_user_ringbuf_drain(&to_bpf, echo_one, NULL, 0);
	__u32 key = 2;
	__s64 *last = bpf_map_lookup_elem(&counters, &key);

	if (last)
		*last = got;
	if (got > 0)
		add(0, got);
	add(3, 1);
}

SEC("raw_tp")
int drain(void *ctx)
{
	drain_once();
	return 0;
}
