// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package nriplugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/config"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/naming"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/runtimescan"
)

// Compile-time checks: the stub finds handlers by type assertion, so a
// handler with a wrong signature would silently never be subscribed.
var (
	_ stub.ConfigureInterface          = (*Plugin)(nil)
	_ stub.SynchronizeInterface        = (*Plugin)(nil)
	_ stub.CreateContainerInterface    = (*Plugin)(nil)
	_ stub.StartContainerInterface     = (*Plugin)(nil)
	_ stub.PostStartContainerInterface = (*Plugin)(nil)
	_ stub.StopContainerInterface      = (*Plugin)(nil)
	_ stub.RemoveContainerInterface    = (*Plugin)(nil)
	_ stub.StopPodInterface            = (*Plugin)(nil)
	_ stub.RemovePodInterface          = (*Plugin)(nil)
	_ stub.ShutdownInterface           = (*Plugin)(nil)

	_ stub.ValidateContainerAdjustmentInterface = (*Plugin)(nil)
)

// Events is the explicit subscription. It leaves out events 12–14 (pod
// sandbox updates, adjustment validation): runtimes older than NRI v0.10
// (containerd 2.0, 2.1) refuse a plugin subscribing to them. EventsFor adds
// the validation where the runtime has it.
var Events = func() api.EventMask {
	var m api.EventMask
	m.Set(
		api.Event_CREATE_CONTAINER,
		api.Event_START_CONTAINER,
		api.Event_POST_START_CONTAINER,
		api.Event_STOP_CONTAINER,
		api.Event_REMOVE_CONTAINER,
		api.Event_STOP_POD_SANDBOX,
		api.Event_REMOVE_POD_SANDBOX,
	)
	return m
}()

// EventsFor is the subscription for the runtime and version named at
// Configure: Events, without PostStartContainer for containerd. containerd
// (1.7, 2.0–2.4) sends StartContainer after it created the container's
// task, with its pid, so the start is recorded there; PostStartContainer
// would only add a round trip to every container's start. Other runtimes
// keep it, for a pid that StartContainer did not carry.
//
// containerd 2.2 and later (NRI v0.10) also get ValidateContainerAdjustment
// (see Plugin.ValidateContainerAdjustment): a plugin with a higher index
// than the guard's can add a GPU after the guard decided, and only the
// validation, which comes after every plugin, sees it. Older containerd
// refuses a plugin that subscribes to it; a version that cannot be read is
// taken for an older one (the plugin must register).
func EventsFor(runtime, version string) api.EventMask {
	if runtime == "containerd" {
		m := Events
		m.Clear(api.Event_POST_START_CONTAINER)
		if atLeast(version, 2, 2) {
			m.Set(api.Event_VALIDATE_CONTAINER_ADJUSTMENT)
		}
		return m
	}
	return Events
}

// atLeast reports whether a runtime version ("v2.2.1", "2.2.1+unknown",
// "2.3.0-rc.1") is major.minor or later.
func atLeast(version string, major, minor int) bool {
	v := strings.TrimPrefix(version, "v")
	fields := strings.SplitN(v, ".", 3)
	if len(fields) < 2 {
		return false
	}
	num := func(s string) (int, bool) {
		end := 0
		for end < len(s) && s[end] >= '0' && s[end] <= '9' {
			end++
		}
		if end == 0 || end > 4 {
			return 0, false
		}
		n, err := strconv.Atoi(s[:end])
		return n, err == nil
	}
	ma, ok1 := num(fields[0])
	mi, ok2 := num(fields[1])
	if !ok1 || !ok2 {
		return false
	}
	return ma > major || (ma == major && mi >= minor)
}

// SetupFunc builds the guard for a configuration: it opens the ledger and
// loads the GPU inventory. The plugin calls it when it is first configured
// and again when the runtime hands it a different configuration, from
// Configure, whose answer the runtime awaits for its request timeout only:
// it must answer by ctx's end (the request's deadline less a margin for
// the reply). A discovery that takes longer goes on in the background over
// a guard that refuses GPU requests meanwhile (guard.Guard.Discovering;
// the daemon's Builder does so).
type SetupFunc func(ctx context.Context, cfg config.Config) (*guard.Guard, error)

// Options configure a Plugin.
type Options struct {
	// Config is used when the runtime's Configure carries no configuration
	// (an external plugin, or a launched one without a conf.d file).
	Config config.Config
	// Setup builds the guard; required.
	Setup SetupFunc
	// Logger; nil = discard.
	Logger *slog.Logger
	// Ready is told true once the plugin is registered and synchronized with
	// the runtime, false when the connection is lost; nil = ignored.
	Ready func(bool)
	// Exempt, when set, is told which containers of exempt namespaces run
	// (they use GPUs without claims: the GPU observer must not take them
	// for intruders).
	Exempt ExemptTracker
	// Gauges, when set, is told what the plugin is retrying in the
	// background (metrics.Metrics implements it).
	Gauges Gauges
}

// Gauges shows the plugin's background retries, which otherwise only its
// log tells of.
type Gauges interface {
	// SetRebuilding is told whether containers asking for a GPU are refused
	// until the ledger is rebuilt from the runtime's containers.
	SetRebuilding(bool)
	// SetReleasesDue is told how many releases of stopped or removed
	// containers (or pods) failed and are being retried: their GPUs stay
	// held until then.
	SetReleasesDue(int)
}

// ExemptTracker follows the running containers of exempt namespaces
// (daemon.Watch implements it).
type ExemptTracker interface {
	// SetExempt records container id, whose cgroupsPath the runtime gave
	// as cgroup ("" if none), as running (true) or gone.
	SetExempt(id, cgroup string, exempt bool)
	// ResetExempt replaces the set (the runtime's list at a Synchronize):
	// container id → cgroupsPath.
	ResetExempt(cgroups map[string]string)
}

// Plugin implements the NRI handlers. One Plugin serves one connection at a
// time; Run creates a fresh stub for each (re)connection.
type Plugin struct {
	base   config.Config
	setup  SetupFunc
	log    *slog.Logger
	ready  func(bool)
	exempt ExemptTracker
	gauges Gauges

	mu sync.Mutex
	g  *guard.Guard
	// cfgText is the Configure string g was built from ("" = base).
	cfgText string
	// tracked holds the containers that may hold an NRI claim (holders and
	// the containers of conflict records), so that the start/stop/remove of
	// the many containers without a GPU cost no ledger write under
	// containerd's global NRI lock, with each one's request as last seen:
	// what the runtime would list for it at a Synchronize. It is rebuilt at
	// every Synchronize and grows with every admission, and with every
	// create refused although its claim may stand (mayHoldClaim). trackGen
	// counts its changes.
	tracked  map[string]trackedCtr
	trackGen uint64
	// known holds the id of every container the runtime has shown this
	// plugin (listed at the last Synchronize, or created since) and not yet
	// removed, GPU or not, exempt or not: the containers of this front end.
	// A recovery that reads the OCI runtimes' state for the hook's
	// containers leaves these out (on a CRI-O host they are in runc's root
	// too), not only the tracked ones.
	known map[string]struct{}
	// exemptAtCreate holds the ids whose CreateContainer granted (and
	// audited) an exemption, until their validation: it must not audit
	// the same exemption again. What admission saw, lower-index plugins'
	// changes included, is not in the validation request (it carries the
	// pristine container).
	exemptAtCreate map[string]struct{}
	// creating are the CreateContainer handlers running, by container id
	// (see startCreation).
	creating map[string]*creation
	// afterRecover, when set, runs between a reconcile's recovery and its
	// reconcile with the runtime's list (tests: another front end's turn).
	afterRecover func()
	// validates: the runtime asks ValidateContainerAdjustment (EventsFor).
	validates atomic.Bool
	// pendingPods, set by a failed Synchronize of a launched plugin (see
	// syncFailed), holds the uids of the pods it listed and of every pod a
	// container was created in since: once the rebuild succeeds, the waiters
	// of any other pod are dropped, as that Synchronize would have done.
	pendingPods map[string]struct{}
	// pendingMu guards pendingPods alone. It is never held while the ledger
	// lock is taken, so that the drop of vanished pods' waiters can ask it
	// under the ledger lock (see forgetVanishedPods).
	pendingMu sync.Mutex
	// resync asks Run for a rebuild of the ledger from the runtime's
	// containers after it was found needing recovery (damaged, missing or
	// replaced) or started afresh by another process: an external plugin
	// reconnects for a new Synchronize; a launched one, which cannot,
	// rebuilds in place from tracked (rebuildInPlace).
	resync chan struct{}
	// rebuilding is set from a resync request until the rebuild is done:
	// meanwhile creations that need the ledger's holders (those asking for
	// a GPU) are refused, since the ledger knows none (setRebuilding).
	rebuilding atomic.Bool
	// rebuildCause is the ledger error that made the rebuild necessary, or
	// the one its last attempt failed with (a lock timeout names the lock's
	// holder): the refusals show it (rebuildingError), so that whoever reads
	// one knows what to look at. Its text only, never wrapped into a
	// refusal (see refusal): a lock timeout wraps the context's error.
	rebuildCause atomic.Pointer[string]
	// admitting is held shared by a create from its last rebuilding check
	// to the end of its decision, and exclusively by a rebuild (which lifts
	// the ledger's lineage fence to rebuild on the new lineage): a create
	// never decides against a ledger whose fence a rebuild lifted, and a
	// create that finds a rebuild running refuses rather than wait.
	admitting sync.RWMutex
	// inPlace is set by Run for a launched plugin (see resync); tests set
	// forceInPlace to get that behaviour on an external connection.
	inPlace      atomic.Bool
	forceInPlace bool
	// registeredName is the name Run registers under (a string; unset
	// before Run): the --name flag, or the one containerd gives a plugin it
	// launches. Validation finds the guard in the plugin list by it.
	registeredName atomic.Value

	// flight counts handlers in progress and when the last one ended, so
	// that neither a reconnect nor a shutdown cuts a reply on its way to the
	// runtime. idle is closed while inflight is 0.
	flight   sync.Mutex
	inflight int
	idle     chan struct{}
	lastDone time.Time
	// due holds the releases that failed and are retried until they
	// succeed (see due.go), by container id (a pod's by "pod/" and its
	// sandbox id); dueSeq numbers them; retrying is set while
	// retryReleases runs. dueMu guards the three.
	dueMu    sync.Mutex
	due      map[string]dueRelease
	dueSeq   uint64
	retrying bool
	// releasing is a one-slot lock held by a retry of the due releases,
	// and by a create while it checks that no release of its container id
	// is due: a retry that began before is over by then, and none begins
	// after, so none ends the claims of a new container of that id.
	releasing chan struct{}
	// life ends the background retries of due releases when Run returns
	// (halt).
	life context.Context
	halt context.CancelFunc

	// starts counts the start records being committed in the background
	// (recordStart): every handler that reads or writes the ledger waits for
	// them first, so that it sees them as if they had been committed inside
	// StartContainer.
	starts *pending
	// entered, when set (tests), is called as a handler starts.
	entered func(handler string)
	// decisionCtx, when set (tests), replaces decisionContext for the
	// handlers' ledger work, so that a test can see the deadline a handler
	// was given and end its wait without racing the runtime's timer.
	decisionCtx func(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc)
}

