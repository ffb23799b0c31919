// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package config

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// ErrInvalid is wrapped by every error Validate returns.
var ErrInvalid = errors.New("invalid configuration")

// validPluginIndex reports whether s is two ASCII digits, as NRI wants.
func validPluginIndex(s string) bool {
	return len(s) == 2 && isDigit(s[0]) && isDigit(s[1])
}

// validPluginName reports whether s is a letter or digit followed by
// letters, digits, '_', '.' or '-'. Checked by hand rather than with a
// regexp: every hook process validates the configuration, and a regexp
// compiled at package init costs each of them on start.
func validPluginName(s string) bool {
	if s == "" || !isAlnum(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if c := s[i]; !isAlnum(c) && c != '_' && c != '.' && c != '-' {
			return false
		}
	}
	return true
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

func isAlnum(c byte) bool { return isDigit(c) || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' }

// Validate checks every key and reports all problems at once, each naming the
// key, the bad value and what is accepted.
func (c *Config) Validate() error {
	var v problems
	if c.Version != CurrentVersion {
		v.bad("version", "unsupported version %d (this build reads version %d)", c.Version, CurrentVersion)
	}
	c.validateLedger(&v)
	c.validateDevices(&v)
	c.validatePolicy(&v)
	c.validateNRI(&v)
	c.validateHook(&v)
	c.validateObserve(&v)
	if c.Metrics.Listen != "" {
		if _, port, err := net.SplitHostPort(c.Metrics.Listen); err != nil {
			v.bad("metrics.listen", "want host:port such as \"127.0.0.1:9464\", got %q", c.Metrics.Listen)
		} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
			// The daemon would fail to listen at start and exit, taking
			// the guard down with it.
			v.bad("metrics.listen", "port %q of %q is not a number from 1 to 65535", port, c.Metrics.Listen)
		}
	}
	return errors.Join(v.errs...)
}

// problems collects what Validate found, one error per key.
type problems struct{ errs []error }

func (v *problems) bad(key, format string, args ...any) {
	v.errs = append(v.errs, fmt.Errorf("%w: %s: %s", ErrInvalid, key, fmt.Sprintf(format, args...)))
}

func (v *problems) oneOf(key string, value string, allowed ...string) {
	for _, a := range allowed {
		if value == a {
			return
		}
	}
	v.bad(key, "invalid value %q (want one of: %s)", value, strings.Join(allowed, ", "))
}

// within checks a duration against the range where it makes sense. The
// bounds of each key are beside its call, with the reason.
func (v *problems) within(key string, d Duration, lo, hi time.Duration) {
	if d.Duration < lo || d.Duration > hi {
		v.bad(key, "must be between %s and %s, got %q", lo, hi, d.String())
	}
}

func (v *problems) absPath(key, path string) {
	if path == "" || !filepath.IsAbs(path) {
		v.bad(key, "must be an absolute path, got %q", path)
	}
}

// systemDirs are directories the ledger must never be: it would put its
// state, lock and audit files among the system's own, and the operator
// surely meant a directory of its own beneath one.
var systemDirs = map[string]bool{
	"/": true, "/bin": true, "/boot": true, "/dev": true, "/etc": true, "/home": true, "/lib": true,
	"/lib32": true, "/lib64": true, "/media": true, "/mnt": true, "/opt": true, "/proc": true,
	"/root": true, "/run": true, "/sbin": true, "/srv": true, "/sys": true, "/tmp": true, "/usr": true,
	"/usr/bin": true, "/usr/lib": true, "/usr/local": true, "/usr/sbin": true, "/usr/share": true,
	"/var": true, "/var/lib": true, "/var/log": true, "/var/run": true, "/var/tmp": true,
	"/var/cache": true, "/var/spool": true, "/run/user": true, "/dev/shm": true, "/etc/nri-gpu-guard": true,
}

// pseudoFSRoots hold kernel file systems: no state can live beneath them.
var pseudoFSRoots = []string{"/proc/", "/sys/", "/dev/"}

// CheckLedgerDir says what is wrong with dir as the ledger directory, or
// nil: the one judgement of [ledger] dir (Validate) and of every flag that
// stands for it (the daemon's, the hook's and gpu-guard-ctl's --state-dir),
// which callers prefix with the key or the flag. The ledger writes its files
// into that directory and makes it 0700: a system directory would be
// damaged.
func CheckLedgerDir(dir string) error {
	if dir == "" || !filepath.IsAbs(dir) {
		return fmt.Errorf("want the absolute path of a directory of the guard's own such as /var/lib/nri-gpu-guard, got %q", dir)
	}
	clean := filepath.Clean(dir)
	if systemDirs[clean] {
		return fmt.Errorf("%q is the system directory %s; name a directory of the guard's own such as /var/lib/nri-gpu-guard", dir, clean)
	}
	for _, root := range pseudoFSRoots {
		if strings.HasPrefix(clean+"/", root) {
			return fmt.Errorf("%q is on a kernel file system (%s); name a directory such as /var/lib/nri-gpu-guard", dir, strings.TrimSuffix(root, "/"))
		}
	}
	return nil
}

func (c *Config) validateLedger(v *problems) {
	if err := CheckLedgerDir(c.Ledger.Dir); err != nil {
		v.bad("ledger.dir", "%v", err)
	}
	// A ledger update takes about a millisecond; under that a busy host
	// would refuse containers for nothing. Over an hour, a front end stalls
	// the runtime behind a lock that a hung process holds (the NRI front end
	// bounds its own wait by the request deadline whatever this says).
	v.within("ledger.lock_timeout", c.Ledger.LockTimeout, time.Millisecond, time.Hour)
	if c.Ledger.AuditMaxBytes < 4096 {
		v.bad("ledger.audit_max_bytes", "must be at least 4096, got %d", c.Ledger.AuditMaxBytes)
	}
}

func (c *Config) validateDevices(v *problems) {
	v.oneOf("devices.source", string(c.Devices.Source),
		string(SourceAuto), string(SourceNVML), string(SourceProc), string(SourceStatic))
	v.absPath("devices.proc_root", c.Devices.ProcRoot)
	if c.Devices.Source == SourceStatic && len(c.Devices.Static) == 0 {
		v.bad("devices.static", "source is \"static\" but no [[devices.static]] GPU is listed")
	}
	c.validateStatic(v.bad)
}

func (c *Config) validatePolicy(v *problems) {
	v.oneOf("policy.on_conflict", string(c.Policy.OnConflict), string(ConflictQueue), string(ConflictReject))
	v.oneOf("policy.release_on", string(c.Policy.ReleaseOn), string(ReleaseOnStop), string(ReleaseOnRemove))
	v.oneOf("policy.all_devices", string(c.Policy.AllDevices), string(AllClaim), string(AllReject), string(AllIgnore))
	v.oneOf("policy.privileged", string(c.Policy.Privileged),
		string(PrivilegedDeclared), string(PrivilegedAll), string(PrivilegedReject))
	v.oneOf("policy.unknown_device", string(c.Policy.UnknownDevice), string(UnknownReject), string(UnknownIgnore))
	// A reservation must outlast the requester's next retry (kubelet backs
	// off up to 5 minutes, a hook polls), yet not hold a GPU idle for days.
	v.within("policy.reservation_ttl", c.Policy.ReservationTTL, 10*time.Second, 24*time.Hour)
	// A waiter must be able to refresh its entry before it expires (a hook
	// refreshes every quarter of it); a day-old entry is surely abandoned.
	v.within("policy.queue_ttl", c.Policy.QueueTTL, 10*time.Second, 24*time.Hour)
	seenNS := map[string]bool{}
	for i, ns := range c.Policy.ExemptNamespaces {
		key := fmt.Sprintf("policy.exempt_namespaces[%d]", i)
		switch {
		case strings.TrimSpace(ns) == "":
			v.bad(key, "empty namespace")
		case !isDNSLabel(ns):
			// Namespaces are matched exactly: one that no pod can have
			// would exempt nothing, silently.
			v.bad(key, "%q is not a Kubernetes namespace name (lowercase letters, digits and '-', at most 63, starting and ending with a letter or digit)", ns)
		case seenNS[ns]:
			v.bad(key, "namespace %q is listed twice", ns)
		}
		seenNS[ns] = true
	}
	if len(c.Policy.SwarmResourceEnvvars) > maxSwarmEnvvars {
		v.bad("policy.swarm_resource_envvars", "%d names listed, at most %d", len(c.Policy.SwarmResourceEnvvars), maxSwarmEnvvars)
	}
	seenVar := map[string]bool{}
	for i, name := range c.Policy.SwarmResourceEnvvars {
		key := fmt.Sprintf("policy.swarm_resource_envvars[%d]", i)
		switch {
		case !validEnvName(name):
			// Matched exactly against the container's variables: a name
			// no variable can have would read nothing, silently.
			v.bad(key, "%q is not an environment variable name (1 to %d printable ASCII characters, no '=' or space)", name, maxEnvNameLen)
		case !strings.HasPrefix(name, SwarmResourcePrefix):
			// The OCI hook's no-GPU shortcut recognises these variables
			// by the prefix Docker gives them, before it reads this file.
			v.bad(key, "%q does not start with %s (Docker names a swarm generic resource's variable %s<KIND>)", name, SwarmResourcePrefix, SwarmResourcePrefix)
		case seenVar[name]:
			v.bad(key, "variable %q is listed twice", name)
		}
		seenVar[name] = true
	}
}

// Bounds on policy.swarm_resource_envvars: NVIDIA's runtime is given one or
// a few names; each is compared with every variable of every container.
const (
	maxSwarmEnvvars = 16
	maxEnvNameLen   = 128
)

// validEnvName reports whether s can name a variable of a container's
// environment as NVIDIA's runtime matches it: exactly, up to the first '='.
// Swarm's generic resources carry a '-' (DOCKER_RESOURCE_NVIDIA-GPU), so
// only what cannot be in a name (or be told apart in a message) is refused.
func validEnvName(s string) bool {
	if s == "" || len(s) > maxEnvNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c > '~' || c == '=' {
			return false
		}
	}
	return true
}

