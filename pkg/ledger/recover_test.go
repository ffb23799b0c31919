// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// failClosedLedger is a hook-only host's ledger: 2 holders (GPU 0 and GPU 1)
// and 3 waiters queued for them. With compacted, every commit is also
// compacted, so ledger.json holds all of it and recovery needs the previous
// snapshot and the journals; without, ledger.json is the empty base of the
// fresh start and recovery replays the journal.
func failClosedLedger(t *testing.T, compacted bool) (dir string, opts Options) {
	t.Helper()
	opts = testOptions(newClock())
	opts.RuntimeDir = t.TempDir()
	dir = filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, opts)
	require.NoError(t, err)
	l.compactAlways = compacted
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h2"), devs(gpu(1)), "env")
		require.NoError(t, err)
	})
	for i, d := range []int{0, 1, 0} {
		update(t, l, func(tx *Tx) { tx.Enqueue(fmt.Sprintf("w%d", i+1), owner(fmt.Sprintf("w%d", i+1)), devs(gpu(d))) })
	}
	return dir, opts
}

func wantFailClosedState(t *testing.T, st State) {
	t.Helper()
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "h2"}, holders(st), "both holders are back")
	require.Equal(t, []string{"w1", "w2", "w3"}, waiterKeys(st), "the waiters are back, in order")
}

