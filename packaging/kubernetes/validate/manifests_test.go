// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package validate

import (
	"bytes"
	"flag"
	"fmt"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/yaml"
)

var update = flag.Bool("update", false, "regenerate "+configMapFile+" from "+shippedConfig)

const (
	manifestDir   = ".."
	configMapFile = "../20-configmap.yaml"
	shippedConfig = "../../config.toml"
	k8sDropIn     = "../../containerd/nri-gpu-guard-kubernetes.toml"
	buildImage    = "../../build-image.sh"

	configKey     = "config.toml"
	configDir     = "/etc/nri-gpu-guard"
	metricsPort   = "metrics"
	daemonSetName = "nri-gpu-guard"
)

// The one change the DaemonSet needs from the shipped defaults: an HTTP
// endpoint for the kubelet's probes. The pod uses the host network, so
// 127.0.0.1 keeps it on the node.
const (
	listenShipped   = "\nlisten = \"\"\n"
	listenDaemonSet = "\n# In the DaemonSet (host network) the kubelet's probes reach /readyz and\n" +
		"# /healthz here; use \":9464\" to let Prometheus scrape /metrics.\n" +
		"listen = \"127.0.0.1:9464\"\n"
)

const configMapHeader = `# GENERATED from packaging/config.toml: do not edit. Edit that file, then run
#   cd packaging/kubernetes/validate && go test ./... -update
# The only difference is [metrics] listen, which the DaemonSet's probes need.
apiVersion: v1
kind: ConfigMap
metadata:
  name: nri-gpu-guard-config
  namespace: nri-gpu-guard
  labels:
    app.kubernetes.io/name: nri-gpu-guard
data:
  config.toml: |
`

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.FromSlash(name))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// daemonSetConfig is packaging/config.toml with the DaemonSet's listen line.
func daemonSetConfig(t *testing.T) string {
	t.Helper()
	shipped := string(readFile(t, shippedConfig))
	if n := strings.Count(shipped, listenShipped); n != 1 {
		t.Fatalf("%s: want exactly one line %q, found %d", shippedConfig, strings.TrimSpace(listenShipped), n)
	}
	if !strings.HasSuffix(shipped, "\n") || strings.HasSuffix(shipped, "\n\n") {
		t.Fatalf("%s must end with exactly one newline (a YAML literal block keeps one)", shippedConfig)
	}
	return strings.Replace(shipped, listenShipped, listenDaemonSet, 1)
}