// isDNSLabel reports whether s is an RFC 1123 label, as Kubernetes
// namespace names are.
func isDNSLabel(s string) bool {
	if len(s) == 0 || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' {
			return false
		}
	}
	return true
}

func (c *Config) validateNRI(v *problems) {
	if !validPluginName(c.NRI.PluginName) {
		v.bad("nri.plugin_name", "invalid name %q (letters, digits, '-', '_', '.'; no index prefix)", c.NRI.PluginName)
	}
	if !validPluginIndex(c.NRI.PluginIndex) {
		v.bad("nri.plugin_index", "must be two digits such as \"90\", got %q", c.NRI.PluginIndex)
	}
	v.absPath("nri.socket", c.NRI.Socket)
}

func (c *Config) validateHook(v *problems) {
	// A hook waiting a day holds a runtime call open that long; under 100ms
	// it could not wait for anything.
	v.within("hook.wait_timeout", c.Hook.WaitTimeout, 100*time.Millisecond, 24*time.Hour)
	// Every poll reads the ledger: under a millisecond a waiting hook spins
	// on it; over a minute a freed GPU stays idle that long.
	v.within("hook.poll_interval", c.Hook.PollInterval, time.Millisecond, time.Minute)
	if c.Hook.PollInterval.Duration > 0 && c.Hook.WaitTimeout.Duration > 0 &&
		c.Hook.PollInterval.Duration > c.Hook.WaitTimeout.Duration {
		v.bad("hook.poll_interval", "%s is longer than hook.wait_timeout %s", c.Hook.PollInterval, c.Hook.WaitTimeout)
	}
	if len(c.Hook.RuntimeRoots) > maxRuntimeRoots {
		v.bad("hook.runtime_roots", "%d directories listed, at most %d", len(c.Hook.RuntimeRoots), maxRuntimeRoots)
	}
	seen := map[string]bool{}
	for i, root := range c.Hook.RuntimeRoots {
		key := fmt.Sprintf("hook.runtime_roots[%d]", i)
		switch {
		case root == "" || !filepath.IsAbs(root):
			v.bad(key, "must be the absolute path of an OCI runtime's state directory (such as \"/run/runc\"), got %q", root)
		case filepath.Clean(root) != root:
			v.bad(key, "%q is not a clean path (write %q)", root, filepath.Clean(root))
		case seen[root]:
			v.bad(key, "%q is listed twice", root)
		}
		seen[root] = true
	}
}

