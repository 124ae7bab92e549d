package proxy

import (
	"bytes"
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
)

// conn is one client connection. Its state is explicit (buffer, offsets,
// parsed head) rather than held in a call stack, so that buffers can be
// released while it is idle.
type conn struct {
	s   *Server
	c   *net.TCPConn
	raw syscall.RawConn
	ip  []byte // client address for X-Forwarded-For

	buf  []byte // client bytes read and not yet consumed: buf[r:w]
	r, w int
	out  []byte // outgoing head assembly (both directions)
	ubuf []byte // upstream read buffer, for one exchange

	req  httphead.Request
	resp httphead.Response

	idle atomic.Bool // waiting for a request with nothing buffered
	// wantPark: readHead found the connection idle for ParkAfter; serve
	// parks it. noPark: parking failed once, wait with a goroutine.
	wantPark, noPark bool
	resumed          bool         // back from the parker: wait out the idle timeout here
	slot             *stats.Slot  // counted in: Finished when the connection ends
	idleSince        atomic.Int64 // when it began waiting (UnixNano)

	// Client watch during an exchange (see watchClient).
	watchTimer *time.Timer
	watchWG    sync.WaitGroup
	watchUp    *upstream.Conn     // closed when the client leaves (proxied)
	watchStop  context.CancelFunc // called when the client leaves (local)
	watchGone  atomic.Bool
	watchFn    func(uintptr) bool

	lr io.LimitedReader // the splice source of conn.move, reused

	// learn is shown the response body bytes that conn.move copies to the
	// client while the exchange's route.Learner still wants them (see
	// exchange.learn); nil otherwise.
	learn *route.Learner

	idleFn  func(uintptr) bool // readIdle's callback, bound once
	idleErr error
}

func newConn(s *Server, tc *net.TCPConn) *conn {
	c := &conn{s: s, c: tc}
	c.raw, _ = tc.SyscallConn()
	if a, ok := tc.RemoteAddr().(*net.TCPAddr); ok {
		c.ip = []byte(a.IP.String())
	}
	tc.SetNoDelay(true)
	return c
}

// wakeIfIdle makes an idle connection's read return so that it sees the
// server closing, if it has been idle for at least grace (see
// Server.ShutdownGently).
func (c *conn) wakeIfIdle(grace time.Duration) {
	if c.idle.Load() && (grace <= 0 || time.Since(time.Unix(0, c.idleSince.Load())) >= grace) {
		c.c.SetReadDeadline(aLongTimeAgo)
	}
}

// serve runs the connection until it ends, or until it parks (park.go):
// then the goroutine returns and the parker starts serve again when the
// client sends.
func (c *conn) serve() {
	for {
		ok := c.serveOne()
		if c.wantPark {
			c.wantPark = false
			if p := c.s.parker; p != nil && p.park(c) {
				return // c belongs to the parker now: not one more access
			}
			c.noPark = true // could not: wait here, to the idle timeout
			continue
		}
		// A response that went out before the server began closing
		// promised keep-alive: with an idle grace (ShutdownGently) the
		// next request is still read and answered (with Connection:
		// close).
		if !ok || c.s.closing.Load() && c.s.idleGrace.Load() == 0 {
			break
		}
	}
	c.finish()
}

// finish releases an ended connection.
func (c *conn) finish() {
	if c.watchTimer != nil {
		c.watchTimer.Stop()
	}
	c.c.Close()
	if c.buf != nil {
		c.s.putBuf(c.buf)
		c.buf = nil
	}
	c.slot.Finished()
	c.s.forget(c)
}

// serveOne handles one request; it reports whether the connection may
// carry another.
func (c *conn) serveOne() bool {
	if err := c.readHead(); err != nil {
		if e, ok := err.(*httphead.Error); ok {
			c.s.counters.Rejected.Add(1)
			if bytes.HasPrefix(c.buf[c.r:c.w], h2Preface) {
				c.refuseHTTP2()
				return false
			}
			c.rejectAndClose(e.Status)
		}
		return false
	}
	c.s.counters.Requests.Add(1)
	req := &c.req
	c.r += req.HeadLen

	if h := c.localHandler(); h != nil {
		c.s.counters.Local.Add(1)
		return c.serveLocal(h)
	}
	var peek []byte
	if req.HasBody() {
		peek = c.peekBody()
	}
	if lim := c.s.cfg.MaxBodyBytes; lim > 0 && req.ContentLength > lim {
		// Too large by its own account: 413 before anything is forwarded.
		c.s.counters.Rejected.Add(1)
		c.rejectAndClose(413)
		return false
	}
	dec := c.s.cfg.Router.Route(req, peek)
	defer func() {
		if dec.Done != nil {
			dec.Done()
		}
	}()
	if dec.Worker == nil {
		c.s.counters.Rejected.Add(1)
		// The body was not read: the connection cannot go on after it.
		keep := req.KeepAlive && !req.HasBody()
		resp := errorResponse(dec.Status, !keep)
		if dec.Reason == route.ReasonBadTarget {
			resp = pick(badTargetResponse, !keep)
		}
		if c.writeClient(resp) == nil && req.HasBody() {
			c.lingerClose()
		}
		return keep
	}
	rr, _ := c.s.cfg.Router.(Rerouter)
	keep, refused := c.proxy(dec.Worker, dec.Learn, rr != nil)
	if !refused {
		return keep
	}
	// The worker refused the connection: nothing was sent, so another
	// worker may take the request (once).
	if dec.Done != nil {
		dec.Done()
	}
	dec = rr.Reroute(req, peek, dec)
	if dec.Worker == nil {
		c.s.counters.BadGateway.Add(1)
		c.writeClient(upstreamError(502, false, true))
		return false
	}
	keep, _ = c.proxy(dec.Worker, dec.Learn, false)
	return keep
}

