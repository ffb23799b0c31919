package ledger

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/devices"
)

// FormatVersion is the state file format this build writes and the newest it
// reads. Bump it for any change an older build would misread.
const FormatVersion = 1

// checksumPrefix names the hash so that a later format may change it.
const checksumPrefix = "sha256:"

// maxStateBytes bounds what is read as state: a ledger of a few hundred
// devices and waiters is well under a MiB, so a bigger file is not ours.
const maxStateBytes = 64 << 20

// envelope is the on-disk form:
//
//	{"format":1,"generation":7,"boot_id":"…","checksum":"sha256:…","state":{…}}
//
// The checksum covers the exact bytes of "state"; generation and boot_id are
// repeated outside so that a human (and the decoder) sees them first, and must
// equal the state's own fields.
type envelope struct {
	Format     int             `json:"format"`
	Generation uint64          `json:"generation"`
	BootID     string          `json:"boot_id"`
	Checksum   string          `json:"checksum"`
	State      json.RawMessage `json:"state"`
}

// errBadState wraps every reason a file is not a valid state.
type errBadState struct{ reason string }

func (e *errBadState) Error() string { return e.reason }
func (e *errBadState) Unwrap() error { return ErrCorrupt }

func badState(format string, args ...any) error {
	return &errBadState{reason: fmt.Sprintf(format, args...)}
}

// encodeState renders st as the file content.
func encodeState(st *State) ([]byte, error) {
	var e encoder
	return e.encode(st, nil)
}

// encode renders st as the file content. The result is built in one of two
// buffers the encoder owns, never in keep (the bytes the ledger caches as its
// last file): neither is modified while cached, and no commit allocates a
// state-sized buffer.
func (e *encoder) encode(st *State, keep []byte) ([]byte, error) {
	i := 0
	if len(keep) > 0 && cap(e.out[0]) > 0 && &e.out[0][:1][0] == &keep[:1][0] {
		i = 1
	}
	out := append(e.out[i][:0], `{"format":`...)
	out = strconv.AppendInt(out, FormatVersion, 10)
	out = append(out, `,"generation":`...)
	out = strconv.AppendUint(out, st.Generation, 10)
	out = append(out, `,"boot_id":`...)
	out = appendString(out, st.BootID)
	out = append(out, `,"checksum":"`...)
	out = append(out, checksumPrefix...)
	sumAt := len(out)
	out = append(out, zeroSum[:]...) // filled in once the body is known
	out = append(out, `","state":`...)
	out, sum, err := e.appendStateBody(out, st)
	if err != nil {
		return nil, err
	}
	hex.Encode(out[sumAt:sumAt+len(zeroSum)], sum[:])
	out = append(out, "}\n"...)
	e.out[i] = out
	return out, nil
}

// zeroSum is the placeholder of a hex sha256 in the header.
var zeroSum [2 * sha256.Size]byte

