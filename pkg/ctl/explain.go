// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"strconv"
	"strings"

	specs "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// maxSpecBytes bounds --spec: OCI specs are tens of KiB.
const maxSpecBytes = 4 << 20

// nvidiaMajor is the character-device major of /dev/nvidia<N>.
const nvidiaMajor = 195

// explainContainerID identifies the hypothetical container in the decision
// (and so in its requester key when no pod is named).
const explainContainerID = "gpu-guard-ctl-explain"

// explainFlags is what explain is told about the hypothetical container.
type explainFlags struct {
	env, annotations, deviceNodes, mounts, cdi []string
	privileged, noDeviceCgroup                 bool
	specPath                                   string
	namespace, pod, podUID, container          string
}

func (a *app) explainCommand() *cobra.Command {
	var f explainFlags
	cmd := newCommand("explain",
		"Show which GPUs a container would reach and the decision it would get now",
		`Describe a container with flags (or an OCI config.json with --spec, which the
flags add to) and show every GPU it would reach, from which source (env
variable, annotation, CDI name, mount, device node, privileged, all), and the
decision the guard would make if it were created now: admit, queue (with its
position) or reject, with the exact message the container would be refused with.

Nothing is written: no claim, no queue entry, no audit record.

--device takes /dev/nvidia<N> (the minor, not the index) or
/dev/nvidia-caps/nvidia-cap<N>. --namespace/--pod/--pod-uid/--container name
the pod: exempt namespaces are honoured, and a request that is already queued
is shown at its own position.

--no-device-cgroup reads the --spec container as the OCI hook reads one that
a rootful runtime runs without a device cgroup (podman --cgroups=disabled,
crun --cgroup-manager=disabled): its bind sources as this host has them, and
every GPU when it binds the host's /dev (or mounts a devtmpfs, or an overlay
with it as a layer) or holds CAP_MKNOD or CAP_SYS_ADMIN outside a user
namespace of its own.

Exits 0 whatever the decision; 1 when the decision could not be made.`,
		`  gpu-guard-ctl explain --env NVIDIA_VISIBLE_DEVICES=1
  gpu-guard-ctl explain --annotation cdi.k8s.io/gpu=nvidia.com/gpu=0 --device /dev/nvidia3
  gpu-guard-ctl explain --spec /run/containerd/io.containerd.runtime.v2.task/k8s.io/<id>/config.json -o json`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			req, owner, err := explainRequest(f)
			if err != nil {
				return err
			}
			inv, _, err := a.inventory()
			if err != nil {
				return err
			}
			cfg, err := a.config()
			if err != nil {
				return err
			}
			l, err := a.openLedger(true)
			if err != nil {
				return err
			}
			// The ledger is read first, as status reads it: one that
			// cannot be read (needs recovery, not root) is the error, in
			// the ledger's own words, once. Asked to decide on it, the
			// guard words it as the refusal of a container, which
			// explain's is not.
			if err := l.View(cmd.Context(), func(*ledger.Tx) error { return nil }); err != nil {
				return fmt.Errorf("read ledger %s: %w", l.StatePath(), err)
			}
			// A mistyped [ledger] dir reads as an empty ledger: every GPU
			// would be admitted as free.
			if err := a.checkLedgerDir(); err != nil {
				return err
			}
			g, err := guard.New(guard.Options{
				Config: cfg, Inventory: inv, Ledger: l, Liveness: a.env.Liveness, Now: a.env.Now,
			})
			if err != nil {
				return fmt.Errorf("explain: %w", err)
			}
			d, err := g.Explain(cmd.Context(), guard.Request{FrontEnd: ledger.FrontEndCtl, Owner: owner, Spec: req})
			if err != nil {
				return fmt.Errorf("explain: %w", err)
			}
			// The decision lists devices only when it got as far as
			// resolving them (not for an exempt namespace); the resolution
			// also carries the notes (ignored ids, "none", "void").
			// A resolution error is already the decision's message.
			res, _ := g.Resolve(req)
			return renderExplain(a.env.Stdout, a.output, newExplainView(d, res))
		})
	fl := cmd.Flags()
	// StringArray, not StringSlice: values such as NVIDIA_VISIBLE_DEVICES=0,1
	// contain commas and must stay one value.
	fl.StringArrayVar(&f.env, "env", nil, "environment variable KEY=VALUE (repeatable)")
	fl.StringArrayVar(&f.annotations, "annotation", nil, "annotation KEY=VALUE, e.g. cdi.k8s.io/gpu=nvidia.com/gpu=0 (repeatable)")
	fl.StringArrayVar(&f.deviceNodes, "device", nil, "device node /dev/nvidiaN or /dev/nvidia-caps/nvidia-capN (repeatable)")
	fl.StringArrayVar(&f.mounts, "mount", nil, "mount destination, e.g. /var/run/nvidia-container-devices/0 (repeatable)")
	fl.StringArrayVar(&f.cdi, "cdi", nil, "CDI device name, e.g. nvidia.com/gpu=0 (repeatable)")
	fl.BoolVar(&f.privileged, "privileged", false, "the container is privileged")
	fl.BoolVar(&f.noDeviceCgroup, "no-device-cgroup", false, "the --spec container runs without a device cgroup (read as the OCI hook reads it then)")
	fl.StringVar(&f.specPath, "spec", "", "OCI runtime spec (config.json) to start from")
	fl.StringVar(&f.namespace, "namespace", "", "pod namespace")
	fl.StringVar(&f.pod, "pod", "", "pod name")
	fl.StringVar(&f.podUID, "pod-uid", "", "pod UID")
	fl.StringVar(&f.container, "container", "", "container name")
	return cmd
}

