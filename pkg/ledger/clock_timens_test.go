// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"fmt"
	"math"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The boot clock is shifted per time namespace, the wall clock is not: a
// ledger process in one would read the shift as a step of the wall clock.
// SinceBoot subtracts its namespace's offset.
func TestParseBootOffset(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want time.Duration
		ok   bool
	}{
		{"none", "monotonic 0 0\nboottime 0 0\n", 0, true},
		{"shifted", "monotonic           0         0\nboottime          600         5\n", 600*time.Second + 5, true},
		{"back", "boottime -600 0\n", -600 * time.Second, true},
		{"by clock id", "1 0 0\n7 42 0\n", 42 * time.Second, true},
		{"no boottime line", "monotonic 3 0\n", 0, true},
		{"empty", "", 0, true},
		{"short line", "boottime 600\n", 0, false},
		{"not a number", "boottime x 0\n", 0, false},
		{"nanoseconds out of range", "boottime 1 1000000000\n", 0, false},
		{"seconds past a Duration", "boottime " + strconv.FormatInt(math.MaxInt64, 10) + " 0\n", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := parseBootOffset([]byte(tc.in))
			assert.Equal(t, tc.ok, ok)
			assert.Equal(t, tc.want, got)
		})
	}
}

func init() {
	// Run in a time namespace by TestSinceBootInATimeNamespace.
	helpers["print-since-boot"] = func() int {
		fmt.Println(int64(SinceBoot()))
		return 0
	}
}

// A process in a time namespace whose boot clock is 10 minutes ahead reads
// the host's boot clock through SinceBoot (unshare(1) makes the namespace;
// the test is skipped where the kernel has none or unshare is missing).
func TestSinceBootInATimeNamespace(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("a time namespace needs root")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Skip("no unshare(1)")
	}
	const shift = 600
	helper := helperCmd(t, "print-since-boot", nil)
	cmd := exec.Command(unshare, append([]string{"--time", "--boottime", strconv.Itoa(shift), "--fork", "--"}, helper.Args...)...)
	cmd.Env = helper.Env
	before := SinceBoot()
	out, err := cmd.CombinedOutput()
	after := SinceBoot()
	if err != nil && strings.Contains(string(out), "unshare failed") {
		t.Skipf("no time namespaces here: %s", out)
	}
	require.NoError(t, err, "%s", out)
	inNS, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	require.NoError(t, err, "%s", out)
	require.GreaterOrEqual(t, before, time.Duration(0))
	assert.GreaterOrEqual(t, time.Duration(inNS), before, "the host's boot clock, not the namespace's (%s ahead)", shift*time.Second)
	assert.LessOrEqual(t, time.Duration(inNS), after, "the host's boot clock, not the namespace's (%s ahead)", shift*time.Second)
}

// A boot reading behind the state's anchor of this boot (which this
// boot's clock never gives: a process whose reading is off) tells no step
// and does not replace the anchor, so the next process's reading is judged
// against the anchor the state had: nothing is moved, no drain ends.
func TestABootReadingBehindTheAnchorKeepsIt(t *testing.T) {
	c := newClock()
	dir := t.TempDir()
	ho := testOptions(c)
	ho.DrainGrace = 2 * time.Minute
	host, err := Open(dir, ho)
	require.NoError(t, err)
	behind := ho
	behind.BootClock = func() time.Duration { return c.Boot() - 10*time.Minute }
	off, err := Open(dir, behind)
	require.NoError(t, err)

	require.NoError(t, tryClaim(host, "x", gpu(0)))
	update(t, host, func(tx *Tx) { tx.MarkDraining("x", "stopped") })
	anchor := snapshot(t, host).Clock
	c.Advance(time.Second)
	require.NoError(t, tryClaim(off, "other", gpu(5)))
	assert.Equal(t, anchor, snapshot(t, host).Clock, "the anchor stays")
	c.Advance(time.Second)
	require.NoError(t, tryClaim(host, "other2", gpu(6)))
	c.Advance(time.Second)
	assert.True(t, isBusy(tryClaim(host, "y", gpu(0))), "3 s into a 2 m drain grace")
	assert.Empty(t, recordsOf(auditRecords(t, host), OpClockStep))
}

// A process off the CPU for longer than half the step tolerance between
// its boot clock readings, in every try, takes no boot reading: the wall
// reading between them may be that far from their midpoint.
func TestAClockReadAcrossALongStallIsNoReading(t *testing.T) {
	c := newClock()
	o := testOptions(c)
	var calls time.Duration
	o.BootClock = func() time.Duration { calls++; return c.Boot() + calls*clockStepTolerance }
	l, err := Open(t.TempDir(), o)
	require.NoError(t, err)
	_, boot := l.clock()
	assert.Equal(t, time.Duration(-1), boot)
	assert.Equal(t, time.Duration(6), calls, "three tries")

	calls = 0
	o.BootClock = func() time.Duration { calls++; return c.Boot() + calls*clockReadGap/2 }
	l, err = Open(t.TempDir(), o)
	require.NoError(t, err)
	calls = 0
	_, boot = l.clock()
	assert.Equal(t, c.Boot()+clockReadGap*3/4, boot, "the midpoint of the first pair, close enough")
}
