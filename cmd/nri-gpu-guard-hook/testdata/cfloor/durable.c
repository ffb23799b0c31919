/*
 * Copyright The nri-gpu-guard Authors.
 * SPDX-License-Identifier: Apache-2.0
 *
 * durable.c is testdata/durablefloor in C: it reads its stdin to the end,
 * flocks the lock file of the state dir, appends one record of the size
 * the journal writes for the phase, fdatasyncs it and unlocks. The floor of
 * a hook that records each claim and release durably, without the start of
 * a language runtime. Built with `cc -O2 -static`.
 *
 *	durable [create-runtime|poststop] [...] --state-dir DIR [...]
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

/* The sizes of testdata/durablefloor: a claim and a release of one GPU. */
enum { claim_record = 323, release_record = 112 };

static int drain_stdin(void)
{
	char buf[4096];
	for (;;) {
		ssize_t n = read(0, buf, sizeof buf);
		if (n == 0)
			return 0;
		if (n < 0 && errno != EINTR)
			return -1;
	}
}

int main(int argc, char **argv)
{
	const char *dir = NULL;
	size_t size = claim_record;
	char path[4096], rec[claim_record];
	int lock, f;

	if (drain_stdin() != 0)
		return 1;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "poststop") == 0)
			size = release_record;
		else if (strcmp(argv[i], "--state-dir") == 0 && i + 1 < argc)
			dir = argv[i + 1];
	}
	if (dir == NULL) {
		fputs("durable: --state-dir DIR is required\n", stderr);
		return 2;
	}
	if (mkdir(dir, 0700) != 0 && errno != EEXIST)
		return 1;
	if (snprintf(path, sizeof path, "%s/cfloor.lock", dir) >= (int)sizeof path)
		return 1;
	lock = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (lock < 0 || flock(lock, LOCK_EX) != 0)
		return 1;
	if (snprintf(path, sizeof path, "%s/cfloor.journal", dir) >= (int)sizeof path)
		return 1;
	f = open(path, O_WRONLY | O_APPEND | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (f < 0)
		return 1;
	memset(rec, 'x', size - 1);
	rec[size - 1] = '\n';
	if (write(f, rec, size) != (ssize_t)size || fdatasync(f) != 0)
		return 1;
	close(f);
	flock(lock, LOCK_UN);
	close(lock);
	return 0;
}