// explainRequest builds the request from --spec and the flags.
func explainRequest(f explainFlags) (devices.Request, ledger.Owner, error) {
	var req devices.Request
	if f.specPath != "" {
		spec, err := readSpec(f.specPath)
		if err != nil {
			return req, ledger.Owner{}, err
		}
		req = devices.RequestFromSpec(spec)
		if f.noDeviceCgroup {
			hook.UnfencedRequest(&req, spec, filepath.Dir(f.specPath))
		}
	} else if f.noDeviceCgroup {
		return req, ledger.Owner{}, usagef("--no-device-cgroup reads the container of --spec: give --spec")
	}
	for _, e := range f.env {
		if !strings.Contains(e, "=") {
			return req, ledger.Owner{}, usagef("--env %q: want KEY=VALUE", e)
		}
		req.Env = append(req.Env, e)
	}
	if len(f.annotations) > 0 {
		merged := make(map[string]string, len(req.Annotations)+len(f.annotations))
		for k, v := range req.Annotations {
			merged[k] = v
		}
		for _, kv := range f.annotations {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return req, ledger.Owner{}, usagef("--annotation %q: want KEY=VALUE", kv)
			}
			merged[k] = v
		}
		req.Annotations = merged
	}
	for _, p := range f.deviceNodes {
		d, err := deviceNode(p)
		if err != nil {
			return req, ledger.Owner{}, err
		}
		req.Devices = append(req.Devices, d)
	}
	req.Mounts = append(req.Mounts, f.mounts...)
	req.CDIDevices = append(req.CDIDevices, f.cdi...)
	req.Privileged = req.Privileged || f.privileged
	// --privileged stands for an engine's privileged container, whose device
	// cgroup allows everything.
	req.AllDevicesAllowed = req.AllDevicesAllowed || f.privileged
	owner := ledger.Owner{
		ContainerID: explainContainerID, Namespace: f.namespace, Pod: f.pod, PodUID: f.podUID,
		Container: f.container, FrontEnd: ledger.FrontEndCtl,
	}
	return req, owner, nil
}

// deviceNode turns a device path into the spec entry a runtime would add.
// A capability node is given by path only: the resolver knows the
// nvidia-caps major from the inventory, and maps the node by path when the
// major is unknown.
func deviceNode(p string) (devices.LinuxDevice, error) {
	const gpuPrefix, capPrefix = "/dev/nvidia", "/dev/nvidia-caps/nvidia-cap"
	switch {
	case strings.HasPrefix(p, capPrefix):
		minor, err := strconv.ParseInt(strings.TrimPrefix(p, capPrefix), 10, 64)
		if err != nil || minor < 0 {
			break
		}
		return devices.LinuxDevice{Path: p, Type: "c", Minor: minor}, nil
	case strings.HasPrefix(p, gpuPrefix):
		minor, err := strconv.ParseInt(strings.TrimPrefix(p, gpuPrefix), 10, 64)
		if err != nil || minor < 0 || minor > 255 {
			break
		}
		return devices.LinuxDevice{Path: p, Type: "c", Major: nvidiaMajor, Minor: minor}, nil
	}
	return devices.LinuxDevice{}, usagef("--device %q: want /dev/nvidia<N> or /dev/nvidia-caps/nvidia-cap<N>", p)
}

