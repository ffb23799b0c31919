#!/usr/bin/env bash
# Builds the packages (make package) and checks the .deb on this machine:
# install, the installed binaries, the systemd unit, the containerd drop-in
# (installed only for containerd >= 2.2, never over an operator's file; a fake
# `containerd --version` on PATH picks the version), the OCI hooks, that a
# locally edited config survives remove + reinstall and an enabled service is
# enabled again, and purge. Needs root and dpkg (Debian/Ubuntu); CI runs it. The machine is left
# as it was found: the package is purged and anything it removed that existed
# before (the ledger directory) is put back.
#
# Environment:
#   NO_BUILD=1   test the packages already in dist/ instead of `make package`
#   BIN_DIR      passed to build-packages.sh (default: bin)
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

PKG=nri-gpu-guard
CONFIG=/etc/nri-gpu-guard/config.toml
DROP_IN=/etc/containerd/conf.d/nri-gpu-guard.toml
DROP_IN_EXAMPLE=/usr/share/nri-gpu-guard/containerd-nri-gpu-guard.toml
UNIT=/usr/lib/systemd/system/nri-gpu-guard.service
HOOK_SOCKET_UNIT=/usr/lib/systemd/system/nri-gpu-guard-hook.socket
HOOK_SERVER_UNIT=/usr/lib/systemd/system/nri-gpu-guard-hook.service
HOOKS_DIR=/usr/share/containers/oci/hooks.d
STATE_DIR=/var/lib/nri-gpu-guard

checks=0
log() { printf 'test-packages: %s\n' "$*"; }
fail() {
	printf 'test-packages: FAIL: %s\n' "$*" >&2
	exit 1
}
ok() {
	checks=$((checks + 1))
	log "ok: $*"
}

[[ $(id -u) -eq 0 ]] || fail "run as root (it installs and purges the .deb)"
command -v dpkg >/dev/null || fail "dpkg not found: this test needs Debian/Ubuntu"
status=$(dpkg-query -W -f='${Status}' "$PKG" 2>/dev/null || true)
if [[ $status == *installed* || $status == *config-files* ]]; then
	fail "$PKG is already installed on this machine; not touching an operator's installation"
fi
[[ ! -e $DROP_IN && ! -L $DROP_IN ]] || fail "$DROP_IN exists; not touching an operator's containerd configuration"

# What exists before, to leave the machine as found.
work=$(mktemp -d)
saved_state=""
made_dirs=()
for d in /etc/containerd/conf.d /etc/containerd; do
	[[ -e $d ]] || made_dirs+=("$d")
done
if [[ -e $STATE_DIR ]]; then
	saved_state=$work/state
	cp -a "$STATE_DIR" "$saved_state"
fi
cleanup() {
	local rc=$?
	if dpkg-query -W "$PKG" >/dev/null 2>&1; then
		dpkg --purge "$PKG" >/dev/null 2>&1 || true
	fi
	if [[ -n $saved_state ]]; then
		rm -rf "$STATE_DIR"
		cp -a "$saved_state" "$STATE_DIR"
	fi
	rm -f "$DROP_IN" # absent at the start (checked)
	for d in "${made_dirs[@]}"; do
		rmdir "$d" 2>/dev/null || true
	done
	rm -rf "$work"
	exit "$rc"
}
trap cleanup EXIT

# A fake containerd whose --version the maintainer scripts read.
fake_containerd() {
	mkdir -p "$work/fake-$1"
	printf '#!/bin/sh\necho "containerd github.com/containerd/containerd/v2 %s 0123abcd"\n' "$1" >"$work/fake-$1/containerd"
	chmod 0755 "$work/fake-$1/containerd"
	echo "$work/fake-$1"
}
new_containerd=$(fake_containerd v2.2.0)
old_containerd=$(fake_containerd 1.7.35)

if [[ ${NO_BUILD:-} != 1 ]]; then
	log "make package"
	make package
