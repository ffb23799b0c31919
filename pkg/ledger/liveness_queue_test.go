// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// The queue's liveness, checked on many random schedules of requests for
// full GPUs and MIG instances of the same GPUs, run on a fake clock against
// the real queue mechanics (Tx, maintain) with the default TTLs. Requesters
// retry like the kubelet (10 s, doubling, capped at 5 min) until admitted,
// run for a while and stop; some give up. After every event the run checks:
//
//	(a) safety: no two containers hold conflicting devices, and every
//	    admitted requester holds exactly what it asked for;
//	(b) liveness: a requester that keeps retrying is refused only while one
//	    of its devices had a holder, or a reservation for another waiter
//	    (or lost a reservation nobody used), within the last maxBackoff
//	    (reservation_ttl when some requesters stop retrying silently), and
//	    every one is admitted in the end;
//	(c) no idle GPU for a waiter that could take it, and no part held for
//	    a waiter that cannot start but for the head of the queue: only the
//	    head holds part of its request, and it has every free device it
//	    asks for; a waiter whose devices are all free has them reserved;
//	(d) no overtaking: while a waiter heads the queue, nobody else is
//	    admitted on a device conflicting with one it asks for, unless that
//	    was reserved for them before (a MIG instance of a GPU the head asks
//	    for whole included, while another instance of it is in use).
//
// The state is carried in memory from one Tx to the next (no file, no
// fsync), which is what makes 10,000 schedules affordable; pkg/guard runs
// fewer schedules through the real Admit on a real ledger.

const (
	simMinBackoff = 10 * time.Second
	simMaxBackoff = 5 * time.Minute
)

// simHolder runs on devs from the start until until.
type simHolder struct {
	id    string
	devs  []devices.Device
	until time.Duration
}

// simReq is one requester: it first asks at arrive, retries with back-off
// until admitted, then runs for hold and stops. giveUp > 0: it stops
// retrying after that many refusals, withdrawn (its pod removal reaches the
// queue) or silently (it just never comes back).
type simReq struct {
	key      string
	want     []devices.Device
	arrive   time.Duration
	hold     time.Duration
	giveUp   int
	withdraw bool
}

type simSchedule struct {
	name    string
	holders []simHolder
	reqs    []simReq
}

// simOutcome is what happened to each requester.
type simOutcome struct {
	admittedAt []time.Duration // -1: never
	refusals   []int
	events     int
}

type simEvent struct {
	at   time.Duration
	seq  int
	kind int // simAttempt, simStop, simHolderStop
	i    int
}

const (
	simAttempt = iota
	simStop
	simHolderStop
)

type simEvents []simEvent

func (h simEvents) Len() int { return len(h) }
func (h simEvents) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h simEvents) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *simEvents) Push(x any)   { *h = append(*h, x.(simEvent)) }
func (h *simEvents) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// memLedger runs Tx on a state kept in memory, with the queue mechanics
// before and after fn as Update runs them.
type memLedger struct {
	l  *Ledger
	st State
}

func newMemLedger() *memLedger {
	return &memLedger{l: &Ledger{opts: Options{ReservationTTL: DefaultReservationTTL, QueueTTL: DefaultQueueTTL}}}
}

func (m *memLedger) update(now time.Time, fn func(tx *Tx)) {
	tx := newTx(m.l, m.st, now, -1) // no boot clock: no step of the wall clock to tell
	tx.maintain()
	fn(tx)
	tx.maintain()
	m.st = tx.st
	tx.close()
}

// simTrace, when set, receives every event and the state after it.
var simTrace func(string)

