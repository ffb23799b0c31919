#!/bin/sh
# postinstall for the nri-gpu-guard .deb (postinst) and .rpm (%post).
#
# Creates the ledger directory, installs the containerd drop-in where it is
# safe to, and tells the operator the step left. It never edits containerd's
# main configuration and never restarts containerd: doing so would restart
# every container runtime operation on the node, and the drop-in makes
# containerd refuse containers until the guard runs, so the operator must
# choose the moment.
#
# Arguments: deb "configure <previously-configured-version>" (empty on a first
# install; the old version also after `dpkg -r` + reinstall, from the
# config-files state); rpm "1" on a first install, "2" or more on an upgrade.
set -e

STATE_DIR=/var/lib/nri-gpu-guard
UNIT=nri-gpu-guard.service
# The OCI hook server (nri-gpu-guard-hook serve) and its socket: the hooks.d
# files run nri-gpu-guard-hook-relay, which hands each hook run to the server
# and runs nri-gpu-guard-hook itself while the server does not answer. So
# the socket is enabled once (it only makes hooks faster, nothing depends on
# it), and the server restarted on an upgrade.
HOOK_SOCKET=nri-gpu-guard-hook.socket
HOOK_SERVER=nri-gpu-guard-hook.service
# Written once the package has enabled the socket (or found it masked):
# from then on the operator's choice stands. Without it (a first install,
# an upgrade from a version without the hook server, a reinstall after a
# removal that disabled an enabled socket: preremove deletes it) the socket
# is enabled.
HOOK_SOCKET_DONE=$STATE_DIR/package-hook-socket-enabled
DROP_IN=/etc/containerd/conf.d/nri-gpu-guard.toml
CONFIG=/etc/nri-gpu-guard/config.toml
DROP_IN_EXAMPLE=/usr/share/nri-gpu-guard/containerd-nri-gpu-guard.toml
DROP_IN_SAVE=$STATE_DIR/package-containerd-drop-in.save
# Written by preremove when a removal disabled an enabled service.
WAS_ENABLED=$STATE_DIR/package-removed-enabled-service

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

# containerd_fails_closed: succeeds when `containerd --version` reports 2.2 or
# newer, the first release with the NRI default validator the drop-in turns
# on. The drop-in is config version 3, which containerd 1.7 cannot load at all
# (it fails to start when its imports find the file), and on 2.0/2.1 the
# validator does not exist. Sets containerd_version for the messages.
containerd_version=
containerd_fails_closed() {
	command -v containerd >/dev/null 2>&1 || return 1
	# "containerd containerd.io 1.7.35 <commit>", "containerd github.com/containerd/containerd/v2 v2.2.0 <commit>"
	containerd_version=$(containerd --version 2>/dev/null | awk '{print $3}') || return 1
	v=${containerd_version#v}
	major=${v%%.*}
	rest=${v#*.}
	minor=${rest%%.*}
	case "$major$minor" in
		'' | *[!0-9]*) return 1 ;;
	esac
	[ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 2 ]; }
}

# An rpm upgrade from a package that still owned the drop-in as %config
# erases it (or moves an edited one to .rpmsave) after this script, when the
# old package goes: keep a copy that posttrans.sh puts back.
case "$1" in
	[2-9] | [1-9][0-9]*)
		if [ -f "$DROP_IN" ] && [ -d "$STATE_DIR" ] && [ ! -L "$STATE_DIR" ]; then
			cp -p "$DROP_IN" "$DROP_IN_SAVE"
		fi
		;;
esac

# The drop-in: installed only on a first install (an upgrade keeps what the
# operator has, including no drop-in), never over an existing file or link,
# and only for containerd >= 2.2.
if [ "$first_install" = yes ]; then
	if [ -e "$DROP_IN" ] || [ -L "$DROP_IN" ]; then
		echo "nri-gpu-guard: kept the existing $DROP_IN (the shipped one is $DROP_IN_EXAMPLE)."
	elif containerd_fails_closed; then
		mkdir -p "$(dirname "$DROP_IN")"
		cp "$DROP_IN_EXAMPLE" "$DROP_IN.tmp.$$"
		chmod 0644 "$DROP_IN.tmp.$$"
		mv -f "$DROP_IN.tmp.$$" "$DROP_IN"
		echo "nri-gpu-guard: installed the containerd drop-in $DROP_IN (containerd $containerd_version)."
	elif [ -n "$containerd_version" ]; then
		echo "nri-gpu-guard: containerd $containerd_version is older than 2.2: NOT installing the drop-in $DROP_IN"
		echo "nri-gpu-guard: (it cannot fail closed there, and containerd 1.7 would not start with it; see $DROP_IN_EXAMPLE)."
	else
		echo "nri-gpu-guard: containerd not found: NOT installing the drop-in $DROP_IN."
		echo "nri-gpu-guard: With containerd >= 2.2, copy $DROP_IN_EXAMPLE there (see install.md)."
	fi
fi

systemd_running=no
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
	systemd_running=yes
	systemctl daemon-reload >/dev/null 2>&1 || true
fi

