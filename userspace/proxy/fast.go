package proxy

// The exchange an event loop runs itself (loop.go): a request without a
// body or with a Content-Length one (the rest spliced up, upload), to a
// worker with a free place, on one of the loop's own upstream sockets;
// the response relayed as it arrives, by its
// framing (Content-Length, chunked validated as it streams, to the close),
// back-pressured by the client. Per proxied keep-alive request that is one
// read from the client, one write up, one read down and one write to the
// client; the wait is one epoll_wait shared by every socket of the loop.
//
// The outcomes are those of outcome.go, decided in the same order: before
// a byte went up, anything unusual goes to a goroutine that decides it
// (connectFailed: placed again, or 502 not-sent); after, a failure before
// the response head is 502 (504 on the response timeout) with
// X-Tether-Upstream-State: sent; after the head, a visible cut (a reset
// for a close-delimited body); a client that leaves closes the upstream at
// once, so the engine cancels the generation.

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
)

// handoff says where the goroutine starts with a connection its loop gave
// it (conn.serveOne): by default it parses the buffered head again.
type handoff struct {
	reject  int            // answer this status and close (the head timed out)
	decided bool           // routed already: dec (no second routing decision)
	dec     route.Decision //
	refused bool           // dec's worker refused the connect, nothing sent: place it again
}

type phase uint8

const (
	phaseSend   phase = iota // the request head (and buffered body bytes) go up
	phaseUpload              // the rest of the request body is spliced up
	phaseHead                // waiting for the response head
	phaseBody                // relaying the response body
)

// lx is the state of an exchange on the loop.
type lx struct {
	w      *route.Worker
	dec    route.Decision
	up     *upconn
	start  int64
	phase  phase
	send   []byte // request bytes not yet written up (in conn.out)
	bodyAt int    // where the request body starts in conn.buf (a fallback rewinds to it)
	uw     int    // response head bytes in conn.ubuf
	kind   httphead.BodyKind
	left   int64 // Content-Length bytes still to come
	sc     httphead.Chunked
	dsc    httphead.Chunked // the de-chunker's own view (dechunk)
	status int              // for Config.Observe: relayed, or tetherd's own

	connected bool  // a connect of this exchange succeeded (no second try after)
	redialed  bool  // the one connect retry was made
	dechunk   bool  // an HTTP/1.0 client gets a chunked body de-chunked, ended by the close
	pipe      *pipe // a body spliced through (pumpSplice); nil: copied through ubuf
	inPipe    int   // bytes in pipe not yet written to the client
	blocked   bool  // the client's socket would block on the pipe's bytes
	lowat     bool  // SO_RCVLOWAT raised on the upstream socket
	upEOF     bool  // the worker closed a close-delimited body (spliced: done once the pipe is empty)
	reqLeft   int64 // request body bytes still to splice up (phaseUpload)
	clLowat   bool  // SO_RCVLOWAT raised on the client socket
	bodyCut   bool  // the worker answered before the whole request body: the client connection lingers, then closes
	early     bool  // waiting for such an answer after the body failed to go up (a timeout is 502, not 504)
	upReady   bool  // the upstream socket may have bytes (edge seen, not drained)
	upHup     bool  // the worker closed or reset: read to the end
	reparse   bool  // an interim head was written late: look at ubuf again
	done      bool  // the response ended at its framing
	isHead    bool
	http10    bool // the client speaks HTTP/1.0
	keep      bool // the client connection may carry another request
	reuse     bool // the upstream connection may go back to the loop's idle list
	failed    bool // counts as a worker error
	sentUp    bool
	sentHead  bool
	closeCut  bool // a close-delimited body: a cut must be a reset
}

// upconn is an upstream socket of a loop.
type upconn struct {
	fd         int
	seq        uint32
	pool       *upstream.Pool
	cl         *conn // the exchange using it; nil while idle
	connecting bool
	fresh      bool
	since      int64 // idle since
}

// fast reports whether the loop can run the exchange of c's parsed head
// itself (no Expect, no chunked body, within MaxBodyBytes, not a local
// endpoint); else a goroutine does.
func (l *loop) fast(c *conn) bool {
	req := &c.req
	cfg := &l.s.cfg
	if req.Expect100 || req.Chunked {
		return false
	}
	if req.HasBody() && cfg.MaxBodyBytes > 0 && req.ContentLength > cfg.MaxBodyBytes {
		return false // 413, answered (and lingered) the goroutine way
	}
	return c.localHandler() == nil
}

