// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package guard

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
)

// Options configure a Guard.
type Options struct {
	// Config supplies the policies ([policy]).
	Config config.Config
	// Inventory is the host's GPUs, loaded once (the daemon may replace it
	// with SetInventory); decisions never enumerate devices themselves.
	Inventory *devices.Inventory
	// Ledger is the host ledger the decisions are recorded in.
	Ledger *ledger.Ledger
	// Liveness checks busy holders out of band; nil = liveness.New over the
	// host's /sys/fs/cgroup and /proc.
	Liveness Liveness
	// Now is the clock for messages and ages; nil = time.Now. The ledger has
	// its own clock (ledger.Options.Now): tests set both.
	Now func() time.Time
	// Logger receives one line per decision and per release; nil = discard.
	Logger *slog.Logger
	// Observer receives decisions and state changes (metrics); nil = none.
	Observer Observer
	// Discovering marks Inventory as standing in for a GPU discovery that
	// is still running (an undiscovered inventory: the daemon answered the
	// runtime before a slow NVML enumeration ended). Every GPU request is
	// refused, saying so, until SetInventory replaces it (see Discovering).
	Discovering bool
}

// Guard makes admission decisions and keeps the ledger in step with the
// containers' lifecycle. It is safe for concurrent use: all shared state is in
// the ledger, under its lock.
type Guard struct {
	cfg    config.Config
	policy config.PolicyConfig
	// view is the inventory decisions use and its resolver, swapped as one
	// (SetInventory): a decision loads it once and uses that pair
	// throughout, whatever a concurrent swap does. swapMu orders the swaps,
	// so that each view's replaced channel is closed once.
	view   atomic.Pointer[invView]
	swapMu sync.Mutex
	ledger *ledger.Ledger
	live   Liveness
	// rt is the runtimes' state ([hook] runtime_roots), the evidence that
	// an OCI hook holder was removed (see ReleasableIdle).
	rt  Runtimes
	now func() time.Time
	log *slog.Logger
	obs Observer
	// observed: an Observer was given; without one (an OCI hook) Admit
	// skips the copy of the state it would hand to StateChanged.
	observed bool
	exempt   map[string]bool
	// takeovers are the claims restarts took over from their stopped
	// predecessors (settleHolders), as they were before, by the restart's
	// container id, until the restart starts: if its create is undone
	// first, Removed hands them back (see rememberTakeover).
	takeoversMu sync.Mutex
	takeovers   map[string][]ledger.Claim
}

// New returns a Guard. Inventory and Ledger are required.
func New(opts Options) (*Guard, error) {
	if opts.Inventory == nil {
		return nil, errors.New("guard: no GPU inventory")
	}
	if opts.Ledger == nil {
		return nil, errors.New("guard: no ledger")
	}
	g := &Guard{
		cfg:    opts.Config,
		policy: opts.Config.Policy,
		ledger: opts.Ledger,
		live:   opts.Liveness,
		rt:     RuntimeRoots(opts.Config.Hook.RuntimeRoots),
		now:    opts.Now,
		log:    opts.Logger,
		obs:    opts.Observer,
		exempt: map[string]bool{},
	}
	if g.live == nil {
		g.live = liveness.New("", "")
	}
	if g.now == nil {
		g.now = time.Now
	}
	if g.log == nil {
		g.log = slog.New(slog.DiscardHandler)
	}
	g.view.Store(&invView{inv: opts.Inventory, resolver: devices.NewResolver(opts.Inventory, opts.Config.Policy),
		discovering: opts.Discovering, replaced: make(chan struct{})})
	g.observed = g.obs != nil
	if g.obs == nil {
		g.obs = nopObserver{}
	}
	for _, ns := range opts.Config.Policy.ExemptNamespaces {
		g.exempt[ns] = true
	}
	return g, nil
}

// Config returns the configuration the guard was built with.
func (g *Guard) Config() config.Config { return g.cfg }

// invView is an inventory and the resolver over it under the guard's policy.
type invView struct {
	inv      *devices.Inventory
	resolver *devices.Resolver
	// discovering: inv stands in for a discovery still running
	// (Options.Discovering).
	discovering bool
	// replaced is closed when SetInventory replaces this view.
	replaced chan struct{}
}

// Inventory returns the GPU inventory the guard decides over.
func (g *Guard) Inventory() *devices.Inventory { return g.view.Load().inv }

// SetInventory replaces the inventory later decisions use. The daemon calls
// it when discovery, retried after the guard started with an incomplete
// inventory (the NVIDIA driver came up later), lists the host's GPUs, and
// when the discovery a guard was built before (Options.Discovering) ends:
// the inventory set is a discovery's result, never one still awaited. It is
// safe with concurrent decisions: each uses the inventory it started with.
func (g *Guard) SetInventory(inv *devices.Inventory) error {
	if inv == nil {
		return errors.New("guard: no GPU inventory")
	}
	g.swapMu.Lock()
	defer g.swapMu.Unlock()
	old := g.view.Swap(&invView{inv: inv, resolver: devices.NewResolver(inv, g.policy), replaced: make(chan struct{})})
	close(old.replaced)
	return nil
}

// Discovering reports whether the guard decides over an inventory that
// stands in for a GPU discovery still running (Options.Discovering: every
// GPU request is refused meanwhile), and returns a channel closed once
// SetInventory replaces the inventory it reports on. Both come from one
// view, so a replacement in between is never missed: a front end that
// deferred work until the discovery ends (the NRI plugin's reconcile with
// the runtime's containers, whose GPUs an undiscovered inventory cannot
// tell) waits on the channel.
func (g *Guard) Discovering() (bool, <-chan struct{}) {
	v := g.view.Load()
	return v.discovering, v.replaced
}

// Ledger returns the ledger the guard records in.
func (g *Guard) Ledger() *ledger.Ledger { return g.ledger }

// Exempt reports whether pods of namespace are never checked. It says
// nothing about whether a request's namespace can be believed: exempts does.
func (g *Guard) Exempt(namespace string) bool { return namespace != "" && g.exempt[namespace] }

// exempts reports whether owner o is exempt: its namespace is listed in
// exempt_namespaces and its front end's pod identity is trusted
// (TrustsIdentity). A hook request naming an exempt namespace is checked
// like any other: its namespace is an annotation its creator wrote.
func (g *Guard) exempts(o ledger.Owner) bool {
	return g.Exempt(o.Namespace) && TrustsIdentity(o.FrontEnd)
}

// Releasable applies the release rule (see ReleasableIdle) with the guard's
// policy, liveness check and runtime roots.
func (g *Guard) Releasable(o ledger.Owner) Verdict {
	return ReleasableIdle(o, g.policy.ReleaseOn, g.requiresIdle(), g.live, g.rt)
}

// Resolve turns a container description into the devices it reaches under the
// guard's policies, without touching the ledger.
func (g *Guard) Resolve(spec devices.Request) (devices.Resolution, error) {
	return g.view.Load().resolver.Resolve(spec)
}

// Admit decides and records (claim or enqueue). A non-nil error means the
// request is refused without a decision to act on: callers fail closed with
// that error. Almost every error (lock timeout, corrupt ledger) comes before
// anything was written. One wrapping ledger.ErrMaybeCommitted comes after:
// the decision was written and the disk failed to make it durable, so its
// claim (or queue entry) may stand, and every later reader sees it. The
// caller must then end it as it ends the claim of a container that never
// ran: a release of exactly that container id when its create is undone
// (the NRI plugin: the runtime's StopContainer and RemoveContainer of a
// refused create), or the release rule once the process the claim records
// is gone (the OCI hook, gpu-guard-ctl run). Taken for "nothing recorded",
// the claim of a container that never runs (no process: the liveness check
// keeps it) is never released. Otherwise d.Err() is nil only for
// Admit/Skip.
func (g *Guard) Admit(ctx context.Context, r Request) (Decision, error) {
	return g.admit(ctx, r, modeAdmit)
}

// AdmitIfFree is Admit for a requester that does not wait (an OCI hook
// without --wait): in one transaction under the ledger lock it claims, as
// Admit does, when the decision is to admit, and otherwise writes nothing
// (no queue entry, no release of a holder found exited, which the answer
// shows as Explain does) and returns the decision Explain would. The ledger
// is read once, where Explain then Admit read it twice, and no queue entry
// is ever made that would have to be withdrawn.
func (g *Guard) AdmitIfFree(ctx context.Context, r Request) (Decision, error) {
	return g.admit(ctx, r, modeIfFree)
}

// AdmitWithoutClaims is Admit for a front end whose ledger's claims cannot
// be trusted yet (the NRI plugin while it rebuilds them): a request the
// guard decides without the claims (no GPU, an exempt namespace, a policy
// refusal) is decided as Admit would, and any other returns ErrNeedsClaims
// and records nothing. The request is resolved once, so what is decided is
// what was checked: an inventory swapped in meanwhile (the daemon's
// re-discovery) cannot turn a request that named no known GPU into one
// decided on claims that are not rebuilt yet.
func (g *Guard) AdmitWithoutClaims(ctx context.Context, r Request) (Decision, error) {
	return g.admit(ctx, r, modeWithoutClaims)
}

