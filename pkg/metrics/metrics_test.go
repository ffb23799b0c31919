// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package metrics

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/guard"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/observe"
)

// families gathers the registry into name → family.
func families(t *testing.T, m *Metrics) map[string]*dto.MetricFamily {
	t.Helper()
	mfs, err := m.Registry().Gather()
	require.NoError(t, err)
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

func labels(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

func TestDecided(t *testing.T) {
	m := New()
	m.Decided(guard.Decision{Result: guard.Admit, Reason: "free"}, 2*time.Millisecond)
	m.Decided(guard.Decision{Result: guard.Admit, Reason: "free", Waited: 90 * time.Second}, time.Millisecond)
	m.Decided(guard.Decision{Result: guard.Queue, Reason: "busy"}, time.Millisecond)

	fams := families(t, m)
	dec := fams["nri_gpu_guard_decisions_total"]
	require.NotNil(t, dec)
	got := map[string]float64{}
	for _, mt := range dec.GetMetric() {
		l := labels(mt)
		got[l["result"]+"/"+l["reason"]] = mt.GetCounter().GetValue()
	}
	assert.Equal(t, map[string]float64{"admit/free": 2, "queue/busy": 1}, got)

	lat := fams["nri_gpu_guard_decision_duration_seconds"].GetMetric()[0].GetHistogram()
	assert.Equal(t, uint64(3), lat.GetSampleCount())
	assert.InDelta(t, 0.004, lat.GetSampleSum(), 1e-9)

	// Only the admission that had waited records a wait.
	wait := fams["nri_gpu_guard_wait_seconds"].GetMetric()[0].GetHistogram()
	assert.Equal(t, uint64(1), wait.GetSampleCount())
	assert.InDelta(t, 90, wait.GetSampleSum(), 1e-9)
}

func claim(uuid, index, ns, pod, ctr string) ledger.Claim {
	return ledger.Claim{
		Device: devices.Device{UUID: uuid, Index: index, Kind: devices.KindGPU},
		Owner:  ledger.Owner{ContainerID: ctr + "-id", Namespace: ns, Pod: pod, Container: ctr},
	}
}

func TestStateChanged(t *testing.T) {
	m := New()
	m.StateChanged(ledger.State{
		Generation: 5,
		Claims: []ledger.Claim{
			claim("GPU-a", "0", "ml", "train-0", "main"),
			claim("GPU-b", "1", "ml", "train-1", "main"),
		},
		Waiters:      []ledger.Waiter{{Key: "k1"}, {Key: "k2"}, {Key: "k3"}},
		Reservations: []ledger.Reservation{{For: "k1"}},
		Conflicts:    []ledger.Conflict{{}},
	})
	fams := families(t, m)
	holders := fams["nri_gpu_guard_device_holder"].GetMetric()
	require.Len(t, holders, 2)
	assert.Equal(t, map[string]string{"device_uuid": "GPU-a", "device_index": "0", "namespace": "ml", "pod": "train-0", "container": "main"},
		labels(holders[0]))
	assert.Equal(t, 3.0, fams["nri_gpu_guard_queue_depth"].GetMetric()[0].GetGauge().GetValue())
	assert.Equal(t, 1.0, fams["nri_gpu_guard_reservations"].GetMetric()[0].GetGauge().GetValue())
	assert.Equal(t, 1.0, fams["nri_gpu_guard_conflicts"].GetMetric()[0].GetGauge().GetValue())

	// A released claim disappears from the holder gauge.
	m.StateChanged(ledger.State{Generation: 6, Claims: []ledger.Claim{claim("GPU-b", "1", "ml", "train-1", "main")}})
	fams = families(t, m)
	holders = fams["nri_gpu_guard_device_holder"].GetMetric()
	require.Len(t, holders, 1)
	assert.Equal(t, "GPU-b", labels(holders[0])["device_uuid"])
	assert.Equal(t, 0.0, fams["nri_gpu_guard_queue_depth"].GetMetric()[0].GetGauge().GetValue())

	// An older state arriving late (observers run outside the ledger lock)
	// does not overwrite a newer one.
	m.StateChanged(ledger.State{Generation: 5, Claims: []ledger.Claim{claim("GPU-a", "0", "x", "y", "z")}})
	holders = families(t, m)["nri_gpu_guard_device_holder"].GetMetric()
	require.Len(t, holders, 1)
	assert.Equal(t, "GPU-b", labels(holders[0])["device_uuid"])
}

// A ledger found corrupt is moved aside and restarts from generation 0: its
// later states must replace the gauges, or they would show the lost
// ledger's holders until the new generation caught up.
func TestStateChangedAfterLedgerRestart(t *testing.T) {
	t0 := time.Date(2026, 5, 9, 8, 0, 0, 0, time.UTC)
	m := New()
	m.StateChanged(ledger.State{Generation: 500, UpdatedAt: t0,
		Claims: []ledger.Claim{claim("GPU-a", "0", "ml", "old", "main")}})
	// Written before the last one shown: a late arrival, ignored.
	m.StateChanged(ledger.State{Generation: 499, UpdatedAt: t0.Add(-time.Second)})
	require.Len(t, families(t, m)["nri_gpu_guard_device_holder"].GetMetric(), 1)

	// The rebuilt ledger's first state.
	m.StateChanged(ledger.State{Generation: 1, UpdatedAt: t0.Add(time.Minute),
		Claims: []ledger.Claim{claim("GPU-b", "1", "ml", "new", "main")}})
	holders := families(t, m)["nri_gpu_guard_device_holder"].GetMetric()
	require.Len(t, holders, 1)
	assert.Equal(t, "GPU-b", labels(holders[0])["device_uuid"])
	// And it orders its own states again.
	m.StateChanged(ledger.State{Generation: 2, UpdatedAt: t0.Add(2 * time.Minute)})
	assert.Empty(t, families(t, m)["nri_gpu_guard_device_holder"].GetMetric())
}

// With a state source, every scrape shows the ledger as it is then, with
// what other processes changed (gpu-guard-ctl, OCI hooks, expired
// waiters); a scrape that cannot read it counts the failure and keeps the
// last values.
func TestScrapeReadsTheLedger(t *testing.T) {
	m := New()
	h := m.Handler()
	var (
		st   ledger.State
		fail error
	)
	m.SetStateSource(func(ctx context.Context) (ledger.State, error) {
		require.NoError(t, ctx.Err())
		return st, fail
	})
	st = ledger.State{Generation: 3, Claims: []ledger.Claim{claim("GPU-a", "0", "ml", "train-0", "main")},
		Waiters: []ledger.Waiter{{Key: "k1"}}}
	_, body := get(t, h, "/metrics")
	assert.Contains(t, body, `nri_gpu_guard_device_holder{container="main",device_index="0",device_uuid="GPU-a",namespace="ml",pod="train-0"} 1`)
	assert.Contains(t, body, "nri_gpu_guard_queue_depth 1")

	// Another process released the claim and the waiter's TTL ran out.
	st = ledger.State{Generation: 4}
	_, body = get(t, h, "/metrics")
	assert.NotContains(t, body, "nri_gpu_guard_device_holder{")
	assert.Contains(t, body, "nri_gpu_guard_queue_depth 0")
	assert.Contains(t, body, "nri_gpu_guard_ledger_read_errors_total 0")

	fail = errors.New("ledger damaged")
	st = ledger.State{Generation: 5, Claims: []ledger.Claim{claim("GPU-b", "1", "ml", "x", "y")}}
	_, body = get(t, h, "/metrics")
	assert.Contains(t, body, "nri_gpu_guard_ledger_read_errors_total 1")
	assert.NotContains(t, body, "GPU-b", "a failed read changes no gauge")
}

func TestReleased(t *testing.T) {
	m := New()
	m.Released(guard.ReasonStale, []ledger.Claim{{}, {}})
	m.Released(guard.ReasonHolderExited, []ledger.Claim{{}})
	m.Released(guard.ReasonHolderExited, nil)
	got := map[string]float64{}
	for _, mt := range families(t, m)["nri_gpu_guard_reconcile_releases_total"].GetMetric() {
		got[labels(mt)["reason"]] = mt.GetCounter().GetValue()
	}
	assert.Equal(t, map[string]float64{"stale": 2, "holder exited": 1}, got)
}

func get(t *testing.T, h http.Handler, path string) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec.Code, rec.Body.String()
}

func TestHandler(t *testing.T) {
	m := New()
	h := m.Handler()

	code, _ := get(t, h, "/healthz")
	assert.Equal(t, http.StatusOK, code)

	code, body := get(t, h, "/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)
	assert.Contains(t, body, "not registered")

	m.SetReady(true)
	code, _ = get(t, h, "/readyz")
	assert.Equal(t, http.StatusOK, code)
	m.SetReady(false)
	code, _ = get(t, h, "/readyz")
	assert.Equal(t, http.StatusServiceUnavailable, code)

	m.Decided(guard.Decision{Result: guard.Reject, Reason: "unknown-device"}, time.Millisecond)
	code, body = get(t, h, "/metrics")
	assert.Equal(t, http.StatusOK, code)
	assert.Contains(t, body, `nri_gpu_guard_decisions_total{reason="unknown-device",result="reject"} 1`)
	assert.Contains(t, body, "go_goroutines")
}

func TestRebuildingGauge(t *testing.T) {
	m := New()
	h := m.Handler()
	_, body := get(t, h, "/metrics")
	assert.Contains(t, body, "nri_gpu_guard_ledger_rebuilding 0")
	m.SetRebuilding(true)
	_, body = get(t, h, "/metrics")
	assert.Contains(t, body, "nri_gpu_guard_ledger_rebuilding 1")
	m.SetRebuilding(false)
	_, body = get(t, h, "/metrics")
	assert.Contains(t, body, "nri_gpu_guard_ledger_rebuilding 0")
}

func TestReleasesDueGauge(t *testing.T) {
	m := New()
	h := m.Handler()
	_, body := get(t, h, "/metrics")
	assert.Contains(t, body, "nri_gpu_guard_releases_due 0")
	m.SetReleasesDue(3)
	_, body = get(t, h, "/metrics")
	assert.Contains(t, body, "nri_gpu_guard_releases_due 3")
}

func TestServeShutsDownOnCancel(t *testing.T) {
	m := New()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- m.serve(ctx, ln, nil) }()

	resp, err := http.Get("http://" + ln.Addr().String() + "/healthz")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	assert.Equal(t, "ok", strings.TrimSpace(string(body)))

	cancel()
	require.NoError(t, <-errc)
}

func TestServeBadAddress(t *testing.T) {
	err := New().Serve(context.Background(), "256.0.0.1:99999", nil)
	require.ErrorContains(t, err, "[metrics] listen")
}

func TestObserverMetrics(t *testing.T) {
	m := New()
	d0 := observe.Device{Index: "0", UUID: "GPU-0"}
	d1 := observe.Device{Index: "1:2", UUID: "MIG-1"}
	at := time.Unix(1700000000, 0)
	m.ObserverReport(observe.Report{Time: at, Findings: []observe.Finding{
		{Kind: observe.KindIntruder, Device: d0, PID: 1},
		{Kind: observe.KindOutOfBounds, Device: d0, PID: 2},
		{Kind: observe.KindIntruder, Device: d1, PID: 3},
		{Kind: observe.KindGone, Device: d1, PID: 4},
		{Kind: observe.KindUnhealthy, Device: d1},
	}})
	gauge := func(name string) map[string]float64 {
		out := map[string]float64{}
		if f := families(t, m)[name]; f != nil {
			for _, mt := range f.GetMetric() {
				l := labels(mt)
				out[l["device_index"]+"/"+l["device_uuid"]] = mt.GetGauge().GetValue()
			}
		}
		return out
	}
	assert.Equal(t, map[string]float64{"0/GPU-0": 2, "1:2/MIG-1": 1}, gauge("nri_gpu_guard_intruders"),
		"intruders and out-of-bounds count; gone and unhealthy do not")
	assert.InDelta(t, 1700000000, families(t, m)["nri_gpu_guard_observer_last_pass_timestamp_seconds"].GetMetric()[0].GetGauge().GetValue(), 0.001)

	// A clean pass clears the series.
	m.ObserverReport(observe.Report{Time: at.Add(10 * time.Second)})
	assert.Empty(t, gauge("nri_gpu_guard_intruders"))

	m.UnhealthyDevices([]observe.Finding{{Kind: observe.KindUnhealthy, Device: d0, Xid: 79}})
	assert.Equal(t, map[string]float64{"0/GPU-0": 1}, gauge("nri_gpu_guard_unhealthy"))
	// The device uncordoned and forgotten: its series goes.
	m.UnhealthyDevices(nil)
	assert.Empty(t, gauge("nri_gpu_guard_unhealthy"))
}

// TestScrapeNeverSeesAStandingSeriesMissing: the gauges rebuilt from a whole
// set (holders, intruders, unhealthy devices) are scraped while they are
// rebuilt with the same content; a series that stands before and after must
// be in every scrape (a Reset then refill let a scrape read a held GPU as
// free, or an intruder as gone, for an instant).
func TestScrapeNeverSeesAStandingSeriesMissing(t *testing.T) {
	m := New()
	d0, d1 := observe.Device{Index: "0", UUID: "GPU-0"}, observe.Device{Index: "1", UUID: "GPU-1"}
	report := observe.Report{Time: time.Unix(1700000000, 0), Findings: []observe.Finding{
		{Kind: observe.KindIntruder, Device: d0, PID: 1}, {Kind: observe.KindIntruder, Device: d1, PID: 2}}}
	unhealthy := []observe.Finding{{Kind: observe.KindUnhealthy, Device: d0}, {Kind: observe.KindUnhealthy, Device: d1}}
	st := ledger.State{Generation: 1, Claims: []ledger.Claim{
		{Device: devices.Device{UUID: "GPU-0", Index: "0"}, Owner: ledger.Owner{ContainerID: "a", Namespace: "ml", Pod: "p", Container: "c"}},
		{Device: devices.Device{UUID: "GPU-1", Index: "1"}, Owner: ledger.Owner{ContainerID: "b", Namespace: "ml", Pod: "q", Container: "c"}}}}
	m.ObserverReport(report)
	m.UnhealthyDevices(unhealthy)
	m.StateChanged(st)

	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			m.ObserverReport(report)
			m.UnhealthyDevices(unhealthy)
			st.Generation++
			m.StateChanged(st)
		}
	}()
	defer func() { close(stop); <-done }()
	for i := range 300 {
		fams := families(t, m)
		for _, name := range []string{"nri_gpu_guard_intruders", "nri_gpu_guard_unhealthy", "nri_gpu_guard_device_holder"} {
			f := fams[name]
			require.NotNil(t, f, "scrape %d: no %s series", i, name)
			require.Len(t, f.GetMetric(), 2, "scrape %d: %s lost a standing series", i, name)
		}
	}
}