// parse parses the head at the start of c's buffered bytes.
func (l *loop) parse(c *conn) error {
	err := httphead.ParseRequest(c.buf[c.r:c.w], l.s.cfg.Limits, &c.req)
	if err == httphead.ErrIncomplete {
		return errIncomplete
	}
	return err
}

// begin routes c's request and sends it up.
func (l *loop) begin(c *conn) {
	s := l.s
	req := &c.req
	s.counters.Requests.Add(1)
	c.r += req.HeadLen
	// The body bytes buffered behind the head go up with it; the rest of
	// a longer body is spliced (upload).
	body, left := 0, int64(0)
	if req.HasBody() {
		body = int(min(req.ContentLength, int64(c.w-c.r)))
		left = req.ContentLength - int64(body)
	}
	dec := s.cfg.Router.Route(req, c.buf[c.r:c.r+body])
	w := dec.Worker
	if w == nil || dec.Learn != nil {
		l.handoff(c, handoff{decided: true, dec: dec})
		return
	}
	sa := l.sockaddr(w.Pool)
	var up *pipe
	if sa != nil && left > 0 {
		up = l.getPipe()
	}
	if sa == nil || left > 0 && up == nil || !w.TryAdmit() {
		// A host name to resolve, a queue to wait in, or no pipe for the
		// body: not here.
		if up != nil {
			l.putPipe(up, true)
		}
		l.handoff(c, handoff{decided: true, dec: dec})
		return
	}
	u, err := l.upstream(w.Pool, sa)
	if err != nil {
		// The goroutine connects again and decides: placed again, 502,
		// or (want of descriptors) 502 that blames no worker.
		w.Leave()
		if up != nil {
			l.putPipe(up, true)
		}
		l.handoff(c, handoff{decided: true, dec: dec})
		return
	}
	w.Stats.Begin()
	x := l.newX()
	c.x = x
	*x = lx{w: w, dec: dec, up: u, start: l.now, bodyAt: c.r, isHead: req.IsMethod("HEAD"), keep: req.KeepAlive, http10: req.Minor == 0,
		reqLeft: left, pipe: up}
	c.busy = true
	u.cl = c
	out := c.appendUpstreamHead(c.out[:0], w)
	out = append(out, c.buf[c.r:c.r+body]...)
	c.out = out
	c.r += body
	x.send = out
	if u.connecting {
		l.setDeadline(c, w.Pool.Options().DialTimeout)
		return
	}
	x.connected = true
	l.send(c)
}

// sockaddr returns the worker's address for a raw connect (nil: a host
// name, dialed the goroutine way).
func (l *loop) sockaddr(p *upstream.Pool) unix.Sockaddr {
	sa, ok := l.addrs[p]
	if !ok {
		sa = sysconn.Sockaddr(p.Addr())
		l.addrs[p] = sa
	}
	return sa
}

// upstream returns the loop's most recently idle connection to p, or a new
// one (its connect possibly in progress).
func (l *loop) upstream(p *upstream.Pool, sa unix.Sockaddr) (*upconn, error) {
	if list := l.idle[p]; len(list) > 0 {
		u := list[len(list)-1]
		list[len(list)-1] = nil
		l.idle[p] = list[:len(list)-1]
		l.s.counters.UpstreamIdle.Add(-1)
		u.fresh = false
		return u, nil
	}
	return l.dial(p, sa)
}

func (l *loop) dial(p *upstream.Pool, sa unix.Sockaddr) (*upconn, error) {
	family := unix.AF_INET
	if _, ok := sa.(*unix.SockaddrInet6); ok {
		family = unix.AF_INET6
	}
	fd, err := unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1)
	err = unix.Connect(fd, sa)
	if err != nil && err != unix.EINPROGRESS {
		unix.Close(fd)
		return nil, err
	}
	u := &upconn{fd: fd, seq: l.nextSeq(), pool: p, connecting: err != nil, fresh: true}
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLOUT | unix.EPOLLRDHUP | unix.EPOLLET, Fd: int32(fd), Pad: int32(u.seq)}
	if err := unix.EpollCtl(l.epfd, unix.EPOLL_CTL_ADD, fd, &ev); err != nil {
		unix.Close(fd)
		return nil, err
	}
	l.ups[int32(fd)] = u
	if !u.connecting {
		p.Stats().ConnOpened()
	}
	return u, nil
}

