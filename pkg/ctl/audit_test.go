// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

// follower is a running `audit --follow`.
type follower struct {
	out    *syncBuffer
	exited chan struct{} // closed when Run returned
	code   int           // Run's exit code, valid once exited is closed
	cancel context.CancelFunc
}

// stop interrupts the follower and returns its exit code.
func (fl *follower) stop() int {
	fl.cancel()
	<-fl.exited
	return fl.code
}

// waitFor blocks until cond holds on the output, re-checking after every
// write. The deadline only turns a hang into a failure.
func (fl *follower) waitFor(t *testing.T, cond func(string) bool) {
	t.Helper()
	deadline := time.After(30 * time.Second)
	for !cond(fl.out.String()) {
		select {
		case <-fl.out.Wrote:
		case <-fl.exited:
			t.Fatalf("audit --follow exited early with %d; output:\n%s", fl.code, fl.out.String())
		case <-deadline:
			t.Fatalf("condition not met; output so far:\n%s", fl.out.String())
		}
	}
}

// followAudit starts `audit --follow`; it is stopped when the test ends.
func (f *fixture) followAudit(t *testing.T, args ...string) *follower {
	t.Helper()
	stderr := &syncBuffer{}
	ctx, cancel := context.WithCancel(t.Context())
	fl := &follower{out: &syncBuffer{Wrote: make(chan struct{}, 1)}, exited: make(chan struct{}), cancel: cancel}
	go func() {
		defer close(fl.exited)
		fl.code = Run(ctx, append([]string{"--config", f.config, "audit", "--follow"}, args...), f.env(fl.out, stderr))
	}()
	t.Cleanup(func() {
		fl.stop()
		assert.Empty(t, stderr.String())
	})
	return fl
}

// TestAuditFollow prints the existing records, then new ones as they are
// written, and exits 0 when interrupted.
func TestAuditFollow(t *testing.T) {
	f := newFixture(t)
	f.update(t, now.Add(-time.Hour), func(tx *ledger.Tx) {
		claim(t, tx, ownTrainer, "env", f.dev(t, uuidGPU1))
	})
	fl := f.followAudit(t, "-n", "1")
	fl.waitFor(t, func(s string) bool { return strings.Contains(s, idTrainer[:12]) })
	require.True(t, strings.HasPrefix(fl.out.String(), "TIME"), fl.out.String())

	f.update(t, now, func(tx *ledger.Tx) { tx.Release(idTrainer, "stop") })
	fl.waitFor(t, func(s string) bool { return strings.Contains(s, "release") })
	assert.Equal(t, 1, strings.Count(fl.out.String(), "TIME"), "one header")

	require.Equal(t, ExitOK, fl.stop())
}

// TestAuditFollowRotation: across rotations of audit.log every record is
// printed exactly once, in order.
func TestAuditFollowRotation(t *testing.T) {
	f := newFixture(t)
	// The smallest audit log the configuration allows, so that a few dozen
	// records rotate it several times.
	cfg, err := os.ReadFile(f.config)
	require.NoError(t, err)
	cfgText := strings.Replace(string(cfg), "[ledger]\n", "[ledger]\naudit_max_bytes = 4096\n", 1)
	require.NoError(t, os.WriteFile(f.config, []byte(cfgText), 0o600))

	l, err := ledger.Open(f.dir, ledger.Options{Now: func() time.Time { return now }, BootID: bootID, AuditMaxBytes: 4096})
	require.NoError(t, err)
	cycle := func(pod string) {
		o := owner(fmt.Sprintf("%064x", len(pod))+"", "ns", pod, "c", ledger.FrontEndNRI)
		o.ContainerID = fmt.Sprintf("%064s", pod)
		require.NoError(t, l.Update(t.Context(), func(tx *ledger.Tx) error {
			if _, err := tx.Claim(key(o), o, []devices.Device{f.dev(t, uuidGPU1)}, "env"); err != nil {
				return err
			}
			tx.Release(o.ContainerID, "stop")
			return nil
		}))
	}
	// One record before following starts; once it is printed, the follower
	// has done its first read and every later record arrives as an append.
	cycle("pod-init")
	fl := f.followAudit(t, "-o", "json")
	fl.waitFor(t, func(s string) bool { return strings.Contains(s, "pod-init") })

	const n = 60
	want := make([]string, n)
	for i := range n {
		want[i] = fmt.Sprintf("pod-%02d", i)
		cycle(want[i])
		// One write at a time: the follower sees every rotation between two
		// of its reads (TestAuditFollowerDoubleRotation covers more).
		fl.waitFor(t, func(s string) bool { return strings.Contains(s, `"pod":"`+want[i]+`"`) })
	}
	_, err = os.Stat(f.dir + "/audit.log.1")
	require.NoError(t, err, "the log must have rotated for this test to mean anything")

	pods := func(s string) []string {
		var seen []string
		for _, line := range strings.Split(strings.TrimSpace(s), "\n") {
			if line == "" {
				continue
			}
			var r ledger.AuditRecord
			require.NoError(t, json.Unmarshal([]byte(line), &r), line)
			if r.Op == ledger.OpClaim {
				seen = append(seen, r.Pod)
			}
		}
		return seen
	}
	fl.waitFor(t, func(s string) bool { return strings.Count(s, `"op":"release"`) >= n+1 })
	require.Equal(t, append([]string{"pod-init"}, want...), pods(fl.out.String()))
}

