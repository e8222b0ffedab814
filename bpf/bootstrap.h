/* SPDX-License-Identifier: GPL-2.0 */
/* Event layout shared by bootstrap_legacy.bpf.c and its user-space reader.
 * Include after vmlinux.h (BPF side, which provides bool) or <stdbool.h>.
 */
#ifndef APERF_BOOTSTRAP_H
#define APERF_BOOTSTRAP_H

#define TASK_COMM_LEN 16
#define MAX_FILENAME_LEN 127

/* Layout (x86-64 / BPF, 176 bytes, align 8):
 *   0  int pid
 *   4  int ppid
 *   8  unsigned exit_code
 *  16  unsigned long long duration_ns     (4 bytes padding before)
 *  24  char comm[16]
 *  40  char filename[127]
 * 167  bool exit_event
 * 168  unsigned long long timestamp_ns
 */
struct event {
	int pid;
	int ppid;
	unsigned exit_code;
	unsigned long long duration_ns;
	char comm[TASK_COMM_LEN];
	char filename[MAX_FILENAME_LEN];
	bool exit_event;
	/* When the event happened: bpf_ktime_get_boot_ns(), CLOCK_BOOTTIME (unlike
	 * CLOCK_MONOTONIC it goes on during suspend, so one offset to the wall clock,
	 * taken when the reader starts, stays right). */
	unsigned long long timestamp_ns;
};

#endif /* APERF_BOOTSTRAP_H */
