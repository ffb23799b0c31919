// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// DeviceStates are the guard's persistent device states the observer's
// policy changes: a cordon keeps new claims off a device (both front ends
// read it from the ledger), and a draining claim (release_requires_idle) is
// kept until its holder's processes have left the device.
type DeviceStates interface {
	// CordonDevice cordons uuid; source is "intruder" or "unhealthy". It
	// returns the cordon in force on the device once the request is
	// decided, and whether that is another source's cordon, kept instead
	// of this request's (kept: it ranks higher, ledger.CordonKept; the
	// request was only audited). With kept false it is this request's.
	CordonDevice(ctx context.Context, uuid, source, reason string) (inForce ledger.Cordon, kept bool, err error)
	// CordonsInForce lists the cordons in force, and the lineage of the
	// ledger state that holds them (one read).
	CordonsInForce(ctx context.Context) (cordons []ledger.Cordon, lineage string, err error)
	// Draining lists the claims kept draining.
	Draining(ctx context.Context) ([]ledger.Claim, error)
	// FinishDraining releases the draining claims of containerID.
	FinishDraining(ctx context.Context, containerID, reason string) error
}

// guardStates is DeviceStates over a guard: its own operations, and the
// cordon and lineage read from one snapshot of its ledger.
type guardStates struct{ *guard.Guard }

// The guard implements DeviceStates (a signature change fails here).
var _ DeviceStates = guardStates{}

func (s guardStates) CordonDevice(ctx context.Context, uuid, source, reason string) (ledger.Cordon, bool, error) {
	return s.CordonDeviceInForce(ctx, uuid, source, reason)
}

func (s guardStates) CordonsInForce(ctx context.Context) ([]ledger.Cordon, string, error) {
	st, err := s.Ledger().Snapshot(ctx)
	if err != nil {
		return nil, "", err
	}
	return st.Cordons, st.Lineage, nil
}

// statesOf returns the device-state operations of g.
func statesOf(g *guard.Guard) DeviceStates { return guardStates{g} }

// WatchMetrics receives what the observer saw (metrics.Metrics).
type WatchMetrics interface {
	ObserverReport(r observe.Report)
	// UnhealthyDevices shows the devices held unhealthy now (the whole
	// set: a device no longer in it is no longer unhealthy).
	UnhealthyDevices(fs []observe.Finding)
}

// Audit operations the observer's policy writes.
const (
	OpIntruder       = "intruder"
	OpOutOfBounds    = "out-of-bounds"
	OpUnhealthy      = "unhealthy"
	OpFindingCleared = "finding-cleared"
)

// Watch runs the GPU observer for the daemon and applies its policy: every
// finding is logged (once, when it appears, and again when it clears),
// audited, counted and written to observe.json in the state directory; under
// on_intruder = "cordon" the device of an intruder is cordoned, and an
// unhealthy device always is; under release_requires_idle the draining
// claims whose holder has left the device are released.
//
// Use hands it each guard the daemon builds; Run does the work in its own
// goroutines, so that nothing of it ever runs on the admission path.
type Watch struct {
	// Logger; nil = discard.
	Logger *slog.Logger
	// Metrics; nil = none.
	Metrics WatchMetrics
	// OpenNVML opens NVML as the observer's source; nil = the host's
	// library (observe.OpenNVML(nil)).
	OpenNVML func() (observe.Source, error)
	// ProcRoot holds the host's proc/ ("/" when empty).
	ProcRoot string
	// States overrides statesOf (tests).
	States func(g *guard.Guard) DeviceStates
	// Now is the clock of the idle grace; nil = time.Now.
	Now func() time.Time
	// Interval overrides [observe] interval when positive (tests: the
	// configuration allows no less than 1s).
	Interval time.Duration
	// After is the timer an observer that runs no accounting pass waits
	// on between two settlings of its unhealthy devices (settleLoop);
	// nil = time.NewTimer (tests inject one).
	After func(time.Duration) <-chan time.Time

	guards chan *guard.Guard
	// afterReport, when set (tests), runs after each report read was
	// handled: its findings acted on and the unhealthy devices settled.
	afterReport func()
	// settled, when set (tests), runs after each settling of settleLoop.
	settled func()
	// guardTaken, when set (tests), runs after Run has acted on each guard
	// handed to it (an observer started, kept, or none for a guard that
	// knows no GPU yet).
	guardTaken func()
	// refused, when set (tests), runs when a pass was refused the ledger
	// because the plugin is not ready.
	refused func()
	// crashAt, when set (tests), is asked at each point of a pass between
	// a write to the ledger and one to the carry file (crash); true
	// abandons the pass there, as a daemon that died there would.
	crashAt func(point string) bool

	// healthMu makes the unhealthy devices' policy one step at a time:
	// onUnhealthy and settleUnhealthy. With accounting passes both run on
	// the observer's callback goroutine; without (settleLoop) settling
	// runs on a goroutine of its own, and a settling that read the
	// unhealthy devices while a new one was being cordoned would judge
	// that cordon missing (lost: written again as such). Taken before mu,
	// never while holding it.
	healthMu sync.Mutex

	mu sync.Mutex
	g  *guard.Guard
	// notReady is set while the plugin is not synchronized with the
	// runtime (SetReady): the observer is refused the ledger then, and
	// reports are not acted on. readyEpoch counts the SetReady(true) calls:
	// a report is acted on only if it was read in the current one (see
	// SetReady).
	notReady   bool
	readyEpoch uint64
	// exempt are the containers of exempt namespaces the runtime runs
	// (SetExempt, ResetExempt): they use GPUs without claims, and the
	// observer must not take them for intruders.
	exempt map[string]string // container id → cgroupsPath
	// What observe.json shows: the findings of the last pass (by key), the
	// devices found unhealthy, the devices the last pass could not list
	// (unlisted, after lastPass) and those it found that the inventory
	// lacks (notInInventory, after lastPass).
	reported  map[string]observe.FileFinding
	unhealthy []observe.Finding
	// cordonFailed: unhealthy devices whose cordon could not be written,
	// with the reason to write (settleUnhealthy retries them).
	cordonFailed map[string]string
	// cordonLineage: for each cordon the observer wrote, or found kept
	// in force instead of its own (ledger.CordonKept), by source and
	// device, the ledger lineage it was written in or last seen in force
	// in ("" when it could not be read): settleUnhealthy and
	// settleIntruders tell an operator's uncordon from a cordon lost with
	// the state by it (cordonLost).
	cordonLineage map[cordonKey]string
	// healthSeen: for each unhealthy device whose cordon settleUnhealthy
	// found in force, the running observer's HealthSeq read before it
	// found it so (none: 0): a device found uncordoned that failed again
	// after it (a newer critical Xid) is cordoned again, not forgotten.
	healthSeen map[string]uint64
	// intruderRetry: devices whose intruder cordon could not be written
	// (onReport retries them while a finding on the device is reported).
	intruderRetry map[string]observe.FileFinding
	// observing: what the running observer was started with (start).
	observing observerRun
	// settleWake, while an observer that runs no accounting pass runs,
	// wakes its settleLoop: a device was found unhealthy (onUnhealthy),
	// and its cordon may now be pending or watched.
	settleWake chan struct{}
	// carryTaken: an observer that watches health (NVML opened) was
	// started; the first one took over the carry file of the daemon
	// before (readPrior): its unhealthy devices at once, its findings too
	// if it accounts. From then on this daemon writes the file.
	carryTaken bool
	// accounted: an observer that runs accounting passes was started; the
	// first one took over the findings of the daemon before, from held
	// when an observer that does not account took them over first (same
	// state directory: heldDir), from the carry file otherwise.
	accounted bool
	// held: the findings of the daemon before (its unhealthy devices
	// aside), taken over from its carry file in heldDir by an observer
	// that runs no accounting pass ([observe] interval = "0s"), which
	// neither reports nor clears them: kept as they were for the first
	// observer that accounts, and written back as they were in the carry
	// file meanwhile (writeCarryWith), for the daemon after.
	held    *priorFindings
	heldDir string
	// carried: what the carry file was last written with (writeCarry), so
	// that a pass that changes nothing of it does not write it again.
	carried        string
	lastPass       time.Time
	unlisted       []observe.UnlistedDevice
	notInInventory []observe.NotInInventoryDevice
	interval       time.Duration
}

// NewWatch returns a Watch; set its fields before Run.
func NewWatch() *Watch { return &Watch{guards: make(chan *guard.Guard, 1)} }

// Use hands the watch the guard the daemon now decides with. It never
// blocks: the latest guard wins.
func (w *Watch) Use(g *guard.Guard) {
	for {
		select {
		case w.guards <- g:
			return
		default:
		}
		select {
		case <-w.guards: // drop the older one not yet taken
		default:
		}
	}
}

// SetReady tells the watch whether the plugin is registered and
// synchronized with the runtime. Until it is, the observer's passes are
// refused the ledger (holdings) and so make no report: before Synchronize
// (or before the plugin's rebuild of a ledger started afresh) the ledger
// has not yet adopted the containers created while the plugin was down, and
// their processes would be taken for intruders (and their devices
// cordoned).
//
// Readiness is what it was when a pass read the ledger, not when its report
// arrives: a pass reads the ledger, then waits up to its interval for NVML,
// and the plugin may lose and regain readiness meanwhile (a reconnect, a
// rebuild in place), the ledger then adopting containers the pass's view
// lacks. Each SetReady(true) starts a new epoch; a report read in an
// earlier one is dropped (onReport). A Watch never told is ready.
func (w *Watch) SetReady(ready bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.notReady = !ready
	if ready {
		w.readyEpoch++
	}
}