// runSchedule plays s and returns an error describing the first violation.
func runSchedule(s simSchedule) (simOutcome, error) {
	base := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	m := newMemLedger()
	out := simOutcome{admittedAt: make([]time.Duration, len(s.reqs)), refusals: make([]int, len(s.reqs))}
	for i := range out.admittedAt {
		out.admittedAt[i] = -1
	}
	var evs simEvents
	seq := 0
	push := func(at time.Duration, kind, i int) {
		seq++
		heap.Push(&evs, simEvent{at: at, seq: seq, kind: kind, i: i})
	}
	m.update(base, func(tx *Tx) {
		for i, h := range s.holders {
			if _, err := tx.Claim("", Owner{ContainerID: h.id, FrontEnd: FrontEndNRI}, h.devs, "env"); err != nil {
				panic(fmt.Sprintf("schedule %s: initial holder %s: %v", s.name, h.id, err))
			}
			push(h.until, simHolderStop, i)
		}
	})
	for i, r := range s.reqs {
		push(r.arrive, simAttempt, i)
	}

	// bound: how long a device must have been left alone (no holder, no
	// reservation dropped unused) before a retrying waiter for it must be
	// admitted. A reservation is used at its waiter's next retry, within
	// maxBackoff; one whose waiter stopped retrying lasts reservation_ttl.
	bound := simMaxBackoff
	for _, r := range s.reqs {
		if r.giveUp > 0 && !r.withdraw {
			bound = DefaultReservationTTL
		}
	}
	bound += time.Second

	// Every device any request or holder names, and the full GPU of every
	// MIG instance: lastBusy is when each last had a conflicting holder or
	// lost a conflicting reservation that was not used.
	var universe []devices.Device
	addDev := func(d devices.Device) {
		if !slices.ContainsFunc(universe, func(u devices.Device) bool { return u.UUID == d.UUID }) {
			universe = append(universe, d)
		}
	}
	for _, h := range s.holders {
		for _, d := range h.devs {
			addDev(d)
		}
	}
	for _, r := range s.reqs {
		for _, d := range r.want {
			addDev(d)
		}
	}
	lastBusy := map[string]time.Duration{}
	// lastReserved: when each device last had a conflicting reservation,
	// by the waiter it was for (the head's reservations may stand for long:
	// for everyone else they keep the device busy).
	lastReserved := map[string]map[string]time.Duration{}
	markHeld := func(at time.Duration) {
		for _, u := range universe {
			for _, c := range m.st.Claims {
				if devices.Conflicts(c.Device, u) {
					lastBusy[u.UUID] = at
				}
			}
			for _, r := range m.st.Reservations {
				if devices.Conflicts(r.Device, u) {
					if lastReserved[u.UUID] == nil {
						lastReserved[u.UUID] = map[string]time.Duration{}
					}
					lastReserved[u.UUID][r.For] = at
				}
			}
			// What the head waits for is kept for it like a
			// reservation (a MIG instance of a GPU it asks for whole).
			head := expectedHead(&m.st)
			for _, k := range headWaitsFor(&m.st, head) {
				if devices.Conflicts(k, u) {
					if lastReserved[u.UUID] == nil {
						lastReserved[u.UUID] = map[string]time.Duration{}
					}
					lastReserved[u.UUID][head] = at
				}
			}
		}
	}
	waitingSince := make([]time.Duration, len(s.reqs))
	for i := range waitingSince {
		waitingSince[i] = -1
	}
	backoff := make([]time.Duration, len(s.reqs))
	ids := make([]string, len(s.reqs))
	gone := make([]bool, len(s.reqs))

	const horizon = 72 * time.Hour
	for evs.Len() > 0 {
		e := heap.Pop(&evs).(simEvent)
		if e.at > horizon {
			break
		}
		out.events++
		now := base.Add(e.at)
		markHeld(e.at) // a holder stopping now held its devices until now
		before := slices.Clone(m.st.Reservations)
		head := expectedHead(&m.st)
		var headWants []devices.Device
		if i := slices.IndexFunc(m.st.Waiters, func(w Waiter) bool { return w.Key == head }); i >= 0 {
			headWants = m.st.Waiters[i].Devices
		}
		admitted, refused := "", -1
		switch e.kind {
		case simHolderStop:
			m.update(now, func(tx *Tx) { tx.Release(s.holders[e.i].id, "stop") })
		case simStop:
			m.update(now, func(tx *Tx) { tx.Release(ids[e.i], "stop") })
		case simAttempt:
			r := &s.reqs[e.i]
			attempt := out.refusals[e.i] + 1
			ids[e.i] = fmt.Sprintf("%s-try-%d", r.key, attempt)
			o := Owner{ContainerID: ids[e.i], Namespace: "ns", Pod: r.key, PodUID: "uid-" + r.key, Container: "main", FrontEnd: FrontEndNRI}
			var ok bool
			m.update(now, func(tx *Tx) {
				if len(tx.Busy(r.key, o, r.want)) == 0 {
					_, err := tx.Claim(r.key, o, r.want, "env")
					ok = err == nil
				}
				if !ok {
					tx.Enqueue(r.key, o, r.want)
				}
			})
			if ok {
				if err := checkNoOvertaking(&m.st, head, headWants, r, before); err != nil {
					return out, fmt.Errorf("schedule %s at %s: (d) %w: %s", s.name, e.at, err, describeQueue(&m.st))
				}
				out.admittedAt[e.i] = e.at
				admitted = r.key
				push(e.at+r.hold, simStop, e.i)
				break
			}
			out.refusals[e.i]++
			if waitingSince[e.i] < 0 {
				waitingSince[e.i] = e.at
			}
			refused = e.i
			if r.giveUp > 0 && out.refusals[e.i] >= r.giveUp {
				gone[e.i] = true
				if r.withdraw {
					m.update(now, func(tx *Tx) { tx.DropWaiter(r.key, "pod removed while waiting") })
				}
				break
			}
			backoff[e.i] = min(max(2*backoff[e.i], simMinBackoff), simMaxBackoff)
			push(e.at+backoff[e.i], simAttempt, e.i)
		}

		// lastBusy: holders now, and reservations gone without being used.
		markHeld(e.at)
		for _, r := range before {
			if r.For == admitted || slices.ContainsFunc(m.st.Reservations, func(x Reservation) bool { return x.Device.UUID == r.Device.UUID && x.For == r.For }) {
				continue
			}
			for _, u := range universe {
				if devices.Conflicts(r.Device, u) {
					lastBusy[u.UUID] = e.at
				}
			}
		}
		// (b): a persistent waiter, waiting for at least bound, whose
		// devices were all left alone for bound (this event included), is
		// not refused.
		if refused >= 0 {
			r := &s.reqs[refused]
			if r.giveUp == 0 && e.at-waitingSince[refused] >= bound {
				calm := true
				for _, d := range r.want {
					if t, seen := lastBusy[d.UUID]; seen && e.at-t < bound {
						calm = false
					}
					for key, t := range lastReserved[d.UUID] {
						if key != r.key && e.at-t < bound {
							calm = false
						}
					}
				}
				if calm {
					return out, fmt.Errorf("schedule %s: %s refused at %s (attempt %d) although nobody held any of %s for %s: %s",
						s.name, r.key, e.at, out.refusals[refused], devNames(r.want), bound, describeQueue(&m.st))
				}
			}
		}
		if simTrace != nil {
			simTrace(fmt.Sprintf("%s kind=%d i=%d: %s", e.at, e.kind, e.i, describeQueue(&m.st)))
		}
		if err := checkSimState(&m.st, s, out.admittedAt, ids, e.at); err != nil {
			return out, fmt.Errorf("schedule %s at %s: %w: %s", s.name, e.at, err, describeQueue(&m.st))
		}
	}
	for i, r := range s.reqs {
		if r.giveUp == 0 && out.admittedAt[i] < 0 {
			return out, fmt.Errorf("schedule %s: %s (%s) never admitted in %s after %d refusals: %s",
				s.name, r.key, devNames(r.want), horizon, out.refusals[i], describeQueue(&m.st))
		}
	}
	return out, nil
}

