// Copyright The nri-gpu-guard Authors.
// SPDX-License-Identifier: Apache-2.0

package hookserve

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/hook"
	"github.com/nri-gpu-guard/nri-gpu-guard/pkg/liveness"
)

// Defaults of Server's bounds.
const (
	DefaultMaxInFlight = 128
	DefaultGrace       = 10 * time.Second
	DefaultReadTimeout = 5 * time.Second
	// writeTimeout bounds sending an answer: a relay that reads nothing
	// must not hold a handler.
	writeTimeout = 5 * time.Second
)

// Runner is the hook entry a server runs for each accepted request:
// hook.MainAs, which tests substitute.
type Runner func(ctx context.Context, inv hook.Invocation, proc hook.Process, stdin io.Reader, stderr io.Writer) int

// Server answers hook relays on a unix socket (see doc.go). The zero value
// is not usable: fill Program, or use New.
type Server struct {
	// Program names the hook at the start of its error lines, as the hook
	// binary does (nri-gpu-guard-hook): the runtime logs the same line
	// whichever of the two answered.
	Program string
	// MaxInFlight bounds the connections handled at once (reading, running
	// or answering); one more is answered 'F' at once.
	MaxInFlight int
	// Grace is how long in-flight runs may go on once the server is told
	// to stop; then their contexts are cancelled.
	Grace time.Duration
	// ReadTimeout bounds reading a request.
	ReadTimeout time.Duration
	// Log receives one line per fallback and per error (never one per
	// answered request); nil: none.
	Log io.Writer
	// Run is the hook entry (nil: hook.MainAs).
	Run Runner

	// procRoot is where peers are read (/proc); tests substitute it.
	procRoot string
	// stopped, where set (tests), is called once the stop has begun:
	// every connection accepted from then on is answered 'F'.
	stopped func()
	logMu   sync.Mutex
}

// New returns a server with the default bounds, logging to log.
func New(program string, log io.Writer) *Server {
	return &Server{Program: program, MaxInFlight: DefaultMaxInFlight, Grace: DefaultGrace, ReadTimeout: DefaultReadTimeout, Log: log}
}

func (s *Server) logf(format string, args ...any) {
	if s.Log == nil {
		return
	}
	s.logMu.Lock()
	defer s.logMu.Unlock()
	_, _ = fmt.Fprintf(s.Log, format+"\n", args...)
}

// Serve answers relays on l until ctx ends, then stops gracefully: it
// answers 'F' at once to every relay that connects from then on (and to
// requests read from then on), lets the hook runs in flight finish for
// Grace, then cancels them, closes l and returns once every connection is
// done. It returns nil after a stop, or the accept error that ended it.
//
// It accepts through the grace rather than closing l at once: a listener
// systemd passed (Activated) is a copy of systemd's socket, which goes on
// listening when this one is closed, so a relay would connect, wait its
// whole acknowledgement timeout (2 s) for an accept that never comes, and
// only then run the hook itself.
func (s *Server) Serve(ctx context.Context, l *net.UnixListener) error {
	run := s.Run
	if run == nil {
		run = hook.MainAs
	}
	procRoot := s.procRoot
	if procRoot == "" {
		procRoot = liveness.DefaultProcRoot
	}
	st := &serving{
		s:     s,
		run:   run,
		check: newPeerCheck(procRoot, os.Geteuid()),
		slots: make(chan struct{}, max(s.MaxInFlight, 1)),
	}
	// Runs outlive ctx by the grace: their context is ctx's values only,
	// cancelled after the grace.
	runCtx, cancelRuns := context.WithCancelCause(context.WithoutCancel(ctx))
	st.runCtx = runCtx
	defer cancelRuns(nil)

	acceptDone := make(chan error, 1)
	go func() { acceptDone <- st.acceptLoop(l) }()

	var acceptErr error
	acceptEnded := false
	select {
	case <-ctx.Done():
	case acceptErr = <-acceptDone:
		acceptEnded = true
	}
	// From here on the accept loop counts no connection in st.conns (it
	// answers 'F' itself), so that Wait never races an Add.
	st.mu.Lock()
	st.stopping.Store(true)
	st.mu.Unlock()
	if s.stopped != nil {
		s.stopped()
	}
	finished := make(chan struct{})
	go func() { st.conns.Wait(); close(finished) }()
	grace := s.Grace
	if grace < 0 {
		grace = 0
	}
	timer := time.NewTimer(grace)
	defer timer.Stop()
	select {
	case <-finished:
	case <-timer.C:
		// A wait still going is handed back to its relay (no answer, see
		// handle), its queue entry kept: the hook the relay runs itself
		// finds it and waits on in its place.
		cancelRuns(fmt.Errorf("%w: the hook server stopped and its grace for running hooks ended", hook.ErrHandOver))
		<-finished
	}
	_ = l.Close()
	if !acceptEnded {
		// It ends with the close, stopping: nil.
		acceptErr = <-acceptDone
	}
	return acceptErr
}

