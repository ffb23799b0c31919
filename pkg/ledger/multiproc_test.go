// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// The devices the racing workers fight over: three GPUs and a MIG instance
// of the third, so that conflicts are not only equality.
var racePool = devs(gpu(0), gpu(1), gpu(2), mig(2, 0))

func raceDevice(uuid string) devices.Device {
	for _, d := range racePool {
		if d.UUID == uuid {
			return d
		}
	}
	panic("unknown device " + uuid)
}

func init() {
	helpers["race-worker"] = raceWorker
	helpers["race-reader"] = raceReader
	helpers["fifo-request"] = fifoRequest
	helpers["fifo-waiter"] = fifoWaiter
}

// raceWorker claims random devices for fresh containers and releases its own
// containers, OPS times, logging every committed claim and release with the
// generation it produced: "claim|release <gen> <container> <uuid,...>".
func raceWorker() int {
	id := envInt("WORKER")
	ops := envInt("OPS")
	l, err := Open(os.Getenv("DIR"), Options{BootID: testBoot, LockTimeout: 2 * time.Minute})
	if err != nil {
		return helperFail("open: %v", err)
	}
	// Half the workers compact at every commit: the lock-free reader and
	// the other writers then meet snapshots and journals replaced under them.
	l.compactAlways = id%2 == 0
	logf, err := os.OpenFile(os.Getenv("LOG"), os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return helperFail("log: %v", err)
	}
	w := bufio.NewWriter(logf)
	defer func() {
		_ = w.Flush()
		_ = logf.Close()
	}()
	rng := rand.New(rand.NewPCG(uint64(id), 99))
	var mine []string // containers of this worker holding something
	busy := 0
	for n := 0; n < ops; n++ {
		ctx := context.Background()
		if len(mine) > 0 && rng.IntN(5) < 3 {
			i := rng.IntN(len(mine))
			ctr := mine[i]
			var gen uint64
			var rel []Claim
			err := l.Update(ctx, func(tx *Tx) error {
				gen = tx.State().Generation + 1
				rel = tx.Release(ctr, "stop")
				return nil
			})
			if err != nil {
				return helperFail("release: %v", err)
			}
			if len(rel) == 0 {
				return helperFail("release of %s found no claim: someone else released it", ctr)
			}
			mine = slices.Delete(mine, i, i+1)
			_, _ = fmt.Fprintf(w, "release %d %s %s\n", gen, ctr, strings.Join(uuids(rel, claimDevice), ","))
			continue
		}
		ctr := fmt.Sprintf("w%d-c%d", id, n)
		want := devs(racePool[rng.IntN(len(racePool))])
		if rng.IntN(4) == 0 {
			want = append(want, racePool[rng.IntN(len(racePool))])
		}
		var gen uint64
		var got []Claim
		err := l.Update(ctx, func(tx *Tx) error {
			gen = tx.State().Generation + 1
			var err error
			got, err = tx.Claim("", owner(ctr), want, "env")
			return err
		})
		if errors.Is(err, ErrBusy) {
			busy++
			continue
		}
		if err != nil {
			return helperFail("claim: %v", err)
		}
		mine = append(mine, ctr)
		_, _ = fmt.Fprintf(w, "claim %d %s %s\n", gen, ctr, strings.Join(uuids(got, claimDevice), ","))
	}
	_, _ = fmt.Fprintf(w, "busy %d\n", busy)
	return 0
}