// checkSimState checks (a) and (c) on a state.
func checkSimState(st *State, s simSchedule, admittedAt []time.Duration, ids []string, now time.Duration) error {
	// (a) safety.
	for i := range st.Claims {
		for j := i + 1; j < len(st.Claims); j++ {
			a, b := st.Claims[i], st.Claims[j]
			if a.Owner.ContainerID != b.Owner.ContainerID && devices.Conflicts(a.Device, b.Device) {
				return fmt.Errorf("(a) %s holds %s and %s holds %s", a.Owner.ContainerID, a.Device.Index, b.Owner.ContainerID, b.Device.Index)
			}
		}
	}
	for i, r := range s.reqs {
		if admittedAt[i] < 0 || now >= admittedAt[i]+r.hold {
			continue
		}
		for _, d := range r.want {
			if k, ok := slices.BinarySearchFunc(st.Claims, d.UUID, func(c Claim, u string) int { return strings.Compare(c.Device.UUID, u) }); !ok || st.Claims[k].Owner.ContainerID != ids[i] {
				return fmt.Errorf("(a) admitted %s does not hold %s", r.key, d.Index)
			}
		}
	}
	// (c) reservations are for waiters; only the head holds part of its
	// request, and has every free device it asks for; a waiter whose
	// devices are all free has them reserved.
	for _, r := range st.Reservations {
		if !slices.ContainsFunc(st.Waiters, func(w Waiter) bool { return w.Key == r.For }) {
			return fmt.Errorf("(c) %s reserved for %s, who does not wait", r.Device.Index, r.For)
		}
	}
	if err := checkReservations(st); err != nil {
		return fmt.Errorf("(c) %w", err)
	}
	return nil
}