// The attacks of the fail-open report, on a hook-only host: every content
// damage of ledger.json, the state dir moved away, ledger.json deleted, and
// more (the journal cut or damaged, the state replaced by another ledger's).
// Each is refused by every Update that would admit (no second holder, not
// even of a free GPU) and by every read, until Recover, after which both
// holders and the waiters are back.
func TestDamagedOrVanishedStateFailsClosedUntilRecovered(t *testing.T) {
	type attack struct {
		name string
		do   func(t *testing.T, dir string)
		// inPlace: the damage rewrites ledger.json in place, keeping its
		// size; a handle that cached the state may not notice at once (see
		// doc.go), fresh ones (every hook) do.
		inPlace bool
		// undo is what the operator does before recovering (put back what
		// was moved); Recover then finds nothing to do.
		undo func(t *testing.T, dir string)
		// lost: the last commit is destroyed (the journal cut): recovery
		// brings back what is left and says what is lost.
		lost bool
		// gone: every file of the ledger was overwritten, unless compaction
		// kept the previous ones.
		gone bool
	}
	snap := func(dir string) string { return filepath.Join(dir, stateName) }
	rewrite := func(mangle func(b []byte) []byte) func(t *testing.T, dir string) {
		return func(t *testing.T, dir string) {
			b := mustRead(t, snap(dir))
			require.NoError(t, os.WriteFile(snap(dir), mangle(bytes.Clone(b)), 0o600))
		}
	}
	attacks := []attack{
		{name: "flipped byte", inPlace: true, do: rewrite(func(b []byte) []byte { b[len(b)-10] ^= 0x20; return b })},
		{name: "empty", do: rewrite(func([]byte) []byte { return nil })},
		{name: "truncated", do: rewrite(func(b []byte) []byte { return b[:len(b)*2/3] })},
		{name: "garbage", do: rewrite(func([]byte) []byte { return []byte("\x7fELF garbage\x00\x00 not a ledger") })},
		{name: "NUL-filled", inPlace: true, do: rewrite(func(b []byte) []byte { return make([]byte, len(b)) })},
		{name: "over-size", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Truncate(snap(dir), maxStateBytes+1)) // sparse: cheap
		}},
		{name: "two holders of one GPU, valid checksum", do: func(t *testing.T, dir string) {
			st, err := DecodeState(mustRead(t, snap(dir)))
			require.NoError(t, err)
			st.Claims = append(st.Claims, Claim{Device: mig(0, 1), Owner: owner("intruder"), Source: "env", Since: st.UpdatedAt})
			b, err := encodeState(&st)
			require.NoError(t, err)
			require.NoError(t, os.WriteFile(snap(dir), b, 0o600))
		}},
		{name: "state dir moved away", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Rename(dir, dir+"-stolen"))
		}, undo: func(t *testing.T, dir string) {
			require.NoError(t, os.Rename(dir+"-stolen", dir))
		}},
		{name: "ledger.json deleted", do: func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(snap(dir)))
		}},
		{name: "every state file deleted", do: func(t *testing.T, dir string) {
			for _, n := range []string{stateName, journalName, prevName, journalPrevName} {
				p := filepath.Join(dir, n)
				if _, err := os.Stat(p); err == nil {
					require.NoError(t, os.Rename(p, p+".hidden"))
				}
			}
		}, undo: func(t *testing.T, dir string) {
			for _, n := range []string{stateName, journalName, prevName, journalPrevName} {
				if _, err := os.Stat(filepath.Join(dir, n+".hidden")); err == nil {
					require.NoError(t, os.Rename(filepath.Join(dir, n+".hidden"), filepath.Join(dir, n)))
				}
			}
		}},
		{name: "journal cut (last commit lost)", lost: true, do: func(t *testing.T, dir string) {
			j := filepath.Join(dir, journalName)
			b := mustRead(t, j)
			if bytes.Count(b, []byte("\n")) < 2 { // compacted: the records are in the old journal
				require.NoError(t, os.Rename(filepath.Join(dir, journalPrevName), j+".moved"))
				require.NoError(t, os.Rename(snap(dir), snap(dir)+".moved"))
				require.NoError(t, os.Rename(filepath.Join(dir, prevName), snap(dir)))
				return
			}
			cut := bytes.LastIndexByte(b[:len(b)-1], '\n') + 1
			require.NoError(t, os.WriteFile(j, b[:cut], 0o600))
		}},
		{name: "replaced by another ledger's state", gone: true, do: func(t *testing.T, dir string) {
			other := t.TempDir()
			o, err := Open(other, Options{BootID: testBoot, RuntimeDir: t.TempDir()})
			require.NoError(t, err)
			update(t, o, func(tx *Tx) { tx.Enqueue("x", owner("x"), devs(gpu(3))) })
			for _, n := range []string{stateName, journalName} {
				require.NoError(t, os.Rename(filepath.Join(other, n), filepath.Join(dir, n)))
			}
		}},
	}
	for _, compacted := range []bool{false, true} {
		for _, a := range attacks {
			t.Run(fmt.Sprintf("%s/compacted=%t", a.name, compacted), func(t *testing.T) {
				dir, opts := failClosedLedger(t, compacted)
				longLived, err := Open(dir, opts)
				require.NoError(t, err)
				wantFailClosedState(t, snapshot(t, longLived)) // cached from here on
				a.do(t, dir)
				damaged := map[string][]byte{}
				for _, n := range []string{stateName, journalName} {
					if b, err := os.ReadFile(filepath.Join(dir, n)); err == nil && len(b) < 1<<20 {
						damaged[n] = b
					}
				}

				handles := []*Ledger{}
				for range 2 { // two hooks, one after the other
					h, err := Open(dir, opts)
					require.NoError(t, err)
					handles = append(handles, h)
				}
				if !a.inPlace {
					handles = append(handles, longLived)
				}
				for i, h := range handles {
					for _, d := range []int{0, 1, 5} { // held, held, free
						ran := false
						err := h.Update(context.Background(), func(tx *Tx) error {
							ran = true
							_, err := tx.Claim("", owner(fmt.Sprintf("new-%d-%d", i, d)), devs(gpu(d)), "env")
							return err
						})
						require.ErrorIs(t, err, ErrNeedsRecovery, "handle %d, GPU %d: %v", i, d, err)
						require.False(t, ran, "nothing is decided against a state that is not the last committed one")
						require.Contains(t, err.Error(), "gpu-guard-ctl recover", "the message says what to do")
					}
					_, err := h.Snapshot(context.Background())
					require.ErrorIs(t, err, ErrNeedsRecovery, "reads report it (ctl status exits non-zero)")
				}
				ro, err := OpenReadOnly(dir, opts)
				require.NoError(t, err)
				_, err = ro.Snapshot(context.Background())
				require.ErrorIs(t, err, ErrNeedsRecovery)
				for n, b := range damaged {
					require.Equal(t, b, mustRead(t, filepath.Join(dir, n)), "%s is never overwritten while refused", n)
				}

				if a.undo != nil {
					a.undo(t, dir)
				}
				rec, err := Open(dir, opts)
				require.NoError(t, err)
				rep, err := rec.Recover(context.Background(), RecoverOptions{Reason: "test"})
				if a.gone && !compacted {
					// The replacement overwrote every file of this ledger:
					// there is nothing of it to recover, and another
					// ledger's claims are not adopted.
					require.ErrorIs(t, err, ErrNeedsRecovery)
					require.ErrorContains(t, err, "--reset")
					return
				}
				require.NoError(t, err)
				if a.undo == nil {
					require.NotEmpty(t, rep.Problem)
					require.NotEmpty(t, rep.From, "the report names what the state was rebuilt from")
				}
				for _, q := range rep.Quarantined {
					require.FileExists(t, q, "what was moved aside is kept")
				}
				if a.lost {
					require.False(t, rep.Complete)
					require.True(t, rep.NewLineage, "a state missing commits gets a new lineage (the NRI daemon rebuilds)")
					require.Contains(t, rep.Lost, "commits")
					require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "h2"}, holders(snapshot(t, rec)))
					return
				}
				require.True(t, rep.Complete, "every commit is back: %+v", rep)
				wantFailClosedState(t, State{Claims: rep.Claims, Waiters: rep.Waiters})

				// Every handle, old and new, decides against the recovered state.
				for _, h := range append(handles, longLived) {
					err := h.Update(context.Background(), func(tx *Tx) error {
						_, err := tx.Claim("", owner("late"), devs(gpu(0)), "env")
						return err
					})
					require.True(t, isBusy(err), "GPU 0 is held again: %v", err)
					wantFailClosedState(t, snapshot(t, h))
				}
			})
		}
	}
}