// closeUp closes an upstream socket.
func (l *loop) closeUp(u *upconn) {
	if u.fd < 0 {
		return
	}
	delete(l.ups, int32(u.fd))
	unix.Close(u.fd)
	u.fd = -1
	if !u.connecting {
		u.pool.Stats().ConnClosed()
	}
}

// putIdle keeps u for the next request to its worker (at most the pool's
// MaxIdle per loop, the oldest evicted); it stays in the epoll set, so a
// worker that closes it is seen when it does, not at the next use.
func (l *loop) putIdle(u *upconn) {
	u.cl = nil
	p := u.pool
	if p.Closed() {
		l.closeUp(u)
		return
	}
	u.since = l.now
	list := l.idle[p]
	if len(list) >= p.Options().MaxIdle {
		l.closeUp(list[0])
		l.s.counters.UpstreamIdle.Add(-1)
		list = append(list[:0], list[1:]...)
	}
	l.idle[p] = append(list, u)
	l.s.counters.UpstreamIdle.Add(1)
	l.setDue(u.since + int64(p.Options().IdleTimeout))
}

// dropIdle closes an idle upstream socket the worker closed (or wrote to
// unasked).
func (l *loop) dropIdle(u *upconn) {
	list := l.idle[u.pool]
	for i, v := range list {
		if v == u {
			l.idle[u.pool] = append(list[:i], list[i+1:]...)
			l.s.counters.UpstreamIdle.Add(-1)
			break
		}
	}
	l.closeUp(u)
}

// upEvent handles an event on an upstream socket.
func (l *loop) upEvent(u *upconn, ev uint32) {
	c := u.cl
	if c == nil {
		if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
			l.dropIdle(u)
		}
		return
	}
	x := c.x
	if u.connecting {
		if ev&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) == 0 {
			return
		}
		if err := sysconn.SocketError(u.fd); err != nil {
			l.connectFailed(c)
			return
		}
		x.connected = true
		u.connecting = false
		u.pool.Stats().ConnOpened()
		l.send(c)
		return
	}
	if ev&(unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		x.upHup = true
	}
	if ev&(unix.EPOLLIN|unix.EPOLLRDHUP|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
		x.upReady = true
	}
	switch x.phase {
	case phaseSend:
		if ev&(unix.EPOLLOUT|unix.EPOLLERR|unix.EPOLLHUP) != 0 {
			l.send(c)
		}
		return
	case phaseUpload:
		if x.upReady && !interimAhead(u.fd) {
			// The worker answers before it has the whole body (a 413, a
			// 401): relay that answer (outcome.go, rule 3).
			l.earlyAnswer(c, l.s.cfg.ResponseTimeout)
			return
		}
		if ev&unix.EPOLLOUT != 0 {
			l.upload(c)
		}
		return
	}
	l.pump(c)
}

// connectFailed: the worker refused (or did not answer) the connect;
// nothing was sent. It is tried once more (as upstream.Pool does); then a
// goroutine places the request again (or answers 502 not-sent), as the
// goroutine path does (conn.serveDecision).
func (l *loop) connectFailed(c *conn) {
	x := c.x
	u := x.up
	l.closeUp(u)
	if !x.redialed && !x.connected {
		x.redialed = true
		u.pool.Retried(upstream.RetryConnect)
		if nu, err := l.dial(u.pool, l.sockaddr(u.pool)); err == nil {
			nu.cl, x.up, x.upReady, x.upHup = c, nu, false, false
			if nu.connecting {
				l.setDeadline(c, u.pool.Options().DialTimeout)
				return
			}
			x.connected = true
			l.send(c)
			return
		}
	}
	x.w.Stats.End(true)
	x.w.Leave()
	dec := x.dec
	if x.pipe != nil {
		l.putPipe(x.pipe, true) // nothing went through it yet
	}
	c.r = x.bodyAt
	c.busy = false
	l.freeX(c)
	l.handoff(c, handoff{decided: true, dec: dec, refused: true})
}

