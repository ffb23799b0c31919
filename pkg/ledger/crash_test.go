// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The crash tests kill a writer (SIGKILL, no chance to clean up) inside its
// commits, deterministically at each stage and at random instants, and check
// that the ledger then holds exactly the old or the new state.
//
// The state is a function of its generation (crashStep), so that any state
// read back can be checked whole: the permanent part (4 held GPUs, 120
// waiters for them, which makes the file ~40 KB so that a torn write would
// show) plus the one claim of generation g.

const crashSeedGPUs = 4 // GPUs 4..7 held for good; GPUs 0..3 rotate

func init() {
	helpers["crash-writer"] = crashWriter
}

// crashStep is the mutation from generation g to g+1: the container of
// generation g releases, the one of g+1 claims GPU (g+1)%4.
func crashStep(tx *Tx) error {
	g := tx.State().Generation
	tx.Release(fmt.Sprintf("c%d", g), "stop")
	_, err := tx.Claim("", owner(fmt.Sprintf("c%d", g+1)), devs(gpu(int(g+1)%4)), "env")
	return err
}

// checkCrashState verifies that st is exactly the state of its generation.
func checkCrashState(t *testing.T, st State, seedGen uint64) {
	t.Helper()
	require.NoError(t, validateState(&st))
	want := map[string]string{}
	for i := 0; i < crashSeedGPUs; i++ {
		want[gpu(4+i).UUID] = fmt.Sprintf("seed-%d", i)
	}
	if st.Generation > seedGen {
		want[gpu(int(st.Generation)%4).UUID] = fmt.Sprintf("c%d", st.Generation)
	}
	require.Equal(t, want, holders(st), "generation %d", st.Generation)
	require.Len(t, st.Waiters, 120)
	require.Empty(t, st.Reservations)
}

// crashWriter commits crashStep in a loop. With STAGE and AT it SIGKILLs
// itself when commit number AT reaches STAGE; without, it runs until killed,
// printing "committed <generation>" after each commit.
func crashWriter() int {
	stage, at := os.Getenv("STAGE"), 0
	if stage != "" {
		at = envInt("AT")
	}
	commits := 0
	failpoint = func(s string) {
		if s == stageBeforeWrite {
			commits++
		}
		if s == stage && commits == at {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	l, err := Open(os.Getenv("DIR"), Options{BootID: testBoot, LockTimeout: time.Minute})
	if err != nil {
		return helperFail("open: %v", err)
	}
	l.compactAlways = os.Getenv("COMPACT") == "1"
	out := bufio.NewWriter(os.Stdout)
	for n := 0; stage == "" || n < at; n++ {
		var gen uint64
		err := l.Update(context.Background(), func(tx *Tx) error {
			gen = tx.State().Generation + 1
			return crashStep(tx)
		})
		if err != nil {
			return helperFail("commit: %v", err)
		}
		_, _ = fmt.Fprintf(out, "committed %d\n", gen)
		_ = out.Flush()
	}
	return helperFail("commit %d did not reach stage %q", at, stage)
}

func seedCrashLedger(t *testing.T) (dir string, seedGen uint64) {
	dir = t.TempDir()
	l, err := Open(dir, Options{BootID: testBoot})
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		for i := 0; i < crashSeedGPUs; i++ {
			_, err := tx.Claim("", owner(fmt.Sprintf("seed-%d", i)), devs(gpu(4+i)), "env")
			require.NoError(t, err)
		}
		for w := 0; w < 120; w++ {
			tx.Enqueue(fmt.Sprintf("ns/uid-%d/ctr", w), owner(fmt.Sprintf("w%d", w)), devs(gpu(4+w%crashSeedGPUs)))
		}
	})
	return dir, snapshot(t, l).Generation
}

// readBack opens a fresh ledger (no cache) and returns the committed state.
func readBack(t *testing.T, dir string) State {
	t.Helper()
	l, err := Open(dir, Options{BootID: testBoot})
	require.NoError(t, err)
	return snapshot(t, l)
}

func tempFiles(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, tempPrefix+"*"))
	require.NoError(t, err)
	return m
}

func killedBySIGKILL(err error) bool {
	var ee *exec.ExitError
	if !errors.As(err, &ee) {
		return false
	}
	ws, ok := ee.Sys().(syscall.WaitStatus)
	return ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL
}

