// SPDX-License-Identifier: Apache-2.0
/* The native traced workload of aperf's benchmark: calls getpid(2) in a tight
 * loop, as fast as one CPU allows, so that the getpid tracepoint producer
 * (bpf/bench_getpid.bpf.c) offers samples at the highest rate it can.
 *
 *   getpid_loop SECONDS
 *
 * Prints "ready", waits for a line on stdin, loops for SECONDS, then prints
 * "result {json}" with the number of calls, the time they took, and the
 * CLOCK_MONOTONIC start and end in ns.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
	double seconds = argc > 1 ? atof(argv[1]) : 1.0, start, deadline, end;
	struct timespec t0, t1;
	uint64_t calls = 0;
	char line[64];

	printf("ready\n");
	fflush(stdout);
	if (!fgets(line, sizeof(line), stdin))
		return 1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	start = now_s();
	deadline = start + seconds;
	do {
		for (int i = 0; i < 1000; i++)
			syscall(SYS_getpid);	/* never cached: always the system call */
		calls += 1000;
		end = now_s();
	} while (end < deadline);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	printf("result {\"calls\": %llu, \"seconds\": %.6f, \"start_ns\": %llu, \"end_ns\": %llu}\n",
	       (unsigned long long)calls, end - start,
	       (unsigned long long)t0.tv_sec * 1000000000ull + (unsigned long long)t0.tv_nsec,
	       (unsigned long long)t1.tv_sec * 1000000000ull + (unsigned long long)t1.tv_nsec);
	return 0;
}