// DecodeState parses and verifies the content of a state file. A file of a
// newer format yields a *FormatError (with an empty Path); anything else that
// is wrong yields an error wrapping ErrCorrupt. It never panics.
func DecodeState(data []byte) (State, error) {
	if len(data) > maxStateBytes {
		return State{}, badState("file is %d bytes, more than the %d a ledger can be", len(data), maxStateBytes)
	}
	if len(bytes.TrimSpace(data)) == 0 {
		return State{}, badState("file is empty")
	}
	var env envelope
	if err := json.Unmarshal(data, &env); err != nil {
		return State{}, badState("not a ledger file: %v", err)
	}
	if env.Format > FormatVersion {
		return State{}, &FormatError{Version: env.Format, Supported: FormatVersion}
	}
	if env.Format < 1 {
		return State{}, badState("format version %d is not valid", env.Format)
	}
	if len(env.State) == 0 || bytes.Equal(env.State, []byte("null")) {
		return State{}, badState("no state in the file")
	}
	sum := sha256.Sum256(env.State)
	want := checksumPrefix + hex.EncodeToString(sum[:])
	if env.Checksum != want {
		return State{}, badState("checksum mismatch: file says %q, content hashes to %q", truncate(env.Checksum, 80), want)
	}
	var st State
	if err := json.Unmarshal(env.State, &st); err != nil {
		return State{}, badState("state does not decode: %v", err)
	}
	if st.Generation != env.Generation || st.BootID != env.BootID {
		return State{}, badState("envelope (generation %d, boot %q) disagrees with state (generation %d, boot %q)",
			env.Generation, truncate(env.BootID, 64), st.Generation, truncate(st.BootID, 64))
	}
	if err := validateState(&st); err != nil {
		return State{}, badState("state violates an invariant: %v", err)
	}
	return st, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// validateState checks the invariants every committed state keeps. It runs on
// decode (a verified file that breaks them was not written by a correct
// ledger) and before every commit (a bug must not reach the disk).
func validateState(st *State) error { return validate(st, true) }

// validate is validateState, checking the queue itself only if
// checkWaiters (it is the costly part, and unchanged in most commits).
func validate(st *State, checkWaiters bool) error {
	for i := range st.Claims {
		c := &st.Claims[i]
		if c.Device.UUID == "" {
			return errors.New("a claim has no device UUID")
		}
		if c.Owner.ContainerID == "" {
			return fmt.Errorf("claim on %s has no container id", DescribeDevice(c.Device))
		}
		if i > 0 && st.Claims[i-1].Device.UUID >= c.Device.UUID {
			return fmt.Errorf("claims are not sorted by unique device UUID at %s", DescribeDevice(c.Device))
		}
		for j := 0; j < i; j++ {
			o := &st.Claims[j]
			if o.Owner.ContainerID != c.Owner.ContainerID && devices.Conflicts(o.Device, c.Device) {
				return fmt.Errorf("%s is held by container %s while %s is held by container %s",
					DescribeDevice(o.Device), ShortID(o.Owner.ContainerID), DescribeDevice(c.Device), ShortID(c.Owner.ContainerID))
			}
		}
	}
	var keys map[string]struct{}
	if checkWaiters {
		keys = make(map[string]struct{}, len(st.Waiters))
	}
	for i := 0; checkWaiters && i < len(st.Waiters); i++ {
		w := &st.Waiters[i]
		if w.Key == "" {
			return errors.New("a waiter has no key")
		}
		if _, dup := keys[w.Key]; dup {
			return fmt.Errorf("waiter %q is queued twice", w.Key)
		}
		keys[w.Key] = struct{}{}
		if i > 0 && st.Waiters[i-1].Seq >= w.Seq {
			return fmt.Errorf("waiters are not in strictly increasing arrival order at %q", w.Key)
		}
		if w.Seq >= st.NextSeq {
			return fmt.Errorf("waiter %q has seq %d, not below next_seq %d", w.Key, w.Seq, st.NextSeq)
		}
	}
	for i := range st.Reservations {
		r := &st.Reservations[i]
		if r.Device.UUID == "" || r.For == "" {
			return errors.New("a reservation has no device or no waiter")
		}
		if i > 0 && st.Reservations[i-1].Device.UUID >= r.Device.UUID {
			return fmt.Errorf("reservations are not sorted by unique device UUID at %s", DescribeDevice(r.Device))
		}
		for j := 0; j < i; j++ {
			o := &st.Reservations[j]
			if o.For != r.For && devices.Conflicts(o.Device, r.Device) {
				return fmt.Errorf("%s is reserved for %q while %s is reserved for %q",
					DescribeDevice(o.Device), o.For, DescribeDevice(r.Device), r.For)
			}
		}
	}
	for i := range st.Reservations {
		r := &st.Reservations[i]
		for j := range st.Claims {
			if c := &st.Claims[j]; devices.Conflicts(c.Device, r.Device) {
				return fmt.Errorf("%s is reserved for %q but %s is held by container %s",
					DescribeDevice(r.Device), r.For, DescribeDevice(c.Device), ShortID(c.Owner.ContainerID))
			}
		}
	}
	for i := range st.Conflicts {
		c := &st.Conflicts[i]
		if c.Device.UUID == "" || c.Owner.ContainerID == "" {
			return errors.New("a conflict record has no device or no container id")
		}
	}
	return nil
}
