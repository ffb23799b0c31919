// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

const namespace = "nri_gpu_guard"

// Metrics holds the daemon's metrics and readiness. It implements
// guard.Observer. The zero value is not usable; call New.
type Metrics struct {
	reg *prometheus.Registry

	holder     seriesSet
	decisions  *prometheus.CounterVec
	latency    prometheus.Histogram
	wait       prometheus.Histogram
	queueDepth prometheus.Gauge
	reserved   prometheus.Gauge
	conflicts  prometheus.Gauge
	releases   *prometheus.CounterVec

	// Observer: findings of the last pass and unhealthy devices.
	intruders  seriesSet
	unhealthy  seriesSet
	lastReport prometheus.Gauge
	observeMu  sync.Mutex

	// stateMu orders StateChanged calls: the holder gauge is reset and
	// refilled, which must not interleave with another refill.
	stateMu sync.Mutex
	// lastGen and lastAt skip states older than one already shown
	// (observers are called outside the ledger lock, so two goroutines may
	// race).
	lastGen uint64
	lastAt  time.Time

	// state, when set, reads the ledger at every scrape (SetStateSource);
	// stateFails counts the scrapes it could not.
	state      atomic.Pointer[StateSource]
	stateFails prometheus.Counter

	// rebuilding: the NRI plugin refuses GPU containers until it rebuilt
	// the ledger from the runtime's containers.
	rebuilding prometheus.Gauge
	// releasesDue: failed releases the NRI plugin retries.
	releasesDue prometheus.Gauge

	ready atomic.Bool
}

// StateSource reads the ledger's last committed state (the current guard's
// Ledger().Snapshot).
type StateSource func(ctx context.Context) (ledger.State, error)

var _ guard.Observer = (*Metrics)(nil)

