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
// The connection's phases, each a function of the loop that runs until it
// must wait for a socket or ends, and returns what comes next (a step:
// the next phase, stepWait, or an ending). One function, loop.drive,
// runs them; every entry goes through it (a socket event, a ring
// completion: loop_ring.go's replay re-enters at the phase of the I/O
// site that queued the operation, a deadline, a new connection), and an
// ending is carried out in one place, loop.leave:
//
//	stepRead    next (read, parse, fast)      loop_head.go      → stepRoute, a goroutine
//	stepRoute   begin                         loop_exchange.go  → stepSend, a goroutine
//	stepSend    send (connectFailed)          loop_exchange.go  → stepUpload, stepRelay
//	stepUpload  upload (earlyAnswer)          loop_exchange.go  → stepRelay
//	stepRelay   pump (head, relayHead, body,  loop_relay.go,    → stepFinish, a failure
//	            pumpSplice)                   loop_splice.go
//	stepFinish  end                           loop_finish.go    → stepRead, stepLinger, close
//	stepLinger  lingerClose (drain)           loop_finish.go,   → close
//	                                          linger.go
//
// A goroutine drives the same phases with blocking calls, one after the
// other in its call stack (gor_serve.go's proxy and runExchange): begin
// (serveDecision, proxy: routed, admitted), send (gor_request.go's send,
// sendAfterContinue), upload (upload, earlyAnswer), pump (gor_response.go's
// pump: readResponseHead, relayResponse), end (proxy's accounting, then
// its lingering close). The steps inside the phases, the exchange's state
// and its endings are the same code for both (exchange.go, framing.go,
// outcome.go, watch.go).
//
// A failure is concluded by outcome.go (a verdict) and applied to the
// client's socket by loop_finish.go's apply (through conclude, fail,
// bodyFailed, clientLeft: the client left). The
// events: clientEvent (loop.go), exchangeEvent (loop_upstream.go),
// sentClient (loop_ring.go), expire (loop_deadline.go) each return the
// phase to drive.
//
// A step lives only until drive runs it: when the connection waits, what
// it was doing is gone. lx.phase is where the exchange is between two
// entries, what the steps cannot say: which of send, upload, head and
// body the events of its sockets go to (clientEvent, exchangeEvent,
// sentClient), which buffer and deadline pump uses, and the stage a
// failure is decided at (expireExchange). It is outcome.go's stage under
// the loop's names: phaseSend and phaseUpload resume at stepSend and
// stepUpload, phaseHead and phaseBody both at stepRelay (phaseBody is set
// with prog.sentHead, in relayHead). Before a byte went up, anything
// unusual goes to a goroutine that decides it (connectFailed: placed
// again, or 502 not-sent), except a connect that finds no descriptor
// (noDescriptor: 502 not-sent here).

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sysconn"
	"github.com/tether-rl/tether/userspace/upstream"
)

// handoff says where the goroutine starts with a connection its loop gave
// it (conn.serveOne): by default it parses the buffered head again.
type handoff struct {
	reject  int            // answer this status and close (the head timed out)
	decided bool           // routed already: dec (no second routing decision)
	held    bool           // the fleet holds it (hold.go): wait, then route
	dec     route.Decision //
	refused bool           // dec's worker refused the connect, nothing sent: place it again
}

// toGoroutine is the ending that gives c to a goroutine running the full
// data path; h says where it starts (conn.serveOne).
func (l *loop) toGoroutine(c *conn, h handoff) step {
	if c.gor == nil {
		c.gor = new(gor)
	}
	c.hand = h
	return leaveHandoff
}

// handoff gives c to a goroutine (leave, for toGoroutine's ending).
func (l *loop) handoff(c *conn) {
	l.s.counters.Handoffs.Add(1)
	l.unhold(c)
	go c.serve()
}

// The phases of an exchange: outcome.go's stages (lx.phase; above).
const (
	phaseSend   = stageHeadUp // the request head (and buffered body bytes) go up
	phaseUpload = stageBodyUp // the rest of the request body is spliced up
	phaseHead   = stageWait   // waiting for the response head
	phaseBody   = stageRelay  // relaying the response body
)

// lx is the loop's I/O state of an exchange (exchange.go): its sockets,
// pipe, buffers and counts, and a few small states, each a group of flags
// that change together.
type lx struct {
	id    uint32 // which exchange (exchanges are reused): loop_ring.go's deferred events
	dec   route.Decision
	up    *upconn
	start int64
	phase stage  // where the exchange is between entries (phaseSend, ...)
	send  []byte // request bytes not yet written up (in conn.out)
	// sendNext: the request body bytes to write up after send, from
	// conn.buf (a body read further for the router: peek.go).
	sendNext []byte
	sendBody bool   // send holds sendNext's bytes: the head went up whole (a failure may be an early answer)
	bodyAt   int    // where the request body starts in conn.buf (a fallback rewinds to it)
	pend     []byte // response bytes the client has not taken yet (loop_relay.go, writeClient)
	pipe     *pipe  // a body spliced through (pumpSplice, upload); nil: copied through ubuf
	inPipe   int    // bytes in pipe not yet written on

	sock readiness
	body bodyState
}