// maxRuntimeRoots bounds hook.runtime_roots: a host runs a handful of OCI
// runtimes.
const maxRuntimeRoots = 32

// maxIdleGrace bounds observe.idle_grace: a draining claim must end, and an
// hour is far beyond the seconds a stopping process needs to free GPU memory.
const maxIdleGrace = time.Hour

// maxObserveInterval bounds observe.interval: an intruder found an hour
// late has had the GPU for that hour.
const maxObserveInterval = time.Hour

// maxXid bounds observe.xids: NVIDIA's catalogue numbers Xids in the low
// hundreds; anything far beyond is a typo.
const maxXid = 65535

func (c *Config) validateObserve(v *problems) {
	if c.Observe.Interval.Duration < 0 {
		v.bad("observe.interval", "must not be negative (0 disables the accounting), got %q", c.Observe.Interval.String())
	} else if c.Observe.Interval.Duration > 0 && (c.Observe.Interval.Duration < time.Second || c.Observe.Interval.Duration > maxObserveInterval) {
		v.bad("observe.interval", "must be between 1s and %s (or 0 to disable), got %q", maxObserveInterval, c.Observe.Interval.String())
	}
	v.oneOf("observe.on_intruder", string(c.Observe.OnIntruder), string(IntruderReport), string(IntruderCordon))
	if g := c.Observe.IdleGrace.Duration; g <= 0 || g > maxIdleGrace {
		v.bad("observe.idle_grace", "must be a positive duration of at most %s, got %q", maxIdleGrace, c.Observe.IdleGrace.String())
	}
	seen := map[int]bool{}
	for i, x := range c.Observe.Xids {
		key := fmt.Sprintf("observe.xids[%d]", i)
		switch {
		case x < 1 || x > maxXid:
			v.bad(key, "Xid %d is out of range (1-%d)", x, maxXid)
		case seen[x]:
			v.bad(key, "Xid %d is listed twice", x)
		}
		seen[x] = true
	}
}