// New returns Metrics registered in a fresh registry together with the Go
// runtime and process collectors.
func New() *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		holder: newSeriesSet(prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "device_holder",
			Help: "1 for each device claim: which container holds which GPU or MIG device.",
		}, []string{"device_uuid", "device_index", "namespace", "pod", "container"})),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "decisions_total",
			Help: "Admission decisions by result (admit, queue, reject, skip) and reason.",
		}, []string{"result", "reason"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: namespace, Name: "decision_duration_seconds",
			Help: "Time to decide one admission, ledger lock wait included.",
			// From sub-millisecond (the normal case) up to the NRI request
			// timeout of 2s, past which the runtime drops the plugin.
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2},
		}),
		wait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: namespace, Name: "wait_seconds",
			Help:    "How long an admitted request had waited in the queue.",
			Buckets: []float64{1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600},
		}),
		queueDepth: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "queue_depth",
			Help: "Requests waiting for a busy device.",
		}),
		reserved: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "reservations",
			Help: "Released devices held for the head of their queue.",
		}),
		conflicts: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "conflicts",
			Help: "Containers found using a device another container holds (see gpu-guard-ctl status).",
		}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "reconcile_releases_total",
			Help: "Claims released without a stop event: stale at reconcile, or holder exited.",
		}, []string{"reason"}),
		intruders: newSeriesSet(prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "intruders",
			Help: "Processes the last observer pass found on a device the ledger does not give their container (intruder or out of bounds), per device.",
		}, []string{"device_uuid", "device_index"})),
		unhealthy: newSeriesSet(prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "unhealthy",
			Help: "1 for each device the observer found unhealthy (critical Xid, lost, needs a reset) and holds cordoned, until the operator uncordons it; kept across restarts of the observer and of the daemon, as the ledger keeps the cordon (gpu-guard-ctl status).",
		}, []string{"device_uuid", "device_index"})),
		stateFails: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "ledger_read_errors_total",
			Help: "Scrapes that could not read the ledger (damaged, missing, unsafe dir): the state gauges keep their last values, and the guard refuses GPU containers until it is recovered.",
		}),
		rebuilding: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "ledger_rebuilding",
			Help: "1 while the NRI plugin rebuilds the ledger from the runtime's containers (it needed recovery, was started afresh, or a Synchronize could not reconcile it): containers asking for a GPU are refused until then; the daemon's log names the ledger error.",
		}),
		releasesDue: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "releases_due",
			Help: "Releases of stopped or removed containers (or pods) whose ledger update failed and that the NRI plugin retries until they succeed: their GPUs stay held until then; the daemon's log names the ledger error.",
		}),
		lastReport: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "observer_last_pass_timestamp_seconds",
			Help: "When the last observer accounting pass completed (Unix time); alert when it falls behind.",
		}),
	}
	m.reg.MustRegister(m.holder.vec, m.decisions, m.latency, m.wait, m.queueDepth, m.reserved, m.conflicts, m.releases,
		m.intruders.vec, m.unhealthy.vec, m.lastReport, m.stateFails, m.rebuilding, m.releasesDue,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry returns the registry the metrics live in.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Decided counts a decision and its latency; an admission that had been
// queued also records its wait.
func (m *Metrics) Decided(d guard.Decision, latency time.Duration) {
	m.decisions.WithLabelValues(string(d.Result), d.Reason).Inc()
	m.latency.Observe(latency.Seconds())
	if d.Result == guard.Admit && d.Waited > 0 {
		m.wait.Observe(d.Waited.Seconds())
	}
}

// Released counts claims released without a stop event.
func (m *Metrics) Released(reason string, claims []ledger.Claim) {
	if len(claims) > 0 {
		m.releases.WithLabelValues(reason).Add(float64(len(claims)))
	}
}

// StateChanged rebuilds the state gauges from a ledger state. A state
// older than one already shown (lower generation, not written later) is
// ignored. The generation alone would not do: a ledger that was found
// corrupt restarts from generation 0, and its states, written later, must
// replace what the gauges showed.
func (m *Metrics) StateChanged(st ledger.State) {
	m.stateMu.Lock()
	defer m.stateMu.Unlock()
	if st.Generation < m.lastGen && !st.UpdatedAt.After(m.lastAt) {
		return
	}
	m.lastGen, m.lastAt = st.Generation, st.UpdatedAt
	held := make([]series, 0, len(st.Claims))
	for _, c := range st.Claims {
		held = append(held, series{labels: []string{c.Device.UUID, c.Device.Index, c.Owner.Namespace, c.Owner.Pod, c.Owner.Container}, value: 1})
	}
	m.holder.replace(held)
	m.queueDepth.Set(float64(len(st.Waiters)))
	m.reserved.Set(float64(len(st.Reservations)))
	m.conflicts.Set(float64(len(st.Conflicts)))
}

// ObserverReport rebuilds the intruder gauge from an accounting pass: one
// series per device with at least one intruder or out-of-bounds process, so
// that a cleared device's series disappears.
func (m *Metrics) ObserverReport(r observe.Report) {
	m.observeMu.Lock()
	defer m.observeMu.Unlock()
	var found []series
	at := map[[2]string]int{} // index in found, by device
	for _, f := range r.Findings {
		if f.Kind != observe.KindIntruder && f.Kind != observe.KindOutOfBounds {
			continue
		}
		k := [2]string{f.Device.UUID, f.Device.Index}
		if i, ok := at[k]; ok {
			found[i].value++
			continue
		}
		at[k] = len(found)
		found = append(found, series{labels: k[:], value: 1})
	}
	m.intruders.replace(found)
	m.lastReport.Set(float64(r.Time.UnixNano()) / 1e9)
}

// UnhealthyDevices rebuilds the unhealthy gauge from the devices the
// observer holds unhealthy now: one series per device, so that a device the
// operator uncordoned (which the observer then forgets), or one no longer
// observed after a restart of the observer, loses its series instead of
// reading as unhealthy until the daemon restarts.
func (m *Metrics) UnhealthyDevices(fs []observe.Finding) {
	m.observeMu.Lock()
	defer m.observeMu.Unlock()
	bad := make([]series, 0, len(fs))
	for _, f := range fs {
		bad = append(bad, series{labels: []string{f.Device.UUID, f.Device.Index}, value: 1})
	}
	m.unhealthy.replace(bad)
}

// SetRebuilding records whether the NRI plugin is rebuilding the ledger
// (nriplugin.Gauges).
func (m *Metrics) SetRebuilding(on bool) {
	v := 0.0
	if on {
		v = 1
	}
	m.rebuilding.Set(v)
}

// SetReleasesDue records how many failed releases the NRI plugin retries
// (nriplugin.Gauges).
func (m *Metrics) SetReleasesDue(n int) { m.releasesDue.Set(float64(n)) }

// SetReady records whether the plugin is registered with the runtime.
func (m *Metrics) SetReady(ready bool) { m.ready.Store(ready) }

// Ready reports what SetReady last recorded.
func (m *Metrics) Ready() bool { return m.ready.Load() }

// SetStateSource makes every scrape of /metrics first read the ledger and
// rebuild the state gauges from it (StateChanged). The daemon's own commits
// update them as they happen; this is what shows the others: gpu-guard-ctl
// (release, gc, cordon, recover), the OCI hooks, waiters whose queue_ttl
// ran out. A read is lock-free; only a ledger that reads as needing recovery
// makes it wait, briefly, for the lock to confirm that (ledger.Snapshot).
func (m *Metrics) SetStateSource(src StateSource) { m.state.Store(&src) }

// stateReadTimeout bounds the ledger read of one scrape.
const stateReadTimeout = 2 * time.Second

func (m *Metrics) refreshState(ctx context.Context) {
	src := m.state.Load()
	if src == nil || *src == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, stateReadTimeout)
	defer cancel()
	st, err := (*src)(ctx)
	if err != nil {
		m.stateFails.Inc()
		return
	}
	m.StateChanged(st)
}

// Handler serves /metrics, /healthz and /readyz.
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	scrape := promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		m.refreshState(r.Context())
		scrape.ServeHTTP(w, r)
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if !m.ready.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintln(w, "not registered with the container runtime (NRI)")
			return
		}
		_, _ = fmt.Fprintln(w, "ok")
	})
	return mux
}

// Serve listens on addr and serves Handler until ctx is done, then shuts the
// server down gracefully. It returns nil after a shutdown caused by ctx.
func (m *Metrics) Serve(ctx context.Context, addr string, logger *slog.Logger) error {
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics endpoint: listen on %s (check [metrics] listen): %w", addr, err)
	}
	return m.serve(ctx, ln, logger)
}

func (m *Metrics) serve(ctx context.Context, ln net.Listener, logger *slog.Logger) error {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	srv := &http.Server{
		Handler:           m.Handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		ErrorLog:          slog.NewLogLogger(logger.Handler(), slog.LevelWarn),
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx)
	}()
	logger.Info("metrics endpoint listening", "addr", ln.Addr().String())
	err := srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		<-done
		return nil
	}
	return fmt.Errorf("metrics endpoint: %w", err)
}
