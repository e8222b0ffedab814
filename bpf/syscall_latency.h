/* SPDX-License-Identifier: GPL-2.0 */
/* The event of syscall_latency.bpf.c: one finished syscall, timed in the kernel.
 * examples/syscall_latency.py decodes it from the object's BTF into NumPy arrays.
 */
#ifndef APERF_SYSCALL_LATENCY_H
#define APERF_SYSCALL_LATENCY_H

struct syscall_event {
	__u64 duration_ns;	/* from sys_enter to sys_exit of this thread */
	__s64 ret;		/* the syscall's return value */
	__u32 pid;		/* the process (tgid) */
	__u32 tid;		/* the thread */
	__u32 nr;		/* the syscall number */
	__u32 cpu;		/* where it returned */
	char comm[16];		/* the thread's name */
};

#endif /* APERF_SYSCALL_LATENCY_H */
