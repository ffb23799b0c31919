// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// ErrNVMLSlow is wrapped by every error of a query that NVML did not answer
// before its context ended (or while an earlier query was still in NVML).
var ErrNVMLSlow = errors.New("NVML did not answer in time")

// Source is the GPU side of the observer: NVML (OpenNVML) or, in tests, a
// go-nvml mock passed to OpenNVML. Its methods block in NVML; the Observer
// bounds every call.
type Source interface {
	// list reports the processes of each device.
	list(devs []Device) []listing
	// watch delivers critical-Xid and lost-device findings of devs to
	// w.emit until ctx ends (nil) or NVML fails (the error; the caller
	// retries).
	watch(ctx context.Context, devs []Device, w watchOpts) error
	// Close releases NVML.
	Close() error
}

// Options configure an Observer.
type Options struct {
	// Source is where processes and health events come from (required).
	Source Source
	// GPUs is the inventory the guard admits against (devices.Inventory.GPUs).
	GPUs []devices.GPU
	// Ledger says who holds what (required).
	Ledger Ledger
	// ProcRoot is the directory holding proc/ ("/" on a host). The guard
	// must see the host's pid namespace: NVML reports host pids.
	ProcRoot string
	// Interval between accounting passes of Run; 0 disables them (Run then
	// only watches health).
	Interval time.Duration
	// Xids are the critical Xid codes (config observe.xids).
	Xids []int
	// OnReport receives the report of every periodic pass, problems or not,
	// so that a cleared problem is seen to clear.
	//
	// Callbacks never hold up the observer: Run calls them from a goroutine
	// of their own, one call at a time, in order. A consumer slower than the
	// passes misses the reports it had no time for (it always gets the
	// latest); no OnUnhealthy call is ever dropped (there is at most one per
	// device). They are called only while Run runs, and must return once
	// Run's context ends: Run waits for the call in progress.
	OnReport func(Report)
	// OnUnhealthy receives each device the first time it becomes unhealthy
	// (see OnReport for how it is called).
	OnUnhealthy func(Finding)
	// OnUnidentified receives the unhealthy finding of a critical Xid whose
	// device NVML could not identify (empty UUID; see Report), the first
	// time each Xid code comes so, whatever the interval (see OnReport for
	// how it is called; none is ever dropped: there is at most one per
	// Xid code). There is no device to mark unhealthy or to cordon: the
	// caller records it where it outlives the observer (the daemon audits
	// it), as reports show it only while this Observer runs, and no
	// report comes with Interval 0.
	OnUnidentified func(Finding)
	// Logger receives NVML errors and retries; nil discards them.
	Logger *slog.Logger

	// EventWait bounds one NVML event wait: Run's health watcher sees its
	// context end within it. Default 1s.
	EventWait time.Duration
	// RetryMin and RetryMax bound the back-off after an NVML failure of
	// the health watcher. Defaults 1s and 1m.
	RetryMin, RetryMax time.Duration
	// Now is the clock of findings; default time.Now.
	Now func() time.Time
}

// Observer compares the ledger with what NVML reports running on each GPU
// and MIG instance, and keeps the health of each device. Safe for concurrent
// use; no method but Run's loop waits for NVML longer than its context allows.
type Observer struct {
	opts Options
	src  Source
	devs []Device
	proc procFS
	xids map[uint64]bool
	log  *slog.Logger
	now  func() time.Time

	// nvml admits one NVML query at a time: a query that outlives its
	// context keeps the slot until NVML returns, and later queries wait
	// for it only as long as their own context allows.
	nvml chan struct{}

	mu        sync.Mutex
	unhealthy map[string]Finding // by device UUID
	// again: for each device of unhealthy that reported a critical Xid
	// again since it was found unhealthy, the sequence number of its
	// latest such Xid (from seq) and that Xid's finding. A device the
	// operator uncordons is forgotten (ForgetHealth) only if it did not
	// fail again since the daemon last saw its cordon in force.
	again map[string]recurrence
	seq   uint64
	// unidentified: critical Xids of devices NVML could not identify, by
	// Xid and what NVML could read of the device (the first event of
	// each); every report lists them.
	unidentified map[unidentifiedKey]Finding
	// unknownSeen: the MIG instances the inventory lacks that were logged.
	unknownSeen map[string]bool
	// movedSeen: the MIG index now of each instance of the inventory
	// logged at another index than the inventory's (by UUID).
	movedSeen map[string]string
	// Callbacks waiting for the dispatcher (see Options.OnReport); wake
	// tells it there are some.
	pendingUnhealthy    []Finding
	pendingUnidentified []Finding
	pendingReport       *Report
	wake                chan struct{}
}