# The hook socket, once. Without systemd running (a chroot, an image
# build) `systemctl enable` still makes the links, so that the image boots
# with it; with it, --now starts it too.
if [ ! -e "$HOOK_SOCKET_DONE" ] && [ -d "$STATE_DIR" ] && [ ! -L "$STATE_DIR" ] && command -v systemctl >/dev/null 2>&1; then
	case "$(systemctl is-enabled "$HOOK_SOCKET" 2>/dev/null || true)" in
	masked | masked-runtime)
		# The operator's: kept, and not asked about again.
		: >"$HOOK_SOCKET_DONE" || true
		;;
	*)
		now=
		[ "$systemd_running" = yes ] && now=--now
		# shellcheck disable=SC2086 # $now is empty or one flag
		if systemctl enable $now "$HOOK_SOCKET" >/dev/null 2>&1; then
			: >"$HOOK_SOCKET_DONE" || true
		else
			echo "nri-gpu-guard: could not enable $HOOK_SOCKET (the OCI hooks work without it, one process start slower each): systemctl enable --now $HOOK_SOCKET" >&2
		fi
		;;
	esac
fi
# On every upgrade, whether or not the socket was enabled just now (an
# `enable --now` of a socket already listening leaves its server as it
# is): the server answers with the code it started with, the new one from
# the next hook on (a stopped server is started by its socket at the next
# hook).
if [ "$systemd_running" = yes ] && [ "$first_install" = no ]; then
	systemctl try-restart "$HOOK_SERVER" >/dev/null 2>&1 || true
fi

# A removal (deb `dpkg -r`, rpm erase) disabled a service that was enabled,
# and this install follows it: put the service back as it was. Without this a
# Debian reinstall from the config-files state (which is `configure <old>`, not
# a first install) would leave the guard disabled while the drop-in it kept
# makes containerd refuse every container. Only the removal's own record
# enables the service: an operator who runs the guard another way
# (/opt/nri/plugins) or not at all is never overridden.
if [ -e "$WAS_ENABLED" ]; then
	rm -f "$WAS_ENABLED"
	if [ "$systemd_running" = yes ] && systemctl enable --now "$UNIT" >/dev/null 2>&1; then
		echo "nri-gpu-guard: re-enabled and started $UNIT, as it was before the package was removed."
		exit 0
	fi
	echo "nri-gpu-guard: WARNING: $UNIT was enabled before the package was removed; could not re-enable it: systemctl enable --now nri-gpu-guard" >&2
fi

if [ "$first_install" = no ]; then
	# Upgrade: restart the guard itself (only if it is running) so the new
	# binary serves. containerd refuses creates for the second this takes, and
	# kubelet retries them. Not when this version refuses the configuration
	# (edited and not yet loaded, or checked more strictly than before): the
	# new daemon would exit at once and restart in a loop, and containerd
	# would refuse every container meanwhile; the running one keeps
	# enforcing with what it loaded.
	config_ok=yes
	if ! config_check=$(/usr/bin/gpu-guard-ctl check-config "$CONFIG" 2>&1); then
		config_ok=no
		cat >&2 <<MSG

nri-gpu-guard: WARNING: $CONFIG does not pass this version's check:
$config_check
The guard was NOT restarted: if it runs, it keeps enforcing with the
configuration it loaded. OCI hooks (podman, CRI-O) read the file for every
container and refuse containers until it is fixed. Fix it, check it with
  gpu-guard-ctl check-config
then restart the guard:
  systemctl restart nri-gpu-guard

MSG
	fi
	if [ "$systemd_running" = yes ]; then
		if [ "$config_ok" = yes ]; then
			systemctl try-restart "$UNIT" >/dev/null 2>&1 || true
		fi
		# Not enabled while the drop-in is in place: containerd refuses every
		# container once it (re)loads the drop-in. Say so on every configure,
		# not only the first; not enabled by force, since the guard may be
		# launched by containerd from /opt/nri/plugins instead.
		if [ -e "$DROP_IN" ] && ! systemctl is-enabled --quiet "$UNIT" 2>/dev/null; then
			cat >&2 <<MSG

nri-gpu-guard: WARNING: $UNIT is not enabled, but $DROP_IN
makes containerd refuse every container while the guard is not running.
To start it (unless containerd launches the guard from /opt/nri/plugins):
  systemctl enable --now nri-gpu-guard

MSG
		fi
	fi
	exit 0
fi

if [ -e "$DROP_IN" ]; then
	cat <<MSG

nri-gpu-guard is installed but not running yet. Next step:

  1. make containerd (>= 2.2) read $DROP_IN:
     /etc/containerd/config.toml (version = 3) needs the line
         imports = ["/etc/containerd/conf.d/*.toml"]
     then:  systemctl restart containerd
     From then on containerd refuses containers while the guard is not running.
  2. start the guard:  systemctl enable --now nri-gpu-guard

MSG
else
	cat <<MSG

nri-gpu-guard is installed but not running yet. Next step:

  start the guard:  systemctl enable --now nri-gpu-guard
  Without the drop-in (not installed, see above) containerd does not refuse
  containers while the guard is down (fail open).

MSG
fi
cat <<'MSG'
Configuration: /etc/nri-gpu-guard/config.toml (check it with
`gpu-guard-ctl check-config`). Guide: /usr/share/doc/nri-gpu-guard/install.md

MSG
exit 0