// A last record without its newline is the write a crash interrupted: that
// transaction never committed (its caller got no answer), so it is not
// damage; the next writer cuts it.
func TestTornJournalTailIsTheUncommittedTransaction(t *testing.T) {
	dir, opts := failClosedLedger(t, false)
	j := filepath.Join(dir, journalName)
	whole := mustRead(t, j)
	f, err := os.OpenFile(j, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.WriteString(`0badc0de {"g":99,"t":"2026-03-01T12:00:00Z","seq":9,"c":[{"dev`)
	require.NoError(t, err)
	require.NoError(t, f.Close())

	l, err := Open(dir, opts)
	require.NoError(t, err)
	wantFailClosedState(t, snapshot(t, l))
	update(t, l, func(tx *Tx) { tx.Release("h2", "stop") })
	b := mustRead(t, j)
	require.True(t, bytes.HasPrefix(b, whole), "the committed records are kept")
	require.True(t, bytes.HasSuffix(b, []byte("\n")), "the torn tail was cut")
	require.NotContains(t, string(b), "0badc0de")
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "h1", gpu(1).UUID: "w2"}, map[string]string{
		gpu(0).UUID: holders(st)[gpu(0).UUID], gpu(1).UUID: reservedFor(st)[gpu(1).UUID]})
}

// A fresh host (no state, no boot marker) starts empty; the same dir once
// this boot committed there does not.
func TestFreshHostStartsEmptyButVanishedStateDoesNot(t *testing.T) {
	opts := testOptions(nil)
	opts.RuntimeDir = t.TempDir()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, opts)
	require.NoError(t, err)
	require.Empty(t, snapshot(t, l).Claims)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	require.NoError(t, os.RemoveAll(dir))
	_, err = Open(dir, opts)
	require.NoError(t, err)
	require.NoDirExists(t, dir, "a vanished state dir is not created afresh")
	err = l.Update(context.Background(), func(*Tx) error { return nil })
	require.ErrorIs(t, err, ErrNeedsRecovery)

	// Nothing left to recover from: Recover says so, Reset starts afresh.
	_, err = l.Recover(context.Background(), RecoverOptions{})
	require.ErrorIs(t, err, ErrNeedsRecovery)
	require.ErrorContains(t, err, "--reset")
	rep, err := l.Reset(context.Background(), "operator: the host's containers were all stopped")
	require.NoError(t, err)
	require.True(t, rep.NewLineage)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h2"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	require.Contains(t, auditOps(t, l), OpReset)
}

// The NRI daemon's rebuild: AllowEmpty starts afresh when nothing verifies.
func TestRecoverAllowEmptyAndAlive(t *testing.T) {
	dir, opts := failClosedLedger(t, true)
	for _, n := range []string{stateName, prevName, journalName, journalPrevName} {
		if _, err := os.Stat(filepath.Join(dir, n)); err == nil {
			require.NoError(t, os.WriteFile(filepath.Join(dir, n), []byte("junk"), 0o600))
		}
	}
	l, err := Open(dir, opts)
	require.NoError(t, err)
	rep, err := l.Recover(context.Background(), RecoverOptions{AllowEmpty: true, Reason: "NRI sync"})
	require.NoError(t, err)
	require.True(t, rep.Empty)
	require.True(t, rep.NewLineage)
	require.NotEmpty(t, rep.Quarantined)
	require.Empty(t, snapshot(t, l).Claims)

	// Alive: a holder known gone is released, one that cannot be checked kept.
	dir, opts = failClosedLedger(t, false)
	require.NoError(t, os.WriteFile(filepath.Join(dir, stateName), []byte("junk"), 0o600))
	l, err = Open(dir, opts)
	require.NoError(t, err)
	rep, err = l.Recover(context.Background(), RecoverOptions{Alive: func(c Claim) (bool, error) {
		if c.Owner.ContainerID == "h1" {
			return false, nil
		}
		return false, fmt.Errorf("cannot tell")
	}})
	require.NoError(t, err)
	require.Len(t, rep.Released, 1)
	require.Equal(t, "h1", rep.Released[0].Owner.ContainerID)
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(1).UUID: "h2"}, holders(st))
	require.Equal(t, "w1", reservedFor(st)[gpu(0).UUID], "the freed GPU goes to the head of its queue")
}

