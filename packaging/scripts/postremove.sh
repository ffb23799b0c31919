#!/bin/sh
# postremove for the nri-gpu-guard .deb (postrm) and .rpm (%postun).
#
# Arguments: deb "remove" | "purge" | "upgrade <new-version>" | ...;
# rpm "0" on erase, "1" or more on upgrade.
set -e

STATE_DIR=/var/lib/nri-gpu-guard
DROP_IN=/etc/containerd/conf.d/nri-gpu-guard.toml

if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
	systemctl daemon-reload >/dev/null 2>&1 || true
fi

case "$1" in
	purge)
		# Everything the package or the guard created. The ledger only
		# records claims of the guard that is now gone. Its per-boot marker
		# (named after a hash of the state dir) goes with it: left behind, it
		# would make a reinstall in the same boot refuse every GPU container
		# as a ledger that vanished.
		rm -rf "$STATE_DIR"
		if command -v sha256sum >/dev/null 2>&1; then
			rm -f "/run/nri-gpu-guard/ledger-$(printf %s "$STATE_DIR" | sha256sum | cut -c1-24).marker"
		fi
		# The OCI hook's container markers (each says "read the ledger at
		# poststop"): with the ledger gone they only cost reads.
		rm -rf /run/nri-gpu-guard/hook-containers
		rmdir /etc/nri-gpu-guard 2>/dev/null || true
		# The containerd drop-in, which postinstall installed (no package
		# file: it is installed only for containerd >= 2.2). The running
		# containerd keeps the requirement until it restarts.
		if [ -e "$DROP_IN" ] || [ -L "$DROP_IN" ]; then
			rm -f "$DROP_IN"
			cat >&2 <<'MSG'

nri-gpu-guard: purged, with the containerd drop-in. containerd keeps refusing
containers until it is restarted: systemctl restart containerd

MSG
		fi
		;;
	remove | 0)
		# rpm has no purge: an operator deletes the ledger directory by hand
		# (install.md). Once it is gone, its per-boot marker must go too, or
		# a reinstall in this boot would refuse every GPU container as a
		# ledger that vanished. Only then: a kept ledger needs its marker.
		if [ "$1" = 0 ] && [ ! -e "$STATE_DIR" ] && [ ! -L "$STATE_DIR" ] && command -v sha256sum >/dev/null 2>&1; then
			rm -f "/run/nri-gpu-guard/ledger-$(printf %s "$STATE_DIR" | sha256sum | cut -c1-24).marker"
		fi
		# A removed .deb keeps the drop-in (until purge), and an erased .rpm
		# an edited one (preremove removed an unedited one). If the drop-in
		# is still in place, the
		# next containerd restart would refuse EVERY container, because the
		# plugin it requires is gone. Say so, with the fix.
		if [ -e "$DROP_IN" ]; then
			cat >&2 <<MSG

nri-gpu-guard: WARNING: $DROP_IN is still in place.
It makes containerd refuse every container while the gpu-guard plugin is
absent. Remove it before containerd next restarts:
  dpkg --purge nri-gpu-guard   (Debian/Ubuntu), or: rm $DROP_IN
  systemctl restart containerd
The running containerd keeps refusing containers until it is restarted
without the drop-in.

MSG
		else
			cat >&2 <<'MSG'

nri-gpu-guard: removed. If containerd loaded the nri-gpu-guard drop-in, it
keeps refusing containers until it is restarted: systemctl restart containerd

MSG
		fi
		;;
esac
exit 0
