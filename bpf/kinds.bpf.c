// SPDX-License-Identifier: GPL-2.0
/* Emits one sample of struct kinds (see kinds.h for the exact values) into
 * the perf event array "samples". Run with bpf_prog_test_run_opts
 * (BPF_F_TEST_RUN_ON_CPU to pick the CPU); returns 0 if the output
 * succeeded, 1 otherwise.
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