// actsOn reports whether a report whose ledger view was read in epoch is
// acted on: the plugin is ready now and has stayed so since the read.
func (w *Watch) actsOn(epoch uint64) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return !w.notReady && epoch == w.readyEpoch
}

func (w *Watch) log() *slog.Logger {
	if w.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return w.Logger
}

func (w *Watch) now() time.Time {
	if w.Now == nil {
		return time.Now()
	}
	return w.Now()
}

func (w *Watch) guard() *guard.Guard {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.g
}

func (w *Watch) states() DeviceStates {
	g := w.guard()
	if g == nil {
		return nil
	}
	if w.States != nil {
		return w.States(g)
	}
	return statesOf(g)
}

// watchKey is what an observer is built from: a guard with the same key
// keeps the running observer.
type watchKey struct {
	gpus    []devices.GPU
	observe config.ObserveConfig
	dir     string
}

// Run observes until ctx ends: it waits for the first guard, opens NVML once
// (without NVML, one log line says the observer is off), and restarts the
// observer when a new guard comes with another inventory or [observe]
// section. NVML that failed to open is tried again only when the guards'
// inventory comes from a discovery that works at last (see reopen). On a
// clean stop it removes observe.json.
func (w *Watch) Run(ctx context.Context) {
	log := w.log()
	var (
		src      observe.Source
		srcErr   error
		opened   bool
		key      *watchKey
		stop     = func() {}
		stateDir string
		// provisional: the inventory of the last guard is one a Builder
		// decides with until its discovery works (Inventory.Provisional).
		provisional bool
	)
	defer func() {
		stop()
		if src != nil {
			if err := src.Close(); err != nil {
				log.Warn("GPU observer: closing NVML failed", "error", err)
			}
		}
		if stateDir != "" {
			if err := observe.RemoveFile(stateDir); err != nil {
				log.Warn("GPU observer", "error", err)
			}
		}
	}()
	for {
		var g *guard.Guard
		select {
		case <-ctx.Done():
			return
		case g = <-w.guards:
		}
		if g.Inventory().Undiscovered {
			// No GPU is known yet (a discovery still running behind a
			// Configure that had to answer, or one that failed): an
			// observer over it would watch nothing, and its start would
			// drop everything carried (the findings and pending cordons
			// of the observer before it, or of the daemon before this
			// one), which only devices it lists keep. The observer that
			// runs, if any, goes on with its guard until a guard that
			// knows its GPUs arrives (Builder.Rediscover).
			w.mu.Lock()
			if w.g == nil {
				w.g = g
			}
			w.mu.Unlock()
			log.Info("GPU observer: waiting for the GPU discovery; the observer (if one runs) keeps its devices and findings until it lands")
			w.tookGuard()
			continue
		}
		w.mu.Lock()
		w.g = g
		w.mu.Unlock()
		cfg := g.Config()
		k := watchKey{gpus: g.Inventory().GPUs, observe: cfg.Observe, dir: g.Ledger().Dir()}
		wasProvisional := provisional
		provisional = g.Inventory().Provisional
		retry := src == nil && reopen(key, k, wasProvisional, provisional)
		if key != nil && reflect.DeepEqual(*key, k) && !retry {
			w.tookGuard()
			continue // a reconnect: same observer, the new guard acts on its findings
		}
		stop()
		stop = func() {}
		key = &k
		if !opened || retry {
			opened = true
			open := w.OpenNVML
			if open == nil {
				open = func() (observe.Source, error) { return observe.OpenNVML(nil) }
			}
			src, srcErr = open()
			if srcErr != nil {
				log.Warn("GPU observer off: NVML is not available (no NVIDIA driver?); no process accounting, health watching or idle check",
					"error", srcErr)
				if cfg.Observe.ReleaseRequiresIdle {
					log.Warn("release_requires_idle cannot check the devices without NVML: draining claims are released after observe.idle_grace")
				}
			}
		}
		if stateDir != "" && stateDir != k.dir {
			_ = observe.RemoveFile(stateDir)
		}
		stateDir = k.dir
		stop = w.start(ctx, src, k, cfg)
		w.tookGuard()
	}
}

// crash tells whether a test has the daemon die at point (crashAt).
func (w *Watch) crash(point string) bool { return w.crashAt != nil && w.crashAt(point) }

// tookGuard tells a test that Run has acted on a guard (guardTaken).
func (w *Watch) tookGuard() {
	if w.guardTaken != nil {
		w.guardTaken()
	}
}

// reopen reports whether NVML, which failed to open, is tried again for the
// guard of key k, that of key prev (nil: none yet) precedes; wasProvisional
// and provisional say whether their inventories are provisional (see
// devices.Inventory.Provisional). It is, once the inventory lists GPUs after one that
// listed none (the driver came up after the daemon) or after one a failed
// discovery left (the cache of an earlier boot: the NVML library was not
// there yet): Builder.Rediscover swaps in what a discovery that works
// lists, and the library it found may be there to open now. The cache
// most often lists the very GPUs discovered, so the GPUs alone do not tell.
// Nothing else retries: a reconnect, or another [observe] section, says
// nothing new about NVML, and each retry that fails logs again.
func reopen(prev *watchKey, k watchKey, wasProvisional, provisional bool) bool {
	if prev == nil || len(k.gpus) == 0 {
		return false
	}
	return len(prev.gpus) == 0 || (wasProvisional && !provisional)
}

// start runs an observer (when NVML is there) and the draining check for
// one configuration; the returned func stops both and waits for them.
func (w *Watch) start(ctx context.Context, src observe.Source, k watchKey, cfg config.Config) func() {
	log := w.log()
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	interval := cfg.Observe.Interval.Duration
	if w.Interval > 0 {
		interval = w.Interval
	}
	var (
		inLedger  []observe.Finding
		inLineage string
		prior     *priorFindings
	)
	// health: the observer watches health (Run does whatever the
	// interval), and so finds unhealthy devices to carry; accounts: it
	// also runs accounting passes.
	health := src != nil
	accounts := health && interval > 0
	readNow := health && w.priorToRead(k.dir, accounts)
	if health {
		// Read before w.mu: never held across a ledger read. The
		// ledger's unhealthy cordons are adopted whatever the interval:
		// an observer that runs no accounting pass ([observe] interval
		// = "0s") settles its unhealthy devices all the same
		// (settleLoop). The ones the daemon before found (its carry
		// file, read by the first observer that watches health) are
		// carried too, as the health watcher's own are: NVML reports an
		// Xid once. Without NVML nothing is read: no observer of this
		// daemon found anything to carry or settles anything, and the
		// carry file is left to one that runs.
		cordons, lineage, read := w.ledgerCordons(ctx)
		inLedger, inLineage = unhealthyOf(cordons), lineage
		if readNow {
			prior = w.readPrior(k.dir, accounts, cordons, lineage, read)
		}
	}
	next := observerRun{dir: k.dir, cordons: cfg.Observe.OnIntruder == config.IntruderCordon}
	w.mu.Lock()
	if health {
		w.takeOverLocked(k.dir, accounts, readNow, prior)
	}
	c := w.carryLocked(k.gpus, next, interval > 0, inLedger, inLineage)
	lastReport := w.lastPass
	w.reported, w.unhealthy, w.unlisted, w.notInInventory, w.lastPass = c.reported, c.unhealthy, nil, nil, c.lastPass
	w.cordonFailed, w.cordonLineage, w.intruderRetry = c.cordonFailed, c.lineages, c.intruderRetry
	w.healthSeen = nil // the new observer's sequence starts afresh
	w.interval, w.observing, w.settleWake = interval, next, nil
	// The new observer starts with what was carried over, and the gauges
	// show it as observe.json does: a finding not carried loses its series
	// (the time of the last report stays what it was).
	w.showUnhealthyLocked()
	if w.Metrics != nil && !lastReport.IsZero() {
		r := observe.Report{Time: lastReport}
		for _, f := range c.reported {
			r.Findings = append(r.Findings, f.Finding)
		}
		w.Metrics.ObserverReport(r)
	}
	w.mu.Unlock()
	for _, f := range c.adopted {
		log.Info("unhealthy device's cordon found in the ledger: the device stays unhealthy, cordoned again if the ledger loses the cordon, until `gpu-guard-ctl uncordon`",
			"device", f.Device.String(), "device_uuid", f.Device.UUID, "reason", f.Message)
	}

	var o *observe.Observer
	if src != nil {
		var err error
		o, err = observe.New(observe.Options{
			Source: src, GPUs: k.gpus, ProcRoot: w.ProcRoot,
			Ledger:   observe.EpochLedgerFunc(func() ([]observe.Holding, uint64, error) { return w.holdingsAt(ctx) }),
			Interval: interval,
			Xids:     cfg.Observe.Xids,
			OnReport: func(r observe.Report) {
				w.onReport(ctx, cfg, r)
				w.settleUnhealthy(ctx, o)
				if w.afterReport != nil && !r.Skipped {
					w.afterReport()
				}
			},
			OnUnhealthy:    func(f observe.Finding) { w.onUnhealthy(ctx, f) },
			OnUnidentified: func(f observe.Finding) { w.onUnidentified(ctx, f) },
			Logger:         log.With("component", "observer"),
		})
		if err != nil {
			log.Error("GPU observer off: bad options", "error", err)
			o = nil
		} else {
			log.Info("GPU observer running", "interval", interval.String(), "on_intruder", string(cfg.Observe.OnIntruder),
				"devices", len(o.Devices()), "xids", len(cfg.Observe.Xids))
			w.writeFile()
			if !accounts {
				// No pass settles the unhealthy devices (OnReport):
				// settleLoop does, from now on.
				wake := make(chan struct{}, 1)
				w.mu.Lock()
				w.settleWake = wake
				w.mu.Unlock()
				wg.Add(1)
				go func() { defer wg.Done(); w.settleLoop(ctx, wake, o) }()
			}
			wg.Add(1)
			go func() { defer wg.Done(); o.Run(ctx) }()
		}
	}
	if cfg.Observe.ReleaseRequiresIdle {
		drainEvery := w.drainPeriod(cfg)
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(drainEvery)
			defer t.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
					w.drainOnce(ctx, cfg, o)
				}
			}
		}()
	}
	return func() { cancel(); wg.Wait() }
}

