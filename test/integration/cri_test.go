// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

//go:build integration

package integration

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// Namespace modes of the CRI API (runtime.v1.NamespaceMode).
const (
	namespacePod  = 0
	namespaceNode = 2
)

// PodSpec describes a pod sandbox. Pods always use the host network: the
// test hosts have no CNI plugin.
type PodSpec struct {
	Name string
	// Namespace defaults to "default", UID to "uid-<Name>".
	Namespace string
	UID       string
	// Attempt is the sandbox attempt number.
	Attempt     int
	Annotations map[string]string
	Labels      map[string]string
	// HostPID shares the host's pid namespace.
	HostPID bool
	// Privileged allows privileged containers in the pod.
	Privileged bool
}

// EnvVar is one environment entry; a container's entries keep their order
// (the runtime gives the last occurrence of a key precedence).
type EnvVar struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// DeviceMapping is a CRI device: a host device node made visible in the
// container.
type DeviceMapping struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

// Mount is a CRI bind mount.
type Mount struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Readonly      bool   `json:"readonly,omitempty"`
}

// ContainerSpec describes a container to create in a pod.
type ContainerSpec struct {
	Name string
	// Image defaults to WorkloadImage.
	Image       string
	Command     []string
	Args        []string
	Env         []EnvVar
	Annotations map[string]string
	Devices     []DeviceMapping
	Mounts      []Mount
	Privileged  bool
}

// GPUEnv is the NVIDIA_VISIBLE_DEVICES entry naming value.
func GPUEnv(value string) []EnvVar {
	return []EnvVar{{Key: "NVIDIA_VISIBLE_DEVICES", Value: value}}
}

// Pod is a running pod sandbox.
type Pod struct {
	c *Containerd
	// ID is the sandbox id.
	ID   string
	Spec PodSpec
	// configPath is the sandbox config, which crictl create needs again.
	configPath string
}

// Owner is how the guard names a container of this pod in messages and in
// the ledger: "namespace/pod/container".
func (p *Pod) Owner(container string) string {
	return p.Spec.Namespace + "/" + p.Spec.Name + "/" + container
}

type podConfigJSON struct {
	Metadata struct {
		Name      string `json:"name"`
		Namespace string `json:"namespace"`
		UID       string `json:"uid"`
		Attempt   int    `json:"attempt"`
	} `json:"metadata"`
	LogDirectory string            `json:"log_directory"`
	Annotations  map[string]string `json:"annotations,omitempty"`
	Labels       map[string]string `json:"labels,omitempty"`
	Linux        struct {
		SecurityContext struct {
			NamespaceOptions struct {
				Network int `json:"network"`
				Pid     int `json:"pid"`
			} `json:"namespace_options"`
			Privileged bool `json:"privileged,omitempty"`
		} `json:"security_context"`
	} `json:"linux"`
}

// RunPod starts a pod sandbox (crictl runp).
func (c *Containerd) RunPod(t testing.TB, spec PodSpec) *Pod {
	t.Helper()
	p, err := c.TryRunPod(spec)
	if err != nil {
		t.Fatalf("run pod %s: %v", spec.Name, err)
	}
	return p
}

// TryRunPod is RunPod returning the error.
func (c *Containerd) TryRunPod(spec PodSpec) (*Pod, error) {
	if spec.Namespace == "" {
		spec.Namespace = "default"
	}
	if spec.UID == "" {
		spec.UID = "uid-" + spec.Name
	}
	var cfg podConfigJSON
	cfg.Metadata.Name, cfg.Metadata.Namespace, cfg.Metadata.UID, cfg.Metadata.Attempt = spec.Name, spec.Namespace, spec.UID, spec.Attempt
	cfg.LogDirectory = filepath.Join(c.PodLogDir, spec.Namespace+"_"+spec.Name+"_"+spec.UID)
	cfg.Annotations, cfg.Labels = spec.Annotations, spec.Labels
	cfg.Linux.SecurityContext.NamespaceOptions.Network = namespaceNode
	cfg.Linux.SecurityContext.NamespaceOptions.Pid = namespacePod
	if spec.HostPID {
		cfg.Linux.SecurityContext.NamespaceOptions.Pid = namespaceNode
	}
	cfg.Linux.SecurityContext.Privileged = spec.Privileged
	path, err := c.writeJSON("pod-"+spec.Name+".json", cfg)
	if err != nil {
		return nil, err
	}
	out, err := c.Crictl("runp", path)
	if err != nil {
		return nil, err
	}
	return &Pod{c: c, ID: strings.TrimSpace(out), Spec: spec, configPath: path}, nil
}