// ErrNeedsClaims is AdmitWithoutClaims' answer to a request that can only
// be decided on the ledger's claims.
var ErrNeedsClaims = errors.New("the request is decided on the ledger's claims")

// How admit treats the ledger.
type admitMode int

const (
	modeAdmit         admitMode = iota // decide and record
	modeExplain                        // decide on a view, write nothing
	modeIfFree                         // record only an admission
	modeWithoutClaims                  // decide only what needs no claims
)

// errNotFree aborts an AdmitIfFree transaction whose decision is not to
// admit: Update then writes nothing.
var errNotFree = errors.New("not admitted: nothing recorded")

// Explain is Admit without any mutation (gpu-guard-ctl explain): the same
// decision, computed on a ledger view whose changes are discarded (it works
// on a read-only ledger). A holder found exited is shown as released in the
// answer, but stays in the ledger.
func (g *Guard) Explain(ctx context.Context, r Request) (Decision, error) {
	return g.admit(ctx, r, modeExplain)
}

// identity is the request's owner, bounded, with the front end the caller
// (the front end itself) set, which decides how far the owner's pod
// identity is trusted; and its requester key.
func (r Request) identity() (ledger.Owner, string) {
	owner := BoundOwner(r.Owner)
	if r.FrontEnd != "" {
		owner.FrontEnd = r.FrontEnd
	}
	key := r.Key
	if key == "" || !TrustsIdentity(owner.FrontEnd) {
		key = RequesterKey(owner)
	}
	return owner, key
}

func (g *Guard) admit(ctx context.Context, r Request, mode admitMode) (Decision, error) {
	dryRun := mode == modeExplain
	start := time.Now()
	owner, key := r.identity()

	d, res, done := g.preDecide(owner, r.Spec)
	if done {
		if d.Reason == reasonExempt && !dryRun {
			if err := g.auditExempt(ctx, owner, key, d, res); err != nil {
				g.log.Error("exempt request could not be audited; refused", append(ownerAttrs(owner, key),
					slog.Any("error", err))...)
				if !errors.Is(err, ledger.ErrNeedsRecovery) && !errors.Is(err, ledger.ErrLockTimeout) {
					err = fmt.Errorf("namespace %s is exempt (policy exempt_namespaces), but an exemption is granted only "+
						"once its audit record is on disk, and it could not be written; fix what follows: %w", owner.Namespace, err)
				}
				return Decision{}, g.ledgerError(owner, err)
			}
		}
		g.finish(d, owner, key, start, dryRun)
		return d, nil
	}
	if mode == modeWithoutClaims {
		return Decision{}, ErrNeedsClaims
	}

	if owner.Pid > 0 && owner.PidStart == 0 {
		owner.PidStart = g.pidStart(owner.Pid)
	}

	var (
		released []ledger.Claim
		st       ledger.State
	)
	var err error
	if dryRun {
		err = g.ledger.View(ctx, func(tx *ledger.Tx) error {
			var err error
			d, released, err = g.decide(tx, key, owner, res)
			return err
		})
	} else {
		err = g.ledger.Update(ctx, func(tx *ledger.Tx) error {
			var err error
			d, released, err = g.decide(tx, key, owner, res)
			if err != nil {
				return err
			}
			if mode == modeIfFree && d.Result != Admit && d.Result != Skip {
				return errNotFree
			}
			if g.observed {
				st = *tx.State() // already a copy the ledger keeps nothing of
			}
			return nil
		})
	}
	if errors.Is(err, errNotFree) {
		// Nothing was written: reported like Explain's answer.
		g.finish(d, owner, key, start, true)
		return d, nil
	}
	if err != nil {
		g.log.Error("admission decision failed", append(ownerAttrs(owner, key),
			slog.Any("devices", res.UUIDs()), slog.Any("error", err))...)
		if errors.Is(err, ledger.ErrMaybeCommitted) && !dryRun {
			if len(d.tookOver) > 0 {
				// The takeover may stand: should the restart's create be
				// undone, its removal hands the claims back as after a
				// success (see rememberTakeover).
				g.rememberTakeover(owner.ContainerID, d.tookOver)
			}
			return Decision{}, g.maybeRecordedError(owner, d, err)
		}
		return Decision{}, g.ledgerError(owner, err)
	}
	if !dryRun && len(d.tookOver) > 0 {
		g.rememberTakeover(owner.ContainerID, d.tookOver)
	}
	if !dryRun && g.observed {
		if len(released) > 0 {
			g.obs.Released(ReasonHolderExited, released)
		}
		g.obs.StateChanged(st)
	}
	g.finish(d, owner, key, start, dryRun)
	return d, nil
}

// ReasonInventoryIncomplete is the Decision.Reason of a GPU request refused
// because the inventory does not list the host's GPUs yet (the driver was
// not loaded when the daemon discovered them); the daemon retries.
const ReasonInventoryIncomplete = "inventory-incomplete"

// ReasonExempt is the Decision.Reason of an exempt request: a Skip that
// lets the container reach its GPUs without a claim.
const ReasonExempt = "exempt"

const reasonExempt = ReasonExempt

// preDecide settles what needs no ledger decision: requests without a GPU,
// exempt namespaces (which Admit audits) and requests the policies refuse.
// done is false when the ledger must be consulted for res.
func (g *Guard) preDecide(owner ledger.Owner, spec devices.Request) (d Decision, res devices.Resolution, done bool) {
	v := g.view.Load()
	res, err := v.resolver.Resolve(spec)
	if g.exempts(owner) && (err != nil || len(res.Devices) > 0 || res.All) {
		// Exempt requests skip every check, the policies' included; only a
		// request that reaches no GPU at all is not an exemption.
		return Decision{Result: Skip, Reason: reasonExempt, Devices: res.Devices,
			Message: fmt.Sprintf("namespace %q is exempt from GPU checks (policy exempt_namespaces)", owner.Namespace)}, res, true
	}
	if g.Exempt(owner.Namespace) {
		g.log.Info("namespace is in exempt_namespaces, but this front end cannot vouch for it; checked like any other",
			ownerAttrs(owner, "")...)
	}
	if v.inv.Undiscovered && (res.All || len(res.Devices) > 0 || errors.Is(err, devices.ErrUnknownDevice)) {
		// No discovery source worked at start (the driver is not loaded
		// yet) and no cache said what the GPUs are, or the discovery is
		// still running: every GPU is unknown, so every GPU request is
		// refused, whatever names it (the resolver refuses unknown ids over
		// an incomplete inventory under unknown_device = "ignore" too); a
		// request the policies refuse anyway keeps its own reason below.
		if v.discovering {
			return Decision{Result: Reject, Reason: ReasonInventoryIncomplete,
				Message: "GPU request refused: nri-gpu-guard is still discovering this host's GPUs (the NVIDIA driver's " +
					"enumeration took longer than the runtime lets a plugin answer; it goes on in the background); refused to stay safe, " +
					"retrying is automatic under Kubernetes and the request is decided as soon as the discovery ends; " +
					"containers without a GPU are not affected; see gpu-guard-ctl devices"}, res, true
		}
		if v.inv.Contradiction != "" {
			// The daemon decided with a static list it could not
			// check, and the driver, checked again, contradicts it.
			return Decision{Result: Reject, Reason: ReasonInventoryIncomplete,
				Message: "GPU request refused: the NVIDIA driver contradicts the [[devices.static]] list the guard decided with: " +
					v.inv.Contradiction + "; then restart the nri-gpu-guard daemon; see gpu-guard-ctl devices"}, res, true
		}
		return Decision{Result: Reject, Reason: ReasonInventoryIncomplete,
			Message: "GPU request refused: the GPU inventory is not known yet (no discovery source worked when the guard started: " +
				"is the NVIDIA driver loaded?); nri-gpu-guard retries the discovery by itself and admits GPU requests once it lists the GPUs " +
				"(a minute at most after nvidia-smi works); see gpu-guard-ctl devices"}, res, true
	}
	if err != nil {
		return Decision{Result: Reject, Reason: reasonFor(err), Devices: res.Devices,
			Message: policyText(err, g.policy, v.inv, owner.FrontEnd)}, res, true
	}
	if len(res.Devices) == 0 && res.All && v.inv.UnlistedGPUs > 0 {
		// "all" over an inventory that lists none of the host's GPUs: it
		// reaches every GPU there is, and which they are is not known.
		return Decision{Result: Reject, Reason: ReasonInventoryIncomplete,
			Message: fmt.Sprintf("GPU request refused: the container asks for every GPU, but the GPU inventory lists none while %d NVIDIA GPU(s) are on the PCI bus "+
				"(the driver was not loaded when the guard started?); nri-gpu-guard retries the discovery by itself and admits such requests once it lists the GPUs "+
				"(a minute at most after nvidia-smi works); see gpu-guard-ctl devices", v.inv.UnlistedGPUs)}, res, true
	}
	if len(res.Devices) == 0 {
		msg := "no GPU requested"
		if len(res.Notes) > 0 {
			msg += " (" + strings.Join(res.Notes, "; ") + ")"
		}
		return Decision{Result: Skip, Reason: "no-gpu", Message: msg}, res, true
	}
	return Decision{}, res, false
}

