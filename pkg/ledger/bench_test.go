package ledger

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/gofrs/flock"
)

// BenchmarkClaimRelease measures one claim and one release (two commits) on
// a busy ledger — 16 GPUs, 8 of them held, 500 waiters queued for those — and,
// in the same run and interleaved with it, the bare floor of two commits of
// the same bytes: flock + write temp + fsync + rename + fsync dir. It reports
// the p50/p99 of both and the ratio of the p50s (the ledger's own overhead).
//
//	go test -tags nri_no_wasm -run '^$' -bench ClaimRelease -benchtime 400x ./pkg/ledger/
func BenchmarkClaimRelease(b *testing.B) {
	ctx := context.Background()
	l, err := Open(b.TempDir(), Options{BootID: testBoot, LockTimeout: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	err = l.Update(ctx, func(tx *Tx) error {
		for g := 0; g < 8; g++ {
			if _, err := tx.Claim("", owner(fmt.Sprintf("holder-%d", g)), devs(gpu(g)), "env"); err != nil {
				return err
			}
		}
		for w := 0; w < 500; w++ {
			o := owner(fmt.Sprintf("waiter-%d", w))
			tx.Enqueue(fmt.Sprintf("ns/%s/ctr", o.PodUID), o, devs(gpu(w%8)))
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	payload, err := os.ReadFile(l.StatePath())
	if err != nil {
		b.Fatal(err)
	}
	bareDir := b.TempDir()
	bareLock := flock.New(filepath.Join(bareDir, "bare.lock"))
	bare := func() {
		if err := bareLock.Lock(); err != nil {
			b.Fatal(err)
		}
		if err := writeAtomic(bareDir, filepath.Join(bareDir, "bare.json"), payload); err != nil {
			b.Fatal(err)
		}
		if err := bareLock.Unlock(); err != nil {
			b.Fatal(err)
		}
	}
	bench := owner("bench")

	ours := make([]time.Duration, 0, b.N)
	floor := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		dev := devs(gpu(8 + i%8))
		t0 := time.Now()
		if err := l.Update(ctx, func(tx *Tx) error {
			_, err := tx.Claim("", bench, dev, "env")
			return err
		}); err != nil {
			b.Fatal(err)
		}
		if err := l.Update(ctx, func(tx *Tx) error {
			if len(tx.Release("bench", "stop")) != 1 {
				return fmt.Errorf("release found no claim")
			}
			return nil
		}); err != nil {
			b.Fatal(err)
		}
		ours = append(ours, time.Since(t0))

		t1 := time.Now()
		bare()
		bare()
		floor = append(floor, time.Since(t1))
	}
	b.StopTimer()
	p := func(ds []time.Duration, q float64) float64 {
		s := slices.Clone(ds)
		slices.Sort(s)
		return float64(s[min(len(s)-1, int(q*float64(len(s))))].Microseconds())
	}
	b.ReportMetric(p(ours, 0.50), "p50-µs")
	b.ReportMetric(p(ours, 0.99), "p99-µs")
	b.ReportMetric(p(floor, 0.50), "bare-p50-µs")
	b.ReportMetric(p(floor, 0.99), "bare-p99-µs")
	b.ReportMetric(p(ours, 0.50)/max(p(floor, 0.50), 1), "p50-ratio")
	b.ReportMetric(float64(len(payload)), "state-bytes")
}

// BenchmarkEncode isolates the state encoder (the CPU part of a commit).
func BenchmarkEncode(b *testing.B) {
	st := State{BootID: testBoot, NextSeq: 501}
	for g := 0; g < 8; g++ {
		st.Claims = append(st.Claims, Claim{Device: gpu(g), Owner: owner(fmt.Sprint(g)), Source: "env", Since: time.Now()})
	}
	for w := 0; w < 500; w++ {
		st.Waiters = append(st.Waiters, Waiter{Key: fmt.Sprint(w), Seq: uint64(w + 1), Devices: devs(gpu(w % 8)), Owner: owner(fmt.Sprint(w)), FirstSeen: time.Now(), LastSeen: time.Now()})
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := encodeState(&st); err != nil {
			b.Fatal(err)
		}
	}
}