// peekBody returns the body bytes buffered behind the head, first reading
// up to Config.PeekBody of them (never beyond the body, never waiting for
// a client that expects 100 Continue).
func (c *conn) peekBody() []byte {
	req := &c.req
	want := c.s.cfg.PeekBody
	if req.ContentLength >= 0 && int64(want) > req.ContentLength {
		want = int(req.ContentLength)
	}
	if want > len(c.buf)-c.r {
		want = len(c.buf) - c.r
	}
	// A chunked body has no length to wait for: whatever came with the head
	// is enough, else one read. (Waiting for more stalled a client whose
	// whole small body had arrived: TestChunkedBodyWithHead.)
	if !req.Expect100 && c.w-c.r < want && !(req.Chunked && c.w > c.r) {
		c.c.SetReadDeadline(time.Now().Add(c.s.cfg.IOTimeout))
		for c.w-c.r < want {
			n, err := c.c.Read(c.buf[c.w : c.r+want])
			c.w += n
			if err != nil || req.Chunked {
				break
			}
		}
	}
	end := c.w
	if req.ContentLength >= 0 && int64(end-c.r) > req.ContentLength {
		end = c.r + int(req.ContentLength)
	}
	return c.buf[c.r:end]
}

func isPath(path []byte, p string) bool {
	if len(path) < len(p) || string(path[:len(p)]) != p {
		return false
	}
	return len(path) == len(p) || path[len(p)] == '?'
}

// readHead reads until c.buf[c.r:c.w] starts with a complete request head,
// parsed into c.req.
func (c *conn) readHead() error {
	lim := c.s.cfg.Limits
	started := false
	if c.buf != nil && c.r == c.w {
		// Nothing pipelined: the buffer goes back while the client idles.
		c.s.putBuf(c.buf)
		c.buf, c.r, c.w = nil, 0, 0
	}
	for {
		if c.w > c.r {
			err := httphead.ParseRequest(c.buf[c.r:c.w], lim, &c.req)
			if err != httphead.ErrIncomplete {
				return err
			}
		}
		if c.buf == nil {
			// Idle with nothing buffered: wait holding no buffer.
			if c.s.closing.Load() && c.s.idleGrace.Load() == 0 {
				return net.ErrClosed
			}
			now := time.Now()
			if !c.idle.Load() {
				c.idleSince.Store(now.UnixNano())
			}
			c.idle.Store(true)
			// Wait here for ParkAfter, then park (park.go) for the rest
			// of the idle timeout.
			since := time.Unix(0, c.idleSince.Load())
			deadline := since.Add(c.s.cfg.IdleTimeout)
			park := c.s.parker != nil && !c.noPark && !c.resumed && c.s.cfg.ParkAfter < c.s.cfg.IdleTimeout
			if park {
				deadline = since.Add(c.s.cfg.ParkAfter)
			}
			c.c.SetReadDeadline(deadline)
			err := c.readIdle()
			if err != nil {
				if park && isTimeout(err) && !c.s.closing.Load() {
					c.wantPark = true // still idle: serve parks it
					return err
				}
				c.idle.Store(false)
				return err
			}
			c.idle.Store(false)
			c.resumed = false
			continue
		}
		if c.r > 0 {
			c.w = copy(c.buf, c.buf[c.r:c.w])
			c.r = 0
		}
		if c.w == len(c.buf) {
			// A head larger than the pooled buffer: grow up to the limit
			// (ParseRequest answers 431 beyond it).
			nb := make([]byte, 2*len(c.buf))
			copy(nb, c.buf[:c.w])
			c.s.putBuf(c.buf)
			c.buf = nb
		}
		if !started {
			c.c.SetReadDeadline(time.Now().Add(c.s.cfg.HeadTimeout))
			started = true
		}
		n, err := c.c.Read(c.buf[c.w:])
		c.w += n
		if err != nil && n == 0 {
			if c.w > 0 && isTimeout(err) && !c.s.closing.Load() {
				// Slow client in the middle of a head.
				return &httphead.Error{Status: 408, Reason: "head timeout"}
			}
			return err
		}
	}
}