// raceReader reads the committed state lock-free until STOP exists (and once
// more after), checking that every state it sees verifies, keeps the
// invariants and that generations never go back. It prints "ready" after its
// first read and "reads <n> <distinct generations>" at the end.
func raceReader() int {
	l, err := OpenReadOnly(os.Getenv("DIR"), Options{BootID: testBoot})
	if err != nil {
		return helperFail("open: %v", err)
	}
	stop := os.Getenv("STOP")
	var last uint64
	reads, distinct := 0, 0
	pace := time.NewTicker(200 * time.Microsecond) // leave CPU to the writers
	defer pace.Stop()
	for stopping := false; ; {
		if stopping {
			break
		}
		if _, err := os.Stat(stop); err == nil {
			stopping = true // one last read: the final state
		}
		st, err := l.Snapshot(context.Background())
		if err != nil {
			return helperFail("read %d: %v", reads, err)
		}
		if err := validateState(&st); err != nil {
			return helperFail("generation %d breaks an invariant: %v", st.Generation, err)
		}
		if st.Generation < last {
			return helperFail("generation went back from %d to %d", last, st.Generation)
		}
		if st.Generation != last || reads == 0 {
			distinct++
		}
		last = st.Generation
		reads++
		if reads == 1 {
			fmt.Println("ready")
		}
		<-pace.C
	}
	fmt.Printf("reads %d %d\n", reads, distinct)
	return 0
}

// TestMultiProcessRace races OS processes claiming and releasing over four
// conflicting devices and proves, from the audit log, the workers' own logs,
// a concurrent reader and the final state: no device ever had two holders,
// no update was lost, and the file always parsed.
func TestMultiProcessRace(t *testing.T) {
	workers, ops := 8, 600
	if testing.Short() {
		ops = 150
	}
	dir := t.TempDir()
	l, err := Open(dir, Options{BootID: testBoot, AuditMaxBytes: 1 << 30})
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {}) // creates the lock file

	stop := filepath.Join(t.TempDir(), "stop")
	reader := helperCmd(t, "race-reader", map[string]string{"DIR": dir, "STOP": stop})
	var readerErr strings.Builder
	reader.Stderr = &readerErr
	readerOut, err := reader.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, reader.Start())
	defer func() {
		if reader.ProcessState == nil {
			_ = reader.Process.Kill()
			_ = reader.Wait()
		}
	}()
	readerLines := bufio.NewScanner(readerOut)
	require.True(t, readerLines.Scan(), "reader: %s", readerErr.String())
	require.Equal(t, "ready", readerLines.Text(), "the reader has read the initial state before the workers start")

	logs := make([]string, workers)
	done := make(chan string, workers)
	for i := 0; i < workers; i++ {
		logs[i] = filepath.Join(t.TempDir(), fmt.Sprintf("worker-%d.log", i))
		go func() {
			code, out := runHelper(t, "race-worker", map[string]string{
				"DIR": dir, "WORKER": strconv.Itoa(i), "OPS": strconv.Itoa(ops), "LOG": logs[i],
			})
			if code != 0 {
				done <- fmt.Sprintf("worker %d exited %d: %s", i, code, out)
				return
			}
			done <- ""
		}()
	}
	for i := 0; i < workers; i++ {
		if msg := <-done; msg != "" {
			t.Error(msg)
		}
	}
	require.NoError(t, os.WriteFile(stop, nil, 0o600))
	require.True(t, readerLines.Scan(), "reader: %s", readerErr.String())
	summary := readerLines.Text()
	require.NoError(t, reader.Wait(), "reader: %s", readerErr.String())
	var reads, distinct int
	_, err = fmt.Sscanf(summary, "reads %d %d", &reads, &distinct)
	require.NoError(t, err, summary)
	require.Greater(t, distinct, 1, "the reader read the initial and the final state at least")
	if t.Failed() {
		return
	}

	final := snapshot(t, l)
	recs, err := ReadAudit(l.AuditPath())
	require.NoError(t, err, "every audit line parses")

	// The audit log holds every commit, in order, each by one process, and
	// replaying it never puts two holders on conflicting devices.
	held := map[string]string{} // uuid → container
	type event struct {
		gen       uint64
		op, ctr   string
		devices   string
		seenInLog bool
	}
	var events []*event
	pidOf := map[uint64]int{}
	var prev uint64
	for _, r := range recs {
		require.GreaterOrEqual(t, r.Generation, prev, "audit records are in commit order")
		if r.Generation > prev {
			require.Equal(t, prev+1, r.Generation, "no commit is missing from the audit log")
		}
		prev = r.Generation
		if p, ok := pidOf[r.Generation]; ok {
			require.Equal(t, p, r.Pid, "generation %d was written by two processes: a lost update", r.Generation)
		}
		pidOf[r.Generation] = r.Pid
		switch r.Op {
		case OpClaim:
			for _, u := range r.Devices {
				for hu, hc := range held {
					require.False(t, hc != r.ContainerID && devices.Conflicts(raceDevice(hu), raceDevice(u)),
						"generation %d: %s claimed %s while %s held %s", r.Generation, r.ContainerID, u, hc, hu)
				}
				held[u] = r.ContainerID
			}
		case OpRelease:
			for _, u := range r.Devices {
				require.Equal(t, r.ContainerID, held[u], "generation %d releases a claim it does not hold", r.Generation)
				delete(held, u)
			}
		default:
			t.Fatalf("unexpected audit op %q in a claim/release race", r.Op)
		}
		devsSorted := slices.Clone(r.Devices)
		slices.Sort(devsSorted)
		events = append(events, &event{gen: r.Generation, op: r.Op, ctr: r.ContainerID, devices: strings.Join(devsSorted, ",")})
	}
	require.Equal(t, final.Generation, prev, "the last audit record is the last commit")
	require.Equal(t, held, holders(final), "final state equals the replay of the audit log")

	// Every worker-observed commit is in the audit log at its generation, and
	// the audit log holds nothing the workers did not do.
	byKey := map[string]*event{}
	for _, e := range events {
		byKey[fmt.Sprintf("%s %d %s %s", e.op, e.gen, e.ctr, e.devices)] = e
	}
	logged, busy := 0, 0
	for _, p := range logs {
		b, err := os.ReadFile(p)
		require.NoError(t, err)
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			f := strings.Fields(line)
			if f[0] == "busy" {
				n, _ := strconv.Atoi(f[1])
				busy += n
				continue
			}
			require.Len(t, f, 4, line)
			ds := strings.Split(f[3], ",")
			slices.Sort(ds)
			e := byKey[fmt.Sprintf("%s %s %s %s", f[0], f[1], f[2], strings.Join(ds, ","))]
			require.NotNil(t, e, "worker committed %q but the audit log does not show it", line)
			require.False(t, e.seenInLog, "two workers claim the same commit %q", line)
			e.seenInLog = true
			logged++
		}
	}
	require.Equal(t, len(events), logged, "every audit record is a commit some worker saw succeed")
	t.Logf("%d processes, %d ops, %d commits, %d refused as busy, reader: %d reads of %d generations",
		workers, workers*ops, final.Generation, busy, reads, distinct)
	require.Positive(t, busy, "the race produced contention")
}

