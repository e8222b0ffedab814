/* SPDX-License-Identifier: GPL-2.0 */
/* A message the tests send through the user ring buffer, encoded from this
 * struct's BTF (user_ringbuf.bpf.c keeps it in the object). */
#ifndef USER_RINGBUF_H
#define USER_RINGBUF_H

enum user_kind {
	USER_KIND_PING = 1,
	USER_KIND_STOP = 2,
};

struct user_message {
	__u64 seq;
	enum user_kind kind;
	__s16 delta;
	__u8 flags[2];
	char name[12];
	__u32 values[3];
};

#endif