// readIdle waits for the next request without holding a buffer: the read
// is made in a RawConn.Read callback that takes a pooled buffer only when
// bytes (or EOF) are there, and gives it back on EAGAIN before the
// goroutine parks. Same syscalls as a plain Read.
func (c *conn) readIdle() error {
	if c.idleFn == nil {
		c.idleFn = c.idleRead
	}
	c.idleErr = nil
	if err := c.raw.Read(c.idleFn); err != nil {
		return err
	}
	if c.buf == nil {
		return c.idleErr
	}
	return nil
}

// idleRead is readIdle's RawConn.Read callback.
func (c *conn) idleRead(fd uintptr) bool {
	b := c.s.getBuf()
	for {
		n, err := syscall.Read(int(fd), b)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			c.s.putBuf(b)
			return false // park until readable
		case err != nil:
			c.s.putBuf(b)
			c.idleErr = err
		case n == 0:
			c.s.putBuf(b)
			c.idleErr = io.EOF
		default:
			c.buf, c.r, c.w = b, 0, n
		}
		return true
	}
}

// h2Preface starts the connection of an HTTP/2 client with prior
// knowledge (RFC 9113 §3.4).
var h2Preface = []byte("PRI * HTTP/2.0\r\n")

// h2Refusal is what such a client is answered: the server preface (an
// empty SETTINGS frame), then GOAWAY with HTTP_1_1_REQUIRED (0xd) and a
// reason, so that it reports why instead of a dropped connection.
var h2Refusal = func() []byte {
	msg := "tetherd speaks HTTP/1.1 only"
	b := []byte{0, 0, 0, 0x4, 0, 0, 0, 0, 0} // SETTINGS, empty, stream 0
	n := 8 + len(msg)
	b = append(b, byte(n>>16), byte(n>>8), byte(n), 0x7, 0, 0, 0, 0, 0) // GOAWAY, stream 0
	b = append(b, 0, 0, 0, 0)                                           // last stream id
	b = append(b, 0, 0, 0, 0xd)                                         // HTTP_1_1_REQUIRED
	return append(b, msg...)
}()

// refuseHTTP2 answers an HTTP/2 prior-knowledge connection and closes it.
func (c *conn) refuseHTTP2() {
	c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.c.Write(h2Refusal); err != nil {
		return
	}
	c.lingerClose()
}

// rejectAndClose answers status, then half-closes and drains briefly so
// the client reads the answer rather than a reset (checklist "Reject").
func (c *conn) rejectAndClose(status int) {
	c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.c.Write(errorResponse(status, true)); err != nil {
		return
	}
	c.lingerClose()
}

// lingerClose half-closes and reads what the client still sends (at most
// 256 KiB, 500 ms): closing with unread bytes would send a reset that can
// destroy the answer before the client reads it. The caller then closes.
func (c *conn) lingerClose() {
	c.c.CloseWrite()
	c.c.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.Linger))
	var b [4096]byte
	for i := 0; i < 64; i++ {
		if _, err := c.c.Read(b[:]); err != nil {
			return
		}
	}
}

// writeClient writes p to the client with the I/O timeout.
func (c *conn) writeClient(p []byte) error {
	c.c.SetWriteDeadline(time.Now().Add(c.s.cfg.IOTimeout))
	_, err := c.c.Write(p)
	return err
}

// exchange is the state of one proxied request.
type exchange struct {
	w        *route.Worker
	up       *upstream.Conn
	failed   bool // counts as a worker error
	sentHead bool // response head written to the client
	sentUp   bool // some request byte was written to the worker
	reuse    bool // upstream connection may go back to the pool
	keep     bool // client connection may carry another request
	sent100  bool // a 100 Continue went to the client (never a second)
	status   int  // status tether answered itself (fail), for Config.Observe
	// isHead: the request's method was HEAD. Taken before the body is
	// relayed: a chunked body is read into the buffer the head was parsed
	// from, so the head's slices no longer hold the head after it.
	isHead bool
	// reroutable: a refused connect is reported (refused), not answered.
	reroutable, refused bool
	// learn, when the router set one, is shown the final status and the
	// first body bytes before they go to the client (learned session ids:
	// route/learn.go); lsc frames its view of a chunked body.
	learn *route.Learner
	lsc   httphead.Chunked
	// closeDelimited: the client's copy of the response body ends at the
	// connection's close (the worker's did, or an HTTP/1.0 client gets a
	// chunked body dechunked).
	closeDelimited bool
}

