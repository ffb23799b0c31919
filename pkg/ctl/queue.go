// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ctl

import (
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/ledger"
)

func (a *app) queueCommand() *cobra.Command {
	return newCommand("queue",
		"List the requests waiting for a GPU, in FIFO order",
		`List one row per waiting request, oldest first: its position in the queue of
the devices it wants ("2 of 3": one request ahead of it, one behind), the
requester (namespace/pod/container), the devices, how long it has waited and
when it last retried. RESERVED shows devices that were released and are held
for it until it retries (policy reservation_ttl).

Waiters that stop retrying leave the queue after policy queue_ttl; they are
not shown once expired.`,
		`  gpu-guard-ctl queue
  gpu-guard-ctl queue -o wide
  gpu-guard-ctl queue -o json | jq '.waiters[] | select(.waited_seconds > 600)'`,
		noArgs,
		func(cmd *cobra.Command, _ []string) error {
			defer pauseGC()()
			var v queueView
			now := a.env.Now()
			err := a.view(cmd.Context(), func(tx *ledger.Tx) error {
				v = buildQueue(tx, now)
				return nil
			})
			if err != nil {
				return err
			}
			if err := a.checkLedgerDir(); err != nil {
				return err
			}
			return v.render(a.env.Stdout, a.output, now)
		})
}

// queueView is the queue output; its JSON is a public interface.
type queueView struct {
	Waiters []waiterJSON `json:"waiters"`
}

type waiterJSON struct {
	// Position is 1 for the request served first among those that want any
	// of the same devices; QueueLength counts them all.
	Position    int `json:"position"`
	QueueLength int `json:"queue_length"`
	// Requester is the stable requester key ("namespace/pod-uid/container"
	// for CRI containers, the container id for hook requests).
	Requester   string `json:"requester"`
	ContainerID string `json:"container_id"`
	Namespace   string `json:"namespace"`
	Pod         string `json:"pod"`
	PodUID      string `json:"pod_uid"`
	Container   string `json:"container"`
	// FrontEnd is nri, hook or ctl: a hook request's pod names are its
	// own annotations, unverified.
	FrontEnd      string    `json:"front_end"`
	Devices       []string  `json:"devices"`
	FirstSeen     time.Time `json:"first_seen"`
	LastSeen      time.Time `json:"last_seen"`
	WaitedSeconds int64     `json:"waited_seconds"`
	// Reserved are the wanted devices already reserved for this request.
	Reserved []string `json:"reserved"`

	indices         []string
	reservedIndices []string
	reservedUntil   time.Time
}

// buildQueue lists the waiters with their positions as the ledger computes
// them for refusal messages.
func buildQueue(tx *ledger.Tx, now time.Time) queueView {
	// Only read, within the View: no copy of the state
	// (TestReadersLeaveTheStateAsRead).
	st := tx.ReadState()
	reserved := map[string][]ledger.Reservation{}
	for _, r := range st.Reservations {
		reserved[r.For] = append(reserved[r.For], r)
	}
	v := queueView{Waiters: make([]waiterJSON, 0, len(st.Waiters))}
	places := tx.Positions() // one pass: Position per waiter would be quadratic
	for _, w := range st.Waiters {
		pos, total := places[w.Key].Position, places[w.Key].Total
		wj := waiterJSON{
			Position: pos, QueueLength: total, Requester: w.Key,
			ContainerID: w.Owner.ContainerID, Namespace: w.Owner.Namespace, Pod: w.Owner.Pod,
			PodUID: w.Owner.PodUID, Container: w.Owner.Container,
			Devices:   make([]string, len(w.Devices)),
			indices:   make([]string, len(w.Devices)),
			FirstSeen: w.FirstSeen, LastSeen: w.LastSeen,
			WaitedSeconds: int64(now.Sub(w.FirstSeen) / time.Second),
			Reserved:      []string{},
			FrontEnd:      string(w.Owner.FrontEnd),
		}
		for i, d := range w.Devices {
			wj.Devices[i], wj.indices[i] = d.UUID, d.Index
		}
		for _, r := range reserved[w.Key] {
			wj.Reserved = append(wj.Reserved, r.Device.UUID)
			wj.reservedIndices = append(wj.reservedIndices, r.Device.Index)
			if wj.reservedUntil.IsZero() || r.Until.Before(wj.reservedUntil) {
				wj.reservedUntil = r.Until
			}
		}
		v.Waiters = append(v.Waiters, wj)
	}
	return v
}

func (v queueView) render(w io.Writer, output string, now time.Time) error {
	if output == outputJSON {
		return writeQueueJSON(w, &v)
	}
	wide := output == outputWide
	header := []string{"POSITION", "REQUESTER", "DEVICES", "WAITED", "LAST SEEN", "RESERVED"}
	if wide {
		header = []string{"POSITION", "REQUESTER", "KEY", "CONTAINER ID", "DEVICES", "WAITED", "LAST SEEN", "RESERVED"}
	}
	t := newTable(w, header...)
	for _, wj := range v.Waiters {
		pos := fmt.Sprintf("%d of %d", wj.Position, wj.QueueLength)
		requester := holderName(ledger.Owner{ContainerID: wj.ContainerID, Namespace: wj.Namespace, Pod: wj.Pod, Container: wj.Container,
			FrontEnd: ledger.FrontEnd(wj.FrontEnd)})
		devs := strings.Join(wj.indices, ",")
		reserved := none
		if len(wj.reservedIndices) > 0 {
			reserved = strings.Join(wj.reservedIndices, ",") + " for " + age(wj.reservedUntil.Sub(now))
		}
		if wide {
			devs = strings.Join(wj.Devices, ",")
			t.row(pos, requester, wj.Requester, wj.ContainerID, devs, since(now, wj.FirstSeen), since(now, wj.LastSeen)+" ago", reserved)
			continue
		}
		t.row(pos, requester, devs, since(now, wj.FirstSeen), since(now, wj.LastSeen)+" ago", reserved)
	}
	return t.flush()
}