// decide runs inside one ledger transaction: find what is busy, release
// holders that exited without a stop event, let a container take over the
// claims of a stopped container of its pod on the devices it asks for,
// then claim, queue or refuse.
func (g *Guard) decide(tx *ledger.Tx, key string, owner ledger.Owner, res devices.Resolution) (Decision, []ledger.Claim, error) {
	now := g.now()
	want := make([]devices.Device, len(res.Devices))
	for i, rd := range res.Devices {
		want[i] = rd.Device
	}
	d := Decision{Devices: res.Devices}

	// A cordon refuses before anything else: no holder is settled and
	// nothing is queued for a device that takes no new claims.
	if cordoned := tx.CordonsOn(owner.ContainerID, want); len(cordoned) > 0 {
		g.refuseCordoned(tx, &d, key, owner, want, cordoned, now)
		return d, nil, nil
	}

	g.dropDeadReservers(tx, key, want)
	busy := tx.Busy(key, owner, want)
	var released, tookOver []ledger.Claim
	var kept map[incarnation]Verdict
	if len(busy) > 0 {
		busy, released, tookOver, kept = g.settleHolders(tx, key, owner, want, busy)
	}

	if len(busy) == 0 {
		var waited time.Duration
		if w, ok := tx.Waiter(key); ok {
			waited = now.Sub(w.FirstSeen)
		}
		if _, err := tx.Claim(key, owner, want, sourceText(res)); err != nil {
			var be *ledger.BusyError
			if !errors.As(err, &be) {
				return Decision{}, nil, fmt.Errorf("claim %s for %s: %w", naming.Devices(want), HolderName(owner), err)
			}
			// Busy said free but Claim disagrees: refuse with what Claim saw.
			busy = be.Busy
		} else {
			d.Result, d.Waited = Admit, waited
			switch {
			case len(tookOver) > 0:
				d.Reason = "takeover"
				d.tookOver = tookOver
			case len(released) > 0:
				d.Reason = "holder-exited"
			default:
				d.Reason = "free"
			}
			d.Message = "admitted: " + naming.Devices(want)
			return d, released, nil
		}
	}

	d.Busy = busy
	g.refuseOrQueue(tx, &d, key, owner, want, now, kept)
	return d, released, nil
}

// incarnation is one process of a holder: the release rule's verdict is
// about one process, and another container that runs under the same id
// (another runtime root) is another holder, checked and released on its own
// (see ledger.SameIncarnation).
type incarnation struct {
	id    string
	pid   int
	start uint64
}

func incarnationOf(o ledger.Owner) incarnation { return incarnation{o.ContainerID, o.Pid, o.PidStart} }

// settleHolders runs the release rule on the holders of the busy devices:
// an exited holder is released (or, under release_on = "remove", marked
// stopped, unless it was removed), and a stopped holder of the same pod
// (see samePod) is taken over when that admits the request: its claims in
// the way of want move to the requester, and it keeps the others (see
// ledger.Tx.TakeOver). It returns what is still busy, and the verdicts
// that kept or drained a holder, for the refusal's words.
func (g *Guard) settleHolders(tx *ledger.Tx, key string, owner ledger.Owner, want []devices.Device,
	busy []ledger.BusyDevice) (_ []ledger.BusyDevice, released, tookOver []ledger.Claim, kept map[incarnation]Verdict) {
	changed := false
	checked := map[incarnation]bool{}
	kept = map[incarnation]Verdict{}
	// predecessors are stopped holders this request may take over
	// (release_on = "remove", same pod).
	var predecessors []string
	for _, bd := range busy {
		if bd.Holder == nil {
			continue
		}
		h := bd.Holder.Owner
		inc := incarnationOf(h)
		if checked[inc] {
			continue
		}
		checked[inc] = true
		v := g.releasableFor(h, owner)
		stopped := v.Action == KeepStopped
		switch v.Action {
		case MarkStopped:
			// The claim lives until removal; the holder only
			// stops being a candidate for liveness checks. (A
			// container known by a conflict record alone has no
			// claim to mark: its record stays until the runtime
			// no longer lists it.)
			stopped, changed = true, true
			if tx.MarkStoppedIncarnation(h) {
				attrs := append(ownerAttrs(h, ""), slog.String("why", v.Why))
				if v.Unsure != "" {
					attrs = append(attrs, slog.String("removal_unknown", v.Unsure))
				}
				g.log.Info("holder exited without a stop event; kept until removal", attrs...)
			}
		case MarkDraining:
			// release_requires_idle: the cgroup is empty, but the GPU
			// may still hold its processes; the claim drains.
			changed = true
			if len(tx.MarkDrainingIncarnation(h, ReasonHolderExited+": "+v.Why)) > 0 {
				g.log.Info("holder exited without a stop event; claim kept draining until its processes leave the GPU",
					append(ownerAttrs(h, ""), slog.String("why", v.Why))...)
			}
		case ReleaseNow:
			rel := tx.ReleaseIncarnation(h, ReasonHolderExited+": "+v.Why)
			released = append(released, rel...)
			changed = true
			msg := "released: holder exited"
			if v.Deleted {
				msg = "released: holder exited and its container was removed"
			}
			g.log.Info(msg, append(ownerAttrs(h, ""), slog.String("why", v.Why), slog.Any("devices", claimUUIDs(rel)))...)
			continue
		}
		kept[inc] = v
		if stopped && g.policy.ReleaseOn == config.ReleaseOnRemove && samePod(h, owner) {
			predecessors = append(predecessors, h.ContainerID)
		}
	}
	if changed {
		busy = tx.Busy(key, owner, want)
	}
	// Take over only when that admits the request: a restart refused
	// for anything else must leave its predecessor's claim where it is,
	// or the refused container's Stop/Remove would release it before
	// the predecessor is removed (and under NRI a refused create's id is
	// not tracked: its Stop and Remove are ignored, and the claim would
	// stay with a container that never existed). What else stands in the
	// way is found before anything moves: the predecessors' claims hide
	// a device kept for the head of the queue (Busy looks for the keep
	// only where nothing holds the device).
	if len(predecessors) > 0 && len(busy) > 0 && onlyHeldBy(busy, predecessors) {
		if after := tx.BusyAfterTakeOver(key, owner, want, predecessors); len(after) > 0 {
			// Refused: the words name the predecessors, which keep their
			// claims, and what the takeover would not have removed (never
			// one of theirs: their claims would have been the request's).
			return append(busy, after...), released, nil, kept
		}
		for _, from := range predecessors {
			// The claims as they were, should the restart's create be
			// undone before it starts (see rememberTakeover): copies, read
			// before TakeOver moves them in place.
			var before []ledger.Claim
			for _, c := range tx.ReadState().Claims {
				if c.Owner.ContainerID == from {
					before = append(before, c)
				}
			}
			// Only the claims in the way of want move: the predecessor
			// keeps the others (a sibling of the requester may ask for
			// them), until its own release.
			moved := tx.TakeOver(from, owner, want, "container "+naming.ShortID(from)+" of the same pod has stopped")
			if len(moved) == 0 {
				continue
			}
			var kept []string
			for _, c := range before {
				if slices.ContainsFunc(moved, func(m ledger.Claim) bool { return m.Device.UUID == c.Device.UUID }) {
					tookOver = append(tookOver, c)
				} else {
					kept = append(kept, c.Device.UUID)
				}
			}
			attrs := append(ownerAttrs(owner, key), slog.String("from_container_id", from),
				slog.Any("devices", claimUUIDs(moved)))
			if len(kept) > 0 {
				attrs = append(attrs, slog.Any("kept_by_predecessor", kept))
			}
			g.log.Info("claim taken over from a stopped container of the same pod", attrs...)
		}
		busy = tx.Busy(key, owner, want)
	}
	return busy, released, tookOver, kept
}