// proxy forwards the parsed request to w and relays the response. With
// reroutable set, a worker that refuses the connection gets no answer
// written: proxy reports refused instead, and the caller may place the
// request again.
func (c *conn) proxy(w *route.Worker, learn *route.Learner, reroutable bool) (keep, refused bool) {
	x := exchange{w: w, isHead: c.req.IsMethod("HEAD"), learn: learn, reroutable: reroutable}
	if adm := c.admit(w); adm != route.Admitted {
		return c.notAdmitted(adm), false
	}
	var start time.Time
	if c.s.cfg.Observe != nil {
		start = time.Now()
	}
	w.Stats.Begin()
	keep = c.proxyExchange(&x)
	w.Stats.End(x.failed)
	w.Leave()
	if x.learn != nil && !x.refused {
		c.learn = nil
		x.learn.End()
	}
	if obs := c.s.cfg.Observe; obs != nil && !x.refused {
		st := x.status
		if x.sentHead {
			st = c.resp.Status
		}
		obs(w.Slot, st/100, time.Since(start))
	}
	if x.up != nil {
		if x.reuse {
			w.Pool.Put(x.up)
		} else {
			x.up.Discard()
		}
	}
	if c.ubuf != nil {
		c.s.putBuf(c.ubuf)
		c.ubuf = nil
	}
	return keep, x.refused
}

// admit takes a place among w's requests in flight (route.Worker.Admit):
// at once under its max_in_flight, else after a wait in its queue while
// the client is watched, so a client that leaves frees its place in line.
func (c *conn) admit(w *route.Worker) route.Admission {
	cfg := &c.s.cfg
	if w.MaxInFlight() == 0 && w.Queued() == 0 {
		return w.Admit(cfg.QueueSize, cfg.QueueTimeout, nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	c.s.counters.Queued.Add(1)
	c.watchLocal(cancel)
	adm := w.Admit(cfg.QueueSize, cfg.QueueTimeout, ctx.Done())
	c.stopWatch()
	cancel()
	c.s.counters.Queued.Add(-1)
	c.c.SetReadDeadline(time.Time{})
	return adm
}

// notAdmitted answers a request that got no place with its worker: 503
// with Retry-After (nothing was sent: safe to retry), or nothing if the
// client left. It reports whether the connection may go on.
func (c *conn) notAdmitted(adm route.Admission) bool {
	switch adm {
	case route.QueueLeft:
		c.s.counters.ClientAborted.Add(1)
		return false
	case route.QueueFull:
		c.s.counters.QueueFull.Add(1)
	case route.QueueTimeout:
		c.s.counters.QueueTimeouts.Add(1)
	}
	// The body was not read: the connection cannot go on after it.
	keep := c.req.KeepAlive && !c.req.HasBody()
	if c.writeClient(pick(busyResponse, !keep)) == nil && c.req.HasBody() {
		c.lingerClose()
	}
	return keep
}

func (c *conn) proxyExchange(x *exchange) bool {
	req := &c.req
	cfg := &c.s.cfg
	up, err := x.w.Pool.Get(context.Background())
	if err != nil {
		return c.refusedOrFail(x, err)
	}
	x.up = up

	// The rewritten head: origin-form target, HTTP/1.1, hop-by-hop fields
	// removed, everything else byte-identical, X-Forwarded-For appended.
	out := c.out[:0]
	out = append(out, req.Method...)
	out = append(out, ' ')
	out = append(out, req.Path...)
	out = append(out, " HTTP/1.1\r\n"...)
	for i := range req.Fields {
		if f := &req.Fields[i]; !f.Drop {
			out = append(out, f.Line...)
		}
	}
	if req.HostRewritten || req.Host == nil {
		host := req.Host
		if host == nil {
			host = []byte(x.w.Addr)
		}
		out = append(out, "Host: "...)
		out = append(out, host...)
		out = append(out, "\r\n"...)
	}
	out = append(out, "X-Forwarded-For: "...)
	if len(req.XFF) > 0 {
		out = append(out, req.XFF...)
		out = append(out, ", "...)
	}
	out = append(out, c.ip...)
	out = append(out, "\r\n\r\n"...)

	// Body bytes already buffered behind the head go in the same write,
	// unless the client waits for 100 Continue.
	waitContinue := req.Expect100 && req.HasBody()
	sc := httphead.Chunked{ExtLimit: cfg.Limits.ChunkExt}
	var sent int64 // Content-Length body bytes sent
	if !waitContinue {
		out, sent, err = c.appendBuffered(out, &sc, 0)
		if err != nil {
			c.out = out[:0]
			return c.sendFailed(x, err, 0)
		}
	}
	c.out = out[:0]
	up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
	n, err := up.Write(out)
	if err != nil && n == 0 && up.Reused() {
		// The pooled connection died between the liveness check and the
		// write, and not one request byte went out: the one retry allowed.
		up.Discard()
		x.up = nil
		if up, err = x.w.Pool.Dial(context.Background()); err != nil {
			return c.refusedOrFail(x, err)
		}
		x.up = up
		up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
		n, err = up.Write(out)
	}
	x.sentUp = n > 0
	x.w.Stats.AddUp(int64(n))
	if err != nil {
		return c.fail(x, 502)
	}

	c.ubuf = c.s.getBuf()
	var uw int // bytes in ubuf
	if waitContinue {
		// Wait briefly for the backend's 100 (or a final answer); a backend
		// that ignores Expect gets the body anyway, as curl does.
		up.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.Continue))
		status, nw, err := c.readResponseHead(x, uw)
		uw = nw
		switch {
		case err == nil && status == 100:
			// Relayed to the client (once) by readResponseHead.
		case err == nil:
			// A final answer before the body: relay it, then close (the
			// client's body was never read).
			c.relayResponse(x, uw, false)
			c.lingerClose()
			return false
		case !isTimeout(err):
			return c.answerFailed(x, err)
		case req.Minor == 1:
			// The backend is silent: tell the client to send (RFC 9110
			// §10.1.1 lets a proxy do so) rather than leave a client that
			// waits for the 100 stalled until a timeout. A late 100 from
			// the backend is then dropped: the client sees exactly one.
			if err := c.writeClient(continue100); err != nil {
				c.s.counters.ClientAborted.Add(1)
				return false
			}
			x.sent100 = true
		}
		var nout []byte
		nout, sent, err = c.appendBuffered(c.out[:0], &sc, 0)
		if err == nil && len(nout) > 0 {
			_, err = up.Write(nout)
			x.w.Stats.AddUp(int64(len(nout)))
		}
		c.out = nout[:0]
		if err != nil {
			return c.sendFailed(x, err, uw)
		}
	}

	// The rest of the request body.
	if err := c.relayRequestBody(x, &sc, sent); err != nil {
		return c.sendFailed(x, err, uw)
	}

	// Watch the client while the backend works: if it leaves, close the
	// upstream connection at once so the engine cancels the generation.
	c.watchClient(up)
	keep := c.awaitAndRelay(x, uw)
	if c.stopWatch() {
		c.s.counters.ClientAborted.Add(1)
		keep = false
		x.reuse = false // the watch closed it
	}
	return keep
}

