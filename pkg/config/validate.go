package config

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/gpuid"
)

// ErrInvalid is wrapped by every error Validate returns.
var ErrInvalid = errors.New("invalid configuration")

var (
	pluginIdxPattern = regexp.MustCompile(`^[0-9]{2}$`)
	pluginNameRE     = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]*$`)
)

// Validate checks every key and reports all problems at once, each naming the
// key, the bad value and what is accepted.
func (c *Config) Validate() error {
	var errs []error
	bad := func(key, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: %s: %s", ErrInvalid, key, fmt.Sprintf(format, args...)))
	}
	oneOf := func(key string, value string, allowed ...string) {
		for _, a := range allowed {
			if value == a {
				return
			}
		}
		bad(key, "invalid value %q (want one of: %s)", value, strings.Join(allowed, ", "))
	}
	positive := func(key string, d Duration) {
		if d.Duration <= 0 {
			bad(key, "must be a positive duration, got %q", d.String())
		}
	}

	if c.Version != CurrentVersion {
		bad("version", "unsupported version %d (this build reads version %d)", c.Version, CurrentVersion)
	}

	if c.Ledger.Dir == "" || !filepath.IsAbs(c.Ledger.Dir) {
		bad("ledger.dir", "must be an absolute path, got %q", c.Ledger.Dir)
	}
	positive("ledger.lock_timeout", c.Ledger.LockTimeout)
	if c.Ledger.AuditMaxBytes < 4096 {
		bad("ledger.audit_max_bytes", "must be at least 4096, got %d", c.Ledger.AuditMaxBytes)
	}

	oneOf("devices.source", string(c.Devices.Source),
		string(SourceAuto), string(SourceNVML), string(SourceProc), string(SourceStatic))
	if c.Devices.ProcRoot == "" || !filepath.IsAbs(c.Devices.ProcRoot) {
		bad("devices.proc_root", "must be an absolute path, got %q", c.Devices.ProcRoot)
	}
	if c.Devices.Source == SourceStatic && len(c.Devices.Static) == 0 {
		bad("devices.static", "source is \"static\" but no [[devices.static]] GPU is listed")
	}
	c.validateStatic(bad)

	oneOf("policy.on_conflict", string(c.Policy.OnConflict), string(ConflictQueue), string(ConflictReject))
	oneOf("policy.release_on", string(c.Policy.ReleaseOn), string(ReleaseOnStop), string(ReleaseOnRemove))
	oneOf("policy.all_devices", string(c.Policy.AllDevices), string(AllClaim), string(AllReject), string(AllIgnore))
	oneOf("policy.privileged", string(c.Policy.Privileged),
		string(PrivilegedDeclared), string(PrivilegedAll), string(PrivilegedReject))
	oneOf("policy.unknown_device", string(c.Policy.UnknownDevice), string(UnknownReject), string(UnknownIgnore))
	positive("policy.reservation_ttl", c.Policy.ReservationTTL)
	positive("policy.queue_ttl", c.Policy.QueueTTL)
	seenNS := map[string]bool{}
	for i, ns := range c.Policy.ExemptNamespaces {
		key := fmt.Sprintf("policy.exempt_namespaces[%d]", i)
		switch {
		case strings.TrimSpace(ns) == "":
			bad(key, "empty namespace")
		case seenNS[ns]:
			bad(key, "namespace %q is listed twice", ns)
		}
		seenNS[ns] = true
	}

	if !pluginNameRE.MatchString(c.NRI.PluginName) {
		bad("nri.plugin_name", "invalid name %q (letters, digits, '-', '_', '.'; no index prefix)", c.NRI.PluginName)
	}
	if !pluginIdxPattern.MatchString(c.NRI.PluginIndex) {
		bad("nri.plugin_index", "must be two digits such as \"90\", got %q", c.NRI.PluginIndex)
	}
	if c.NRI.Socket == "" || !filepath.IsAbs(c.NRI.Socket) {
		bad("nri.socket", "must be an absolute path, got %q", c.NRI.Socket)
	}

	positive("hook.wait_timeout", c.Hook.WaitTimeout)
	positive("hook.poll_interval", c.Hook.PollInterval)
	if c.Hook.PollInterval.Duration > 0 && c.Hook.WaitTimeout.Duration > 0 &&
		c.Hook.PollInterval.Duration > c.Hook.WaitTimeout.Duration {
		bad("hook.poll_interval", "%s is longer than hook.wait_timeout %s", c.Hook.PollInterval, c.Hook.WaitTimeout)
	}

	if c.Metrics.Listen != "" {
		if _, _, err := net.SplitHostPort(c.Metrics.Listen); err != nil {
			bad("metrics.listen", "want host:port such as \"127.0.0.1:9464\", got %q", c.Metrics.Listen)
		}
	}
	return errors.Join(errs...)
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