// A FIFO (or any non-regular file) in place of a ledger file is refused at
// once, never opened blocking.
func TestNonRegularLedgerFilesAreRefused(t *testing.T) {
	for _, name := range []string{stateName, journalName, auditName} {
		t.Run(name, func(t *testing.T) {
			l := seeded(t)
			p := filepath.Join(l.Dir(), name)
			require.NoError(t, os.Remove(p))
			require.NoError(t, syscall.Mkfifo(p, 0o600))
			err := l.Update(context.Background(), func(tx *Tx) error {
				_, err := tx.Claim("", owner("c2"), devs(gpu(1)), "env")
				return err
			})
			if name == auditName {
				// The commit stands (its audit record is logged as lost);
				// what matters is that nothing hung.
				require.NoError(t, err)
				_, err = ReadAudit(p)
				require.Error(t, err)
			} else {
				require.ErrorIs(t, err, ErrUnsafeDir)
				require.ErrorContains(t, err, "not a regular file")
			}
			_, err = Open(l.Dir(), testOptions(nil))
			require.ErrorIs(t, err, ErrUnsafeDir)
		})
	}
}

func TestCheckDirChain(t *testing.T) {
	require.NoError(t, CheckDirChain("/"))
	require.ErrorIs(t, CheckDirChain("relative/state"), ErrUnsafeDir)
	require.ErrorIs(t, CheckDirChain("/var/../etc"), ErrUnsafeDir)

	safe := safeDir(t)
	require.NoError(t, CheckDirChain(safe), "a fresh 0755 dir of the test's own, in the temp dir")
	require.NoError(t, CheckDirChain(filepath.Join(safe, "a", "state")), "missing components at the end are created later")
	// Open walks the chain again only where part of it was missing.
	complete, err := checkDirChain(filepath.Join(safe, "a", "state"))
	require.NoError(t, err)
	require.False(t, complete, "a missing tail is reported, so that Open checks the chain again once it exists")
	complete, err = checkDirChain(safe)
	require.NoError(t, err)
	require.True(t, complete)
	require.NoError(t, os.Mkdir(filepath.Join(safe, "real"), 0o700))
	require.NoError(t, os.Symlink(filepath.Join(safe, "real"), filepath.Join(safe, "link")))
	require.ErrorContains(t, CheckDirChain(filepath.Join(safe, "link", "state")), "symlink")
	require.NoError(t, os.WriteFile(filepath.Join(safe, "file"), nil, 0o600))
	require.ErrorContains(t, CheckDirChain(filepath.Join(safe, "file", "state")), "not a directory")
}

// TestOpenRefusesMovableStateDir is the `mv state stolen` attack: a state
// dir whose parent anyone may write to (without the sticky bit) can be
// renamed away by anyone, so Open and OpenReadOnly refuse it, saying what to
// fix. In a sticky parent (like /tmp, 1777) only the owner of an entry may
// rename it, so a root- or euid-owned state dir there is accepted; one owned
// by another user is not.
func TestOpenRefusesMovableStateDir(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	base := safeDir(t)
	require.NoError(t, CheckDirChain(base), "a fresh 0755 dir of the test's own, in the temp dir")
	mk := func(name string, mode os.FileMode) string {
		p := filepath.Join(base, name)
		require.NoError(t, os.Mkdir(p, 0o700))
		require.NoError(t, os.Chmod(p, mode))
		return p
	}
	for _, tc := range []struct {
		name  string
		dir   func() string
		wants []string // empty: accepted
	}{
		{name: "non-sticky 0777 parent", dir: func() string { return filepath.Join(mk("open", 0o777), "state") },
			wants: []string{"0777", "without the sticky bit", "mv state stolen", "chmod go-w"}},
		{name: "non-sticky 0770 parent", dir: func() string { return filepath.Join(mk("group", 0o770), "state") },
			wants: []string{"0770", "without the sticky bit"}},
		{name: "non-sticky 0777 grandparent", dir: func() string {
			p := filepath.Join(mk("gp", 0o777), "mid")
			require.NoError(t, os.Mkdir(p, 0o700))
			return filepath.Join(p, "state")
		}, wants: []string{filepath.Join(base, "gp") + " (on the path", "0777"}},
		{name: "sticky 1777 parent, root-owned state dir", dir: func() string {
			p := filepath.Join(mk("sticky", 0o777|os.ModeSticky), "state")
			require.NoError(t, os.Mkdir(p, 0o700))
			return p
		}},
		{name: "sticky 1777 parent, missing state dir is created", dir: func() string {
			return filepath.Join(mk("sticky2", 0o777|os.ModeSticky), "state")
		}},
		{name: "sticky 1777 parent, state dir owned by another user", dir: func() string {
			p := filepath.Join(mk("sticky3", 0o777|os.ModeSticky), "state")
			require.NoError(t, os.Mkdir(p, 0o700))
			require.NoError(t, os.Chown(p, 65534, 65534))
			return p
		}, wants: []string{"owned by uid 65534"}},
		{name: "sticky 1777 parent owned by another user", dir: func() string {
			p := mk("sticky4", 0o777|os.ModeSticky)
			require.NoError(t, os.Chown(p, 65534, 65534))
			return filepath.Join(p, "state")
		}, wants: []string{"owned by uid 65534", "chown root"}},
		{name: "sticky bit does not excuse a writable state dir", dir: func() string {
			return mk("stickyleaf", 0o777|os.ModeSticky)
		}, wants: []string{"the ledger dir", "chmod 0700"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := tc.dir()
			for _, open := range []func(string, Options) (*Ledger, error){Open, OpenReadOnly} {
				l, err := open(dir, testOptions(nil))
				if len(tc.wants) == 0 {
					require.NoError(t, err)
					continue
				}
				require.Nil(t, l)
				require.ErrorIs(t, err, ErrUnsafeDir)
				for _, w := range tc.wants {
					require.ErrorContains(t, err, w)
				}
			}
			if len(tc.wants) == 0 {
				fi, err := os.Lstat(dir)
				require.NoError(t, err, "Open created the state dir")
				require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
			}
		})
	}
}