// New checks the options and returns an Observer; nothing runs until Run,
// Account or Idle is called.
func New(opts Options) (*Observer, error) {
	if opts.Source == nil {
		return nil, errors.New("observe: no NVML source")
	}
	if opts.Ledger == nil {
		return nil, errors.New("observe: no ledger")
	}
	if opts.Interval < 0 {
		return nil, fmt.Errorf("observe: negative interval %s", opts.Interval)
	}
	if opts.ProcRoot == "" {
		opts.ProcRoot = "/"
	}
	if opts.EventWait <= 0 {
		opts.EventWait = time.Second
	}
	if opts.RetryMin <= 0 {
		opts.RetryMin = time.Second
	}
	if opts.RetryMax < opts.RetryMin {
		opts.RetryMax = max(time.Minute, opts.RetryMin)
	}
	o := &Observer{
		opts: opts, src: opts.Source, devs: DevicesOf(opts.GPUs),
		proc: procFS{root: opts.ProcRoot}, xids: map[uint64]bool{},
		log: opts.Logger, now: opts.Now,
		nvml: make(chan struct{}, 1), unhealthy: map[string]Finding{}, unknownSeen: map[string]bool{}, movedSeen: map[string]string{},
		unidentified: map[unidentifiedKey]Finding{}, again: map[string]recurrence{},
		wake: make(chan struct{}, 1),
	}
	if o.log == nil {
		o.log = slog.New(slog.DiscardHandler)
	}
	if o.now == nil {
		o.now = time.Now
	}
	for _, x := range opts.Xids {
		if x <= 0 {
			return nil, fmt.Errorf("observe: invalid Xid %d", x)
		}
		o.xids[uint64(x)] = true
	}
	return o, nil
}

// Devices returns the devices the observer looks at.
func (o *Observer) Devices() []Device { return append([]Device(nil), o.devs...) }

// call runs fn (an NVML query) and returns when it has returned or ctx has
// ended, whichever is first.
func (o *Observer) call(ctx context.Context, what string, fn func()) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrNVMLSlow, what, err)
	}
	select {
	case o.nvml <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("%w: %s: an earlier NVML query has not returned yet: %w", ErrNVMLSlow, what, ctx.Err())
	}
	done := make(chan struct{})
	go func() {
		defer func() { <-o.nvml; close(done) }()
		fn()
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("%w: %s: %w", ErrNVMLSlow, what, ctx.Err())
	}
}

// Account runs one accounting pass: it lists the processes on every device,
// maps each to its container and compares them with the ledger. Devices that
// vanished become unhealthy (also in Unhealthy). It returns when the pass is
// done or ctx ends.
func (o *Observer) Account(ctx context.Context) (Report, error) {
	var (
		holdings []Holding
		epoch    uint64
		err      error
	)
	if el, ok := o.opts.Ledger.(EpochLedger); ok {
		holdings, epoch, err = el.HoldingsAt()
	} else {
		holdings, err = o.opts.Ledger.Holdings()
	}
	if err != nil {
		return Report{}, fmt.Errorf("observe: read the ledger: %w", err)
	}
	ls, err := o.listAttributed(ctx, o.devs)
	if err != nil {
		return Report{}, err
	}
	r := compare(o.now(), ls, newLedgerView(holdings))
	r.LedgerEpoch = epoch
	for _, l := range ls {
		if l.err != nil {
			o.log.Warn("cannot list the processes of a device; nothing concluded about it this pass",
				"device", l.device.String(), "error", l.err)
		}
		if l.device.unknownMIG && o.firstUnknown(l.device.UUID) {
			o.log.Warn("MIG instance not in the inventory; its processes are judged against the claims on its GPU",
				"gpu", fmt.Sprintf("GPU %d (%s)", l.device.gpuIndex, l.device.ParentUUID),
				"instance", l.device.UUID, "index", l.device.Index, "message", unknownMIGNotice(l.device))
		}
		if l.nowAt != "" && o.firstMove(l.device.UUID, l.nowAt) {
			o.log.Warn("MIG instance is at another MIG index than at discovery; it is still observed by its UUID",
				"device", l.device.String(), "index_now", l.nowAt,
				"message", "the MIG layout of its GPU changed; restart nri-gpu-guard to rebuild the inventory "+
					"(`sudo gpu-guard-ctl devices --refresh` refreshes the OCI hooks' cache)")
		}
	}
	for _, f := range r.Findings {
		if f.Kind == KindUnhealthy {
			o.markUnhealthy(f)
		}
	}
	o.addUnidentified(&r)
	return r, nil
}