// handling marks a handler in progress; defer the result (directly: it
// calls recover). A panic in a handler would otherwise kill the process,
// and containerd before 2.2 creates the container in flight unchecked when
// its connection to the plugin breaks (later lines refuse it, but drop the
// plugin). The panic is logged with its stack and,
// when errp is set, turned into a refusal.
func (p *Plugin) handling(handler string, errp *error) func() {
	p.flight.Lock()
	if p.inflight == 0 {
		p.idle = make(chan struct{})
	}
	p.inflight++
	p.flight.Unlock()
	if p.entered != nil {
		p.entered(handler)
	}
	return func() {
		if r := recover(); r != nil {
			p.log.Error("internal error in an NRI handler (recovered; please report this)", "handler", handler,
				"panic", fmt.Sprint(r), "stack", string(debug.Stack()))
			if errp != nil {
				*errp = fmt.Errorf("nri-gpu-guard: internal error in %s, refused to stay safe (please report this): %v", handler, r)
			}
		}
		p.flight.Lock()
		p.inflight--
		p.lastDone = time.Now()
		if p.inflight == 0 {
			close(p.idle)
		}
		p.flight.Unlock()
	}
}

// waitQuiet waits until no handler has run for resyncQuiet and reports
// whether it got there before abort or closed fired. A reply leaves within
// microseconds of its handler's return, but it does leave after: closing
// the connection under it would make containerd drop the plugin and (before
// 2.2) create that container unchecked.
func (p *Plugin) waitQuiet(abort, closed <-chan struct{}) bool {
	for {
		p.flight.Lock()
		busy, idle, since := p.inflight > 0, p.idle, time.Since(p.lastDone)
		p.flight.Unlock()
		var timer *time.Timer
		var wake <-chan time.Time
		if !busy {
			if since >= resyncQuiet {
				return true
			}
			timer = time.NewTimer(resyncQuiet - since)
			wake, idle = timer.C, nil
		}
		done := false
		select {
		case <-abort:
			done = true
		case <-closed:
			done = true
		case <-idle:
		case <-wake:
		}
		if timer != nil {
			timer.Stop()
		}
		if done {
			return false
		}
	}
}

type trackedCtr struct {
	sandboxID string
	started   bool // pid/cgroup recorded
	starting  bool // being recorded in the background
	// stopped: its stop event came (release_on = "remove" keeps it tracked
	// until its removal), or its create was refused (mayHoldClaim); a
	// Synchronize would not list it.
	stopped bool
	// req is the container's request as the runtime last showed it (with
	// its pid and cgroup once started): what rebuildInPlace reconciles.
	req guard.Request
}

// New returns a Plugin.
func New(opts Options) (*Plugin, error) {
	if opts.Setup == nil {
		return nil, errors.New("nriplugin: no guard setup function")
	}
	p := &Plugin{
		base:           opts.Config,
		setup:          opts.Setup,
		log:            opts.Logger,
		ready:          opts.Ready,
		exempt:         opts.Exempt,
		gauges:         opts.Gauges,
		tracked:        map[string]trackedCtr{},
		known:          map[string]struct{}{},
		exemptAtCreate: map[string]struct{}{},
		creating:       map[string]*creation{},
		resync:         make(chan struct{}, 1),
		due:            map[string]dueRelease{},
		releasing:      make(chan struct{}, 1),
		idle:           make(chan struct{}),
		starts:         newPending(),
	}
	close(p.idle)
	p.life, p.halt = context.WithCancel(context.Background())
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	if p.ready == nil {
		p.ready = func(bool) {}
	}
	return p, nil
}

// Guard returns the current guard, nil before the first Configure.
func (p *Plugin) Guard() *guard.Guard {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.g
}

// Configure applies the configuration the runtime passed (launched plugins
// get the conf.d file's content; external plugins get nothing and keep the
// base configuration) and subscribes to Events.
func (p *Plugin) Configure(ctx context.Context, cfgText, runtime, version string) (api.EventMask, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.log.Info("configured by runtime", "runtime", runtime, "runtime_version", version,
		"config_from_runtime", cfgText != "")
	mask := EventsFor(runtime, version)
	p.validates.Store(mask.IsSet(api.Event_VALIDATE_CONTAINER_ADJUSTMENT))
	if runtime == "containerd" && !p.validates.Load() && !atLeast(version, 0, 0) {
		p.log.Warn("containerd's version cannot be read: the plugins' adjustments are not validated (other NRI plugins "+
			"with a higher index can add GPUs unchecked, and any plugin's CDI devices go unseen); keep plugins that add devices, env or "+
			"mounts below this one's index, and let none add CDI devices or device cgroup rules, or remove env or devices", "runtime_version", version)
	}
	p.warnHooksUnderNRI(runtime)
	if p.g != nil && cfgText == p.cfgText {
		return mask, nil
	}
	cfg := p.base
	if cfgText != "" {
		parsed, err := config.Parse([]byte(cfgText))
		if err != nil {
			return 0, fmt.Errorf("nri-gpu-guard: configuration from the runtime (NRI conf.d): %w", err)
		}
		cfg = parsed
	}
	// Within the request's deadline: a plugin that answers Configure late
	// is dropped, its registration refused (a launched one is not
	// relaunched until containerd restarts), and containers are then
	// created unchecked or, with the validator, all refused.
	sctx, cancel := decisionContext(ctx, 0)
	defer cancel()
	g, err := p.setup(sctx, cfg)
	if err != nil {
		return 0, fmt.Errorf("nri-gpu-guard: setup: %w", err)
	}
	p.g, p.cfgText = g, cfgText
	return mask, nil
}

// hookDirs are the OCI hooks directories CRI-O reads when its hooks_dir is
// not set, and the hook files the packages install there.
var (
	hookDirs  = []string{"/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d"}
	hookFiles = []string{"nri-gpu-guard-create-runtime.json", "nri-gpu-guard-poststop.json"}
)