// Positions agrees with Position for every waiter, including MIG overlaps.
func TestPositionsMatchesPosition(t *testing.T) {
	l := openTest(t, newClock())
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h"), devs(gpu(0), gpu(1), gpu(2)), "env")
		require.NoError(t, err)
		reqs := [][]int{{0}, {1}, {0, 1}, {2}, {0}, {1, 2}, {2}, {0}}
		for i, r := range reqs {
			var ds = devs()
			for _, g := range r {
				ds = append(ds, gpu(g))
			}
			if i == 3 {
				ds = devs(mig(2, 0))
			}
			tx.Enqueue(fmt.Sprintf("k%d", i), owner(fmt.Sprintf("k%d", i)), ds)
		}
	})
	require.NoError(t, l.View(context.Background(), func(tx *Tx) error {
		all := tx.Positions()
		require.Len(t, all, 8)
		for k, p := range all {
			pos, total, ok := tx.Position(k)
			require.True(t, ok)
			require.Equal(t, QueuePlace{pos, total}, p, k)
		}
		return nil
	}))
}

// Tx.State is a copy: changing it changes neither the Tx nor the cache.
func TestTxStateIsACopy(t *testing.T) {
	l := seeded(t)
	update(t, l, func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(gpu(0))) })
	update(t, l, func(tx *Tx) {
		st := tx.State()
		st.Claims[0].Owner.ContainerID = "evil"
		st.Waiters[0].Devices[0] = gpu(7)
		st.Waiters = append(st.Waiters[:0], Waiter{Key: "evil"})
		busy := tx.Busy("", owner("x"), devs(gpu(0)))
		require.Len(t, busy, 1)
		require.Equal(t, "c1", busy[0].Holder.Owner.ContainerID, "the Tx decides on its own state")
		pos, _, ok := tx.Position("w")
		require.True(t, ok)
		require.Equal(t, 1, pos)
		_, err := tx.Claim("", owner("c2"), devs(gpu(1)), "env")
		require.NoError(t, err)
		w, ok := tx.Waiter("w")
		require.True(t, ok)
		require.Equal(t, gpu(0), w.Devices[0], "one waiter, read from the Tx's own state")
		w.Devices[0] = gpu(7)
		_, ok = tx.Waiter("nobody")
		require.False(t, ok)
	})
	st := snapshot(t, l)
	require.Equal(t, map[string]string{gpu(0).UUID: "c1", gpu(1).UUID: "c2"}, holders(st))
	require.Equal(t, gpu(0), st.Waiters[0].Devices[0])
	require.True(t, slices.Equal([]string{"w"}, waiterKeys(st)))
}