// refuseOrQueue completes a decision whose devices are busy (d.Busy): the
// requester is queued (on_conflict = "queue") or refused and the refusal
// audited, and the message says who holds what and what to do.
func (g *Guard) refuseOrQueue(tx *ledger.Tx, d *Decision, key string, owner ledger.Owner, want []devices.Device, now time.Time,
	kept map[incarnation]Verdict) {
	d.Reason = "busy"
	if allReserved(d.Busy) {
		d.Reason = "reserved"
	}
	text := conflictText{
		now:     now,
		policy:  g.policy,
		busy:    d.Busy,
		waiter:  tx.Waiter,
		partial: tx.HoldsPartOfRequest,
		key:     key,
		hook:    owner.FrontEnd == ledger.FrontEndHook,
		kept:    kept,
	}
	if g.policy.OnConflict == config.ConflictQueue {
		d.Result = Queue
		d.Position, d.QueueLength = tx.Enqueue(key, owner, want)
		if w, ok := tx.Waiter(key); ok {
			d.Waited = now.Sub(w.FirstSeen)
		}
		text.queued, text.position, text.total, text.waited = true, d.Position, d.QueueLength, d.Waited
	} else {
		d.Result, d.Audited = Reject, true
		// Nothing else records a refusal that is not queued; the audit log
		// should still say who was turned away and why.
		tx.Audit(AuditRefuse, ledger.AuditRecord{
			Devices: deviceUUIDs(want), ContainerID: owner.ContainerID, Key: key,
			Namespace: owner.Namespace, Pod: owner.Pod, Container: owner.Container,
			FrontEnd: string(owner.FrontEnd), Reason: "on_conflict=reject: " + strings.Join(busyAttrs(d.Busy), "; "),
		})
	}
	text.free = freeGPUs(tx.State(), g.Inventory(), key)
	d.Message = text.String()
	d.words = text.words()
}

// auditExempt records an exemption: a container that reaches GPUs without a
// claim must leave a trace. Without the record on disk the exemption is not
// granted (the caller refuses), as for any decision the ledger cannot
// record. Not through Update: a commit that also changed state (an expired
// waiter, say) only logs a failed audit append, since the state it wrote
// stands; AppendAudit writes nothing but the record and returns its error.
func (g *Guard) auditExempt(ctx context.Context, owner ledger.Owner, key string, d Decision, res devices.Resolution) error {
	why := "policy exempt_namespaces lists namespace " + owner.Namespace
	if res.All {
		why += "; the container reaches every GPU"
	}
	return g.ledger.AppendAudit(ctx, ledger.AuditRecord{
		Op: AuditExempt, Devices: resolvedUUIDs(d.Devices), ContainerID: owner.ContainerID, Key: key,
		Namespace: owner.Namespace, Pod: owner.Pod, Container: owner.Container,
		FrontEnd: string(owner.FrontEnd), Reason: why,
	})
}

// finish logs the decision and reports it to the observer.
func (g *Guard) finish(d Decision, owner ledger.Owner, key string, start time.Time, dryRun bool) {
	latency := time.Since(start)
	attrs := append(ownerAttrs(owner, key),
		slog.String("result", string(d.Result)),
		slog.String("reason", d.Reason),
		slog.Any("devices", resolvedUUIDs(d.Devices)),
		slog.Duration("latency", latency),
	)
	if d.Result == Queue {
		attrs = append(attrs, slog.Int("position", d.Position), slog.Int("queue_length", d.QueueLength),
			slog.Duration("waited", d.Waited))
	}
	if len(d.Busy) > 0 {
		attrs = append(attrs, slog.Any("busy", busyAttrs(d.Busy)))
	}
	if d.Result == Queue || d.Result == Reject {
		attrs = append(attrs, slog.String("message", d.Message))
	}
	if dryRun {
		attrs = append(attrs, slog.Bool("dry_run", true))
		g.log.Debug("admission decision", attrs...)
		return
	}
	level := slog.LevelInfo
	if d.Result == Skip {
		level = slog.LevelDebug
	}
	g.log.Log(context.Background(), level, "admission decision", attrs...)
	g.obs.Decided(d, latency)
}

// ledgerError turns a failed ledger update into the error the front ends
// refuse the container with. A lock timeout says "ledger busy".
func (g *Guard) ledgerError(owner ledger.Owner, err error) error {
	who := HolderName(owner)
	switch {
	case errors.Is(err, ledger.ErrLockTimeout) && owner.FrontEnd == ledger.FrontEndHook:
		// Nothing retries a hook request: the person has to.
		return fmt.Errorf("GPU ledger busy: another process held the ledger lock, no decision for %s in time; "+
			"refused to stay safe, try again in a moment: %w", who, err)
	case errors.Is(err, ledger.ErrLockTimeout):
		return fmt.Errorf("GPU ledger busy: another process held the ledger lock, no decision for %s in time; "+
			"refused to stay safe, retrying is automatic under Kubernetes: %w", who, err)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		return fmt.Errorf("GPU ledger busy: no decision for %s before the request deadline; refused to stay safe: %w", who, err)
	case errors.Is(err, ledger.ErrLineageChanged):
		return fmt.Errorf("GPU ledger was started afresh by another process and is being rebuilt from the runtime's "+
			"containers (a new NRI sync, or in place by a plugin launched by containerd); refused %s to stay safe, "+
			"retrying is automatic: %w", who, err)
	case errors.Is(err, ledger.ErrNeedsRecovery) && owner.FrontEnd == ledger.FrontEndNRI:
		// The plugin asks for a new Synchronize (an external one reconnects),
		// which recovers the ledger and reconciles it with the runtime.
		return fmt.Errorf("GPU ledger needs recovery: NO container gets a GPU until it is recovered; refused %s. "+
			"The daemon recovers it and rebuilds the claims from the runtime's containers "+
			"(an external plugin reconnects for a new sync now; a plugin launched by containerd rebuilds in place "+
			"from the containers it tracks; retrying is automatic), or run `sudo gpu-guard-ctl recover`: %w", who, err)
	case errors.Is(err, ledger.ErrNeedsRecovery):
		return fmt.Errorf("GPU ledger needs recovery: NO container gets a GPU until it is recovered; refused %s. "+
			"Run `sudo gpu-guard-ctl recover` (it replays the journal onto the last good snapshot and keeps every "+
			"claim whose holder still runs), then start the container again: %w", who, err)
	default:
		return fmt.Errorf("GPU ledger error, refused %s to stay safe: %w", who, err)
	}
}

// maybeRecordedError is the refusal of a request whose decision d was
// written to the ledger and then failed to be made durable
// (ledger.ErrMaybeCommitted): the claim or queue entry may stand. It says
// what stands, how it ends, and where to look.
func (g *Guard) maybeRecordedError(owner ledger.Owner, d Decision, err error) error {
	who := HolderName(owner)
	want := make([]devices.Device, len(d.Devices))
	for i, rd := range d.Devices {
		want[i] = rd.Device
	}
	what := "its claim of " + naming.Devices(want)
	var ends string
	switch {
	case d.Result == Queue:
		// A queue entry outlives a refusal anyway: it keeps the
		// request's place for its retry.
		what = "its queue entry for " + naming.Devices(want)
		ends = "the entry keeps its place for the retry, as after any refusal that queues"
	case d.Result != Admit:
		// Nothing was recorded for it that must end.
		return g.ledgerError(owner, err)
	case IsTicket(owner):
		ends = "the claim is released once this gpu-guard-ctl run has exited (by the next request for those GPUs, " +
			"or `gpu-guard-ctl gc`); try again in a moment"
	case owner.FrontEnd == ledger.FrontEndHook:
		ends = "the claim is released once the refused container is gone (by the next request for those GPUs, " +
			"or `gpu-guard-ctl gc`); try again in a moment"
	default:
		ends = "the claim is released when the runtime undoes the refused create (its StopContainer and " +
			"RemoveContainer); retrying is automatic under Kubernetes"
	}
	return fmt.Errorf("GPU ledger: the decision for %s was written, then the disk failed to make it durable: it is refused "+
		"to stay safe, though %s may stand (every reader of the ledger sees it); %s; if this repeats, check the disk "+
		"of the ledger directory ([ledger] dir; the kernel log): %w", who, what, ends, err)
}

// Started records the pid and cgroup of a container once it runs, so that the
// liveness check can tell later whether it exited.
func (g *Guard) Started(ctx context.Context, containerID string, pid int, cgroup string) error {
	if pid <= 0 && cgroup == "" {
		return nil
	}
	var pidStart uint64
	if pid > 0 {
		pidStart = g.pidStart(pid)
	}
	err := g.update(ctx, "start", func(tx *ledger.Tx) bool {
		return tx.SetStarted(containerID, pid, pidStart, cgroup)
	})
	if err == nil {
		g.forgetTakeover(containerID) // it runs: the takeover is real
	}
	return err
}

// maxTakeovers bounds the takeovers remembered: one whose restart never
// starts nor is removed (an event missed) would otherwise stay for good.
// Forgetting one only loses the hand-back of a create undone later.
const maxTakeovers = 1024