// send writes the request up; then waits for the response head.
func (l *loop) send(c *conn) {
	x := c.x
	cfg := &l.s.cfg
	for len(x.send) > 0 {
		n, err := unix.Write(x.up.fd, x.send)
		if n > 0 {
			x.sentUp = true
			x.w.Stats.AddUp(int64(n))
			x.send = x.send[n:]
			continue
		}
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			l.setDeadline(c, cfg.IOTimeout)
			return
		case !x.sentUp && !x.up.fresh:
			// A pooled connection that died before it took a byte: the
			// one retry allowed, on a new connection.
			u := x.up
			l.closeUp(u)
			u.pool.Retried(upstream.RetryDeadPooled)
			nu, err := l.dial(u.pool, l.sockaddr(u.pool))
			if err != nil {
				l.connectFailed(c)
				return
			}
			nu.cl, x.up, x.upReady, x.upHup = c, nu, false, false
			x.redialed = true // a new connection that fails is not tried again
			if nu.connecting {
				l.setDeadline(c, u.pool.Options().DialTimeout)
				return
			}
			x.connected = true
			continue
		}
		l.fail(c, 502)
		return
	}
	if x.reqLeft > 0 {
		x.phase = phaseUpload
		if x.reqLeft >= batchMin {
			x.clLowat = unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, batchLowat) == nil
		}
		c.readable = true // try: the body may be queued already
		l.upload(c)
		return
	}
	x.phase = phaseHead
	l.setDeadline(c, cfg.ResponseTimeout)
	if x.upReady {
		l.pump(c)
	}
}

// pump reads the response while the client takes it.
func (l *loop) pump(c *conn) {
	s := l.s
	x := c.x
	for {
		if len(c.pend) > 0 || x.blocked {
			return // the client takes what it has first (EPOLLOUT)
		}
		if x.done {
			l.end(c)
			return
		}
		if x.phase == phaseBody && l.splicing(x) {
			if !l.pumpSplice(c) {
				return
			}
			if !x.done {
				return
			}
			continue
		}
		if x.reparse {
			x.reparse = false
			if !l.head(c) {
				return
			}
			continue
		}
		if !x.upReady {
			return
		}
		if c.ubuf == nil {
			c.ubuf = s.getBuf()
		}
		var p []byte
		if x.phase == phaseHead {
			if x.uw == len(c.ubuf) {
				nb := make([]byte, 2*len(c.ubuf)) // a head past the buffer (the parser's limit ends it)
				copy(nb, c.ubuf[:x.uw])
				s.putBuf(c.ubuf)
				c.ubuf = nb
			}
			p = c.ubuf[x.uw:]
		} else {
			p = c.ubuf
			if x.kind == httphead.BodyLength && int64(len(p)) > x.left {
				p = p[:x.left]
			}
		}
		n, err := unix.Read(x.up.fd, p)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			x.upReady = false
			return
		}
		if n <= 0 {
			// The worker closed (or reset) the connection.
			if x.phase == phaseHead {
				l.fail(c, 502)
			} else if x.kind == httphead.BodyClose && err == nil {
				x.done, x.reuse, x.keep = true, false, false
				continue
			} else {
				l.bodyFailed(c)
			}
			return
		}
		x.w.Stats.AddDown(int64(n))
		// A short read drained the socket: the next bytes bring an edge.
		x.upReady = n == len(p) || x.upHup
		if x.phase == phaseHead {
			x.uw += n
			if !l.head(c) {
				return
			}
			continue
		}
		if !l.body(c, p[:n]) {
			return
		}
	}
}

// head handles the response bytes in ubuf while no final head went out:
// interim heads (a 100 dropped: the loop never sends Expect; others
// relayed), then the final head with the body bytes behind it. False when
// the exchange ended.
func (l *loop) head(c *conn) bool {
	s := l.s
	x := c.x
	resp := &c.resp
	for x.uw > 0 {
		err := httphead.ParseResponse(c.ubuf[:x.uw], s.cfg.Limits, resp)
		if err == httphead.ErrIncomplete {
			return true
		}
		if err != nil || resp.Status == 101 {
			l.fail(c, 502) // a broken head, or an upgrade tether never asked for
			return false
		}
		if resp.Status >= 200 {
			return l.relayHead(c)
		}
		if resp.Status != 100 && !x.http10 {
			out := c.appendResponseHead(c.out[:0], false, false)
			c.out = out[:0]
			ok := l.writeClient(c, out)
			x.uw = copy(c.ubuf, c.ubuf[resp.HeadLen:x.uw])
			if !ok {
				l.clientLost(c)
				return false
			}
			if len(c.pend) > 0 {
				x.reparse = true
				return true
			}
			continue
		}
		x.uw = copy(c.ubuf, c.ubuf[resp.HeadLen:x.uw])
	}
	return true
}

