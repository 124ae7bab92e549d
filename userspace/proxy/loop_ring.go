package proxy

// The loop's socket reads and writes, batched through an io_uring
// (userspace/uring) when the kernel lets the loop have one: a wake-up's
// reads and writes, across all its connections, go to the kernel in one
// io_uring_enter instead of one recvfrom or sendto each. Every one is
// MSG_DONTWAIT, so it completes within that call with what the system
// call would have returned; nothing stays in flight across flush.
//
// The state machines are not rewritten for it. An I/O site asks the loop
// for its result (recv, sendUp, writeClient). Where the loop batches, the
// operation is queued and the site returns as if it had to wait
// (errQueued: its phase returns stepWait); after the batch is submitted,
// the completion drives the connection again from the phase of that site
// (resumeAt: stepRead, stepRelay or stepSend: next, pump or send), which
// walks to the same site, with the same buffer, and is handed the
// completed result there (replay), exactly once; a replay that lands
// elsewhere is a bug (ringBug; strictRing in the tests). A client write needs no replay:
// queued, it is pending output (x.pend, as after EAGAIN) and its
// completion is what EPOLLOUT would have been (sentClient).
//
// Invariants: a connection has at most one operation queued (conn.ioq);
// events for it that arrive meanwhile wait on that operation (deferEvent)
// and are handled after its completion; a connection that closes or is
// handed to a goroutine withdraws what it has queued (cancelIO: a NOP in
// the kernel's queue, so neither its descriptor, perhaps reused, nor its
// buffer, perhaps lent again, is touched).

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/uring"
)

// ringEntries bounds one batch; past it the loop makes the system call
// itself.
const ringEntries = 256

// The operations a loop batches, by their I/O site.
const (
	opRead    = 1 + iota // client bytes into c.buf (read, entry next)
	opUpRecv             // response bytes into c.ubuf (pump)
	opUpSend             // the request up (send)
	opCliSend            // response bytes to the client (writeClient, sentClient)
)

// resumeAt is the phase a completed operation re-enters (drive), the
// one whose I/O site queued it.
func resumeAt(op uint8) step {
	switch op {
	case opRead:
		return stepRead // next → read
	case opUpRecv:
		return stepRelay // pump
	case opUpSend:
		return stepSend // send
	}
	return stepWait
}

// errQueued: the operation went into the loop's batch; its completion
// runs the connection's phases again from the one that queued it.
var errQueued = errors.New("queued for the ring")

// Test hooks: strictRing makes a broken invariant panic instead of
// failing one connection with a log line; noRing runs every loop on
// system calls (go test -args -syscalls: the fallback path's suite).
var strictRing, noRing bool

// ioOp is one queued operation.
type ioOp struct {
	c    *conn // nil: withdrawn
	op   uint8
	slot uint32 // its submission queue entry (uring.Ring.Cancel)
	ptr  *byte  // the buffer, checked at replay
	n    int
	res  int32
	// Events for c's client socket (evc) and its upstream socket u (evu,
	// while exchange ux had it) that arrived while the operation was
	// queued.
	evc, evu uint32
	u        *upconn
	ux       uint32
}

// ioResult is the completion being replayed (c nil: none).
type ioResult struct {
	c   *conn
	op  uint8
	ptr *byte
	n   int
	res int32
}

// openRing gives the loop its ring (on the loop's own thread: the ring is
// single-issuer); without one the loop makes each system call itself.
func (l *loop) openRing() {
	if !l.s.cfg.Ring.Or(true) || noRing {
		return
	}
	r, err := uring.New(ringEntries)
	if err != nil {
		l.s.ringOnce.Do(func() {
			l.s.cfg.Log.Info("event loops make their socket calls one by one: no io_uring here", "err", err)
		})
		return
	}
	l.ring = r
	l.q = make([]ioOp, 0, ringEntries)
	l.batch = make([]ioOp, 0, ringEntries)
}

func (l *loop) closeRing() {
	if l.ring != nil {
		l.ring.Close()
		l.ring = nil
	}
}