// checkNoOvertaking checks (d) for r, just admitted into st; head, asking
// for want, headed the queue before, when reservations were before. A head
// that left the queue in the meantime (it stopped retrying and expired) is
// no longer owed anything.
func checkNoOvertaking(st *State, head string, want []devices.Device, r *simReq, before []Reservation) error {
	if head == "" || head == r.key || !slices.ContainsFunc(st.Waiters, func(w Waiter) bool { return w.Key == head }) {
		return nil
	}
	for _, d := range r.want {
		if slices.ContainsFunc(before, func(x Reservation) bool { return x.For == r.key && x.Device.UUID == d.UUID }) {
			continue
		}
		for _, h := range want {
			if !devices.Conflicts(d, h) {
				continue
			}
			return fmt.Errorf("%s admitted on %s while %s, the head of the queue, asks for %s", r.key, d.Index, head, h.Index)
		}
	}
	return nil
}

func devNames(ds []devices.Device) string {
	var b strings.Builder
	for i, d := range ds {
		if i > 0 {
			b.WriteString(",")
		}
		b.WriteString(d.Index)
	}
	return b.String()
}

func describeQueue(st *State) string {
	var b strings.Builder
	b.WriteString("claims [")
	for _, c := range st.Claims {
		fmt.Fprintf(&b, " %s:%s", c.Device.Index, c.Owner.ContainerID)
	}
	b.WriteString(" ] waiters [")
	for _, w := range st.Waiters {
		fmt.Fprintf(&b, " %s(#%d)=%s", w.Key, w.Seq, devNames(w.Devices))
	}
	b.WriteString(" ] reservations [")
	for _, r := range st.Reservations {
		fmt.Fprintf(&b, " %s:%s", r.Device.Index, r.For)
	}
	b.WriteString(" ]")
	return b.String()
}