// fifoRequest is one attempt of requester KEY for GPU 0: exit 0 admitted
// (and prints "admitted <gen>"), 3 queued (prints "queued <pos> <total>").
func fifoRequest() int {
	l, err := Open(os.Getenv("DIR"), Options{BootID: testBoot, LockTimeout: time.Minute})
	if err != nil {
		return helperFail("open: %v", err)
	}
	key := os.Getenv("KEY")
	var admitted bool
	var gen uint64
	var pos, total int
	err = l.Update(context.Background(), func(tx *Tx) error {
		gen = tx.State().Generation + 1
		admitted, pos, total = claimOrQueue(tx, key, owner("ctr-"+key), devs(gpu(0)))
		return nil
	})
	if err != nil {
		return helperFail("update: %v", err)
	}
	if admitted {
		fmt.Printf("admitted %d\n", gen)
		return 0
	}
	fmt.Printf("queued %d %d\n", pos, total)
	return 3
}

// fifoWaiter retries (as the hook front end does) until admitted, then
// releases at once; it prints the generation of its admission.
func fifoWaiter() int {
	l, err := Open(os.Getenv("DIR"), Options{BootID: testBoot, LockTimeout: time.Minute})
	if err != nil {
		return helperFail("open: %v", err)
	}
	key := os.Getenv("KEY")
	poll := time.NewTicker(2 * time.Millisecond) // the hook's poll_interval
	defer poll.Stop()
	for {
		var admitted bool
		var gen uint64
		err = l.Update(context.Background(), func(tx *Tx) error {
			gen = tx.State().Generation + 1
			admitted, _, _ = claimOrQueue(tx, key, owner("ctr-"+key), devs(gpu(0)))
			return nil
		})
		if err != nil {
			return helperFail("update: %v", err)
		}
		if admitted {
			if err := l.Update(context.Background(), func(tx *Tx) error { tx.Release("ctr-"+key, "done"); return nil }); err != nil {
				return helperFail("release: %v", err)
			}
			fmt.Printf("admitted %d\n", gen)
			return 0
		}
		<-poll.C
	}
}

