package proxy

// The event loops. Each listener has one: a goroutine locked to its OS
// thread around one epoll set, holding its connections as plain
// non-blocking descriptors (outside the Go runtime's poller), with no
// goroutine per connection. The loop accepts, reads request heads, and
// runs the common exchange itself (loop_exchange.go): a request without a body or
// with a Content-Length one (spliced past the buffered bytes), to a worker
// with a free place, relayed back whatever the response's framing.
// Everything else (a chunked body, Expect: 100-continue, tetherd's own
// endpoints, a queued or learned request, a malformed head, a refused
// connect) is handed to a goroutine that runs the full data path
// (gor_serve.go's conn.serve, the gor_*.go files) on a net.TCPConn lent
// for it, and that gives the connection back once it is idle
// (Config.ParkAfter). Both paths conclude an exchange the same way
// (outcome.go) and share the batching (batch.go), the retry rule
// (upstream.Attempt) and the idle-set rule (upstream.Idle).
//
// Order of work per wake-up (epoll_wait returns):
//  1. client and upstream events, in the order the kernel gives them: a
//     read only after readiness (edge-triggered: a read that fills less
//     than it asked drained the socket), a write until EAGAIN, then wait
//     for EPOLLOUT (registered once with EPOLLET, so it costs nothing
//     until a write blocks);
//  2. the eventfd: connections given back by goroutines (inbox), a freed
//     place under --max-conns, shutdown;
//  3. the reads and writes those queued for the ring, submitted together
//     and completed, until their completions queue nothing more (loop_ring.go;
//     without a ring each was its system call, made where it was asked
//     for; events of a connection with an operation queued wait for it);
//  4. the sweep of deadlines, when one is due: one deadline per
//     connection, checked at most every tick, never a timer syscall
//     (then the ring again).

import (
	"net"
	"net/http"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/uring"
)

// loop is one event loop (one listener).
type loop struct {
	s    *Server
	slot *stats.Slot
	epfd int
	evfd int // eventfd: wakes the loop (inbox, freed place, shutdown)
	lfd  int // the loop's own copy of the listening socket; -1 once it stopped accepting
	seq  uint32

	// nodelay: accepted sockets' TCP_NODELAY comes from the listener (1),
	// is set on each (-1), or is not known yet (0: opened looks).
	nodelay int8

	conns map[int32]*conn   // client sockets the loop holds, by descriptor
	ups   map[int32]*upconn // upstream sockets, by descriptor
	idle  map[*upstream.Pool]*upstream.Idle[*upconn]
	addrs map[*upstream.Pool]unix.Sockaddr // nil value: not numeric (goroutine path)

	mu     sync.Mutex
	inbox  []*conn // given back by goroutines
	stop   bool    // Server.Close: end everything now
	exited bool
	woken  atomic.Bool
	freed  atomic.Bool // a place freed (Server.placeFreedLocked): try accepting again

	now       int64 // UnixNano, once per wake-up
	due       int64 // next sweep (0: none needed)
	lastSweep int64
	tick      int64

	// accepting: paused at MaxConns (until a place frees), or failing
	// (retry at retryAt, backoff doubling).
	paused  bool
	retryAt int64
	backoff time.Duration

	events []unix.EpollEvent

	// The batch of socket operations (loop_ring.go); ring nil: system calls.
	ring  *uring.Ring
	q     []ioOp      // queued since the last submit
	batch []ioOp      // being completed
	res   ioResult    // the completion being replayed
	pipes []*pipe     // free splice pipes (loop_splice.go)
	xs    []*exchange // free exchange states (loop_lend.go)
	// Free heads and head-assembly buffers, lent to busy connections
	// (loop_lend.go).
	reqs  []*httphead.Request
	resps []*httphead.Response
	outs  [][]byte

	// The answer writer and request probeInLoop reuses (local.go).
	probe    *localWriter
	probeReq *http.Request
}

// Registration tokens: an epoll event carries the descriptor and a
// sequence number (Pad), so an event for a descriptor that was closed and
// reused within one batch is recognised and dropped.
const (
	tokListener = 1
	tokWake     = 2
	firstSeq    = 16
)

func (l *loop) nextSeq() uint32 {
	l.seq++
	if l.seq < firstSeq {
		l.seq = firstSeq
	}
	return l.seq
}

