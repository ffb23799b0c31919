#!/bin/sh
# preremove for the nri-gpu-guard .deb (prerm) and .rpm (%preun).
#
# On removal (not on upgrade) stop and disable the service, and record that it
# was enabled so that a reinstall (a Debian reinstall from the config-files
# state is not a first install) enables it again: the drop-in stays, and with
# it containerd's refusal of every container while the guard is down.
# containerd is not touched. On rpm erase the containerd drop-in goes too when
# it is still the shipped one (rpm has no purge; an edited one stays, and
# postremove warns about it).
#
# Arguments: deb "remove" | "upgrade <new-version>" | "deconfigure" | ...;
# rpm "0" on erase, "1" or more on upgrade.
set -e

UNIT=nri-gpu-guard.service
HOOK_SOCKET=nri-gpu-guard-hook.socket
STATE_DIR=/var/lib/nri-gpu-guard
WAS_ENABLED=$STATE_DIR/package-removed-enabled-service
# postinstall's record that it enabled the hook socket once (see there).
HOOK_SOCKET_DONE=$STATE_DIR/package-hook-socket-enabled
DROP_IN=/etc/containerd/conf.d/nri-gpu-guard.toml
DROP_IN_EXAMPLE=/usr/share/nri-gpu-guard/containerd-nri-gpu-guard.toml

case "$1" in
	remove | 0) ;;
	*) exit 0 ;;
esac

if command -v systemctl >/dev/null 2>&1; then
	# A socket this removal disables comes back with a reinstall (its
	# record goes); one the operator disabled or masked stays so.
	if systemctl is-enabled --quiet "$HOOK_SOCKET" 2>/dev/null; then
		rm -f "$HOOK_SOCKET_DONE"
	fi
fi
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
	if systemctl is-enabled --quiet "$UNIT" 2>/dev/null && [ -d "$STATE_DIR" ] && [ ! -L "$STATE_DIR" ]; then
		: >"$WAS_ENABLED" || true
	fi
	systemctl disable --now "$UNIT" >/dev/null 2>&1 || true
	# The hook server goes with its binary: the relay that stays until the
	# files go runs nri-gpu-guard-hook itself meanwhile.
	systemctl disable --now "$HOOK_SOCKET" nri-gpu-guard-hook.service >/dev/null 2>&1 || true
elif command -v systemctl >/dev/null 2>&1; then
	# No systemd running (a chroot): the links postinstall made go.
	systemctl disable "$HOOK_SOCKET" >/dev/null 2>&1 || true
fi

if [ "$1" = 0 ] && [ -f "$DROP_IN" ] && [ ! -L "$DROP_IN" ] && cmp -s "$DROP_IN" "$DROP_IN_EXAMPLE"; then
	rm -f "$DROP_IN"
fi
exit 0