func (c *Config) validateStatic(bad func(key, format string, args ...any)) {
	uuids := map[string]string{}
	indices := map[int]string{}
	minors := map[int]string{}
	for i, g := range c.Devices.Static {
		key := fmt.Sprintf("devices.static[%d]", i)
		if !gpuid.IsGPUUUID(g.UUID) {
			bad(key+".uuid", "%q is not a GPU UUID (want GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)", g.UUID)
		} else if prev, dup := uuids[strings.ToLower(g.UUID)]; dup {
			bad(key+".uuid", "UUID %s is already used by %s", g.UUID, prev)
		} else {
			uuids[strings.ToLower(g.UUID)] = key
		}
		if g.Index < 0 {
			bad(key+".index", "must not be negative, got %d", g.Index)
		} else if prev, dup := indices[g.Index]; dup {
			bad(key+".index", "index %d is already used by %s", g.Index, prev)
		} else {
			indices[g.Index] = key
		}
		if !gpuid.IsGPUMinor(g.Minor) {
			bad(key+".minor", "must be between 0 and %d, got %d", gpuid.MaxGPUMinor, g.Minor)
		} else if prev, dup := minors[g.Minor]; dup {
			bad(key+".minor", "minor %d is already used by %s", g.Minor, prev)
		} else {
			minors[g.Minor] = key
		}
		migIdx := map[int]bool{}
		type giCI struct{ gi, ci int }
		migInst := map[giCI]string{}
		for j, m := range g.MIG {
			mkey := fmt.Sprintf("%s.mig[%d]", key, j)
			if !gpuid.IsMIGUUID(m.UUID) {
				bad(mkey+".uuid", "%q is not a MIG UUID (want MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)", m.UUID)
			} else if prev, dup := uuids[strings.ToLower(m.UUID)]; dup {
				bad(mkey+".uuid", "UUID %s is already used by %s", m.UUID, prev)
			} else {
				uuids[strings.ToLower(m.UUID)] = mkey
			}
			if m.Index < 0 || migIdx[m.Index] {
				bad(mkey+".index", "MIG index %d is negative or repeated on GPU %d", m.Index, g.Index)
			}
			migIdx[m.Index] = true
			if m.GI < 0 || m.CI < 0 {
				bad(mkey, "gi and ci must not be negative, got gi=%d ci=%d", m.GI, m.CI)
			} else if prev, dup := migInst[giCI{m.GI, m.CI}]; dup {
				// One GPU/compute instance is one MIG device: two entries
				// for it would make the inventory refuse to load.
				bad(mkey, "gi=%d ci=%d is already used by %s", m.GI, m.CI, prev)
			} else {
				migInst[giCI{m.GI, m.CI}] = mkey
			}
		}
	}
}

