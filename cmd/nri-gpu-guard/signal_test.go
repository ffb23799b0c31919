package main

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runMainEnv makes the test binary run main's run() with its arguments.
const runMainEnv = "NRI_GPU_GUARD_TEST_RUN_MAIN"

// watchdog only keeps a broken build from hanging the suite; the time a
// command takes to end after SIGTERM is logged, not asserted.
const watchdog = 60 * time.Second

// signalConfig writes a configuration with two static GPUs and a ledger in a
// fresh directory.
func signalConfig(t *testing.T) (cfgPath, stateDir string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "gg-sig-") // unix socket paths are short
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	stateDir = filepath.Join(dir, "state")
	conf := fmt.Sprintf("[ledger]\ndir = %q\n[devices]\nsource = \"static\"\n[hook]\npoll_interval = \"50ms\"\n", stateDir)
	for i := 0; i < 2; i++ {
		conf += fmt.Sprintf("[[devices.static]]\nindex = %d\nuuid = %q\nminor = %d\n", i, gpuUUID(i), i)
	}
	cfgPath = filepath.Join(dir, "config.toml")
	require.NoError(t, os.WriteFile(cfgPath, []byte(conf), 0o600))
	return cfgPath, stateDir
}

// started is a child process of the test binary running run(args).
type started struct {
	cmd    *exec.Cmd
	stderr *bufio.Reader
	done   chan error
}

func startMain(t *testing.T, stdin io.Reader, args ...string) *started {
	t.Helper()
	self, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(self, args...)
	cmd.Env = append(os.Environ(), runMainEnv+"=1")
	cmd.Stdin = stdin
	pr, pw, err := os.Pipe()
	require.NoError(t, err)
	cmd.Stderr = pw
	require.NoError(t, cmd.Start())
	_ = pw.Close()
	s := &started{cmd: cmd, stderr: bufio.NewReader(pr), done: make(chan error, 1)}
	go func() { s.done <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-s.done
		_ = pr.Close()
	})
	return s
}

// waitLine reads stderr until a line containing want, and returns it.
func (s *started) waitLine(t *testing.T, want string) string {
	t.Helper()
	for {
		line, err := s.stderr.ReadString('\n')
		if strings.Contains(line, want) {
			return line
		}
		require.NoError(t, err, "stderr ended before a line with %q", want)
	}
}

// term sends SIGTERM and waits for the exit; it returns the exit code and
// how long the process took to end.
func (s *started) term(t *testing.T) (int, time.Duration) {
	t.Helper()
	start := time.Now()
	require.NoError(t, s.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-s.done:
	case <-time.After(watchdog):
		t.Fatalf("still running %s after SIGTERM", watchdog)
	}
	return s.cmd.ProcessState.ExitCode(), time.Since(start)
}

// A FIFO given as the configuration is refused at once by the daemon and the
// hook: opening it used to block forever, deaf to SIGTERM.
func TestFIFOConfigRefused(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "config.toml")
	require.NoError(t, syscall.Mkfifo(fifo, 0o600))
	for _, args := range [][]string{{"--config", fifo}, {"hook", "poststop", "--config", fifo}} {
		var stdout, stderr bytes.Buffer
		code := run(args, strings.NewReader(""), &stdout, &stderr)
		assert.Equal(t, 1, code, args)
		assert.Contains(t, stderr.String(), "not a regular file (it is a named pipe (FIFO))")
	}
}
