// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package observe

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// FileName is the daemon's latest observer report in the state directory.
const FileName = "observe.json"

// Bounds of the report file: a host with thousands of stray processes must
// not turn a status file into a log.
const (
	maxFileFindings = 256
	maxFileErrors   = 64
	maxFileBytes    = 1 << 20
)

// FileFinding is a finding as the report file records it, with the names
// the ledger knows for the process's container.
type FileFinding struct {
	Finding
	// Namespace, Pod and Container name the process's container when the
	// ledger knows it (a holder, a waiter, a conflict); empty otherwise.
	Namespace string `json:"namespace,omitempty"`
	Pod       string `json:"pod,omitempty"`
	Container string `json:"container,omitempty"`
}

// File is the content of observe.json: what the daemon's observer saw last.
// Its JSON is a public interface (docs/ctl-json.md).
type File struct {
	// Time is when the accounting pass ran (zero when none has completed;
	// the file then carries health only).
	Time time.Time `json:"time"`
	// WrittenAt is when the file was written (a health change rewrites it
	// between passes).
	WrittenAt time.Time `json:"written_at"`
	// IntervalSeconds is the daemon's [observe] interval; 0 = accounting
	// off. A reader judges the file stale against it.
	IntervalSeconds float64 `json:"interval_seconds"`
	// Findings are the problems of the last pass (no "gone" ones); for a
	// device it could not list (Errors), those of the last pass that did
	// (the daemon keeps them: nothing is concluded about such a device).
	Findings []FileFinding `json:"findings"`
	// Unhealthy are the devices the observer found unhealthy since the
	// daemon started.
	Unhealthy []Finding `json:"unhealthy"`
	// Errors are why devices could not be judged in the last pass.
	Errors []string `json:"errors"`
	// Unlisted are the devices of Errors, in the same order, each with its
	// error, for a reader that matches them to its own (by UUID, not by
	// the text). A file of an older daemon has Errors only.
	Unlisted []UnlistedDevice `json:"unlisted"`
	// NotInInventory are the devices of the last pass that the daemon's
	// inventory lacks (DeviceReport.NotInInventory), each with its notice:
	// a MIG instance created since discovery, whose processes were listed
	// and judged (its findings are in Findings, and clear when its
	// processes leave; it is in Unlisted too only when NVML could not
	// list it), or the unidentified GPU of a critical Xid (empty UUID).
	// A file of an older daemon has none: it put them in Unlisted.
	NotInInventory []NotInInventoryDevice `json:"not_in_inventory"`
	// Truncated counts findings, errors and devices not in the inventory
	// left out to bound the file.
	Truncated int `json:"truncated,omitempty"`
}

// NotInInventoryDevice is a device of a pass that the daemon's inventory
// lacks (DeviceReport.NotInInventory): Notice says so and what to do.
type NotInInventoryDevice struct {
	Device Device `json:"device"`
	Notice string `json:"notice"`
}

// String names the device and its notice: "MIG 1:5 (MIG-…): the MIG
// layout of GPU 1 … changed …".
func (n NotInInventoryDevice) String() string {
	return fmt.Sprintf("%s: %s", n.Device, n.Notice)
}

// UnlistedDevice is a device whose processes NVML could not list in a
// pass (DeviceReport.Error): nothing was concluded about it.
type UnlistedDevice struct {
	Device Device `json:"device"`
	Error  string `json:"error"`
}

// String is the device's entry of File.Errors: "GPU 1 (GPU-…): error".
func (u UnlistedDevice) String() string {
	return fmt.Sprintf("%s: %s", u.Device, u.Error)
}

// Stale reports whether f is too old to trust at now: three intervals
// without a pass (the daemon stopped observing, or NVML keeps failing).
func (f *File) Stale(now time.Time) bool {
	if f.IntervalSeconds <= 0 {
		return false
	}
	limit := 3 * time.Duration(f.IntervalSeconds*float64(time.Second))
	ref := f.Time
	if ref.IsZero() { // the observer has just started: no pass yet
		ref = f.WrittenAt
	}
	return now.Sub(ref) > limit
}