// warnHooksUnderNRI warns when CRI-O, which also runs OCI hooks, connects
// while the guard's hooks files are in its default hooks directories: each
// GPU container is then checked by both front ends, and the hook, which
// honours no exempt namespace, claims the GPUs of exempt containers
// (docs/hook.md, podman and CRI-O).
func (p *Plugin) warnHooksUnderNRI(runtime string) {
	if r := strings.ToLower(runtime); !strings.Contains(r, "cri-o") && !strings.Contains(r, "crio") {
		return
	}
	seen := false
	for _, dir := range hookDirs {
		if _, err := os.Stat(dir); err == nil {
			seen = true
		}
		for _, f := range hookFiles {
			path := filepath.Join(dir, f)
			if _, err := os.Stat(path); err == nil {
				p.log.Warn("CRI-O runs NRI plugins and may also run nri-gpu-guard's OCI hooks: unless CRI-O's hooks_dir "+
					"([crio.runtime] in crio.conf) leaves this directory out, every GPU container is checked twice and "+
					"the hook claims the GPUs of containers in exempt namespaces", "hook_file", path)
				return
			}
		}
	}
	if !seen {
		// In a pod, which mounts none of them.
		p.log.Info("CRI-O connected; its OCI hooks directories are not visible here, so whether it also runs "+
			"nri-gpu-guard's OCI hooks cannot be checked: if the packages are installed on the host, make CRI-O's "+
			"hooks_dir ([crio.runtime] in crio.conf) leave out their nri-gpu-guard-*.json files", "hook_dirs", hookDirs)
	}
}

// Synchronize reconciles the ledger with every container the runtime lists
// (CREATED and RUNNING ones; exited containers are not listed, so their claims
// go), drops the waiters of pods that no longer exist, and marks the plugin
// ready.
func (p *Plugin) Synchronize(ctx context.Context, pods []*api.PodSandbox, ctrs []*api.Container) (_ []*api.ContainerUpdate, err error) {
	defer p.handling("Synchronize", &err)()
	g := p.Guard()
	if g == nil {
		return nil, errors.New("nri-gpu-guard: synchronize before configure")
	}
	// The whole reconcile shares one budget inside the request deadline: a
	// late answer gets the plugin dropped; an error only makes an external
	// plugin reconnect and try again.
	ctx, cancel := decisionContext(ctx, 0)
	defer cancel()
	p.settleStarts(ctx)
	byID := make(map[string]*api.PodSandbox, len(pods))
	for _, pod := range pods {
		byID[pod.GetId()] = pod
	}
	live := make([]guard.Request, 0, len(ctrs))
	exempt := map[string]string{}
	known := make(map[string]struct{}, len(ctrs))
	for _, c := range ctrs {
		pod := byID[c.GetPodSandboxId()]
		live = append(live, guardRequest(pod, c))
		known[c.GetId()] = struct{}{}
		if g.Exempt(pod.GetNamespace()) {
			exempt[c.GetId()] = c.GetLinux().GetCgroupsPath()
		}
	}
	if p.exempt != nil {
		p.exempt.ResetExempt(exempt)
	}
	p.mu.Lock()
	p.known = known
	p.mu.Unlock()
	if discovering, replaced := g.Discovering(); discovering {
		p.awaitDiscovery(live, pods, replaced)
		return nil, nil
	}
	mark := p.dueMark()
	p.admitting.Lock()
	res, tracked, err := p.reconcile(ctx, g, live, "NRI Synchronize: rebuilt, then reconciled with the runtime's containers")
	p.admitting.Unlock()
	if err != nil {
		if p.inPlace.Load() {
			p.syncFailed(live, pods, err)
			return nil, nil
		}
		// An external plugin's connection is closed by the runtime on this
		// error; Run reconnects with backoff, and the next Synchronize
		// tries again.
		return nil, fmt.Errorf("%w (the plugin reconnects and synchronizes again; if this repeats, see the ledger error)", err)
	}
	p.mu.Lock()
	p.tracked = tracked
	p.trackGen++
	p.mu.Unlock()
	p.pendingMu.Lock()
	p.pendingPods = nil
	p.pendingMu.Unlock()
	p.settleDue(mark)

	// Waiters of pods removed while the plugin was away never get their
	// RemovePodSandbox: the guard drops them now.
	uids := make([]string, 0, len(pods))
	for _, pod := range pods {
		uids = append(uids, pod.GetUid())
	}
	gone, err := g.ForgetVanishedPods(ctx, ledger.FrontEndNRI, uids)
	if err != nil {
		p.log.Warn("dropping waiters of vanished pods failed", "error", err)
	}
	p.log.Info("synchronized with runtime", "pods", len(pods), "containers", len(ctrs),
		"released", len(res.Released), "adopted", len(res.Adopted), "conflicts", len(res.Conflicts),
		"tracked", len(tracked), "vanished_pods", gone)
	p.setRebuilding(false, nil)
	p.ready(true)
	return nil, nil
}

// syncFailed is a launched plugin's answer to a Synchronize whose reconcile
// failed (the ledger lock held past the request's budget by a gpu-guard-ctl
// command or a hook, a recovery that failed). An error would make containerd
// stop the plugin for good, since it relaunches pre-installed plugins only
// when it restarts itself: GPU containers would then be created unchecked,
// or, with required_plugins, every container refused. Instead the plugin
// answers, tracks every container the runtime listed (the input of a
// rebuild: those holding no GPU drop out of it) and rebuilds in place with
// backoff (rebuildInPlace, through resync), refusing GPU containers until
// the ledger matches the runtime again.
func (p *Plugin) syncFailed(live []guard.Request, pods []*api.PodSandbox, err error) {
	p.trackListed(live, pods)
	p.setRebuilding(true, err)
	p.log.Error("synchronizing with the runtime failed: the GPU ledger could not be reconciled with the runtime's containers; "+
		"the plugin stays registered (containerd would not relaunch it) and rebuilds the ledger in place, retrying with backoff; "+
		"containers asking for a GPU are refused until then", "containers", len(live), "pods", len(pods), "error", err)
	select {
	case p.resync <- struct{}{}:
	default: // one is pending already
	}
}

// trackListed makes the containers and pods of a Synchronize that was not
// reconciled the input of the rebuild that will be: every container listed
// is tracked (those holding no GPU drop out at the rebuild), and the pods'
// uids are kept for dropping the waiters of the others once it succeeded
// (pendingPods).
func (p *Plugin) trackListed(live []guard.Request, pods []*api.PodSandbox) {
	tracked := make(map[string]trackedCtr, len(live))
	for _, r := range live {
		tracked[r.Owner.ContainerID] = trackedCtr{
			sandboxID: r.Owner.PodSandboxID,
			started:   r.Owner.Pid > 0 || r.Owner.Cgroup != "",
			req:       r,
		}
	}
	uids := make(map[string]struct{}, len(pods))
	for _, pod := range pods {
		uids[pod.GetUid()] = struct{}{}
	}
	p.mu.Lock()
	p.tracked = tracked
	p.trackGen++
	p.mu.Unlock()
	p.pendingMu.Lock()
	p.pendingPods = uids
	p.pendingMu.Unlock()
}

// awaitDiscovery answers a Synchronize that comes while the guard's GPU
// discovery still runs (its Setup answered Configure before a slow NVML
// enumeration ended; see guard.Guard.Discovering). The ledger is not
// reconciled yet: over an inventory that knows no GPU, a running
// container's GPUs could be neither adopted nor recorded in conflict, and
// once the discovery's inventory is in, they would read as free. Meanwhile
// the guard refuses every GPU request (saying the discovery is in progress)
// and decides the others as always; stops and removals of the containers
// listed release their claims as always. Once the discovery's inventory is
// swapped in, the ledger is rebuilt as after a failed Synchronize (resync):
// a launched plugin reconciles in place with the containers listed here,
// less those stopped or removed since; an external one reconnects for a new
// Synchronize. The plugin reports ready only then.
func (p *Plugin) awaitDiscovery(live []guard.Request, pods []*api.PodSandbox, replaced <-chan struct{}) {
	p.trackListed(live, pods)
	// Rebuilding from now on, not from the rebuild's start: between the
	// swap and the rebuild a GPU request would be decided on a ledger
	// that has not adopted the running containers yet.
	p.setRebuilding(true, errSyncedDiscovering)
	p.log.Warn("synchronized with the runtime while the GPU discovery still runs: containers asking for a GPU are refused "+
		"until it ends; the ledger is then reconciled with the containers listed", "containers", len(live), "pods", len(pods))
	go func() {
		select {
		case <-replaced:
		case <-p.life.Done():
			return
		}
		if !p.rebuilding.Load() {
			// A later Synchronize (an external plugin's reconnect) came
			// after the discovery and reconciled already.
			return
		}
		p.log.Info("GPU discovery ended: reconciling the ledger with the runtime's containers")
		select {
		case p.resync <- struct{}{}:
		default: // one is pending already
		}
	}()
}

