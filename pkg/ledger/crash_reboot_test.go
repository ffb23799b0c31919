// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"context"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const nextBoot = "99999999-8888-7777-6666-555555555555"

// thirdBoot is the boot after the one whose first commit a power cut
// stopped (a power cut is a reboot).
const thirdBoot = "33333333-3333-4333-8333-333333333333"

// copyStateDir copies the ledger's files to a new state dir, for a second
// future of the same crash.
func copyStateDir(t *testing.T, dir string) string {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "state")
	require.NoError(t, os.Mkdir(dst, 0o700))
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range ents {
		if e.Type().IsRegular() {
			require.NoError(t, os.WriteFile(filepath.Join(dst, e.Name()), mustRead(t, filepath.Join(dir, e.Name())), 0o600))
		}
	}
	return dst
}

func init() {
	helpers["reboot-writer"] = rebootWriter
}

// rebootWriter is the first writer after a reboot: it opens the ledger with
// BOOT as the boot id and RUNDIR as the (fresh) runtime dir, and commits one
// claim of GPU 2, SIGKILLing itself when the commit reaches STAGE.
func rebootWriter() int {
	stage := os.Getenv("STAGE")
	failpoint = func(s string) {
		if s == stage {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	l, err := Open(os.Getenv("DIR"), Options{BootID: os.Getenv("BOOT"), RuntimeDir: os.Getenv("RUNDIR"), LockTimeout: time.Minute})
	if err != nil {
		return helperFail("open: %v", err)
	}
	err = l.Update(context.Background(), func(tx *Tx) error {
		_, err := tx.Claim("", owner("fresh"), devs(gpu(2)), "env")
		return err
	})
	if err != nil {
		return helperFail("commit: %v", err)
	}
	return helperFail("the commit did not reach stage %q", stage)
}

// The first commit after a reboot starts a new lineage from an empty state
// that keeps only the operator's cordons. Killed at any stage of it, the
// ledger reads as the earlier boot's (empty but for the operator's cordons)
// or the new one (with the commit): never damaged, never without the
// cordon, and the next writer carries on.
func TestCrashInTheFirstCommitAfterAReboot(t *testing.T) {
	for _, s := range []struct {
		stage     string
		committed bool
	}{
		{stageBeforeWrite, false},
		{stageJournalSynced, false},  // the new journal written, not in place
		{stageJournalRotated, false}, // the old one linked aside, still in place
		{stageJournalSwapped, true},  // the new journal in place, next to the earlier boot's snapshot
		{stageSnapWritten, true},     // the snapshot of the empty base being written
		{stageSnapSynced, true},
		{stagePrevLinked, true},  // the earlier boot's snapshot linked to a temp name
		{stageAfterRename, true}, // the new one in place
		{stagePrevKept, true},    // the earlier boot's kept as .prev
		{stageAfterDirSyn, true},
		{stageAfterAudit, true},
	} {
		t.Run(s.stage, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "state")
			bootWithClaimAndCordon(t, dir)

			// The reboot: a new boot id, an empty runtime dir.
			runDir := t.TempDir()
			cmd := helperCmd(t, "reboot-writer", map[string]string{"DIR": dir, "STAGE": s.stage, "BOOT": nextBoot, "RUNDIR": runDir})
			out, err := cmd.CombinedOutput()
			require.True(t, killedBySIGKILL(err), "want SIGKILL, got %v: %s", err, out)

			// Had the kill been a power cut, the next reader is of a third
			// boot: it finds no damage either, discards the second boot's
			// state as an earlier boot's, keeps the operator's cordon, and
			// writes.
			third, run3 := copyStateDir(t, dir), t.TempDir()
			l3, err := Open(third, Options{BootID: thirdBoot, RuntimeDir: run3})
			require.NoError(t, err)
			st3, err := l3.Snapshot(context.Background())
			require.NoError(t, err, "never damaged, in the boot after a power cut either")
			require.Empty(t, holders(st3))
			require.Len(t, st3.Cordons, 1)
			update(t, l3, func(tx *Tx) {
				_, err := tx.Claim("", owner("third"), devs(gpu(3)), "env")
				require.NoError(t, err)
			})
			l3again, err := Open(third, Options{BootID: thirdBoot, RuntimeDir: run3})
			require.NoError(t, err)
			st3 = snapshot(t, l3again)
			require.Equal(t, map[string]string{gpu(3).UUID: "third"}, holders(st3))
			require.Len(t, st3.Cordons, 1)

			l, err := Open(dir, Options{BootID: nextBoot, RuntimeDir: runDir})
			require.NoError(t, err)
			st, err := l.Snapshot(context.Background())
			require.NoError(t, err, "never damaged")
			// What was read is what the files hold: no reader mistakes the
			// earlier boot's snapshot next to a genesis journal for one
			// replaced meanwhile (and reads again, up to 21 times).
			ld, err := l.current()
			require.NoError(t, err)
			require.False(t, l.replacedMeanwhile(&ld))
			want := map[string]string{}
			if s.committed {
				want[gpu(2).UUID] = "fresh"
			}
			require.Equal(t, want, holders(st), "the earlier boot's claims are gone; the commit is in effect or not")
			require.Len(t, st.Cordons, 1, "the operator's cordon outlives the reboot")
			require.Equal(t, gpu(1).UUID, st.Cordons[0].Device.UUID)

			// The next writer carries on from there, cordon kept.
			update(t, l, func(tx *Tx) {
				_, err := tx.Claim("", owner("next"), devs(gpu(3)), "env")
				require.NoError(t, err)
			})
			again, err := Open(dir, Options{BootID: nextBoot, RuntimeDir: runDir})
			require.NoError(t, err)
			st = snapshot(t, again)
			want[gpu(3).UUID] = "next"
			require.Equal(t, want, holders(st))
			require.Len(t, st.Cordons, 1)
			require.Empty(t, tempFiles(t, dir))
		})
	}
}

// bootWithClaimAndCordon opens a ledger in dir for the boot testBoot with
// a claim on GPU 0 and an operator's cordon on GPU 1: the state a reboot
// finds.
func bootWithClaimAndCordon(t *testing.T, dir string) *Ledger {
	t.Helper()
	old, err := Open(dir, Options{BootID: testBoot, RuntimeDir: t.TempDir()})
	require.NoError(t, err)
	update(t, old, func(tx *Tx) {
		_, err := tx.Claim("", owner("old"), devs(gpu(0)), "env")
		require.NoError(t, err)
		_, _, err = tx.Cordon(gpu(1), CordonOperator, "bad fan", "root")
		require.NoError(t, err)
	})
	return old
}
