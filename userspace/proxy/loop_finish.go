package proxy

// How a loop's exchange ends: at its framing (end), failed before or after
// the response head (outcome.go's verdict, applied here: apply, through
// conclude, fail, bodyFailed), abandoned (abandon: the client left,
// leaveAborted), past its deadline (expireExchange), or with the client
// lingering (lingerClose, drain). What becomes of the client connection
// is returned (a step): the loop ends it in one place (leave).

import (
	"time"

	"golang.org/x/sys/unix"
)

// end finishes an exchange whose response ended at its framing.
func (l *loop) end(c *conn) step {
	keep, cut := c.x.fr.keep, c.x.body.cut
	l.finishExchange(c)
	if cut {
		return stepLinger // its body was not all read: no reset over the answer
	}
	if !keep {
		return leaveClose
	}
	c.deadline = 0
	return stepRead
}

// finishExchange counts the exchange's end and releases what it held.
func (l *loop) finishExchange(c *conn) {
	l.cancelIO(c)
	x := c.x
	l.s.exchangeEnded(x.w, x.failed, true, x.status, time.Duration(l.now-x.start))
	if x.dec.Done != nil {
		x.dec.Done()
	}
	if x.pipe != nil {
		l.putPipe(x.pipe, x.inPipe == 0)
	}
	x.body.clientLowat.lower(c.fd)
	if x.up != nil && x.up.fd >= 0 {
		x.body.upLowat.lower(x.up.fd) // never back to the idle list with a raised mark
	}
	if u := x.up; u != nil {
		u.cl = nil
		if x.fr.reuse && x.prog.done && !x.sock.upHup {
			l.putIdle(u)
		} else {
			l.closeUp(u)
		}
	}
	if c.ubuf != nil {
		l.s.putBuf(c.ubuf)
		c.ubuf = nil
	}
	c.busy = false
	l.freeX(c)
}

// fail ends c's exchange with a worker error: status (502 or 504) if no
// response head went out, then the close (outcome.go's gatewayVerdict).
func (l *loop) fail(c *conn, status int) step {
	return l.apply(c, l.s.gatewayVerdict(status, c.x.reached(l.unread(c.x))))
}

// bodyFailed: the response was cut after its head went out; the client
// must see it (outcome.go's endCut).
func (l *loop) bodyFailed(c *conn) step {
	return l.conclude(c, fault{stage: stageRelay})
}

// unread: x's request body was not all read (cut: the rest was given up
// for an early answer).
func (l *loop) unread(x *exchange) bool { return x.reqLeft > 0 || x.body.cut }

// apply carries out v on c's exchange: the answer written (best effort:
// the connection closes), the exchange accounted, then the close, a
// reset or the lingering close.
func (l *loop) apply(c *conn, v verdict) step {
	switch v.end {
	case endAbort:
		return leaveClose // (counted; leave abandons the exchange)
	case endEarly:
		return stepFinish // the loop relays an early answer as any response
	}
	c.x.take(v)
	if v.answer != nil {
		unix.Write(c.fd, v.answer)
	}
	if v.reset {
		unix.SetsockoptLinger(c.fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	}
	l.finishExchange(c)
	if v.linger {
		return stepLinger
	}
	return leaveClose
}

// abandon ends c's exchange, if one runs, without an answer (the client
// left, or the server closes; leave): the upstream connection closes, so
// the worker sees it.
func (l *loop) abandon(c *conn) {
	if !c.busy {
		return
	}
	c.x.fr.reuse = false
	l.finishExchange(c)
}

// expireExchange handles an exchange whose deadline passed.
func (l *loop) expireExchange(c *conn) step {
	x := c.x
	if x.up != nil && x.up.connecting {
		return l.connectFailed(c) // the worker did not answer the connect: nothing sent
	}
	// Where it was: its phase (an upload: the client stopped sending, or
	// the worker taking; the body: the worker went silent), unless the
	// client stopped reading.
	f := fault{stage: x.phase, timeout: true, early: x.body.early}
	if len(x.pend) > 0 || x.sock.blocked {
		f.stage = stageRelay
	}
	return l.conclude(c, f)
}

// conclude ends c's failed exchange as outcome.go decides.
func (l *loop) conclude(c *conn, f fault) step {
	return l.apply(c, l.s.conclude(f, c.x.reached(l.unread(c.x))))
}

// lingerClose half-closes the client connection and reads what it still
// sends, for as long and as much as linger.go's lingering allows, before
// the close: closing with unread bytes would send a reset that can destroy
// the answer before the client reads it. Its deadline is the connection's
// one deadline (expire closes).
func (l *loop) lingerClose(c *conn) step {
	unix.Shutdown(c.fd, unix.SHUT_WR)
	c.readable = true
	l.setDeadline(c, c.linger.begin(&l.s.cfg))
	return l.drain(c)
}

// drain reads and drops what a lingering client sends, until lingering
// says to close or the socket has nothing more for now.
func (l *loop) drain(c *conn) step {
	var scratch [lingerChunk]byte
	for c.readable {
		n, err := unix.Read(c.fd, scratch[:])
		switch c.linger.read(n, err) {
		case lingerWait:
			c.readable = false
			return stepWait
		case lingerDone:
			return leaveClose
		}
	}
	return stepWait
}