// forgetVanishedPods drops the waiters of the pods a failed Synchronize
// would have found gone (see pendingPods), once a rebuild succeeded.
//
// pendingPods keeps recording the pods of new creations until the drop has
// committed, and is read under the ledger lock: a create admitted since the
// rebuild whose request queued a waiter before the drop took the lock has
// recorded its pod, which therefore counts as live.
func (p *Plugin) forgetVanishedPods(ctx context.Context, g *guard.Guard) {
	p.pendingMu.Lock()
	active := p.pendingPods != nil
	p.pendingMu.Unlock()
	if !active {
		return
	}
	isLive := func(uid string) bool {
		p.pendingMu.Lock()
		defer p.pendingMu.Unlock()
		_, ok := p.pendingPods[uid]
		return ok
	}
	gone, err := g.ForgetPodsNotLive(ctx, ledger.FrontEndNRI, isLive)
	p.pendingMu.Lock()
	p.pendingPods = nil
	p.pendingMu.Unlock()
	if err != nil {
		// Not worth another rebuild: those waiters leave after queue_ttl.
		p.log.Warn("dropping waiters of vanished pods failed; they leave after policy.queue_ttl", "error", err)
		return
	}
	p.log.Info("dropped the waiters of pods gone before the plugin could synchronize", "vanished_pods", gone)
}

// reconcile makes the ledger's NRI claims match live, the runtime's
// containers (Synchronize's list, or what rebuildInPlace remembers of it),
// and returns the containers to track from then on: those of live that hold
// an NRI claim or are in a conflict record.
//
// It runs on whatever lineage the ledger has now: it is what rebuilds a
// ledger started afresh. A ledger that needs recovery is recovered first
// (or, if nothing verifies, started empty): live is the truth it is then
// reconciled with. Every later handler requires the resulting lineage: a
// ledger another process starts afresh has forgotten the running holders,
// and is handled like a corruption found here.
func (p *Plugin) reconcile(ctx context.Context, g *guard.Guard, live []guard.Request, reason string) (ledger.ReconcileResult, map[string]trackedCtr, error) {
	return p.reconcileWith(ctx, g, live, reason, nil)
}

// reconcileWith is reconcile with the runtimes' state already read
// (preReadHooks; nil: read it now if a recovery needs it).
func (p *Plugin) reconcileWith(ctx context.Context, g *guard.Guard, live []guard.Request, reason string, hooks *runtimescan.Result) (ledger.ReconcileResult, map[string]trackedCtr, error) {
	led := g.Ledger()
	led.RequireLineage("")
	opts := ledger.RecoverOptions{AllowEmpty: true, Reason: reason}
	if _, err := led.Snapshot(ctx); errors.Is(err, ledger.ErrNeedsRecovery) {
		hookRun, hookWhy, herr := p.hookHoldings(ctx, g, live, hooks)
		if herr != nil {
			// Recovering without them would lose the claims of the OCI
			// hook's running containers: the rebuild is tried again.
			return ledger.ReconcileResult{}, nil, fmt.Errorf("nri-gpu-guard: recover the ledger: the OCI hook's containers: %w", herr)
		}
		// The runtime's own containers go into the recovered state's
		// commit too, after the hook's (a GPU both use stays the hook
		// container's, the runtime's is a conflict, as the reconcile would
		// record it): the recovery and the reconcile are two lock holds,
		// and an OCI hook admitted between them would find the GPUs of
		// running containers free. The reconcile then finds them claimed.
		listed := g.ListedHoldings(ledger.FrontEndNRI, live)
		opts.Running = slices.Concat(hookRun, listed)
		opts.RunningWhy = func(i int) string {
			if i < len(hookRun) {
				return hookWhy(i)
			}
			return "recover: listed by the runtime (" + reason + ")"
		}
	}
	if rep, err := led.Recover(ctx, opts); err != nil {
		return ledger.ReconcileResult{}, nil, fmt.Errorf("nri-gpu-guard: recover the ledger: %w", err)
	} else if rep.Problem != "" {
		p.log.Warn("ledger recovered before reconciling with the runtime's containers", "problem", rep.Problem, "from", rep.From,
			"replayed", rep.Replayed, "complete", rep.Complete, "lost", rep.Lost, "quarantined", rep.Quarantined)
	}
	if p.afterRecover != nil {
		p.afterRecover()
	}
	res, err := g.Reconcile(ctx, ledger.FrontEndNRI, live)
	if err != nil {
		return res, nil, fmt.Errorf("nri-gpu-guard: %w", err)
	}
	led.RequireLineage(res.Lineage)
	st, err := led.Snapshot(ctx)
	if err != nil {
		return res, nil, fmt.Errorf("nri-gpu-guard: read ledger after reconcile: %w", err)
	}
	byID := make(map[string]guard.Request, len(live))
	for _, r := range live {
		byID[r.Owner.ContainerID] = r
	}
	tracked := map[string]trackedCtr{}
	track := func(o *ledger.Owner) {
		if o.FrontEnd != ledger.FrontEndNRI {
			return
		}
		t := tracked[o.ContainerID]
		t.sandboxID = o.PodSandboxID
		t.started = t.started || o.Pid > 0 || o.Cgroup != ""
		if r, ok := byID[o.ContainerID]; ok {
			t.req = r
		} else {
			// Kept by the reconcile although not listed (draining, or
			// still running: containerd does not list a container it
			// could not load): its stop or removal still releases it, and
			// an in-place rebuild leaves it out of the list, as the
			// runtime does, so the release rule decides it again.
			t.req, t.stopped = guard.Request{FrontEnd: ledger.FrontEndNRI, Owner: *o}, true
		}
		tracked[o.ContainerID] = t
	}
	for i := range st.Claims {
		track(&st.Claims[i].Owner)
	}
	// A container in a conflict record may be handed the claim when the
	// holder goes; its own stop and removal must then release it.
	for i := range st.Conflicts {
		track(&st.Conflicts[i].Owner)
	}
	return res, tracked, nil
}

// hookHoldings lists, for a recovery, the containers of the OCI hook front
// end that the runtimes' state dirs ([hook] runtime_roots) show live, with
// the GPUs each one's spec names: on a host where podman or CRI-O runs
// containers beside containerd's, a recovery that lost commits (or found
// nothing to recover) would otherwise forget their claims, and nothing
// else would bring them back. Containers of this front end (live, and every
// one the runtime has shown the plugin: on a CRI-O host they are in runc's
// root too) are left to the reconcile. pre is a read made earlier
// (rebuildOnce); nil reads now, within ctx's deadline.
func (p *Plugin) hookHoldings(ctx context.Context, g *guard.Guard, live []guard.Request, pre *runtimescan.Result) ([]ledger.Holding, func(int) string, error) {
	res := pre
	if res == nil {
		var err error
		if res, err = p.readHooks(ctx, g); err != nil || res == nil {
			return nil, nil, err
		}
	}
	nri := make(map[string]bool, len(live))
	for _, r := range live {
		nri[r.Owner.ContainerID] = true
	}
	p.mu.Lock()
	for id := range p.known {
		nri[id] = true
	}
	p.mu.Unlock()
	holdings, why := res.Without(nri)
	p.log.Warn("the ledger needs recovery: the OCI hook's running containers are adopted from the runtimes' state",
		"roots", res.Roots, "live", res.Live, "hook_containers", len(holdings), "unresolved", len(res.Unresolved),
		"problems", len(res.Problems))
	for _, n := range res.Unresolved {
		p.log.Warn("a running container's GPUs cannot be told: its claims are kept, nothing is adopted for it",
			"container", n.ID, "runtime", n.Runtime, "error", n.Error)
	}
	return holdings, func(i int) string { return why[i] }, nil
}

// readHooks reads the runtimes' state for hookHoldings, by ctx's deadline
// (a Synchronize answered late gets the plugin dropped, and a launched one
// is not relaunched). nil, nil: nothing to read (no runtime_roots, or none
// readable here).
func (p *Plugin) readHooks(ctx context.Context, g *guard.Guard) (*runtimescan.Result, error) {
	roots := g.Config().Hook.RuntimeRoots
	if len(roots) == 0 {
		return nil, nil
	}
	// The host's /proc: a DaemonSet runs with hostPID.
	deadline, _ := ctx.Deadline()
	res, err := readHookState(roots, "", deadline, func() (*guard.Guard, error) { return g, nil })
	if err != nil {
		return nil, fmt.Errorf("read the OCI runtimes' state (%s): %w", strings.Join(roots, ", "), err)
	}
	if len(res.Roots) == 0 {
		// A DaemonSet pod does not mount them: on a node where podman or
		// CRI-O run hooked containers, their claims are not given back.
		p.log.Warn("the ledger needs recovery, but none of hook.runtime_roots is readable here: the claims of containers "+
			"the OCI hook admitted (podman, CRI-O) cannot be given back; if such containers run on this host, mount the "+
			"runtime roots and bundle directories read-only into the guard, or run `gpu-guard-ctl recover` on the host",
			"runtime_roots", roots)
		return nil, nil
	}
	return res, nil
}

// rebuildScanBudget bounds the read of the runtimes' state an in-place
// rebuild makes before it takes the ledger's lock: no request waits for
// it (GPU containers are refused meanwhile), and lock_timeout, the budget
// of the rebuild's lock waits, is too short for a host with many
// containers.
const rebuildScanBudget = 30 * time.Second