// addUnidentified adds to r, as a device and an unhealthy finding each,
// the critical Xids of devices NVML could not identify: no device carries
// them (nothing can be cordoned, Unhealthy and Health do not know them),
// so the report is where the operator sees them (the device's
// NotInInventory notice holds what to do: it has no processes to list, so
// no Error, which would read as a device NVML could not list).
func (o *Observer) addUnidentified(r *Report) {
	o.mu.Lock()
	fs := make([]Finding, 0, len(o.unidentified))
	for _, f := range o.unidentified {
		fs = append(fs, f)
	}
	o.mu.Unlock()
	if len(fs) == 0 {
		return
	}
	sort.Slice(fs, func(i, j int) bool {
		if fs[i].Xid != fs[j].Xid {
			return fs[i].Xid < fs[j].Xid
		}
		return fs[i].Message < fs[j].Message // what NVML read of each device
	})
	for _, f := range fs {
		// Readers print the notice after the device's name.
		r.Devices = append(r.Devices, DeviceReport{Device: f.Device, Processes: []Process{},
			NotInInventory: strings.TrimPrefix(f.Message, f.Device.String()+" ")})
	}
	// Findings are sorted by device UUID: the empty one comes first.
	r.Findings = append(fs, r.Findings...)
}

// listAttributed lists devs through NVML and maps every pid to its container.
func (o *Observer) listAttributed(ctx context.Context, devs []Device) ([]listing, error) {
	listedAt, err := o.proc.uptimeTicks()
	if err != nil {
		return nil, fmt.Errorf("observe: %w", err)
	}
	var ls []listing
	if err := o.call(ctx, "list GPU processes", func() { ls = o.src.list(devs) }); err != nil {
		return nil, err
	}
	for i := range ls {
		for j := range ls[i].procs {
			p := &ls[i].procs[j]
			if err := o.proc.attribute(p, listedAt); err != nil {
				// Unreadable, not absent: not attributable, so not blamed;
				// but not known to be gone either (see Idle).
				o.log.Warn("cannot map a GPU process to its container; not counted",
					"pid", p.PID, "device", ls[i].device.String(), "error", err)
				p.Gone, p.unattributed = true, err
			}
		}
	}
	return ls, nil
}

// firstUnknown reports whether the MIG instance uuid, one the inventory
// lacks, is seen for the first time (it is logged once; each report says
// so as long as it is there).
func (o *Observer) firstUnknown(uuid string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.unknownSeen[uuid] {
		return false
	}
	o.unknownSeen[uuid] = true
	return true
}

// firstMove reports whether MIG instance uuid of the inventory is seen at
// MIG index now for the first time (logged once per index it moves to).
func (o *Observer) firstMove(uuid, now string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.movedSeen[uuid] == now {
		return false
	}
	o.movedSeen[uuid] = now
	return true
}

// IdleResult answers Idle.
type IdleResult struct {
	// Idle is true when none of the holder's processes runs on the device.
	Idle bool
	// Processes are the holder's processes still on the device.
	Processes []Process
}

