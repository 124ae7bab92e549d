package proxy

// Sending a request up, the goroutine's send and upload (the loop's
// phases): the head and the body bytes buffered behind it, the wait for a
// 100 Continue, the rest of a Content-Length or chunked body, and the
// look for an early answer.

import (
	"context"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

// send connects and writes the request head up, with the body bytes
// buffered behind it unless the client waits for a 100 Continue (then
// the wait: sendAfterContinue). ended: the exchange ended here (keep:
// the client connection goes on).
func (c *conn) send(x *exchange) (keep, ended bool) {
	req := c.req
	cfg := &c.s.cfg
	up, err := x.w.Pool.Get(context.Background())
	if err != nil {
		return c.refusedOrFail(x, err), true
	}
	x.uc, x.prog.connected = up, true
	out := c.appendUpstreamHead(c.out[:0], x.w, &x.rt)
	// Body bytes already buffered behind the head go in the same write,
	// unless the client waits for 100 Continue.
	waitContinue := req.Expect100 && req.HasBody()
	x.rsc = httphead.Chunked{ExtLimit: cfg.Limits.ChunkExt}
	var rest []byte             // body bytes written from the buffer after out (peek.go)
	r0, left0 := c.r, x.reqLeft // before the buffered body bytes are taken
	if !waitContinue {
		if out, rest, err = c.appendBuffered(out, x); err != nil {
			c.out = out[:0]
			return c.sendFailed(x, err), true
		}
	}
	c.out = out[:0]
	up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
	n, err := up.Write(out)
	x.wentUp(int64(n))
	if reason, ok := x.retrySend(up.Reused()); err != nil && ok {
		// The pooled connection died between the liveness check and the
		// write, and not one request byte went out: the one retry.
		up.Discard()
		x.uc, x.prog.redialed = nil, true
		if up, err = x.w.Pool.Redial(context.Background(), reason); err != nil {
			// Nothing went up: the body bytes taken from the buffer are
			// given back, for the worker a reroute picks (as the loop
			// rewinds to bodyAt).
			c.r, x.reqLeft = r0, left0
			return c.refusedOrFail(x, err), true
		}
		x.uc = up
		up.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
		n, err = up.Write(out)
		x.wentUp(int64(n))
	}
	if err == nil && len(rest) > 0 {
		n, err = up.Write(rest)
		x.wentUp(int64(n))
		if err != nil {
			// The worker stopped taking the body read further for the
			// router (peek.go): it may have answered first, as when the
			// body is relayed (upload).
			c.ubuf = c.s.getBuf()
			return c.sendFailed(x, err), true
		}
	}
	if err != nil {
		return c.fail(x, 502), true
	}
	c.dropLarge()
	c.ubuf = c.s.getBuf()
	if waitContinue {
		return c.sendAfterContinue(x)
	}
	return false, false
}

// sendAfterContinue waits briefly for the worker's 100 (or a final
// answer), then sends the body bytes buffered; a worker that ignores
// Expect gets the body anyway, as curl does.
func (c *conn) sendAfterContinue(x *exchange) (keep, ended bool) {
	x.uc.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.Continue))
	status, err := c.readResponseHead(x)
	switch {
	case err == nil && status == 100:
		// Relayed to the client (once) by readResponseHead.
	case err == nil:
		// A final answer before the body: relay it, then close (the
		// client's body was never read).
		x.giveUpBody()
		c.relayResponse(x)
		return false, true
	case !isTimeout(err):
		return c.answerFailed(x, err), true
	case c.req.Minor == 1:
		// The worker is silent: tell the client to send (RFC 9110
		// §10.1.1 lets a proxy do so) rather than leave a client that
		// waits for the 100 stalled until a timeout. A late 100 from the
		// worker is then dropped: the client sees exactly one.
		if err := c.writeClient(continue100); err != nil {
			return c.clientLeft(x), true
		}
		x.prog.sent100 = true
	}
	out, rest, err := c.appendBuffered(c.out[:0], x)
	if err == nil && len(out) > 0 {
		_, err = x.uc.Write(out)
		x.wentUp(int64(len(out)))
	}
	if err == nil && len(rest) > 0 {
		_, err = x.uc.Write(rest)
		x.wentUp(int64(len(rest)))
	}
	c.out = out[:0]
	if err != nil {
		return c.sendFailed(x, err), true
	}
	return false, false
}

// earlyAnswer relays a final response that the backend sent before taking
// the whole request body (a 413 or 401 and a close, say), which is why
// relaying the body failed: the client gets that answer rather than a 502
// or 408, and its connection closes, since its body was not all read. It
// reports whether there was such an answer.
func (c *conn) earlyAnswer(x *exchange) bool {
	x.uc.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.EarlyAnswer))
	for {
		status, err := c.readResponseHead(x)
		if err != nil {
			return false
		}
		if status >= 200 {
			x.giveUpBody()
			c.relayResponse(x)
			return true
		}
	}
}

// continue100 is the interim response tether sends itself
// (sendAfterContinue).
var continue100 = []byte("HTTP/1.1 100 Continue\r\n\r\n")

// errBodyTooLarge: a chunked request body grew past Config.MaxBodyBytes.
var errBodyTooLarge = &httphead.Error{Status: 413, Reason: "request body too large"}

// appendBuffered moves request body bytes already in the client buffer
// into out (Content-Length bytes up to the length, x.reqLeft; chunked
// bytes as far as they are valid framing, x.rsc); rest: those of a body
// read further for the router, past a pooled buffer's size, to write
// from the buffer after out (splitRankBody).
func (c *conn) appendBuffered(out []byte, x *exchange) (_, rest []byte, _ error) {
	req := c.req
	avail := c.buf[c.r:c.w]
	switch {
	case req.ContentLength > 0:
		take := x.reqLeft
		if int64(len(avail)) < take {
			take = int64(len(avail))
		}
		out, rest = c.splitRankBody(out, avail[:take], x.w, x.rt, true)
		c.r += int(take)
		x.reqLeft -= take
	case req.Chunked:
		n, err := x.rsc.Scan(avail)
		if err != nil {
			return out, nil, err
		}
		out = append(out, avail[:n]...)
		c.r += n
	}
	return out, rest, nil
}

// upload sends what is left of the request body up (the loop's upload).
func (c *conn) upload(x *exchange) error {
	req := c.req
	cfg := &c.s.cfg
	sc := &x.rsc
	switch {
	case req.ContentLength > 0:
		left := x.reqLeft
		if left == 0 {
			return nil
		}
		// Everything buffered was taken: the buffer is free as scratch.
		c.r, c.w = 0, 0
		if c.buf == nil {
			c.buf = c.s.getBuf()
		}
		n, err := c.move(x.uc.TCPConn, c.c, left, c.buf, cfg.IOTimeout)
		x.reqLeft -= n
		x.wentUp(n)
		return err
	case req.Chunked:
		var total int64 // bytes relayed after the head's write, framing included
		for !sc.Done() {
			if lim := cfg.MaxBodyBytes; lim > 0 && total+sc.Data() > lim {
				return errBodyTooLarge // what went upstream dies with its connection
			}
			if d := sc.Data(); d >= cfg.SpliceMin && c.r == c.w {
				n, err := c.move(x.uc.TCPConn, c.c, d, nil, cfg.IOTimeout)
				total += n
				sc.Skip(n)
				x.wentUp(n)
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
				x.uc.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
				w, werr := x.uc.Write(avail[:n])
				x.wentUp(int64(w))
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