// readSpec loads an OCI runtime spec, bounded in size. Only a regular file
// is read: a FIFO would block the open, a device would never end.
func readSpec(path string) (*specs.Spec, error) {
	f, err := config.OpenRegular(path)
	if err != nil {
		return nil, fmt.Errorf("--spec: %w", err)
	}
	defer func() { _ = f.Close() }() // read-only: a close error loses nothing
	data, err := io.ReadAll(io.LimitReader(f, maxSpecBytes+1))
	if err != nil {
		return nil, fmt.Errorf("--spec: read %s: %w", path, err)
	}
	if len(data) > maxSpecBytes {
		return nil, fmt.Errorf("--spec: %s is larger than %d bytes; is it an OCI config.json?", path, maxSpecBytes)
	}
	// A spec the runtimes read in two ways is refused by the hook; explain
	// says so rather than show one reading.
	if err := hook.CheckSpecKeys(data); err != nil {
		return nil, fmt.Errorf("--spec: %s: %w", path, err)
	}
	var spec specs.Spec
	if err := json.Unmarshal(data, &spec); err != nil {
		return nil, fmt.Errorf("--spec: %s is not an OCI runtime spec: %w", path, err)
	}
	return &spec, nil
}

// explainView is the explain output; its JSON is a public interface.
// Privileged says the request was resolved under policy.privileged
// (devices.Resolution): the container is privileged, or it can open every
// GPU node (a device cgroup rule such as c 195:*, or, with
// --no-device-cgroup, the host's /dev bound in, CAP_MKNOD or CAP_SYS_ADMIN).
type explainView struct {
	Devices     []explainDevice `json:"devices"`
	All         bool            `json:"all"`
	Privileged  bool            `json:"privileged"`
	Notes       []string        `json:"notes"`
	Decision    guard.Result    `json:"decision"`
	Reason      string          `json:"reason"`
	Message     string          `json:"message"`
	Position    int             `json:"position,omitempty"`
	QueueLength int             `json:"queue_length,omitempty"`
}

type explainDevice struct {
	UUID    string   `json:"uuid"`
	Index   string   `json:"index"`
	Kind    string   `json:"kind"`
	Sources []string `json:"sources"`
}

func newExplainView(d guard.Decision, res devices.Resolution) explainView {
	v := explainView{
		Devices: []explainDevice{}, Notes: []string{}, Decision: d.Result, Reason: d.Reason, Message: d.Message,
		Position: d.Position, QueueLength: d.QueueLength,
	}
	resolved := res.Devices
	if len(resolved) == 0 {
		resolved = d.Devices
	}
	v.All, v.Privileged = res.All, res.Privileged
	v.Notes = append(v.Notes, res.Notes...)
	for _, r := range resolved {
		v.Devices = append(v.Devices, explainDevice{UUID: r.UUID, Index: r.Index, Kind: string(r.Kind), Sources: r.Sources})
	}
	return v
}

func renderExplain(w io.Writer, output string, v explainView) error {
	if output == outputJSON {
		return writeJSON(w, v)
	}
	var b strings.Builder
	if len(v.Devices) == 0 {
		b.WriteString("reaches no GPU\n")
	} else {
		t := newTable(&b, "INDEX", "UUID", "SOURCES")
		for _, d := range v.Devices {
			u := d.UUID
			if output != outputWide {
				u = shortUUID(u)
			}
			t.row(d.Index, u, strings.Join(d.Sources, "; "))
		}
		if err := t.flush(); err != nil {
			return err
		}
	}
	for _, n := range v.Notes {
		fmt.Fprintf(&b, "note: %s\n", escapeLine(n))
	}
	fmt.Fprintf(&b, "\ndecision: %s (%s)\n", v.Decision, escapeLine(v.Reason))
	if v.Message != "" {
		fmt.Fprintf(&b, "%s\n", escapeLine(v.Message))
	}
	if _, err := io.WriteString(w, b.String()); err != nil {
		return fmt.Errorf("write output: %w", err)
	}
	return nil
}