// observerRun is what the running observer was started with that the next
// one carries its findings by (carryLocked): the ledger they are judged
// against, and whether its policy cordons intruders' devices.
type observerRun struct {
	dir     string
	cordons bool
}

// observerCarry is what an observer that starts takes over from the one
// before it (carryLocked).
type observerCarry struct {
	unhealthy    []observe.Finding
	cordonFailed map[string]string
	lineages     map[cordonKey]string
	// adopted: the unhealthy devices adopted from the ledger's cordons.
	adopted       []observe.Finding
	reported      map[string]observe.FileFinding
	intruderRetry map[string]observe.FileFinding
	lastPass      time.Time
}

// carryLocked returns what the observer that starts over gpus, for next,
// begins with; accounts tells whether it runs accounting passes. w.mu is
// held.
//
// A restart of the observer (a reconnect with another [observe] section,
// an inventory swap, NVML reopened) changes nothing on the host: a device
// that failed is still broken, a process that ran without a claim still
// runs. What the policy knows of both is carried, for every device gpus
// still lists (a device it no longer lists is dropped: no claim can name
// it, nor can the new observer watch it; a carried finding takes the
// device as gpus lists it, its index may have changed):
//
//   - Every unhealthy device, not only those whose cordon could not be
//     written yet (cordonFailed): a new observer knows of no unhealthy
//     device, and NVML reports a critical Xid once, as an event. Dropped,
//     a device whose cordon could not be written read as healthy and took
//     new claims; one whose cordon was written kept it only until the
//     ledger lost it with its state (a reset, a recovery that starts a new
//     lineage), as nothing re-cordoned it before its next Xid.
//   - The findings of the last pass (intruders, out of bounds), and the
//     intruder cordons pending a retry (intruderRetry): dropped, the first
//     pass of the new observer took every process still running for a new
//     finding, logged and audited it again and, under on_intruder =
//     "cordon", cordoned its device again, although the operator had
//     lifted that cordon (accepting the process). A carried finding whose
//     process has gone by that pass is cleared by it, as any other
//     (finding-cleared). They are carried only to an observer that runs
//     accounting passes (none would clear them) over the same ledger: a
//     finding is a process the claims of that ledger do not account for,
//     and another ledger judges it afresh (its audit log records it).
//   - The lineage of each cordon the observer wrote or saw in force
//     (cordonLineage), with the finding it is for: a missing cordon is
//     still told apart, lifted by the operator in the same lineage
//     (forgotten, and the same finding does not cordon again) or lost in
//     another (written again). Without it, an operator's uncordon would read
//     as a loss (cordonLost errs toward cordoning).
//
// An observer that cordons intruders after one that did not (on_intruder
// changed from "report" to "cordon") has the device of each carried
// finding no cordon is known for cordoned at its first pass, as a pending
// retry: the old policy never cordoned it, and the finding is not new to
// the new one.
//
// The daemon's first observer that accounts carries the same way what the
// daemon before it recorded (adoptPriorLocked, from its carry file: see
// readPrior), as if it were the observer before; its unhealthy devices,
// the first observer that watches health, whatever the interval
// (takeOverLocked).
//
// inLedger are the unhealthy cordons in force in the ledger, read in
// lineage (unhealthyOf; for every observer that watches health, whatever
// the interval: one that runs no pass settles them too, see settleLoop):
// one on a device not carried is adopted,
// seen in force in lineage, and returned in adopted too. That is the
// daemon's restart (a new Watch holds nothing), or a device an inventory
// left and lists again: its cordon stands in the ledger, and the device
// stays unhealthy, as if this observer had found it. Intruder cordons are
// adopted only for a finding carried (readPrior): the finding they were
// written for is not in the ledger.
func (w *Watch) carryLocked(gpus []devices.GPU, next observerRun, accounts bool, inLedger []observe.Finding, lineage string) observerCarry {
	var c observerCarry
	listed := map[string]observe.Device{}
	for _, d := range observe.DevicesOf(gpus) {
		listed[d.UUID] = d
	}
	// carried: the devices of the findings carried, by the source of the
	// cordons written for them; their lineages go with them.
	carried := map[string]map[string]bool{ledger.CordonUnhealthy: {}, ledger.CordonIntruder: {}}
	for _, f := range w.unhealthy {
		uuid := f.Device.UUID
		d, ok := listed[uuid]
		if !ok {
			continue
		}
		f.Device = d
		c.unhealthy = append(c.unhealthy, f)
		carried[ledger.CordonUnhealthy][uuid] = true
		if reason, ok := w.cordonFailed[uuid]; ok {
			if c.cordonFailed == nil {
				c.cordonFailed = map[string]string{}
			}
			c.cordonFailed[uuid] = reason
		}
	}
	c.reported = map[string]observe.FileFinding{}
	if accounts && next.dir == w.observing.dir {
		for k, f := range w.reported {
			d, ok := listed[f.Device.UUID]
			if !ok {
				continue
			}
			f.Device = d
			c.reported[k] = f
			carried[ledger.CordonIntruder][d.UUID] = true
		}
		for uuid, f := range w.intruderRetry {
			if carried[ledger.CordonIntruder][uuid] {
				if c.intruderRetry == nil {
					c.intruderRetry = map[string]observe.FileFinding{}
				}
				f.Device = listed[uuid]
				c.intruderRetry[uuid] = f
			}
		}
		c.lastPass = w.lastPass // when the findings carried were seen (observe.json's time)
	}
	for k, seen := range w.cordonLineage {
		if carried[k.source][k.uuid] {
			if c.lineages == nil {
				c.lineages = map[cordonKey]string{}
			}
			c.lineages[k] = seen
		}
	}
	for _, f := range inLedger {
		d, ok := listed[f.Device.UUID]
		if !ok || carried[ledger.CordonUnhealthy][d.UUID] {
			continue
		}
		f.Device = d
		c.unhealthy = append(c.unhealthy, f)
		if c.lineages == nil {
			c.lineages = map[cordonKey]string{}
		}
		c.lineages[cordonKey{ledger.CordonUnhealthy, d.UUID}] = lineage
		c.adopted = append(c.adopted, f)
	}
	if next.cordons && !w.observing.cordons {
		fs := slices.Collect(maps.Values(c.reported))
		sortFindings(fs)
		for _, f := range fs {
			uuid := f.Device.UUID
			if _, known := c.lineages[cordonKey{ledger.CordonIntruder, uuid}]; known {
				continue
			}
			if _, pending := c.intruderRetry[uuid]; pending {
				continue
			}
			if c.intruderRetry == nil {
				c.intruderRetry = map[string]observe.FileFinding{}
			}
			c.intruderRetry[uuid] = f
		}
	}
	return c
}

// ledgerCordons returns the cordons in force in the ledger and the lineage
// of the state read (read: whether it could be read), for the observer that
// starts: the unhealthy ones are adopted (unhealthyOf, carryLocked), the
// intruder ones settle the findings of the daemon before (readPrior). A
// ledger that cannot be read adopts nothing (logged): the cordons stand in
// it all the same, but an unhealthy one lost later is not written again
// before the device's next critical error.
//
// A state of an earlier boot reads without the observer's cordons
// (ledger.Snapshot, as its next update drops them): a reboot is not taken
// for a loss.
func (w *Watch) ledgerCordons(ctx context.Context) (cordons []ledger.Cordon, lineage string, read bool) {
	s := w.states()
	if s == nil {
		return nil, "", false
	}
	ks, lineage, err := s.CordonsInForce(ctx)
	if err != nil {
		if ctx.Err() == nil {
			w.log().Warn("GPU observer: cannot read the ledger's cordons; an unhealthy device cordoned before this observer started is not cordoned again should the ledger lose its cordon",
				"error", err)
		}
		return nil, "", false
	}
	return ks, lineage, true
}

