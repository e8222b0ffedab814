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

#endif /* APERF_KINDS_H */
