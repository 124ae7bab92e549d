package proxy

// The response of a loop's exchange: its head (interim ones relayed),
// its body by the framing, back-pressure from the client (EPOLLOUT), and
// how the exchange ends: done, failed (outcome.go's order), or abandoned.

import (
	"time"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/sysconn"
)

// pump reads the response while the client takes it.
func (l *loop) pump(c *conn) step {
	s := l.s
	x := c.x
	for {
		if len(x.pend) > 0 || x.sock.blocked {
			return stepWait // the client takes what it has first (EPOLLOUT)
		}
		if x.prog.done {
			return stepFinish
		}
		// (Not while a read it queued is replayed: that read's bytes are
		// in ubuf, and a pipe freed meanwhile must not jump them.)
		if x.phase == phaseBody && l.res.c != c && l.splicing(x) {
			if st := l.pumpSplice(c); st != stepOn {
				return st
			}
			if x.prog.done {
				continue
			}
			if x.fr.kind != httphead.BodyChunked || x.inPipe > 0 || x.sc.Data() > 0 {
				return stepWait
			}
			// A chunk's data went through the pipe: its end and the
			// next chunk's size line are read and framed below, in a
			// short read, so that a long next chunk is spliced nearly
			// whole instead of its first 16 KiB copied.
			x.body.lineNext = true
		}
		if x.sock.reparse {
			x.sock.reparse = false
			if st := l.head(c); st != stepOn {
				return st
			}
			continue
		}
		if !x.sock.upReady {
			return stepWait
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
			if x.fr.kind == httphead.BodyLength && int64(len(p)) > x.left {
				p = p[:x.left]
			}
			if x.body.lineNext {
				p = p[:chunkLineRead]
			}
		}
		n, err := l.recv(c, opUpRecv, x.up.fd, p)
		if err == errQueued {
			return stepWait // its completion runs pump again (loop_ring.go)
		}
		x.body.lineNext = false // (kept while queued: the replay reads into the same p)
		if err == unix.EINTR {
			continue
		}
		if err == unix.EAGAIN {
			x.sock.upReady = false
			return stepWait
		}
		if n <= 0 {
			// The worker closed (or reset) the connection.
			if x.phase == phaseHead {
				return l.conclude(c, fault{stage: stageWait})
			}
			if x.fr.kind == httphead.BodyClose && err == nil {
				x.prog.done, x.fr.reuse, x.fr.keep = true, false, false
				continue
			}
			return l.conclude(c, fault{stage: stageRelay})
		}
		x.w.Stats.AddDown(int64(n))
		// A short read drained the socket: the next bytes bring an edge.
		x.sock.upReady = n == len(p) || x.sock.upHup
		if x.phase == phaseHead {
			x.uw += n
			if st := l.head(c); st != stepOn {
				return st
			}
			continue
		}
		if st := l.body(c, p[:n]); st != stepOn {
			return st
		}
	}
}

// chunkLineRead is the read after a spliced chunk's data: its CRLF and the
// next size line (with room for extensions), and the first bytes of the
// next chunk's data, which are copied; the rest of a long chunk is
// spliced.
const chunkLineRead = 256

// head handles the response bytes in ubuf while no final head went out:
// interim heads (a 100 dropped: the loop never sends Expect; others
// relayed), then the final head with the body bytes behind it: stepOn, or
// the ending of the exchange's connection.
func (l *loop) head(c *conn) step {
	s := l.s
	x := c.x
	resp := l.lendResp(c)
	for x.uw > 0 {
		err := httphead.ParseResponse(c.ubuf[:x.uw], s.cfg.Limits, resp)
		if err == httphead.ErrIncomplete {
			return stepOn
		}
		if err != nil {
			return l.fail(c, 502) // a broken head
		}
		if resp.Status >= 200 {
			return l.relayHead(c)
		}
		// (The loop never forwards Expect: a 100 is never the client's.)
		switch interimPolicy(resp.Status, x.req.http10, false, false) {
		case interimBroken:
			return l.fail(c, 502) // an upgrade tether never asked for
		case interimRelay:
			out := c.appendResponseHead(c.out[:0], false, false, x.rt)
			c.out = out[:0]
			ok := l.writeClient(c, out)
			x.uw = copy(c.ubuf, c.ubuf[resp.HeadLen:x.uw])
			if !ok {
				return leaveAborted
			}
			if len(x.pend) > 0 {
				x.sock.reparse = true
				return stepOn
			}
			continue
		}
		x.uw = copy(c.ubuf, c.ubuf[resp.HeadLen:x.uw])
	}
	return stepOn
}