// Idle reports whether the holder h still has processes on h.DeviceUUID (for
// a GPU in MIG mode: on any of its MIG instances, those NVML reports now
// included, the inventory's or not). It is the check of
// release_requires_idle: a draining claim is released once it is true.
// An NVML error, a lost device or a listed process whose /proc entry cannot
// be read is returned as an error (the claim stays draining and the caller
// retries until its grace ends); it returns when ctx ends at the latest.
func (o *Observer) Idle(ctx context.Context, h Holding) (IdleResult, error) {
	var devs []Device
	for _, d := range o.devs {
		if d.UUID == h.DeviceUUID || d.ParentUUID == h.DeviceUUID {
			devs = append(devs, d)
		}
	}
	if len(devs) == 0 {
		return IdleResult{}, fmt.Errorf("observe: device %s is not in the inventory", h.DeviceUUID)
	}
	ls, err := o.listAttributed(ctx, devs)
	if err != nil {
		return IdleResult{}, err
	}
	res := IdleResult{Idle: true}
	for _, l := range ls {
		if l.lost != nil {
			return IdleResult{}, fmt.Errorf("observe: %s: %w", l.device, l.lost)
		}
		if l.err != nil {
			return IdleResult{}, fmt.Errorf("observe: %s: %w", l.device, l.err)
		}
		for _, p := range l.procs {
			if p.unattributed != nil {
				// Its /proc entry is there but unreadable: it may be the
				// holder's. Not proven idle; the claim stays draining until
				// the check can tell, or its grace ends.
				return IdleResult{}, fmt.Errorf("observe: %s: pid %d cannot be attributed, so the device is not known to be idle: %w",
					l.device, p.PID, p.unattributed)
			}
			if !p.Gone && owns(h, p) {
				res.Idle = false
				res.Processes = append(res.Processes, p)
			}
		}
	}
	return res, nil
}

// recurrence is a critical Xid of a device already unhealthy (see
// Observer.again).
type recurrence struct {
	seq uint64
	f   Finding
}

// unidentifiedKey tells apart the critical Xids of devices NVML could not
// identify: by Xid and what NVML could read of the device (its PCI bus id,
// else its minor number; "" when it read neither, and then by Xid alone).
type unidentifiedKey struct {
	xid   uint64
	ident string
}

// markUnhealthy records f (KindUnhealthy); the first finding per device is
// kept and reported to OnUnhealthy. A later critical Xid of a device
// already unhealthy is not reported again, but it is recorded (again) and
// logged: the operator may have uncordoned the device since, and the
// daemon, which forgets a device whose cordon was lifted, must not forget
// one that failed after (ForgetHealth).
func (o *Observer) markUnhealthy(f Finding) {
	if f.Time.IsZero() {
		f.Time = o.now()
	}
	o.mu.Lock()
	_, known := o.unhealthy[f.Device.UUID]
	if known {
		o.seq++
		o.again[f.Device.UUID] = recurrence{seq: o.seq, f: f}
	} else {
		o.unhealthy[f.Device.UUID] = f
		if o.opts.OnUnhealthy != nil {
			o.pendingUnhealthy = append(o.pendingUnhealthy, f)
		}
	}
	o.mu.Unlock()
	if known {
		o.log.Warn("critical Xid again from a GPU already unhealthy: it stays cordoned, and is cordoned again if its cordon was lifted",
			"device", f.Device.String(), "device_index", f.Device.Index, "device_uuid", f.Device.UUID, "xid", f.Xid, "message", f.Message)
		return
	}
	o.log.Error("GPU unhealthy", "device", f.Device.String(), "xid", f.Xid, "message", f.Message)
	o.poke()
}

// markUnidentified records f, the unhealthy finding of a critical Xid whose
// device could not be identified, for every report from now on (the first
// of each Xid and device, told apart by ident, what NVML could read of it:
// see unidentifiedKey, is kept, and handed to OnUnidentified), and logs
// each such event as an error: no device is cordoned for it, so the
// operator must find the GPU.
func (o *Observer) markUnidentified(f Finding, ident string) {
	if f.Time.IsZero() {
		f.Time = o.now()
	}
	k := unidentifiedKey{xid: f.Xid, ident: ident}
	o.mu.Lock()
	_, seen := o.unidentified[k]
	if !seen {
		o.unidentified[k] = f
		if o.opts.OnUnidentified != nil {
			o.pendingUnidentified = append(o.pendingUnidentified, f)
		}
	}
	o.mu.Unlock()
	o.log.Error("critical Xid from a GPU NVML cannot identify; no GPU cordoned: find it and cordon it by hand",
		"xid", f.Xid, "read", ident, "message", f.Message)
	if !seen {
		o.poke()
	}
}