// serving is one Serve's state.
type serving struct {
	s     *Server
	run   Runner
	check peerCheck
	slots chan struct{}
	conns sync.WaitGroup
	// mu orders the accept loop's conns.Add against the stop's setting
	// stopping (after which Serve waits on conns).
	mu       sync.Mutex
	stopping atomic.Bool
	runCtx   context.Context
}

func (st *serving) acceptLoop(l *net.UnixListener) error {
	var backoff time.Duration
	for {
		c, err := l.AcceptUnix()
		if err != nil {
			if st.stopping.Load() || errors.Is(err, net.ErrClosed) {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			// EMFILE and its kin pass; anything else ends the server (the
			// relays fall back meanwhile).
			if errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) || errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM) {
				// As net/http does: back off, so that the loop does not spin
				// while no descriptor is free.
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				st.s.logf("%s serve: accept: %v; the relays fall back meanwhile; retrying in %v", st.s.Program, err, backoff)
				time.Sleep(backoff)
				continue
			}
			return fmt.Errorf("accept hook relay connections: %w", err)
		}
		backoff = 0
		// Answered without reading the request: a relay reads the
		// acknowledgement after sending, and falls back either way.
		st.mu.Lock()
		if st.stopping.Load() {
			st.mu.Unlock()
			// Not logged: a stop answers every relay that connects
			// alike, and a probe whether a server answers (Listen's)
			// is no relay.
			st.answerFallBack(c, "the hook server is stopping")
			continue
		}
		select {
		case st.slots <- struct{}{}:
		default:
			st.mu.Unlock()
			st.fallBack(c, 0, fmt.Sprintf("the hook server has %d requests in flight, its bound", cap(st.slots)))
			continue
		}
		st.conns.Add(1)
		st.mu.Unlock()
		go func() {
			defer st.conns.Done()
			defer func() { <-st.slots }()
			st.handle(c)
		}()
	}
}

// fallBack answers 'F' with reason, logs it, and closes c.
func (st *serving) fallBack(c *net.UnixConn, pid int32, reason string) {
	st.s.logf("%s serve: relay pid %d falls back: %s", st.s.Program, pid, reason)
	st.answerFallBack(c, reason)
}

// answerFallBack answers 'F' with reason and closes c.
func (st *serving) answerFallBack(c *net.UnixConn, reason string) {
	_ = c.SetWriteDeadline(time.Now().Add(writeTimeout))
	_, _ = c.Write(AppendFallBack(nil, reason))
	_ = c.Close()
}

