#!/bin/sh
# posttrans for the nri-gpu-guard .rpm (%posttrans; rpm only, no arguments).
#
# Earlier packages owned /etc/containerd/conf.d/nri-gpu-guard.toml as
# %config; on an upgrade from one, rpm erases that file (an edited one becomes
# .rpmsave) after the new package's %post, which saved a copy. The drop-in is
# now the operator's file, installed by postinstall on a first install: put it
# back, so that the upgrade does not silently turn fail closed into fail open.
set -e

DROP_IN=/etc/containerd/conf.d/nri-gpu-guard.toml
DROP_IN_SAVE=/var/lib/nri-gpu-guard/package-containerd-drop-in.save

[ -f "$DROP_IN_SAVE" ] || exit 0
if [ ! -e "$DROP_IN" ] && [ ! -L "$DROP_IN" ]; then
	mv -f "$DROP_IN_SAVE" "$DROP_IN"
	rm -f "$DROP_IN.rpmsave"
	echo "nri-gpu-guard: kept the containerd drop-in $DROP_IN across the upgrade."
else
	rm -f "$DROP_IN_SAVE"
fi
exit 0
