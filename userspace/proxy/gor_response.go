package proxy

// The response: waiting for its head (1xx handled), rewriting it, and
// relaying its body by its framing.

import (
	"bytes"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

func (c *conn) awaitAndRelay(x *exchange, uw int) bool {
	x.up.SetReadDeadline(time.Now().Add(c.s.cfg.ResponseTimeout))
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
				switch {
				case st == 101:
					// tether asked for no upgrade: a 101 is a broken backend.
					return 0, uw, errBadResponse
				case st >= 200:
					return st, uw, nil
				case st == 100:
					if c.req.Expect100 && !x.sent100 {
						if err := c.writeInterim(x); err != nil {
							return 0, uw, err
						}
						x.sent100 = true
						c.dropHead(&uw)
						return 100, uw, nil
					}
					// Unsolicited or repeated 100: not for the client.
					c.dropHead(&uw)
					continue
				default:
					if c.req.Minor == 1 {
						if err := c.writeInterim(x); err != nil {
							return 0, uw, err
						}
					}
					c.dropHead(&uw)
					continue
				}
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
		n, err := x.up.Read(c.ubuf[uw:])
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

// appendResponseHead writes the response head for the client: HTTP/1.1,
// status and reason as received, fields as received minus hop-by-hop ones,
// Connection: close when the client connection will close.
func (c *conn) appendResponseHead(out []byte, closing, dropTE bool, rt routeNote) []byte {
	head := c.ubuf[:c.resp.HeadLen]
	line := head[:bytes.IndexByte(head, '\n')+1]
	out = append(out, "HTTP/1.1"...)
	out = append(out, line[8:]...)
	for i := range c.resp.Fields {
		f := &c.resp.Fields[i]
		if f.Drop || dropTE && (httphead.EqualFold(f.Name, "Transfer-Encoding") || httphead.EqualFold(f.Name, "Trailer")) {
			continue // de-chunked for HTTP/1.0: no framing, no trailers
		}
		out = append(out, f.Line...)
	}
	if closing {
		out = append(out, "Connection: close\r\n"...)
	}
	out = c.appendRouteHeader(out, rt)
	return append(out, "\r\n"...)
}

// relayResponse writes the response head and relays its body. bodyRead
// says whether the request body was consumed (false after a final answer
// to Expect: 100-continue, which forces the client connection closed).
func (c *conn) relayResponse(x *exchange, uw int, bodyRead bool) bool {
	req, resp := c.req, c.resp
	cfg := &c.s.cfg
	kind := resp.Body(x.isHead)
	dechunk := kind == httphead.BodyChunked && req.Minor == 0
	// The client's body ends at the close: a cut one must end in a reset.
	x.closeDelimited = kind == httphead.BodyClose || dechunk
	keep := req.KeepAlive && bodyRead && kind != httphead.BodyClose && !c.s.closing.Load()
	// An unread request body (early answer to Expect) leaves the upstream
	// connection mid-message: never reuse it.
	x.reuse = bodyRead && !resp.Close && kind != httphead.BodyClose

	// An HTTP/1.0 client never sees Transfer-Encoding, HEAD included.
	out := c.appendResponseHead(c.out[:0], !keep, req.Minor == 0 && resp.Chunked, c.rt)
	body := c.ubuf[resp.HeadLen:uw]
	var sc httphead.Chunked
	var left int64 // Content-Length bytes still to come
	switch kind {
	case httphead.BodyNone:
		if len(body) > 0 {
			x.reuse = false // a body where none may be: never reuse
		}
		body = nil
	case httphead.BodyLength:
		left = resp.ContentLength
		if int64(len(body)) > left {
			body = body[:left]
			x.reuse = false // more than Content-Length
		}
		left -= int64(len(body))
	case httphead.BodyChunked:
		n, err := sc.Scan(body)
		if err != nil {
			x.reuse = false
			c.s.counters.Truncated.Add(1)
			return c.fail(x, 502)
		}
		if n < len(body) {
			x.reuse = false
		}
		body = body[:n]
		if dechunk {
			// Re-scan from the start, emitting data only (rare: 1.0 clients).
			sc = httphead.Chunked{}
			out, _, _ = appendDechunked(out, &sc, body)
			body = nil
		}
	}
	out = append(out, body...)
	c.out = out[:0]
	if x.learn != nil && x.learn.Status(resp.Status) {
		c.learnBody(x, body, kind == httphead.BodyChunked && !dechunk)
	}
	if err := c.writeClient(out); err != nil {
		x.reuse = false
		c.s.counters.ClientAborted.Add(1)
		return false
	}
	x.sentHead = true

	switch kind {
	case httphead.BodyLength:
		if left > 0 {
			n, err := c.move(c.c, x.up.TCPConn, left, c.ubuf, cfg.IOTimeout)
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
		n, err := c.move(c.c, x.up.TCPConn, 1<<62, c.ubuf, cfg.StreamIdleTimeout)
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
		if d := sc.Data(); d >= cfg.SpliceMin && !dechunk && c.learn == nil {
			n, err := c.move(c.c, x.up.TCPConn, d, nil, cfg.StreamIdleTimeout)
			sc.Skip(n)
			x.w.Stats.AddDown(n)
			if err != nil {
				return err
			}
			continue
		}
		x.up.SetReadDeadline(time.Now().Add(cfg.StreamIdleTimeout))
		n, rerr := x.up.Read(c.ubuf)
		if n > 0 {
			x.w.Stats.AddDown(int64(n))
			p := c.ubuf[:n]
			var out []byte
			var m int
			var serr error
			if dechunk {
				out, m, serr = appendDechunked(c.out[:0], sc, p)
				c.out = out[:0]
			} else {
				m, serr = sc.Scan(p)
				out = p[:m]
			}
			if m < n && sc.Done() {
				x.reuse = false
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

// appendDechunked appends only the chunk data of p to out, validating the
// framing (for HTTP/1.0 clients, which cannot read chunked).
func appendDechunked(out []byte, sc *httphead.Chunked, p []byte) ([]byte, int, error) {
	used := 0
	for used < len(p) && !sc.Done() {
		if d := sc.Data(); d > 0 {
			k := int64(len(p) - used)
			if k > d {
				k = d
			}
			out = append(out, p[used:used+int(k)]...)
			sc.Skip(k)
			used += int(k)
			continue
		}
		if _, err := sc.Scan(p[used : used+1]); err != nil {
			return out, used, err
		}
		used++
	}
	return out, used, nil
}
