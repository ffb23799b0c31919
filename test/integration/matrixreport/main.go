// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

// Command matrixreport turns the output of the end-to-end suite run against
// several containerd versions (`make matrix`) into the compatibility table,
// and checks the README's table against it.
//
//	matrixreport -run                      # the -run pattern of the core subset
//	matrixreport LOG...                    # the table, one row per LOG; fails
//	                                       # unless every scenario passed or is
//	                                       # not supported
//	matrixreport -readme LOG...            # the README's rows for those runs
//	matrixreport -check README.md LOG...   # fail unless README has those rows
//
// Each LOG is the `go test -v` output of one run of the suite with
// CONTAINERD_VERSION set; TestRuntimeUnderTest's log line names the version
// and its NRI version. A scenario the runtime lacks a capability for is
// skipped with a message starting "not supported on containerd": it is
// shown as not supported, with that message as a note.
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Scenario is one column of the table: a test of the core subset.
type Scenario struct {
	Label string
	Test  string
}

// Scenarios is the core subset `make matrix` runs, in table order.
var Scenarios = []Scenario{
	{"containers + CDI", "TestHarnessRunsContainers"},
	{"admit/refuse + message", "TestConflictingRequestIsRefusedAndQueued"},
	{"queue + reservation", "TestStoppedHolderHandsGPUToHeadOfQueue"},
	{"restart reconcile", "TestPluginRestartReconcilesWithRuntime"},
	{"exited holder via cgroup", "TestExitedHolderIsSeenThroughItsCgroup"},
	{"fail-closed validator", "TestGuardAbsentFailsClosed"},
	{"launched mode", "TestPreinstalledPluginSurvivesContainerdRestart"},
	{"later-plugin validation", "TestLaterPluginCannotAddAnUncheckedGPU"},
}

// runtimeTest logs the version line every run must have.
const runtimeTest = "TestRuntimeUnderTest"

// RunPattern is the `go test -run` pattern of the core subset.
func RunPattern() string {
	names := []string{runtimeTest}
	for _, s := range Scenarios {
		names = append(names, s.Test)
	}
	return "^(" + strings.Join(names, "|") + ")$"
}

// Status is a scenario's outcome on one runtime.
type Status string

// Outcomes. NotRun is a test that started but reported nothing (the test
// binary crashed or timed out) or never started.
const (
	Pass         Status = "pass"
	Fail         Status = "FAIL"
	NotSupported Status = "not supported"
	NotRun       Status = "not run"
	Skipped      Status = "skipped"
)

// Result is one run of the suite.
type Result struct {
	Containerd  string // e.g. v1.7.35
	NRI         string // e.g. v0.8.0
	StubWarning bool   // the plugin's stub logged stubVersionWarning
	Cgroup      string // "v1" (v1 or hybrid) or "v2": /sys/fs/cgroup during the run
	Status      map[string]Status
	Note        map[string]string // the skip message of a non-pass test
}

var (
	resultRE  = regexp.MustCompile(`^\s*--- (PASS|FAIL|SKIP): (\S+) \(`)
	runtimeRE = regexp.MustCompile(`runtime under test: containerd (\S+), NRI (\S+), config version \d+, stub version warning: (true|false), cgroup (v[12])`)
	// logRE is a t.Log/t.Skip line: "    file_test.go:123: message".
	logRE = regexp.MustCompile(`^\s+\S+_test\.go:\d+: (.*)$`)
)

// notSupportedPrefix matches the integration package's RequireCapability.
const notSupportedPrefix = "not supported on containerd "