fi
debs=(dist/"$PKG"_*.deb)
[[ -f ${debs[0]} && ${#debs[@]} -eq 1 ]] || fail "want exactly one dist/${PKG}_*.deb, found: ${debs[*]}"
deb=${debs[0]}
rpms=(dist/"$PKG"-*.rpm)
[[ -f ${rpms[0]} ]] || fail "no dist/$PKG-*.rpm"
log "testing $deb"

# --- Package metadata -------------------------------------------------------
version=$(dpkg-deb -f "$deb" Version)
dpkg --compare-versions "$version" gt 0 || fail "version '$version' does not sort above 0"
ok "version $version is valid for dpkg"
conffiles=$(dpkg-deb --ctrl-tarfile "$deb" | tar -xOf - ./conffiles)
grep -qxF "$CONFIG" <<<"$conffiles" || fail "$CONFIG is not a conffile"
! grep -qxF "$DROP_IN" <<<"$conffiles" || fail "$DROP_IN is a conffile (it must be installed only for containerd >= 2.2)"
ok "config is a conffile, the drop-in is not a package file"

if command -v rpm >/dev/null; then
	rpm_files=$(rpm -qpl "${rpms[0]}" 2>/dev/null)
	rpm_config=$(rpm -qpc "${rpms[0]}" 2>/dev/null)
	for f in /usr/bin/nri-gpu-guard /usr/bin/gpu-guard-ctl /usr/bin/nri-gpu-guard-hook /usr/bin/nri-gpu-guard-hook-relay "$UNIT" "$HOOK_SOCKET_UNIT" "$HOOK_SERVER_UNIT" "$CONFIG" "$DROP_IN_EXAMPLE"; do
		grep -qxF "$f" <<<"$rpm_files" || fail "rpm lacks $f"
	done
	! grep -qxF "$DROP_IN" <<<"$rpm_files" || fail "rpm owns $DROP_IN (it must be installed only for containerd >= 2.2)"
	grep -qxF "$CONFIG" <<<"$rpm_config" || fail "rpm: $CONFIG is not %config"
	rpm_scripts=$(rpm -qp --scripts "${rpms[0]}" 2>/dev/null)
	for s in 'postinstall scriptlet' 'preuninstall scriptlet' 'postuninstall scriptlet' 'posttrans scriptlet' 'systemctl enable --now nri-gpu-guard' 'package-containerd-drop-in.save'; do
		grep -qF "$s" <<<"$rpm_scripts" || fail "rpm scriptlets lack '$s'"
	done
	[[ $(rpm -qp --queryformat '%{LICENSE}' "${rpms[0]}" 2>/dev/null) == Apache-2.0 ]] ||
		fail "rpm does not declare License: Apache-2.0"
	ok "rpm contents, %config files, scriptlets and license"
else
	log "skip: rpm not installed, the .rpm is not inspected"
fi

# --- Install ----------------------------------------------------------------
PATH=$new_containerd:$PATH dpkg -i "$deb" </dev/null >"$work/install.log" 2>&1 || {
	cat "$work/install.log" >&2
	fail "dpkg -i"
}
grep -q 'Next step' "$work/install.log" || fail "postinst did not print the next step"
grep -q 'systemctl enable --now nri-gpu-guard' "$work/install.log" || fail "postinst did not name the enable command"
ok "dpkg -i installed $PKG and printed the next step"
grep -qF "installed the containerd drop-in $DROP_IN (containerd v2.2.0)" "$work/install.log" ||
	fail "postinst did not say it installed the drop-in for containerd 2.2: $(cat "$work/install.log")"

[[ -d $STATE_DIR && ! -L $STATE_DIR ]] || fail "$STATE_DIR was not created"
[[ $(stat -c '%a %U %G' "$STATE_DIR") == "700 root root" ]] || fail "$STATE_DIR is $(stat -c '%a %U %G' "$STATE_DIR"), want 700 root root"
ok "$STATE_DIR is 0700 root:root"

for b in nri-gpu-guard gpu-guard-ctl nri-gpu-guard-hook nri-gpu-guard-hook-relay; do
	[[ -x /usr/bin/$b ]] || fail "/usr/bin/$b missing"
done
for u in "$HOOK_SOCKET_UNIT" "$HOOK_SERVER_UNIT"; do
	[[ -f $u ]] || fail "$u missing"
done
# The hook socket is enabled on a first install (with systemd running or
# not: the links are what an image boots with). systemctl reads the unit
# files whether or not systemd runs.
hook_socket_state() { systemctl is-enabled nri-gpu-guard-hook.socket 2>/dev/null || true; }
HOOK_SOCKET_LINK=/etc/systemd/system/sockets.target.wants/nri-gpu-guard-hook.socket
if command -v systemctl >/dev/null; then
	[[ $(hook_socket_state) == enabled ]] || fail "the first install did not enable nri-gpu-guard-hook.socket: $(hook_socket_state); $(cat "$work/install.log")"
	ok "the first install enables nri-gpu-guard-hook.socket"
fi
for d in "$HOOKS_DIR" "/usr/share/doc/$PKG"; do
	[[ $(stat -c '%a' "$d") == 755 ]] || fail "$d is mode $(stat -c '%a' "$d"), want 755 (rootless engines read it)"
done
ok "the package's directories are 0755"
out=$(/usr/bin/nri-gpu-guard --version 2>&1) || fail "nri-gpu-guard --version: $out"
want=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
grep -qF "$want" <<<"$out" || fail "nri-gpu-guard --version printed '$out', want the build version $want"
ok "nri-gpu-guard --version: $out"
out=$(/usr/bin/nri-gpu-guard-hook --version 2>&1) || fail "nri-gpu-guard-hook --version: $out"
grep -qF "$want" <<<"$out" || fail "nri-gpu-guard-hook --version printed '$out', want the build version $want"
# Static: no program interpreter (ld-linux) to load for each hook run.
! grep -q 'ld-linux' /usr/bin/nri-gpu-guard-hook || fail "/usr/bin/nri-gpu-guard-hook is dynamically linked"
# What the hooks.d files run (in the environment they set), for a container
# that names no GPU: admitted and released without the ledger (the state dir
# here does not exist).
mkdir -p "$work/bundle"
# (A capabilities object as every engine writes one: without it the hook
# reads the container as able to make device nodes.)
printf '{"ociVersion":"1.0.2","process":{"env":["PATH=/bin"],"capabilities":{"bounding":["CAP_CHOWN","CAP_KILL"]}}}' >"$work/bundle/config.json"
for phase in create-runtime poststop; do
	printf '{"ociVersion":"1.0.2","id":"pkgtest","status":"creating","bundle":"%s"}' "$work/bundle" |
		env -i GOMAXPROCS=1 /usr/bin/nri-gpu-guard-hook "$phase" --state-dir "$work/no-state" >"$work/hook.log" 2>&1 ||
		fail "nri-gpu-guard-hook $phase of a container without GPU: $(cat "$work/hook.log")"
done
[[ ! -e $work/no-state ]] || fail "nri-gpu-guard-hook created a ledger for a container without GPU"
ok "nri-gpu-guard-hook: static, $out, passes a container without GPU"

# The relay the hooks.d files name: static too; without a server it runs
# /usr/bin/nri-gpu-guard-hook itself, and with one (started here on a socket
# of its own) the server answers: a hook path that does not exist proves it.
! grep -q 'ld-linux' /usr/bin/nri-gpu-guard-hook-relay || fail "/usr/bin/nri-gpu-guard-hook-relay is dynamically linked"
relay_state() { printf '{"ociVersion":"1.0.2","id":"pkgtest","status":"creating","bundle":"%s"}' "$work/bundle"; }
for phase in create-runtime poststop; do
	relay_state | env -i GOMAXPROCS=1 /usr/bin/nri-gpu-guard-hook-relay --relay-socket="$work/none.sock" "$phase" --state-dir "$work/no-state" >"$work/relay.log" 2>&1 ||
		fail "nri-gpu-guard-hook-relay $phase without a server: $(cat "$work/relay.log")"
done
# Its first line says it listens.
coproc SERVE { exec /usr/bin/nri-gpu-guard-hook serve --socket "$work/hook.sock" 2>&1; }
serve_pid=$SERVE_PID
read -r line <&"${SERVE[0]}" || fail "nri-gpu-guard-hook serve exited without a word"
[[ $line == *"listening on $work/hook.sock"* ]] || fail "nri-gpu-guard-hook serve: $line"
for phase in create-runtime poststop; do
	relay_state | env -i GOMAXPROCS=1 /usr/bin/nri-gpu-guard-hook-relay --relay-socket="$work/hook.sock" --relay-hook=/nonexistent "$phase" --state-dir "$work/no-state" >"$work/relay.log" 2>&1 ||
		fail "nri-gpu-guard-hook-relay $phase answered by nri-gpu-guard-hook serve: $(cat "$work/relay.log")"
done
kill "$serve_pid"
wait "$serve_pid" 2>/dev/null || true
[[ ! -e $work/no-state ]] || fail "the relay's hook runs created a ledger for a container without GPU"
ok "nri-gpu-guard-hook-relay: static, passes a container without GPU with and without the hook server"

out=$(/usr/bin/gpu-guard-ctl check-config 2>&1) || fail "gpu-guard-ctl check-config of the shipped config: $out"
grep -qF "$CONFIG" <<<"$out" || fail "gpu-guard-ctl check-config did not read $CONFIG: $out"
ok "gpu-guard-ctl check-config accepts $CONFIG"
printf 'version = 1\n[policy]\non_confilct = "queue"\n' >"$work/bad.toml"
if out=$(/usr/bin/gpu-guard-ctl check-config "$work/bad.toml" 2>&1); then
	fail "gpu-guard-ctl check-config accepted a misspelt key: $out"
fi
grep -q 'on_confilct' <<<"$out" || fail "check-config did not name the bad key: $out"
ok "gpu-guard-ctl check-config rejects a bad config, naming the key"

# Static, like the hook: what needs NVML (ps here) runs as `nri-gpu-guard ctl`
# from the same directory, so the output is that binary's, whatever NVML says.
! grep -q 'ld-linux' /usr/bin/gpu-guard-ctl || fail "/usr/bin/gpu-guard-ctl is dynamically linked"
want=$(/usr/bin/nri-gpu-guard ctl ps 2>&1) || true
out=$(PATH=/nonexistent /usr/bin/gpu-guard-ctl ps 2>&1) || true
[[ -n $out && $out == "$want" ]] || fail "gpu-guard-ctl ps printed '$out', want what nri-gpu-guard ctl ps prints: '$want'"
ok "gpu-guard-ctl: static, runs ps through nri-gpu-guard ctl"

cmp -s packaging/containerd/nri-gpu-guard.toml "$DROP_IN" || fail "$DROP_IN differs from packaging/containerd/nri-gpu-guard.toml"
cmp -s packaging/containerd/nri-gpu-guard.toml "$DROP_IN_EXAMPLE" || fail "$DROP_IN_EXAMPLE differs from packaging/containerd/nri-gpu-guard.toml"
[[ $(stat -c '%a %U' "$DROP_IN") == "644 root" ]] || fail "$DROP_IN is $(stat -c '%a %U' "$DROP_IN"), want 644 root"
ok "installed drop-in (containerd 2.2) and its template are byte-identical"
cmp -s packaging/config.toml "$CONFIG" || fail "$CONFIG differs from packaging/config.toml"
ok "installed config is byte-identical"
hooks=0
for f in packaging/oci-hooks.d/*.json; do
	[[ -f $f ]] || continue
	cmp -s "$f" "$HOOKS_DIR/$(basename "$f")" || fail "$HOOKS_DIR/$(basename "$f") differs from $f"
	hooks=$((hooks + 1))
done
((hooks > 0)) || fail "no OCI hook JSON in packaging/oci-hooks.d"
ok "$hooks OCI hooks installed in $HOOKS_DIR"
ONE_HOOK_MASK=/usr/share/nri-gpu-guard/one-hook/nri-gpu-guard-poststop.json
cmp -s packaging/oci-hooks.d/one-hook/nri-gpu-guard-poststop.json "$ONE_HOOK_MASK" ||
	fail "$ONE_HOOK_MASK missing or differs from packaging/oci-hooks.d/one-hook/nri-gpu-guard-poststop.json"
[[ ! -e $HOOKS_DIR/one-hook ]] || fail "$HOOKS_DIR/one-hook: the one-hook mask must not be in a hooks directory"
ok "one-hook poststop mask installed outside the hooks directories"
[[ -f /usr/share/doc/$PKG/install.md ]] || fail "/usr/share/doc/$PKG/install.md missing"
cmp -s LICENSE "/usr/share/doc/$PKG/LICENSE" || fail "/usr/share/doc/$PKG/LICENSE missing or not the project's LICENSE"
ok "docs and LICENSE installed"

# --- systemd unit -----------------------------------------------------------
if ! command -v systemd-analyze >/dev/null; then
	apt-cache policy systemd | grep -q 'Candidate: [0-9]' || fail "systemd-analyze missing and no systemd package available"
	log "installing systemd for systemd-analyze"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd >/dev/null
fi
for u in "$UNIT" "$HOOK_SOCKET_UNIT" "$HOOK_SERVER_UNIT"; do
	systemd-analyze verify "$u" || fail "systemd-analyze verify $u"
done
ok "systemd-analyze verify passes for the three units"
if systemd-analyze security --help 2>&1 | grep -q -- '--offline'; then
	# Exposure is 0.0 (locked down) to 10.0 (unprotected); the unit scores
	# about 3.5 and must not regress past "MEDIUM".
	systemd-analyze security --offline=yes --threshold=50 "$UNIT" >"$work/security.log" 2>&1 || {
		cat "$work/security.log" >&2
		fail "systemd-analyze security: exposure above 5.0"
	}
	ok "$(grep -o 'Overall exposure level.*' "$work/security.log")"
fi

# --- Reinstall over an installed package: an upgrade, no first-install text -
dpkg -i "$deb" </dev/null >"$work/reinstall.log" 2>&1 || {
	cat "$work/reinstall.log" >&2
	fail "dpkg -i over the installed package"
}
if grep -q 'Next step' "$work/reinstall.log"; then
	fail "postinst printed the first-install text on an upgrade"
fi
ok "reinstall is quiet"

# --- The hook socket across upgrades ------------------------------------------
if command -v systemctl >/dev/null; then
	# The operator's disable and mask stand through an upgrade.
	systemctl disable nri-gpu-guard-hook.socket >/dev/null 2>&1 || fail "systemctl disable nri-gpu-guard-hook.socket"
	dpkg -i "$deb" </dev/null >"$work/upgrade-socket.log" 2>&1 || fail "dpkg -i (upgrade, socket disabled)"
	[[ $(hook_socket_state) == disabled ]] || fail "an upgrade re-enabled the hook socket the operator disabled: $(hook_socket_state)"
	systemctl mask nri-gpu-guard-hook.socket >/dev/null 2>&1 || fail "systemctl mask nri-gpu-guard-hook.socket"
	dpkg -i "$deb" </dev/null >"$work/upgrade-socket.log" 2>&1 || fail "dpkg -i (upgrade, socket masked)"
	[[ $(hook_socket_state) == masked* ]] || fail "an upgrade unmasked the hook socket: $(hook_socket_state)"
	! grep -q 'could not enable' "$work/upgrade-socket.log" || fail "an upgrade asked to enable the masked hook socket"
	systemctl unmask nri-gpu-guard-hook.socket >/dev/null 2>&1 || fail "systemctl unmask nri-gpu-guard-hook.socket"
	ok "an upgrade keeps the hook socket disabled or masked as the operator left it"
	# An upgrade from a version without the hook server: no record that
	# the package enabled the socket, and the socket not enabled.
	rm -f "$STATE_DIR/package-hook-socket-enabled"
	dpkg -i "$deb" </dev/null >"$work/upgrade-socket.log" 2>&1 || fail "dpkg -i (upgrade from a version without the hook server)"
	[[ $(hook_socket_state) == enabled ]] || fail "an upgrade from a version without the hook server did not enable its socket: $(hook_socket_state)"
	ok "an upgrade from a version without the hook server enables its socket"
fi

# --- An upgrade over a configuration this version refuses -------------------
# The running guard must not be restarted into a crash loop (containerd would
# refuse every container); postinst says why and what to do.
cp "$CONFIG" "$work/good.toml"
sed -i 's/^\[policy\]$/[policy]\nno_such_key = 1/' "$CONFIG"
grep -q '^no_such_key = 1$' "$CONFIG" || fail "could not edit $CONFIG"
dpkg -i "$deb" </dev/null >"$work/upgrade-bad-config.log" 2>&1 || {
	cat "$work/upgrade-bad-config.log" >&2
	fail "dpkg -i over the installed package with a refused config"
}
grep -q 'guard was NOT restarted' "$work/upgrade-bad-config.log" || fail "an upgrade over a refused config did not say the guard was not restarted: $(cat "$work/upgrade-bad-config.log")"
grep -q 'no_such_key' "$work/upgrade-bad-config.log" || fail "an upgrade over a refused config did not name what is wrong: $(cat "$work/upgrade-bad-config.log")"
cp "$work/good.toml" "$CONFIG"
ok "an upgrade over a refused config keeps the running guard and says why"

# --- A locally edited config survives remove + install ----------------------
# With systemd running, an enabled service is enabled again by the reinstall
# that follows `dpkg -r` (a configure with the old version, not a first
# install), since the drop-in stays and containerd would refuse everything.
systemd_up=no
if [[ -d /run/systemd/system ]]; then
	systemd_up=yes
	systemctl enable nri-gpu-guard >/dev/null 2>&1 || fail "systemctl enable nri-gpu-guard"
fi
sed -i 's/^on_conflict = "queue"$/on_conflict = "reject"/' "$CONFIG"
grep -q '^on_conflict = "reject"$' "$CONFIG" || fail "could not edit $CONFIG"
cp "$CONFIG" "$work/edited.toml"
dpkg -r "$PKG" </dev/null >"$work/remove.log" 2>&1 || {
	cat "$work/remove.log" >&2
	fail "dpkg -r"
}
for b in nri-gpu-guard nri-gpu-guard-hook nri-gpu-guard-hook-relay; do
	[[ ! -e /usr/bin/$b ]] || fail "dpkg -r left /usr/bin/$b"
done
[[ ! -L $HOOK_SOCKET_LINK ]] || fail "dpkg -r left the hook socket enabled ($HOOK_SOCKET_LINK)"
cmp -s "$work/edited.toml" "$CONFIG" || fail "dpkg -r did not keep the edited $CONFIG"
grep -q "$DROP_IN is still in place" "$work/remove.log" || fail "dpkg -r did not warn that the drop-in stays"
ok "dpkg -r keeps the edited config and warns about the drop-in"
dpkg -i "$deb" </dev/null >"$work/install2.log" 2>&1 || {
	cat "$work/install2.log" >&2
	fail "dpkg -i after dpkg -r"
}
cmp -s "$work/edited.toml" "$CONFIG" || fail "dpkg -i after dpkg -r replaced the edited $CONFIG"
/usr/bin/gpu-guard-ctl check-config >/dev/null 2>&1 || fail "check-config rejects the edited config"
ok "dpkg -r then dpkg -i keeps the locally edited config"
cmp -s packaging/containerd/nri-gpu-guard.toml "$DROP_IN" || fail "dpkg -r then dpkg -i lost or changed $DROP_IN"
if command -v systemctl >/dev/null; then
	[[ $(hook_socket_state) == enabled ]] || fail "dpkg -r then dpkg -i left the hook socket it had enabled disabled: $(hook_socket_state)"
	ok "dpkg -r then dpkg -i enables the hook socket again"
fi
if [[ $systemd_up == yes ]]; then
	systemctl is-enabled --quiet nri-gpu-guard || fail "dpkg -r then dpkg -i left the previously enabled service disabled: $(cat "$work/install2.log")"
	grep -q 're-enabled and started' "$work/install2.log" || fail "postinst did not say it re-enabled the service"
	systemctl disable --now nri-gpu-guard >/dev/null 2>&1 || true
	ok "dpkg -r then dpkg -i enables the previously enabled service again"
	# Disabled by hand with the drop-in in place: an upgrade warns.
	dpkg -i "$deb" </dev/null >"$work/upgrade-disabled.log" 2>&1 || fail "dpkg -i (upgrade, service disabled)"
	grep -q 'is not enabled' "$work/upgrade-disabled.log" || fail "upgrade with the drop-in and a disabled service did not warn"
	ok "an upgrade warns that the service is disabled while the drop-in is in place"
fi

# --- Purge ------------------------------------------------------------------
# The default ledger's per-boot marker, as the guard leaves it once it
# committed in this boot (the name is a hash of the state dir).
MARKER=/run/nri-gpu-guard/ledger-$(printf %s "$STATE_DIR" | sha256sum | cut -c1-24).marker
[[ -e $MARKER ]] || { mkdir -p /run/nri-gpu-guard && chmod 0700 /run/nri-gpu-guard && : >"$MARKER"; }
# And an OCI hook container marker, as create-runtime leaves one.
HOOK_MARKERS=/run/nri-gpu-guard/hook-containers
[[ -d $HOOK_MARKERS ]] || { mkdir -p "$HOOK_MARKERS" && chmod 0700 "$HOOK_MARKERS"; }
: >"$HOOK_MARKERS/c-package-test"
dpkg --purge "$PKG" </dev/null >/dev/null 2>&1 || fail "dpkg --purge"
[[ ! -e $MARKER ]] || fail "purge left the ledger's boot marker $MARKER (a reinstall in this boot would refuse every GPU container)"
[[ ! -e $HOOK_MARKERS ]] || fail "purge left the hook's container markers in $HOOK_MARKERS"
for p in "$CONFIG" /etc/nri-gpu-guard "$DROP_IN" "$DROP_IN_EXAMPLE" "$UNIT" "$HOOK_SOCKET_UNIT" "$HOOK_SERVER_UNIT" /usr/bin/nri-gpu-guard /usr/bin/nri-gpu-guard-hook /usr/bin/nri-gpu-guard-hook-relay "$STATE_DIR"; do
	[[ ! -e $p ]] || fail "purge left $p"
done
for f in packaging/oci-hooks.d/*.json; do
	[[ ! -e $HOOKS_DIR/$(basename "$f") ]] || fail "purge left $HOOKS_DIR/$(basename "$f")"
done
[[ ! -e $HOOK_SOCKET_LINK && ! -L $HOOK_SOCKET_LINK ]] || fail "purge left $HOOK_SOCKET_LINK"
ok "dpkg --purge removes everything"

# --- The drop-in on other hosts ---------------------------------------------
# containerd 1.7 (config version 2; it would not start with the drop-in): not installed.
PATH=$old_containerd:$PATH dpkg -i "$deb" </dev/null >"$work/install-old.log" 2>&1 || fail "dpkg -i with containerd 1.7"
[[ ! -e $DROP_IN ]] || fail "postinst installed $DROP_IN for containerd 1.7"
grep -q 'older than 2.2: NOT installing' "$work/install-old.log" || fail "postinst did not say why it skipped the drop-in: $(cat "$work/install-old.log")"
dpkg --purge "$PKG" </dev/null >/dev/null 2>&1 || fail "dpkg --purge"
ok "containerd 1.7: the drop-in is not installed, and postinst says why"
# An operator's own file: kept as it is.
mkdir -p "$(dirname "$DROP_IN")"
printf '# operator file\nversion = 3\n' >"$DROP_IN"
cp "$DROP_IN" "$work/operator-drop-in.toml"
PATH=$new_containerd:$PATH dpkg -i "$deb" </dev/null >"$work/install-kept.log" 2>&1 || fail "dpkg -i over an operator's drop-in"
cmp -s "$work/operator-drop-in.toml" "$DROP_IN" || fail "postinst overwrote the operator's $DROP_IN"
grep -q "kept the existing $DROP_IN" "$work/install-kept.log" || fail "postinst did not say it kept the operator's drop-in"
dpkg --purge "$PKG" </dev/null >/dev/null 2>&1 || fail "dpkg --purge"
[[ ! -e $DROP_IN ]] || fail "purge left $DROP_IN"
ok "an operator's drop-in is kept on install (purge removes it)"

printf '%d passed, 0 failed\n' "$checks"
