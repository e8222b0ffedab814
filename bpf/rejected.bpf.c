// SPDX-License-Identifier: GPL-2.0
/* A program the verifier must reject (for aperf's error tests): it reads a map
 * value without checking the lookup for NULL. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} values SEC(".maps");

SEC("raw_tp")
int unchecked_lookup(void *ctx)
{
	__u32 key = 0;
	__u64 *value = bpf_map_lookup_elem(&values, &key);

	return *value; /* no NULL check: "invalid mem access 'map_value_or_null'" */
}