// renderConfigMap is the whole ConfigMap file for a config document.
func renderConfigMap(cfg string) []byte {
	var b bytes.Buffer
	b.WriteString(configMapHeader)
	for line := range strings.Lines(cfg) {
		if strings.TrimSpace(line) != "" {
			b.WriteString("    ")
		}
		b.WriteString(strings.TrimRight(line, " \t\n"))
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// object is one decoded manifest document.
type object struct {
	file string
	kind string
	meta *metav1.ObjectMeta
	obj  any
}

// newTyped returns an empty API object for a document's apiVersion and kind;
// only the kinds this project ships are accepted.
func newTyped(tm metav1.TypeMeta) (any, *metav1.ObjectMeta, error) {
	switch tm.APIVersion + "/" + tm.Kind {
	case "v1/Namespace":
		o := &corev1.Namespace{}
		return o, &o.ObjectMeta, nil
	case "v1/ServiceAccount":
		o := &corev1.ServiceAccount{}
		return o, &o.ObjectMeta, nil
	case "v1/ConfigMap":
		o := &corev1.ConfigMap{}
		return o, &o.ObjectMeta, nil
	case "apps/v1/DaemonSet":
		o := &appsv1.DaemonSet{}
		return o, &o.ObjectMeta, nil
	}
	return nil, nil, fmt.Errorf("unexpected apiVersion %q kind %q", tm.APIVersion, tm.Kind)
}

var docSeparator = regexp.MustCompile(`(?m)^---[ \t]*$`)

// decodeStrict decodes every document of a YAML stream into its API type,
// failing on unknown fields, duplicate fields and unknown kinds.
func decodeStrict(file string, data []byte) ([]object, error) {
	var out []object
	for i, doc := range docSeparator.Split(string(data), -1) {
		if strings.TrimSpace(stripComments(doc)) == "" {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			return nil, fmt.Errorf("%s document %d: %w", file, i, err)
		}
		obj, meta, err := newTyped(tm)
		if err != nil {
			return nil, fmt.Errorf("%s document %d: %w", file, i, err)
		}
		if err := yaml.UnmarshalStrict([]byte(doc), obj); err != nil {
			return nil, fmt.Errorf("%s document %d (%s): %w", file, i, tm.Kind, err)
		}
		out = append(out, object{file: file, kind: tm.Kind, meta: meta, obj: obj})
	}
	return out, nil
}

func stripComments(doc string) string {
	var b strings.Builder
	for line := range strings.Lines(doc) {
		if !strings.HasPrefix(strings.TrimSpace(line), "#") {
			b.WriteString(line)
		}
	}
	return b.String()
}

// manifests decodes every *.yaml file of packaging/kubernetes.
func manifests(t *testing.T) []object {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(manifestDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatalf("no manifests in %s", manifestDir)
	}
	sort.Strings(files)
	var all []object
	for _, f := range files {
		objs, err := decodeStrict(f, readFile(t, f))
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, objs...)
	}
	return all
}

// single returns the only object of type T.
func single[T any](t *testing.T, objs []object) T {
	t.Helper()
	var found []T
	for _, o := range objs {
		if v, ok := o.obj.(T); ok {
			found = append(found, v)
		}
	}
	if len(found) != 1 {
		var zero T
		t.Fatalf("want exactly one %T in the manifests, found %d", zero, len(found))
	}
	return found[0]
}

// The strict decoder is what the other tests stand on: prove it rejects what
// a lenient decode would silently drop.
func TestDecodeStrictRejects(t *testing.T) {
	tests := []struct {
		name, doc, want string
	}{
		{"unknown field", "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  lables: {a: b}\n", "unknown field"},
		{"duplicate field", "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: x\n  name: y\n", "already set"},
		{"wrong type", "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: x\nspec:\n  template:\n    spec:\n      hostPID: \"yes\"\n", "hostPID"},
		{"unknown kind", "apiVersion: v1\nkind: Secret\nmetadata:\n  name: x\n", "unexpected apiVersion"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := decodeStrict("test.yaml", []byte(tc.doc))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

// Every object is well named, labelled and placed in the one namespace.
func TestManifestsMetadata(t *testing.T) {
	objs := manifests(t)
	ns := single[*corev1.Namespace](t, objs)
	// hostPID and hostPath volumes need the "privileged" Pod Security level.
	if got := ns.Labels["pod-security.kubernetes.io/enforce"]; got != "privileged" {
		t.Errorf("namespace %s: pod-security enforce label is %q, want privileged", ns.Name, got)
	}
	for _, o := range objs {
		m := o.meta
		for _, msg := range validation.IsDNS1123Subdomain(m.Name) {
			t.Errorf("%s %s: name: %s", o.file, o.kind, msg)
		}
		if o.kind != "Namespace" && m.Namespace != ns.Name {
			t.Errorf("%s %s/%s: namespace %q, want %q", o.file, o.kind, m.Name, m.Namespace, ns.Name)
		}
		checkLabelsAnnotations(t, fmt.Sprintf("%s %s/%s", o.file, o.kind, m.Name), m.Labels, m.Annotations)
	}
	ds := single[*appsv1.DaemonSet](t, objs)
	tm := ds.Spec.Template.ObjectMeta
	checkLabelsAnnotations(t, "DaemonSet pod template", tm.Labels, tm.Annotations)
}

func checkLabelsAnnotations(t *testing.T, where string, lbls, annotations map[string]string) {
	t.Helper()
	for k, v := range lbls {
		for _, msg := range validation.IsQualifiedName(k) {
			t.Errorf("%s: label key %q: %s", where, k, msg)
		}
		for _, msg := range validation.IsValidLabelValue(v) {
			t.Errorf("%s: label %q value %q: %s", where, k, v, msg)
		}
	}
	for k := range annotations {
		for _, msg := range validation.IsQualifiedName(k) {
			t.Errorf("%s: annotation key %q: %s", where, k, msg)
		}
	}
}

// The ConfigMap is packaging/config.toml plus the DaemonSet's listen line,
// byte for byte, so the cluster runs the defaults the packages ship.
func TestConfigMapMatchesShippedConfig(t *testing.T) {
	want := daemonSetConfig(t)
	if *update {
		if err := os.WriteFile(configMapFile, renderConfigMap(want), 0o644); err != nil { //nolint:gosec // a manifest, world-readable on purpose
			t.Fatal(err)
		}
	}
	data := readFile(t, configMapFile)
	if !bytes.Equal(data, renderConfigMap(want)) {
		t.Errorf("%s is stale: regenerate it with `go test ./... -update` in this directory", configMapFile)
	}
	objs, err := decodeStrict(configMapFile, data)
	if err != nil {
		t.Fatal(err)
	}
	cm := single[*corev1.ConfigMap](t, objs)
	if got := cm.Data[configKey]; got != want {
		t.Errorf("ConfigMap data[%q] differs from %s with the DaemonSet listen line", configKey, shippedConfig)
	}
	if len(cm.Data) != 1 || len(cm.BinaryData) != 0 {
		t.Errorf("ConfigMap holds %d keys, want only %q", len(cm.Data)+len(cm.BinaryData), configKey)
	}
}

// tomlString extracts `key = "value"` from a TOML document (a flat lookup is
// enough for the few keys checked here and keeps this module free of the
// main module's dependencies).
func tomlString(t *testing.T, doc, key string) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^[ \t]*`+regexp.QuoteMeta(key)+`\s*=\s*"([^"]*)"`).FindAllStringSubmatch(doc, -1)
	if len(m) != 1 {
		t.Fatalf("want exactly one live %q key, found %d", key, len(m))
	}
	return m[0][1]
}

func mountFor(c corev1.Container, volume string) (corev1.VolumeMount, bool) {
	for _, m := range c.VolumeMounts {
		if m.Name == volume {
			return m, true
		}
	}
	return corev1.VolumeMount{}, false
}

// hostPathVolume returns the volume whose hostPath is p and the container's
// mount of it.
func hostPathVolume(t *testing.T, spec corev1.PodSpec, c corev1.Container, p string) (corev1.Volume, corev1.VolumeMount) {
	t.Helper()
	for _, v := range spec.Volumes {
		if v.HostPath != nil && path.Clean(v.HostPath.Path) == path.Clean(p) {
			m, ok := mountFor(c, v.Name)
			if !ok {
				t.Fatalf("hostPath volume %s (%s) is not mounted", v.Name, p)
			}
			return v, m
		}
	}
	t.Fatalf("no hostPath volume for %s", p)
	return corev1.Volume{}, corev1.VolumeMount{}
}

// The DaemonSet reaches what the configuration names: the NRI socket
// directory, the ledger directory, the config file, the cgroup hierarchy, and
// serves the probes on the configured endpoint.
func TestDaemonSetMatchesConfig(t *testing.T) {
	objs := manifests(t)
	ds := single[*appsv1.DaemonSet](t, objs)
	cm := single[*corev1.ConfigMap](t, objs)
	sa := single[*corev1.ServiceAccount](t, objs)
	spec := ds.Spec.Template.Spec
	cfg := cm.Data[configKey]

	if ds.Name != daemonSetName {
		t.Errorf("DaemonSet name %q, want %q", ds.Name, daemonSetName)
	}
	sel, err := metav1.LabelSelectorAsSelector(ds.Spec.Selector)
	if err != nil {
		t.Fatal(err)
	}
	if sel.Empty() || !sel.Matches(labels.Set(ds.Spec.Template.Labels)) {
		t.Errorf("selector %s does not match the pod template labels %v", sel, ds.Spec.Template.Labels)
	}
	if spec.ServiceAccountName != sa.Name {
		t.Errorf("serviceAccountName %q, want %q", spec.ServiceAccountName, sa.Name)
	}
	if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
		t.Error("the guard needs no API token: automountServiceAccountToken must be false")
	}
	if !spec.HostPID {
		t.Error("hostPID must be true: holder pids recorded from containerd are host pids")
	}
	if !spec.HostNetwork {
		t.Error("hostNetwork must be true: the guard must start before the CNI plugin's pods")
	}
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q, want system-node-critical", spec.PriorityClassName)
	}
	if len(spec.Containers) != 1 {
		t.Fatalf("want one container, got %d", len(spec.Containers))
	}
	c := spec.Containers[0]

	// NRI socket and ledger: hostPath volumes mounted at the same paths the
	// configuration names, read-write.
	socketDir := path.Dir(tomlString(t, cfg, "socket"))
	ledgerDir := tomlString(t, cfg, "dir")
	for _, p := range []string{socketDir, ledgerDir} {
		_, m := hostPathVolume(t, spec, c, p)
		if path.Clean(m.MountPath) != p || m.ReadOnly {
			t.Errorf("%s must be mounted read-write at the same path, got %s (readOnly %v)", p, m.MountPath, m.ReadOnly)
		}
	}
	// The ledger's runtime dir (the per-boot markers: ledger.DefaultRuntimeDir)
	// must be the host's, writable: the root file system is read-only, and
	// the hooks and gpu-guard-ctl on the node read the same markers.
	const runtimeDir = "/run/nri-gpu-guard"
	if _, m := hostPathVolume(t, spec, c, runtimeDir); path.Clean(m.MountPath) != runtimeDir || m.ReadOnly {
		t.Errorf("%s must be mounted read-write at the same path, got %s (readOnly %v)", runtimeDir, m.MountPath, m.ReadOnly)
	}
	if _, m := hostPathVolume(t, spec, c, "/sys/fs/cgroup"); m.MountPath != "/sys/fs/cgroup" || !m.ReadOnly {
		t.Errorf("the host cgroup hierarchy must be mounted read-only at /sys/fs/cgroup, got %s (readOnly %v)", m.MountPath, m.ReadOnly)
	}

	// Config: the ConfigMap mounted at the directory the --config flag names.
	var cfgVol *corev1.Volume
	for i, v := range spec.Volumes {
		if v.ConfigMap != nil {
			cfgVol = &spec.Volumes[i]
		}
	}
	if cfgVol == nil || cfgVol.ConfigMap.Name != cm.Name {
		t.Fatalf("no volume from ConfigMap %s", cm.Name)
	}
	if m, ok := mountFor(c, cfgVol.Name); !ok || m.MountPath != configDir || !m.ReadOnly {
		t.Errorf("ConfigMap must be mounted read-only at %s", configDir)
	}
	wantArgs := []string{"--config", path.Join(configDir, configKey)}
	if strings.Join(c.Args, " ") != strings.Join(wantArgs, " ") {
		t.Errorf("args %q, want %q", c.Args, wantArgs)
	}

	// Probes: on the endpoint [metrics] listen opens.
	host, port, err := net.SplitHostPort(tomlString(t, cfg, "listen"))
	if err != nil {
		t.Fatalf("ConfigMap [metrics] listen: %v", err)
	}
	var containerPort int32
	for _, p := range c.Ports {
		if p.Name == metricsPort {
			containerPort = p.ContainerPort
			if p.HostPort != 0 && p.HostPort != p.ContainerPort {
				t.Errorf("with hostNetwork, hostPort %d must equal containerPort %d", p.HostPort, p.ContainerPort)
			}
		}
	}
	if strconv.Itoa(int(containerPort)) != port {
		t.Errorf("port %q is %d, [metrics] listen port is %s", metricsPort, containerPort, port)
	}
	for name, probe := range map[string]*corev1.Probe{"/readyz": c.ReadinessProbe, "/healthz": c.LivenessProbe} {
		if probe == nil || probe.HTTPGet == nil {
			t.Errorf("missing HTTP probe on %s", name)
			continue
		}
		g := probe.HTTPGet
		if g.Path != name || g.Port.String() != metricsPort {
			t.Errorf("probe %s: path %s port %s", name, g.Path, g.Port.String())
		}
		if host != "" && host != "0.0.0.0" && host != "::" && g.Host != host {
			t.Errorf("probe %s: host %q, but the endpoint listens only on %s", name, g.Host, host)
		}
	}

	// Scheduling: the nodes provisioned with the drop-ins, including tainted
	// ones (see TestDaemonSetNodeSelector).
	// A labelled node that kubeadm made a control-plane node is tainted
	// NoSchedule; without its guard it refuses every pod (docs/install.md).
	tolerated, controlPlane := false, false
	for _, tol := range spec.Tolerations {
		tolerated = tolerated || (tol.Key == "nvidia.com/gpu" && tol.Operator == corev1.TolerationOpExists && tol.Effect == "")
		controlPlane = controlPlane || (tol.Key == "node-role.kubernetes.io/control-plane" && tol.Operator == corev1.TolerationOpExists &&
			(tol.Effect == "" || tol.Effect == corev1.TaintEffectNoSchedule))
	}
	if !tolerated {
		t.Error("missing a toleration for the nvidia.com/gpu taint (operator Exists, every effect)")
	}
	if !controlPlane {
		t.Error("missing a toleration for kubeadm's node-role.kubernetes.io/control-plane:NoSchedule taint")
	}

	// Resources: requests for scheduling; memory bounded; no CPU limit
	// (throttling could overrun containerd's NRI request timeout).
	req, lim := c.Resources.Requests, c.Resources.Limits
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if q, ok := req[r]; !ok || q.Cmp(resource.MustParse("0")) <= 0 {
			t.Errorf("missing %s request", r)
		}
	}
	if _, ok := lim[corev1.ResourceMemory]; !ok {
		t.Error("missing memory limit")
	}
	if _, ok := lim[corev1.ResourceCPU]; ok {
		t.Error("a CPU limit can throttle the plugin past containerd's request timeout")
	}

	// Least privilege: root (host files are root-owned) but not privileged.
	sc := c.SecurityContext
	switch {
	case sc == nil:
		t.Fatal("missing container securityContext")
	case sc.Privileged == nil || *sc.Privileged:
		t.Error("the container must not be privileged")
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation:
		t.Error("allowPrivilegeEscalation must be false")
	case sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		t.Error("readOnlyRootFilesystem must be true")
	case sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL":
		t.Error("capabilities must drop ALL and add back only what is needed")
	}
}