// migDeadlockSchedule is the case that deadlocked partial reservations: X
// holds MIG instance 4:1, Y holds GPU 1; A asks for GPU 4 and GPU 1, then B
// for 4:0 and GPU 1. X stops after 10 minutes, Y after 20; newcomers ask for
// 4:0 alone: N after 15 minutes (GPU 4 idle, A and B unable to start), C
// after 25.
func migDeadlockSchedule() simSchedule {
	return simSchedule{
		name: "mig-deadlock",
		holders: []simHolder{
			{id: "X", devs: devs(mig(4, 1)), until: 10 * time.Minute},
			{id: "Y", devs: devs(gpu(1)), until: 20 * time.Minute},
		},
		reqs: []simReq{
			{key: "A", want: devs(gpu(4), gpu(1)), arrive: 0, hold: 30 * time.Minute},
			{key: "B", want: devs(mig(4, 0), gpu(1)), arrive: time.Second, hold: 30 * time.Minute},
			{key: "C", want: devs(mig(4, 0)), arrive: 25 * time.Minute, hold: 10 * time.Minute},
			{key: "N", want: devs(mig(4, 0)), arrive: 15 * time.Minute, hold: 2 * time.Minute},
		},
	}
}

// randomSchedule draws 2 or 3 GPUs (each partitioned into two MIG instances
// with probability 1/2, both the full GPU and its instances then being asked
// for), up to 2 holders at the start and 2 to 7 requesters for one or two
// devices, arriving within 20 minutes and running up to 40; one in five
// gives up after a few refusals.
func randomSchedule(seed uint64) simSchedule {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	var pool []devices.Device
	for g := range 2 + rng.IntN(2) {
		pool = append(pool, gpu(g))
		if rng.IntN(2) == 0 {
			pool = append(pool, mig(g, 0), mig(g, 1))
		}
	}
	pick := func() []devices.Device {
		a := pool[rng.IntN(len(pool))]
		if rng.IntN(5) < 3 {
			return devs(a)
		}
		for range 8 {
			if b := pool[rng.IntN(len(pool))]; !devices.Conflicts(a, b) {
				return devs(a, b)
			}
		}
		return devs(a)
	}
	s := simSchedule{name: fmt.Sprintf("seed-%d", seed)}
	for i := range rng.IntN(3) {
		d := pick()
		if slices.ContainsFunc(s.holders, func(h simHolder) bool { return anyConflict(h.devs, d) }) {
			continue
		}
		s.holders = append(s.holders, simHolder{id: fmt.Sprintf("H%d", i), devs: d, until: time.Duration(1+rng.IntN(60)) * time.Minute})
	}
	for i := range 2 + rng.IntN(6) {
		r := simReq{
			key:    fmt.Sprintf("R%d", i),
			want:   pick(),
			arrive: time.Duration(rng.IntN(20*60)) * time.Second,
			hold:   time.Duration(30+rng.IntN(40*60)) * time.Second,
		}
		if rng.IntN(5) == 0 {
			r.giveUp, r.withdraw = 1+rng.IntN(6), rng.IntN(2) == 0
		}
		s.reqs = append(s.reqs, r)
	}
	return s
}

// TestQueueLiveness plays the fixed schedules, then the random ones.
func TestQueueLiveness(t *testing.T) {
	t.Run("mig-deadlock", testQueueLivenessMIGDeadlock)
	t.Run("starvation", testQueueLivenessStarvation)
	t.Run("random", testQueueLivenessRandomSchedules)
}

func testQueueLivenessMIGDeadlock(t *testing.T) {
	s := migDeadlockSchedule()
	out, err := runSchedule(s)
	if err != nil {
		t.Fatal(err)
	}
	// A is admitted at its first retry once both of its GPUs are free (Y
	// stops at 20m; A retries every 5 minutes by then).
	if at := out.admittedAt[0]; at < 20*time.Minute || at > 20*time.Minute+simMaxBackoff {
		t.Fatalf("A admitted at %s, want within %s of 20m0s", at, simMaxBackoff)
	}
	// N, a newcomer for 4:0, does not overtake A, the head of the queue:
	// GPU 4 is kept for A from 10m, when X stopped. Nor does it overtake B,
	// which waits for 4:0 since before: B is admitted once A's GPUs are
	// free, then N, then C.
	a, b, c, n := out.admittedAt[0], out.admittedAt[1], out.admittedAt[2], out.admittedAt[3]
	if b < a+30*time.Minute {
		t.Fatalf("B admitted at %s while A held GPU 1 (A admitted at %s)", b, a)
	}
	if n < b+30*time.Minute || c < n+2*time.Minute {
		t.Fatalf("admitted A %s, B %s, N %s, C %s: want N after B's 30 minutes on 4:0, C after N's 2", a, b, n, c)
	}
}

