// SPDX-License-Identifier: GPL-2.0
/* Emits samples of the structs of kinds.h (see there for the exact values)
 * into the perf event array "samples". Run with bpf_prog_test_run_opts
 * (BPF_F_TEST_RUN_ON_CPU to pick the CPU); each program returns 0 if its
 * outputs succeeded, 1 otherwise.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include "kinds.h"

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_PERF_EVENT_ARRAY);
	__uint(key_size, sizeof(u32));
	__uint(value_size, sizeof(u32));
} samples SEC(".maps");

/* value type also puts struct kinds into the object's BTF */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct kinds);
} scratch SEC(".maps");

SEC("raw_tp")
int emit_kinds(void *ctx)
{
	struct kinds *k;
	__u32 zero = 0;
	int i, j;

	k = bpf_map_lookup_elem(&scratch, &zero);
	if (!k)
		return 1;
	__builtin_memset(k, 0, sizeof(*k));

	k->u8 = 0xff;
	k->s8 = -128;
	k->u16 = 0xffff;
	k->s16 = -32768;
	k->u32 = 0xffffffff;
	k->s32 = -2147483647 - 1;
	k->u64 = 0xffffffffffffffffULL;
	k->s64 = -9223372036854775807LL - 1;
	k->flag = true;
	k->color = BLUE;

	k->name[0] = 'h';
	k->name[1] = 'e';
	k->name[2] = 'l';
	k->name[3] = 'l';
	k->name[4] = 'o';

	k->raw[0] = 'a';
	k->raw[1] = (char)0xff;
	k->raw[2] = (char)0xfe;
	k->raw[3] = 'b';
	k->raw[4] = 0;
	k->raw[5] = 'z';

	for (i = 0; i < 4; i++)
		k->arr[i] = i + 1;

	k->where.x = -5;
	k->where.y = 7;

	k->pts[0].x = 1;
	k->pts[0].y = 2;
	k->pts[1].x = 3;
	k->pts[1].y = 4;

	for (i = 0; i < 2; i++)
		for (j = 0; j < 3; j++)
			k->matrix[i][j] = i * 3 + j + 1;

	if (bpf_perf_event_output(ctx, &samples, BPF_F_CURRENT_CPU, k, sizeof(*k)) < 0)
		return 1;
	return 0;
}

#define VARIETY_ROOM 256
#define FILLER_SIZE 4076	/* a 4088-byte record: the most a one-page ring takes */

/* Per-CPU scratch space for building samples (a struct with a flexible array
 * member cannot be a map value with room behind it). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u8[4096]);
} room SEC(".maps");

/* Puts variety_t, struct shorty and enum run_state into the object's BTF. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, variety_t);
} variety_type SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct shorty);
} shorty_type SEC(".maps");

/* key 0: how many bytes of struct shorty emit_short outputs */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} short_size SEC(".maps");

static __always_inline void fill_variety(struct variety *v, __u32 len, __u64 seq, __u32 st)
{
	const char digits[] = "0123456789";
	int i;

	__builtin_memset(v, 0, sizeof(*v));
	v->c = 'A';
	v->neg = -2;
	v->u8s[0] = 0xde;
	v->u8s[1] = 0xad;
	v->u8s[2] = 0xbe;
	v->u8s[3] = 0xef;
	for (i = 0; i < 4; i++)
		v->uchars[i] = i + 1;
	v->schars[0] = -1;
	v->schars[1] = -2;
	v->schars[2] = 127;
	v->schars[3] = -128;
	v->names[0][0] = 'a';
	v->names[0][1] = 'b';
	for (i = 0; i < 8; i++)
		v->names[1][i] = 'c' + i;
	v->word.u = 0xfffffffe;
	v->pid = 4242;
	v->tid = 4243;
	v->addr = 0x1122334455667788ULL;
	v->ptr = (__u32 *)0xdeadbeef00ULL;
	v->nothing = 0;
	v->from = 1;
	v->in = 2;
	v->async = 3;
	v->None = 4;
	v->__pad = 5;
	v->st = st;
	v->pair.lo = 1;
	v->pair.hi = 2;
	v->len = len;
	v->seq = seq;
	if (len == 3) {
		v->data[0] = 'x';
		v->data[1] = 'y';
		v->data[2] = 'z';
	} else {
		for (i = 0; i < 10; i++)
			v->data[i] = digits[i];
	}
}

SEC("raw_tp")
int emit_variety(void *ctx)
{
	__u32 zero = 0;
	struct variety *v;

	v = bpf_map_lookup_elem(&room, &zero);
	if (!v)
		return 1;
	fill_variety(v, 3, 0, RUNNING);
	if (bpf_perf_event_output(ctx, &samples, BPF_F_CURRENT_CPU, v, sizeof(*v) + 3) < 0)
		return 1;
	fill_variety(v, 10, 1, 7);
	if (bpf_perf_event_output(ctx, &samples, BPF_F_CURRENT_CPU, v, sizeof(*v) + 10) < 0)
		return 1;
	return 0;
}

/* One sample of FILLER_SIZE bytes of 0xab: with one page per ring, it fills the ring. */
SEC("raw_tp")
int emit_filler(void *ctx)
{
	__u32 zero = 0;
	__u64 *buf;
	int i;

	buf = bpf_map_lookup_elem(&room, &zero);
	if (!buf)
		return 1;
	for (i = 0; i < 512; i++) {
		buf[i] = 0xababababababababULL;
		asm volatile("" ::: "memory");	/* a loop, not a memset call BPF lacks */
	}
	if (bpf_perf_event_output(ctx, &samples, BPF_F_CURRENT_CPU, buf, FILLER_SIZE) < 0)
		return 1;
	return 0;
}

/* The first short_size[0] bytes of a struct shorty (1 to sizeof). */
SEC("raw_tp")
int emit_short(void *ctx)
{
	__u32 zero = 0, *size;
	struct shorty *s;
	__u64 n;

	size = bpf_map_lookup_elem(&short_size, &zero);
	s = bpf_map_lookup_elem(&room, &zero);
	if (!size || !s)
		return 1;
	n = *size;
	if (n < 1 || n > sizeof(*s))
		return 1;
	s->seq = 7;
	s->ts = 8;
	s->x = 9;
	s->last = 0x44332211;
	if (bpf_perf_event_output(ctx, &samples, BPF_F_CURRENT_CPU, s, n) < 0)
		return 1;
	return 0;
}