// The pod tolerates the absence of the guard (it is the guard), using exactly
// the annotation key the Kubernetes containerd drop-in configures.
func TestDaemonSetToleratesMissingGuard(t *testing.T) {
	ds := single[*appsv1.DaemonSet](t, manifests(t))
	key := tomlString(t, string(readFile(t, k8sDropIn)), "tolerate_missing_plugins_annotation")
	if key == "" || strings.Contains(key, "/") {
		t.Fatalf("%s: annotation key %q must be non-empty and without '/' (containerd appends /pod)", k8sDropIn, key)
	}
	ann := ds.Spec.Template.Annotations
	if got := ann[key+"/pod"]; got != "true" {
		t.Errorf("pod template annotation %s/pod = %q, want \"true\"", key, got)
	}
}

// The label node provisioning sets together with the containerd drop-ins
// (kubelet --node-labels), and docs/install.md tells it so.
const (
	enabledLabel = "nri-gpu-guard.io/enabled"
	installDoc   = "../../../docs/install.md"
)

// The DaemonSet selects only on labels that exist before any pod ran on the
// node. A node with the drop-ins refuses every pod until the guard runs, so a
// label set by a pod (GPU Feature Discovery, NFD, the GPU operator) would never
// appear on a new node, and the guard would never be scheduled there.
func TestDaemonSetNodeSelector(t *testing.T) {
	ds := single[*appsv1.DaemonSet](t, manifests(t))
	want := map[string]string{"kubernetes.io/os": "linux", enabledLabel: "true"}
	got := ds.Spec.Template.Spec.NodeSelector
	if len(got) != len(want) {
		t.Errorf("nodeSelector = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("nodeSelector[%s] = %q, want %q", k, got[k], v)
		}
	}
	if a := ds.Spec.Template.Spec.Affinity; a != nil && a.NodeAffinity != nil {
		t.Error("node affinity: select nodes with nodeSelector on " + enabledLabel + " only")
	}
	doc := string(readFile(t, installDoc))
	for _, s := range []string{
		"--node-labels=" + enabledLabel + "=true",
		"kubectl label node <node> " + enabledLabel + "=true",
	} {
		if !strings.Contains(doc, s) {
			t.Errorf("%s does not mention %q", installDoc, s)
		}
	}
	if strings.Contains(doc, "nvidia.com/gpu.present=true") {
		t.Errorf("%s still tells operators to select on nvidia.com/gpu.present", installDoc)
	}
}

// The DaemonSet runs the image packaging/build-image.sh writes.
func TestDaemonSetImage(t *testing.T) {
	ds := single[*appsv1.DaemonSet](t, manifests(t))
	m := regexp.MustCompile(`IMAGE_REPO=\$\{IMAGE_REPO:-([^}]+)\}`).FindSubmatch(readFile(t, buildImage))
	if m == nil {
		t.Fatalf("%s: no IMAGE_REPO default", buildImage)
	}
	image := ds.Spec.Template.Spec.Containers[0].Image
	repo, tag, ok := strings.Cut(image, ":")
	if !ok || repo != string(m[1]) || tag == "" {
		t.Errorf("image %q, want %s:<tag>", image, m[1])
	}
	if p := ds.Spec.Template.Spec.Containers[0].ImagePullPolicy; p != corev1.PullIfNotPresent {
		t.Errorf("imagePullPolicy %q: an imported image must not be pulled (IfNotPresent)", p)
	}
}
