/* Copyright The nri-gpu-guard Authors. SPDX-License-Identifier: Apache-2.0 */

/*
 * nri-gpu-guard-hook-relay: the OCI hook that hooks.d names, in front of the
 * Go hook nri-gpu-guard-hook.
 *
 * Why: a runtime starts one hook process per container and phase, and a Go
 * hook pays a Go runtime start each time. This static C program starts in a
 * fraction of that, forwards its arguments and stdin over a unix socket to a
 * resident server (`nri-gpu-guard-hook serve`, which runs the same hook entry
 * the Go binary runs) and relays the answer: stderr bytes and exit code.
 * Whenever the server cannot answer, it exec()s the Go hook with the same
 * arguments and the same stdin bytes, so no verdict depends on the server
 * being up. The wire format is protocol version 2 ("GGH2", pkg/hookserve):
 * the request, an acknowledgement ('A' accepted or 'F' fall back), the
 * relay's go-ahead 'G' after an 'A' that came in time, then the result.
 *
 * Invariants:
 *   - it holds no policy and never decides a verdict itself: the exit code is
 *     the server's result or the Go hook's own;
 *   - exactly one of the two runs a request: the server runs it only after
 *     the 'G', which is sent only for an 'A' read within the ack timeout;
 *     a relay that falls back before sending it has its socket closed by
 *     the exec (O_CLOEXEC), which tells the server not to run;
 *   - it never forks: on fallback the Go hook replaces this process and keeps
 *     its pid and parent (the hook reads its parent, the runtime, from /proc);
 *   - every failure before a complete result (bad option value, arguments
 *     over the protocol's bounds, a stdin read error, connect, send, a late,
 *     malformed or 'F' acknowledgement, a connection that ends before the
 *     whole result) means fallback: execv(hook, {"nri-gpu-guard-hook",
 *     forwarded args...}) with the environment unchanged;
 *   - stdin is replayed exactly: once the relay has read it, fd 0 is
 *     replaced by a memfd (a pipe where memfd_create is missing and the bytes
 *     fit in the pipe) holding exactly the bytes read, at offset 0. A
 *     fallback decided before stdin is read (no phase argument, bounds,
 *     options) leaves fd 0 untouched, so the hook reads what it would have
 *     read had hooks.d named it directly;
 *   - every fd it opens is O_CLOEXEC except the replacement stdin, and
 *     SIGPIPE cannot kill it (MSG_NOSIGNAL; ignored only just before the
 *     result's stderr is written, after which nothing is exec'd);
 *   - if the exec fails: one line on stderr naming the hook path and exit 1,
 *     which refuses the container at create-runtime (fail closed).
 *
 * Lean on start cost: no stdio, no locale, no heap; one static buffer (BSS,
 * paid only as far as touched) holds the request, stdin included; the only
 * environment variable read is NRI_GPU_GUARD_CONFIG, the only one forwarded.
 *
 * Built static: cc -O2 -static -Wall -Wextra -Werror -o nri-gpu-guard-hook-relay relay.c
 */

#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef RELAY_DEFAULT_HOOK
#define RELAY_DEFAULT_HOOK "/usr/bin/nri-gpu-guard-hook"
#endif
#ifndef RELAY_DEFAULT_SOCKET
#define RELAY_DEFAULT_SOCKET "/run/nri-gpu-guard/hook.sock"
#endif
#define DEFAULT_ACK_TIMEOUT_MS 2000
#define MAX_ACK_TIMEOUT_MS 3600000L

/* Protocol version 2 bounds. */
#define MAX_ARGC 32
#define MAX_ARG_LEN 4096
#define MAX_ENV_LEN 8192
#define MAX_STDIN ((1 << 20) + 1)
#define MAX_STDERR 65536

#define CONFIG_ENV "NRI_GPU_GUARD_CONFIG"
#define SELF "nri-gpu-guard-hook-relay"

/* magic, argc, args, envc, one env entry, stdin_len. */
#define MAX_HEADER (4 + 4 + MAX_ARGC * (4 + MAX_ARG_LEN) + 4 + (4 + MAX_ENV_LEN) + 4)

static unsigned char req[MAX_HEADER + MAX_STDIN];
/* The acknowledgement (5 bytes; an 'F' reason is never read) and the result. */
static unsigned char resp[5 + 1 + 4 + 4 + MAX_STDERR];

static const char *hook_path = RELAY_DEFAULT_HOOK;
static char hook_name[] = "nri-gpu-guard-hook";
static char *no_args[] = { hook_name, NULL };
static char **hook_argv = no_args;
/* Where the stdin bytes start in req, and how many were read; stdin_taken is
 * set once fd 0 has been read from, and from then on a fallback replays. */
static size_t stdin_off, stdin_len;
static int stdin_taken;

static void put_u32(unsigned char *p, uint32_t v)
{
	p[0] = (unsigned char)v;
	p[1] = (unsigned char)(v >> 8);
	p[2] = (unsigned char)(v >> 16);
	p[3] = (unsigned char)(v >> 24);
}