// relayHead writes the final response head and the body bytes behind it.
func (l *loop) relayHead(c *conn) bool {
	s := l.s
	x := c.x
	resp := &c.resp
	kind := resp.Body(x.isHead)
	x.kind = kind
	x.dechunk = kind == httphead.BodyChunked && x.http10
	x.closeCut = kind == httphead.BodyClose || x.dechunk
	x.keep = x.keep && !x.closeCut && !s.closing.Load()
	x.reuse = !resp.Close && kind != httphead.BodyClose
	x.status = resp.Status
	// An HTTP/1.0 client never sees Transfer-Encoding, HEAD included.
	out := c.appendResponseHead(c.out[:0], !x.keep, x.http10 && resp.Chunked)
	body := c.ubuf[resp.HeadLen:x.uw]
	switch kind {
	case httphead.BodyNone:
		if len(body) > 0 {
			x.reuse = false // a body where none may be: never reuse
		}
		body = nil
		x.done = true
	case httphead.BodyLength:
		x.left = resp.ContentLength
		if int64(len(body)) > x.left {
			body = body[:x.left]
			x.reuse = false
		}
		x.left -= int64(len(body))
		x.done = x.left == 0
	case httphead.BodyChunked:
		n, err := x.sc.Scan(body)
		if err != nil {
			x.reuse = false
			s.counters.Truncated.Add(1)
			l.fail(c, 502)
			return false
		}
		if n < len(body) {
			x.reuse = false
		}
		body = body[:n]
		x.done = x.sc.Done()
		if x.dechunk {
			var dc httphead.Chunked // the data only, framing checked again
			out, _, _ = appendDechunked(out, &dc, body)
			body = nil
			x.dsc = dc
		}
	}
	out = append(out, body...)
	c.out = out[:0]
	x.uw = 0
	if !l.writeClient(c, out) {
		l.clientLost(c)
		return false
	}
	x.sentHead = true
	x.phase = phaseBody
	l.setDeadline(c, l.bodyTimeout(x))
	return true
}

func (l *loop) bodyTimeout(x *lx) time.Duration {
	if x.kind == httphead.BodyLength {
		return l.s.cfg.IOTimeout
	}
	return l.s.cfg.StreamIdleTimeout
}

// body relays response body bytes p by the framing.
func (l *loop) body(c *conn, p []byte) bool {
	x := c.x
	out := p
	var serr error
	switch x.kind {
	case httphead.BodyLength:
		x.left -= int64(len(p))
		x.done = x.left == 0
	case httphead.BodyChunked:
		m, err := x.sc.Scan(p)
		if m < len(p) && x.sc.Done() {
			x.reuse = false // bytes past the last chunk
		}
		out, serr = p[:m], err
		x.done = x.sc.Done()
		if x.dechunk {
			out, _, _ = appendDechunked(c.out[:0], &x.dsc, out)
			c.out = out[:0]
		}
	}
	if len(out) > 0 && !l.writeClient(c, out) {
		l.clientLost(c)
		return false
	}
	if serr != nil {
		l.bodyFailed(c)
		return false
	}
	l.setDeadline(c, l.bodyTimeout(x))
	return true
}

// writeClient writes p to the client; what the socket does not take now
// waits in c.pend for EPOLLOUT. False if the client is gone.
func (l *loop) writeClient(c *conn, p []byte) bool {
	for len(p) > 0 {
		n, err := unix.Write(c.fd, p)
		if n > 0 {
			p = p[n:]
			continue
		}
		switch err {
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			c.pend = p
			l.setDeadline(c, l.s.cfg.IOTimeout)
			return true
		}
		return false
	}
	c.pend = nil
	return true
}

// flushClient writes what waited for the client, then goes on.
func (l *loop) flushClient(c *conn) {
	c.x.blocked = false
	if !l.writeClient(c, c.pend) {
		l.clientLost(c)
		return
	}
	if len(c.pend) == 0 {
		if c.x.phase == phaseBody {
			l.setDeadline(c, l.bodyTimeout(c.x))
		}
		l.pump(c)
	}
}