func (c *Containerd) writeJSON(name string, v any) (string, error) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return "", err
	}
	path := c.uniqueFile(name)
	return path, os.WriteFile(path, b, 0o600)
}

type containerConfigJSON struct {
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Image struct {
		Image string `json:"image"`
	} `json:"image"`
	Command     []string          `json:"command,omitempty"`
	Args        []string          `json:"args,omitempty"`
	Envs        []EnvVar          `json:"envs,omitempty"`
	Annotations map[string]string `json:"annotations,omitempty"`
	Devices     []DeviceMapping   `json:"devices,omitempty"`
	Mounts      []Mount           `json:"mounts,omitempty"`
	Linux       struct {
		SecurityContext struct {
			Privileged bool `json:"privileged,omitempty"`
		} `json:"security_context"`
	} `json:"linux"`
	LogPath string `json:"log_path"`
}

// CreateError is a container create that failed, with the part of crictl's
// error that the refusing party wrote (the NRI plugin's message when the
// guard refused).
type CreateError struct {
	Tool *ToolError
	// Message is the innermost error text, after the last "desc = ".
	Message string
}

func (e *CreateError) Error() string { return "create refused: " + e.Message }
func (e *CreateError) Unwrap() error { return e.Tool }

// Create creates a container in the pod (crictl create). A refusal comes
// back as a *CreateError.
func (p *Pod) Create(spec ContainerSpec) (string, error) {
	var cfg containerConfigJSON
	cfg.Metadata.Name = spec.Name
	cfg.Image.Image = spec.Image
	if cfg.Image.Image == "" {
		cfg.Image.Image = WorkloadImage
	}
	cfg.Command, cfg.Args, cfg.Envs = spec.Command, spec.Args, spec.Env
	cfg.Annotations, cfg.Devices, cfg.Mounts = spec.Annotations, spec.Devices, spec.Mounts
	cfg.Linux.SecurityContext.Privileged = spec.Privileged
	cfg.LogPath = spec.Name + ".log"
	path, err := p.c.writeJSON("ctr-"+p.Spec.Name+"-"+spec.Name+".json", cfg)
	if err != nil {
		return "", err
	}
	out, err := p.c.Crictl("create", p.ID, path, p.configPath)
	if err != nil {
		var te *ToolError
		if errors.As(err, &te) {
			return "", &CreateError{Tool: te, Message: refusalMessage(te.Stderr)}
		}
		return "", err
	}
	return strings.TrimSpace(out), nil
}

// refusalMessage digs the innermost error out of crictl's fatal log line:
// `... level=fatal msg="creating container: rpc error: code = Unknown desc =
// ... desc = <message>"`.
func refusalMessage(stderr string) string {
	msg := strings.TrimSpace(stderr)
	if i := strings.LastIndex(stderr, "msg="); i >= 0 {
		if q, err := strconv.QuotedPrefix(stderr[i+len("msg="):]); err == nil {
			if s, err := strconv.Unquote(q); err == nil {
				msg = s
			}
		}
	}
	if i := strings.LastIndex(msg, "desc = "); i >= 0 {
		msg = msg[i+len("desc = "):]
	}
	return msg
}

