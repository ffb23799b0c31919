#!/usr/bin/env bash
# `make demo`: two pods fight over one GPU on a throwaway containerd, with
# nri-gpu-guard deciding. Needs root, `make build` and
# test/integration/setup.sh (make demo runs both). Everything lives in one
# temp dir and is torn down on exit, also after a failure or ^C.
#
# The host needs no GPU: the guard gets a static 4-GPU inventory and the
# pods name GPUs through NVIDIA_VISIBLE_DEVICES and a CDI annotation (backed
# by fake /dev/nvidiaN nodes).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${NRI_GPU_GUARD_CACHE:-$HOME/.cache/nri-gpu-guard}
TOOLS=${TOOLS_DIR:-$CACHE/tools}
IMAGE=$CACHE/images/gpu-guard-test.tar
GUARD=$ROOT/bin/nri-gpu-guard
CTL=$ROOT/bin/gpu-guard-ctl
WORKLOAD=localhost/gpu-guard-test/sleeper:1

die() { printf 'demo: error: %s\n' "$*" >&2; exit 1; }
[[ $(id -u) -eq 0 ]] || die "run as root (it starts a containerd): sudo make demo"
for f in "$TOOLS/containerd" "$TOOLS/crictl" "$TOOLS/ctr" "$IMAGE"; do
	[[ -e $f ]] || die "$f is missing: run test/integration/setup.sh (make demo does)"
done
for f in "$GUARD" "$CTL"; do
	[[ -x $f ]] || die "$f is missing: run make build"
done

# A short dir: containerd's and NRI's sockets live in it.
D=$(mktemp -d /tmp/ggd-XXXXXX)
CONTAINERD_PID=
GUARD_PID=
export PATH=$TOOLS:$PATH