// poke wakes the dispatcher without ever waiting for it.
func (o *Observer) poke() {
	select {
	case o.wake <- struct{}{}:
	default: // already woken; it will see everything pending
	}
}

// dispatch hands pending notifications to the callbacks until ctx ends:
// unhealthy devices first (in the order they were found), then the
// critical Xids of unidentified devices (in the same order), then the
// latest report: a report that lists one of them comes after its
// callback.
func (o *Observer) dispatch(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-o.wake:
		}
		for ctx.Err() == nil {
			o.mu.Lock()
			un, unid, rep := o.pendingUnhealthy, o.pendingUnidentified, o.pendingReport
			o.pendingUnhealthy, o.pendingUnidentified, o.pendingReport = nil, nil, nil
			o.mu.Unlock()
			if len(un) == 0 && len(unid) == 0 && rep == nil {
				break
			}
			for _, f := range un {
				o.opts.OnUnhealthy(f)
			}
			for _, f := range unid {
				o.opts.OnUnidentified(f)
			}
			if rep != nil {
				o.opts.OnReport(*rep)
			}
		}
	}
}

// Unhealthy returns the unhealthy devices, by UUID. It never touches NVML:
// admission may call it.
func (o *Observer) Unhealthy() []Finding {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := make([]Finding, 0, len(o.unhealthy))
	for _, f := range o.unhealthy {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Device.UUID < out[j].Device.UUID })
	return out
}

// Health returns why the device uuid is unhealthy. A GPU is unhealthy when
// one of its MIG instances is not; a MIG instance is unhealthy when its GPU
// is. It never touches NVML.
func (o *Observer) Health(uuid string) (Finding, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if f, ok := o.unhealthy[uuid]; ok {
		return f, true
	}
	for _, d := range o.devs {
		if d.UUID == uuid && d.IsMIG() {
			f, ok := o.unhealthy[d.ParentUUID]
			return f, ok
		}
		if d.ParentUUID == uuid {
			if f, ok := o.unhealthy[d.UUID]; ok {
				return f, true
			}
		}
	}
	return Finding{}, false
}

// ClearHealth forgets that uuid was unhealthy (after an operator has reset
// or replaced it), whatever it reported since. It reports whether it was.
func (o *Observer) ClearHealth(uuid string) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok := o.unhealthy[uuid]
	delete(o.unhealthy, uuid)
	delete(o.again, uuid)
	return ok
}

// HealthSeq returns the sequence number of the latest critical Xid uuid
// reported again since it was found unhealthy (0: none, or uuid is not
// unhealthy). A caller that reads it before it sees the device's cordon
// in force hands it to ForgetHealth once it finds the cordon lifted.
func (o *Observer) HealthSeq(uuid string) uint64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.again[uuid].seq
}

// ForgetHealth forgets that uuid was unhealthy, as ClearHealth does, unless
// it reported a critical Xid again after seen (a HealthSeq read before its
// cordon was last seen in force): then the device failed again, maybe after
// the operator lifted its cordon, and it is not forgotten. It returns that
// Xid's finding, which stands for the device from now on (Health), and
// its sequence number, to be seen in turn (failed: true). The check and
// the forgetting are one step: an Xid that comes after is reported as a
// new finding (OnUnhealthy).
func (o *Observer) ForgetHealth(uuid string, seen uint64) (again Finding, seq uint64, failed bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if r, ok := o.again[uuid]; ok && r.seq != seen {
		if _, known := o.unhealthy[uuid]; known {
			o.unhealthy[uuid] = r.f
			return r.f, r.seq, true
		}
	}
	delete(o.unhealthy, uuid)
	delete(o.again, uuid)
	return Finding{}, 0, false
}