// unhealthyOf returns a finding for each cordon from source unhealthy in
// cordons, for carryLocked to adopt. The finding's message is the cordon's
// reason, without the prefix of a cordon written again (settleUnhealthy
// adds it again should the cordon be lost once more); its time is when the
// device was cordoned; its Xid is not known (only the reason names it).
func unhealthyOf(cordons []ledger.Cordon) []observe.Finding {
	var out []observe.Finding
	for _, k := range cordons {
		if k.Source != ledger.CordonUnhealthy {
			continue
		}
		// The device as the inventory lists it is filled in by
		// carryLocked, which drops one it does not list.
		out = append(out, observe.Finding{Kind: observe.KindUnhealthy, Device: observe.Device{UUID: k.Device.UUID},
			Time: k.Since, Message: strings.TrimPrefix(k.Reason, recordonReason)})
	}
	return out
}

// holdingsAt is the observer's view of the ledger: every claim of the
// current guard's ledger, and the exempt containers, which may use any GPU,
// with the readiness epoch it was read in. While the plugin is not ready it
// is refused (observe.ErrLedgerNotReady): neither the ledger nor the exempt
// set holds the containers the runtime started meanwhile. The epoch is taken
// before the reads, so that a SetReady(true) during them makes the report
// stale rather than current.
func (w *Watch) holdingsAt(ctx context.Context) ([]observe.Holding, uint64, error) {
	w.mu.Lock()
	notReady, epoch, g := w.notReady, w.readyEpoch, w.g
	var exempt map[string]string
	if !notReady {
		exempt = maps.Clone(w.exempt)
	}
	w.mu.Unlock()
	if notReady {
		if w.refused != nil {
			w.refused()
		}
		return nil, 0, fmt.Errorf("%w: the NRI plugin is not synchronized with the runtime", observe.ErrLedgerNotReady)
	}
	st, err := g.Ledger().Snapshot(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("read the ledger: %w", err)
	}
	if err := g.Ledger().CheckLineage(&st); err != nil {
		// Started afresh by another process, which the plugin learns at
		// its next write (then not ready until rebuilt): the running
		// holders are missing from this state, and would be intruders.
		return nil, 0, fmt.Errorf("%w: %w", observe.ErrLedgerNotReady, err)
	}
	return Holdings(st.Claims, exempt), epoch, nil
}

// SetExempt records that container id, of a namespace in
// exempt_namespaces, runs (exempt) or is gone: the observer does not take
// its processes for intruders.
func (w *Watch) SetExempt(id, cgroup string, exempt bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !exempt {
		delete(w.exempt, id)
		return
	}
	if w.exempt == nil {
		w.exempt = map[string]string{}
	}
	w.exempt[id] = cgroup
}

// ResetExempt replaces the exempt containers with cgroups, container id →
// cgroupsPath (the runtime's list at a Synchronize).
func (w *Watch) ResetExempt(cgroups map[string]string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.exempt = maps.Clone(cgroups)
}

// findingKey names a finding across passes, and across daemons (the carry
// file): its kind, device and process, the pid with its start time, so that
// a pid reused by another process is another finding.
func findingKey(f observe.Finding) string {
	return fmt.Sprintf("%s|%s|%d|%d|%s", f.Kind, f.Device.UUID, f.PID, f.StartTicks, f.ContainerID)
}

// onReport applies the policy to one pass: new findings are logged, audited
// and (on_intruder = "cordon") cordoned, and the cordons that could not be
// written, or were lost with the ledger state, are written again while their
// device is still reported (planIntruderCordons); cleared ones are logged
// and audited; the metrics, observe.json and the carry file show the pass.
// The findings of a device the pass could not list are kept as they were:
// not seeing a process is no sign that it left.
func (w *Watch) onReport(ctx context.Context, cfg config.Config, r observe.Report) {
	if r.Skipped {
		return // no view was read; the caller settles unhealthy devices
	}
	if !w.actsOn(r.LedgerEpoch) {
		// Read while the plugin was not ready, or before it became ready
		// again: the view may lack containers the ledger has adopted since,
		// whose processes would read as intruders (and, under on_intruder
		// = "cordon", their devices cordoned for good). The next pass
		// reads the ledger afresh.
		w.log().Debug("GPU observer: report dropped: its ledger view predates the plugin's last synchronization",
			"ledger_epoch", r.LedgerEpoch)
		return
	}
	log := w.log()
	g := w.guard()
	var known map[string]ledger.Owner
	if st, err := g.Ledger().Snapshot(ctx); err == nil {
		known = st.Owners()
	}
	current := map[string]observe.FileFinding{}
	var notListed []observe.UnlistedDevice
	var outside []observe.NotInInventoryDevice
	unlisted := map[string]bool{} // devices NVML could not list this pass
	for _, d := range r.Devices {
		if d.Error != "" {
			notListed = append(notListed, observe.UnlistedDevice{Device: d.Device, Error: d.Error})
			unlisted[d.Device.UUID] = true
		}
		// A device the inventory lacks is no unlisted one: its processes
		// were listed (unless Error says otherwise), so its findings end
		// when they leave, as on any device. Carried as unlisted, they
		// would stand for as long as the device exists.
		if d.NotInInventory != "" {
			outside = append(outside, observe.NotInInventoryDevice{Device: d.Device, Notice: d.NotInInventory})
		}
	}
	for _, f := range r.Problems() {
		if f.Kind == observe.KindUnhealthy {
			continue // the health path handles it once (onUnhealthy; onUnidentified for a GPU NVML could not identify)
		}
		ff := observe.FileFinding{Finding: f}
		if ow, ok := known[f.ContainerID]; ok && f.ContainerID != "" {
			ff.Namespace, ff.Pod, ff.Container = ow.Namespace, ow.Pod, ow.Container
		}
		current[findingKey(f)] = ff
	}

	w.mu.Lock()
	prev := w.reported
	// A device NVML could not list (or that is lost: the MIG instances of
	// a lost GPU are not listed at all) was not seen this pass, and nothing
	// is concluded about it (observe.DeviceReport.Error): its findings
	// stand as the last pass that listed it saw them. Dropped, they would
	// read as the process leaving (finding-cleared, the cordon lineage and
	// a pending cordon retry forgotten), and the next pass that lists the
	// device would take the same process for a new finding and cordon the
	// device again, although the operator had lifted its cordon.
	// A finding on a MIG instance the inventory lacks is its GPU's
	// (observe.Finding.Instance), and the instance is the device that was
	// or was not listed.
	var carried []observe.Finding
	for k, f := range prev {
		if _, ok := current[k]; !ok && (unlisted[f.Device.UUID] || (f.Device.IsMIG() && unlisted[f.Device.ParentUUID]) ||
			(f.Instance != nil && unlisted[f.Instance.UUID])) {
			current[k] = f
			carried = append(carried, f.Finding)
		}
	}
	w.reported, w.unlisted, w.notInInventory, w.lastPass = current, notListed, outside, r.Time
	w.mu.Unlock()

	var fresh, cleared []observe.FileFinding
	for k, f := range current {
		if _, ok := prev[k]; !ok {
			fresh = append(fresh, f)
		}
	}
	for k, f := range prev {
		if _, ok := current[k]; !ok {
			cleared = append(cleared, f)
		}
	}
	sortFindings(fresh)
	sortFindings(cleared)
	for _, f := range fresh {
		log.Warn("GPU process not admitted by the guard", findingAttrs(f)...)
	}
	for _, f := range cleared {
		log.Info("GPU finding cleared: the process left the device", findingAttrs(f)...)
	}
	if len(fresh)+len(cleared) > 0 {
		w.audit(ctx, func(tx *ledger.Tx) {
			for _, f := range fresh {
				op := OpIntruder
				if f.Kind == observe.KindOutOfBounds {
					op = OpOutOfBounds
				}
				tx.Audit(op, auditOf(f))
			}
			for _, f := range cleared {
				rec := auditOf(f)
				rec.Reason = fmt.Sprintf("%s cleared: pid %d is no longer on %s", f.Kind, f.PID, f.Device)
				tx.Audit(OpFindingCleared, rec)
			}
		})
	}
	if cfg.Observe.OnIntruder == config.IntruderCordon {
		// The carry file is written before the cordons as well as after
		// when some are pending (see writeCarry): a crash between the two
		// writes must leave the next daemon a cordon to write, never a
		// cordon it takes for written (and, missing, for lifted by the
		// operator). A pass with none pending writes it once, after.
		p := w.planIntruderCordons(ctx, fresh, current)
		if p.pending {
			w.writeCarry()
		}
		if w.crash("intruder cordons pending") {
			return
		}
		w.writeIntruderCordons(ctx, p)
		if w.crash("intruder cordons written") {
			return
		}
	} else {
		// Under "report" no cordon is written or settled, but a lineage
		// must still go with the last finding on its device, as
		// settleIntruders drops it: carried to an observer that cordons
		// again, it would make the next process on the device read as one
		// whose cordon the operator lifted, never cordoned.
		w.mu.Lock()
		w.forgetIntruderLineagesLocked(findingsByDevice(current))
		w.mu.Unlock()
	}
	if w.Metrics != nil {
		// The gauges show what observe.json shows: the carried findings too.
		shown := r
		shown.Findings = append(slices.Clone(r.Findings), carried...)
		w.Metrics.ObserverReport(shown)
	}
	w.writeFile()
	w.writeCarry()
}

