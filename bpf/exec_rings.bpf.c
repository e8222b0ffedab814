// SPDX-License-Identifier: GPL-2.0
/* minimal.bpf.c's program with a BPF ring buffer per CPU (docs/ringbuf.md): each exec's
 * sample goes into the ring of the CPU it ran on. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <aperf/buffer.bpf.h>
#include "exec_event.h"

char LICENSE[] SEC("license") = "GPL";

/* 64 KiB per CPU; BPFObject puts a ring in each CPU's slot when it loads the object. */
APERF_RINGBUF_PER_CPU(rings, 64 * 1024);

SEC("tp/sched/sched_process_exec")
int on_exec(void *ctx)
{
	struct exec_event e = {};

	fill_exec_event(&e);
	aperf_ringbuf_output(rings, &e, sizeof(e));
	return 0;
}