// starvationSchedule is what all or nothing reservations alone let starve:
// A asks for GPUs 0 and 1, held by H0 and H1 until 10 and 20 minutes, and
// newcomers for GPU 0 or GPU 1 alone arrive in turn, each before the last
// one stops, so that GPUs 0 and 1 are never free together unless one is
// kept for A.
func starvationSchedule() simSchedule {
	s := simSchedule{
		name: "starvation",
		holders: []simHolder{
			{id: "H0", devs: devs(gpu(0)), until: 10 * time.Minute},
			{id: "H1", devs: devs(gpu(1)), until: 20 * time.Minute},
		},
		reqs: []simReq{{key: "A", want: devs(gpu(0), gpu(1)), arrive: 0, hold: 10 * time.Minute}},
	}
	for i := range 12 {
		s.reqs = append(s.reqs, simReq{
			key: fmt.Sprintf("S%d", i), want: devs(gpu(i % 2)),
			arrive: time.Duration(5+10*i) * time.Minute, hold: 20 * time.Minute,
		})
	}
	return s
}

func testQueueLivenessStarvation(t *testing.T) {
	out, err := runSchedule(starvationSchedule())
	if err != nil {
		t.Fatal(err)
	}
	// GPU 0 is kept for A from 10m; GPU 1 frees at 20m: A starts at its
	// next retry, before any newcomer.
	a := out.admittedAt[0]
	if a < 20*time.Minute || a > 20*time.Minute+simMaxBackoff {
		t.Fatalf("A admitted at %s, want within %s of 20m0s", a, simMaxBackoff)
	}
	for i, at := range out.admittedAt[1:] {
		if at < a {
			t.Fatalf("S%d admitted at %s, before A (%s)", i, at, a)
		}
	}
}

func testQueueLivenessRandomSchedules(t *testing.T) {
	n := 10000
	if testing.Short() {
		n = 2000
	}
	var events, maxRefusals, admitted int
	for seed := range uint64(n) {
		out, err := runSchedule(randomSchedule(seed))
		if err != nil {
			t.Fatalf("%v\n(replay: runSchedule(randomSchedule(%d)))", err, seed)
		}
		events += out.events
		for i, r := range out.refusals {
			maxRefusals = max(maxRefusals, r)
			if out.admittedAt[i] >= 0 {
				admitted++
			}
		}
	}
	t.Logf("%d schedules, %d events, %d admissions, at most %d refusals for one requester", n, events, admitted, maxRefusals)
}

// A ledger written before reservations were all or nothing may hold the
// deadlock itself: the first Update after the upgrade undoes it and gives
// A, the earlier waiter, both GPUs.
func TestPartialReservationsOfAnOlderVersionAreUndone(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	m := newMemLedger()
	m.st = State{
		Waiters: []Waiter{
			{Key: "A", Seq: 1, Devices: devs(gpu(4), gpu(1)), Owner: owner("a"), FirstSeen: now, LastSeen: now},
			{Key: "B", Seq: 2, Devices: devs(mig(4, 0), gpu(1)), Owner: owner("b"), FirstSeen: now, LastSeen: now},
		},
		Reservations: []Reservation{
			{Device: gpu(1), For: "A", Since: now, Until: now.Add(6 * time.Minute)},
			{Device: mig(4, 0), For: "B", Since: now, Until: now.Add(6 * time.Minute)},
		},
		NextSeq: 3,
	}
	var busyA, busyB int
	m.update(now.Add(time.Minute), func(tx *Tx) {
		busyA = len(tx.Busy("A", owner("a"), devs(gpu(4), gpu(1))))
		busyB = len(tx.Busy("B", owner("b"), devs(mig(4, 0), gpu(1))))
	})
	if busyA != 0 || busyB == 0 {
		t.Fatalf("A busy on %d devices, B on %d; want A free, B busy: %s", busyA, busyB, describeQueue(&m.st))
	}
	if got := reservedFor(m.st); len(got) != 2 || got[gpu(4).UUID] != "A" || got[gpu(1).UUID] != "A" {
		t.Fatalf("reservations %v, want GPUs 4 and 1 for A", got)
	}
}