// Warnings lists settings that are valid but probably not what the operator
// wants; unlike Validate's errors they do not stop anything.
func (c *Config) Warnings() []string {
	var out []string
	if w := listenWarning(c.Metrics.Listen); w != "" {
		out = append(out, "metrics.listen: "+w)
	}
	// The kubelet retries a failed create with a back-off that grows to 5
	// minutes: a reservation that expires sooner is lost by the queue head
	// between two retries, and a waiter not seen for queue_ttl is dropped.
	if d := c.Policy.ReservationTTL.Duration; d > 0 && d <= kubeletMaxBackoff {
		out = append(out, fmt.Sprintf("policy.reservation_ttl: %s is not longer than the kubelet's %s maximum back-off between retries; "+
			"the head of the queue may lose its reserved GPU before it retries (the default is 6m)", d, kubeletMaxBackoff))
	}
	if d := c.Policy.QueueTTL.Duration; d > 0 && d <= kubeletMaxBackoff {
		out = append(out, fmt.Sprintf("policy.queue_ttl: %s is not longer than the kubelet's %s maximum back-off between retries; "+
			"a pod that keeps retrying may be dropped from the queue (the default is 15m)", d, kubeletMaxBackoff))
	}
	// A waiting hook (and gpu-guard-ctl run) renews its queue place and
	// its reservation every quarter of the shorter TTL, but never more often
	// than it polls: with a poll as long as half a TTL the renewal has no
	// margin left, and past it the waiter is dropped, or its reservation
	// lapses, between two polls (it queues again at the back).
	for _, ttl := range []struct {
		key  string
		d    Duration
		risk string
	}{
		{"policy.queue_ttl", c.Policy.QueueTTL, "be dropped from the queue"},
		{"policy.reservation_ttl", c.Policy.ReservationTTL, "lose the GPU reserved for it"},
	} {
		if p := c.Hook.PollInterval.Duration; p > 0 && ttl.d.Duration > 0 && 2*p > ttl.d.Duration {
			out = append(out, fmt.Sprintf("hook.poll_interval: %s is longer than half of %s (%s): a waiting hook or `gpu-guard-ctl run` "+
				"renews its place only when it polls, and may %s between two polls; keep poll_interval under a quarter of %s",
				c.Hook.PollInterval, ttl.key, ttl.d, ttl.risk, ttl.key))
		}
	}
	if c.Observe.OnIntruder == IntruderCordon && c.Observe.Interval.Duration == 0 {
		out = append(out, "observe.on_intruder: \"cordon\" has no effect while observe.interval = \"0s\" turns the accounting off: no intruder is ever found")
	}
	if !c.Hook.Poststop && c.Observe.ReleaseRequiresIdle {
		out = append(out, "hook.poststop: false with observe.release_requires_idle = true: an exited hook container's claim starts "+
			"draining only when the next request for its GPU finds it exited, and that request is refused until the drain ends "+
			"(idle_grace on a host without the daemon's observer); with the poststop the drain starts at the container's deletion")
	}
	if len(c.Policy.ExemptNamespaces) > 0 {
		out = append(out, "policy.exempt_namespaces: applies to containers seen through NRI only; "+
			"containers checked by the OCI hook are never exempt (their namespace is an annotation whoever creates them can set)")
	}
	return out
}

// kubeletMaxBackoff is the longest the kubelet waits between two attempts
// to create a failed container (its CrashLoopBackOff/ErrImagePull cap).
const kubeletMaxBackoff = 5 * time.Minute

// listenWarning warns about a metrics endpoint reachable from other hosts:
// it has no authentication and its labels name pods and containers.
func listenWarning(listen string) string {
	if listen == "" {
		return ""
	}
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		return "" // Validate reports it
	}
	if host == "localhost" {
		return ""
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return ""
	}
	what := fmt.Sprintf("%q is reachable from other hosts", host)
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		what = fmt.Sprintf("%q listens on every address", listen)
	}
	return what + "; the endpoint has no authentication and its metrics name pods and containers. " +
		"Listen on 127.0.0.1 (or ::1) and let a local agent scrape it, or firewall the port"
}