// journalTail is what follows the journal's last newline: the torn record
// a crash in the middle of an append leaves.
func journalTail(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, journalName))
	if errors.Is(err, os.ErrNotExist) {
		return ""
	}
	require.NoError(t, err)
	return string(b[bytes.LastIndexByte(b, '\n')+1:])
}

func TestCrashAtEachCommitStage(t *testing.T) {
	rounds := 30
	if testing.Short() {
		rounds = 5
	}
	dir, seedGen := seedCrashLedger(t)
	type stage struct {
		name      string
		committed bool // the killed commit is in effect
		leftover  int  // temp files left behind
		torn      bool // a torn journal record is left behind
	}
	// A journal append: the record is visible to every reader of this boot
	// once written whole (a reboot discards the state anyway).
	appendStages := []stage{
		{stageBeforeWrite, false, 0, false},
		{stageTornWrite, false, 0, true},
		{stageAfterWrite, true, 0, false},
		{stageAfterFsync, true, 0, false},
		{stageAfterAudit, true, 0, false},
	}
	// A commit with compaction: the record is appended first, so every
	// compaction stage has the commit in effect.
	compactStages := []stage{
		{stageSnapWritten, true, 1, false}, // the new snapshot's temp file
		{stageSnapSynced, true, 1, false},
		{stagePrevLinked, true, 2, false}, // ... and the old snapshot's temp name
		{stageAfterRename, true, 1, false},
		{stagePrevKept, true, 0, false},
		{stageAfterDirSyn, true, 0, false},
		{stageJournalSynced, true, 1, false},
		{stageJournalRotated, true, 1, false},
		{stageJournalSwapped, true, 0, false},
		{stageAfterAudit, true, 0, false},
	}
	kills := 0
	for round := 0; round < rounds; round++ {
		for _, mode := range []struct {
			compact string
			stages  []stage
		}{{"0", appendStages}, {"1", compactStages}} {
			for _, s := range mode.stages {
				before := readBack(t, dir).Generation
				at := 1 + (round+kills)%3 // die in the 1st, 2nd or 3rd commit of the process
				cmd := helperCmd(t, "crash-writer", map[string]string{"DIR": dir, "STAGE": s.name, "AT": strconv.Itoa(at), "COMPACT": mode.compact})
				out, err := cmd.CombinedOutput()
				require.True(t, killedBySIGKILL(err), "stage %s: want SIGKILL, got %v: %s", s.name, err, out)
				kills++

				require.Len(t, tempFiles(t, dir), s.leftover, "stage %s leaves its temp files", s.name)
				if s.torn {
					require.NotEmpty(t, journalTail(t, dir), "stage %s leaves a torn record", s.name)
				} else {
					require.Empty(t, journalTail(t, dir), "stage %s", s.name)
				}
				st := readBack(t, dir)
				want := before + uint64(at) - 1
				if s.committed {
					want++
				}
				require.Equal(t, want, st.Generation, "stage %s, commit %d: old or new state exactly", s.name, at)
				checkCrashState(t, st, seedGen)
				checkRecoverableWithoutSnapshot(t, dir, st.Generation, seedGen, s.name)
				// The next writer removes the leftovers and carries on from there.
				l, err := Open(dir, Options{BootID: testBoot})
				require.NoError(t, err)
				update(t, l, func(tx *Tx) { require.NoError(t, crashStep(tx)) })
				checkCrashState(t, readBack(t, dir), seedGen)
				require.Empty(t, tempFiles(t, dir))
				require.Empty(t, journalTail(t, dir))
			}
		}
	}
	checkAuditAfterCrashes(t, dir)
	t.Logf("%d writers killed at commit stages", kills)
}

// checkRecoverableWithoutSnapshot: whatever instant a crash hit, the other
// files (ledger.json.prev, the journals) still replay to the commit the
// snapshot holds, should the snapshot be damaged; and ledger.json.prev is
// never the snapshot itself under a second name (a hard link), which
// damage in place to the snapshot would damage too. Checked on a copy, with
// its ledger.json overwritten.
func checkRecoverableWithoutSnapshot(t *testing.T, dir string, gen, seedGen uint64, stage string) {
	t.Helper()
	a, err := os.Lstat(filepath.Join(dir, stateName))
	require.NoError(t, err)
	if b, err := os.Lstat(filepath.Join(dir, prevName)); err == nil {
		require.False(t, os.SameFile(a, b), "stage %s: %s is a link to %s", stage, prevName, stateName)
	}
	cp := copyStateDir(t, dir)
	require.NoError(t, os.WriteFile(filepath.Join(cp, stateName), []byte("damaged"), 0o600))
	l, err := Open(cp, Options{BootID: testBoot, RuntimeDir: t.TempDir()})
	require.NoError(t, err)
	rep, err := l.Recover(context.Background(), RecoverOptions{Reason: "test"})
	require.NoError(t, err, "stage %s", stage)
	require.Equal(t, gen, rep.RecoveredGeneration, "stage %s: the snapshot's commit replays from the other files", stage)
	st := snapshot(t, l)
	st.Generation = rep.RecoveredGeneration // the recovered state is written one generation on
	checkCrashState(t, st, seedGen)
}