// intruderCordons are the intruder cordons one pass writes, by device
// (planIntruderCordons, writeIntruderCordons), in order.
type intruderCordons struct {
	todo  map[string]observe.FileFinding
	order []string
	// lost: the devices whose cordon the ledger lost with its state
	// (settleIntruders), written again.
	lost map[string]observe.FileFinding
	// pending: some cordon but those lost is to be written, recorded as
	// pending a retry (intruderRetry) until it is: the carry file is
	// written before the cordons only then (onReport). A lost one needs
	// no such write: its lineage record already names it lost.
	pending bool
}

// planIntruderCordons decides the intruder cordons of a pass: the device
// of each new finding (intruder or out of bounds), once per device, and
// the cordons that could not be written at an earlier pass (ledger lock
// busy, ledger being recovered) for as long as a finding on their device
// is still reported: a finding is new only at the pass that first sees it,
// so without the retry its process would run on a device that takes new
// claims. A retry whose device has no finding left is dropped: the
// process is gone, there is nothing to cordon for. The cordons written at
// earlier passes are checked too (settleIntruders): one lost with the
// ledger state is written again.
//
// Every cordon planned but those lost is recorded as pending a retry
// (intruderRetry) until writeIntruderCordons has written it: a carry file
// written in between (onReport) names it as one the next daemon writes
// unless the ledger shows a cordon in force on its device.
func (w *Watch) planIntruderCordons(ctx context.Context, fresh []observe.FileFinding, current map[string]observe.FileFinding) intruderCordons {
	w.mu.Lock()
	retry := w.intruderRetry // replaced below, once the pass's are known
	w.mu.Unlock()

	p := intruderCordons{todo: map[string]observe.FileFinding{}}
	add := func(f observe.FileFinding) {
		if _, ok := p.todo[f.Device.UUID]; !ok {
			p.todo[f.Device.UUID] = f
			p.order = append(p.order, f.Device.UUID)
		}
	}
	for _, f := range fresh {
		add(f)
	}
	if len(retry) > 0 {
		still := make([]observe.FileFinding, 0, len(current))
		for _, f := range current {
			if _, ok := retry[f.Device.UUID]; ok {
				still = append(still, f)
			}
		}
		sortFindings(still)
		for _, f := range still {
			add(f)
		}
		for _, uuid := range slices.Sorted(maps.Keys(retry)) {
			if _, ok := p.todo[uuid]; !ok {
				f := retry[uuid]
				w.log().Info("intruder cordon no longer retried: the process left the device before its cordon could be written",
					"device", f.Device.String(), "device_uuid", uuid, "pid", f.PID)
			}
		}
	}
	pending := maps.Clone(p.todo)
	p.lost = w.settleIntruders(ctx, current, p.todo)
	for _, uuid := range slices.Sorted(maps.Keys(p.lost)) {
		add(p.lost[uuid])
	}
	if len(pending) == 0 {
		pending = nil
	}
	p.pending = pending != nil
	w.mu.Lock()
	w.intruderRetry = pending
	w.mu.Unlock()
	return p
}

// writeIntruderCordons writes the cordons p planned; those that could not
// be written are retried at the next pass (intruderRetry), but for a lost
// one, whose lineage record still says it was lost.
func (w *Watch) writeIntruderCordons(ctx context.Context, p intruderCordons) {
	var failed map[string]observe.FileFinding
	var lineage string
	if len(p.order) > 0 {
		lineage = w.ledgerLineage(ctx) // read before the writes, once per pass
	}
	for _, uuid := range p.order {
		f := p.todo[uuid]
		reason := fmt.Sprintf("%s: pid %d (%s) runs on it without a claim", f.Kind, f.PID, ownerText(f))
		if f.Instance != nil {
			// The finding is the GPU's (observe.Finding.Instance): the
			// cordon says where on it the process runs.
			reason = fmt.Sprintf("%s: pid %d (%s) runs without a claim on its MIG instance %s (%s), which the inventory lacks (restart nri-gpu-guard)",
				f.Kind, f.PID, ownerText(f), f.Instance.Index, f.Instance.UUID)
		}
		_, again := p.lost[uuid]
		if again {
			reason = recordonReason + reason
		}
		if !w.cordonRecordedIn(ctx, f.Finding, ledger.CordonIntruder, reason, lineage) && !again {
			// A cordon lost that could not be written again needs no
			// retry: its record still names the lineage it was lost from.
			if failed == nil {
				failed = map[string]observe.FileFinding{}
			}
			failed[uuid] = f
		}
	}
	w.mu.Lock()
	w.intruderRetry = failed
	w.mu.Unlock()
}

// findingsByDevice returns a finding on each device of current, the first
// in findingKey order.
func findingsByDevice(current map[string]observe.FileFinding) map[string]observe.FileFinding {
	on := map[string]observe.FileFinding{}
	for _, f := range current {
		if prev, ok := on[f.Device.UUID]; !ok || findingKey(f.Finding) < findingKey(prev.Finding) {
			on[f.Device.UUID] = f
		}
	}
	return on
}

// forgetIntruderLineagesLocked drops the lineage of each intruder cordon
// whose device has no finding left in on (w.mu held): its process is gone,
// and the next intruder there is a new finding.
func (w *Watch) forgetIntruderLineagesLocked(on map[string]observe.FileFinding) {
	for k := range w.cordonLineage {
		if _, ok := on[k.uuid]; k.source == ledger.CordonIntruder && !ok {
			delete(w.cordonLineage, k)
		}
	}
}

// settleIntruders checks the intruder cordons written at earlier passes, as
// settleUnhealthy does the unhealthy ones, on the devices not cordoned at
// this pass anyway (todo):
//
//   - a device with no finding left is forgotten: its process is gone, and
//     its next intruder is a new finding (a device NVML could not list
//     keeps its findings in current: see onReport);
//   - a cordon in force records the lineage it is in force in;
//   - a cordon missing in the lineage it was written in or last seen in
//     force in was lifted by the operator: it is forgotten and stays lifted
//     (the same finding does not cordon the device again; a new one does);
//   - a cordon missing in another lineage (cordonLost) was lost with the
//     state while its process still runs: its device is returned, with a
//     finding on it, to be cordoned again (logged here, audited with
//     recordonReason).
func (w *Watch) settleIntruders(ctx context.Context, current, todo map[string]observe.FileFinding) map[string]observe.FileFinding {
	on := findingsByDevice(current)
	written := map[string]string{}
	w.mu.Lock()
	w.forgetIntruderLineagesLocked(on)
	for k, lineage := range w.cordonLineage {
		if k.source != ledger.CordonIntruder {
			continue
		}
		if _, ok := todo[k.uuid]; !ok {
			written[k.uuid] = lineage
		}
	}
	w.mu.Unlock()
	if len(written) == 0 {
		return nil
	}
	fates, lineage := w.cordonFates(ctx, ledger.CordonIntruder, written)
	log := w.log()
	var lost map[string]observe.FileFinding
	for _, uuid := range slices.Sorted(maps.Keys(fates)) {
		f := on[uuid]
		switch fates[uuid] {
		case cordonInForce:
		case cordonMissingLost:
			log.Warn("intruder cordon lost: the ledger was started afresh (reset or recovery) since it was written, and a process the guard did not admit still runs on the device; cordoning it again",
				"device", f.Device.String(), "device_uuid", uuid, "pid", f.PID, "cordon_lineage", written[uuid], "ledger_lineage", lineage)
			if lost == nil {
				lost = map[string]observe.FileFinding{}
			}
			lost[uuid] = f
		case cordonMissingLifted:
			w.mu.Lock()
			delete(w.cordonLineage, cordonKey{ledger.CordonIntruder, uuid})
			w.mu.Unlock()
			log.Info("intruder cordon lifted by the operator: not cordoned again for this process; a new intruder cordons the device again",
				"device", f.Device.String(), "device_uuid", uuid, "pid", f.PID)
		}
	}
	return lost
}

// cordonFate is what became of an observer's cordon since it was written
// or last seen in force (cordonFates).
type cordonFate int

const (
	// cordonInForce: in the ledger (a write that reported an error may
	// have committed).
	cordonInForce cordonFate = iota
	// cordonMissingLost: missing in another lineage than the one it was
	// seen in (cordonLost): it may have been lost with the state.
	cordonMissingLost
	// cordonMissingLifted: missing in the lineage it was seen in: only an
	// uncordon (gpu-guard-ctl uncordon) removes a cordon within a lineage.
	cordonMissingLifted
)

// cordonFates reads the ledger's cordons once (one snapshot, however many
// devices are watched) and tells what became of the observer's cordon from
// source on each device of seen (judgeCordons), and the lineage read. A
// cordon in force records that lineage. When the ledger cannot be read it
// tells nothing (nil): every device is checked at the next pass.
func (w *Watch) cordonFates(ctx context.Context, source string, seen map[string]string) (map[string]cordonFate, string) {
	s := w.states()
	if s == nil || len(seen) == 0 {
		return nil, ""
	}
	cordons, lineage, err := s.CordonsInForce(ctx)
	if err != nil {
		return nil, "" // checked at the next pass
	}
	fates := judgeCordons(cordons, lineage, seen)
	for uuid, fate := range fates {
		if fate == cordonInForce {
			w.setCordonLineage(source, uuid, lineage)
		}
	}
	return fates, lineage
}

