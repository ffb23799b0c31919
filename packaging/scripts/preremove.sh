#!/bin/sh
# preremove for the nri-gpu-guard .deb (prerm) and .rpm (%preun).
#
# On removal (not on upgrade) stop and disable the service. containerd is not
# touched.
#
# Arguments: deb "remove" | "upgrade <new-version>" | "deconfigure" | ...;
# rpm "0" on erase, "1" or more on upgrade.
set -e

UNIT=nri-gpu-guard.service

case "$1" in
	remove | 0) ;;
	*) exit 0 ;;
esac

if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
	systemctl disable --now "$UNIT" >/dev/null 2>&1 || true
fi
exit 0