// rememberTakeover keeps the claims restartID took over, as they were, until
// it starts or is removed. A restart's create can still be undone after
// its admission (a later NRI plugin's adjustment refused at validation, the
// runtime failing, an answer past the deadline): the runtime then stops and
// removes the restart, and releasing its claims would end the claim of the
// predecessor, which is still there (stopped, kept until its removal under
// release_on = "remove"), and let another pod take the GPU. Kept in memory
// only: the restart's create and its undo reach the same process, seconds
// apart; a daemon restart in between forgets it, and the claim is then
// released as before.
func (g *Guard) rememberTakeover(restartID string, originals []ledger.Claim) {
	g.takeoversMu.Lock()
	defer g.takeoversMu.Unlock()
	if g.takeovers == nil {
		g.takeovers = map[string][]ledger.Claim{}
	}
	if len(g.takeovers) >= maxTakeovers {
		for k := range g.takeovers {
			delete(g.takeovers, k)
			break
		}
	}
	g.takeovers[restartID] = originals
}

// takenOver returns the claims restart id took over, as they were.
func (g *Guard) takenOver(id string) []ledger.Claim {
	g.takeoversMu.Lock()
	defer g.takeoversMu.Unlock()
	return g.takeovers[id]
}

// forgetTakeover forgets what restart id took over: it started (the
// takeover is real), or what could be handed back was.
func (g *Guard) forgetTakeover(id string) {
	g.takeoversMu.Lock()
	defer g.takeoversMu.Unlock()
	delete(g.takeovers, id)
}

// forgetTakeoversFrom forgets the claims taken over from predecessor id,
// which is removed: a restart undone later has nobody to hand them back to.
// A restart may have taken over from several predecessors; what it took
// from the others is kept.
func (g *Guard) forgetTakeoversFrom(id string) {
	g.takeoversMu.Lock()
	defer g.takeoversMu.Unlock()
	for k, cs := range g.takeovers {
		kept := slices.DeleteFunc(slices.Clone(cs), func(c ledger.Claim) bool { return c.Owner.ContainerID == id })
		if len(kept) == 0 {
			delete(g.takeovers, k)
		} else {
			g.takeovers[k] = kept
		}
	}
}

// handBack gives the claims o took over back to its predecessor if o never
// started (its create was undone): see rememberTakeover.
func (g *Guard) handBack(ctx context.Context, o ledger.Owner) error {
	originals := g.takenOver(o.ContainerID)
	if len(originals) == 0 {
		return nil
	}
	var back []ledger.Claim
	err := g.update(ctx, "removed", func(tx *ledger.Tx) bool {
		back = tx.HandBack(o.ContainerID, originals, "the restart was removed before it started (its create was undone)")
		return len(back) > 0
	})
	if err != nil {
		return err // kept: the retried Removed tries again
	}
	g.forgetTakeover(o.ContainerID)
	for _, c := range back {
		g.log.Info("claim handed back to the restart's predecessor: the restart never started",
			append(ownerAttrs(o, ""), slog.String("to_container_id", c.Owner.ContainerID),
				slog.String("device", c.Device.UUID))...)
	}
	return nil
}

// Stopped handles a container whose processes exited: under release_on =
// "stop" its claims are released; under "remove" they are marked stopped and
// kept until removal. It never touches the queue: a refused create is
// followed by a Stop for the refused id, and its requester keeps its place.
func (g *Guard) Stopped(ctx context.Context, o ledger.Owner) error {
	if g.policy.ReleaseOn == config.ReleaseOnRemove {
		// Kept until removal; release_requires_idle drains it then.
		return g.update(ctx, "stop", func(tx *ledger.Tx) bool {
			return tx.MarkStopped(o.ContainerID)
		})
	}
	if g.requiresIdle() {
		return g.drain(ctx, o, "stopped")
	}
	return g.release(ctx, o, "stopped")
}

// Removed releases a removed container's claims (idempotent). Under
// release_requires_idle they are kept draining instead (a claim already
// draining keeps its start): removal does not prove that the container's
// processes left the GPU, and the drain grace bounds the wait.
func (g *Guard) Removed(ctx context.Context, o ledger.Owner) error {
	if err := g.handBack(ctx, o); err != nil {
		return err
	}
	g.forgetTakeoversFrom(o.ContainerID)
	if g.requiresIdle() {
		return g.drain(ctx, o, "removed")
	}
	return g.release(ctx, o, "removed")
}

func (g *Guard) release(ctx context.Context, o ledger.Owner, reason string) error {
	var rel []ledger.Claim
	err := g.update(ctx, reason, func(tx *ledger.Tx) bool {
		rel = tx.Release(o.ContainerID, reason)
		return len(rel) > 0
	})
	if err == nil && len(rel) > 0 {
		g.log.Info("released", append(ownerAttrs(o, ""), slog.String("reason", reason),
			slog.Any("devices", claimUUIDs(rel)))...)
	}
	return err
}

// RemovedExited is Removed for a front end that names the removed container
// by id alone while another container may run under the same id (an OCI
// hook's poststop: an id is unique only within one runtime root or
// containerd namespace, and two containers of one id are two holders, told
// apart by pid and pid start time, see ledger.SameIncarnation).
//
// Which claims are the removed container's is decided under the ledger
// lock, so that a container of the same id admitted at any moment before
// keeps its claim: a claim of the id whose recorded process still runs
// (runs reports it; nil: the pid recorded runs with the recorded start
// time, on the host's /proc) is another container's and is kept; RemovedExited
// returns those. With none kept it does what Removed does. Otherwise the
// other claims are released, or kept draining under release_requires_idle,
// incarnation by incarnation (ledger.ReleaseIncarnation,
// ledger.MarkDrainingIncarnation); a claim that records no process (pid and
// start time) cannot be told from a running one by those, and is released
// at once by its device.
func (g *Guard) RemovedExited(ctx context.Context, o ledger.Owner, runs func(ledger.Owner) bool) ([]ledger.Claim, error) {
	const reason = "removed"
	runs = orRunning(runs)
	var kept, ended []ledger.Claim
	drained := false
	err := g.update(ctx, reason, func(tx *ledger.Tx) bool {
		kept, ended, drained = nil, nil, false
		if o.ContainerID == "" {
			return false
		}
		var mine []ledger.Claim
		for _, c := range tx.ReadState().Claims {
			if c.Owner.ContainerID != o.ContainerID {
				continue
			}
			if runs(c.Owner) {
				kept = append(kept, c)
			} else {
				mine = append(mine, c)
			}
		}
		before := drainingUUIDs(tx)
		if len(kept) == 0 {
			// Claims and conflict records of the id: Removed.
			if g.requiresIdle() {
				tx.MarkDraining(o.ContainerID, reason)
			} else {
				ended = tx.Release(o.ContainerID, reason)
			}
			drained = newlyDraining(tx, before)
			return tx.Changed() // conflict records ended count too
		}
		for _, c := range mine {
			if !stillHeld(tx, c) {
				continue // ended with an earlier claim of its incarnation
			}
			if slices.ContainsFunc(kept, func(k ledger.Claim) bool { return ledger.SameIncarnation(&k.Owner, &c.Owner) }) {
				// It records no process that tells it from a running
				// one: this device alone, released at once.
				if rel, err := tx.ReleaseDevice(c.Device.UUID, reason); err == nil {
					ended = append(ended, rel)
				}
				continue
			}
			if g.requiresIdle() {
				tx.MarkDrainingIncarnation(c.Owner, reason)
			} else {
				ended = append(ended, tx.ReleaseIncarnation(c.Owner, reason)...)
			}
		}
		drained = newlyDraining(tx, before)
		return tx.Changed()
	})
	if err != nil {
		return nil, err
	}
	if len(ended) > 0 {
		g.log.Info("released", append(ownerAttrs(o, ""), slog.String("reason", reason),
			slog.Any("devices", claimUUIDs(ended)))...)
	}
	if drained {
		g.log.Info("holder "+reason+"; claim kept draining until its processes leave the GPU",
			append(ownerAttrs(o, ""), slog.Duration("idle_grace", g.cfg.Observe.IdleGrace.Duration))...)
	}
	return kept, nil
}

// orRunning is runs, or when nil liveness.Running over the host's /proc
// (the recorded pid runs with the recorded start time).
func orRunning(runs func(ledger.Owner) bool) func(ledger.Owner) bool {
	if runs != nil {
		return runs
	}
	return func(o ledger.Owner) bool { return liveness.Running(liveness.DefaultProcRoot, o.Pid, o.PidStart) }
}

// drainingUUIDs lists the devices whose claims are draining in tx.
func drainingUUIDs(tx *ledger.Tx) map[string]bool {
	out := map[string]bool{}
	for _, c := range tx.Draining() {
		out[c.Device.UUID] = true
	}
	return out
}

// newlyDraining reports whether a claim drains in tx that did not in before.
func newlyDraining(tx *ledger.Tx, before map[string]bool) bool {
	return slices.ContainsFunc(tx.Draining(), func(c ledger.Claim) bool { return !before[c.Device.UUID] })
}

