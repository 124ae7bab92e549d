package proxy

// Sending a request up: the body bytes buffered behind the head, the rest
// of a Content-Length or chunked body, and the look for an early answer.

import (
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

// earlyAnswer relays a final response that the backend sent before taking
// the whole request body (a 413 or 401 and a close, say), which is why
// relaying the body failed: the client gets that answer rather than a 502
// or 408, and its connection closes, since its body was not all read. It
// reports whether there was such an answer.
func (c *conn) earlyAnswer(x *exchange, uw int) bool {
	x.uc.SetReadDeadline(time.Now().Add(c.s.cfg.Waits.EarlyAnswer))
	for {
		status, nw, err := c.readResponseHead(x, uw)
		uw = nw
		if err != nil {
			return false
		}
		if status >= 200 {
			c.relayResponse(x, uw, false)
			x.linger = true
			return true
		}
	}
}

// continue100 is the interim response tether sends itself (see
// proxyExchange).
var continue100 = []byte("HTTP/1.1 100 Continue\r\n\r\n")

// errBodyTooLarge: a chunked request body grew past Config.MaxBodyBytes.
var errBodyTooLarge = &httphead.Error{Status: 413, Reason: "request body too large"}

// appendBuffered moves request body bytes already in the client buffer
// into out (Content-Length bytes up to the length; chunked bytes as far as
// they are valid framing). It returns out and the Content-Length bytes
// taken so far (sent is the count already sent before).
func (c *conn) appendBuffered(out []byte, sc *httphead.Chunked, sent int64) ([]byte, int64, error) {
	req := c.req
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
	req := c.req
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
		n, err := c.move(x.uc.TCPConn, c.c, left, c.buf, cfg.IOTimeout)
		x.w.Stats.AddUp(n)
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
				x.uc.SetWriteDeadline(time.Now().Add(cfg.IOTimeout))
				w, werr := x.uc.Write(avail[:n])
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