// preReadHooks is the read of hookHoldings for a rebuild in place, made
// before its lock waits, with a budget of its own; nil when the ledger does
// not need recovery now (a recovery found needed later reads within the
// lock budget, and a failure is retried).
func (p *Plugin) preReadHooks(ctx context.Context, g *guard.Guard) (*runtimescan.Result, error) {
	if _, err := g.Ledger().Snapshot(ctx); !errors.Is(err, ledger.ErrNeedsRecovery) {
		return nil, nil
	}
	sctx, cancel := context.WithTimeout(ctx, rebuildScanBudget)
	defer cancel()
	return p.readHooks(sctx, g)
}

// readHookState reads the OCI runtimes' state for hookHoldings (a test
// makes it fail).
var readHookState = runtimescan.ReadBy

// rebuildInPlace is a launched plugin's answer to a ledger that needs
// recovery or was started afresh by another process (an operator's
// `gpu-guard-ctl recover`): it cannot reconnect for a new Synchronize (only a
// containerd restart relaunches it), so it reconciles the ledger with the
// containers it tracks, which are what the runtime listed at the last
// Synchronize plus every admission since, less every container stopped or
// removed since. GPU creations are refused meanwhile (rebuilding). A container
// whose stop or removal comes while the rebuild runs changes tracked, and
// the rebuild runs again, so that no claim of a stopped container is
// adopted back. A failed rebuild (the lock held too long) is retried with
// backoff until it succeeds or the plugin stops.
func (p *Plugin) rebuildInPlace(ctx context.Context, closed <-chan struct{}) {
	p.setRebuilding(true, nil)
	p.ready(false)
	backoff := minBackoff
	for {
		// A resync asked for until now is served by this attempt.
		select {
		case <-p.resync:
		default:
		}
		err := p.rebuildOnce(ctx)
		if errors.Is(err, errDiscovering) {
			// Not a failure: rebuilt once the discovery ends.
			if g := p.Guard(); g != nil {
				if discovering, replaced := g.Discovering(); discovering {
					select {
					case <-ctx.Done():
						return
					case <-closed:
						return
					case <-replaced:
					}
				}
			}
			continue
		}
		if err == nil {
			p.setRebuilding(false, nil)
			// Logged once GPU creations are decided again (tests and
			// operators wait for it): the line of rebuildOnce comes while
			// they are still refused.
			p.log.Info("GPU ledger rebuilt: containers asking for a GPU are decided again")
			p.rebuilt(ctx)
			p.ready(true)
			return
		}
		if !errors.Is(err, errTrackedChanged) {
			p.setRebuilding(true, err)
			p.log.Error("rebuilding the GPU ledger from the containers this plugin tracks failed; containers asking for a GPU stay refused, retrying",
				"retry_in", backoff.String(), "error", err)
			select {
			case <-ctx.Done():
				return
			case <-closed:
				return
			case <-time.After(backoff):
			}
			backoff = min(backoff*2, maxBackoff)
		}
	}
}

var errTrackedChanged = errors.New("a tracked container stopped or was removed during the rebuild")

// errDiscovering postpones a rebuild until the guard's GPU discovery ends.
var errDiscovering = errors.New("the GPU discovery is still running; the ledger is rebuilt once it ends")

// errSyncedDiscovering is why the ledger is rebuilt after a Synchronize
// that came while the GPU discovery ran (see awaitDiscovery).
var errSyncedDiscovering = errors.New("the GPU discovery was still running when the plugin synchronized with the runtime; " +
	"the ledger is reconciled with the runtime's containers once it ends")

func (p *Plugin) rebuildOnce(ctx context.Context) error {
	g := p.Guard()
	if g == nil {
		return errors.New("not configured")
	}
	if discovering, _ := g.Discovering(); discovering {
		// Not over an inventory that knows no GPU (see awaitDiscovery):
		// retried, and resynchronized once the discovery ends.
		return errDiscovering
	}
	hooks, err := p.preReadHooks(ctx, g)
	if err != nil {
		return err
	}
	rctx, cancel := decisionContext(ctx, g.Config().Ledger.LockTimeout.Duration)
	defer cancel()
	p.settleStarts(rctx)
	p.admitting.Lock()
	defer p.admitting.Unlock()
	mark := p.dueMark()
	p.mu.Lock()
	gen := p.trackGen
	live := make([]guard.Request, 0, len(p.tracked))
	for _, t := range p.tracked {
		if !t.stopped {
			live = append(live, t.req)
		}
	}
	p.mu.Unlock()
	res, tracked, err := p.reconcileWith(rctx, g, live, "NRI plugin launched by containerd: rebuilt, then reconciled with the containers it tracks", hooks)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.trackGen != gen {
		return errTrackedChanged
	}
	// Stopped containers kept for their removal (release_on = "remove")
	// stay tracked: their claims went with the reconcile, their events
	// still come.
	for id, t := range p.tracked {
		if _, ok := tracked[id]; !ok && t.stopped {
			tracked[id] = t
		}
	}
	p.tracked = tracked
	p.trackGen++
	p.log.Warn("rebuilt the GPU ledger from the containers this plugin tracks (a launched plugin gets no new Synchronize until containerd restarts)",
		"containers", len(live), "released", len(res.Released), "adopted", len(res.Adopted), "conflicts", len(res.Conflicts))
	// The containers of the due releases were left out of live (marked
	// stopped before their release ran): the reconcile released them.
	p.settleDue(mark)
	return nil
}

// rebuilt finishes a successful in-place rebuild: what a Synchronize does
// after its reconcile and that one left undone.
func (p *Plugin) rebuilt(ctx context.Context) {
	g := p.Guard()
	if g == nil {
		return
	}
	fctx, cancel := decisionContext(ctx, g.Config().Ledger.LockTimeout.Duration)
	defer cancel()
	p.forgetVanishedPods(fctx, g)
}

// Shutdown is called when the runtime shuts down.
func (p *Plugin) Shutdown(context.Context) {
	p.log.Info("runtime is shutting down")
	p.ready(false)
}

// requestMargin is kept between the end of a decision and the runtime's
// request deadline, for the reply to travel back: a reply that misses the
// deadline gets the plugin dropped, and the container created unchecked by
// containerd before 2.2 (2.2–2.4 refuse it: the dropped plugin fails its
// validation).
const requestMargin = 300 * time.Millisecond

// decisionContext bounds a handler's ledger work well inside the request's
// deadline (see decisionDeadline). Every handler runs under it, not only
// CreateContainer: a Stop or Remove that waits for the ledger lock up to a
// long lock_timeout would overrun the deadline just the same.
func decisionContext(ctx context.Context, limit time.Duration) (context.Context, context.CancelFunc) {
	deadline, hasDeadline := ctx.Deadline()
	end, bounded := decisionDeadline(time.Now(), deadline, hasDeadline, limit)
	if !bounded {
		return context.WithCancel(ctx)
	}
	return context.WithDeadline(ctx, end)
}

// decisionDeadline is when a handler's ledger work must end, given the time
// now, the request's deadline (hasDeadline false: none) and a limit (<= 0:
// none): min(deadline - margin, now + limit). The margin is requestMargin, or
// a quarter of what is left for short deadlines so the work is still
// attempted; the result is never earlier than now + 1ms. bounded is false
// when there is neither a deadline nor a limit.
func decisionDeadline(now, deadline time.Time, hasDeadline bool, limit time.Duration) (end time.Time, bounded bool) {
	if !hasDeadline {
		if limit <= 0 {
			return time.Time{}, false
		}
		return now.Add(limit), true
	}
	left := deadline.Sub(now)
	end = deadline.Add(-min(requestMargin, max(left/4, 0)))
	if limit > 0 && now.Add(limit).Before(end) {
		end = now.Add(limit)
	}
	if floor := now.Add(time.Millisecond); end.Before(floor) {
		end = floor
	}
	return end, true
}

// bounded is decisionContext with the guard's lock_timeout as the limit.
// (The ledger itself requires the lineage of the last Synchronize: see
// ledger.Ledger.RequireLineage.)
func (p *Plugin) bounded(ctx context.Context, g *guard.Guard) (context.Context, context.CancelFunc) {
	if p.decisionCtx != nil {
		return p.decisionCtx(ctx, g.Config().Ledger.LockTimeout.Duration)
	}
	return decisionContext(ctx, g.Config().Ledger.LockTimeout.Duration)
}

// boundedDetached is bounded for work that outlives the request: the same
// deadline (the request's less the margin, or lock_timeout), but not
// cancelled with the request, which is answered at once.
func (p *Plugin) boundedDetached(ctx context.Context, g *guard.Guard) (context.Context, context.CancelFunc) {
	bctx, cancel := p.bounded(ctx, g)
	deadline, ok := bctx.Deadline()
	cancel()
	detached := context.WithoutCancel(ctx)
	if !ok {
		return context.WithCancel(detached)
	}
	return context.WithDeadline(detached, deadline)
}