# processes_under DIR: pids whose binary or arguments lie in DIR (shims,
# the guard, containerd) — processes this demo started.
processes_under() {
	local p pid
	for p in /proc/[0-9]*; do
		pid=${p#/proc/}
		[[ $pid == "$$" ]] && continue
		if [[ $(readlink "$p/exe" 2>/dev/null) == "$1"/* ]] ||
			tr '\0' '\n' 2>/dev/null <"$p/cmdline" | grep -qF "$1/"; then
			echo "$pid"
		fi
	done
}

# task_ids: containers whose runtime state is still in the demo's containerd
# state dir (left running if containerd could not remove them).
task_ids() { ls "$D/state-containerd/io.containerd.runtime.v2.task/k8s.io" 2>/dev/null || true; }
# task_pids ID: processes in that container's cgroup.
task_pids() { grep -l ":/k8s.io/$1\$" /proc/[0-9]*/cgroup 2>/dev/null | cut -d/ -f3; }

stop_pid() { # stop_pid PID: SIGTERM, then SIGKILL after 10s
	local pid=$1 i
	[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for ((i = 0; i < 100; i++)); do
		kill -0 "$pid" 2>/dev/null || return 0
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
	local rc=$? pids
	trap - EXIT INT TERM
	# Tear down as much as possible: no step's failure may stop the rest.
	set +e +o pipefail
	echo
	if ((rc != 0)); then
		echo "demo: failed (exit $rc). Last lines of the logs:"
		tail -n 5 "$D/guard.log" "$D/containerd.log" 2>/dev/null | cut -c1-200 || true
	fi
	if [[ -n $CONTAINERD_PID ]] && kill -0 "$CONTAINERD_PID" 2>/dev/null; then
		cri rmp --force --all >/dev/null 2>&1 || true
	fi
	stop_pid "$GUARD_PID"
	stop_pid "$CONTAINERD_PID"
	pids=$(processes_under "$D"; for id in $(task_ids); do task_pids "$id"; done)
	# shellcheck disable=SC2086 # a list of pids
	[[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
	for id in $(task_ids); do
		rm -rf "/run/containerd/runc/k8s.io/$id"
		rmdir /sys/fs/cgroup/*/k8s.io/"$id" /sys/fs/cgroup/k8s.io/"$id" 2>/dev/null
	done
	grep -oE " $D/[^ ]+" /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
	rm -rf "$D"
	# The ledger's per-boot marker (named after a hash of its state dir):
	# the state dir is gone, so is the memory of it.
	rm -f "/run/nri-gpu-guard/ledger-$(printf %s "$D/state" | sha256sum | cut -c1-24).marker"
	echo "demo: torn down (containerd, guard, pods and $D removed)"
	exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# crictl, without its warning that pods here have no cgroup parent.
cri() { crictl --config "$D/crictl.yaml" "$@" 2> >(grep -v 'cgroup_parent is not set' >&2); }
ctl() { "$CTL" --config "$D/guard.toml" --state-dir "$D/state" "$@"; }
say() { printf '\n== %s\n' "$*"; }
indent() { fold -s -w 96 | sed 's/^/     /'; }

# wait_until DESCRIPTION COMMAND...: poll (10/s, 60s at most) until COMMAND succeeds.
wait_until() {
	local what=$1 i
	shift
	for ((i = 0; i < 600; i++)); do
		if "$@" >/dev/null 2>&1; then return 0; fi
		sleep 0.1
	done
	die "timed out waiting for $what"
}

# --- a throwaway containerd with four fake GPUs ------------------------------
mkdir -p "$D/cdi" "$D/dev" "$D/logs" "$D/nri-plugins" "$D/nri-conf.d" "$D/cfg"
uuid() { printf 'GPU-de30%04d-5e1f-4c2a-8b7d-0000000000%02d' "$1" "$1"; }
cdi_devices=
for i in 0 1 2 3; do
	mknod "$D/dev/nvidia$i" c 195 "$i"
	cdi_devices+="${cdi_devices:+,}{\"name\":\"$i\",\"containerEdits\":{\"deviceNodes\":[{\"path\":\"/dev/nvidia$i\",\"hostPath\":\"$D/dev/nvidia$i\"}]}}"
done
echo "{\"cdiVersion\":\"0.6.0\",\"kind\":\"nvidia.com/gpu\",\"devices\":[$cdi_devices]}" >"$D/cdi/nvidia.json"

cat >"$D/containerd.toml" <<EOF
version = 3
root = "$D/root"
state = "$D/state-containerd"
[grpc]
  address = "$D/containerd.sock"
[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = "$D/nri.sock"
  plugin_path = "$D/nri-plugins"
  plugin_config_path = "$D/nri-conf.d"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "registry.k8s.io/pause:3.10"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["$D/cdi"]
EOF
printf 'runtime-endpoint: unix://%s\nimage-endpoint: unix://%s\ntimeout: 60\n' "$D/containerd.sock" "$D/containerd.sock" >"$D/crictl.yaml"

{
	# proc_root: no driver tree there, so the demo's fake GPUs are not
	# compared with a real driver's on a GPU host.
	printf 'version = 1\n[ledger]\ndir = "%s"\n[devices]\nsource = "static"\nproc_root = "%s"\n' "$D/state" "$D/no-driver"
	for i in 0 1 2 3; do
		printf '[[devices.static]]\nindex = %d\nuuid = "%s"\nminor = %d\nmodel = "Demo GPU"\n' "$i" "$(uuid "$i")" "$i"
	done
	printf '[nri]\nsocket = "%s"\n' "$D/nri.sock"
} >"$D/guard.toml"

say "Starting a throwaway containerd ($("$TOOLS/containerd" --version | awk '{print $3}')) in $D"
containerd --config "$D/containerd.toml" >"$D/containerd.log" 2>&1 &
CONTAINERD_PID=$!
wait_until "containerd" cri info
ctr --address "$D/containerd.sock" --namespace k8s.io images import "$IMAGE" >/dev/null 2>&1

say "Starting nri-gpu-guard (external NRI plugin, static inventory of 4 GPUs)"
"$GUARD" --config "$D/guard.toml" >"$D/guard.log" 2>&1 &
GUARD_PID=$!
wait_until "the guard to register with containerd" grep -q 'plugin \\"90-gpu-guard\\" connected and synchronized' "$D/containerd.log"
echo "   registered with containerd as 90-gpu-guard (pid $GUARD_PID)"

# run_pod NAME: start a host-network pod, print its id.
run_pod() {
	cat >"$D/cfg/pod-$1.json" <<EOF
{"metadata":{"name":"$1","namespace":"ml-team","uid":"uid-$1","attempt":0},
 "linux":{"security_context":{"namespace_options":{"network":2}}},"log_directory":"$D/logs/$1"}
EOF
	cri runp "$D/cfg/pod-$1.json"
}
# create POD_NAME POD_ID JSON_FRAGMENT: create container "trainer" with the
# given request; prints the container id, or the guard's refusal and fails.
create() {
	local out
	cat >"$D/cfg/ctr-$1.json" <<EOF
{"metadata":{"name":"trainer"},"image":{"image":"$WORKLOAD"},"log_path":"trainer.log",$3}
EOF
	if out=$(cri create "$2" "$D/cfg/ctr-$1.json" "$D/cfg/pod-$1.json" 2>"$D/create.err"); then
		echo "$out"
		return 0
	fi
	echo "   REFUSED. What crictl (and the kubelet) got back:"
	grep 'level=fatal' "$D/create.err" | sed 's/.*desc = //; s/"$//; s/\\"/"/g' | indent
	return 1
}
held_by() { ctl claims -o json | grep -q "\"container_id\": *\"$1\""; }
released() { ! held_by "$1"; }

say "Pod ml-team/train-a asks for GPU 1 by UUID (NVIDIA_VISIBLE_DEVICES=$(uuid 1))"
A=$(run_pod train-a)
A_CTR=$(create train-a "$A" "\"envs\":[{\"key\":\"NVIDIA_VISIBLE_DEVICES\",\"value\":\"$(uuid 1)\"}]")
cri start "$A_CTR" >/dev/null
echo "   ADMITTED: container ${A_CTR:0:12} now holds GPU 1"

say "Pod ml-team/train-b asks for GPU 1 by index (NVIDIA_VISIBLE_DEVICES=1)"
B=$(run_pod train-b)
create train-b "$B" '"envs":[{"key":"NVIDIA_VISIBLE_DEVICES","value":"1"}]' && die "train-b was admitted"

say "Pod ml-team/infer-c asks for GPU 1 through CDI (cdi.k8s.io/gpu: nvidia.com/gpu=1)"
C=$(run_pod infer-c)
create infer-c "$C" '"annotations":{"cdi.k8s.io/gpu":"nvidia.com/gpu=1"}' && die "infer-c was admitted"

say "The queue (gpu-guard-ctl queue)"
ctl queue | cut -c1-110 | sed 's/^/   /'

say "train-a finishes: crictl stop ${A_CTR:0:12}"
cri stop --timeout 10 "$A_CTR" >/dev/null
wait_until "the guard to release GPU 1" released "$A_CTR"
ctl queue -o json | tr -d ' \n' | grep -q "\"requester\":\"ml-team/uid-train-b/trainer\"[^}]*\"reserved\":\[\"$(uuid 1)\"" ||
	die "GPU 1 is not reserved for train-b"
echo "   released; GPU 1 is now reserved for the head of the queue, train-b"

say "infer-c retries first (later in the queue)"
create infer-c "$C" '"annotations":{"cdi.k8s.io/gpu":"nvidia.com/gpu=1"}' && die "infer-c jumped the queue"

say "train-b retries (as the kubelet does after its back-off)"
B_CTR=$(create train-b "$B" '"envs":[{"key":"NVIDIA_VISIBLE_DEVICES","value":"1"}]')
cri start "$B_CTR" >/dev/null
echo "   ADMITTED: container ${B_CTR:0:12} now holds GPU 1"

say "What the operator sees (gpu-guard-ctl status)"
ctl status | sed 's/^/   /'
