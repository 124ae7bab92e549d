package proxy

// The response: waiting for its head (1xx handled), rewriting it, and
// relaying its body by its framing.

import (
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

// pump waits for the response head and relays the response (the loop's
// pump), the client watched meanwhile (watch.go): if it leaves, the
// upstream connection closes at once so the engine cancels the
// generation.
func (c *conn) pump(x *exchange) bool {
	c.watchClient(x.uc)
	keep := c.awaitAndRelay(x)
	if c.stopWatch() {
		keep = c.clientLeft(x) // (the watch closed the upstream)
	}
	return keep
}

func (c *conn) awaitAndRelay(x *exchange) bool {
	x.uc.SetReadDeadline(time.Now().Add(c.s.cfg.ResponseTimeout))
	for {
		status, err := c.readResponseHead(x)
		if err != nil {
			return c.answerFailed(x, err)
		}
		if status >= 200 {
			return c.relayResponse(x)
		}
		// A 100: readResponseHead relayed it (the first one only) and
		// already removed it from ubuf.
	}
}

// readResponseHead reads until ubuf starts with a response head (the
// steps: nextHead). Interim heads for the client are relayed and
// dropped, others dropped; a 100 relayed is returned to the caller. It
// returns the status.
func (c *conn) readResponseHead(x *exchange) (int, error) {
	for {
		if x.uw > 0 {
			next, err := c.nextHead(x, c.respp())
			switch next {
			case headFinal:
				return c.resp.Status, nil
			case headBroken:
				return 0, err
			case headInterim:
				if err := c.writeClient(c.interimHead(x)); err != nil {
					return 0, err
				}
				c.dropHead(x)
				if c.resp.Status == 100 {
					return 100, nil
				}
				continue
			case headDrop:
				c.dropHead(x)
				continue
			}
			c.ubuf = c.s.roomFor(c.ubuf, x.uw)
		}
		n, err := x.uc.Read(c.ubuf[x.uw:])
		x.uw += n
		x.w.Stats.AddDown(int64(n))
		if err != nil && n == 0 {
			return 0, err
		}
	}
}

// relayResponse writes the response head and relays its body (over a
// request body given up, x.linger, the client connection closes after
// it).
func (c *conn) relayResponse(x *exchange) bool {
	resp := c.resp
	cfg := &c.s.cfg
	out, hl, err := c.finalHead(x)
	if err != nil {
		return c.apply(x, c.s.brokenVerdict(x.reached(false)))
	}
	kind, dechunk, keep, left := x.fr.kind, x.fr.dechunk, x.fr.keep, x.left
	if x.learn != nil && x.learn.Status(resp.Status) {
		c.learnBody(x, out[hl:], kind == httphead.BodyChunked && !dechunk)
	}
	if err := c.writeClient(out); err != nil {
		return c.clientLeft(x)
	}
	x.prog.sentHead, x.status = true, resp.Status

	switch kind {
	case httphead.BodyLength:
		if left > 0 {
			n, err := c.move(c.c, x.uc.TCPConn, left, c.ubuf, cfg.bodyIdle(kind))
			x.w.Stats.AddDown(n)
			if err != nil {
				return c.bodyFailed(x, err)
			}
		}
	case httphead.BodyChunked:
		if err := c.relayChunkedResponse(x, dechunk); err != nil {
			return c.bodyFailed(x, err)
		}
	case httphead.BodyClose:
		// Until the backend closes: the move ends with errSrcEOF.
		n, err := c.move(c.c, x.uc.TCPConn, 1<<62, c.ubuf, cfg.bodyIdle(kind))
		x.w.Stats.AddDown(n)
		if err != errSrcEOF {
			return c.bodyFailed(x, err)
		}
		x.prog.done = true
		return false
	}
	x.prog.done = true
	return keep
}

// relayChunkedResponse streams a chunked body: every piece the backend
// writes is forwarded as soon as its framing is validated (SSE events reach
// the client at once); long chunk data is spliced.
func (c *conn) relayChunkedResponse(x *exchange, dechunk bool) error {
	cfg := &c.s.cfg
	sc := &x.sc
	for !sc.Done() {
		if d := spliceBody(httphead.BodyChunked, 0, sc, dechunk, cfg.SpliceMin); d > 0 && c.learn == nil {
			n, err := c.move(c.c, x.uc.TCPConn, d, nil, cfg.StreamIdleTimeout)
			sc.Skip(n)
			x.w.Stats.AddDown(n)
			if err != nil {
				return err
			}
			continue
		}
		x.uc.SetReadDeadline(time.Now().Add(cfg.StreamIdleTimeout))
		n, rerr := x.uc.Read(c.ubuf)
		if n > 0 {
			x.w.Stats.AddDown(int64(n))
			out, serr := c.frameBody(x, c.ubuf[:n])
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