func (st *serving) handle(c *net.UnixConn) {
	cred, err := credentials(c)
	if err != nil {
		st.fallBack(c, 0, err.Error())
		return
	}
	readTimeout := st.s.ReadTimeout
	if readTimeout <= 0 {
		readTimeout = DefaultReadTimeout
	}
	_ = c.SetReadDeadline(time.Now().Add(readTimeout))
	started := time.Now()
	// A request is a few KiB (the OCI state); bufio grows nothing, a
	// larger one is read through in more calls.
	br := bufio.NewReaderSize(c, 4<<10)
	q, err := ReadRequest(br)
	if errors.Is(err, io.EOF) {
		// Closed before a byte: a probe whether a server answers (Listen's
		// own, another server's starting), nothing to log.
		_ = c.Close()
		return
	}
	if err != nil {
		// Malformed, cut short or too slow: no answer, the relay falls back.
		st.s.logf("%s serve: relay pid %d: %v; closed without an answer", st.s.Program, cred.Pid, err)
		_ = c.Close()
		return
	}
	if n := br.Buffered(); n > 0 {
		// A relay sends nothing after its request until the 'A': bytes
		// already here are not a relay of this protocol.
		st.s.logf("%s serve: relay pid %d: %d bytes after its request, before the acknowledgement; closed without an answer", st.s.Program, cred.Pid, n)
		_ = c.Close()
		return
	}
	if st.stopping.Load() {
		st.fallBack(c, cred.Pid, "the hook server is stopping")
		return
	}
	if err := st.check.check(cred); err != nil {
		st.fallBack(c, cred.Pid, err.Error())
		return
	}
	inv, err := hook.ParseArgs(st.s.Program, q.Args)
	if err != nil {
		st.fallBack(c, cred.Pid, fmt.Sprintf("arguments %q: %v (the hook itself answers them)", q.Args, err))
		return
	}
	if why := relativePaths(inv, q.Env); why != "" {
		st.fallBack(c, cred.Pid, why)
		return
	}
	// The runtime's hook timeout counts from the relay's start: before its
	// stdin read and its connect, which may have waited in a full backlog.
	inv.Options.Started = liveness.StartedAt(st.check.procRoot, int(cred.Pid), started)
	_ = c.SetWriteDeadline(time.Now().Add(writeTimeout))
	if _, err := c.Write(AppendAccept(nil)); err != nil {
		st.s.logf("%s serve: relay pid %d: send the acknowledgement: %v", st.s.Program, cred.Pid, err)
		_ = c.Close()
		return
	}

	// Nothing runs before the relay's go-ahead: a relay whose timeout
	// ended before the 'A' came runs the hook itself and closes instead.
	if err := readGoAhead(c, readTimeout); err != nil {
		st.s.logf("%s serve: relay pid %d: no go-ahead after the acknowledgement (%v); nothing ran, the relay runs the hook itself",
			st.s.Program, cred.Pid, err)
		_ = c.Close()
		return
	}

	// The relay sends nothing more: a read that returns means it is gone
	// (the runtime killed it), and nobody waits for this answer any more.
	ctx, cancel := context.WithCancelCause(st.runCtx)
	defer cancel(nil)
	_ = c.SetReadDeadline(time.Time{})
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		var b [1]byte
		_, err := c.Read(b[:])
		if err == nil {
			err = errors.New("it sent more than its request")
		}
		cancel(fmt.Errorf("the hook relay (pid %d) hung up (%w): nobody waits for the answer", cred.Pid, err))
	}()

	var stderr tailBuffer
	code := st.run(ctx, inv, hook.Process{Pid: int(cred.Pid), Env: q.Env}, bytes.NewReader(q.Stdin), &stderr)
	if cause := context.Cause(ctx); cause != nil && ctx.Err() != nil && st.runCtx.Err() == nil {
		st.s.logf("%s serve: relay pid %d: %v", st.s.Program, cred.Pid, cause)
	}
	if code != 0 && st.runCtx.Err() != nil {
		// The server stopped and cancelled this run (a --wait still
		// queued, most likely): its refusal says so, not what the hook
		// decides. No answer: the relay runs the hook itself, which finds
		// the queue entry the cancelled run kept (hook.ErrHandOver) and
		// waits on in its place. An admission that ended as the grace did
		// is answered.
		st.s.logf("%s serve: relay pid %d: the server stopped while its hook ran (exit code %d); closed without an answer, the relay runs the hook itself",
			st.s.Program, cred.Pid, code)
		_ = c.Close()
		<-readerDone
		return
	}
	_ = c.SetWriteDeadline(time.Now().Add(writeTimeout))
	if _, err := c.Write(AppendResult(nil, code, stderr.Bytes())); err != nil && ctx.Err() == nil {
		st.s.logf("%s serve: relay pid %d: send the result (exit code %d): %v", st.s.Program, cred.Pid, code, err)
	}
	_ = c.Close()
	<-readerDone
}

// readGoAhead reads the relay's one byte after an 'A' within timeout: nil
// for GoAhead; an error for anything else, the connection closed (io.EOF)
// or the timeout passing.
func readGoAhead(c *net.UnixConn, timeout time.Duration) error {
	_ = c.SetReadDeadline(time.Now().Add(timeout))
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return err
	}
	if b[0] != GoAhead {
		return fmt.Errorf("%w: go-ahead: %q is not %q", ErrMalformed, b[0], GoAhead)
	}
	return nil
}

// tailBuffer keeps the last MaxStderr bytes written to it: a hook's verdict
// line comes last, after any progress lines of a wait.
type tailBuffer struct {
	b []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.b = append(t.b, p...)
	if over := len(t.b) - MaxStderr; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	return len(p), nil
}

func (t *tailBuffer) Bytes() []byte { return t.b }
