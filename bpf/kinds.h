/* SPDX-License-Identifier: GPL-2.0 */
/* A struct exercising many BTF kinds, for testing BTF-based sample decoders.
 * kinds.bpf.c emits exactly one sample of sizeof(struct kinds) bytes holding
 * the values in the comments below (padding bytes are zero).
 * Include after vmlinux.h (BPF side, which provides the __u8.. types and bool).
 */
#ifndef APERF_KINDS_H
#define APERF_KINDS_H

enum color {
	RED = 1,
	GREEN = 2,
	BLUE = 4,
};

struct point {
	__s32 x;
	__s32 y;
};

/* Layout: sizeof 120, align 8. Offsets: u8 0, s8 1, u16 2, s16 4, (pad 6-7),
 * u32 8, s32 12, u64 16, s64 24, flag 32, (pad 33-35), color 36, name 40,
 * raw 56, arr 64, where 80, pts 88, matrix 104, (trailing pad 116-119).
 * A perf sample of it arrives as 124 raw bytes; decode only the first 120.
 */
struct kinds {
	__u8 u8;		/* 0xff (255) */
	__s8 s8;		/* -128 */
	__u16 u16;		/* 0xffff (65535) */
	__s16 s16;		/* -32768 */
	__u32 u32;		/* 0xffffffff (4294967295) */
	__s32 s32;		/* -2147483648 */
	__u64 u64;		/* 0xffffffffffffffff (18446744073709551615) */
	__s64 s64;		/* -9223372036854775808 (INT64_MIN) */
	bool flag;		/* true (byte 0x01) */
	enum color color;	/* BLUE (4); BTF ENUM, size 4, unsigned */
	char name[16];		/* "hello" followed by 11 NUL bytes */
	char raw[8];		/* bytes 61 ff fe 62 00 7a 00 00 ('a',0xff,0xfe,'b',0,'z',0,0) */
	__u32 arr[4];		/* {1, 2, 3, 4} */
	struct point where;	/* {x = -5, y = 7} */
	struct point pts[2];	/* {{1, 2}, {3, 4}} */
	__u16 matrix[2][3];	/* {{1, 2, 3}, {4, 5, 6}} */
};

/* --- Decoded values that mean the same, whatever the decoder (docs/decoding.md) ---
 * emit_variety outputs two samples of struct variety (values below; sample 1
 * differs where noted); tests mirror it as a ctypes structure and compare.
 */

enum run_state {
	IDLE = 0,
	RUNNING = 1,
};

union word {
	__u32 u;	/* 0xfffffffe */
	__s32 s;	/* -2 */
	__u8 b[4];	/* fe ff ff ff */
};

typedef struct {
	__u16 lo;	/* 1 */
	__u16 hi;	/* 2 */
} pair_t;		/* a typedef of an anonymous struct */

/* sizeof 112, align 8; data[] at 112. Samples: 112 + 3 and 112 + 10 bytes output. */
struct variety {
	char c;			/* 'A' (65) */
	char neg;		/* -2 */
	__u8 u8s[4];		/* de ad be ef */
	unsigned char uchars[4];	/* 01 02 03 04 */
	signed char schars[4];	/* ff fe 7f 80 */
	char names[2][8];	/* "ab", "cdefghij" (8 chars, no NUL) */
	union word word;
	struct {		/* anonymous: its members are the struct's own */
		__u32 pid;	/* 4242 */
		__u32 tid;	/* 4243 */
	};
	union {			/* anonymous union */
		__u64 addr;	/* 0x1122334455667788 */
		__u32 halves[2];
	};
	__u32 *ptr;		/* 0xdeadbeef00 */
	void *nothing;		/* NULL */
	__u32 from;		/* 1: named like Python keywords */
	__u32 in;		/* 2 */
	__u32 async;		/* 3 */
	__u32 None;		/* 4 */
	__u32 __pad;		/* 5: a leading underscore */
	enum run_state st;		/* RUNNING; sample 1: 7, which the enum does not name */
	pair_t pair;
	__u32 len;		/* 3; sample 1: 10 */
	__u64 seq;		/* 0; sample 1: 1 */
	__u8 data[];		/* "xyz"; sample 1: "0123456789" */
};

typedef struct variety variety_t;

/* emit_short outputs the first N bytes (config) of this struct; the ring held
 * 0xab bytes there before (emit_filler), and the kernel pads without clearing.
 */
struct shorty {
	__u64 seq;		/* 7 */
	__u64 ts;		/* 8 */
	__u32 x;		/* 9 */
	__u32 last;		/* 0x44332211: its first bytes are the ones output */
};

#endif /* APERF_KINDS_H */