// newLoop makes the loop of ln; the listener stays the caller's.
func newLoop(s *Server, ln *net.TCPListener, slot *stats.Slot) (*loop, error) {
	lfd, err := sysconn.DupListener(ln)
	if err != nil {
		return nil, err
	}
	if err := unix.SetNonblock(lfd, true); err != nil {
		unix.Close(lfd)
		return nil, err
	}
	epfd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		unix.Close(lfd)
		return nil, err
	}
	evfd, err := unix.Eventfd(0, unix.EFD_NONBLOCK|unix.EFD_CLOEXEC)
	if err != nil {
		unix.Close(lfd)
		unix.Close(epfd)
		return nil, err
	}
	l := &loop{s: s, slot: slot, epfd: epfd, evfd: evfd, lfd: lfd,
		conns: map[int32]*conn{}, ups: map[int32]*upconn{},
		idle: map[*upstream.Pool]*upstream.Idle[*upconn]{}, addrs: map[*upstream.Pool]unix.Sockaddr{},
		events: make([]unix.EpollEvent, 256)}
	l.tick = int64(s.cfg.tick())
	// Accepted sockets inherit the listener's TCP_NODELAY (checked on the
	// first one, opened): a setsockopt per connection saved.
	if unix.SetsockoptInt(lfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) != nil {
		l.nodelay = -1
	}
	// The loop accepts on its copy; the listener's own descriptor stays
	// registered with the Go runtime's poller, which would then wake on
	// every new connection for nothing: take it out (sysconn.Unpoll).
	if err := sysconn.Control(ln, func(fd int) error { _, err := sysconn.Unpoll(fd, epfd); return err }); err != nil {
		s.cfg.Log.Warn("the listener stays in the runtime's poller (a wake-up per new connection)", "err", err)
	}
	for _, r := range []struct {
		fd  int
		tok int32
	}{{lfd, tokListener}, {evfd, tokWake}} {
		ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLET, Fd: int32(r.fd), Pad: r.tok}
		if err := unix.EpollCtl(epfd, unix.EPOLL_CTL_ADD, r.fd, &ev); err != nil {
			l.release()
			return nil, err
		}
	}
	return l, nil
}

// tick is how often deadlines are looked at: a twentieth of the shortest
// timeout, between 1 ms and 250 ms.
func (c *Config) tick() time.Duration {
	d := min(c.IdleTimeout, c.HeadTimeout, c.ResponseTimeout, c.StreamIdleTimeout, c.IOTimeout) / 20
	return min(max(d, time.Millisecond), 250*time.Millisecond)
}

// wake makes the loop look at its inbox and the server's state.
func (l *loop) wake() {
	if l.woken.CompareAndSwap(false, true) {
		var one = [8]byte{1}
		unix.Write(l.evfd, one[:])
	}
}

// adopt gives c (idle, served by a goroutine until now, its net.TCPConn
// already closed) back to the loop; false if the loop is gone (the caller
// keeps serving it).
func (l *loop) adopt(c *conn) bool {
	l.mu.Lock()
	if l.exited || l.stop {
		l.mu.Unlock()
		return false
	}
	l.inbox = append(l.inbox, c)
	l.mu.Unlock()
	l.wake()
	return true
}

// close makes the loop end every connection and return (Server.Close).
func (l *loop) close() {
	l.mu.Lock()
	l.stop = true
	l.mu.Unlock()
	l.wake()
}

// run serves until the server closes and the loop holds no connection.
func (l *loop) run() {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer l.release()
	l.openRing()
	l.now = time.Now().UnixNano()
	l.accept()
	l.flush()
	lastYield := l.now
	for {
		timeout := -1
		if l.due != 0 {
			timeout = int((l.due - l.now + int64(time.Millisecond) - 1) / int64(time.Millisecond))
			timeout = max(timeout, 0)
		}
		n, err := unix.EpollWait(l.epfd, l.events, timeout)
		l.now = time.Now().UnixNano()
		if err != nil && err != unix.EINTR {
			l.s.cfg.Log.Error("event loop failed", "err", err)
			l.stopAll()
			return
		}
		for i := 0; i < n; i++ {
			ev := &l.events[i]
			switch ev.Pad {
			case tokListener:
				l.accept()
			case tokWake:
				l.woke()
			default:
				if c := l.conns[ev.Fd]; c != nil && c.seq == uint32(ev.Pad) {
					if c.ioq {
						l.deferEvent(c, nil, ev.Events)
					} else {
						l.drive(c, l.clientEvent(c, ev.Events))
					}
				} else if u := l.ups[ev.Fd]; u != nil && u.seq == uint32(ev.Pad) {
					if u.cl != nil && u.cl.ioq {
						l.deferEvent(u.cl, u, ev.Events)
					} else {
						l.upEvent(u, ev.Events)
					}
				}
			}
		}
		l.flush()
		if l.due != 0 && l.now >= l.due {
			l.sweep()
			l.flush()
		}
		if l.finished() {
			return
		}
		if l.now-lastYield > yieldEvery {
			lastYield = l.now
			runtime.Gosched()
		}
	}
}

