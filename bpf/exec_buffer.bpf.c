// SPDX-License-Identifier: GPL-2.0
/* minimal.bpf.c's program, with the buffer of aperf's BPF header: one sample for every
 * exec, into a map the loader makes a BPF ring buffer or a perf event array
 * (docs/own-program.md), and a count of the execs seen, read live. */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <aperf/buffer.bpf.h>
#include "exec_event.h"

char LICENSE[] SEC("license") = "GPL";

/* A 256 KiB BPF ring buffer, or a perf event array: aperf.BPFObject(..., buffer=). */
APERF_BUFFER(events, 256 * 1024);

/* A global the program keeps: user space reads it live with obj.read_global("execs"). */
__u64 execs = 0;
/* One it reads: user space pauses it with obj.write_global("paused", True). */
bool paused = false;

SEC("tp/sched/sched_process_exec")
int on_exec(void *ctx)
{
	struct exec_event *e;

	if (paused)
		return 0;
	__sync_fetch_and_add(&execs, 1);
	e = aperf_buffer_reserve(events, sizeof(*e));
	if (!e)
		return 0; /* no room: the header counted it */
	fill_exec_event(e);
	aperf_buffer_submit(events, ctx, e, sizeof(*e));
	return 0;
}
