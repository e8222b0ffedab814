// SPDX-License-Identifier: GPL-2.0
/* The smallest BPF side of a user ring buffer (docs/user-ringbuf.md): each getppid() of
 * the process target_tgid drains "to_bpf" and echoes every message into the ring buffer
 * "from_bpf". getppid, not getpid: asyncio calls getpid() itself, and such a trigger
 * would drain the ring behind the sender's back. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "GPL";

struct message {
	__u64 seq;
	char text[24];
};
struct message *unused_message __attribute__((unused)); /* its BTF, for encoder="message" */

struct {
	__uint(type, BPF_MAP_TYPE_USER_RINGBUF);
	__uint(max_entries, 4096);
} to_bpf SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 4096);
} from_bpf SEC(".maps");

const volatile __u32 target_tgid; /* set before load */

static long on_message(struct bpf_dynptr *dynptr, void *ctx)
{
	struct message msg;

	if (bpf_dynptr_read(&msg, sizeof(msg), dynptr, 0, 0))
		return 1; /* not a whole message: stop draining */
	bpf_ringbuf_output(&from_bpf, &msg, sizeof(msg), 0);
	return 0; /* on to the next one */
}

SEC("tp/syscalls/sys_enter_getppid")
int drain(void *ctx)
{
	if (bpf_get_current_pid_tgid() >> 32 == target_tgid)
		bpf_user_ringbuf_drain(&to_bpf, on_message, NULL, 0);
	return 0;
}