// woke handles the eventfd: inbox, shutdown, a freed place.
func (l *loop) woke() {
	var b [8]byte
	unix.Read(l.evfd, b[:])
	l.woken.Store(false)
	l.mu.Lock()
	in, stop := l.inbox, l.stop
	l.inbox = nil
	l.mu.Unlock()
	for _, c := range in {
		if l.hold(c) {
			l.drive(c, stepRead)
		}
	}
	if stop {
		return // finished() ends everything
	}
	if l.s.closing.Load() {
		l.stopAccepting()
		l.setDue(l.now) // sweep now: idle connections go (ShutdownGently)
	}
	if l.freed.Swap(false) {
		l.retryAt = 0
		l.accept()
	}
}

// finished ends the loop when the server closed and nothing is left.
func (l *loop) finished() bool {
	l.mu.Lock()
	stop := l.stop
	l.mu.Unlock()
	if stop {
		l.stopAll()
		return true
	}
	if !l.s.closing.Load() || len(l.conns) > 0 {
		return false
	}
	l.mu.Lock()
	if len(l.inbox) > 0 {
		l.mu.Unlock()
		return false
	}
	l.exited = true
	l.mu.Unlock()
	return true
}

// stopAll closes everything the loop holds (Server.Close).
func (l *loop) stopAll() {
	l.mu.Lock()
	l.exited = true
	in := l.inbox
	l.inbox = nil
	l.mu.Unlock()
	for _, c := range in {
		l.hold(c)
	}
	for _, c := range l.conns {
		l.leave(c, leaveClose)
	}
}

// release closes the loop's own descriptors and idle upstream sockets.
func (l *loop) release() {
	l.stopAccepting()
	for _, set := range l.idle {
		for _, u := range set.TakeAll() {
			l.closeUp(u)
			l.s.counters.UpstreamIdle.Add(-1)
		}
	}
	l.idle = map[*upstream.Pool]*upstream.Idle[*upconn]{}
	for _, u := range l.ups {
		l.closeUp(u)
	}
	for _, p := range l.pipes {
		l.putPipe(p, false)
	}
	l.pipes = nil
	l.closeRing()
	unix.Close(l.evfd)
	unix.Close(l.epfd)
}

func (l *loop) stopAccepting() {
	if l.lfd >= 0 {
		unix.Close(l.lfd) // the socket lives on in the listener (and a successor)
		l.lfd = -1
	}
}

// hold puts c in the loop's epoll set; false (and c finished) if it could
// not.
func (l *loop) hold(c *conn) bool {
	c.seq = l.nextSeq()
	c.lp = l
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(c.fd), Pad: int32(c.seq)}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, c.fd, &ev); err != nil {
		c.finish()
		return false
	}
	l.conns[int32(c.fd)] = c
	l.s.counters.Parked.Add(1)
	return true
}

// unhold takes c out of the loop (to a goroutine).
func (l *loop) unhold(c *conn) {
	l.cancelIO(c)
	unix.EpollCtl(l.epfd, unix.EPOLL_CTL_DEL, c.fd, nil)
	delete(l.conns, int32(c.fd))
	l.s.counters.Parked.Add(-1)
	c.deadline = 0
}

// step is what a phase of the loop's work on a connection returns: the
// phase to run next, that the connection waits (for an event, its
// deadline or a ring completion), or how it leaves the loop (an ending,
// which leave carries out). A phase never calls another: it returns it,
// and drive runs it. Nothing touches a connection after an ending was
// returned for it.
type step uint8

