package proxy

// Phase 1 of a loop's exchange: reading and parsing the request head
// (next), and deciding whether the loop runs the exchange itself (fast)
// or hands it to a goroutine.

import (
	"errors"
	"net/http"

	"golang.org/x/sys/unix"

	"github.com/tether-rl/tether/userspace/httphead"
)

// read reads once from the client into its buffer (taken if it has
// none): stepOn, or an ending (the client closed), or stepWait if the read
// was queued for the ring (loop_ring.go: its completion runs next(c) again,
// and this read is handed the result).
func (l *loop) read(c *conn) step {
	if c.buf == nil {
		c.buf, c.r, c.w = l.s.getBuf(), 0, 0
	} else if c.r > 0 {
		c.w = copy(c.buf, c.buf[c.r:c.w])
		c.r = 0
	}
	space := len(c.buf) - c.w
	if space == 0 {
		return stepOn
	}
	for {
		n, err := l.recv(c, opRead, c.fd, c.buf[c.w:])
		switch {
		case err == errQueued:
			return stepWait // its completion runs next(c) again
		case n > 0:
			c.w += n
			c.readable = n == space || c.hup // a full read may have left more; a FIN is still to read
			return stepOn
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			c.readable = false
			return stepOn
		}
		return leaveClose // EOF or reset
	}
}

// next serves what c holds: a complete head starts its exchange; an
// incomplete one waits (head timeout); nothing: c idles without a buffer.
func (l *loop) next(c *conn) step {
	s := l.s
	for !c.busy {
		if c.r == c.w && c.readable {
			if st := l.read(c); st != stepOn {
				return st
			}
		}
		if c.r == c.w {
			if c.buf != nil {
				s.putBuf(c.buf)
				c.buf, c.r, c.w = nil, 0, 0
			}
			l.takeBack(c)
			if s.closing.Load() && s.idleGrace.Load() == 0 {
				return leaveClose
			}
			if c.headSince != 0 || c.deadline == 0 {
				c.headSince = 0
				c.idleSince.Store(l.now)
				l.setDeadline(c, s.cfg.IdleTimeout)
			}
			return stepWait
		}
		err := l.parse(c)
		if err == errIncomplete {
			// (A head that reaches the buffer's end behind a served
			// one: read compacts it first.)
			if c.readable && (c.w < len(c.buf) || c.r > 0) {
				if st := l.read(c); st != stepOn {
					return st
				}
				continue
			}
			if c.w == len(c.buf) && c.r == 0 {
				return l.toGoroutine(c, handoff{}) // a head past the pooled buffer: grown (or 431) there
			}
			if c.headSince == 0 {
				c.headSince = l.now
				l.setDeadline(c, s.cfg.HeadTimeout)
			}
			return stepWait
		}
		c.headSince = 0
		var local http.Handler
		if err == nil {
			var probe bool
			if local, probe = c.local(); probe {
				if st, ok := l.probeInLoop(c, local); ok {
					if st != stepOn {
						return st // answered and closed
					}
					continue // the next request, or idle
				}
			}
		}
		if err != nil || local != nil || c.pdTakes() || !l.fast(c) {
			return l.toGoroutine(c, handoff{}) // parsed again there: answered or served
		}
		if l.peekShort(c) {
			// The router may read a key from the first body bytes
			// (Config.PeekBody, peekWant): wait for them (past
			// --io-timeout, a goroutine takes over).
			if c.readable {
				if st := l.read(c); st != stepOn {
					return st
				}
				continue
			}
			if !c.peekWait {
				c.peekWait = true
				l.setDeadline(c, s.cfg.IOTimeout)
			}
			return stepWait
		}
		c.peekWait = false
		return stepRoute
	}
	return stepWait
}

// errIncomplete: the head is not all there yet.
var errIncomplete = errors.New("incomplete head")

// fast reports whether the loop can run the exchange of c's parsed head
// itself (no Expect, no chunked body, within MaxBodyBytes; the caller has
// ruled out local endpoints); else a goroutine does.
func (l *loop) fast(c *conn) bool {
	req := c.req
	cfg := &l.s.cfg
	if req.Expect100 || req.Chunked {
		return false
	}
	if req.HasBody() && cfg.MaxBodyBytes > 0 && req.ContentLength > cfg.MaxBodyBytes {
		return false // 413, answered (and lingered) the goroutine way
	}
	return true
}

// peekShort reports whether fewer body bytes than the router reads are
// buffered behind c's parsed head (peekTarget: PeekBody's, or what the
// router asked for; then c's buffer may have moved, and its head been
// parsed again).
func (l *loop) peekShort(c *conn) bool {
	req := c.req
	if l.s.cfg.PeekBody == 0 || !req.HasBody() {
		return false
	}
	want := c.peekTarget(c.r + req.HeadLen)
	return c.w-(c.r+req.HeadLen) < want
}

// parse parses the head at the start of c's buffered bytes.
func (l *loop) parse(c *conn) error {
	err := httphead.ParseRequest(c.buf[c.r:c.w], l.s.cfg.Limits, l.lendReq(c))
	if err == httphead.ErrIncomplete {
		return errIncomplete
	}
	return err
}
