package proxy

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/stats"
)

// Accepting: the connection cap and accept failures.
//
// At Config.MaxConns open connections an accept loop stops calling
// accept(2) until a connection ends: new connections wait in the kernel's
// accept queue (and, past its backlog, SYNs are retried by the client's
// kernel), as with HAProxy's maxconn. A failing accept (EMFILE, ENFILE,
// ENOBUFS) backs off, 5 ms doubling to 500 ms, or until a connection ends,
// whichever comes first: never a spin. Each of the two is logged once per
// episode, when it begins and when it ends, not once per connection.

// fdsPerConn: what one busy client connection holds: its socket and an
// upstream socket (a splice pipe is held only during a splice call, and
// an idle keep-alive connection holds one), as HAProxy counts maxconn.
const fdsPerConn = 2

// fdReserve: descriptors kept for everything else (listeners, admin, health
// checks, BPF maps, spawned workers' pipes, logs): 256, or an eighth of a
// small limit.
func fdReserve(nofile uint64) uint64 { return min(256, nofile/8) }

// DefaultMaxConns is the connection cap that keeps busy connections within
// a descriptor limit of nofile: (nofile - reserve) / 2, at least 16, the
// reserve 256 or an eighth of a small limit. Go raises the soft
// RLIMIT_NOFILE to the hard one at start, so nofile is usually the hard
// limit (systemd's LimitNOFILE).
func DefaultMaxConns(nofile uint64) int {
	n := (nofile - fdReserve(nofile)) / fdsPerConn
	if n < 16 {
		return 16
	}
	if n > 1<<30 {
		n = 1 << 30
	}
	return int(n)
}

// NoFile returns this process's soft descriptor limit (0 if unknown).
func NoFile() uint64 {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 0
	}
	return rl.Cur
}

// episodeQuiet: a condition that has not come back for this long is over
// (its end is logged); one that comes back sooner continues its episode.
const episodeQuiet = time.Second

// episode logs a condition that flaps (each freed descriptor lets one
// accept through, and the next fails) once when it begins and once when
// it has been over for episodeQuiet, however often it flaps in between.
type episode struct {
	mu     sync.Mutex
	active bool
	since  time.Time
	count  int
	end    *time.Timer
}

// begin records one occurrence; true when it starts a new episode.
func (e *episode) begin() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.count++
	if e.end != nil && e.end.Stop() {
		e.end = nil
		return false // it came back before the episode was declared over
	}
	if e.active {
		return false
	}
	e.active, e.since, e.count = true, time.Now(), 1
	return true
}

// over says the condition ended; done runs, with the occurrences and the
// episode's length, once it stays ended for episodeQuiet.
func (e *episode) over(done func(n int, d time.Duration)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.active {
		return
	}
	if e.end != nil {
		e.end.Stop()
	}
	e.end = time.AfterFunc(episodeQuiet, func() {
		e.mu.Lock()
		if !e.active {
			e.mu.Unlock()
			return
		}
		e.active, e.end = false, nil
		n, d := e.count, time.Since(e.since)
		e.mu.Unlock()
		done(n, d)
	})
}

// The decisions of both accept loops (Serve's, a loop's accept): the
// back-off after a failing accept and the episodes' log lines.

// acceptFailed records a failing accept (logged when its episode begins)
// and returns the next back-off after last: 5 ms, doubling while under
// 500 ms (so at most 640 ms).
func (s *Server) acceptFailed(err error, last time.Duration) time.Duration {
	if s.acceptFailing.begin() {
		s.counters.AcceptPauses.Add(1)
		s.cfg.Log.Error("accept failing, backing off (too many open files? raise LimitNOFILE / ulimit -n, or lower --max-conns)",
			"err", err, "open", s.counters.Open.Load())
	}
	if last == 0 {
		return 5 * time.Millisecond
	}
	if last < 500*time.Millisecond {
		return 2 * last
	}
	return last
}

// acceptResumed: an accept succeeded after failures.
func (s *Server) acceptResumed() {
	s.acceptFailing.over(func(n int, d time.Duration) {
		s.cfg.Log.Warn("accept resumed", "failures", n, "after", d.Round(time.Millisecond))
	})
}

// capPaused: accepting pauses at MaxConns (logged when its episode begins).
func (s *Server) capPaused(max int) {
	if s.capped.begin() {
		s.counters.AcceptPauses.Add(1)
		s.cfg.Log.Warn("connection limit reached: accepting paused, new connections wait in the kernel's queue",
			"max_conns", max)
	}
}

// capResumed: a place freed under MaxConns after a pause.
func (s *Server) capResumed(max int) {
	s.capped.over(func(n int, d time.Duration) {
		s.cfg.Log.Info("accepting resumed", "max_conns", max, "pauses", n, "over", d.Round(time.Millisecond))
	})
}

var noSlot = new(stats.Slot)