const (
	stepWait step = iota // wait for an event, the deadline or a completion
	stepOn               // (inside a phase, between its helpers) go on

	// The phases (loop_exchange.go's header maps them to their files).
	stepRead   // read and parse a request head (next)
	stepRoute  // route it, take a place, connect (begin)
	stepSend   // write the request head up (send)
	stepUpload // splice the rest of the request body up (upload)
	stepRelay  // relay the response, head and body (pump)
	stepFinish // the response ended at its framing (end)
	stepLinger // half-close and drain the client, then close (lingerClose)

	// Endings.
	leaveClose   // close the client connection
	leaveAborted // the client left mid-exchange (counted): close
	leaveHandoff // give the connection to a goroutine (c.hand says where it starts)
)

// ended reports whether st is an ending.
func (st step) ended() bool { return st >= leaveClose }

// drive runs c's phases from st until c waits or leaves the loop (then
// it carries out the ending: leave). Every entry of the loop into a
// connection goes through it: its socket events (clientEvent,
// exchangeEvent), a ring completion (loop_ring.go's complete, which
// re-enters at the phase of the operation's I/O site), a deadline
// (expire), a connection accepted or given back (stepRead).
func (l *loop) drive(c *conn, st step) step {
	for {
		switch st {
		case stepRead:
			st = l.next(c)
		case stepRoute:
			st = l.begin(c)
		case stepSend:
			st = l.send(c)
		case stepUpload:
			st = l.upload(c)
		case stepRelay:
			st = l.pump(c)
		case stepFinish:
			st = l.end(c)
		case stepLinger:
			st = l.lingerClose(c)
		case stepWait, stepOn:
			return stepWait
		default:
			l.leave(c, st)
			return st
		}
	}
}

// leave takes c out of the loop, the one place a connection the loop holds
// ends (gnet's eventloop.close): an exchange still running is abandoned
// (its upstream closed, so the worker sees it), what c queued for the
// ring is withdrawn, then c closes or goes to a goroutine.
func (l *loop) leave(c *conn, why step) {
	if why == leaveAborted {
		l.s.count(countClientAborted)
	}
	l.abandon(c)
	if why == leaveHandoff {
		l.handoff(c)
		return
	}
	l.cancelIO(c)
	delete(l.conns, int32(c.fd))
	l.s.counters.Parked.Add(-1)
	c.finish()
}

// clientEvent handles an event on a client socket.
func (l *loop) clientEvent(c *conn, ev uint32) step {
	if c.linger.on() {
		c.readable = true
		return l.drain(c)
	}
	if c.busy && c.x.phase == phaseUpload {
		if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			c.readable = true // the body, or its end: upload reads to it
			return stepUpload
		}
		return stepWait
	}
	if c.busy {
		if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			// The client left (or half-closed) while its exchange ran:
			// close the upstream at once, so the engine cancels the
			// generation (the watch of the goroutine path, gor_watch.go).
			return leaveAborted
		}
		if ev&unix.EPOLLIN != 0 {
			c.readable = true // pipelined: read once this exchange ends
		}
		if ev&unix.EPOLLOUT != 0 && (len(c.x.pend) > 0 || c.x.sock.blocked) {
			return l.flushClient(c)
		}
		return stepWait
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		// A FIN that came with the request (the client half-closed after
		// sending) is read once the answer went out: the connection
		// then ends instead of waiting out the idle timeout.
		c.hup = c.hup || ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0
		c.readable = true
		return stepRead
	}
	return stepWait
}

// ProcsForLoops raises GOMAXPROCS to one more than the event loops (unless
// the GOMAXPROCS variable fixes it), and returns the value in force. A
// loop blocks in epoll_wait on its own thread, its P held in a syscall;
// with no P idle, the runtime's sysmon takes that P away, and the loop
// must win one back each time it wakes: futex wake-ups and context
// switches on every pass. One P more keeps one idle (bench/measurements.md,
// "The event loop").
func ProcsForLoops(loops int) int {
	n := runtime.GOMAXPROCS(0)
	if os.Getenv("GOMAXPROCS") != "" || n > loops {
		return n
	}
	runtime.GOMAXPROCS(loops + 1)
	return loops + 1
}

// yieldEvery: a busy loop goes through the scheduler this often, a little
// under the 10 ms after which the runtime's sysmon preempts a goroutine
// that has not been scheduled (and takes the P of one in a system call
// with it, each take setting sysmon back to waking at its shortest
// period): a loop goroutine, always running or in epoll_wait, would
// otherwise keep sysmon from ever sleeping long (bench/measurements.md,
// "The event loop").
const yieldEvery = int64(8 * time.Millisecond)