// A field this build does not know (a newer build's, or a hand edit) is not
// dropped at the next write: the state is refused, the file left as it is.
func TestUnknownFieldIsRefusedNotDropped(t *testing.T) {
	l := seeded(t)
	l.compactAlways = true
	update(t, l, func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(gpu(0))) })
	st := stored(t, l)
	body, err := appendStateJSON(nil, &st)
	require.NoError(t, err)
	body = append([]byte(`{"priority_classes":["gold"],`), body[1:]...)
	file := snapFile(t, map[string]any{"format": FormatVersion, "generation": st.Generation, "boot_id": st.BootID,
		"lineage": st.Lineage, "checksum": checksumOf(body), "bytes": len(body)}, body)
	require.NoError(t, os.WriteFile(l.StatePath(), file, 0o600))

	fresh, err := Open(l.Dir(), testOptions(nil))
	require.NoError(t, err)
	err = fresh.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("", owner("x"), devs(gpu(3)), "env")
		return err
	})
	require.ErrorIs(t, err, ErrNeedsRecovery)
	require.ErrorContains(t, err, `unknown field "priority_classes"`)
	require.ErrorContains(t, err, "would drop it")
	require.Equal(t, file, mustRead(t, l.StatePath()), "left as it is")
}

// The boot marker is what tells a vanished state from a fresh host: a
// damaged one is refused, never read as "fresh".
func TestDamagedBootMarkerIsRefused(t *testing.T) {
	dir, opts := failClosedLedger(t, false)
	l, err := Open(dir, opts)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(l.markerPath(), []byte("garbage"), 0o600))
	err = l.Update(context.Background(), func(*Tx) error { return nil })
	require.ErrorIs(t, err, ErrNeedsRecovery)
	require.ErrorContains(t, err, "boot marker")
	_, err = l.Snapshot(context.Background())
	require.ErrorIs(t, err, ErrNeedsRecovery)
}

// Recover claims completeness only on evidence. A journal cut back to its
// first commits while the boot marker is damaged, or a journal damaged in
// the middle while the marker is missing (a failed marker write), may have
// lost commits that nothing can vouch for: the result gets a new lineage (so
// the NRI daemon rebuilds from the runtime) and says what may be lost.
func TestRecoverWithoutAnIntactMarkerIsNotComplete(t *testing.T) {
	cut := func(t *testing.T, dir string) {
		j := filepath.Join(dir, journalName)
		lines := bytes.SplitAfter(mustRead(t, j), []byte("\n"))
		require.Greater(t, len(lines), 3)
		require.NoError(t, os.WriteFile(j, bytes.Join(lines[:2], nil), 0o600)) // header + first commit
	}
	flip := func(t *testing.T, dir string) {
		j := filepath.Join(dir, journalName)
		b := mustRead(t, j)
		lines := bytes.SplitAfter(b, []byte("\n"))
		off := len(lines[0]) + len(lines[1]) + len(lines[2])/2 // inside the second commit
		b[off] ^= 0x20
		require.NoError(t, os.WriteFile(j, b, 0o600))
	}
	for _, tc := range []struct {
		name   string
		damage func(t *testing.T, dir string)
		marker func(t *testing.T, l *Ledger)
		// replayed: the journal records before the damage, which recovery
		// keeps (the first commit in both cases).
		replayed int
	}{
		{name: "journal cut, marker damaged", damage: cut, replayed: 1,
			marker: func(t *testing.T, l *Ledger) {
				require.NoError(t, os.WriteFile(l.markerPath(), []byte("garbage"), 0o600))
			}},
		{name: "journal damaged mid-way, marker missing", damage: flip, replayed: 1,
			marker: func(t *testing.T, l *Ledger) { require.NoError(t, os.Remove(l.markerPath())) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, opts := failClosedLedger(t, false)
			l, err := Open(dir, opts)
			require.NoError(t, err)
			lineage := snapshot(t, l).Lineage
			tc.damage(t, dir)
			tc.marker(t, l)
			rep, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"})
			require.NoError(t, err)
			require.False(t, rep.Complete, "%+v", rep)
			require.True(t, rep.NewLineage, "%+v", rep)
			require.Equal(t, tc.replayed, rep.Replayed, "%+v", rep)
			require.NotEmpty(t, rep.Lost)
			require.NotEqual(t, lineage, snapshot(t, l).Lineage, "a fenced NRI daemon sees the change and rebuilds")
		})
	}
}

// Without a marker (a failed marker write, or the runtime dir cleared),
// recovery still does not call a chain complete when a file it found names
// a later commit than the chain reaches: here the latest snapshot and the
// journal it compacted are gone, the previous snapshot took the current
// one's place, and the current journal's header names the lost snapshot's
// generation.
func TestRecoverWithoutMarkerSeesAGenerationGap(t *testing.T) {
	dir, opts := failClosedLedger(t, true)
	l, err := Open(dir, opts)
	require.NoError(t, err)
	last := snapshot(t, l)
	snap := filepath.Join(dir, stateName)
	require.NoError(t, os.Rename(filepath.Join(dir, journalPrevName), snap+".moved-journal"))
	require.NoError(t, os.Rename(snap, snap+".moved"))
	require.NoError(t, os.Rename(filepath.Join(dir, prevName), snap))
	require.NoError(t, os.Remove(l.markerPath()))

	rep, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err)
	require.False(t, rep.Complete, "the journal names generation %d: %+v", last.Generation, rep)
	require.True(t, rep.NewLineage)
	require.Less(t, rep.RecoveredGeneration, last.Generation)
	require.Contains(t, rep.Lost, fmt.Sprintf("names generation %d", last.Generation))
	require.NotEqual(t, last.Lineage, snapshot(t, l).Lineage, "a fenced NRI daemon sees the change and rebuilds")
	require.Greater(t, snapshot(t, l).Generation, last.Generation, "generations keep counting up")
}