// judgeCordons tells, from the cordons in force in a ledger state of
// lineage, what became of the observer's cordon on each device of seen
// (device UUID → the lineage the cordon was written in or last seen in
// force in, "" unknown). It is the one rule for whether an observer's
// cordon is in force: at each pass (cordonFates) and for the cordons the
// daemon before watched or still had to write (readPrior).
//
// A cordon on the device counts, whatever its source. The ledger keeps one
// cordon per device, of the highest-ranking source written (operator >
// unhealthy > intruder, ledger.CordonKept), so the observer's cordon may
// stand in another source's name without an uncordon: an operator's
// replaces any (the device cordoned for maintenance), an unhealthy one
// replaces an intruder's (a device with an intruder found broken), and an
// intruder's finding leaves an operator's or an unhealthy cordon in force
// (written, the observer's intruder cordon is that one). Only an uncordon
// removes the device's cordon, and the one it removes stood for the
// observer's findings too: the operator lifts it knowing the device's
// findings (the audit log records those that left a cordon as it was).
// Judged by its source, a cordon so replaced or kept would read as missing
// although nobody lifted it: an unhealthy device forgotten while it stays
// cordoned, or an intruder's cordon judged by a lineage older than the one
// it was last in force in (lost, and written again after the operator's
// uncordon).
//
// Callers ask only about the devices whose cordon the observer wrote, saw
// in force or still has to write (seen): of another device it would take
// a cordon that is not the observer's for the observer's, and write it
// again should the ledger lose it.
func judgeCordons(cordons []ledger.Cordon, lineage string, seen map[string]string) map[string]cordonFate {
	cordoned := make(map[string]bool, len(cordons))
	for _, k := range cordons {
		cordoned[k.Device.UUID] = true
	}
	fates := make(map[string]cordonFate, len(seen))
	for uuid, was := range seen {
		switch {
		case cordoned[uuid]:
			fates[uuid] = cordonInForce
		case cordonLost(was, lineage):
			fates[uuid] = cordonMissingLost
		default:
			fates[uuid] = cordonMissingLifted
		}
	}
	return fates
}

// onUnhealthy cordons a device the first time it is found unhealthy, and
// audits, counts and reports it. The observer reports a device once, but a
// device carried over from the previous observer, or adopted from the
// ledger's cordons (carryLocked), is news to the new one: its
// entry is replaced, not listed twice.
func (w *Watch) onUnhealthy(ctx context.Context, f observe.Finding) {
	w.healthMu.Lock()
	defer w.healthMu.Unlock()
	defer w.wakeSettle()
	w.recordUnhealthy(ctx, f)
}

// recordUnhealthy lists, audits and cordons f's device, found unhealthy
// (w.healthMu held): onUnhealthy's, and settleUnhealthy's for a device
// that failed again after the operator lifted its cordon.
func (w *Watch) recordUnhealthy(ctx context.Context, f observe.Finding) {
	w.mu.Lock()
	if i := slices.IndexFunc(w.unhealthy, func(u observe.Finding) bool { return u.Device.UUID == f.Device.UUID }); i >= 0 {
		w.unhealthy[i] = f
	} else {
		w.unhealthy = append(w.unhealthy, f)
	}
	w.showUnhealthyLocked()
	w.mu.Unlock()
	w.audit(ctx, func(tx *ledger.Tx) {
		rec := auditOf(observe.FileFinding{Finding: f})
		tx.Audit(OpUnhealthy, rec)
	})
	if f.Vanished && f.Device.IsMIG() {
		// A MIG instance gone from NVML is most often a repartition of its
		// GPU (the inventory is then stale), not a fault; a cordon on it
		// would block its whole GPU until the next reboot. A GPU that fails
		// reports itself.
		w.log().Warn("MIG instance no longer in NVML (its GPU repartitioned?): not cordoned; restart nri-gpu-guard to load the new MIG layout",
			"device", f.Device.String())
	} else {
		// Recorded for the daemon after this one before the cordon (see
		// writeUnhealthyCarry): a cordon in force on the device may be
		// another's, kept instead of this one (ledger.CordonKept), and
		// NVML reports the Xid once.
		w.writeUnhealthyCarry(map[string]string{f.Device.UUID: f.Message})
		if !w.cordonRecorded(ctx, f, ledger.CordonUnhealthy, f.Message) {
			w.cordonFailedFor(f.Device.UUID, f.Message)
		}
	}
	w.writeUnhealthyCarry(nil)
	w.writeFile()
}

// onUnidentified audits a critical Xid whose GPU NVML could not identify
// (observe.Options.OnUnidentified: once per Xid code and observer), as an
// unhealthy record that names no device: there is none to name, and none
// is cordoned. Its reason is the finding's message: the Xid, what NVML
// could read of the device (its PCI bus id, its minor number) and how to
// find the GPU and cordon it by hand. The observer logs it as an error and
// lists it in its reports (observe.json's not_in_inventory, with
// accounting on), but only for as long as it runs: the audit record is
// the trace that outlives it, at any interval.
//
// It is not carried across a restart of the daemon (the carry file): with
// no device to tell it by, nothing would ever clear it (an unhealthy
// device clears when the operator uncordons it), and restarting the
// daemon is how the operator, having cordoned the GPU by hand, clears it
// from status; the record stays in the audit log.
func (w *Watch) onUnidentified(ctx context.Context, f observe.Finding) {
	w.audit(ctx, func(tx *ledger.Tx) {
		tx.Audit(OpUnhealthy, ledger.AuditRecord{Reason: f.Message})
	})
}

// wakeSettle wakes the settleLoop of an observer that runs no accounting
// pass, if one runs, without ever waiting for it.
func (w *Watch) wakeSettle() {
	w.mu.Lock()
	wake := w.settleWake
	w.mu.Unlock()
	if wake == nil {
		return
	}
	select {
	case wake <- struct{}{}:
	default: // already woken
	}
}

// showUnhealthyLocked rebuilds the unhealthy gauge from w.unhealthy (w.mu
// held, so that two changes cannot show in the wrong order): the gauge
// shows what observe.json shows, and a device forgotten after the
// operator's uncordon, or after a restart of the observer, loses its series.
func (w *Watch) showUnhealthyLocked() {
	if w.Metrics != nil {
		w.Metrics.UnhealthyDevices(slices.Clone(w.unhealthy))
	}
}

// cordonKey names a cordon the observer writes: its source
// (ledger.CordonIntruder or ledger.CordonUnhealthy) and its device.
type cordonKey struct{ source, uuid string }

// cordonRecorded writes f's cordon from source and records the lineage it
// was written in: the ledger's lineage read before the write, so that a
// reset at any moment after that read shows as a change (and the cordon,
// if it went with it, is written again), while an uncordon in the same
// lineage, however soon after the write, is the operator's. A lineage that
// cannot be read is recorded as "": a missing cordon then reads as lost
// (cordonLost), which errs toward cordoning. A cordon of a source that
// ranks higher, kept instead of f's (cordon), stands for it and is
// recorded the same way (judgeCordons).
func (w *Watch) cordonRecorded(ctx context.Context, f observe.Finding, source, reason string) bool {
	return w.cordonRecordedIn(ctx, f, source, reason, w.ledgerLineage(ctx))
}

// cordonRecordedIn is cordonRecorded for a caller that read the ledger's
// lineage already in this pass (before the write, as cordonRecorded does).
func (w *Watch) cordonRecordedIn(ctx context.Context, f observe.Finding, source, reason, lineage string) bool {
	if !w.cordon(ctx, f, source, reason) {
		return false
	}
	w.setCordonLineage(source, f.Device.UUID, lineage)
	return true
}

// ledgerLineage reads the ledger's lineage now ("" when it cannot be
// read: a cordon recorded in it then reads as lost when missing, which
// errs toward cordoning).
func (w *Watch) ledgerLineage(ctx context.Context) string {
	if s := w.states(); s != nil {
		if _, l, err := s.CordonsInForce(ctx); err == nil {
			return l
		}
	}
	return ""
}

// cordonLost tells whether an observer's cordon missing from the ledger,
// whose lineage is now lineage, was lost with the state (true: it is
// written again) rather than lifted by an uncordon: seen is the lineage it
// was written in or last seen in force in ("" unknown). Only an uncordon
// removes a cordon within a lineage; Reset, Recover with AllowEmpty (the
// NRI daemon's own rebuild after damage) and a recovery that lost commits
// start a new one, from a state without it. Nothing tells a lost cordon
// from one uncordoned just before the state was started afresh; the safe
// side is a cordon (an operator who had lifted it lifts it again).
func cordonLost(seen, lineage string) bool { return seen == "" || seen != lineage }

// cordonFailedFor records that the unhealthy cordon of uuid, with reason,
// could not be written (settleUnhealthy retries it).
func (w *Watch) cordonFailedFor(uuid, reason string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cordonFailed == nil {
		w.cordonFailed = map[string]string{}
	}
	w.cordonFailed[uuid] = reason
}

func (w *Watch) setCordonLineage(source, uuid, lineage string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.cordonLineage == nil {
		w.cordonLineage = map[cordonKey]string{}
	}
	w.cordonLineage[cordonKey{source, uuid}] = lineage
}