// ValidateContainerAdjustment refuses a container that, as every plugin's
// adjustments leave it, reaches a GPU it holds no claim for. containerd
// (2.2 and later; see EventsFor) asks it once every plugin has answered
// CreateContainer, before it creates the container: a plugin with a higher
// index than the guard's (a device injector reading pod annotations, a
// plugin adding CDI devices or env) can add a GPU the guard's
// CreateContainer never saw. The container as created is resolved as at
// admission (adjusted, guardRequest), the CDI devices of the adjustment as
// names injected after the check, and every device it reaches must be
// claimed by it (guard.Validate); where the container NRI showed the
// plugins differs from it in its env (a duplicated variable the adjustment
// sets), that one is checked too. A refusal fails the create; containerd's
// undo then sends StopContainer and RemoveContainer, which release what
// CreateContainer claimed.
func (p *Plugin) ValidateContainerAdjustment(ctx context.Context, req *api.ValidateContainerAdjustmentRequest) (err error) {
	defer p.handling("ValidateContainerAdjustment", &err)()
	g := p.Guard()
	if g == nil {
		return errors.New("nri-gpu-guard: not configured yet; refused to stay safe, retrying is automatic")
	}
	// Whether its create granted an exemption, asked once (the entry goes
	// now, whatever the answer).
	id := req.GetContainer().GetId()
	p.mu.Lock()
	_, exempted := p.exemptAtCreate[id]
	delete(p.exemptAtCreate, id)
	p.mu.Unlock()
	self := g.Config().NRI.PluginName
	if n, ok := p.registeredName.Load().(string); ok && n != "" {
		self = n
	}
	before, after, found := pluginsAround(req.GetPlugins(), self)
	if !adjustsAccess(req.GetAdjust()) && len(before) == 0 && found {
		// The container is the one admission decided on: no plugin ran
		// before the guard, and nothing that can reach a GPU was changed
		// after it. The common case, at no cost beyond this look. A
		// plugin that ran before changed the request the guard saw in
		// place, and not always as the runtime creates the container:
		// NRI applies an env or device removal to what later plugins
		// see, but leaves it out of the adjustment containerd applies
		// (a removed NVIDIA_VISIBLE_DEVICES stays in the spec), and it
		// shows a value set over a variable the spec holds twice, which
		// containerd does not create (it keeps the last original copy:
		// see adjusted). So the pristine container and the adjustment
		// are resolved then; and so
		// they are when the guard is not in the list under the name it
		// looks for: which plugins ran before it is not known.
		return nil
	}
	pod := req.GetPod()
	final, late, shown := adjusted(req.GetContainer(), req.GetAdjust())
	// Where the container as created and as NRI showed it differ (an env
	// variable the spec holds twice, which the adjustment sets: see
	// adjusted), both are checked, each against the container's claims.
	views := []*api.Container{final}
	if shown != nil {
		views = append(views, shown)
	}
	// NRI has no privileged flag (specOf: a device cgroup allowing
	// everything stands for it). Whether the engine opened the container
	// wholesale is read from the container as the engine made it, once for
	// every view: a plugin's rule does not make it privileged.
	engineOpened := devices.AllowsAllDevices(deviceRules(req.GetContainer().GetLinux().GetResources().GetDevices()))
	dctx, cancel := p.bounded(ctx, g)
	defer cancel()
	exemptNow := false
	for _, view := range views {
		d, err := p.validateView(dctx, g, pod, view, late, engineOpened, guard.ValidateOptions{
			// An exemption is audited once: at admission, or by the
			// first view that is granted it.
			ExemptAtAdmission: exempted || exemptNow,
			After:             culpritText(before, after),
			// While the ledger's holders are being rebuilt, a container
			// that reaches a GPU is refused at once, as at
			// CreateContainer.
			WithoutLedger: p.rebuilding.Load(),
		})
		if err != nil {
			return err
		}
		exemptNow = exemptNow || d.Reason == guard.ReasonExempt
	}
	if exemptNow && p.exempt != nil {
		// Exempt because of what a later plugin added (its create named
		// no GPU): the observer must not take its processes for intruders.
		p.exempt.SetExempt(id, final.GetLinux().GetCgroupsPath(), true)
	}
	return nil
}

// validateView asks the guard about one view of the container as the
// adjustment leaves it, and turns a refusal or a failed decision into the
// error that refuses the create. engineOpened says the engine created the
// container with a device cgroup allowing everything (NRI's privileged).
func (p *Plugin) validateView(ctx context.Context, g *guard.Guard, pod *api.PodSandbox, view *api.Container, late []string,
	engineOpened bool, opts guard.ValidateOptions) (guard.Decision, error) {
	id := view.GetId()
	r := guardRequest(pod, view)
	r.Spec.LateCDIDevices = late
	if !engineOpened {
		// A container the engine did not open wholesale is not made
		// privileged by a plugin's rule: such a rule reaches every GPU,
		// and is resolved as the rule it is.
		r.Spec.Privileged = false
	}
	d, err := g.Validate(ctx, r, opts)
	switch {
	case errors.Is(err, guard.ErrNeedsClaims):
		return d, p.rebuildingError()
	case err != nil:
		p.ledgerTrouble(err)
		return d, fmt.Errorf("nri-gpu-guard: container %s refused: %w", naming.ShortID(id), err)
	case d.Result == guard.Reject:
		return d, fmt.Errorf("nri-gpu-guard: container %s refused: %s", naming.ShortID(id), d.Message)
	}
	return d, nil
}

// pluginsAround names ("10-device-injector") the plugins consulted before
// and after the one named self, by index; found says self is listed. When
// it is not, all of them count as after, and the caller cannot tell that
// none ran before.
func pluginsAround(plugins []*api.PluginInstance, self string) (before, after []string, found bool) {
	selfIdx := ""
	for _, pl := range plugins {
		if pl.GetName() == self {
			selfIdx, found = pl.GetIndex(), true
		}
	}
	for _, pl := range plugins {
		switch name := pl.GetIndex() + "-" + pl.GetName(); {
		case pl.GetName() == self:
		case selfIdx != "" && pl.GetIndex() <= selfIdx:
			before = append(before, name)
		default:
			after = append(after, name)
		}
	}
	return before, after, found
}

// culpritText says which plugins a refusal at validation can come from: the
// ones after the guard, and, when any ran before it, those too (they changed
// the request the guard decided on in ways the runtime may not follow).
func culpritText(before, after []string) string {
	a := "none listed"
	if len(after) > 0 {
		a = strings.Join(after, ", ")
	}
	if len(before) == 0 {
		return "an NRI plugin that runs after nri-gpu-guard (" + a + ")"
	}
	return "an NRI plugin's adjustment (before nri-gpu-guard: " + strings.Join(before, ", ") + "; after it: " + a + ")"
}

// CreateContainer admits the container or refuses it with the guard's
// message, which is the only part of containerd's error written for people.
func (p *Plugin) CreateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) (_ *api.ContainerAdjustment, _ []*api.ContainerUpdate, err error) {
	cr := p.startCreation(ctr.GetId())
	defer p.endCreation(ctr.GetId(), cr)
	defer p.handling("CreateContainer", &err)()
	// One p.mu section: the guard, and the container made known.
	p.mu.Lock()
	g := p.g
	if g != nil {
		p.known[ctr.GetId()] = struct{}{}
	}
	p.mu.Unlock()
	if g == nil {
		return nil, nil, errors.New("nri-gpu-guard: not configured yet; refused to stay safe, retrying is automatic")
	}
	p.pendingMu.Lock()
	if p.pendingPods != nil {
		p.pendingPods[pod.GetUid()] = struct{}{}
	}
	p.pendingMu.Unlock()
	req := guardRequest(pod, ctr)
	// During a rebuild only the requests decided on the ledger's holders
	// are refused: one that names no GPU, or of an exempt namespace, is
	// decided as always (and the exemption audited), so that a node's
	// ordinary containers keep starting while a rebuild waits for a busy
	// ledger lock. The guard tells which in the same resolution it decides
	// on (AdmitWithoutClaims).
	onlyWithoutClaims := p.rebuilding.Load()
	dctx, cancel := p.bounded(ctx, g)
	defer cancel()
	if !onlyWithoutClaims {
		// Waiting for a start record can itself find the ledger started
		// afresh and start a rebuild: the rebuilding check that counts
		// comes after it, under admitting, which the rebuild holds while
		// the fence is lifted.
		p.settleStarts(dctx)
		if p.admitting.TryRLock() {
			defer p.admitting.RUnlock()
			onlyWithoutClaims = p.rebuilding.Load()
		} else {
			onlyWithoutClaims = true
		}
	}
	if !onlyWithoutClaims && p.hasDue() {
		// Before the decision: the GPUs of containers whose release
		// failed are free again for this one, and a container of an id
		// whose release is still due is refused (the retry would end its
		// claims).
		p.retryDue(dctx, g, "CreateContainer")
		if err := p.claimDueFor(dctx, ctr.GetId()); err != nil {
			return nil, nil, err
		}
	}
	admit := g.Admit
	if onlyWithoutClaims {
		admit = g.AdmitWithoutClaims
	}
	d, err := admit(dctx, req)
	if errors.Is(err, guard.ErrNeedsClaims) {
		return nil, nil, p.rebuildingError()
	}
	if err != nil {
		p.ledgerTrouble(err)
		if errors.Is(err, ledger.ErrMaybeCommitted) {
			p.mayHoldClaim(ctx, g, pod, ctr, cr, req)
		}
		return nil, nil, refusal(err)
	}
	if derr := d.Err(); derr != nil {
		return nil, nil, refusal(derr)
	}
	// One p.mu section: whether the runtime undid the create meanwhile,
	// and what the container is tracked as if it did not.
	exempt := d.Reason == guard.ReasonExempt
	p.mu.Lock()
	undone := cr.undone
	if !undone && d.Result == guard.Admit {
		p.tracked[ctr.GetId()] = trackedCtr{sandboxID: ctr.GetPodSandboxId(), req: req}
		p.trackGen++
	}
	if !undone && exempt && p.validates.Load() {
		p.exemptAtCreate[ctr.GetId()] = struct{}{}
	}
	p.mu.Unlock()
	switch {
	case undone && d.Result == guard.Admit:
		return nil, nil, p.undoCreation(ctx, g, pod, ctr)
	case undone:
		// Nothing claimed; nothing of a container that never runs is
		// kept (its removal has already come).
		return nil, nil, nil
	}
	if exempt && p.exempt != nil {
		p.exempt.SetExempt(ctr.GetId(), ctr.GetLinux().GetCgroupsPath(), true)
	}
	return nil, nil, nil
}

