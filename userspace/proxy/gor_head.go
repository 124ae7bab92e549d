package proxy

// The request side of a connection: reading and parsing a request head
// (idle waits without a buffer), the first body bytes for routing, and the
// refusals that close the connection.

import (
	"errors"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

// peekBody returns the body bytes buffered behind the head, first reading
// up to Config.PeekBody of them, or what the router asks for (peek.go;
// never beyond the body, never waiting for a client that expects 100
// Continue), within one IOTimeout.
func (c *conn) peekBody() []byte {
	req := c.req
	deadline := false
	for !req.Expect100 {
		want := c.peekTarget(c.r) // (c.r may move)
		// A chunked body has no length to wait for: whatever came with
		// the head is enough, else one read. (Waiting for more stalled a
		// client whose whole small body had arrived:
		// TestChunkedBodyWithHead.)
		if c.w-c.r >= want || req.Chunked && c.w > c.r {
			break
		}
		if !deadline {
			c.c.SetReadDeadline(time.Now().Add(c.s.cfg.IOTimeout))
			deadline = true
		}
		n, err := c.c.Read(c.buf[c.w : c.r+want])
		c.w += n
		if err != nil || req.Chunked {
			break
		}
	}
	c.peekDone()
	end := c.w
	if req.ContentLength >= 0 && int64(end-c.r) > req.ContentLength {
		end = c.r + int(req.ContentLength)
	}
	return c.buf[c.r:end]
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
			err := httphead.ParseRequest(c.buf[c.r:c.w], lim, c.reqp())
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
			// Idle: back to the event loop, at once or after ParkAfter
			// (then wait out the idle timeout there).
			since := time.Unix(0, c.idleSince.Load())
			deadline := since.Add(c.s.cfg.IdleTimeout)
			park := c.lp != nil && !c.noPark && c.s.cfg.ParkAfter >= 0 && c.s.cfg.ParkAfter < c.s.cfg.IdleTimeout
			if park && c.s.cfg.ParkAfter == 0 {
				c.wantPark = true
				return errParked
			}
			if park {
				deadline = since.Add(c.s.cfg.ParkAfter)
			}
			c.c.SetReadDeadline(deadline)
			err := c.readIdle()
			if err != nil && isTimeout(err) {
				// A request that came with the deadline is served, not
				// closed on (idleclose.go).
				err = c.readPending(err)
			}
			if err != nil {
				if park && isTimeout(err) && !c.idleGraceOver(since) {
					// Still idle: serve parks it (shutting down gently
					// too, until the idle grace: the loop closes it then).
					c.wantPark = true
					return err
				}
				c.idle.Store(false)
				return err
			}
			c.idle.Store(false)
			continue
		}
		if c.r > 0 {
			c.w = copy(c.buf, c.buf[c.r:c.w])
			c.r = 0
		}
		c.buf = c.s.roomFor(c.buf, c.w) // (ParseRequest answers 431 past the limit)
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

// errParked: readHead gave the idle connection back to its loop.
var errParked = errors.New("idle: back to the event loop")

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

// readPending reads what came on an idle connection whose wait ended at
// its deadline (the deadline's error err, unless bytes or EOF came). A
// RawConn.Control, not Read: the deadline passed.
func (c *conn) readPending(err error) error {
	c.idleErr = nil
	c.raw.Control(func(fd uintptr) { c.idleRead(fd) }) // (non-blocking)
	if c.buf != nil {
		return nil
	}
	return err
}

// idleGraceOver reports whether the server shuts down and a connection idle
// since then must close now (ShutdownGently's idle grace).
func (c *conn) idleGraceOver(since time.Time) bool {
	return c.s.closing.Load() && time.Since(since) >= time.Duration(c.s.idleGrace.Load())
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
// the client reads the answer rather than a reset (docs/http-framing.md:
// the rules answered with a status and "reject").
func (c *conn) rejectAndClose(status int) {
	if c.reject(status) {
		c.lingerClose()
	}
}

// rejectRequest answers a request tetherd rejects before anything of it
// went up (outcome.go's rejectVerdict: counted), then the lingering close.
func (c *conn) rejectRequest(status int) {
	if c.answerClosing(c.s.rejectVerdict(status).answer) {
		c.lingerClose()
	}
}

// reject answers status (the connection closes after it); false if the
// answer could not be written.
func (c *conn) reject(status int) bool { return c.answerClosing(errorResponse(status, true)) }

// answerClosing writes tetherd's own answer before the close; false if
// it could not be written.
func (c *conn) answerClosing(p []byte) bool {
	c.c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, err := c.c.Write(p)
	return err == nil
}

// lingerClose half-closes and reads what the client still sends, for as
// long and as much as linger.go's lingering allows: closing with unread
// bytes would send a reset that can destroy the answer before the client
// reads it. The caller then closes.
func (c *conn) lingerClose() {
	c.c.CloseWrite()
	var g lingering
	c.c.SetReadDeadline(time.Now().Add(g.begin(&c.s.cfg)))
	var b [lingerChunk]byte
	for {
		n, err := c.c.Read(b[:])
		if g.read(n, err) != lingerAgain {
			return // (no lingerWait: the read blocks until the deadline)
		}
	}
}

// writeClient writes p to the client with the I/O timeout.
func (c *conn) writeClient(p []byte) error {
	c.c.SetWriteDeadline(time.Now().Add(c.s.cfg.IOTimeout))
	_, err := c.c.Write(p)
	return err
}