func (c *conn) awaitAndRelay(x *exchange, uw int) bool {
	x.up.SetReadDeadline(time.Now().Add(c.s.cfg.ResponseTimeout))
	for {
		status, nw, err := c.readResponseHead(x, uw)
		uw = nw
		if err != nil {
			return c.answerFailed(x, err)
		}
		if status >= 200 {
			return c.relayResponse(x, uw, true)
		}
		// A 100: readResponseHead relayed it (the first one only) and
		// already removed it from ubuf.
	}
}

// earlyAnswer relays a final response that the backend sent before taking
// the whole request body (a 413 or 401 and a close, say), which is why
// relaying the body failed: the client gets that answer rather than a 502
// or 408, and its connection closes, since its body was not all read. It
// reports whether there was such an answer.
func (c *conn) earlyAnswer(x *exchange, uw int) bool {
	x.up.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.EarlyAnswer))
	for {
		status, nw, err := c.readResponseHead(x, uw)
		uw = nw
		if err != nil {
			return false
		}
		if status >= 200 {
			c.relayResponse(x, uw, false)
			c.lingerClose()
			return true
		}
	}
}

// continue100 is the interim response tether sends itself (see
// proxyExchange).
var continue100 = []byte("HTTP/1.1 100 Continue\r\n\r\n")

// dropHead removes the parsed response head from ubuf.
func (c *conn) dropHead(uw *int) {
	n := c.resp.HeadLen
	*uw = copy(c.ubuf, c.ubuf[n:*uw])
}

// readResponseHead reads until ubuf starts with a response head. Interim
// 1xx heads other than 100 are relayed to HTTP/1.1 clients and skipped;
// a 100 is returned to the caller (relayed to the client first when the
// client asked for it). It returns the status and the bytes in ubuf.
func (c *conn) readResponseHead(x *exchange, uw int) (int, int, error) {
	for {
		if uw > 0 {
			err := httphead.ParseResponse(c.ubuf[:uw], c.s.cfg.Limits, &c.resp)
			if err == nil {
				st := c.resp.Status
				switch {
				case st == 101:
					// tether asked for no upgrade: a 101 is a broken backend.
					return 0, uw, errBadResponse
				case st >= 200:
					return st, uw, nil
				case st == 100:
					if c.req.Expect100 && !x.sent100 {
						if err := c.writeInterim(x); err != nil {
							return 0, uw, err
						}
						x.sent100 = true
						c.dropHead(&uw)
						return 100, uw, nil
					}
					// Unsolicited or repeated 100: not for the client.
					c.dropHead(&uw)
					continue
				default:
					if c.req.Minor == 1 {
						if err := c.writeInterim(x); err != nil {
							return 0, uw, err
						}
					}
					c.dropHead(&uw)
					continue
				}
			}
			if err != httphead.ErrIncomplete {
				return 0, uw, err
			}
			if uw == len(c.ubuf) {
				nb := make([]byte, 2*len(c.ubuf))
				copy(nb, c.ubuf[:uw])
				c.s.putBuf(c.ubuf)
				c.ubuf = nb
			}
		}
		n, err := x.up.Read(c.ubuf[uw:])
		uw += n
		x.w.Stats.AddDown(int64(n))
		if err != nil && n == 0 {
			return 0, uw, err
		}
	}
}