// TestQueueFIFOAcrossProcesses queues requesters from separate processes and
// checks that the queue order survives between processes: nobody but the
// head gets the released GPU, and concurrent retrying waiters are admitted
// in arrival order.
func TestQueueFIFOAcrossProcesses(t *testing.T) {
	dir := t.TempDir()
	l, err := Open(dir, Options{BootID: testBoot})
	require.NoError(t, err)
	update(t, l, func(tx *Tx) {
		_, err := tx.Claim("", owner("holder"), devs(gpu(0)), "env")
		require.NoError(t, err)
	})
	keys := []string{"k0", "k1", "k2", "k3"}
	for i, k := range keys {
		code, out := runHelper(t, "fifo-request", map[string]string{"DIR": dir, "KEY": k})
		require.Equal(t, 3, code, out)
		require.Equal(t, fmt.Sprintf("queued %d %d\n", i+1, i+1), out)
	}
	update(t, l, func(tx *Tx) { tx.Release("holder", "stop") })
	// Latecomers first: all refused, positions kept.
	for i := len(keys) - 1; i >= 1; i-- {
		code, out := runHelper(t, "fifo-request", map[string]string{"DIR": dir, "KEY": keys[i]})
		require.Equal(t, 3, code, out)
		require.Equal(t, fmt.Sprintf("queued %d %d\n", i+1, len(keys)), out)
	}
	code, out := runHelper(t, "fifo-request", map[string]string{"DIR": dir, "KEY": "newcomer"})
	require.Equal(t, 3, code, out)
	require.Equal(t, "queued 5 5\n", out)
	code, out = runHelper(t, "fifo-request", map[string]string{"DIR": dir, "KEY": "k0"})
	require.Equal(t, 0, code, out)

	// Now k1..k3 and the newcomer retry concurrently while k0 holds GPU 0;
	// started in reverse order, they must be admitted in queue order.
	order := append(slices.Clone(keys[1:]), "newcomer")
	type result struct {
		key string
		gen uint64
		err string
	}
	results := make(chan result, len(order))
	for i := len(order) - 1; i >= 0; i-- {
		k := order[i]
		go func() {
			code, out := runHelper(t, "fifo-waiter", map[string]string{"DIR": dir, "KEY": k})
			var gen uint64
			if _, err := fmt.Sscanf(out, "admitted %d", &gen); code != 0 || err != nil {
				results <- result{key: k, err: fmt.Sprintf("exit %d: %s", code, out)}
				return
			}
			results <- result{key: k, gen: gen}
		}()
	}
	update(t, l, func(tx *Tx) { require.Len(t, tx.Release("ctr-k0", "stop"), 1) })
	var got []result
	for range order {
		r := <-results
		require.Empty(t, r.err, r.key)
		got = append(got, r)
	}
	slices.SortFunc(got, func(a, b result) int { return cmpUint(a.gen, b.gen) })
	var admitted []string
	for _, r := range got {
		admitted = append(admitted, r.key)
	}
	require.Equal(t, order, admitted, "admitted in arrival order")
	st := snapshot(t, l)
	require.Empty(t, st.Waiters)
	require.Empty(t, st.Claims)
}