// Serve serves ln until the server closes, counting its connections in
// slot (which may be nil). A TCP listener gets an event loop (loop.go),
// run on the calling goroutine: Serve returns once the server is closing
// and the loop holds no connection. Any other listener (tests wrap one)
// gets an accept loop and a goroutine per connection; Serve returns when
// it is closed.
func (s *Server) Serve(ln net.Listener, slot *stats.Slot) error {
	if slot == nil {
		slot = noSlot
	}
	var l *loop
	if tl, ok := ln.(*net.TCPListener); ok {
		var err error
		if l, err = newLoop(s, tl, slot); err != nil {
			return fmt.Errorf("event loop: %w", err)
		}
	}
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		if l != nil {
			l.release()
		}
		return nil
	}
	s.listeners[ln] = struct{}{}
	if l != nil {
		s.loops[l] = struct{}{}
		s.nloops.Add(1)
	}
	s.accepting.Add(1)
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		if l != nil {
			delete(s.loops, l)
			s.nloops.Add(-1)
		}
		delete(s.placeWaiters, l)
		s.mu.Unlock()
		s.accepting.Done()
	}()
	if l != nil {
		l.run()
		return nil
	}
	var backoff time.Duration
	for {
		if !s.admit() {
			return nil
		}
		nc, err := ln.Accept()
		if err != nil {
			s.unadmit()
			if errors.Is(err, net.ErrClosed) || s.closing.Load() {
				return nil
			}
			backoff = s.acceptFailed(err, backoff)
			s.waitFreed(backoff)
			continue
		}
		if backoff != 0 {
			backoff = 0
			s.acceptResumed()
		}
		tc, ok := nc.(*net.TCPConn)
		if !ok {
			nc.Close()
			s.unadmit()
			continue
		}
		s.counters.Accepted.Add(1)
		s.counters.Open.Add(1)
		slot.Opened()
		c := newConn(s, tc)
		c.slot = slot
		s.mu.Lock()
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go c.serve()
	}
}

// admit reserves a place for the next accepted connection, waiting while
// the server is at Config.MaxConns; false when the server is closing.
func (s *Server) admit() bool {
	max := s.cfg.MaxConns
	s.mu.Lock()
	defer s.mu.Unlock()
	paused := false
	for max > 0 && s.open >= max && !s.closing.Load() {
		if !paused {
			s.capPaused(max)
		}
		paused = true
		s.freed.Wait()
	}
	if s.closing.Load() {
		return false
	}
	if paused {
		s.capResumed(max)
	}
	s.open++ // a place reserved for the connection Accept will return
	return true
}

// tryAdmit is admit for an event loop, which never waits: false when the
// server is closing or at MaxConns (then l is woken when a place frees).
func (s *Server) tryAdmit(l *loop) bool {
	max := s.cfg.MaxConns
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing.Load() {
		return false
	}
	if max > 0 && s.open >= max {
		if !l.paused {
			l.paused = true
			s.capPaused(max)
		}
		s.placeWaiters[l] = false
		return false
	}
	if l.paused {
		l.paused = false
		s.capResumed(max)
	}
	s.open++    // a place reserved for the connection accept will return,
	s.wg.Add(1) // and its count (forget, or unadmit after a failed accept)
	return true
}

// waitForDescriptor wakes l when a connection ends, which frees a
// descriptor (an accept failing for want of them retries then, before its
// backoff ends).
func (s *Server) waitForDescriptor(l *loop) {
	s.mu.Lock()
	s.placeWaiters[l] = true
	s.mu.Unlock()
}

// placeFreedLocked wakes the loops waiting for a place under MaxConns
// and, when a connection ended (closed), those waiting for a descriptor
// (s.mu held). A reservation given back after a failed accept frees a
// place but no descriptor: waking a loop that failed for want of one
// would make it spin.
func (s *Server) placeFreedLocked(closed bool) {
	for l, wantsFD := range s.placeWaiters {
		if wantsFD && !closed {
			continue
		}
		l.freed.Store(true)
		l.wake()
		delete(s.placeWaiters, l)
	}
}

// unadmit gives back a place that admit reserved.
func (s *Server) unadmit() {
	s.mu.Lock()
	s.open--
	s.freed.Broadcast()
	if len(s.placeWaiters) > 0 {
		s.placeFreedLocked(false)
	}
	s.mu.Unlock()
}

// waitFreed waits until a connection ends, the server closes, or d
// passes.
func (s *Server) waitFreed(d time.Duration) {
	fired := false
	t := time.AfterFunc(d, func() {
		s.mu.Lock()
		fired = true
		s.freed.Broadcast()
		s.mu.Unlock()
	})
	s.mu.Lock()
	for gen := s.freedGen; s.freedGen == gen && !fired && !s.closing.Load(); {
		s.freed.Wait()
	}
	s.mu.Unlock()
	t.Stop()
}

// forget removes an ended connection and gives back its place.
func (s *Server) forget(c *conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.open--
	s.counters.Open.Add(-1)
	s.freedGen++
	s.freed.Broadcast()
	if len(s.placeWaiters) > 0 {
		s.placeFreedLocked(true)
	}
	s.mu.Unlock()
	s.wg.Done()
}