// end finishes an exchange whose response ended at its framing.
func (l *loop) end(c *conn) {
	keep, cut := c.x.keep, c.x.bodyCut
	l.finishExchange(c)
	if cut {
		l.lingerClose(c) // its body was not all read: no reset over the answer
		return
	}
	if !keep {
		l.closeConn(c)
		return
	}
	c.deadline = 0
	l.next(c)
}

// finishExchange counts the exchange's end and releases what it held.
func (l *loop) finishExchange(c *conn) {
	x := c.x
	x.w.Stats.End(x.failed)
	x.w.Leave()
	if x.dec.Done != nil {
		x.dec.Done()
	}
	if obs := l.s.cfg.Observe; obs != nil {
		obs(x.w.Slot, x.status/100, time.Duration(l.now-x.start))
	}
	if x.pipe != nil {
		l.putPipe(x.pipe, x.inPipe == 0)
	}
	if x.clLowat {
		unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
	}
	if u := x.up; u != nil {
		u.cl = nil
		if x.reuse && x.done && !x.upHup {
			l.putIdle(u)
		} else {
			l.closeUp(u)
		}
	}
	if c.ubuf != nil {
		l.s.putBuf(c.ubuf)
		c.ubuf = nil
	}
	c.busy, c.pend = false, nil
	l.freeX(c)
}

// newX returns a cleared exchange (the loop's free list: a connection
// holds one only while busy).
func (l *loop) newX() *lx {
	if n := len(l.xs); n > 0 {
		x := l.xs[n-1]
		l.xs = l.xs[:n-1]
		return x
	}
	return new(lx)
}

// freeX clears c's exchange and keeps it for the next one.
func (l *loop) freeX(c *conn) {
	*c.x = lx{}
	if len(l.xs) < 1024 {
		l.xs = append(l.xs, c.x)
	}
	c.x = nil
}

// fail answers status (502 or 504) if no response head went out, and
// closes the client connection.
func (l *loop) fail(c *conn, status int) {
	s := l.s
	x := c.x
	x.failed, x.reuse = true, false
	if !x.sentHead {
		x.status = status
		switch status {
		case 502:
			s.counters.BadGateway.Add(1)
		case 504:
			s.counters.Timeouts.Add(1)
		}
		unix.Write(c.fd, upstreamError(status, x.sentUp, true)) // best effort: the connection closes
	}
	l.finishExchange(c)
	l.closeConn(c)
}

