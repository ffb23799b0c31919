package ledger

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// DefaultRuntimeDir holds the per-boot markers (Options.RuntimeDir): a
// tmpfs that every boot starts empty.
const DefaultRuntimeDir = "/run/nri-gpu-guard"

// The per-boot marker tells a fresh host from a vanished state. A ledger of
// an earlier boot is discarded anyway, so a boot legitimately starts empty;
// but once a ledger was committed in this boot, the marker (in a tmpfs, gone
// at the next boot) records its lineage and the generation last committed,
// and a state dir that is then missing, empty, of another lineage or of an
// older generation is refused instead of read as a fresh host.
type marker struct {
	Dir        string `json:"dir"`
	BootID     string `json:"boot_id"`
	Lineage    string `json:"lineage"`
	Generation uint64 `json:"generation"`
}

// markerPath is this state dir's marker: one per dir path, since what
// vanishes is what the configuration points at.
func (l *Ledger) markerPath() string {
	sum := sha256.Sum256([]byte(l.dir))
	return filepath.Join(l.opts.RuntimeDir, "ledger-"+hex.EncodeToString(sum[:12])+".marker")
}

// readMarker returns this boot's marker of the state dir, or ok = false if
// there is none (a marker of another boot, on a runtime dir that is not a
// tmpfs, is none either). A marker that cannot be read is an error: it must
// not read as "fresh host".
func (l *Ledger) readMarker() (m marker, ok bool, err error) {
	p := l.markerPath()
	data, exists, err := readFileNoFollow(p, 64<<10, nil)
	if err != nil {
		return m, false, fmt.Errorf("read the ledger's boot marker: %w", err)
	}
	if !exists {
		return m, false, nil
	}
	if err := json.Unmarshal(data, &m); err != nil || m.Dir != l.dir || m.Lineage == "" {
		return m, false, &NeedsRecoveryError{Path: p, Problem: "the boot marker of the state dir does not verify (damaged, or not ours)"}
	}
	if m.BootID != l.opts.BootID {
		return marker{}, false, nil
	}
	return m, true, nil
}

// writeMarker records the committed lineage and generation (lock held).
// The runtime dir is a tmpfs: no fsync, it does not outlive the boot.
func (l *Ledger) writeMarker(st *State) error {
	if err := ensureRuntimeDir(l.opts.RuntimeDir); err != nil {
		return err
	}
	data, err := json.Marshal(marker{Dir: l.dir, BootID: l.opts.BootID, Lineage: st.Lineage, Generation: st.Generation})
	if err != nil {
		return err
	}
	p := l.markerPath()
	tmp := p + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600) //nolint:gosec // fixed name in the runtime dir
	if err != nil {
		return fmt.Errorf("write the ledger's boot marker: %w", err)
	}
	_, werr := f.Write(append(data, '\n'))
	cerr := f.Close()
	if err := errors.Join(werr, cerr); err != nil {
		return fmt.Errorf("write the ledger's boot marker %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, p); err != nil { //nolint:gosec // fixed names in the runtime dir
		return fmt.Errorf("write the ledger's boot marker: %w", err)
	}
	return nil
}

// ensureRuntimeDir creates the runtime dir (0700) and checks it like the
// state dir: whoever can write there can erase the memory of a ledger.
func ensureRuntimeDir(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fmt.Errorf("create the ledger runtime dir %s: %w", dir, err)
		}
		fi, err = os.Lstat(dir)
	}
	if err != nil {
		return fmt.Errorf("ledger runtime dir %s: %w", dir, err)
	}
	if fi.Mode()&fs.ModeSymlink != 0 || !fi.IsDir() {
		return fmt.Errorf("%w: ledger runtime dir %s is not a directory (a symlink?)", ErrUnsafeDir, dir)
	}
	return checkOwnerMode(dir, fi, false)
}