// relayHead writes the final response head and the body bytes behind it.
func (l *loop) relayHead(c *conn) step {
	s := l.s
	x := c.x
	resp := c.resp
	f := frameResponse(resp, x.req.head, x.req.http10, x.fr.keep, !x.body.cut, s.closing.Load())
	x.fr = f
	x.status = resp.Status
	out := c.appendResponseHead(c.out[:0], !x.fr.keep, f.dropTE, x.rt)
	out, left, extra, err := frameFirst(&f, resp, c.ubuf[resp.HeadLen:x.uw], &x.sc, out)
	if extra {
		x.fr.reuse = false
	}
	if err != nil {
		return l.apply(c, s.brokenVerdict(x.reached(l.unread(x))))
	}
	x.left = left
	switch f.kind {
	case httphead.BodyNone:
		x.prog.done = true
	case httphead.BodyLength:
		x.prog.done = x.left == 0
	case httphead.BodyChunked:
		x.prog.done = x.sc.Done()
	}
	c.out = out[:0]
	x.uw = 0
	if !l.writeClient(c, out) {
		return leaveAborted
	}
	x.prog.sentHead = true
	x.phase = phaseBody
	l.setDeadline(c, l.bodyTimeout(x))
	return stepOn
}

func (l *loop) bodyTimeout(x *exchange) time.Duration { return l.s.cfg.bodyIdle(x.fr.kind) }

// body relays response body bytes p by the framing.
func (l *loop) body(c *conn, p []byte) step {
	x := c.x
	out := p
	var serr error
	switch x.fr.kind {
	case httphead.BodyLength:
		x.left -= int64(len(p))
		x.prog.done = x.left == 0
	case httphead.BodyChunked:
		var extra bool
		out, extra, serr = frameChunk(&x.sc, p, x.fr.dechunk, c.out[:0])
		if extra {
			x.fr.reuse = false // bytes past the last chunk
		}
		if x.fr.dechunk {
			c.out = out[:0]
		}
		x.prog.done = x.sc.Done()
	}
	if serr != nil {
		// The valid bytes before the broken framing go out now (not
		// queued: the exchange ends here), then the cut.
		l.writeNow(c, out)
		return l.bodyFailed(c)
	}
	if len(out) > 0 && !l.writeClient(c, out) {
		return leaveAborted
	}
	l.setDeadline(c, l.bodyTimeout(x))
	return stepOn
}

// writeClient writes p to the client; what the socket does not take now
// waits in x.pend for EPOLLOUT (or, queued for the ring, for its
// completion). False if the client is gone.
func (l *loop) writeClient(c *conn, p []byte) bool {
	if l.queue(c, opCliSend, c.fd, p, true) {
		c.x.pend = p // pending until its completion (loop_ring.go: sentClient)
		return true
	}
	p, err := l.writeNow(c, p)
	if err == unix.EAGAIN {
		c.x.pend = p
		l.setDeadline(c, l.s.cfg.IOTimeout)
		return true
	}
	c.x.pend = nil
	return err == nil
}

// writeNow writes p to the client with system calls until it is all
// written or the socket would block (EAGAIN) or fails; it returns what
// is left.
func (l *loop) writeNow(c *conn, p []byte) ([]byte, error) {
	for len(p) > 0 {
		n, err := sysconn.Send(c.fd, p)
		if n > 0 {
			p = p[n:]
			continue
		}
		if err != unix.EINTR {
			return p, err
		}
	}
	return nil, nil
}

// flushClient writes what waited for the client, then goes on.
func (l *loop) flushClient(c *conn) step {
	x := c.x
	x.sock.blocked = false
	if !l.writeClient(c, x.pend) {
		return leaveAborted
	}
	if len(x.pend) == 0 {
		if x.phase == phaseBody {
			l.setDeadline(c, l.bodyTimeout(x))
		}
		return stepRelay
	}
	return stepWait
}