// TestAuditFollowerDoubleRotation: when audit.log rotates twice between two
// polls, the whole middle file is read from audit.log.1 and the rest of the
// first from the open descriptor; nothing is printed twice.
func TestAuditFollowerDoubleRotation(t *testing.T) {
	dir := t.TempDir()
	path := dir + "/audit.log"
	line := func(op string) string {
		return `{"time":"2026-03-01T12:00:00Z","op":"` + op + `","generation":1,"pid":1}` + "\n"
	}
	appendTo := func(p, text string) {
		fh, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
		require.NoError(t, err)
		_, err = fh.WriteString(text)
		require.NoError(t, err)
		require.NoError(t, fh.Close())
	}
	ops := func(recs []ledger.AuditRecord) []string {
		var out []string
		for _, r := range recs {
			out = append(out, r.Op)
		}
		return out
	}
	var warnings []error
	fw := &auditFollower{path: path, warn: func(err error) { warnings = append(warnings, err) }}
	defer fw.close()

	appendTo(path+".1", line("old"))
	appendTo(path, line("a1"))
	recs, err := fw.start()
	require.NoError(t, err)
	assert.Equal(t, []string{"old", "a1"}, ops(recs))

	// A partial line waits for its end.
	appendTo(path, `{"time":"2026-03-01T12:00:00Z","op":"a2",`)
	recs, err = fw.poll()
	require.NoError(t, err)
	assert.Empty(t, recs)
	appendTo(path, `"generation":2,"pid":1}`+"\n")

	// Rotate twice: A → .1, B written, B → .1 (A is gone but still open), C.
	require.NoError(t, os.Rename(path, path+".1"))
	appendTo(path, line("b1")+line("b2"))
	require.NoError(t, os.Rename(path, path+".1"))
	appendTo(path, line("c1"))
	recs, err = fw.poll()
	require.NoError(t, err)
	assert.Equal(t, []string{"a2", "b1", "b2", "c1"}, ops(recs))
	require.Len(t, warnings, 1)

	// A single rotation: the rest of C, then D.
	appendTo(path, line("c2"))
	require.NoError(t, os.Rename(path, path+".1"))
	appendTo(path, line("d1"))
	recs, err = fw.poll()
	require.NoError(t, err)
	assert.Equal(t, []string{"c2", "d1"}, ops(recs))

	// A bad line is reported, the good ones still come.
	appendTo(path, "not json\n"+line("d2"))
	recs, err = fw.poll()
	require.NoError(t, err)
	assert.Equal(t, []string{"d2"}, ops(recs))
	require.Len(t, warnings, 2)
	assert.ErrorContains(t, warnings[1], "line 2")
}