// recv reads from fd into p for c's operation op: the completed result
// being replayed, a queued read (errQueued), or recvfrom's.
func (l *loop) recv(c *conn, op uint8, fd int, p []byte) (int, error) {
	if l.res.c == c {
		return l.replay(c, op, p)
	}
	if l.queue(c, op, fd, p, false) {
		return 0, errQueued
	}
	return sysconn.Recv(fd, p)
}

// sendUp writes p to c's upstream socket fd (as recv).
func (l *loop) sendUp(c *conn, fd int, p []byte) (int, error) {
	if l.res.c == c {
		return l.replay(c, opUpSend, p)
	}
	if l.queue(c, opUpSend, fd, p, true) {
		return 0, errQueued
	}
	return sysconn.Send(fd, p)
}

// queue puts an operation in the batch; false: the caller makes the
// system call (no ring, a full batch, an empty buffer).
func (l *loop) queue(c *conn, op uint8, fd int, p []byte, send bool) bool {
	if l.ring == nil || len(p) == 0 || len(l.q) == cap(l.q) {
		return false
	}
	if c.ioq {
		l.ringBug(c, fmt.Sprintf("a second operation (%d) on a connection with one queued", op))
		return false
	}
	data := uint64(len(l.q))
	var slot uint32
	var err error
	if send {
		slot, err = l.ring.Send(fd, p, data)
	} else {
		slot, err = l.ring.Recv(fd, p, data)
	}
	if err != nil {
		return false
	}
	l.q = append(l.q, ioOp{c: c, op: op, slot: slot, ptr: &p[0], n: len(p)})
	c.ioq = true
	return true
}

// replay hands the I/O site the result of the operation it queued.
func (l *loop) replay(c *conn, op uint8, p []byte) (int, error) {
	r := l.res
	l.res = ioResult{}
	if r.op != op || len(p) == 0 || r.ptr != &p[0] || r.n != len(p) {
		l.ringBug(c, fmt.Sprintf("replay of operation %d met operation %d (%d bytes)", r.op, op, len(p)))
		return -1, unix.EIO // this connection fails; no byte is lost silently
	}
	if r.res < 0 {
		return -1, unix.Errno(-r.res)
	}
	return int(r.res), nil
}

func (l *loop) ringBug(c *conn, what string) {
	if strictRing {
		panic("proxy ring: " + what)
	}
	l.s.cfg.Log.Error("event loop: internal error, the connection fails", "err", what, "fd", c.fd)
}

// deferEvent keeps an event for c (u: on c's upstream socket) until c's
// queued operation (in the queue, or in the batch being completed)
// completes.
func (l *loop) deferEvent(c *conn, u *upconn, ev uint32) {
	for _, q := range [][]ioOp{l.q, l.batch} {
		for i := range q {
			e := &q[i]
			if e.c != c {
				continue
			}
			if u != nil {
				if e.evu != 0 && e.u != u {
					// Cannot happen: while c's operation is queued its
					// exchange, and so its upstream socket, stays.
					l.ringBug(c, "two upstream sockets' events waiting")
				}
				e.evu |= ev
				e.u = u
				if c.x != nil {
					e.ux = c.x.id
				}
			} else {
				e.evc |= ev
			}
			return
		}
	}
	l.ringBug(c, "an event for a connection with nothing queued")
}

// cancelIO withdraws what c has queued.
func (l *loop) cancelIO(c *conn) {
	if !c.ioq {
		return
	}
	c.ioq = false
	for i := range l.q {
		if e := &l.q[i]; e.c == c {
			l.ring.Cancel(e.slot)
			e.c = nil
		}
	}
	for i := range l.batch {
		if e := &l.batch[i]; e.c == c {
			e.c = nil // completed in the kernel; its result is dropped
		}
	}
	if l.res.c == c {
		l.res = ioResult{}
	}
}

