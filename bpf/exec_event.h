/* SPDX-License-Identifier: GPL-2.0 */
/* The sample of exec_buffer.bpf.c and exec_rings.bpf.c (minimal.bpf.c's, kept there
 * whole as docs/own-program.md shows it): user space decodes it by this name, from
 * the object's BTF, which the unused global takes it into. */
#ifndef APERF_EXEC_EVENT_H
#define APERF_EXEC_EVENT_H

struct exec_event {
	int pid;
	char comm[16];
};

struct exec_event *unused_exec_event __attribute__((unused));

/* Fill one for the running process. */
static __always_inline void fill_exec_event(struct exec_event *e)
{
	e->pid = bpf_get_current_pid_tgid() >> 32;
	bpf_get_current_comm(&e->comm, sizeof(e->comm));
}

#endif /* APERF_EXEC_EVENT_H */
