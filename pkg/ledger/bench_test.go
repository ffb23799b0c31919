// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/gofrs/flock"
)

// busyLedger is a ledger of 16 GPUs, 8 of them held, with waiters queued for
// the held ones.
func busyLedger(b *testing.B, waiters int) *Ledger {
	b.Helper()
	l, err := Open(b.TempDir(), Options{BootID: testBoot, LockTimeout: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	err = l.Update(context.Background(), func(tx *Tx) error {
		for g := 0; g < 8; g++ {
			if _, err := tx.Claim("", owner(fmt.Sprintf("holder-%d", g)), devs(gpu(g)), "env"); err != nil {
				return err
			}
		}
		for w := 0; w < waiters; w++ {
			o := owner(fmt.Sprintf("waiter-%d", w))
			tx.Enqueue(fmt.Sprintf("ns/%s/ctr", o.PodUID), o, devs(gpu(w%8)))
		}
		return nil
	})
	if err != nil {
		b.Fatal(err)
	}
	return l
}

// floor is the bare cost of one durable write of payload: flock + write a
// temp file + fsync + rename + fsync dir + unlock.
type floor struct {
	b    *testing.B
	dir  string
	lock *flock.Flock
}

func newFloor(b *testing.B) *floor {
	dir := b.TempDir()
	return &floor{b: b, dir: dir, lock: flock.New(filepath.Join(dir, "bare.lock"))}
}

func (f *floor) write(payload []byte) {
	if err := f.lock.Lock(); err != nil {
		f.b.Fatal(err)
	}
	tmp, err := writeTemp(f.dir, "bare.json.tmp-*", payload, "", "")
	if err != nil {
		f.b.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(f.dir, "bare.json")); err != nil {
		f.b.Fatal(err)
	}
	if err := syncDir(f.dir); err != nil {
		f.b.Fatal(err)
	}
	if err := f.lock.Unlock(); err != nil {
		f.b.Fatal(err)
	}
}

func quantile(ds []time.Duration, q float64) float64 {
	s := slices.Clone(ds)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(q*float64(len(s))))].Microseconds())
}

// BenchmarkDurableCommit measures one durable commit (a claim, then a
// release: two samples per iteration) on a busy ledger with 500 and 10,000
// waiters, interleaved in the same run with the floor: flock + write +
// fsync + rename + fsync dir of 4 KiB (bare4k), and of the whole state
// (bareState: what format 1 had to write at every commit). It reports the
// p50/p99 of each and the ratios to the 4 KiB floor, and the process's CPU
// per commit of ours (cpu-µs/commit: what grows with the queue, whatever the
// disk does); ns/op includes the periodic compaction.
//
//	go test -tags nri_no_wasm -run '^$' -bench DurableCommit -benchtime 400x -count 5 ./pkg/ledger/
func BenchmarkDurableCommit(b *testing.B) {
	for _, waiters := range []int{500, 10000} {
		b.Run(fmt.Sprintf("waiters=%d", waiters), func(b *testing.B) { benchCommit(b, waiters) })
	}
}

func benchCommit(b *testing.B, waiters int) {
	ctx := context.Background()
	l := busyLedger(b, waiters)
	st, err := l.Snapshot(ctx)
	if err != nil {
		b.Fatal(err)
	}
	whole, err := encodeState(&st)
	if err != nil {
		b.Fatal(err)
	}
	page := bytes.Repeat([]byte("x"), 4096)
	bare := newFloor(b)
	bench := owner("bench")
	var ours, bare4k, bareState []time.Duration
	var cpu time.Duration // the process's CPU during our commits (GC included)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		dev := devs(gpu(8 + i%8))
		t0, c0 := time.Now(), cpuTime()
		if err := l.Update(ctx, func(tx *Tx) error {
			_, err := tx.Claim("", bench, dev, "env")
			return err
		}); err != nil {
			b.Fatal(err)
		}
		ours = append(ours, time.Since(t0))
		cpu += cpuTime() - c0

		t1 := time.Now()
		bare.write(page)
		bare4k = append(bare4k, time.Since(t1))

		t2, c2 := time.Now(), cpuTime()
		if err := l.Update(ctx, func(tx *Tx) error {
			if len(tx.Release("bench", "stop")) != 1 {
				return fmt.Errorf("release found no claim")
			}
			return nil
		}); err != nil {
			b.Fatal(err)
		}
		ours = append(ours, time.Since(t2))
		cpu += cpuTime() - c2

		if i%4 == 0 { // the whole-state floor is slow at 10,000 waiters: sample it
			t3 := time.Now()
			bare.write(whole)
			bareState = append(bareState, time.Since(t3))
		}
		t4 := time.Now()
		bare.write(page)
		bare4k = append(bare4k, time.Since(t4))
	}
	b.StopTimer()
	b.ReportMetric(quantile(ours, 0.50), "p50-µs")
	b.ReportMetric(quantile(ours, 0.99), "p99-µs")
	b.ReportMetric(quantile(bare4k, 0.50), "bare4k-p50-µs")
	b.ReportMetric(quantile(bare4k, 0.99), "bare4k-p99-µs")
	b.ReportMetric(quantile(bareState, 0.50), "bareState-p50-µs")
	b.ReportMetric(quantile(ours, 0.50)/max(quantile(bare4k, 0.50), 1), "p50-ratio-4k")
	b.ReportMetric(quantile(ours, 0.99)/max(quantile(bare4k, 0.99), 1), "p99-ratio-4k")
	b.ReportMetric(quantile(ours, 0.50)/max(quantile(bareState, 0.50), 1), "p50-ratio-state")
	b.ReportMetric(float64(len(whole)), "state-bytes")
	b.ReportMetric(float64(cpu.Microseconds())/float64(len(ours)), "cpu-µs/commit")
}