// A damaged ledger of an earlier boot, recovered after the reboot, is
// discarded as any read of an earlier boot's state is: its holders and
// waiters died with that boot. Only the operator's cordons carry over; the
// observer's are dropped; each is audited.
func TestRecoverAfterRebootDiscardsTheEarlierBootsHolders(t *testing.T) {
	c := newClock()
	dir, l := earlierBootLedger(t, c)
	update(t, l, func(tx *Tx) { tx.Enqueue("w", owner("w"), devs(gpu(0))) })
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(1), CordonOperator, "ECC errors, RMA 4711", "uid 0 via gpu-guard-ctl")
		require.NoError(t, err)
		_, _, err = tx.Cordon(gpu(2), CordonIntruder, "pid 4242 not admitted", "observer")
		require.NoError(t, err)
	})
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h3"), devs(gpu(3)), "env")
		require.NoError(t, err)
	})
	before := snapshot(t, l)
	// Damage the journal's last commit: the earlier boot's state needs
	// recovery (the first Update of the new boot would otherwise discard
	// it), and what verifies holds h1, the waiter and both cordons.
	j := filepath.Join(dir, journalName)
	b := mustRead(t, j)
	lines := bytes.SplitAfter(b, []byte("\n"))
	require.Len(t, lines, 6, "header, four commits, and the empty rest")
	last := len(b) - len(lines[4]) // the last commit's line
	b[last+len(lines[4])/2] ^= 0x20
	require.NoError(t, os.WriteFile(j, b, 0o600))

	c.Advance(time.Hour)
	opts := rebootOptions(t, c, "after-reboot")
	r, err := Open(dir, opts)
	require.NoError(t, err)
	_, err = r.Snapshot(context.Background())
	require.ErrorIs(t, err, ErrNeedsRecovery)
	rep, err := r.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err)
	require.Empty(t, rep.Claims, "no holder of the earlier boot comes back: %+v", rep)
	require.Empty(t, rep.Waiters)
	require.True(t, rep.NewLineage, "the NRI daemon rebuilds from the runtime")

	st := snapshot(t, r)
	require.Empty(t, st.Claims)
	require.Empty(t, st.Waiters)
	require.Equal(t, map[string]string{gpu(1).UUID: CordonOperator}, cordonSources(st.Cordons))
	require.Equal(t, "after-reboot", st.BootID)
	require.Greater(t, st.Generation, rep.RecoveredGeneration)
	require.NotEqual(t, before.Lineage, st.Lineage, "(lineage, generation) never names two states")

	audit := string(mustRead(t, filepath.Join(dir, auditName)))
	require.Contains(t, audit, "from before the current boot")
	require.Contains(t, audit, "kept across the reboot")
	require.Contains(t, audit, "dropped at the reboot")

	// A handle opened afresh (the next hook) reads the same.
	again, err := Open(dir, opts)
	require.NoError(t, err)
	require.Equal(t, st.Cordons, snapshot(t, again).Cordons)
	require.Empty(t, snapshot(t, again).Claims)
}

// Recover on a healthy ledger changes nothing and reports the state as any
// read sees it: after a reboot, the earlier boot's holders are not listed
// (they are discarded by the first write of this boot).
func TestRecoverOfAHealthyEarlierBootsLedgerListsNoHolders(t *testing.T) {
	c := newClock()
	dir, l := earlierBootLedger(t, c)
	before := mustRead(t, l.StatePath())
	r, err := Open(dir, rebootOptions(t, c, "after-reboot"))
	require.NoError(t, err)
	rep, err := r.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err)
	require.Empty(t, rep.Problem)
	require.Empty(t, rep.Claims)
	require.Empty(t, rep.Lineage, "the earlier boot's lineage ends with this boot's first write")
	require.Equal(t, before, mustRead(t, l.StatePath()), "nothing written")
}

// earlierBootLedger is a ledger written in boot testBoot, in which h1 holds
// GPU 0 (the reboot tests then open it with another boot id).
func earlierBootLedger(t *testing.T, c *clock) (string, *Ledger) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "state")
	l, err := Open(dir, rebootOptions(t, c, testBoot))
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h1"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	return dir, l
}