// bodyFailed: the response was cut after its head went out; the client
// must see it, so its connection closes (a reset for a close-delimited
// body, which a FIN would make look complete).
func (l *loop) bodyFailed(c *conn) {
	x := c.x
	x.failed, x.reuse = true, false
	l.s.counters.Truncated.Add(1)
	if x.closeCut {
		unix.SetsockoptLinger(c.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	}
	l.finishExchange(c)
	l.closeConn(c)
}

// clientLost: the client went away mid-exchange (a write failed).
func (l *loop) clientLost(c *conn) {
	l.s.counters.ClientAborted.Add(1)
	l.abandon(c)
	l.closeConn(c)
}

// abandon ends c's exchange without an answer (the client left, or the
// server closes): the upstream connection closes, so the worker sees it.
func (l *loop) abandon(c *conn) {
	if !c.busy {
		return
	}
	c.x.reuse = false
	l.finishExchange(c)
}

// expireExchange handles an exchange whose deadline passed.
func (l *loop) expireExchange(c *conn) {
	x := c.x
	switch {
	case x.up != nil && x.up.connecting:
		l.connectFailed(c) // the worker did not answer the connect: nothing sent
	case len(c.pend) > 0 || x.blocked:
		l.bodyFailed(c) // the client stopped reading
	case x.phase == phaseSend:
		l.fail(c, 502)
	case x.phase == phaseUpload:
		// The body made no progress for --io-timeout: the client stopped
		// sending (or the worker stopped taking it): 408, as outcome.go
		// rule 4; the half-sent request dies with its upstream.
		l.s.counters.Rejected.Add(1)
		x.failed = false
		x.reuse = false
		x.status = 408
		unix.Write(c.fd, errorResponse(408, true))
		l.finishExchange(c)
		l.lingerClose(c)
	case x.phase == phaseHead && x.early:
		l.fail(c, 502) // the body failed to go up and no answer came
	case x.phase == phaseHead:
		l.fail(c, 504)
	default:
		l.bodyFailed(c) // the worker went silent mid-body
	}
}

// Splicing a long response body (pumpSplice): the bytes go from the
// worker's socket into a pipe and from the pipe to the client's socket
// with splice(2), never through user space, as the goroutine path's
// conn.move does. A body of at least batchMin also raises the upstream
// socket's SO_RCVLOWAT to batchLowat, so that one wake-up moves a big
// batch, and lowers it again for the last batchLowat bytes.

// pipe is a splice pipe of a loop.
type pipe struct {
	r, w int
	size int
}

// splicing reports whether x's body moves by splice (and gives it a pipe).
func (l *loop) splicing(x *lx) bool {
	if x.pipe != nil {
		return true
	}
	if x.dechunk || !(x.kind == httphead.BodyClose || x.kind == httphead.BodyLength && x.left >= l.s.cfg.SpliceMin) {
		return false
	}
	x.pipe = l.getPipe()
	if x.pipe == nil {
		return false
	}
	if x.kind == httphead.BodyLength && x.left >= batchMin {
		x.lowat = unix.SetsockoptInt(x.up.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, batchLowat) == nil
	}
	return true
}

// pumpSplice moves the body: the pipe is emptied to the client first, then
// filled from the worker (an EAGAIN on an empty pipe is the socket's). It
// returns false when the exchange ended; otherwise x.done, or a socket
// would block (x.blocked: the client's; !x.upReady: the worker's).
func (l *loop) pumpSplice(c *conn) bool {
	x := c.x
	p := x.pipe
	const flags = unix.SPLICE_F_NONBLOCK | unix.SPLICE_F_MOVE
	for {
		if x.inPipe > 0 {
			n, err := unix.Splice(p.r, nil, c.fd, nil, x.inPipe, flags)
			switch {
			case n > 0:
				x.inPipe -= int(n)
				l.setDeadline(c, l.bodyTimeout(x))
				continue
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				x.blocked = true
				l.setDeadline(c, l.s.cfg.IOTimeout)
				return true
			}
			l.clientLost(c)
			return false
		}
		if x.kind == httphead.BodyLength && x.left == 0 || x.upEOF {
			x.done = true // the pipe is empty too
			return true
		}
		if !x.upReady {
			return true
		}
		want := p.size
		if x.kind == httphead.BodyLength && x.left < int64(want) {
			want = int(x.left)
		}
		if x.lowat && x.left <= batchLowat {
			unix.SetsockoptInt(x.up.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
			x.lowat = false
		}
		n, err := unix.Splice(x.up.fd, nil, p.w, nil, want, flags)
		switch {
		case n > 0:
			x.w.Stats.AddDown(n)
			x.inPipe += int(n)
			if x.kind == httphead.BodyLength {
				x.left -= n
			}
			continue
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			x.upReady = false
			continue // x.upReady false: return (after nothing is left in the pipe)
		case err == nil && x.kind == httphead.BodyClose:
			// The worker's close ends the body, once the pipe is empty.
			x.upEOF, x.reuse, x.keep = true, false, false
			continue
		}
		l.bodyFailed(c)
		return false
	}
}

// getPipe returns a free pipe of the loop (1 MiB where the system allows),
// or nil if none can be made (the body is copied instead).
func (l *loop) getPipe() *pipe {
	if n := len(l.pipes); n > 0 {
		p := l.pipes[n-1]
		l.pipes = l.pipes[:n-1]
		return p
	}
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return nil
	}
	size, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, 1<<20)
	if err != nil {
		size, _ = unix.FcntlInt(uintptr(fds[1]), unix.F_GETPIPE_SZ, 0)
	}
	if size <= 0 {
		size = 64 << 10
	}
	return &pipe{r: fds[0], w: fds[1], size: size}
}

// putPipe keeps an empty pipe for the next body (a few per loop); one
// holding bytes is closed.
func (l *loop) putPipe(p *pipe, empty bool) {
	if empty && len(l.pipes) < 8 {
		l.pipes = append(l.pipes, p)
		return
	}
	unix.Close(p.r)
	unix.Close(p.w)
}