// cordon cordons f's device, or says why it cannot, and reports whether the
// device is cordoned: by f's cordon from source, or by a cordon of a source
// that ranks higher, which the ledger kept instead of it (ledger.CordonKept:
// the policy counts a cordon of any source, see judgeCordons). Each is
// logged as what it is: the observer's cordon, or a finding that left
// another's cordon in force.
func (w *Watch) cordon(ctx context.Context, f observe.Finding, source, reason string) bool {
	log := w.log()
	s := w.states()
	if s == nil {
		log.Error("cannot cordon the device: the daemon has no guard yet", "device", f.Device.String(), "source", source)
		return false
	}
	k, kept, err := s.CordonDevice(ctx, f.Device.UUID, source, reason)
	if err != nil {
		log.Error("cordoning the device failed; it still takes new claims (retried at the next accounting pass, or within 10s with accounting off)", "device", f.Device.String(),
			"source", source, "error", err)
		return false
	}
	if kept {
		// The ledger holds the other source's cordon, and this finding
		// only in its audit log: the operator reading this log must not
		// take the device for cordoned for this finding, and must know
		// that lifting that cordon puts the device back into service
		// despite it (the observer does not cordon it again for the same
		// finding).
		log.Warn(fmt.Sprintf("device already cordoned by %s: the observer's %s cordon is not recorded over it; that cordon stays in force (no new claims), the finding is in the audit log, and lifting that cordon with `gpu-guard-ctl uncordon` lifts this finding's too",
			k.Source, source),
			"device", f.Device.String(), "device_index", f.Device.Index, "device_uuid", f.Device.UUID, "source", source, "reason", reason,
			"cordon_source", k.Source, "cordon_by", k.By, "cordon_reason", k.Reason)
		return true
	}
	log.Warn("device cordoned: no new claims until `gpu-guard-ctl uncordon`", "device", f.Device.String(), "source", source, "reason", reason)
	return true
}

// recordonReason prefixes the reason of an observer's cordon written again
// because the ledger lost it (it is the cordon's reason and its audit
// record's).
const recordonReason = "cordoned again (the ledger was started afresh by a reset or a recovery and lost this cordon): "

// settleUnhealthy runs after each accounting pass (with accounting off:
// settleLoop) and keeps every unhealthy device cordoned until the operator
// uncordons it:
//
//   - a cordon in force records the ledger lineage it is in force in;
//   - a cordon that could not be written is written again;
//   - a cordon missing in the lineage it was written in or last seen in
//     force in was removed by a commit of that lineage: only an uncordon
//     (gpu-guard-ctl uncordon) removes a cordon within a lineage (the
//     observer's cordons end otherwise only with the state of an earlier
//     boot, which starts a new lineage). The device is forgotten, by the
//     observer too (forget), so that its next critical error cordons it
//     again instead of being taken for the one already reported;
//     A device that reported a critical Xid again after its cordon was
//     last seen in force (health's HealthSeq, read before the ledger) is
//     not forgotten but cordoned again, as a new finding (that Xid's):
//     the Xid may have come after the uncordon, and the observer, which
//     took it for the one already reported, reported it to no one;
//   - a cordon missing in another lineage (cordonLost) may have been lost
//     with the state. The device is cordoned again, logged and audited as
//     such: a device that failed must not take new claims on a guess.
func (w *Watch) settleUnhealthy(ctx context.Context, health healthKeeper) {
	w.healthMu.Lock()
	defer w.healthMu.Unlock()
	log := w.log()
	w.mu.Lock()
	unhealthy := slices.Clone(w.unhealthy)
	seen := map[string]string{}
	for _, f := range unhealthy {
		if f.Vanished && f.Device.IsMIG() {
			continue // never cordoned (see onUnhealthy)
		}
		seen[f.Device.UUID] = w.cordonLineage[cordonKey{ledger.CordonUnhealthy, f.Device.UUID}]
	}
	w.mu.Unlock()
	// Read before the ledger: an Xid after this read counts as newer than
	// a cordon this settling finds in force, so that an uncordon before
	// it cannot forget the device.
	seqs := make(map[string]uint64, len(seen))
	for uuid := range seen {
		seqs[uuid] = health.HealthSeq(uuid)
	}
	fates, lineage := w.cordonFates(ctx, ledger.CordonUnhealthy, seen)
	for _, f := range unhealthy {
		uuid := f.Device.UUID
		fate, ok := fates[uuid]
		if !ok {
			continue // not cordoned, or retried at the next pass
		}
		w.mu.Lock()
		reason, retry := w.cordonFailed[uuid]
		if fate == cordonInForce {
			delete(w.cordonFailed, uuid) // nothing to retry
			w.noteHealthSeqLocked(uuid, seqs[uuid])
		}
		healthSeen := w.healthSeen[uuid]
		w.mu.Unlock()
		switch {
		case fate == cordonInForce:
		case retry:
			if w.cordonRecordedIn(ctx, f, ledger.CordonUnhealthy, reason, lineage) {
				w.mu.Lock()
				delete(w.cordonFailed, uuid)
				w.mu.Unlock()
			}
		case fate == cordonMissingLost:
			log.Warn("unhealthy device's cordon lost: the ledger was started afresh (reset or recovery) since it was written; cordoning it again (`gpu-guard-ctl uncordon` once the device is repaired)",
				"device", f.Device.String(), "device_uuid", uuid, "cordon_lineage", seen[uuid], "ledger_lineage", lineage)
			if !w.cordonRecordedIn(ctx, f, ledger.CordonUnhealthy, recordonReason+f.Message, lineage) {
				w.cordonFailedFor(uuid, recordonReason+f.Message)
			}
		default:
			if again, seq, failed := health.ForgetHealth(uuid, healthSeen); failed {
				log.Warn("unhealthy device uncordoned by the operator, but it reported a critical Xid again since its cordon was last seen in force: cordoning it again (`gpu-guard-ctl uncordon` once the device is repaired)",
					"device", again.Device.String(), "device_index", again.Device.Index, "device_uuid", uuid, "xid", again.Xid, "reason", again.Message)
				w.recordUnhealthy(ctx, again)
				w.mu.Lock()
				w.noteHealthSeqLocked(uuid, seq)
				w.mu.Unlock()
				continue
			}
			w.mu.Lock()
			w.unhealthy = slices.DeleteFunc(w.unhealthy, func(u observe.Finding) bool { return u.Device.UUID == uuid })
			delete(w.cordonLineage, cordonKey{ledger.CordonUnhealthy, uuid})
			delete(w.healthSeen, uuid)
			w.showUnhealthyLocked()
			w.mu.Unlock()
			log.Info("unhealthy device uncordoned by the operator: its next critical error cordons it again", "device", f.Device.String())
			w.writeFile()
		}
	}
	// What became of the cordons (their lineages, a retry done, a device
	// forgotten) for the daemon after this one.
	w.writeUnhealthyCarry(nil)
}

// healthKeeper is what settleUnhealthy asks of the observer
// (*observe.Observer): HealthSeq, read before it reads the ledger, and
// ForgetHealth, which forgets a device whose cordon the operator lifted,
// unless it failed again since (see settleUnhealthy).
type healthKeeper interface {
	HealthSeq(uuid string) uint64
	ForgetHealth(uuid string, seen uint64) (again observe.Finding, seq uint64, failed bool)
}

// noteHealthSeqLocked records seq, the observer's HealthSeq of uuid read
// before its cordon was found in force or written again (w.mu held).
func (w *Watch) noteHealthSeqLocked(uuid string, seq uint64) {
	if w.healthSeen == nil {
		w.healthSeen = map[string]uint64{}
	}
	w.healthSeen[uuid] = seq
}

// Timing of settleLoop. A cordon still to be written is retried after
// settleRetryMin, then after twice the previous wait, up to
// accountingOffPeriod; the cordons in force are checked every
// accountingOffPeriod, as often as an accounting pass at the default
// [observe] interval would (and as the draining claims are with
// accounting off: drainPeriod).
const (
	settleRetryMin      = time.Second
	accountingOffPeriod = 10 * time.Second
)

// settleLoop settles the unhealthy devices (settleUnhealthy) for an
// observer that runs no accounting pass ([observe] interval = "0s"), until
// ctx ends; health is the observer (settleUnhealthy). Its health watcher finds
// unhealthy devices all the same, and the daemon adopts those of the
// daemon before it and of the observer before it (takeOverLocked,
// carryLocked), but only a pass settled them: a cordon pending (the
// daemon before died before writing it) or that failed (ledger lock busy)
// was never written, one the ledger lost with its state (a reset, a
// recovery afresh) never written again, and a device the operator
// uncordoned never forgotten (its next critical Xid, taken for the one
// already reported, cordoned nothing): the failing GPU took new claims.
//
// It settles at once (what the observer took over), then on a schedule
// while there is something to settle: after a back-off while a cordon is
// still to be written, every accountingOffPeriod while a cordon is
// watched (whether it is still in force: lost, or lifted by the
// operator). With no unhealthy device it waits for wake: onUnhealthy says
// that a device was found unhealthy (its cordon written, or not).
func (w *Watch) settleLoop(ctx context.Context, wake <-chan struct{}, health healthKeeper) {
	after := w.After
	if after == nil {
		after = func(d time.Duration) <-chan time.Time { return time.NewTimer(d).C }
	}
	backoff := settleRetryMin
	settle := func() {
		w.settleUnhealthy(ctx, health)
		if w.settled != nil {
			w.settled()
		}
	}
	settle()
	for {
		var due <-chan time.Time // nil: nothing to settle until woken
		switch pending, watched := w.unhealthyToSettle(); {
		case pending:
			due = after(backoff)
		case watched:
			due = after(accountingOffPeriod)
		}
		select {
		case <-ctx.Done():
			return
		case <-wake:
			continue // the schedule as the new device's cordon left it
		case <-due:
		}
		settle()
		if pending, _ := w.unhealthyToSettle(); pending {
			backoff = min(2*backoff, accountingOffPeriod)
		} else {
			backoff = settleRetryMin
		}
	}
}