// BenchmarkCommitBehindCordonedBacklog is BenchmarkDurableCommit's claim and
// release at 10,000 waiters, the first 5,000 of which wait for a GPU an
// operator cordoned: none of them is the head of the queue, so finding the
// head passes over all of them. It reports the process's CPU per commit.
//
//	go test -tags nri_no_wasm -run '^$' -bench CordonedBacklog -benchtime 200x -count 4 ./pkg/ledger/
func BenchmarkCommitBehindCordonedBacklog(b *testing.B) {
	ctx := context.Background()
	l, err := Open(b.TempDir(), Options{BootID: testBoot, LockTimeout: time.Minute})
	if err != nil {
		b.Fatal(err)
	}
	update(b, l, func(tx *Tx) {
		for g := 0; g < 8; g++ {
			if _, err := tx.Claim("", owner(fmt.Sprintf("holder-%d", g)), devs(gpu(g)), "env"); err != nil {
				b.Fatal(err)
			}
		}
		if _, _, err := tx.Cordon(gpu(15), CordonOperator, "RMA", "bench"); err != nil {
			b.Fatal(err)
		}
		for w := 0; w < 10000; w++ {
			d := gpu(15)
			if w >= 5000 {
				d = gpu(w % 8)
			}
			o := owner(fmt.Sprintf("waiter-%d", w))
			tx.Enqueue(fmt.Sprintf("ns/%s/ctr", o.PodUID), o, devs(d))
		}
	})
	var cpu time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c0 := cpuTime()
		if err := l.Update(ctx, func(tx *Tx) error {
			_, err := tx.Claim("", owner("bench"), devs(gpu(8+i%7)), "env")
			return err
		}); err != nil {
			b.Fatal(err)
		}
		update(b, l, func(tx *Tx) { tx.Release("bench", "stop") })
		cpu += cpuTime() - c0
	}
	b.ReportMetric(float64(cpu.Microseconds())/float64(2*b.N), "cpu-µs/commit")
}

// cpuTime is the process's user and system CPU time so far. The figure it
// gives a commit does not depend on how long the disk takes to sync, so it
// shows what grows with the queue.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkColdRead is what gpu-guard-ctl status and a hook's poststop pay
// to read the ledger: a fresh handle (no cache) reads the snapshot (decoded
// once, in one pass) and replays the journal, at 1,000 waiters.
//
//	go test -tags nri_no_wasm -run '^$' -bench ColdRead -count 5 ./pkg/ledger/
func BenchmarkColdRead(b *testing.B) {
	l := busyLedger(b, 1000)
	// A journal of 100 commits after the snapshot, as between compactions.
	for i := 0; i < 50; i++ {
		update(b, l, func(tx *Tx) {
			if _, err := tx.Claim("", owner("bench"), devs(gpu(8+i%8)), "env"); err != nil {
				b.Fatal(err)
			}
		})
		update(b, l, func(tx *Tx) { tx.Release("bench", "stop") })
	}
	snap, err := os.Stat(l.StatePath())
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(float64(snap.Size()), "snapshot-bytes")
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r, err := OpenReadOnly(l.Dir(), l.opts)
		if err != nil {
			b.Fatal(err)
		}
		st, err := r.Snapshot(context.Background())
		if err != nil || len(st.Waiters) != 1000 {
			b.Fatal(err, len(st.Waiters))
		}
	}
}

// BenchmarkPositions is ctl queue's position computation at 4,000 waiters:
// one pass (Positions) against a Position call per waiter.
//
//	go test -tags nri_no_wasm -run '^$' -bench Positions ./pkg/ledger/
func BenchmarkPositions(b *testing.B) {
	l := busyLedger(b, 4000)
	b.Run("Positions", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			_ = l.View(context.Background(), func(tx *Tx) error {
				if len(tx.Positions()) != 4000 {
					b.Fatal("positions")
				}
				return nil
			})
		}
	})
	b.Run("PositionPerWaiter", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			_ = l.View(context.Background(), func(tx *Tx) error {
				for _, w := range tx.st.Waiters {
					_, _, _ = tx.Position(w.Key)
				}
				return nil
			})
		}
	})
}

// BenchmarkEncode isolates the snapshot encoder (the CPU part of a
// compaction).
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
