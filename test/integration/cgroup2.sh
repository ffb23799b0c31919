#!/usr/bin/env bash
# Runs a command (the end-to-end suite) on cgroup v2 on a host whose
# /sys/fs/cgroup is cgroup v1 or hybrid: in a private mount namespace, the
# kernel's unified hierarchy is mounted at /sys/fs/cgroup, so containerd,
# runc, the guard and its liveness check all see a cgroup v2 host. On a
# cgroup v2 host it just runs the command.
#
# Usage (as root): cgroup2.sh COMMAND [ARG...]
#   e.g. make integration CGROUP=v2
#
# Limits: on a hybrid host the resource controllers (cpu, memory, pids, ...)
# stay bound to their v1 hierarchies, so this cgroup v2 view has none (or
# only those no v1 hierarchy uses). runc then places containers in cgroup v2
# and sets no limits, which is all the suite needs: the cgroups' process
# lists and populated state are real.
set -euo pipefail

[[ $# -gt 0 ]] || { echo "usage: $0 COMMAND [ARG...]" >&2; exit 2; }
if [[ $(stat -f -c %T /sys/fs/cgroup) == cgroup2fs ]]; then
	exec "$@"
fi
command -v unshare >/dev/null || { echo "cgroup2.sh: unshare (util-linux) is missing" >&2; exit 1; }
# shellcheck disable=SC2016 # expanded by the inner shell
exec unshare --mount --propagation private -- bash -c '
	set -e
	mount -t cgroup2 cgroup2 /sys/fs/cgroup
	exec "$@"' cgroup2.sh "$@"