var errBadResponse = &httphead.Error{Status: 502, Reason: "unexpected 101"}

// errBodyTooLarge: a chunked request body grew past Config.MaxBodyBytes.
var errBodyTooLarge = &httphead.Error{Status: 413, Reason: "request body too large"}

// writeInterim relays a 1xx head (hop-by-hop fields removed).
func (c *conn) writeInterim(x *exchange) error {
	out := c.appendResponseHead(c.out[:0], false, false)
	c.out = out[:0]
	return c.writeClient(out)
}

// appendResponseHead writes the response head for the client: HTTP/1.1,
// status and reason as received, fields as received minus hop-by-hop ones,
// Connection: close when the client connection will close.
func (c *conn) appendResponseHead(out []byte, closing, dropTE bool) []byte {
	head := c.ubuf[:c.resp.HeadLen]
	line := head[:bytes.IndexByte(head, '\n')+1]
	out = append(out, "HTTP/1.1"...)
	out = append(out, line[8:]...)
	for i := range c.resp.Fields {
		f := &c.resp.Fields[i]
		if f.Drop || dropTE && (httphead.EqualFold(f.Name, "Transfer-Encoding") || httphead.EqualFold(f.Name, "Trailer")) {
			continue // de-chunked for HTTP/1.0: no framing, no trailers
		}
		out = append(out, f.Line...)
	}
	if closing {
		out = append(out, "Connection: close\r\n"...)
	}
	return append(out, "\r\n"...)
}

// appendBuffered moves request body bytes already in the client buffer
// into out (Content-Length bytes up to the length; chunked bytes as far as
// they are valid framing). It returns out and the Content-Length bytes
// taken so far (sent is the count already sent before).
func (c *conn) appendBuffered(out []byte, sc *httphead.Chunked, sent int64) ([]byte, int64, error) {
	req := &c.req
	avail := c.buf[c.r:c.w]
	switch {
	case req.ContentLength > 0:
		take := req.ContentLength - sent
		if int64(len(avail)) < take {
			take = int64(len(avail))
		}
		out = append(out, avail[:take]...)
		c.r += int(take)
		return out, sent + take, nil
	case req.Chunked:
		n, err := sc.Scan(avail)
		if err != nil {
			return out, sent, err
		}
		out = append(out, avail[:n]...)
		c.r += n
	}
	return out, sent, nil
}

