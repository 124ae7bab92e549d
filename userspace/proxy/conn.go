package proxy

import (
	"context"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// conn is one client connection. Its state is explicit (buffer, offsets,
// parsed head) rather than held in a call stack, so that buffers can be
// released while it is idle.
type conn struct {
	s  *Server
	c  *net.TCPConn // while a goroutine serves it (under s.mu): a duplicate of fd lent to the net package
	ip netip.Addr   // client address for X-Forwarded-For

	// In an event loop (loop*.go): the socket, the loop, its
	// registration, the one deadline (UnixNano, 0: none), and the
	// exchange the loop runs (x, while busy).
	fd        int // -1: a goroutine-only connection (a listener that is not TCP)
	lp        *loop
	seq       uint32
	linger    lingering // on: answered and half-closed; what the client still sends is read and dropped (linger.go)
	readable  bool      // the socket may hold bytes (an edge not yet drained)
	peekWait  bool      // a whole head waits for the body bytes the router reads (Config.PeekBody)
	hup       bool      // the peer's FIN (or an error) was signalled: read to it
	busy      bool      // x is running
	ioq       bool      // an operation of its is queued for the loop's ring (loop_ring.go)
	peekAsked bool      // buf's length ends at the body bytes the router asked for (peek.go)
	deadline  int64
	headSince int64     // when the head now being read began (0: none)
	x         *exchange // the loop's exchange, while busy (from the loop's free list)

	buf  []byte // client bytes read and not yet consumed: buf[r:w]
	r, w int
	out  []byte // outgoing head assembly (both directions)
	ubuf []byte // upstream read buffer, for one exchange

	// The parsed heads, while a request is being served: an idle
	// connection on a loop gives them (and out) back to the loop's free
	// lists (loop.takeBack).
	req  *httphead.Request
	resp *httphead.Response

	slot      *stats.Slot  // counted in: Finished when the connection ends
	idleSince atomic.Int64 // when it began waiting (UnixNano)

	// What only a goroutine serving c uses: allocated when one takes c
	// (newConn, loop.handoff), dropped when c goes back to its loop, so
	// that a connection the loop holds (most of them, idle) is small.
	*gor
}

// gor is the part of a connection that only the goroutine path uses.
type gor struct {
	raw  syscall.RawConn // c's
	hand handoff         // where the goroutine starts (set by the loop)

	idle atomic.Bool // waiting for a request with nothing buffered
	// wantPark: readHead found the connection idle for ParkAfter; serve
	// gives it back to its loop. noPark: it could not, wait with a
	// goroutine.
	wantPark, noPark bool

	// Client watch during an exchange (see watchClient).
	watchTimer *time.Timer
	watchWG    sync.WaitGroup
	watchUp    *upstream.Conn     // closed when the client leaves (proxied)
	watchStop  context.CancelFunc // called when the client leaves (local)
	watchGone  atomic.Bool
	watchFn    func(uintptr) bool

	lr io.LimitedReader // the splice source of conn.move, reused

	rt routeNote // the decision noted for the next exchange (noteRoute), which takes it (exchange.rt)

	// learn is shown the response body bytes that conn.move copies to the
	// client while the exchange's route.Learner still wants them (see
	// exchange.learn); nil otherwise.
	learn *route.Learner

	idleFn  func(uintptr) bool // readIdle's callback, bound once
	idleErr error
}

func newConn(s *Server, tc *net.TCPConn) *conn {
	c := &conn{s: s, c: tc, fd: -1, gor: new(gor)}
	c.raw, _ = tc.SyscallConn()
	if a, ok := tc.RemoteAddr().(*net.TCPAddr); ok {
		c.ip = a.AddrPort().Addr().Unmap().WithZone("")
	}
	tc.SetNoDelay(true)
	return c
}

// reqp returns the request head to parse into.
func (c *conn) reqp() *httphead.Request {
	if c.req == nil {
		c.req = new(httphead.Request)
	}
	return c.req
}

// respp returns the response head to parse into.
func (c *conn) respp() *httphead.Response {
	if c.resp == nil {
		c.resp = new(httphead.Response)
	}
	return c.resp
}

// wakeIfIdle makes an idle connection's read return so that it sees the
// server closing, if it has been idle for at least grace (see
// Server.ShutdownGently). Called under s.mu; a connection its loop holds
// is the loop's to close.
func (c *conn) wakeIfIdle(grace time.Duration) {
	if c.c != nil && c.idle.Load() && (grace <= 0 || time.Since(time.Unix(0, c.idleSince.Load())) >= grace) {
		c.c.SetReadDeadline(aLongTimeAgo)
	}
}

// attach lends the loop's socket to the net package for this goroutine;
// false if the server closed (or the socket could not be lent).
func (c *conn) attach() bool {
	tc, err := sysconn.TCPConn(c.fd)
	if err != nil {
		c.s.cfg.Log.Warn("connection dropped: its socket could not be lent to a goroutine", "err", err)
		return false
	}
	tc.SetNoDelay(true)
	raw, _ := tc.SyscallConn()
	c.s.mu.Lock()
	if c.s.closed {
		c.s.mu.Unlock()
		tc.Close()
		return false
	}
	c.c, c.raw = tc, raw
	c.s.conns[c] = struct{}{} // the goroutines' connections: Close and ShutdownGently reach them
	c.s.mu.Unlock()
	return true
}

// detach gives an idle connection back to its loop; false if it has none
// (or the loop is gone: then c.c is lent again, or nil if that failed).
func (c *conn) detach() bool {
	if c.lp == nil {
		return false
	}
	c.s.mu.Lock()
	tc := c.c
	c.c = nil
	delete(c.s.conns, c)
	c.s.mu.Unlock()
	tc.Close()  // the duplicate: the loop's descriptor stays open
	c.gor = nil // idle: its watch is stopped, its timer unreferenced
	if c.lp.adopt(c) {
		return true
	}
	c.gor = new(gor)
	c.attach()
	return false
}

// finish releases an ended connection.
func (c *conn) finish() {
	if c.gor != nil && c.watchTimer != nil {
		c.watchTimer.Stop()
	}
	c.s.mu.Lock()
	tc := c.c
	c.c = nil
	c.s.mu.Unlock()
	if tc != nil {
		tc.Close()
	}
	if c.fd >= 0 {
		unix.Close(c.fd)
		c.fd = -1
	}
	if c.buf != nil {
		c.s.putBuf(c.buf)
		c.buf = nil
	}
	if c.ubuf != nil {
		c.s.putBuf(c.ubuf)
		c.ubuf = nil
	}
	c.slot.Finished()
	c.s.forget(c)
}

// appendUpstreamHead appends the rewritten request head: origin-form
// target, HTTP/1.1, hop-by-hop fields removed, everything else
// byte-identical, the DP rank named (appendRankHeader), X-Forwarded-For
// appended.
func (c *conn) appendUpstreamHead(out []byte, w *worker.Worker, rt *routeNote) []byte {
	req := c.req
	out = append(out, req.Method...)
	out = append(out, ' ')
	out = append(out, req.Path...)
	out = append(out, " HTTP/1.1\r\n"...)
	at, field := c.rankInBody(w, *rt)
	rt.inBody, rt.bodyAt = at >= 0, int32(at)
	for i := range req.Fields {
		if f := &req.Fields[i]; !f.Drop && !(rt.inBody && httphead.EqualFold(f.Name, "Content-Length")) {
			out = append(out, f.Line...)
		}
	}
	if rt.inBody {
		out = append(out, "Content-Length: "...)
		out = strconv.AppendInt(out, req.ContentLength+rankFieldLen(field, rt.rank), 10)
		out = append(out, "\r\n"...)
	}
	if req.HostRewritten || req.Host == nil {
		host := req.Host
		if host == nil {
			host = []byte(w.Addr)
		}
		out = append(out, "Host: "...)
		out = append(out, host...)
		out = append(out, "\r\n"...)
	}
	out = appendRankHeader(out, w, *rt)
	out = append(out, "X-Forwarded-For: "...)
	if len(req.XFF) > 0 {
		out = append(out, req.XFF...)
		out = append(out, ", "...)
	}
	if c.ip.IsValid() {
		out = c.ip.AppendTo(out)
	}
	return append(out, "\r\n\r\n"...)
}
