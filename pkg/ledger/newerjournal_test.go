// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package ledger

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// A newer build's journal header carries a higher journal number and,
// most likely, a field this build does not know: it is newer, not damaged.
func TestNewerJournalHeaderIsAFormatError(t *testing.T) {
	for _, line := range []string{
		fmt.Sprintf(`{"journal":%d,"lineage":"L","boot_id":"B","base":7,"genesis":true,"base_next_seq":3,"epoch":1}`, journalFormat+1),
		fmt.Sprintf(`{"epoch":1,"journal":%d,"lineage":"L"}`, journalFormat+1),
		fmt.Sprintf(`{"journal":%d}`, journalFormat+1),
	} {
		_, err := decodeHeader([]byte(line))
		var fe *FormatError
		require.ErrorAs(t, err, &fe, line)
		require.Equal(t, FormatVersion+1, fe.Version)
		require.NotErrorIs(t, err, ErrCorrupt)
	}
	// This build's number with a field it does not know is damage (or a
	// hand edit), as before.
	_, err := decodeHeader([]byte(fmt.Sprintf(`{"journal":%d,"lineage":"L","boot_id":"B","base":7,"epoch":1}`, journalFormat)))
	require.ErrorIs(t, err, ErrCorrupt)
}

// writeNewerJournal gives l's journal the header a newer build would write,
// its records kept, and returns the file's bytes.
func writeNewerJournal(t *testing.T, l *Ledger) []byte {
	t.Helper()
	data := mustRead(t, l.JournalPath())
	nl := bytes.IndexByte(data, '\n')
	hdr, err := decodeHeader(data[9:nl])
	require.NoError(t, err)
	line, err := appendJournalLine(nil, json.RawMessage(fmt.Sprintf(`{"journal":%d,"lineage":%q,"boot_id":%q,"base":%d,"genesis":%t,"epoch":1}`,
		journalFormat+1, hdr.Lineage, hdr.BootID, hdr.Base, hdr.Genesis)))
	require.NoError(t, err)
	out := append(line, data[nl+1:]...)
	require.NoError(t, os.WriteFile(l.JournalPath(), out, 0o600))
	return out
}

func setAside(t *testing.T, dir string) []string {
	t.Helper()
	m, err := filepath.Glob(filepath.Join(dir, "*.corrupt-*"))
	require.NoError(t, err)
	return m
}

// A ledger whose journal a newer build wrote is refused as newer by every
// reader and writer, and recovery (the NRI daemon's, which may start
// empty) leaves it alone instead of moving it aside with its commits.
func TestNewerJournalIsLeftAlone(t *testing.T) {
	l := seeded(t)
	journal := writeNewerJournal(t, l)
	state := mustRead(t, l.StatePath())

	err := l.Update(context.Background(), func(tx *Tx) error { t.Fatal("fn must not run"); return nil })
	var fe *FormatError
	require.ErrorAs(t, err, &fe)
	require.Equal(t, l.JournalPath(), fe.Path)
	require.NotErrorIs(t, err, ErrNeedsRecovery)
	_, err = l.Snapshot(context.Background())
	require.ErrorIs(t, err, ErrUnsupportedFormat)

	_, err = l.Recover(context.Background(), RecoverOptions{AllowEmpty: true, Reason: "test"})
	require.ErrorIs(t, err, ErrUnsupportedFormat)
	require.Equal(t, journal, mustRead(t, l.JournalPath()), "untouched")
	require.Equal(t, state, mustRead(t, l.StatePath()), "untouched")
	require.Empty(t, setAside(t, l.Dir()))
}

// When the snapshot is damaged too, recovery finds the newer journal among
// the files it would replay or move aside: it refuses, naming the file and
// what to do, and changes nothing.
func TestRecoveryRefusesToMoveANewerFileAside(t *testing.T) {
	for _, dryRun := range []bool{false, true} {
		t.Run(fmt.Sprintf("dry run %t", dryRun), func(t *testing.T) {
			l := seeded(t)
			journal := writeNewerJournal(t, l)
			require.NoError(t, os.WriteFile(l.StatePath(), []byte("garbage"), 0o600))
			_, err := l.Snapshot(context.Background())
			require.ErrorIs(t, err, ErrNeedsRecovery)

			_, err = l.Recover(context.Background(), RecoverOptions{AllowEmpty: true, Reason: "test", DryRun: dryRun})
			require.ErrorIs(t, err, ErrUnsupportedFormat)
			require.Contains(t, err.Error(), "ledger recover: nothing was changed: ledger state "+l.JournalPath()+
				fmt.Sprintf(" has format version %d, written by a newer nri-gpu-guard", FormatVersion+1))
			require.Contains(t, err.Error(), "recovering with this build would move it aside and lose the commits it holds. "+
				"Recover with the newer build (upgrade every nri-gpu-guard binary on this host), or, to go back to this "+
				"build, start afresh deliberately with `gpu-guard-ctl recover --reset`")
			require.Equal(t, journal, mustRead(t, l.JournalPath()), "untouched")
			require.Equal(t, []byte("garbage"), mustRead(t, l.StatePath()), "untouched")
			require.Empty(t, setAside(t, l.Dir()))
		})
	}
}