// relayRequestBody sends what is left of the request body upstream.
func (c *conn) relayRequestBody(x *exchange, sc *httphead.Chunked, sent int64) error {
	req := &c.req
	cfg := &c.s.cfg
	switch {
	case req.ContentLength > 0:
		left := req.ContentLength - sent
		if left == 0 {
			return nil
		}
		// Everything buffered was taken: the buffer is free as scratch.
		c.r, c.w = 0, 0
		if c.buf == nil {
			c.buf = c.s.getBuf()
		}
		n, err := c.move(x.up.TCPConn, c.c, left, c.buf, cfg.IOTimeout)
		x.w.Stats.AddUp(n)
		return err
	case req.Chunked:
		var total int64 // bytes relayed after the head's write, framing included
		for !sc.Done() {
			if lim := cfg.MaxBodyBytes; lim > 0 && total+sc.Data() > lim {
				return errBodyTooLarge // what went upstream dies with its connection
			}
			if d := sc.Data(); d >= cfg.SpliceMin && c.r == c.w {
				n, err := c.move(x.up.TCPConn, c.c, d, nil, cfg.IOTimeout)
				total += n
				sc.Skip(n)
				x.w.Stats.AddUp(n)
				if err != nil {
					return err
				}
				continue
			}
			if c.r == c.w {
				// Everything buffered went out (the head's slices are
				// dead): stream the rest through a big buffer.
				if cap(c.buf) != bigBufSize {
					if c.buf != nil {
						c.s.putBuf(c.buf)
					}
					c.buf = c.s.getBigBuf()
				}
				c.r, c.w = 0, 0
				c.c.SetReadDeadline(time.Now().Add(cfg.IOTimeout))
				n, err := c.c.Read(c.buf)
				c.w = n
				if n == 0 {
					if err == nil {
						continue
					}
					return err
				}
			}
			avail := c.buf[c.r:c.w]
			n, err := sc.Scan(avail)
			if n > 0 {
				x.up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
				w, werr := x.up.Write(avail[:n])
				x.w.Stats.AddUp(int64(w))
				total += int64(w)
				c.r += n
				if werr != nil {
					return werr
				}
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// relayResponse writes the response head and relays its body. bodyRead
// says whether the request body was consumed (false after a final answer
// to Expect: 100-continue, which forces the client connection closed).
func (c *conn) relayResponse(x *exchange, uw int, bodyRead bool) bool {
	req, resp := &c.req, &c.resp
	cfg := &c.s.cfg
	kind := resp.Body(x.isHead)
	dechunk := kind == httphead.BodyChunked && req.Minor == 0
	// The client's body ends at the close: a cut one must end in a reset.
	x.closeDelimited = kind == httphead.BodyClose || dechunk
	keep := req.KeepAlive && bodyRead && kind != httphead.BodyClose && !c.s.closing.Load()
	// An unread request body (early answer to Expect) leaves the upstream
	// connection mid-message: never reuse it.
	x.reuse = bodyRead && !resp.Close && kind != httphead.BodyClose

	// An HTTP/1.0 client never sees Transfer-Encoding, HEAD included.
	out := c.appendResponseHead(c.out[:0], !keep, req.Minor == 0 && resp.Chunked)
	body := c.ubuf[resp.HeadLen:uw]
	var sc httphead.Chunked
	var left int64 // Content-Length bytes still to come
	switch kind {
	case httphead.BodyNone:
		if len(body) > 0 {
			x.reuse = false // a body where none may be: never reuse
		}
		body = nil
	case httphead.BodyLength:
		left = resp.ContentLength
		if int64(len(body)) > left {
			body = body[:left]
			x.reuse = false // more than Content-Length
		}
		left -= int64(len(body))
	case httphead.BodyChunked:
		n, err := sc.Scan(body)
		if err != nil {
			x.reuse = false
			c.s.counters.Truncated.Add(1)
			return c.fail(x, 502)
		}
		if n < len(body) {
			x.reuse = false
		}
		body = body[:n]
		if dechunk {
			// Re-scan from the start, emitting data only (rare: 1.0 clients).
			sc = httphead.Chunked{}
			out, _, _ = appendDechunked(out, &sc, body)
			body = nil
		}
	}
	out = append(out, body...)
	c.out = out[:0]
	if x.learn != nil && x.learn.Status(resp.Status) {
		c.learnBody(x, body, kind == httphead.BodyChunked && !dechunk)
	}
	if err := c.writeClient(out); err != nil {
		x.reuse = false
		c.s.counters.ClientAborted.Add(1)
		return false
	}
	x.sentHead = true

	switch kind {
	case httphead.BodyLength:
		if left > 0 {
			n, err := c.move(c.c, x.up.TCPConn, left, c.ubuf, cfg.IOTimeout)
			x.w.Stats.AddDown(n)
			if err != nil {
				return c.bodyFailed(x, err)
			}
		}
	case httphead.BodyChunked:
		if err := c.relayChunkedResponse(x, &sc, dechunk); err != nil {
			return c.bodyFailed(x, err)
		}
	case httphead.BodyClose:
		// Until the backend closes: the move ends with errSrcEOF.
		n, err := c.move(c.c, x.up.TCPConn, 1<<62, c.ubuf, cfg.StreamIdleTimeout)
		x.w.Stats.AddDown(n)
		if err != errSrcEOF {
			return c.bodyFailed(x, err)
		}
		return false
	}
	return keep
}

// clientGone reports whether the client closed or reset its connection.
// It ends the client watch first: while the watch waits it holds the read
// side, and sysconn.PeerGone would block until the client sends or leaves. A
// departure the watch saw is reported here once (the stopWatch after the
// exchange then reports false, so it is not counted twice).
func (c *conn) clientGone() bool {
	if c.watchTimer != nil && c.stopWatch() {
		c.watchGone.Store(false)
		return true
	}
	c.c.SetReadDeadline(time.Time{})
	return sysconn.PeerGone(c.raw)
}

// relayChunkedResponse streams a chunked body: every piece the backend
// writes is forwarded as soon as its framing is validated (SSE events reach
// the client at once); long chunk data is spliced.
func (c *conn) relayChunkedResponse(x *exchange, sc *httphead.Chunked, dechunk bool) error {
	cfg := &c.s.cfg
	for !sc.Done() {
		if d := sc.Data(); d >= cfg.SpliceMin && !dechunk && c.learn == nil {
			n, err := c.move(c.c, x.up.TCPConn, d, nil, cfg.StreamIdleTimeout)
			sc.Skip(n)
			x.w.Stats.AddDown(n)
			if err != nil {
				return err
			}
			continue
		}
		x.up.SetReadDeadline(time.Now().Add(cfg.StreamIdleTimeout))
		n, rerr := x.up.Read(c.ubuf)
		if n > 0 {
			x.w.Stats.AddDown(int64(n))
			p := c.ubuf[:n]
			var out []byte
			var m int
			var serr error
			if dechunk {
				out, m, serr = appendDechunked(c.out[:0], sc, p)
				c.out = out[:0]
			} else {
				m, serr = sc.Scan(p)
				out = p[:m]
			}
			if m < n && sc.Done() {
				x.reuse = false
			}
			if c.learn != nil {
				c.learnBody(x, out, !dechunk)
			}
			if len(out) > 0 {
				if err := c.writeClient(out); err != nil {
					return err
				}
			}
			if serr != nil {
				return serr
			}
		}
		if rerr != nil {
			if sc.Done() {
				return nil
			}
			return rerr
		}
	}
	return nil
}

// learnBody shows response body bytes to the exchange's Learner before they
// go to the client (chunked: the chunk data only), and keeps c.learn set
// while it wants more.
func (c *conn) learnBody(x *exchange, p []byte, chunked bool) {
	c.learn = x.learn
	if chunked {
		p, _, _ = appendDechunked(nil, &x.lsc, p)
	}
	if len(p) > 0 && !x.learn.Body(p) {
		c.learn = nil
	}
}

// appendDechunked appends only the chunk data of p to out, validating the
// framing (for HTTP/1.0 clients, which cannot read chunked).
func appendDechunked(out []byte, sc *httphead.Chunked, p []byte) ([]byte, int, error) {
	used := 0
	for used < len(p) && !sc.Done() {
		if d := sc.Data(); d > 0 {
			k := int64(len(p) - used)
			if k > d {
				k = d
			}
			out = append(out, p[used:used+int(k)]...)
			sc.Skip(k)
			used += int(k)
			continue
		}
		if _, err := sc.Scan(p[used : used+1]); err != nil {
			return out, used, err
		}
		used++
	}
	return out, used, nil
}

// watchClient arranges that, if the backend is still working after
// Waits.Watch, a goroutine waits (without reading) for the client to close
// or reset; then it closes up at once, so the engine cancels the
// generation. stopWatch ends the watch and reports whether the client left.
func (c *conn) watchClient(up *upstream.Conn) {
	c.startWatch(up, nil)
}

// watchLocal watches the client while a local handler runs (abort waves
// can last minutes): if it leaves, stop is called.
func (c *conn) watchLocal(stop context.CancelFunc) {
	c.startWatch(nil, stop)
}

func (c *conn) startWatch(up *upstream.Conn, stop context.CancelFunc) {
	// The watch waits under the client's read deadline: clear what the
	// head or body reads left, or it would give up after IdleTimeout.
	c.c.SetReadDeadline(time.Time{})
	c.watchUp, c.watchStop = up, stop
	c.watchGone.Store(false)
	c.watchWG.Add(1)
	if c.watchTimer == nil {
		c.watchTimer = time.AfterFunc(c.s.cfg.Waits.Watch, c.watch)
	} else {
		c.watchTimer.Reset(c.s.cfg.Waits.Watch)
	}
}

func (c *conn) stopWatch() bool {
	if c.watchTimer.Stop() {
		c.watchWG.Done() // never started
		return false
	}
	// Running or ran: wake it (a deadline in the past ends its wait, even
	// one it has not begun yet) and wait for it.
	c.c.SetReadDeadline(aLongTimeAgo)
	c.watchWG.Wait()
	return c.watchGone.Load()
}

// watch runs in the timer's goroutine.
func (c *conn) watch() {
	defer c.watchWG.Done()
	if c.watchFn == nil {
		c.watchFn = c.watchPeek
	}
	c.raw.Read(c.watchFn)
}

// watchPeek is watch's RawConn.Read callback.
func (c *conn) watchPeek(fd uintptr) bool {
	switch sysconn.Peek(fd) {
	case sysconn.PeekEmpty:
		return false // nothing yet: wait for readability
	case sysconn.PeekData:
		// A pipelined request waits for its turn; the client may still
		// leave behind it (FIN or reset after the bytes), which a peek
		// cannot see. Until then, wait for the next event on the socket
		// (more bytes, FIN, reset): edge-triggered, so no spinning.
		if !sysconn.PeerShutdown(fd) {
			return false
		}
	}
	c.watchGone.Store(true)
	if c.watchUp != nil {
		c.watchUp.Close()
	}
	if c.watchStop != nil {
		c.watchStop()
	}
	return true
}