// readiness: what the loop knows of its sockets between events
// (edge-triggered: a flag stays set until a read or write says otherwise).
type readiness struct {
	upReady bool // the upstream socket may have bytes (edge seen, not drained)
	upHup   bool // the worker closed or reset: read to the end
	blocked bool // the client's socket would block on the pipe's bytes
	reparse bool // an interim head was written late: look at ubuf again
}

// bodyState: the bodies' states beyond their framing.
type bodyState struct {
	clientLowat lowat // SO_RCVLOWAT raised on the client socket (upload)
	upLowat     lowat // SO_RCVLOWAT raised on the upstream socket (pumpSplice)
	upEOF       bool  // the worker closed a close-delimited body (spliced: done once the pipe is empty)
	lineNext    bool  // a chunk's data was spliced: the next read takes its end and the next size line (chunkLineRead bytes), not the next chunk's data
}

// begin routes c's request and sends it up.
func (l *loop) begin(c *conn) step {
	s := l.s
	req := c.req
	s.counters.Requests.Add(1)
	c.peekDone()
	c.r += req.HeadLen
	// The body bytes buffered behind the head go up with it; the rest of
	// a longer body is spliced (upload).
	body, left := 0, int64(0)
	if req.HasBody() {
		body = int(min(req.ContentLength, int64(c.w-c.r)))
		left = req.ContentLength - int64(body)
	}
	if c.held(nil) {
		return l.toGoroutine(c, handoff{held: true})
	}
	dec := s.cfg.Router.Route(req, c.buf[c.r:c.r+body])
	w := dec.Worker
	if w == nil || dec.Learn != nil {
		return l.toGoroutine(c, handoff{decided: true, dec: dec})
	}
	sa := l.sockaddr(w.Pool)
	var up *pipe
	var perr error
	if sa != nil && left > 0 {
		up, perr = l.getPipe()
	}
	if sa == nil || left > 0 && up == nil && !fdShortage(perr) || !w.TryAdmit() {
		// A host name to resolve, a queue to wait in, or no pipe for the
		// body (not for want of a descriptor: noDescriptor, below): not
		// here.
		if up != nil {
			l.putPipe(up, true)
		}
		return l.toGoroutine(c, handoff{decided: true, dec: dec})
	}
	if c.held(w) {
		// A sync began as the place was taken, or w is fenced.
		w.Leave()
		if up != nil {
			l.putPipe(up, true)
		}
		if dec.Done != nil {
			dec.Done()
		}
		return l.toGoroutine(c, handoff{held: true})
	}
	var u *upconn
	err := perr // no pipe for the body: no descriptor (noDescriptor, below)
	if up != nil || left == 0 {
		u, err = l.upstream(w.Pool, sa)
	}
	if err != nil && !fdShortage(err) {
		// The goroutine connects again and decides: placed again, or
		// 502 (without a descriptor: noDescriptor, here).
		w.Leave()
		if up != nil {
			l.putPipe(up, true)
		}
		return l.toGoroutine(c, handoff{decided: true, dec: dec})
	}
	w.Stats.Begin()
	x := l.newX()
	c.x = x
	*x = newExchange(w, req)
	x.lx = lx{id: l.nextSeq(), dec: dec, up: u, start: l.now, bodyAt: c.r, pipe: up}
	x.rt = s.routeNote(dec)
	x.reqLeft = left // (the rest: what is buffered goes up with the head)
	c.busy = true
	if u == nil {
		return l.noDescriptor(c, err)
	}
	u.cl = c
	out := c.appendUpstreamHead(l.lendOut(c), w, &x.rt)
	out, x.sendNext = c.splitRankBody(out, c.buf[c.r:c.r+body], w, x.rt, true)
	c.out = out
	c.r += body
	x.send = out
	if u.connecting {
		l.setDeadline(c, w.Pool.Options().DialTimeout)
		return stepWait
	}
	x.prog.connected = true
	return stepSend
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

// noDescriptor ends an exchange whose connect, the first or a redial, or
// whose upload's splice pipe found no descriptor (EMFILE, ENFILE), even
// after idle sockets were given up (dial, getPipe): no other worker would
// fare better, and a goroutine could not even be lent the client's
// socket. 502 not-sent here (this host's shortage, upstream.ErrLocal),
// logged once per episode; then the client connection lingers over a
// request body not all read (lingerClose), so that no reset destroys the
// answer.
func (l *loop) noDescriptor(c *conn, err error) step {
	upstream.LocalFailures.Add(1)
	return l.apply(c, l.s.localVerdict(err, c.x.reached(l.unread(c.x)))) // (lingering over a body not all read)
}

// connectFailed: the worker refused (or did not answer) the connect;
// nothing was sent. It is tried once more if the retry rule allows
// (upstream.Attempt.Retry); then a goroutine places the request again
// (or answers 502 not-sent: conn.serveDecision). A redial without a
// descriptor ends as a first connect's would (noDescriptor).
func (l *loop) connectFailed(c *conn) step {
	x := c.x
	l.closeUp(x.up)
	if reason, ok := (upstream.Attempt{Connected: x.prog.connected, Retried: x.prog.redialed}).Retry(); ok {
		return l.redial(c, reason)
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
	return l.toGoroutine(c, handoff{decided: true, dec: dec, refused: true})
}

// redial makes the request's one retry (upstream.Attempt.Retry) on a new
// connection to its worker, its old one closed; a connect that fails at
// once ends as connectFailed says (the retry made, never another).
func (l *loop) redial(c *conn, reason int) step {
	x := c.x
	p := x.up.pool
	p.Retried(reason)
	x.prog.redialed = true
	nu, err := l.dial(p, l.sockaddr(p))
	if err != nil {
		if fdShortage(err) {
			return l.noDescriptor(c, err)
		}
		return l.connectFailed(c)
	}
	nu.cl, x.up, x.sock.upReady, x.sock.upHup = c, nu, false, false
	if nu.connecting {
		l.setDeadline(c, p.Options().DialTimeout)
		return stepWait
	}
	x.prog.connected = true
	return stepSend
}

// send writes the request up; then waits for the response head.
func (l *loop) send(c *conn) step {
	x := c.x
	cfg := &l.s.cfg
	for len(x.send) > 0 || len(x.sendNext) > 0 {
		if len(x.send) == 0 {
			x.send, x.sendNext, x.sendBody = x.sendNext, nil, true
		}
		n, err := l.sendUp(c, x.up.fd, x.send)
		if n > 0 {
			x.wentUp(int64(n))
			x.send = x.send[n:]
			continue
		}
		switch {
		case err == errQueued:
			return stepWait // its completion runs send again (loop_ring.go)
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			l.setDeadline(c, cfg.IOTimeout)
			return stepWait
		}
		if reason, ok := x.retrySend(!x.up.fresh); ok {
			// A pooled connection that died before it took a byte.
			l.closeUp(x.up)
			return l.redial(c, reason)
		}
		if x.sendBody {
			// The worker stopped taking the body read further for the
			// router (peek.go): it may have answered first, as when the
			// body is spliced (upload).
			return l.earlyAnswer(c, cfg.Waits.EarlyAnswer)
		}
		return l.fail(c, 502)
	}
	c.dropLarge()
	if x.reqLeft > 0 {
		x.phase = phaseUpload
		x.body.clientLowat.mark(c.fd, x.reqLeft)
		c.readable = true // try: the body may be queued already
		return stepUpload
	}
	x.phase = phaseHead
	l.setDeadline(c, cfg.ResponseTimeout)
	if x.sock.upReady {
		return stepRelay
	}
	return stepWait
}

// upload splices the rest of a Content-Length request body from the client
// to the worker through the exchange's pipe (emptied up first, then filled
// from the client: an EAGAIN on an empty pipe is the client's socket),
// the client's socket batched (batch.go). Then the response is awaited.
func (l *loop) upload(c *conn) step {
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
				x.wentUp(n)
				l.setDeadline(c, cfg.IOTimeout)
				continue
			case err == unix.EINTR:
				continue
			case err == unix.EAGAIN:
				l.setDeadline(c, cfg.IOTimeout) // EPOLLOUT on the upstream socket goes on
				return stepWait
			}
			// The worker stopped taking the body (closed, reset): it may
			// have answered first.
			return l.earlyAnswer(c, cfg.Waits.EarlyAnswer)
		}
		if x.reqLeft == 0 {
			x.body.clientLowat.lower(c.fd)
			l.putPipe(p, true)
			x.pipe = nil
			x.phase = phaseHead
			l.setDeadline(c, cfg.ResponseTimeout)
			if x.sock.upReady {
				return stepRelay
			}
			return stepWait
		}
		if !c.readable {
			l.setDeadline(c, cfg.IOTimeout)
			return stepWait
		}
		x.body.clientLowat.mark(c.fd, x.reqLeft)
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
		return l.clientLeft(c)
	}
}

// earlyAnswer: the worker answered (or failed) before it took the whole
// request body. Its answer, if one comes within wait, is relayed; the
// client connection then lingers and closes, its body unread (outcome.go,
// rule 3); else 502 sent.
func (l *loop) earlyAnswer(c *conn, wait time.Duration) step {
	x := c.x
	if x.pipe != nil {
		l.putPipe(x.pipe, false) // what it holds goes nowhere
		x.pipe, x.inPipe = nil, 0
	}
	x.reqLeft = 0
	x.giveUpBody()
	x.phase = phaseHead
	x.sock.upReady = true
	l.setDeadline(c, wait)
	return stepRelay
}

// interimAhead reports whether the bytes a worker sent during an upload
// start an interim (1xx) head: some send a 100 unasked; it is dropped
// later, and the upload goes on (a final answer would stop it).
func interimAhead(fd int) bool {
	var b [10]byte
	n, _, err := unix.Recvfrom(fd, b[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
	return err == nil && n == len(b) && string(b[:5]) == "HTTP/" && b[9] == '1'
}