// TestAuditWithoutItsLedger: audit reads a state dir without an audit log
// as status does. Its ledger's files gone after this boot committed there
// (the ledger's boot marker says so): the log went with them, and audit
// exits 1 with LEDGER NEEDS RECOVERY like status, claims, queue and
// explain, with --follow too, instead of an empty log, exit 0. A damaged
// ledger whose log is there is no reason to hide the log: it shows what
// happened. A fresh host's missing [ledger] dir is warned about, as the
// other read commands do. Before, every case printed an empty log or the
// records, exit 0, no word.
func TestAuditWithoutItsLedger(t *testing.T) {
	for _, tc := range []struct {
		name    string
		damage  func(t *testing.T, f *fixture)
		code    int
		stderr  []string
		records bool // the log's records are shown
	}{
		{name: "state dir gone", code: ExitError,
			damage: func(t *testing.T, f *fixture) { require.NoError(t, os.RemoveAll(f.dir)) },
			stderr: []string{"error: LEDGER NEEDS RECOVERY: no audit log in $STATE_DIR: ", "the state files are gone", "sudo gpu-guard-ctl recover"}},
		{name: "state dir emptied", code: ExitError,
			damage: func(t *testing.T, f *fixture) {
				entries, err := os.ReadDir(f.dir)
				require.NoError(t, err)
				for _, e := range entries {
					require.NoError(t, os.Remove(filepath.Join(f.dir, e.Name())))
				}
			},
			stderr: []string{"error: LEDGER NEEDS RECOVERY: no audit log in $STATE_DIR: ", "the state files are gone"}},
		{name: "ledger files gone, audit log kept", code: ExitOK, records: true,
			damage: func(t *testing.T, f *fixture) {
				require.NoError(t, os.Remove(filepath.Join(f.dir, "ledger.json")))
				require.NoError(t, os.Remove(filepath.Join(f.dir, "ledger.journal")))
			}},
		{name: "fresh host, [ledger] dir missing", code: ExitOK,
			damage: func(t *testing.T, f *fixture) { f.setLedgerDir(t, f.dir+"-fresh") },
			stderr: []string{"warning: the ledger directory $STATE_DIR-fresh ([ledger] dir of $CONFIG) does not exist"}},
	} {
		for _, follow := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/follow=%v", tc.name, follow), func(t *testing.T) {
				f := newFixture(t)
				f.populate(t)
				tc.damage(t, f)
				args := []string{"--config", f.config, "audit", "-n", "0"}
				if follow {
					args = append(args, "--follow")
				}
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				stdout, stderr := &syncBuffer{Wrote: make(chan struct{}, 1)}, &syncBuffer{}
				exited, code := make(chan struct{}), 0
				go func() {
					defer close(exited)
					code = Run(ctx, args, f.env(stdout, stderr))
				}()
				if follow && tc.code == ExitOK {
					// It follows: stopped once it has printed the log.
					fl := &follower{out: stdout, exited: exited, cancel: cancel}
					fl.waitFor(t, func(out string) bool { return strings.Contains(out, "REASON") })
					fl.cancel()
				}
				select {
				case <-exited:
				case <-time.After(30 * time.Second): // turns a hang into a failure
					t.Fatalf("audit is still running (following a log that is gone?); output:\n%s", stdout.String())
				}
				require.Equal(t, tc.code, code, "stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
				if len(tc.stderr) == 0 {
					assert.Empty(t, stderr.String())
				}
				for _, want := range tc.stderr {
					assert.Contains(t, f.normalize(stderr.String()), want)
				}
				if tc.records {
					assert.Contains(t, stdout.String(), idTrainer[:12])
				}
				if code != ExitOK {
					assert.Empty(t, stdout.String())
				}
			})
		}
	}
}

// TestAuditWithoutItsLogLooksAtEachFileOnce: audit on a dir without an
// audit log looks for audit.log and its rotation once, then judges the dir
// by the ledger's other files (the warning, the refusal) without looking
// for those two again. Before, ledgerDirOf looked for them a second time.
func TestAuditWithoutItsLogLooksAtEachFileOnce(t *testing.T) {
	for _, tc := range []struct {
		name     string
		stateDir bool // named by --state-dir, not the configuration
		code     int
		stderr   string
	}{
		{name: "[ledger] dir without a ledger", code: ExitOK, stderr: "holds no ledger"},
		{name: "--state-dir without a ledger", stateDir: true, code: ExitError, stderr: "no ledger here"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			empty := filepath.Join(filepath.Dir(f.dir), "not-the-ledger")
			require.NoError(t, os.Mkdir(empty, 0o700))
			args := []string{"audit"}
			if tc.stateDir {
				args = append([]string{"--state-dir", empty}, args...)
			} else {
				f.setLedgerDir(t, empty)
			}
			seen := map[string]int{}
			defer func(was func(string) (os.FileInfo, error)) { lstat = was }(lstat)
			lstat = func(p string) (os.FileInfo, error) {
				seen[p]++
				return os.Lstat(p)
			}
			r := f.run(t, args...)
			require.Equal(t, tc.code, r.code, "stdout:\n%s\nstderr:\n%s", r.stdout, r.stderr)
			assert.Contains(t, r.stderr, tc.stderr)
			require.Equal(t, 1, seen[filepath.Join(empty, "audit.log")], "%v", seen)
			for p, n := range seen {
				assert.Equal(t, 1, n, "%s looked at %d times", p, n)
			}
		})
	}
}