// unhealthyToSettle tells whether the cordon of an unhealthy device is
// still to be written (pending: cordonFailed) and whether any is watched
// (every unhealthy device's but a vanished MIG instance's, which is never
// cordoned: see onUnhealthy).
func (w *Watch) unhealthyToSettle() (pending, watched bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, f := range w.unhealthy {
		if f.Vanished && f.Device.IsMIG() {
			continue
		}
		watched = true
		if _, ok := w.cordonFailed[f.Device.UUID]; ok {
			pending = true
		}
	}
	return pending, watched
}

// audit writes records through the ledger (an update that changes nothing
// else appends them alone). A failure is logged: the log line and the
// metric still show the finding.
func (w *Watch) audit(ctx context.Context, fn func(tx *ledger.Tx)) {
	err := w.guard().Ledger().Update(ctx, func(tx *ledger.Tx) error { fn(tx); return nil })
	if err != nil && ctx.Err() == nil {
		w.log().Warn("GPU observer: audit records not written", "error", err)
	}
}

func auditOf(f observe.FileFinding) ledger.AuditRecord {
	return ledger.AuditRecord{Devices: []string{f.Device.UUID}, ContainerID: f.ContainerID,
		Namespace: f.Namespace, Pod: f.Pod, Container: f.Container, Reason: f.Message}
}

func ownerText(f observe.FileFinding) string {
	switch {
	case f.ContainerID == "":
		return "host process"
	case f.Namespace != "" || f.Pod != "" || f.Container != "":
		return fmt.Sprintf("%s/%s/%s, container %s", f.Namespace, f.Pod, f.Container, ledger.ShortID(f.ContainerID))
	default:
		return "container " + ledger.ShortID(f.ContainerID)
	}
}

func findingAttrs(f observe.FileFinding) []any {
	attrs := []any{"kind", string(f.Kind), "pid", f.PID, "device", f.Device.String(),
		"device_index", f.Device.Index, "device_uuid", f.Device.UUID}
	if f.Instance != nil {
		// The MIG instance the inventory lacks that the process runs on
		// (the finding, and any cordon for it, is its GPU's).
		attrs = append(attrs, "instance_index", f.Instance.Index, "instance_uuid", f.Instance.UUID)
	}
	if f.ContainerID == "" {
		attrs = append(attrs, "container", "host process")
	} else {
		attrs = append(attrs, "container_id", f.ContainerID)
	}
	if f.Namespace != "" || f.Pod != "" || f.Container != "" {
		attrs = append(attrs, "namespace", f.Namespace, "pod", f.Pod, "container", f.Container)
	}
	if f.Holder != "" {
		attrs = append(attrs, "holder", f.Holder)
	}
	return append(attrs, "message", f.Message)
}

func sortFindings(fs []observe.FileFinding) {
	sort.Slice(fs, func(i, j int) bool { return findingKey(fs[i].Finding) < findingKey(fs[j].Finding) })
}

// writeFile writes observe.json from what the watch holds.
func (w *Watch) writeFile() {
	g := w.guard()
	if g == nil {
		return
	}
	w.mu.Lock()
	f := observe.File{Time: w.lastPass, WrittenAt: w.now().UTC(), IntervalSeconds: w.interval.Seconds(),
		Unhealthy: slices.Clone(w.unhealthy), Unlisted: slices.Clone(w.unlisted), NotInInventory: slices.Clone(w.notInInventory)}
	for _, ff := range w.reported {
		f.Findings = append(f.Findings, ff)
	}
	for _, u := range f.Unlisted {
		f.Errors = append(f.Errors, u.String())
	}
	w.mu.Unlock()
	sortFindings(f.Findings)
	if err := observe.WriteFile(g.Ledger().Dir(), f); err != nil {
		w.log().Warn("GPU observer: report for gpu-guard-ctl status not written", "error", err)
	}
}

// maxIdleCheck bounds one idle check of a draining claim. Listing one
// device's processes takes NVML milliseconds; a check this slow is a hang,
// and a timeout costs little: the claim stays draining until the next check
// or its grace.
const maxIdleCheck = 5 * time.Second

// drainPeriod is how often the draining claims are checked: every
// accounting interval, or every accountingOffPeriod with accounting off.
func (w *Watch) drainPeriod(cfg config.Config) time.Duration {
	d := cfg.Observe.Interval.Duration
	if w.Interval > 0 {
		d = w.Interval
	}
	if d <= 0 {
		d = accountingOffPeriod
	}
	return d
}

// drainOnce checks every draining claim: a holder with none of its
// processes left on its devices is released ("idle"); one still there after
// observe.idle_grace is released anyway, with a log line naming the device
// and the holder. Without NVML (o nil) only the grace applies. Errors keep
// the claim draining until the next check.
//
// Each idle check is bounded (maxIdleCheck, and never past the drain
// period, so that a round ends before the next): one that hangs in NVML must
// not hold this check (and its ticker) forever, or no claim past its grace
// would be released. A check that timed out counts as "not idle", so the
// grace decides; the checks after it in the same round are not tried, as
// they would wait for the same NVML call (the observer asks NVML one query
// at a time).
func (w *Watch) drainOnce(ctx context.Context, cfg config.Config, o *observe.Observer) {
	log := w.log()
	idleTimeout := min(w.drainPeriod(cfg), maxIdleCheck)
	var nvmlSlow error // an idle check of this round that NVML did not answer
	s := w.states()
	if s == nil {
		return
	}
	claims, err := s.Draining(ctx)
	if err != nil {
		if ctx.Err() == nil {
			log.Warn("release_requires_idle: cannot list the draining claims; retrying", "error", err)
		}
		return
	}
	byHolder := map[string][]ledger.Claim{}
	var order []string
	for _, c := range claims {
		id := c.Owner.ContainerID
		if _, ok := byHolder[id]; !ok {
			order = append(order, id)
		}
		byHolder[id] = append(byHolder[id], c)
	}
	now := w.now()
	for _, id := range order {
		cs := byHolder[id]
		holder := guard.HolderName(cs[0].Owner)
		idle, why := true, ""
		for _, c := range cs {
			if o == nil {
				idle, why = false, "NVML is not available"
				break
			}
			if nvmlSlow != nil {
				idle, why = false, nvmlSlow.Error()
				break
			}
			ictx, cancel := context.WithTimeout(ctx, idleTimeout)
			res, err := o.Idle(ictx, HoldingOf(c))
			cancel()
			if err != nil {
				if errors.Is(err, observe.ErrNVMLSlow) && ctx.Err() == nil {
					nvmlSlow = err
					log.Warn("release_requires_idle: NVML did not answer the idle check in time; the claim stays draining until observe.idle_grace",
						"holder", holder, "container_id", id, "device", ledger.DescribeDevice(c.Device), "timeout", idleTimeout.String(), "error", err)
				}
				idle, why = false, err.Error()
				break
			}
			if !res.Idle {
				var pids []string
				for _, p := range res.Processes {
					pids = append(pids, fmt.Sprint(p.PID))
				}
				idle, why = false, fmt.Sprintf("pid %s still on %s", strings.Join(pids, ", "), ledger.DescribeDevice(c.Device))
				break
			}
		}
		if idle {
			if err := s.FinishDraining(ctx, id, "idle"); err != nil {
				log.Warn("release_requires_idle: releasing an idle holder failed; retrying", "holder", holder,
					"container_id", id, "error", err)
				continue
			}
			log.Info("draining claim released: its processes left the device", "holder", holder, "container_id", id,
				"devices", claimDevices(cs))
			continue
		}
		// The ledger also ends a draining claim after the grace at its next
		// update (so hook-only hosts never hang); this pass does it on time
		// and says why the device was not idle.
		since := cs[0].Owner.DrainingSince
		grace := cfg.Observe.IdleGrace.Duration
		if since.IsZero() || now.Sub(since) < grace {
			continue
		}
		reason := fmt.Sprintf("idle grace %s expired (%s)", grace, why)
		if err := s.FinishDraining(ctx, id, reason); err != nil {
			log.Warn("release_requires_idle: releasing after the grace failed; retrying", "holder", holder,
				"container_id", id, "error", err)
			continue
		}
		log.Warn("draining claim released although the device is not idle: observe.idle_grace expired; the next container may find GPU memory still in use",
			"holder", holder, "container_id", id, "devices", claimDevices(cs), "why", why, "grace", grace.String())
	}
}

func claimDevices(cs []ledger.Claim) string {
	var out []string
	for _, c := range cs {
		out = append(out, ledger.DescribeDevice(c.Device))
	}
	return strings.Join(out, ", ")
}