func TestCrashAtRandomInstants(t *testing.T) {
	rounds := 100
	if testing.Short() {
		rounds = 15
	}
	dir, seedGen := seedCrashLedger(t)
	rng := rand.New(rand.NewPCG(3, 4))
	busy, inFlight := 0, 0 // rounds killed while committing; of which the unreported commit took effect
	for round := 0; round < rounds; round++ {
		before := readBack(t, dir).Generation
		// Half the rounds compact at every commit, so kills land in
		// compactions too.
		cmd := helperCmd(t, "crash-writer", map[string]string{"DIR": dir, "COMPACT": strconv.Itoa(round % 2)})
		stdout, err := cmd.StdoutPipe()
		require.NoError(t, err)
		require.NoError(t, cmd.Start())
		// The child reports each commit; the last one reported is at least
		// committed, the one after it may or may not be.
		var mu sync.Mutex
		last := before
		working := make(chan struct{})
		scanned := make(chan struct{})
		go func() {
			defer close(scanned)
			sc := bufio.NewScanner(stdout)
			for first := true; sc.Scan(); first = false {
				var g uint64
				if _, err := fmt.Sscanf(sc.Text(), "committed %d", &g); err == nil {
					mu.Lock()
					last = g
					mu.Unlock()
				}
				if first {
					close(working)
				}
			}
		}()
		// Once the writer is in its commit loop, kill it at a random instant:
		// the kill is the fault injected, and any instant must be safe.
		select {
		case <-working:
		case <-scanned:
		}
		delay := time.Duration(rng.IntN(8000)) * time.Microsecond
		kill := time.AfterFunc(delay, func() { _ = cmd.Process.Signal(syscall.SIGKILL) })
		<-scanned
		err = cmd.Wait()
		kill.Stop()
		require.True(t, killedBySIGKILL(err), "round %d: %v", round, err)

		mu.Lock()
		reported := last
		mu.Unlock()
		st := readBack(t, dir)
		require.Contains(t, []uint64{reported, reported + 1}, st.Generation,
			"round %d: last reported commit %d, state generation %d", round, reported, st.Generation)
		checkCrashState(t, st, seedGen)
		require.GreaterOrEqual(t, st.Generation, before)
		if st.Generation > before {
			busy++
		}
		if st.Generation == reported+1 {
			inFlight++
		}
	}
	checkAuditAfterCrashes(t, dir)
	t.Logf("%d writers killed at random instants in their commit loop, %d with a commit in flight that took effect", busy, inFlight)
}

// checkAuditAfterCrashes: once the next writer has appended (which cuts off
// the unfinished line a writer killed inside write(2) may leave, and
// appends the records of the commits whose writer was killed before it
// appended them), every line of the audit log parses, generations only go
// up (a crash never reorders or invents a record), and every committed
// generation has its claim record, none reported lost (the journals still
// held every one the log lacked).
func checkAuditAfterCrashes(t *testing.T, dir string) {
	t.Helper()
	l, err := Open(dir, Options{BootID: testBoot})
	require.NoError(t, err)
	require.NoError(t, l.AppendAudit(context.Background(), AuditRecord{Op: "after-crashes"}))
	recs, err := ReadAudit(filepath.Join(dir, auditName))
	require.NoError(t, err)
	var prev uint64
	claimed := map[uint64]bool{}
	for _, r := range recs {
		require.GreaterOrEqual(t, r.Generation, prev)
		prev = r.Generation
		require.NotEqual(t, OpAuditLost, r.Op, "%s", r.Reason)
		if r.Op == OpClaim {
			claimed[r.Generation] = true
		}
	}
	final := readBack(t, dir).Generation
	require.Equal(t, final, prev, "the last record is of the last commit")
	for g := uint64(1); g <= final; g++ {
		require.True(t, claimed[g], "generation %d (of %d) was committed but the audit log has no claim record of it", g, final)
	}
}