// flush submits the batch and completes it, until the completions queue
// nothing more.
func (l *loop) flush() {
	for l.ring != nil && len(l.q) > 0 {
		l.batch, l.q = l.q, l.batch[:0]
		cs, err := l.ring.Submit()
		l.s.counters.RingOps.Add(uint64(len(l.batch)))
		l.s.counters.RingSubmits.Add(1)
		if err != nil {
			// The ring broke (it should not): what was submitted is
			// unknown, so those connections fail; the loop goes on
			// with system calls.
			l.s.cfg.Log.Error("event loop: io_uring failed; back to system calls", "err", err)
			for i := range l.batch {
				l.batch[i].res = -int32(unix.EIO)
			}
			l.closeRing()
		}
		for _, cp := range cs {
			if int(cp.Data) < len(l.batch) {
				l.batch[cp.Data].res = cp.Res
			}
		}
		for i := range l.batch {
			if e := &l.batch[i]; e.c != nil {
				l.complete(e)
				e.c = nil // done: deferEvent looks for pending ones only
			}
		}
		l.batch = l.batch[:0]
	}
}

// complete runs a completed operation's connection on, then the events
// that waited for it.
func (l *loop) complete(e *ioOp) {
	c := e.c
	c.ioq = false
	// An ending returned by c's continuation says c is gone (closed, or
	// with a goroutine that may now be using it): nothing more here.
	var st step
	if e.op == opCliSend {
		st = l.drive(c, l.sentClient(c, e.res))
	} else {
		l.res = ioResult{c: c, op: e.op, ptr: e.ptr, n: e.n, res: e.res}
		st = l.drive(c, resumeAt(e.op))
		if l.res.c != nil {
			l.res = ioResult{}
			l.ringBug(c, fmt.Sprintf("operation %d completed and was never taken", e.op))
			if !st.ended() {
				l.leave(c, leaveClose)
			}
			return
		}
	}
	// The events that waited: c's own (unless c is gone: closed, or with
	// a goroutine), then its upstream socket's.
	if e.evc != 0 && !st.ended() {
		if c.ioq {
			l.deferEvent(c, nil, e.evc)
		} else {
			l.drive(c, l.clientEvent(c, e.evc))
		}
	}
	if e.evu != 0 {
		l.upDeferred(e.u, e.ux, e.evu)
	}
}

// upDeferred delivers an event of upstream socket u that waited while
// exchange ux had it. If that exchange ended meanwhile, the readiness it
// reported was that exchange's (read, or moot): a socket now idle is
// dropped only if the worker closed it or wrote unasked (a peek says
// which), and a socket another exchange took gets only the hang-up.
func (l *loop) upDeferred(u *upconn, ux uint32, ev uint32) {
	if u.fd < 0 || l.ups[int32(u.fd)] != u {
		return // closed meanwhile
	}
	const hup = unix.EPOLLRDHUP | unix.EPOLLHUP | unix.EPOLLERR
	c := u.cl
	if c == nil {
		if ev&hup != 0 || sysconn.Peek(uintptr(u.fd)) != sysconn.PeekEmpty {
			l.dropIdle(u)
		}
		return
	}
	if c.x == nil || c.x.id != ux {
		if ev &= hup; ev == 0 {
			return
		}
	}
	if c.ioq {
		l.deferEvent(c, u, ev)
		return
	}
	l.upEvent(u, ev)
}

// sentClient is the completion of a queued client write (x.pend): what
// EPOLLOUT's flushClient would do after its write.
func (l *loop) sentClient(c *conn, res int32) step {
	x := c.x
	if res < 0 && res != -int32(unix.EAGAIN) {
		return leaveAborted
	}
	if res > 0 {
		x.pend = x.pend[res:]
	}
	if len(x.pend) > 0 {
		// The socket is full: the rest goes on EPOLLOUT (flushClient).
		l.setDeadline(c, l.s.cfg.IOTimeout)
		return stepWait
	}
	x.pend = nil
	if x.phase == phaseBody {
		l.setDeadline(c, l.bodyTimeout(x))
	}
	return stepRelay
}