// A waiter whose retry asks for a held device keeps, as the head of the
// queue, the reservations it still asks for; once a later waiter is the
// head instead, what it cannot use whole passes on.
func TestChangedRequestDropsItsReservations(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	m := newMemLedger()
	m.update(now, func(tx *Tx) {
		if _, err := tx.Claim("", owner("h"), devs(gpu(2)), "env"); err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Claim("", owner("h0"), devs(gpu(0)), "env"); err != nil {
			t.Fatal(err)
		}
		tx.Enqueue("A", owner("a"), devs(gpu(0)))
		tx.Enqueue("B", owner("b"), devs(gpu(0)))
		tx.Release("h0", "stop")
	})
	if got := reservedFor(m.st); got[gpu(0).UUID] != "A" {
		t.Fatalf("reservations %v, want GPU 0 for A", got)
	}
	m.update(now.Add(time.Minute), func(tx *Tx) {
		tx.Enqueue("A", owner("a"), devs(gpu(0), gpu(2))) // GPU 2 is held
	})
	if got := reservedFor(m.st); len(got) != 1 || got[gpu(0).UUID] != "A" {
		t.Fatalf("reservations %v, want GPU 0 for A, the head: %s", got, describeQueue(&m.st))
	}
	var pos int
	m.update(now.Add(time.Minute), func(tx *Tx) { pos, _, _ = tx.Position("A") })
	if pos != 1 {
		t.Fatalf("A at position %d, want 1: it keeps its place", pos)
	}
	// An earlier waiter E, complete, loses GPU 3 to a container found
	// running on it: E heads the queue now, and A's partial reservation
	// goes to nobody else but is dropped (one partial holder at a time).
	m = newMemLedger()
	var rec []AuditRecord
	m.update(now, func(tx *Tx) {
		if _, err := tx.Claim("", owner("h"), devs(gpu(2)), "env"); err != nil {
			t.Fatal(err)
		}
		tx.Enqueue("E", owner("e"), devs(gpu(3)))
		tx.Enqueue("A", owner("a"), devs(gpu(0), gpu(2)))
	})
	if got := reservedFor(m.st); len(got) != 2 || got[gpu(3).UUID] != "E" || got[gpu(0).UUID] != "A" {
		t.Fatalf("reservations %v, want GPU 3 for E (can start) and GPU 0 for A (the head): %s", got, describeQueue(&m.st))
	}
	m.update(now.Add(time.Minute), func(tx *Tx) {
		tx.dropReservationsOn(gpu(3), "in use by a running container")
		tx.insertClaim(Claim{Device: gpu(3), Owner: owner("found"), Source: "reconcile", Since: tx.now})
		tx.touch()
		tx.maintain()
		rec = tx.audit
	})
	if got := reservedFor(m.st); len(got) != 0 {
		t.Fatalf("reservations %v, want none: E (the head) waits for GPU 3, A is not the head: %s", got, describeQueue(&m.st))
	}
	if !slices.ContainsFunc(rec, func(r AuditRecord) bool { return r.Op == OpUnreserve && r.Key == "A" }) {
		t.Fatalf("no unreserve record for A: %+v", rec)
	}
}