// creation is one CreateContainer handler running.
type creation struct {
	// undone: the runtime stopped or removed the container while the
	// handler ran (guarded by Plugin.mu).
	undone bool
}

// startCreation records a create of container id as running. Under the
// failure policy the plugin asks for (KeepConnected), a create that answers
// past the runtime's deadline fails without the plugin being dropped, and the
// runtime's undo (StopContainer, RemoveContainer of the id) can arrive while
// the handler still runs: the id is not tracked yet, so those would end
// nothing, and the claim the handler then commits, of a container that never
// exists (no process: the liveness check keeps it), would never end.
func (p *Plugin) startCreation(id string) *creation {
	cr := &creation{}
	p.mu.Lock()
	p.creating[id] = cr
	p.mu.Unlock()
	return cr
}

func (p *Plugin) endCreation(id string, cr *creation) {
	p.mu.Lock()
	if p.creating[id] == cr {
		delete(p.creating, id)
	}
	p.mu.Unlock()
}

// undoCreations marks the running creates of id as undone (a stop or removal
// of an id not tracked: see startCreation).
func (p *Plugin) undoCreations(id string) {
	p.mu.Lock()
	if cr := p.creating[id]; cr != nil {
		cr.undone = true
	}
	p.mu.Unlock()
}

// undoCreation ends the claim a create committed after the runtime had
// already stopped or removed the container, and refuses the create (the
// runtime gave up on it anyway). A release that fails is due, retried as any
// other.
func (p *Plugin) undoCreation(ctx context.Context, g *guard.Guard, pod *api.PodSandbox, ctr *api.Container) error {
	released := "its claim is released"
	if p.releaseUndone(ctx, g, ownerOf(pod, ctr), "a create the runtime had already undone") {
		p.log.Warn("the runtime stopped or removed the container while its create was decided (the create answered past "+
			"the runtime's deadline): its claim is released", "container_id", ctr.GetId())
	} else {
		released = "the release of its claim is retried in the background"
	}
	return fmt.Errorf("nri-gpu-guard: container %s refused: the runtime stopped or removed it while nri-gpu-guard decided "+
		"its create (the answer came past the runtime's deadline); %s, retrying is automatic", naming.ShortID(ctr.GetId()), released)
}

// releaseUndone releases the claims of o, a container whose create the
// runtime undid (what says which), and reports whether it did: a release
// that fails is due, retried in the background and at the next NRI event.
func (p *Plugin) releaseUndone(ctx context.Context, g *guard.Guard, o ledger.Owner, what string) bool {
	rctx, cancel := p.boundedDetached(ctx, g)
	defer cancel()
	if err := g.Removed(rctx, o); err != nil {
		p.ledgerTrouble(err)
		p.addDue(releaseRemove, o, err)
		p.log.Error("releasing the claim of "+what+" failed; retried in the background and at the next NRI event",
			"container_id", o.ContainerID, "error", err)
		return false
	}
	return true
}

// mayHoldClaim follows a create refused although its claim may stand: the
// admission was written to the ledger, whose sync then failed
// (ledger.ErrMaybeCommitted). Every reader sees that claim, of a container
// that never runs (no process: the liveness check keeps it), and the pod's
// retries would queue behind it until the pod goes. The id is tracked as
// stopped (out of rebuilds: the runtime never lists it), so that the
// runtime's undo of the create (StopContainer, RemoveContainer) releases
// its claims as any holder's: a release of exactly that container id, safe
// to repeat, retried while it fails. An undo that came while the create
// was decided found the id untracked: the claims are released now. Only this
// error tracks a refused create; every other leaves nothing in the ledger,
// and its undo costs nothing.
func (p *Plugin) mayHoldClaim(ctx context.Context, g *guard.Guard, pod *api.PodSandbox, ctr *api.Container, cr *creation, req guard.Request) {
	p.mu.Lock()
	undone := cr.undone
	if !undone {
		p.tracked[ctr.GetId()] = trackedCtr{sandboxID: ctr.GetPodSandboxId(), stopped: true, req: req}
		p.trackGen++
	}
	p.mu.Unlock()
	if !undone {
		p.log.Warn("a create was refused although its claim may be in the ledger (the ledger's disk failed to make the "+
			"decision durable): its claim is released when the runtime undoes the create", "container_id", ctr.GetId())
		return
	}
	if !p.releaseUndone(ctx, g, ownerOf(pod, ctr), "a refused create that may have left one") {
		return
	}
	p.log.Warn("a create was refused although its claim may be in the ledger (the ledger's disk failed to make the "+
		"decision durable), and the runtime had undone it meanwhile: its claim is released", "container_id", ctr.GetId())
}

// errRebuilding refuses a GPU container's create while the ledger is rebuilt.
var errRebuilding = errors.New("nri-gpu-guard: the GPU ledger is being rebuilt from the runtime's containers (it needed " +
	"recovery, was started afresh by another process, or could not be reconciled when the plugin synchronized with the runtime, " +
	"as while the GPU discovery still ran); " +
	"containers asking for a GPU are refused until then to stay safe, retrying is automatic")

// rebuildingError is errRebuilding with the ledger error behind the
// rebuild, when one is known.
func (p *Plugin) rebuildingError() error {
	if cause := p.rebuildingCause(); cause != "" {
		return fmt.Errorf("%w; last ledger error: %s", errRebuilding, cause)
	}
	return errRebuilding
}

// rebuildingCause is the ledger error behind the rebuild ("" = none known).
func (p *Plugin) rebuildingCause() string {
	if cause := p.rebuildCause.Load(); cause != nil {
		return *cause
	}
	return ""
}

// setRebuilding enters (with the ledger error that makes the rebuild
// necessary, or that its last attempt failed with) or leaves (cause nil
// with on false) the rebuilding mode.
func (p *Plugin) setRebuilding(on bool, cause error) {
	if cause != nil {
		why := cause.Error()
		p.rebuildCause.Store(&why)
	} else if !on {
		p.rebuildCause.Store(nil)
	}
	p.rebuilding.Store(on)
	if p.gauges != nil {
		p.gauges.SetRebuilding(on)
	}
}

// refusal flattens an error into the text the runtime shows. It deliberately
// does not wrap: the error travels as a ttrpc status string anyway, and a
// wrapped context error must never be mistaken for the plugin timing out.
func refusal(err error) error {
	return errors.New("nri-gpu-guard: " + err.Error())
}

// StartContainer records the pid and cgroup of a GPU holder.
func (p *Plugin) StartContainer(ctx context.Context, _ *api.PodSandbox, ctr *api.Container) error {
	defer p.handling("StartContainer", nil)()
	p.recordStart(ctx, ctr)
	return nil
}

// PostStartContainer records the pid and cgroup if StartContainer could not
// (the pid is normally known at StartContainer already).
func (p *Plugin) PostStartContainer(ctx context.Context, _ *api.PodSandbox, ctr *api.Container) error {
	defer p.handling("PostStartContainer", nil)()
	p.recordStart(ctx, ctr)
	return nil
}