// stillHeld reports whether c's device is still held by c's incarnation in
// tx.
func stillHeld(tx *ledger.Tx, c ledger.Claim) bool {
	for i := range tx.ReadState().Claims {
		if h := &tx.ReadState().Claims[i]; h.Device.UUID == c.Device.UUID {
			return ledger.SameIncarnation(&h.Owner, &c.Owner)
		}
	}
	return false
}

// WithdrawExited is Withdraw for a front end that names the requester by a
// container id that another container may share (see RemovedExited): key's
// queue entry (and its reservations) is dropped unless the process it
// records still runs (runs reports it; nil as for RemovedExited), decided
// under the ledger lock.
// kept reports an entry left in place for that reason.
func (g *Guard) WithdrawExited(ctx context.Context, key, reason string, runs func(ledger.Owner) bool) (kept bool, err error) {
	runs = orRunning(runs)
	err = g.update(ctx, "withdraw", func(tx *ledger.Tx) bool {
		kept = false
		w, ok := tx.Waiter(key)
		if !ok {
			return false
		}
		if runs(w.Owner) {
			kept = true
			return false
		}
		return tx.DropWaiter(key, reason)
	})
	return kept, err
}

// PodGone releases every claim of front end fe's stopped or removed pod
// sandbox and drops its waiters: a waiter whose pod is gone never claims.
// The sandbox id decides (ledger.PodMatches): the kubelet replaces a pod's
// sandbox under the same pod UID and removes the old one later, and that
// removal must leave the new sandbox's containers alone; the pod UID counts
// only where the event or the ledger has no sandbox id. Only fe's own claims
// and waiters are touched: another front end's pod identity may be
// annotations a container's creator wrote.
func (g *Guard) PodGone(ctx context.Context, fe ledger.FrontEnd, podUID, sandboxID string) error {
	var (
		rel     []ledger.Claim
		dropped []ledger.Waiter
	)
	err := g.update(ctx, "pod gone", func(tx *ledger.Tx) bool {
		drained := false
		if g.requiresIdle() {
			drained = g.drainPod(tx, fe, podUID, sandboxID)
		} else {
			rel = tx.ReleasePod(fe, podUID, sandboxID, "pod gone")
		}
		dropped = tx.DropPodWaiters(fe, podUID, sandboxID, "pod gone")
		return drained || len(rel) > 0 || len(dropped) > 0
	})
	if err == nil && (len(rel) > 0 || len(dropped) > 0) {
		keys := make([]string, len(dropped))
		for i, w := range dropped {
			keys[i] = w.Key
		}
		g.log.Info("pod gone", slog.String("pod_uid", podUID), slog.String("pod_sandbox_id", sandboxID),
			slog.Any("released", claimUUIDs(rel)), slog.Any("dropped_waiters", keys))
	}
	return err
}

// Withdraw takes a waiter out of the queue (its request was abandoned).
func (g *Guard) Withdraw(ctx context.Context, key, reason string) error {
	return g.update(ctx, "withdraw", func(tx *ledger.Tx) bool {
		return tx.DropWaiter(key, reason)
	})
}

// listedEntry is one container of a runtime's list, as Reconcile and
// ListedHoldings read it.
type listedEntry struct {
	owner ledger.Owner
	res   devices.Resolution
	err   error // the request no longer resolves: res is what a lenient policy still reaches
}

// listedEntries resolves the containers of front end fe's list (exempt ones
// left out): a request that no longer resolves reaches what a lenient policy
// still resolves (err set).
func (g *Guard) listedEntries(fe ledger.FrontEnd, live []Request) []listedEntry {
	entries := make([]listedEntry, 0, len(live))
	var lenient *devices.Resolver // built on the first request that fails
	v := g.view.Load()
	for _, r := range live {
		// The containers are the runtime's own list for front end fe;
		// that front end decides how far their identity is trusted.
		o := r.Owner
		o.FrontEnd = fe
		if o.Pid > 0 && o.PidStart == 0 {
			o.PidStart = g.pidStart(o.Pid)
		}
		o = BoundOwner(o)
		if g.exempts(o) {
			continue
		}
		res, err := v.resolver.Resolve(r.Spec)
		if err != nil {
			if lenient == nil {
				lenient = devices.NewResolver(v.inv, reachablePolicy(g.policy))
			}
			res, _ = lenient.Resolve(r.Spec) // nothing when even that fails
		}
		entries = append(entries, listedEntry{owner: o, res: res, err: err})
	}
	return entries
}

// ListedHoldings is what the containers of front end fe's list reach, as
// Reconcile reads them, for a recovery that must know them in the commit
// that writes the recovered state (ledger.RecoverOptions.Running): between
// that commit and the reconcile another front end could otherwise be
// admitted onto a GPU one of them uses.
func (g *Guard) ListedHoldings(fe ledger.FrontEnd, live []Request) []ledger.Holding {
	var out []ledger.Holding
	for _, e := range g.listedEntries(fe, live) {
		if len(e.res.Devices) == 0 {
			continue // no GPU: nothing to keep for it (Reconcile skips it too)
		}
		h := ledger.Holding{Owner: e.owner, Source: sourceText(e.res)}
		for _, rd := range e.res.Devices {
			h.Devices = append(h.Devices, rd.Device)
		}
		out = append(out, h)
	}
	return out
}

// Reconcile makes the ledger's claims of front end fe match the containers
// the runtime lists as live: listed containers reaching GPUs without a claim
// are adopted, and two listed containers on one GPU are recorded as a
// conflict. A claim of a container not listed ends only as the release rule
// says (unlistedRule): released ("stale") once its processes are gone, or
// when it never started, marked draining instead under
// release_requires_idle, and kept while its processes run or cannot be told
// gone — containerd does not list a running container it could not load
// after a restart (CRI state UNKNOWN), and that container still uses its
// GPU. A listed container whose request no longer resolves (inventory or
// policy changed: an id the inventory lacks, a privileged container under
// privileged = "reject") keeps the claims it has, and is adopted for, or
// recorded in conflict on, what it reaches all the same (reachable): it
// runs, so what it can open is not free. Nothing is released on doubt.
func (g *Guard) Reconcile(ctx context.Context, fe ledger.FrontEnd, live []Request) (ledger.ReconcileResult, error) {
	entries := g.listedEntries(fe, live)
	for _, e := range entries {
		if e.err != nil {
			g.log.Warn("reconcile: container request does not resolve; its claims are kept, and what it still reaches is not free",
				append(ownerAttrs(e.owner, ""), slog.Any("error", e.err), slog.Any("reaches", resolvedUUIDs(e.res.Devices)))...)
		}
	}
	listedIDs := make(map[string]bool, len(live))
	for _, r := range live {
		listedIDs[r.Owner.ContainerID] = true
	}

	var (
		rep ledger.ReconcileReport
		st  ledger.State
	)
	err := g.ledger.Update(ctx, func(tx *ledger.Tx) error {
		holdings := make([]ledger.Holding, 0, len(entries))
		for _, e := range entries {
			var devs []devices.Device
			source := sourceText(e.res)
			for _, rd := range e.res.Devices {
				devs = append(devs, rd.Device)
			}
			if e.err != nil {
				for _, c := range tx.State().Claims {
					if c.Owner.ContainerID == e.owner.ContainerID && !slices.ContainsFunc(devs, func(d devices.Device) bool { return d.UUID == c.Device.UUID }) {
						devs = append(devs, c.Device)
						source = c.Source
					}
				}
			}
			if len(devs) == 0 {
				continue
			}
			holdings = append(holdings, ledger.Holding{Owner: e.owner, Devices: devs, Source: source})
		}
		// Reconcile also fills in the pid and cgroup of claims that lack
		// them (the daemon restarted after the container started).
		rep = tx.ReconcileWith(fe, holdings, g.unlistedRule(listedIDs))
		st = *tx.State() // already a copy the ledger keeps nothing of
		return nil
	})
	if err != nil {
		return ledger.ReconcileResult{}, fmt.Errorf("reconcile %d live containers with the ledger: %w", len(live), err)
	}
	result := rep.ReconcileResult
	g.obs.Released(ReasonStale, result.Released)
	g.obs.StateChanged(st)
	for _, c := range result.Released {
		g.log.Info("released: stale", append(ownerAttrs(c.Owner, ""), slog.String("device", c.Device.UUID))...)
	}
	for _, c := range rep.Drained {
		g.log.Info("reconcile: container no longer listed; claim kept draining until its processes leave the GPU",
			append(ownerAttrs(c.Owner, ""), slog.String("device", c.Device.UUID))...)
	}
	for _, c := range rep.Kept {
		g.log.Warn("reconcile: the runtime does not list this container, but its processes are not known to have exited; "+
			"its claim is kept (containerd leaves out a running container it could not load after a restart) and ends "+
			"at its stop or removal, or once it is found exited",
			append(ownerAttrs(c.Owner, ""), slog.String("device", c.Device.UUID), slog.String("device_index", c.Device.Index))...)
	}
	for _, c := range result.Adopted {
		g.log.Info("adopted claim", append(ownerAttrs(c.Owner, ""), slog.String("device", c.Device.UUID))...)
	}
	for _, c := range result.Conflicts {
		g.log.Warn("conflict: container uses a GPU another container holds",
			append(ownerAttrs(c.Owner, ""), slog.String("device", c.Device.UUID), slog.String("device_index", c.Device.Index))...)
	}
	g.log.Info("reconciled", slog.String("front_end", string(fe)), slog.Int("live", len(live)),
		slog.Int("holding", len(entries)), slog.Int("released", len(result.Released)),
		slog.Int("adopted", len(result.Adopted)), slog.Int("conflicts", len(result.Conflicts)),
		slog.Int("drained", len(rep.Drained)), slog.Int("kept_unlisted", len(rep.Kept)))
	return result, nil
}

