package config

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strings"
	"time"

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
		if _, _, err := net.SplitHostPort(c.Metrics.Listen); err != nil {
			v.bad("metrics.listen", "want host:port such as \"127.0.0.1:9464\", got %q", c.Metrics.Listen)
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

func (v *problems) positive(key string, d Duration) {
	if d.Duration <= 0 {
		v.bad(key, "must be a positive duration, got %q", d.String())
	}
}

func (v *problems) absPath(key, path string) {
	if path == "" || !filepath.IsAbs(path) {
		v.bad(key, "must be an absolute path, got %q", path)
	}
}

func (c *Config) validateLedger(v *problems) {
	v.absPath("ledger.dir", c.Ledger.Dir)
	v.positive("ledger.lock_timeout", c.Ledger.LockTimeout)
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
	v.positive("policy.reservation_ttl", c.Policy.ReservationTTL)
	v.positive("policy.queue_ttl", c.Policy.QueueTTL)
	seenNS := map[string]bool{}
	for i, ns := range c.Policy.ExemptNamespaces {
		key := fmt.Sprintf("policy.exempt_namespaces[%d]", i)
		switch {
		case strings.TrimSpace(ns) == "":
			v.bad(key, "empty namespace")
		case seenNS[ns]:
			v.bad(key, "namespace %q is listed twice", ns)
		}
		seenNS[ns] = true
	}
}

func (c *Config) validateNRI(v *problems) {
	if !pluginNameRE.MatchString(c.NRI.PluginName) {
		v.bad("nri.plugin_name", "invalid name %q (letters, digits, '-', '_', '.'; no index prefix)", c.NRI.PluginName)
	}
	if !pluginIdxPattern.MatchString(c.NRI.PluginIndex) {
		v.bad("nri.plugin_index", "must be two digits such as \"90\", got %q", c.NRI.PluginIndex)
	}
	v.absPath("nri.socket", c.NRI.Socket)
}

func (c *Config) validateHook(v *problems) {
	v.positive("hook.wait_timeout", c.Hook.WaitTimeout)
	v.positive("hook.poll_interval", c.Hook.PollInterval)
	if c.Hook.PollInterval.Duration > 0 && c.Hook.WaitTimeout.Duration > 0 &&
		c.Hook.PollInterval.Duration > c.Hook.WaitTimeout.Duration {
		v.bad("hook.poll_interval", "%s is longer than hook.wait_timeout %s", c.Hook.PollInterval, c.Hook.WaitTimeout)
	}
}

// maxIdleGrace bounds observe.idle_grace: a draining claim must end, and an
// hour is far beyond the seconds a stopping process needs to free GPU memory.
const maxIdleGrace = time.Hour

// maxXid bounds observe.xids: NVIDIA's catalogue numbers Xids in the low
// hundreds; anything far beyond is a typo.
const maxXid = 65535

func (c *Config) validateObserve(v *problems) {
	if c.Observe.Interval.Duration < 0 {
		v.bad("observe.interval", "must not be negative (0 disables the accounting), got %q", c.Observe.Interval.String())
	} else if c.Observe.Interval.Duration > 0 && c.Observe.Interval.Duration < time.Second {
		v.bad("observe.interval", "must be at least 1s (or 0 to disable), got %q", c.Observe.Interval.String())
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