// WriteFile replaces dir/observe.json with f (bounded; mode 0600): a temp
// file renamed into place, so a reader sees the old file or the new one.
func WriteFile(dir string, f File) error {
	if n := len(f.Findings) - maxFileFindings; n > 0 {
		f.Findings, f.Truncated = f.Findings[:maxFileFindings], f.Truncated+n
	}
	if n := len(f.Errors) - maxFileErrors; n > 0 {
		f.Errors, f.Truncated = f.Errors[:maxFileErrors], f.Truncated+n
	}
	if len(f.Unlisted) > maxFileErrors { // the devices of Errors: counted there
		f.Unlisted = f.Unlisted[:maxFileErrors]
	}
	if n := len(f.NotInInventory) - maxFileErrors; n > 0 {
		f.NotInInventory, f.Truncated = f.NotInInventory[:maxFileErrors], f.Truncated+n
	}
	if f.Findings == nil {
		f.Findings = []FileFinding{}
	}
	if f.Unhealthy == nil {
		f.Unhealthy = []Finding{}
	}
	if f.Errors == nil {
		f.Errors = []string{}
	}
	if f.Unlisted == nil {
		f.Unlisted = []UnlistedDevice{}
	}
	if f.NotInInventory == nil {
		f.NotInInventory = []NotInInventoryDevice{}
	}
	return writeJSON(dir, FileName, "the observer report", f)
}

// writeJSON replaces dir/name with v as JSON (mode 0600): a temp file
// renamed into place, so a reader sees the old file or the new one. what
// names the file in errors.
func writeJSON(dir, name, what string, v any) error {
	data, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("encode %s: %w", what, err)
	}
	tmp, err := os.CreateTemp(dir, "."+strings.TrimSuffix(name, ".json")+"-*.tmp")
	if err != nil {
		return fmt.Errorf("write %s in %s: %w", what, dir, err)
	}
	tmpName := tmp.Name()
	_, err = tmp.Write(append(data, '\n'))
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmpName, filepath.Join(dir, name))
	}
	if err != nil {
		_ = os.Remove(tmpName)
		return fmt.Errorf("write %s %s: %w", what, filepath.Join(dir, name), err)
	}
	return nil
}

// RemoveFile removes dir/observe.json (the daemon stops observing cleanly:
// no report is better than one that only grows stale).
func RemoveFile(dir string) error {
	err := os.Remove(filepath.Join(dir, FileName))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove the observer report: %w", err)
	}
	return nil
}

// ErrNoFile is returned by ReadFile when the daemon has written no report
// (it does not run, runs without NVML, or stopped cleanly).
var ErrNoFile = errors.New("no observer report")

// ReadFile reads dir/observe.json. It refuses a symlink or a file that is
// not regular, and one larger than any the daemon writes.
func ReadFile(dir string) (*File, error) {
	var f File
	if err := readJSON(dir, FileName, "observer report", &f); err != nil {
		return nil, err
	}
	return &f, nil
}

// readJSON decodes dir/name into v: ErrNoFile when it does not exist; an
// error for a symlink, a file that is not regular, one larger than
// maxFileBytes, or one that does not parse. what names the file in errors.
func readJSON(dir, name, what string, v any) error {
	p := filepath.Join(dir, name)
	fd, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0) //nolint:gosec // fixed name in the state dir
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return ErrNoFile
	case errors.Is(err, syscall.ELOOP):
		return fmt.Errorf("%s %s is a symlink; remove it (the daemon rewrites it)", what, p)
	case err != nil:
		return fmt.Errorf("read the %s: %w", what, err)
	}
	defer func() { _ = fd.Close() }()
	fi, err := fd.Stat()
	if err != nil {
		return fmt.Errorf("read the %s: %w", what, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s %s is not a regular file", what, p)
	}
	data, err := io.ReadAll(io.LimitReader(fd, maxFileBytes+1))
	if err != nil {
		return fmt.Errorf("read the %s: %w", what, err)
	}
	if len(data) > maxFileBytes {
		return fmt.Errorf("%s %s is larger than %d bytes; not read", what, p, maxFileBytes)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("%s %s does not parse: %w", what, p, err)
	}
	return nil
}
