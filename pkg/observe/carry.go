// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"fmt"
	"time"
)

// CarryFileName is the daemon's record, in the state directory, of the
// intruder and out-of-bounds findings it acted on and of the devices it
// found unhealthy, for the daemon that runs after it (a restart, an
// upgrade, a crash): unlike observe.json it outlives a clean stop, and no
// one but the daemon reads it.
const CarryFileName = "observe-carry.json"

// CarryFormat is the version of the carry file's JSON: a file of another
// version is not read. A field added since (Unhealthy) is optional: a file
// written without it carries none of what it holds.
const CarryFormat = 1

// Carry is the content of the carry file: what the daemon's policy knows of
// the processes it reported, so that the next daemon does not take the same
// process for a new finding. A process is the same one only in the same
// boot, with the same pid and start time (Finding.StartTicks).
//
// It is no record of the cordons: the ledger holds those. CordonLineages
// only tells the next daemon which ledger lineage the daemon saw each of
// its intruder cordons in, so that a cordon missing from the ledger can be
// told lifted by the operator (the same lineage) from lost with the state
// (another).
type Carry struct {
	Format int `json:"format"`
	// BootID is the boot the findings were seen in (start ticks count from
	// it): a file of another boot names processes that are gone.
	BootID string `json:"boot_id"`
	// WrittenAt is when the file was written.
	WrittenAt time.Time `json:"written_at"`
	// Cordons: the daemon cordoned intruders' devices (on_intruder =
	// "cordon").
	Cordons bool `json:"cordons"`
	// Findings are the findings of the daemon's last pass, with the names
	// of their containers.
	Findings []FileFinding `json:"findings"`
	// CordonLineages maps the device UUID of each intruder cordon the
	// daemon wrote or last saw in force to the ledger lineage it did so in
	// ("" when it could not be read).
	CordonLineages map[string]string `json:"cordon_lineages,omitempty"`
	// CordonRetries are the device UUIDs whose intruder cordon could not be
	// written yet, or was about to be written when the file was: the
	// daemon writes the file before its cordon writes too, so that one that
	// dies in between leaves them to the next daemon, which writes each
	// unless the ledger shows a cordon in force on its device.
	CordonRetries []string `json:"cordon_retries,omitempty"`
	// Unhealthy are the devices the daemon found unhealthy and still
	// watched: NVML reports a critical Xid once, and a cordon in force on
	// the device may be another's (an operator's outranks an unhealthy
	// one, ledger.CordonKept), so neither tells the next daemon that the
	// device failed. A file without it (an older daemon's) carries none.
	Unhealthy []UnhealthyDevice `json:"unhealthy,omitempty"`
	// Truncated counts the findings left out to bound the file: the next
	// daemon takes their processes for new findings.
	Truncated int `json:"truncated,omitempty"`
}

// UnhealthyDevice is an unhealthy device in the carry file: the finding
// that made it so, and what the daemon knew of its unhealthy cordon.
type UnhealthyDevice struct {
	Finding
	// CordonLineage is the ledger lineage the device's unhealthy cordon
	// was written in or last seen in force in ("" when it could not be
	// read); nil when the daemon knew of no such cordon (not written yet,
	// or never: a MIG instance gone from NVML is not cordoned).
	CordonLineage *string `json:"cordon_lineage,omitempty"`
	// CordonRetry is the reason of the device's unhealthy cordon when it
	// could not be written yet, or was about to be written when the file
	// was: the next daemon writes it unless the ledger shows a cordon in
	// force on the device.
	CordonRetry string `json:"cordon_retry,omitempty"`
}

// WriteCarry replaces dir/observe-carry.json with c (bounded as
// observe.json; mode 0600; atomically), stamped with CarryFormat.
func WriteCarry(dir string, c Carry) error {
	c.Format = CarryFormat
	if n := len(c.Findings) - maxFileFindings; n > 0 {
		c.Findings, c.Truncated = c.Findings[:maxFileFindings], c.Truncated+n
	}
	if c.Findings == nil {
		c.Findings = []FileFinding{}
	}
	return writeJSON(dir, CarryFileName, "the observer's carry file", c)
}

// ReadCarry reads dir/observe-carry.json: ErrNoFile when there is none; an
// error for a file that is odd (as ReadFile), does not parse, or is of
// another format.
func ReadCarry(dir string) (*Carry, error) {
	var c Carry
	if err := readJSON(dir, CarryFileName, "observer's carry file", &c); err != nil {
		return nil, err
	}
	if c.Format != CarryFormat {
		return nil, fmt.Errorf("observer's carry file in %s has format %d, not %d", dir, c.Format, CarryFormat)
	}
	return &c, nil
}
