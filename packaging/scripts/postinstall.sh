#!/bin/sh
# postinstall for the nri-gpu-guard .deb (postinst) and .rpm (%post).
#
# Creates the ledger directory and tells the operator the one step left. It
# never edits containerd's configuration and never restarts containerd: doing
# so would restart every container runtime operation on the node, and the
# drop-in makes containerd refuse containers until the guard runs, so the
# operator must choose the moment.
#
# Arguments: deb "configure <previously-configured-version>" (empty on a first
# install); rpm "1" on a first install, "2" or more on an upgrade.
set -e

STATE_DIR=/var/lib/nri-gpu-guard
UNIT=nri-gpu-guard.service

first_install=no
case "$1" in
	configure) [ -z "$2" ] && first_install=yes ;;
	1) first_install=yes ;;
	[0-9]*) ;;
	*) exit 0 ;; # abort-upgrade, abort-remove, ...: nothing to do
esac

# The ledger refuses a directory that is a symlink, not root-owned or not
# 0700 (see the security section of the docs). Never follow a symlink here.
if [ -L "$STATE_DIR" ]; then
	echo "nri-gpu-guard: WARNING: $STATE_DIR is a symlink; the guard refuses to use it." >&2
	echo "nri-gpu-guard: replace it with a directory owned by root with mode 0700." >&2
else
	mkdir -p "$STATE_DIR"
	chown root:root "$STATE_DIR"
	chmod 0700 "$STATE_DIR"
fi

systemd_running=no
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
	systemd_running=yes
	systemctl daemon-reload >/dev/null 2>&1 || true
fi

if [ "$first_install" = no ]; then
	# Upgrade: restart the guard itself (only if it is running) so the new
	# binary serves. containerd refuses creates for the second this takes, and
	# kubelet retries them.
	if [ "$systemd_running" = yes ]; then
		systemctl try-restart "$UNIT" >/dev/null 2>&1 || true
	fi
	exit 0
fi

cat <<'MSG'

nri-gpu-guard is installed but not running yet. Next step:

  1. make containerd (>= 2.2) read /etc/containerd/conf.d/nri-gpu-guard.toml:
     /etc/containerd/config.toml (version = 3) needs the line
         imports = ["/etc/containerd/conf.d/*.toml"]
     then:  systemctl restart containerd
     From then on containerd refuses containers while the guard is not running.
  2. start the guard:  systemctl enable --now nri-gpu-guard

Configuration: /etc/nri-gpu-guard/config.toml (check it with
`gpu-guard-ctl check-config`). Guide: /usr/share/doc/nri-gpu-guard/install.md

MSG
exit 0