// unlistedRule is the release rule Reconcile applies to a holder the ledger
// gets no list entry for (see ledger.UnlistedRule); listed are the ids the
// runtime listed, GPU or not.
//
//   - Listed, but reaching no GPU now (exempt, or its request resolves to
//     none under the current configuration): the runtime's list says it
//     runs without the device: released (draining under
//     release_requires_idle), as a listed container no longer on a device
//     it holds is.
//   - Its processes run, or the check cannot tell (KeepRunning): kept. Not
//     being listed is no evidence of exit: containerd leaves out a running
//     container it could not load after a restart (CRI state UNKNOWN: its
//     shim did not answer in time, its task is paused).
//   - Its processes are gone (found now, or recorded as stopped under
//     release_on = "remove": an exited-but-not-removed holder's GPU is free):
//     released, or marked draining under release_requires_idle.
//   - It never started (no pid, no cgroup recorded): released (draining
//     under release_requires_idle). The runtime lists every created
//     container, so one that never started and is not listed is gone: lost
//     by a runtime that crashed while creating it, or deleted while the
//     plugin was away. No event will ever name it again, and kept, its
//     claim would hold the GPU until an operator released it. A running
//     container the runtime hides as UNKNOWN has started, which the plugin
//     records (its start events carry the pid): only one whose start the
//     plugin never recorded (it was away, or the ledger stayed locked)
//     could still run there.
func (g *Guard) unlistedRule(listed map[string]bool) ledger.UnlistedRule {
	gone := ledger.UnlistedRelease
	if g.requiresIdle() {
		gone = ledger.UnlistedDrain
	}
	return func(o ledger.Owner) ledger.UnlistedVerdict {
		if listed[o.ContainerID] {
			return ledger.UnlistedVerdict{Action: gone,
				Why: "the runtime lists it, but it reaches no GPU it holds under the current configuration"}
		}
		v := g.Releasable(o)
		switch v.Action {
		case KeepRunning:
			return ledger.UnlistedVerdict{Action: ledger.UnlistedKeep, Why: v.Why}
		case KeepDraining:
			return ledger.UnlistedVerdict{Action: ledger.UnlistedKeep, Why: "draining"}
		case KeepNotStarted:
			// Safe even when containerd, after a restart, hides a
			// created-but-not-started container as CRI UNKNOWN (its
			// status could not be loaded): its CRI StartContainer refuses
			// a container not in state CONTAINER_CREATED, so an UNKNOWN
			// one can never be started (the kubelet removes it and
			// creates another, which asks for its GPU anew) and its
			// process never runs the workload.
			return ledger.UnlistedVerdict{Action: gone, Why: "it never started, and the runtime lists every created container"}
		case KeepStopped:
			return ledger.UnlistedVerdict{Action: gone, Why: "it exited at " + o.StoppedAt.UTC().Format(time.RFC3339)}
		default: // found exited now: MarkStopped, MarkDraining, ReleaseNow
			return ledger.UnlistedVerdict{Action: gone, Why: v.Why}
		}
	}
}

// dropDeadReservers takes out of the queue the OCI hook waiters (a hook's
// --wait, a gpu-guard-ctl run ticket) that hold a reservation on a device
// conflicting with want and whose process is gone: nobody will ever use
// what they were kept, and the freed GPU would otherwise stay idle until
// reservation_ttl, whoever asks for it (the hook drops them itself before
// asking; an NRI request did not). An NRI waiter has no process while it
// waits (the kubelet retries it): its pid says nothing, and it is left
// alone. Their reservations pass on as the queue's rules say.
func (g *Guard) dropDeadReservers(tx *ledger.Tx, self string, want []devices.Device) {
	var dead []ledger.Waiter
	for _, r := range tx.State().Reservations {
		if r.For == self || !slices.ContainsFunc(want, func(d devices.Device) bool { return devices.Conflicts(d, r.Device) }) ||
			slices.ContainsFunc(dead, func(w ledger.Waiter) bool { return w.Key == r.For }) {
			continue
		}
		if w, ok := tx.Waiter(r.For); ok && g.deadHookWaiter(w) {
			dead = append(dead, w)
		}
	}
	for _, w := range dead {
		tx.DropWaiter(w.Key, "waiter gone: its process "+strconv.Itoa(w.Owner.Pid)+" exited")
	}
	// The head of the queue keeps, without a reservation, the free MIG
	// instances of a GPU it asks for whole (ledger.Tx.Busy's KeptFor): a
	// dead hook waiter there would keep them from everyone until
	// queue_ttl. Each head dropped makes the next waiter the head: a few
	// are looked at, not the whole queue.
	for range maxDeadHeads {
		head, wants, ok := tx.HeadWaitsFor()
		if !ok || head.Key == self || !anyConflict(wants, want) || !g.deadHookWaiter(head) {
			return
		}
		tx.DropWaiter(head.Key, "waiter gone: its process "+strconv.Itoa(head.Owner.Pid)+" exited")
	}
}

// maxDeadHeads bounds the dead heads of the queue one request drops.
const maxDeadHeads = 8

// deadHookWaiter reports whether w is an OCI hook waiter (a hook's --wait,
// a gpu-guard-ctl run ticket) whose process, known by pid and start time,
// is gone. An NRI waiter has no process while it waits.
func (g *Guard) deadHookWaiter(w ledger.Waiter) bool {
	if w.Owner.FrontEnd != ledger.FrontEndHook || w.Owner.Pid <= 0 || w.Owner.PidStart == 0 {
		return false
	}
	gone, _ := g.live.Exited(liveness.Process{Pid: w.Owner.Pid, PidStart: w.Owner.PidStart})
	return gone
}

// anyConflict reports whether a device of a conflicts with one of b.
func anyConflict(a, b []devices.Device) bool {
	return slices.ContainsFunc(a, func(x devices.Device) bool {
		return slices.ContainsFunc(b, func(y devices.Device) bool { return devices.Conflicts(x, y) })
	})
}

// reachablePolicy is the policy under which Reconcile reads what a running
// container whose request the configured policy refuses still reaches:
// unknown ids are skipped rather than refused, a request for every GPU and a
// privileged container get every GPU. What "all" means when all_devices =
// "ignore" (the runtime does not give it every GPU) stays the operator's.
func reachablePolicy(p config.PolicyConfig) config.PolicyConfig {
	p.UnknownDevice = config.UnknownIgnore
	if p.AllDevices == config.AllReject {
		p.AllDevices = config.AllClaim
	}
	if p.Privileged == config.PrivilegedReject {
		p.Privileged = config.PrivilegedAll
	}
	return p
}