static uint32_t get_u32(const unsigned char *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Writes all n bytes to fd (with send and MSG_NOSIGNAL where sock is set:
 * a server gone mid-request is EPIPE, not SIGPIPE); any failure, a send
 * timeout included, is -1. */
static int put_all(int fd, const unsigned char *p, size_t n, int sock)
{
	while (n > 0) {
		ssize_t w = sock ? send(fd, p, n, MSG_NOSIGNAL) : write(fd, p, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			if (w == 0)
				errno = EIO;
			return -1;
		}
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

static size_t append(char *dst, size_t at, size_t cap, const char *s)
{
	while (*s && at < cap)
		dst[at++] = *s++;
	return at;
}

/* One line on stderr, then exit 1: the only outcome that is not the server's
 * result or the hook's own. */
static void die(const char *what, int err) __attribute__((noreturn));
static void die(const char *what, int err)
{
	char line[4096 + 256];
	size_t n = 0, cap = sizeof line - 1;

	n = append(line, n, cap, SELF ": ");
	n = append(line, n, cap, what);
	n = append(line, n, cap, hook_path);
	n = append(line, n, cap, ": ");
	n = append(line, n, cap, strerror(err));
	line[n++] = '\n';
	(void)put_all(2, (const unsigned char *)line, n, 0);
	_exit(1);
}

static int make_memfd(void)
{
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 27))
	return memfd_create("nri-gpu-guard-hook-stdin", MFD_CLOEXEC);
#elif defined(SYS_memfd_create)
	return (int)syscall(SYS_memfd_create, "nri-gpu-guard-hook-stdin", 1U /* MFD_CLOEXEC */);
#else
	errno = ENOSYS;
	return -1;
#endif
}

/* Make fd 0 hold exactly the stdin bytes read, at offset 0. The memfd (or
 * pipe) is opened O_CLOEXEC; dup2 onto 0 yields the one fd without it. */
static int replay_stdin(void)
{
	const unsigned char *p = req + stdin_off;
	int fd = make_memfd();

	if (fd >= 0) {
		if (put_all(fd, p, stdin_len, 0) < 0 || lseek(fd, 0, SEEK_SET) != 0)
			return -1;
	} else {
		int pfd[2], size;

		if (errno != ENOSYS && errno != EINVAL)
			return -1;
		if (pipe2(pfd, O_CLOEXEC) < 0)
			return -1;
		/* Written before anyone reads: the bytes must fit the pipe. */
		size = fcntl(pfd[1], F_GETPIPE_SZ);
		if (size < 0 || stdin_len > (size_t)size) {
			errno = EFBIG;
			return -1;
		}
		if (put_all(pfd[1], p, stdin_len, 0) < 0)
			return -1;
		close(pfd[1]);
		fd = pfd[0];
	}
	if (fd != 0 && dup2(fd, 0) < 0)
		return -1;
	return 0;
}

static void fall_back(void) __attribute__((noreturn));
static void fall_back(void)
{
	if (stdin_taken && replay_stdin() < 0)
		die("cannot hand its stdin to the hook ", errno);
	execv(hook_path, hook_argv);
	die("cannot run the hook ", errno);
}

static int set_timeout(int fd, int opt, long ms)
{
	struct timeval tv = { .tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000 };

	return setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
}

static long now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static size_t resp_len;

/* Receives until resp holds at least n bytes. With a deadline (ms on the
 * monotonic clock, > 0), each wait is bounded by the time left (the socket
 * already has the whole timeout as SO_RCVTIMEO for the first wait). EOF, a
 * timeout and an error are all -1. */
static int recv_upto(int fd, size_t n, long deadline)
{
	int first = 1;

	while (resp_len < n) {
		ssize_t r;

		if (deadline > 0 && !first) {
			long left = deadline - now_ms();

			if (left <= 0 || set_timeout(fd, SO_RCVTIMEO, left) < 0)
				return -1;
		}
		first = 0;
		r = recv(fd, resp + resp_len, sizeof resp - resp_len, 0);
		if (r > 0) {
			resp_len += (size_t)r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		return -1;
	}
	return 0;
}

/* "--relay-NAME=" prefix test; returns the value or NULL. */
static const char *option(const char *arg, const char *name)
{
	size_t n = strlen(name);

	return strncmp(arg, name, n) == 0 ? arg + n : NULL;
}

/* A decimal number of milliseconds, 1..MAX_ACK_TIMEOUT_MS; -1 otherwise. */
static long parse_ms(const char *s)
{
	long v = 0;

	if (*s == '\0')
		return -1;
	for (; *s; s++) {
		if (*s < '0' || *s > '9')
			return -1;
		v = v * 10 + (*s - '0');
		if (v > MAX_ACK_TIMEOUT_MS)
			return -1;
	}
	return v > 0 ? v : -1;
}

int main(int argc, char **argv)
{
	const char *socket_path = RELAY_DEFAULT_SOCKET;
	long ack_ms = DEFAULT_ACK_TIMEOUT_MS;
	int bad_option = 0, first, nfwd, i, fd;
	const char *v, *config;
	unsigned char *p;
	struct sockaddr_un sa;
	size_t slen;
	long deadline;
	uint32_t code, errlen;

	for (first = 1; first < argc; first++) {
		const char *a = argv[first];

		if ((v = option(a, "--relay-socket=")) != NULL)
			socket_path = v;
		else if ((v = option(a, "--relay-hook=")) != NULL)
			hook_path = v;
		else if ((v = option(a, "--relay-ack-timeout-ms=")) != NULL) {
			ack_ms = parse_ms(v);
			if (ack_ms < 0)
				bad_option = 1;
		} else
			break;
	}
	/* The hook's argv reuses ours: the slot before the first forwarded
	 * argument (argv[0] or the last relay option) becomes its argv[0];
	 * argv[argc] is NULL. An empty argv (argc 0) keeps no_args. */
	nfwd = argc - first;
	if (argc > 0) {
		hook_argv = argv + first - 1;
		hook_argv[0] = hook_name;
	}

	if (bad_option || nfwd < 1 || nfwd > MAX_ARGC ||
	    (strcmp(argv[first], "create-runtime") != 0 && strcmp(argv[first], "poststop") != 0))
		fall_back();

	/* The request up to stdin; over a bound -> fall back, fd 0 untouched. */
	p = req;
	memcpy(p, "GGH2", 4);
	put_u32(p + 4, (uint32_t)nfwd);
	p += 8;
	for (i = first; i < argc; i++) {
		size_t n = strlen(argv[i]);

		if (n > MAX_ARG_LEN)
			fall_back();
		put_u32(p, (uint32_t)n);
		memcpy(p + 4, argv[i], n);
		p += 4 + n;
	}
	config = getenv(CONFIG_ENV);
	if (config == NULL) {
		put_u32(p, 0);
		p += 4;
	} else {
		size_t n = strlen(config), name = sizeof CONFIG_ENV; /* with '=' */

		if (n > MAX_ENV_LEN - name)
			fall_back();
		put_u32(p, 1);
		put_u32(p + 4, (uint32_t)(name + n));
		memcpy(p + 8, CONFIG_ENV "=", name);
		memcpy(p + 8 + name, config, n);
		p += 8 + name + n;
	}
	stdin_off = (size_t)(p - req) + 4;

	/* stdin to EOF, but no more than MAX_STDIN bytes. */
	while (stdin_len < MAX_STDIN) {
		ssize_t r = read(0, req + stdin_off + stdin_len, MAX_STDIN - stdin_len);

		if (r > 0) {
			stdin_taken = 1;
			stdin_len += (size_t)r;
			continue;
		}
		if (r == 0)
			break;
		if (errno == EINTR)
			continue;
		/* Nothing read yet: fd 0 stays, and the hook meets the same
		 * error. Else it gets the bytes read, a cut state it refuses. */
		fall_back();
	}
	stdin_taken = 1;
	put_u32(p, (uint32_t)stdin_len);

	/* Connect and send, each wait bounded by the ack timeout. */
	slen = strlen(socket_path);
	if (slen == 0 || slen >= sizeof sa.sun_path)
		fall_back();
	memset(&sa, 0, sizeof sa);
	sa.sun_family = AF_UNIX;
	memcpy(sa.sun_path, socket_path, slen);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	/* fd <= 2: a standard fd was closed; the result's stderr would go
	 * astray. */
	if (fd <= 2 || set_timeout(fd, SO_SNDTIMEO, ack_ms) < 0 ||
	    set_timeout(fd, SO_RCVTIMEO, ack_ms) < 0 ||
	    connect(fd, (const struct sockaddr *)&sa, sizeof sa) < 0 ||
	    put_all(fd, req, stdin_off + stdin_len, 1) < 0)
		fall_back();

	/* The acknowledgement within the ack timeout, then the go-ahead: from
	 * here on the server runs the hook, and we do not. The result's wait
	 * is unbounded (the runtime's hook timeout bounds us): set before the
	 * go-ahead, so that nothing after it can fail but the connection. */
	deadline = now_ms() + ack_ms;
	if (recv_upto(fd, 5, deadline) < 0 || memcmp(resp, "GGH2", 4) != 0 || resp[4] != 'A' ||
	    set_timeout(fd, SO_RCVTIMEO, 0) < 0 || put_all(fd, (const unsigned char *)"G", 1, 1) < 0)
		fall_back();

	/* The hook runs on the server; wait for its result as long as it takes.
	 * A connection lost before it is a fallback: the server's run ended
	 * with it (a crash, or a stop that hands a wait over), and a hook run
	 * is idempotent per container. */
	if (recv_upto(fd, 5 + 9, 0) < 0 || resp[5] != 'R')
		fall_back();
	code = get_u32(resp + 6);
	errlen = get_u32(resp + 10);
	if (code > 255 || errlen > MAX_STDERR || recv_upto(fd, 5 + 9 + errlen, 0) < 0)
		fall_back();

	signal(SIGPIPE, SIG_IGN);
	(void)put_all(2, resp + 14, errlen, 0);
	_exit((int)code);
}