// Parse reads one `go test -v` log.
func Parse(r io.Reader) (*Result, error) {
	res := &Result{Status: map[string]Status{}, Note: map[string]string{}}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	// With -v, a test's log lines stream before its "--- SKIP" line: keep
	// the last one of the running top-level test as its skip message.
	running, lastLog := "", ""
	for sc.Scan() {
		line := sc.Text()
		if m := runtimeRE.FindStringSubmatch(line); m != nil {
			res.Containerd, res.NRI, res.StubWarning, res.Cgroup = m[1], m[2], m[3] == "true", m[4]
		}
		if name, ok := strings.CutPrefix(line, "=== RUN   "); ok {
			if !strings.Contains(name, "/") {
				running, lastLog = strings.TrimSpace(name), ""
			}
			continue
		}
		if m := resultRE.FindStringSubmatch(line); m != nil {
			if strings.Contains(m[2], "/") {
				continue // a subtest: its parent's result is the scenario's
			}
			switch m[1] {
			case "PASS":
				res.Status[m[2]] = Pass
			case "FAIL":
				res.Status[m[2]] = Fail
			case "SKIP":
				res.Status[m[2]] = Skipped
				if m[2] == running && lastLog != "" {
					if strings.HasPrefix(lastLog, notSupportedPrefix) {
						res.Status[m[2]] = NotSupported
					}
					res.Note[m[2]] = lastLog
				}
			}
			running, lastLog = "", ""
			continue
		}
		if m := logRE.FindStringSubmatch(line); m != nil && running != "" {
			lastLog = m[1]
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if res.Containerd == "" {
		return nil, fmt.Errorf("no %q line: not the log of a suite run that included %s", "runtime under test", runtimeTest)
	}
	return res, nil
}

// status of scenario s, NotRun when the log has none.
func (r *Result) status(s Scenario) Status {
	if st, ok := r.Status[s.Test]; ok {
		return st
	}
	return NotRun
}

// Line is the release line "1.7" of a version "v1.7.35".
func Line(version string) string {
	v := strings.TrimPrefix(version, "v")
	if i := strings.Index(v, "."); i >= 0 {
		if j := strings.Index(v[i+1:], "."); j >= 0 {
			return v[:i+1+j]
		}
	}
	return v
}

// sortResults orders results by version, oldest first.
func sortResults(rs []*Result) {
	key := func(v string) []int {
		var k []int
		for _, p := range strings.Split(strings.TrimPrefix(v, "v"), ".") {
			n, _ := strconv.Atoi(p)
			k = append(k, n)
		}
		return k
	}
	sort.SliceStable(rs, func(i, j int) bool {
		a, b := key(rs[i].Containerd), key(rs[j].Containerd)
		for n := 0; n < len(a) && n < len(b); n++ {
			if a[n] != b[n] {
				return a[n] < b[n]
			}
		}
		return len(a) < len(b)
	})
}

// Table is the full per-scenario table, with the notes of every
// non-passing scenario below it.
func Table(rs []*Result) string {
	var b strings.Builder
	b.WriteString("| containerd | NRI | cgroup | stub warning |")
	for _, s := range Scenarios {
		b.WriteString(" " + s.Label + " |")
	}
	b.WriteString("\n|---|---|---|---|")
	for range Scenarios {
		b.WriteString("---|")
	}
	b.WriteString("\n")
	var notes []string
	for _, r := range rs {
		warn := "no"
		if r.StubWarning {
			warn = "yes"
		}
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", r.Containerd, r.NRI, r.Cgroup, warn)
		for _, s := range Scenarios {
			st := r.status(s)
			fmt.Fprintf(&b, " %s |", st)
			if st != Pass && r.Note[s.Test] != "" {
				notes = append(notes, fmt.Sprintf("- %s, %s: %s", r.Containerd, s.Label, r.Note[s.Test]))
			}
		}
		b.WriteString("\n")
	}
	if len(notes) > 0 {
		b.WriteString("\n" + strings.Join(notes, "\n") + "\n")
	}
	return b.String()
}

// ReadmeRow is the README's compatibility row of one run: containerd line
// (and the patch release verified), NRI version, status, what is verified.
func ReadmeRow(r *Result) string {
	var passed, missing, failed []string
	for _, s := range Scenarios {
		switch r.status(s) {
		case Pass:
			passed = append(passed, s.Label)
		case NotSupported:
			missing = append(missing, s.Label)
		default:
			failed = append(failed, s.Label)
		}
	}
	status := "supported"
	switch {
	case len(failed) > 0:
		status = "**failing**: " + strings.Join(failed, ", ")
	case len(missing) > 0:
		status = "supported, without " + joinOr(missing)
	}
	verified := strings.Join(passed, ", ")
	if verified == "" {
		verified = "nothing"
	}
	return fmt.Sprintf("| %s (%s) | %s | %s | %s |", Line(r.Containerd), r.Containerd, r.NRI, status, verified)
}

// joinOr joins names as "a, b or c": a status lists what a line lacks, and
// "without a, b" could read as lacking a but having b.
func joinOr(names []string) string {
	if len(names) < 2 {
		return strings.Join(names, "")
	}
	return strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// Unverified names every scenario of the runs that neither passed nor was
// reported as not supported (failed, skipped for another reason, or not run
// at all, as after a test's rename): the go test exit status does not show
// the last two, so the table's run fails on them.
func Unverified(rs []*Result) []string {
	var out []string
	for _, r := range rs {
		for _, s := range Scenarios {
			if st := r.status(s); st != Pass && st != NotSupported {
				out = append(out, fmt.Sprintf("containerd %s, %s (%s): %s", r.Containerd, s.Label, s.Test, st))
			}
		}
	}
	return out
}

// Markers around the generated rows in the README.
const (
	beginMarker = "<!-- matrix:begin -->"
	endMarker   = "<!-- matrix:end -->"
)

// readmeRows returns the rows between the markers, keyed by release line.
func readmeRows(readme string) (map[string]string, error) {
	i := strings.Index(readme, beginMarker)
	j := strings.Index(readme, endMarker)
	if i < 0 || j < i {
		return nil, fmt.Errorf("no %s … %s block", beginMarker, endMarker)
	}
	rows := map[string]string{}
	for _, line := range strings.Split(readme[i+len(beginMarker):j], "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "| ") || strings.HasPrefix(line, "|---") || strings.HasPrefix(line, "| containerd ") {
			continue
		}
		cell := strings.TrimSpace(strings.Split(line, "|")[1])
		line1 := strings.Fields(cell)[0]
		if _, dup := rows[line1]; dup {
			return nil, fmt.Errorf("two rows for containerd %s", line1)
		}
		rows[line1] = line
	}
	return rows, nil
}

// Check compares the README's rows with the runs: every run's release line
// must have exactly the row the run produces. Lines without a run are not
// judged (CI runs only some lines).
func Check(readme string, rs []*Result) error {
	rows, err := readmeRows(readme)
	if err != nil {
		return err
	}
	var errs []error
	for _, r := range rs {
		want := ReadmeRow(r)
		got, ok := rows[Line(r.Containerd)]
		switch {
		case !ok:
			errs = append(errs, fmt.Errorf("no row for containerd %s; add:\n%s", Line(r.Containerd), want))
		case got != want:
			errs = append(errs, fmt.Errorf("containerd %s row differs from what %s showed:\n  README: %s\n  run:    %s", Line(r.Containerd), r.Containerd, got, want))
		}
	}
	return errors.Join(errs...)
}

func main() {
	run := flag.Bool("run", false, "print the go test -run pattern of the core subset")
	readme := flag.Bool("readme", false, "print the README rows of the runs")
	check := flag.String("check", "", "fail unless `README` has the rows of the runs")
	flag.Parse()
	if *run {
		fmt.Println(RunPattern())
		return
	}
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: matrixreport [-readme | -check README.md] LOG... (or -run)")
		os.Exit(2)
	}
	var rs []*Result
	for _, path := range flag.Args() {
		f, err := os.Open(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, "matrixreport:", err)
			os.Exit(1)
		}
		r, err := Parse(f)
		_ = f.Close()
		if err != nil {
			fmt.Fprintf(os.Stderr, "matrixreport: %s: %v\n", path, err)
			os.Exit(1)
		}
		rs = append(rs, r)
	}
	sortResults(rs)
	switch {
	case *check != "":
		b, err := os.ReadFile(*check)
		if err == nil {
			err = Check(string(b), rs)
		}
		if err != nil {
			fmt.Fprintf(os.Stderr, "matrixreport: %s: %v\n", *check, err)
			os.Exit(1)
		}
		fmt.Printf("%s: the compatibility rows match the runs of %d containerd versions\n", *check, len(rs))
	case *readme:
		for _, r := range rs {
			fmt.Println(ReadmeRow(r))
		}
	default:
		fmt.Print(Table(rs))
		if bad := Unverified(rs); len(bad) > 0 {
			fmt.Fprintf(os.Stderr, "matrixreport: not verified:\n  %s\n", strings.Join(bad, "\n  "))
			os.Exit(1)
		}
	}
}