// recordStart commits a holder's pid and cgroup in the background: the
// container's start does not wait for the durable write (one of the three
// of a GPU container's life), nor does containerd's global NRI lock. Every
// later handler that touches the ledger waits for it first (p.starts), so
// the order of the ledger's records is that of the events. Until it is
// committed the claim has no process, which reads as "created, not started":
// the holder is kept, never released early.
func (p *Plugin) recordStart(ctx context.Context, ctr *api.Container) {
	id := ctr.GetId()
	pid := int(ctr.GetPid())
	cgroup := ctr.GetLinux().GetCgroupsPath()
	p.mu.Lock()
	t, ok := p.tracked[id]
	g := p.g
	if !ok || t.started || t.starting || g == nil || pid <= 0 {
		p.mu.Unlock()
		return
	}
	t.starting = true
	p.tracked[id] = t
	p.starts.add()
	p.mu.Unlock()
	bctx, cancel := p.boundedDetached(ctx, g)
	go func() {
		defer p.starts.done()
		defer cancel()
		err := g.Started(bctx, id, pid, cgroup)
		p.mu.Lock()
		if t, ok := p.tracked[id]; ok {
			t.starting, t.started = false, err == nil
			// What a Synchronize would show, whether or not the record
			// was committed.
			t.req.Owner.Pid, t.req.Owner.Cgroup = pid, cgroup
			p.tracked[id] = t
			p.trackGen++
		}
		p.mu.Unlock()
		if err != nil {
			p.ledgerTrouble(err)
			// Not fatal: without a pid the holder is kept until its stop event.
			p.log.Warn("recording container start failed", "container_id", id, "pid", pid, "cgroup", cgroup, "error", err)
		}
	}()
}

// settleStarts waits, within ctx, for the start records still being
// committed (see recordStart).
func (p *Plugin) settleStarts(ctx context.Context) {
	if err := p.starts.wait(ctx); err != nil {
		p.log.Warn("a container's start record was still being committed when the next event had to be handled", "error", err)
	}
}

// StopContainer releases (release_on = "stop") or marks stopped ("remove")
// the container's claims. A container that holds none — including a refused
// create, which containerd stops and removes right away — costs nothing; a
// refused create whose claim may stand (mayHoldClaim) is tracked, and
// released as a holder is.
func (p *Plugin) StopContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) ([]*api.ContainerUpdate, error) {
	defer p.handling("StopContainer", nil)()
	g, ok := p.trackedGuard(ctr.GetId())
	if !ok {
		p.undoCreations(ctr.GetId())
		return nil, nil
	}
	ctx, cancel := p.bounded(ctx, g)
	defer cancel()
	p.settleStarts(ctx)
	p.retryDue(ctx, g, "StopContainer")
	// Out of rebuilds before its claims go: a rebuild that listed it before
	// then sees tracked change and runs again, instead of adopting back the
	// claim this release ends.
	p.markStopped(ctr.GetId())
	o := ownerOf(pod, ctr)
	err := g.Stopped(ctx, o)
	if err == nil && !g.ClaimOutlivesStop() {
		p.untrack(ctr.GetId())
	} // else kept (stopped) for its removal
	if err != nil {
		p.ledgerTrouble(err)
		p.addDue(releaseStop, o, err)
		p.log.Error("releasing a stopped container failed; retried in the background and at the next NRI event until it succeeds "+
			"(its GPU stays held until then)", "container_id", ctr.GetId(), "error", err)
		return nil, nil
	}
	p.clearDue(releaseStop, o)
	return nil, nil
}

// RemoveContainer releases the container's claims.
func (p *Plugin) RemoveContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) error {
	defer p.handling("RemoveContainer", nil)()
	if p.exempt != nil {
		p.exempt.SetExempt(ctr.GetId(), "", false)
	}
	p.mu.Lock()
	delete(p.known, ctr.GetId())
	delete(p.exemptAtCreate, ctr.GetId()) // a create whose validation never came
	p.mu.Unlock()
	g, ok := p.trackedGuard(ctr.GetId())
	if !ok {
		p.undoCreations(ctr.GetId())
		return nil
	}
	ctx, cancel := p.bounded(ctx, g)
	defer cancel()
	p.settleStarts(ctx)
	p.retryDue(ctx, g, "RemoveContainer")
	p.markStopped(ctr.GetId()) // out of rebuilds first, as in StopContainer
	o := ownerOf(pod, ctr)
	if err := g.Removed(ctx, o); err != nil {
		p.ledgerTrouble(err)
		// Replaces a due release of its stop: the removal ends it all.
		p.addDue(releaseRemove, o, err)
		p.log.Error("releasing a removed container failed; retried in the background and at the next NRI event until it succeeds "+
			"(its GPU stays held until then)", "container_id", ctr.GetId(), "error", err)
		return nil
	}
	p.clearDue(releaseRemove, o)
	p.untrack(ctr.GetId())
	return nil
}

// StopPodSandbox releases every claim of the pod and drops its waiters.
func (p *Plugin) StopPodSandbox(ctx context.Context, pod *api.PodSandbox) error {
	defer p.handling("StopPodSandbox", nil)()
	p.podGone(ctx, pod, "stopped")
	return nil
}

// RemovePodSandbox releases every claim of the pod and drops its waiters.
func (p *Plugin) RemovePodSandbox(ctx context.Context, pod *api.PodSandbox) error {
	defer p.handling("RemovePodSandbox", nil)()
	p.podGone(ctx, pod, "removed")
	return nil
}

func (p *Plugin) podGone(ctx context.Context, pod *api.PodSandbox, what string) {
	g := p.Guard()
	if g == nil {
		return
	}
	ctx, cancel := p.bounded(ctx, g)
	defer cancel()
	p.settleStarts(ctx)
	p.retryDue(ctx, g, "pod "+what)
	// Out of rebuilds before the release, as in StopContainer; the set
	// changes (and a rebuild runs again) only if the pod had tracked
	// containers, so that pod churn without GPUs never holds a rebuild up.
	p.mu.Lock()
	changed := false
	for id, t := range p.tracked {
		if t.sandboxID == pod.GetId() && !t.stopped {
			t.stopped = true
			p.tracked[id] = t
			changed = true
		}
	}
	if changed {
		p.trackGen++
	}
	p.mu.Unlock()
	o := ledger.Owner{PodUID: pod.GetUid(), PodSandboxID: pod.GetId(), Namespace: pod.GetNamespace(), Pod: pod.GetName(),
		FrontEnd: ledger.FrontEndNRI}
	if err := g.PodGone(ctx, ledger.FrontEndNRI, pod.GetUid(), pod.GetId()); err != nil {
		p.ledgerTrouble(err)
		p.addDue(releasePod, o, err)
		p.log.Error("releasing a "+what+" pod failed; retried in the background and at the next NRI event until it succeeds "+
			"(its GPUs stay held until then)", "pod_uid", pod.GetUid(),
			"pod_sandbox_id", pod.GetId(), "namespace", pod.GetNamespace(), "pod", pod.GetName(), "error", err)
		return
	}
	p.clearDue(releasePod, o)
	p.untrackPod(pod.GetId())
}

// untrackPod stops tracking the containers of a sandbox whose claims went.
func (p *Plugin) untrackPod(sandboxID string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	changed := false
	for id, t := range p.tracked {
		if t.sandboxID == sandboxID {
			delete(p.tracked, id)
			changed = true
		}
	}
	if changed {
		p.trackGen++
	}
}

// ledgerTrouble asks for a rebuild (see resync) when err says the ledger
// needs recovery (damaged, missing or replaced) or was started afresh by
// another process since the last Synchronize (another lineage: that process
// reset it, or recovered it without every commit). Either way the ledger has
// forgotten the runtime's running GPU holders and must learn them again. The
// plugin refuses creations from this moment on, not only once Run has seen
// the request: the very next create would otherwise be decided against a
// ledger without them.
func (p *Plugin) ledgerTrouble(err error) {
	if !errors.Is(err, ledger.ErrNeedsRecovery) && !errors.Is(err, ledger.ErrLineageChanged) {
		return
	}
	p.setRebuilding(true, err)
	select {
	case p.resync <- struct{}{}:
	default: // one is pending already
	}
}

func (p *Plugin) trackedGuard(id string) (*guard.Guard, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.tracked[id]
	return p.g, ok && p.g != nil
}

func (p *Plugin) untrack(id string) {
	p.mu.Lock()
	delete(p.tracked, id)
	p.trackGen++
	p.mu.Unlock()
}

// markStopped keeps a container tracked but out of rebuilds: the runtime
// no longer lists it.
func (p *Plugin) markStopped(id string) {
	p.mu.Lock()
	if t, ok := p.tracked[id]; ok {
		t.stopped = true
		p.tracked[id] = t
		p.trackGen++
	}
	p.mu.Unlock()
}