// MustCreate creates a container and fails the test if that is refused.
func (p *Pod) MustCreate(t testing.TB, spec ContainerSpec) string {
	t.Helper()
	id, err := p.Create(spec)
	if err != nil {
		t.Fatalf("create %s: %v", p.Owner(spec.Name), err)
	}
	return id
}

// Refused creates a container that the test expects to be refused and
// returns the refusal's message.
func (p *Pod) Refused(t testing.TB, spec ContainerSpec) string {
	t.Helper()
	id, err := p.Create(spec)
	if err == nil {
		t.Fatalf("create %s was admitted (container %s), want it refused", p.Owner(spec.Name), id)
	}
	var ce *CreateError
	if !errors.As(err, &ce) {
		t.Fatalf("create %s: %v", p.Owner(spec.Name), err)
	}
	return ce.Message
}

// Run creates and starts a container, and returns its id.
func (p *Pod) Run(t testing.TB, spec ContainerSpec) string {
	t.Helper()
	id := p.MustCreate(t, spec)
	p.c.StartContainer(t, id)
	return id
}

// Remove force-removes the pod and its containers (crictl rmp -f).
func (p *Pod) Remove(t testing.TB) {
	t.Helper()
	if _, err := p.c.Crictl("rmp", "--force", p.ID); err != nil {
		t.Fatalf("remove pod %s: %v", p.Spec.Name, err)
	}
}

// StartContainer starts a created container.
func (c *Containerd) StartContainer(t testing.TB, id string) {
	t.Helper()
	if _, err := c.Crictl("start", id); err != nil {
		t.Fatalf("start container %s: %v", id, err)
	}
}

// StopContainer stops a container gracefully (SIGTERM; the test image exits
// on it at once) and returns once it has exited.
func (c *Containerd) StopContainer(t testing.TB, id string) {
	t.Helper()
	if _, err := c.Crictl("stop", "--timeout", "10", id); err != nil {
		t.Fatalf("stop container %s: %v", id, err)
	}
}

// RemoveContainer force-removes a container (crictl rm -f).
func (c *Containerd) RemoveContainer(t testing.TB, id string) {
	t.Helper()
	if _, err := c.Crictl("rm", "--force", id); err != nil {
		t.Fatalf("remove container %s: %v", id, err)
	}
}

// CRIContainer is one container as `crictl ps -o json` lists it.
type CRIContainer struct {
	ID           string `json:"id"`
	PodSandboxID string `json:"podSandboxId"`
	Metadata     struct {
		Name string `json:"name"`
	} `json:"metadata"`
	// State is CONTAINER_CREATED, CONTAINER_RUNNING, CONTAINER_EXITED or
	// CONTAINER_UNKNOWN.
	State string `json:"state"`
}

// Containers lists every container, in any state (crictl ps -a).
func (c *Containerd) Containers(t testing.TB) []CRIContainer {
	t.Helper()
	out, err := c.Crictl("ps", "--all", "--output", "json")
	if err != nil {
		t.Fatalf("list containers: %v", err)
	}
	var list struct {
		Containers []CRIContainer `json:"containers"`
	}
	if err := json.Unmarshal([]byte(out), &list); err != nil {
		t.Fatalf("list containers: %v in %q", err, out)
	}
	return list.Containers
}

// ContainerState is the CRI state of container id, or "" if there is none.
func (c *Containerd) ContainerState(t testing.TB, id string) string {
	t.Helper()
	for _, ctr := range c.Containers(t) {
		if ctr.ID == id {
			return ctr.State
		}
	}
	return ""
}

// LiveContainers maps the id of every CREATED or RUNNING container (what
// NRI's Synchronize lists) to its pod sandbox id.
func (c *Containerd) LiveContainers(t testing.TB) map[string]string {
	t.Helper()
	live := map[string]string{}
	for _, ctr := range c.Containers(t) {
		if ctr.State == "CONTAINER_CREATED" || ctr.State == "CONTAINER_RUNNING" {
			live[ctr.ID] = ctr.PodSandboxID
		}
	}
	return live
}

// describe is a short text of a value for failure messages.
func describe(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}