// update runs one lifecycle mutation and reports the new state when fn says
// something changed.
func (g *Guard) update(ctx context.Context, op string, fn func(tx *ledger.Tx) bool) error {
	var (
		changed bool
		st      ledger.State
	)
	err := g.ledger.Update(ctx, func(tx *ledger.Tx) error {
		// fn's own account, or any mutation the transaction made (an
		// ended conflict record, say, that fn did not count).
		changed = fn(tx) || tx.Changed()
		if changed {
			st = *tx.State() // already a copy the ledger keeps nothing of
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("ledger %s: %w", op, err)
	}
	if changed {
		g.obs.StateChanged(st)
	}
	return nil
}

func (g *Guard) pidStart(pid int) uint64 {
	ps, ok := g.live.(PidStarter)
	if !ok {
		return 0
	}
	start, err := ps.PidStart(pid)
	if err != nil {
		return 0
	}
	return start
}

// Err returns nil for Admit and Skip; otherwise an error whose text is the
// Message and which wraps ErrQueued (Queue) or ErrRejected (Reject).
func (d Decision) Err() error {
	switch d.Result {
	case Queue:
		return &DecisionError{Decision: d, sentinel: ErrQueued}
	case Reject:
		return &DecisionError{Decision: d, sentinel: ErrRejected}
	default:
		return nil
	}
}

// DecisionError is the error of a Queue or Reject decision.
type DecisionError struct {
	Decision Decision
	sentinel error
}

// Error is the decision's operator-facing message.
func (e *DecisionError) Error() string { return e.Decision.Message }

// Unwrap returns ErrQueued or ErrRejected.
func (e *DecisionError) Unwrap() error { return e.sentinel }

// reasonFor maps a resolution error to a machine-readable reason.
func reasonFor(err error) string {
	switch {
	case errors.Is(err, devices.ErrUnknownDevice):
		return "unknown-device"
	case errors.Is(err, devices.ErrInvalidID):
		return "invalid-id"
	case errors.Is(err, devices.ErrAllRejected):
		return "policy-all"
	case errors.Is(err, devices.ErrPrivilegedRejected):
		return "policy-privileged"
	case errors.Is(err, devices.ErrTooLarge):
		return "too-large"
	default:
		return "invalid-request"
	}
}

// samePod reports whether a and b are two containers of the same pod, the
// condition for b taking over the claim of a, which has stopped (release_on
// = "remove"): a restart of a, or the pod's next container. The device
// plugin hands an app container the devices of the pod's init containers,
// and the kubelet removes a finished init container only with its pod:
// limited to a restart of the same name, the takeover left the pod's own
// app container queued for good behind it. Any container of the pod may
// take it over: a stopped holder runs nothing, so the GPU still has one
// user, and should it start again it queues like any other. The pod is its
// UID, not its sandbox: a pod whose sandbox the kubelet replaced runs its
// containers again in the new one, while the stopped ones of the old
// sandbox are kept until the pod's garbage collection. Both pod identities
// must come from a front end that vouches for them (TrustsIdentity): a hook
// container naming another's pod uid must not take its claim, nor may a
// trusted container take the claim of a hook container that named its pod.
func samePod(a, b ledger.Owner) bool {
	return TrustsIdentity(a.FrontEnd) && TrustsIdentity(b.FrontEnd) && a.PodUID != "" && a.PodUID == b.PodUID &&
		a.ContainerID != b.ContainerID
}

// restartOf reports whether holder h is an earlier incarnation of the
// requester's own container: the same id through the same front end, another
// process. A runtime creates an id again only once it deleted the container
// of that id: podman does so at every restart and every start of a stopped
// container, and a create it undid after admission runs no poststop, so the
// claim is still there when the container is started again.
func restartOf(h, requester ledger.Owner) bool {
	return h.ContainerID == requester.ContainerID && h.FrontEnd == requester.FrontEnd &&
		!ledger.SameIncarnation(&h, &requester)
}

// releasableFor is Releasable for holder h as the request of requester sees
// it (releasableForRequester).
func (g *Guard) releasableFor(h, requester ledger.Owner) Verdict {
	return releasableForRequester(h, requester, g.policy.ReleaseOn, g.requiresIdle(), g.live, g.rt)
}

// releasableForRequester is ReleasableIdle for holder h as the request of
// requester sees it. An earlier incarnation of the requester's own container
// (restartOf) is judged as removed, whatever release_on says (its id was
// created again), and with the requester's process not counted as its: the
// runtime names the cgroup after the id, so the restart runs in the cgroup
// its predecessor recorded (liveness.Process.Successor). Otherwise the
// restart found its own predecessor alive, or kept until a removal that had
// happened, and was refused in its own name.
func releasableForRequester(h, requester ledger.Owner, releaseOn config.ReleaseOn, requiresIdle bool, live Liveness, rt Runtimes) Verdict {
	if !restartOf(h, requester) {
		return ReleasableIdle(h, releaseOn, requiresIdle, live, rt)
	}
	shared := requester.Pid > 0 && h.Cgroup != "" && h.Cgroup == requester.Cgroup
	if shared {
		live = successorLiveness{live, requester.Pid}
	}
	v := ReleasableIdle(h, config.ReleaseOnStop, requiresIdle, live, nil)
	if v.Action == KeepStopped {
		// Exited earlier, kept until its removal, which the new create shows.
		v = Verdict{Action: ReleaseNow, Deleted: true, Why: "it exited at " + h.StoppedAt.UTC().Format(time.RFC3339)}
		if requiresIdle {
			v.Action = MarkDraining
		}
	}
	switch v.Action {
	case ReleaseNow, MarkDraining:
		v.Why += "; its container was created again (a restart)"
	case KeepRunning:
		// Kept for what else runs in the cgroup they share: the refusal
		// says so. (With no shared cgroup the holder is as much another
		// container as one of another runtime root.)
		v.EarlierIncarnation = shared
	}
	return v
}

// successorLiveness is a Liveness that tells it which process of a holder's
// cgroup is its successor's (see releasableFor).
type successorLiveness struct {
	Liveness
	pid int
}

func (s successorLiveness) Exited(p liveness.Process) (bool, string) {
	p.Successor = s.pid
	return s.Liveness.Exited(p)
}

// onlyHeldBy reports whether every busy device is held (not reserved) by one
// of the containers ids, through a claim: a container found running on a
// device without one (a conflict record) has nothing to take over.
func onlyHeldBy(busy []ledger.BusyDevice, ids []string) bool {
	for _, b := range busy {
		if b.Holder == nil || b.Conflict || !slices.Contains(ids, b.Holder.Owner.ContainerID) {
			return false
		}
	}
	return true
}

func allReserved(busy []ledger.BusyDevice) bool {
	for _, b := range busy {
		if b.Holder != nil || b.Reservation == nil {
			return false
		}
	}
	return len(busy) > 0
}

// freeGPUs lists the full GPUs that no claim touches (on the GPU or one of its
// MIG instances) and that are not reserved for another requester than key.
func freeGPUs(st *ledger.State, inv *devices.Inventory, key string) []devices.Device {
	var free []devices.Device
	for _, gpu := range inv.GPUs {
		dev, ok := inv.Lookup(gpu.UUID)
		if !ok {
			continue
		}
		taken := false
		for _, c := range st.Claims {
			if devices.Conflicts(c.Device, dev) {
				taken = true
				break
			}
		}
		for _, k := range st.Cordons {
			if devices.Conflicts(k.Device, dev) {
				taken = true // not free for a new claim
			}
		}
		for _, r := range st.Reservations {
			if !taken && r.For != key && devices.Conflicts(r.Device, dev) {
				taken = true
			}
		}
		if !taken {
			free = append(free, dev)
		}
	}
	return free
}

// maxSourceLen bounds the per-claim source text kept in the ledger.
const maxSourceLen = 512

// sourceText summarises where a request named its devices, for the claim.
func sourceText(res devices.Resolution) string {
	var srcs []string
	for _, d := range res.Devices {
		for _, s := range d.Sources {
			if !slices.Contains(srcs, s) {
				srcs = append(srcs, s)
			}
		}
	}
	s := strings.Join(srcs, "; ")
	if len(s) > maxSourceLen {
		s = s[:maxSourceLen] + "…"
	}
	return s
}

func ownerAttrs(o ledger.Owner, key string) []any {
	attrs := []any{slog.String("container_id", o.ContainerID)}
	if o.Namespace != "" || o.Pod != "" {
		attrs = append(attrs, slog.String("namespace", o.Namespace), slog.String("pod", o.Pod),
			slog.String("pod_uid", o.PodUID))
	}
	if o.PodSandboxID != "" {
		attrs = append(attrs, slog.String("pod_sandbox_id", o.PodSandboxID))
	}
	if o.Container != "" {
		attrs = append(attrs, slog.String("container", o.Container))
	}
	if o.FrontEnd != "" {
		attrs = append(attrs, slog.String("front_end", string(o.FrontEnd)))
	}
	if key != "" {
		attrs = append(attrs, slog.String("key", key))
	}
	return attrs
}

func resolvedUUIDs(rs []devices.Resolved) []string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = r.UUID
	}
	return out
}

func deviceUUIDs(ds []devices.Device) []string {
	out := make([]string, len(ds))
	for i, d := range ds {
		out[i] = d.UUID
	}
	return out
}

func claimUUIDs(cs []ledger.Claim) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Device.UUID
	}
	return out
}

func busyAttrs(busy []ledger.BusyDevice) []string {
	out := make([]string, 0, len(busy))
	for _, b := range busy {
		switch {
		case b.Holder != nil:
			out = append(out, b.Wanted.UUID+" held by "+b.Holder.Owner.ContainerID)
		case b.Reservation != nil:
			out = append(out, b.Wanted.UUID+" reserved for "+b.Reservation.For)
		case b.KeptFor != nil:
			out = append(out, b.Wanted.UUID+" kept for "+b.KeptFor.Key)
		default:
			out = append(out, b.Wanted.UUID)
		}
	}
	return out
}
