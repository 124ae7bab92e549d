package proxy

// The response: waiting for its head (1xx handled), rewriting it, and
// relaying its body by its framing.

import (
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

func (c *conn) awaitAndRelay(x *exchange, uw int) bool {
	x.uc.SetReadDeadline(time.Now().Add(c.s.cfg.ResponseTimeout))
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
			err := httphead.ParseResponse(c.ubuf[:uw], c.s.cfg.Limits, c.respp())
			if err == nil {
				st := c.resp.Status
				if st >= 200 {
					return st, uw, nil
				}
				switch interimPolicy(st, c.req.Minor == 0, c.req.Expect100, x.sent100) {
				case interimBroken:
					return 0, uw, errBadResponse
				case interimRelay:
					if err := c.writeInterim(x); err != nil {
						return 0, uw, err
					}
					if st == 100 {
						x.sent100 = true
						c.dropHead(&uw)
						return 100, uw, nil
					}
				}
				c.dropHead(&uw)
				continue
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
		n, err := x.uc.Read(c.ubuf[uw:])
		uw += n
		x.w.Stats.AddDown(int64(n))
		if err != nil && n == 0 {
			return 0, uw, err
		}
	}
}

var errBadResponse = &httphead.Error{Status: 502, Reason: "unexpected 101"}

// writeInterim relays a 1xx head (hop-by-hop fields removed).
func (c *conn) writeInterim(x *exchange) error {
	out := c.appendResponseHead(c.out[:0], false, false, c.rt)
	c.out = out[:0]
	return c.writeClient(out)
}

// relayResponse writes the response head and relays its body. bodyRead
// says whether the request body was consumed (false after a final answer
// to Expect: 100-continue, which forces the client connection closed).
func (c *conn) relayResponse(x *exchange, uw int, bodyRead bool) bool {
	req, resp := c.req, c.resp
	cfg := &c.s.cfg
	f := frameResponse(resp, x.req.head, req.Minor == 0, req.KeepAlive, bodyRead, c.s.closing.Load())
	kind, dechunk, keep := f.kind, f.dechunk, f.keep
	x.fr.closeCut = f.closeCut
	x.fr.reuse = f.reuse

	out := c.appendResponseHead(c.out[:0], !keep, f.dropTE, c.rt)
	hl := len(out)
	var sc httphead.Chunked
	out, left, extra, err := frameFirst(&f, resp, c.ubuf[resp.HeadLen:uw], &sc, out)
	if extra {
		x.fr.reuse = false
	}
	if err != nil {
		return c.apply(x, c.s.brokenVerdict(x.reached(false)))
	}
	c.out = out[:0]
	if x.learn != nil && x.learn.Status(resp.Status) {
		c.learnBody(x, out[hl:], kind == httphead.BodyChunked && !dechunk)
	}
	if err := c.writeClient(out); err != nil {
		return c.clientLeft(x)
	}
	x.prog.sentHead = true

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
		if err := c.relayChunkedResponse(x, &sc, dechunk); err != nil {
			return c.bodyFailed(x, err)
		}
	case httphead.BodyClose:
		// Until the backend closes: the move ends with errSrcEOF.
		n, err := c.move(c.c, x.uc.TCPConn, 1<<62, c.ubuf, cfg.bodyIdle(kind))
		x.w.Stats.AddDown(n)
		if err != errSrcEOF {
			return c.bodyFailed(x, err)
		}
		return false
	}
	return keep
}

// relayChunkedResponse streams a chunked body: every piece the backend
// writes is forwarded as soon as its framing is validated (SSE events reach
// the client at once); long chunk data is spliced.
func (c *conn) relayChunkedResponse(x *exchange, sc *httphead.Chunked, dechunk bool) error {
	cfg := &c.s.cfg
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
			out, extra, serr := frameChunk(sc, c.ubuf[:n], dechunk, c.out[:0])
			if dechunk {
				c.out = out[:0]
			}
			if extra {
				x.fr.reuse = false
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