// A crash anywhere inside a recovery never loses what it recovers. Of an
// earlier boot's damaged ledger every file is "of another boot", so all are
// moved aside: they are linked aside and keep their names until the write
// of the recovered state replaces them, never leaving an empty state dir
// (which the next read would take for a fresh host, losing the operator's
// cordon). In this boot, a crash after the new state (a new lineage: the
// journal lost a commit) is kept as ledger.json.prev but before the boot
// marker says so leaves a state the next recovery takes as superseding the
// marker's. Whatever the crash left reads either as needing recovery again
// (and the next recovery keeps the cordon) or as the recovered state. Each
// subtest crashes the recovery at the n-th write stage it reaches, for
// every n until one completes.
func TestCrashInsideRecoveryKeepsTheOperatorsCordon(t *testing.T) {
	for _, boot := range []struct {
		name  string
		after string // the boot that recovers; claims of an earlier one go
		held  int
	}{{"earlier boot", "after-reboot", 0}, {"this boot", testBoot, 1}} {
		t.Run(boot.name, func(t *testing.T) {
			for n := 1; ; n++ {
				if !crashInsideRecovery(t, n, boot.after, boot.held) {
					require.Greater(t, n, 8, "the recovery writes the base pair, a snapshot and a journal")
					return
				}
			}
		})
	}
}

// crashInsideRecovery runs a recovery that crashes at the n-th write stage
// it reaches and checks what is left; it reports whether the recovery
// crashed (false: it had fewer stages and completed).
func crashInsideRecovery(t *testing.T, n int, after string, held int) bool {
	t.Helper()
	c := newClock()
	dir, l := earlierBootLedger(t, c)
	update(t, l, func(tx *Tx) {
		_, _, err := tx.Cordon(gpu(1), CordonOperator, "RMA 4711", "uid 0 via gpu-guard-ctl")
		require.NoError(t, err)
	})
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("h3"), devs(gpu(3)), "env")
		require.NoError(t, err)
	})
	j := filepath.Join(dir, journalName)
	b := mustRead(t, j)
	lines := bytes.SplitAfter(b, []byte("\n"))
	last := len(b) - len(lines[len(lines)-2]) // the last commit's line
	b[last+len(lines[len(lines)-2])/2] ^= 0x20
	require.NoError(t, os.WriteFile(j, b, 0o600))

	c.Advance(time.Hour)
	opts := l.opts
	if after != testBoot {
		opts = rebootOptions(t, c, after)
	}
	r, err := Open(dir, opts)
	require.NoError(t, err)
	crashed := false
	func() {
		reached := 0
		failpoint = func(string) {
			if reached++; reached == n {
				panic("crash")
			}
		}
		defer func() {
			failpoint = nil
			crashed = recover() != nil
		}()
		_, err := r.Recover(context.Background(), RecoverOptions{Reason: "test", AllowEmpty: true})
		require.NoError(t, err)
	}()
	if !crashed {
		return false
	}

	again, err := Open(dir, opts)
	require.NoError(t, err)
	st, err := again.Snapshot(context.Background())
	if errors.Is(err, ErrNeedsRecovery) {
		_, err = again.Recover(context.Background(), RecoverOptions{Reason: "test", AllowEmpty: true})
		require.NoError(t, err)
		st, err = again.Snapshot(context.Background())
	}
	require.NoError(t, err)
	require.Equal(t, map[string]string{gpu(1).UUID: CordonOperator}, cordonSources(st.Cordons), "crash at stage %d", n)
	require.Len(t, st.Claims, held, "crash at stage %d: this boot's holder h1 stays (h3's commit was the damaged one); an earlier boot's go", n)
	return true
}

// A writer makes the state dir and the runtime dir it owns 0700 when they
// are open to reading (a Kubernetes hostPath of type DirectoryOrCreate is
// made 0755): the audit log, the holders' names and the hook's container
// markers are root's alone. A reader changes nothing.
func TestWriterTightensItsDirs(t *testing.T) {
	base := safeDir(t)
	state, run := filepath.Join(base, "state"), filepath.Join(base, "run")
	for _, d := range []string{state, run} {
		require.NoError(t, os.Mkdir(d, 0o700))
		require.NoError(t, os.Chmod(d, 0o755))
	}
	mode := func(p string) os.FileMode {
		t.Helper()
		fi, err := os.Stat(p)
		require.NoError(t, err)
		return fi.Mode().Perm()
	}
	opts := testOptions(nil)
	opts.RuntimeDir = run
	_, err := OpenReadOnly(state, opts)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o755), mode(state), "a reader leaves the dir as it is")

	l, err := Open(state, opts)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), mode(state))
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("a"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	require.Equal(t, os.FileMode(0o700), mode(run), "the runtime dir, made 0700 at the commit that writes the boot marker")
}