// Run watches health in its own goroutine and, when Interval > 0, runs an
// accounting pass every Interval, handing each report to OnReport. It
// returns when ctx ends: after the callback in progress has returned, and
// after the health watcher has stopped or, should NVML not return from its
// event wait, after EventWait more (the watcher then leaves when NVML
// returns; closing the Source meanwhile is safe). NVML errors are logged and
// retried with back-off; nothing in Run blocks admission, which only reads
// Unhealthy/Health.
func (o *Observer) Run(ctx context.Context) {
	watcher := make(chan struct{})
	go func() {
		defer close(watcher)
		o.watchHealth(ctx)
	}()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		o.dispatch(ctx)
	}()
	o.poke() // notifications found before Run started
	defer func() {
		wg.Wait()
		t := time.NewTimer(o.opts.EventWait)
		defer t.Stop()
		select {
		case <-watcher:
		case <-t.C:
			o.log.Warn("NVML did not return from an event wait; stopping without it")
		}
	}()
	if o.opts.Interval == 0 {
		<-ctx.Done()
		return
	}
	tick := time.NewTicker(o.opts.Interval)
	defer tick.Stop()
	for {
		o.pass(ctx)
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// pass runs one periodic accounting, bounded by the interval.
func (o *Observer) pass(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, o.opts.Interval)
	defer cancel()
	r, err := o.Account(pctx)
	if errors.Is(err, ErrLedgerNotReady) {
		o.log.Debug("GPU process accounting skipped: the ledger is not ready", "error", err)
		if o.opts.OnReport != nil {
			// The caller's periodic work that needs no view still runs
			// (a rebuild can keep the plugin unready for long).
			o.mu.Lock()
			o.pendingReport = &Report{Time: o.now(), Skipped: true}
			o.mu.Unlock()
			o.poke()
		}
		return
	}
	if err != nil {
		if ctx.Err() == nil {
			o.log.Warn("GPU process accounting failed; retrying at the next interval", "error", err)
		}
		return
	}
	for _, f := range r.Problems() {
		if f.Kind != KindUnhealthy {
			// Debug: the caller's OnReport decides what to tell operators
			// (the daemon logs each finding once, with the holder's name).
			o.log.Debug("GPU process not explained by the ledger", "kind", string(f.Kind),
				"pid", f.PID, "container", f.ContainerID, "device", f.Device.String(), "message", f.Message)
		}
	}
	if o.opts.OnReport != nil {
		o.mu.Lock()
		o.pendingReport = &r
		o.mu.Unlock()
		o.poke()
	}
}

// watchOpts are the parameters of one health watch (Source.watch).
type watchOpts struct {
	xids map[uint64]bool // the critical Xids
	// wait bounds one NVML event wait: the watch sees ctx end within it.
	wait time.Duration
	// retryMin and retryMax bound the back-off between registrations of a
	// GPU whose registration for Xid events failed: it is registered again
	// while the others are watched.
	retryMin, retryMax time.Duration
	emit               func(Finding)
	// unidentified receives the unhealthy finding of a critical Xid
	// whose device could not be identified (unidentifiedFinding), and
	// what NVML could read of the device (eventTarget.ident).
	unidentified func(f Finding, ident string)
	log          *slog.Logger
	// ran is called when an event wait has returned (an event or its
	// timeout): the watch works, and a later failure is a new one.
	ran func()
}

// watchHealth runs the NVML event watch until ctx ends, restarting it with
// back-off whenever NVML fails. The back-off starts over after a watch that
// ran: it is there to space out the attempts of an NVML that keeps failing,
// and a failure after hours of watching must not wait RetryMax, with no
// Xid seen, because of failures long past.
func (o *Observer) watchHealth(ctx context.Context) {
	backoff := o.opts.RetryMin
	for ctx.Err() == nil {
		ran := false
		err := o.src.watch(ctx, o.devs, watchOpts{
			xids: o.xids, wait: o.opts.EventWait, retryMin: o.opts.RetryMin, retryMax: o.opts.RetryMax,
			emit: o.markUnhealthy, unidentified: o.markUnidentified, log: o.log, ran: func() { ran = true },
		})
		if ctx.Err() != nil {
			return
		}
		if ran {
			backoff = o.opts.RetryMin
		}
		o.log.Warn("NVML health events failed; retrying", "error", err, "retry_in", backoff)
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, o.opts.RetryMax)
	}
}
