/*
 * Copyright The nri-gpu-guard Authors.
 * SPDX-License-Identifier: Apache-2.0
 *
 * readstdin.c is the floor of any hook process in any language: a static C
 * program that reads its stdin (the OCI state a runtime writes to every
 * hook) to the end and exits 0. No language runtime starts, so what
 * BenchmarkRuncHook measures for it is what the runtime's own way of
 * running a hook costs: fork, exec, the state written down a pipe, the
 * wait. Built with `cc -O2 -static`.
 */
#include <errno.h>
#include <unistd.h>

int main(void)
{
	char buf[4096];
	for (;;) {
		ssize_t n = read(0, buf, sizeof buf);
		if (n == 0)
			return 0;
		if (n < 0 && errno != EINTR)
			return 1;
	}
}