// upload splices the rest of a Content-Length request body from the client
// to the worker through the exchange's pipe (emptied up first, then filled
// from the client: an EAGAIN on an empty pipe is the client's socket). A
// body of at least batchMin raises the client socket's SO_RCVLOWAT, as
// conn.move does. Then the response is awaited.
func (l *loop) upload(c *conn) {
	x := c.x
	p := x.pipe
	cfg := &l.s.cfg
	const flags = unix.SPLICE_F_NONBLOCK | unix.SPLICE_F_MOVE
	for {
		if x.inPipe > 0 {
			n, err := unix.Splice(p.r, nil, x.up.fd, nil, x.inPipe, flags)
			switch {
			case n > 0:
				x.inPipe -= int(n)
				x.sentUp = true
				x.w.Stats.AddUp(n)
				l.setDeadline(c, cfg.IOTimeout)
				continue
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				l.setDeadline(c, cfg.IOTimeout) // EPOLLOUT on the upstream socket goes on
				return
			}
			// The worker stopped taking the body (closed, reset): it may
			// have answered first.
			l.earlyAnswer(c, cfg.Waits.EarlyAnswer)
			return
		}
		if x.reqLeft == 0 {
			if x.clLowat {
				unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
				x.clLowat = false
			}
			l.putPipe(p, true)
			x.pipe = nil
			x.phase = phaseHead
			l.setDeadline(c, cfg.ResponseTimeout)
			if x.upReady {
				l.pump(c)
			}
			return
		}
		if !c.readable {
			l.setDeadline(c, cfg.IOTimeout)
			return
		}
		if x.clLowat && x.reqLeft <= batchLowat {
			unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVLOWAT, 1)
			x.clLowat = false
		}
		n, err := unix.Splice(c.fd, nil, p.w, nil, int(min(x.reqLeft, int64(p.size))), flags)
		switch {
		case n > 0:
			x.reqLeft -= n
			x.inPipe += int(n)
			continue
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			c.readable = false
			continue
		}
		// The client's end (or reset) before its whole body: it left.
		l.s.counters.ClientAborted.Add(1)
		l.abandon(c)
		l.closeConn(c)
		return
	}
}

// earlyAnswer: the worker answered (or failed) before it took the whole
// request body. Its answer, if one comes within wait, is relayed; the
// client connection then lingers and closes, its body unread (outcome.go,
// rule 3); else 502 sent.
func (l *loop) earlyAnswer(c *conn, wait time.Duration) {
	x := c.x
	if x.pipe != nil {
		l.putPipe(x.pipe, false) // what it holds goes nowhere
		x.pipe, x.inPipe = nil, 0
	}
	x.reqLeft = 0
	x.phase, x.keep, x.reuse, x.bodyCut, x.early = phaseHead, false, false, true, true
	x.upReady = true
	l.setDeadline(c, wait)
	l.pump(c)
}

// lingerClose half-closes the client connection and reads what it still
// sends (at most 256 KiB, Waits.Linger) before the close: closing with
// unread bytes would send a reset that can destroy the answer before the
// client reads it (head.go's lingerClose, in the loop).
func (l *loop) lingerClose(c *conn) {
	unix.Shutdown(c.fd, unix.SHUT_WR)
	c.linger = 256 << 10
	c.readable = true
	c.deadline = 0
	l.setDeadline(c, l.s.cfg.Waits.Linger)
	l.drain(c)
}

// drain reads and drops what a lingering client sends; at its end (or the
// limit) the connection closes.
func (l *loop) drain(c *conn) {
	var scratch [4096]byte
	for c.readable {
		n, err := unix.Read(c.fd, scratch[:])
		switch {
		case n > 0:
			c.linger -= n
			if c.linger <= 0 {
				l.closeConn(c)
				return
			}
			continue
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			c.readable = false
			return
		}
		l.closeConn(c)
		return
	}
}

// interimAhead reports whether the bytes a worker sent during an upload
// start an interim (1xx) head: some send a 100 unasked; it is dropped
// later, and the upload goes on (a final answer would stop it).
func interimAhead(fd int) bool {
	var b [10]byte
	n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return err == nil && n == len(b) && string(b[:5]) == "HTTP/" && b[9] == '1'
}
