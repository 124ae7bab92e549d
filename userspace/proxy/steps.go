package proxy

// The steps of a response that both drivers take, written once: what the
// bytes read from the worker start with (nextHead), an interim head
// relayed (interimHead) or dropped (dropHead), the final head framed for
// the client with the body bytes behind it (finalHead), and the body's
// bytes framed as they come (frameBody). The decisions are these steps';
// each driver only moves the bytes: the loop on raw non-blocking sockets
// (loop_relay.go's head, relayHead, body), a goroutine on blocking
// net.TCPConns (gor_response.go's readResponseHead, relayResponse,
// relayChunkedResponse).

import "github.com/tether-rl/tether/userspace/httphead"

// headNext is what the response bytes read so far start with.
type headNext uint8

const (
	headMore    headNext = iota // no whole head yet: read more
	headFinal                   // the final head (resp): finalHead
	headInterim                 // an interim head for the client: interimHead, then dropHead
	headDrop                    // an interim head not for the client: dropHead
	headBroken                  // a head that breaks the response: 502
)

// errBadResponse: an interim head tether never asked for (a 101).
var errBadResponse = &httphead.Error{Status: 502, Reason: "unexpected 101"}

// nextHead parses the response bytes read (ubuf[:x.uw]) into resp
// (c.resp): a final head, an interim one relayed or dropped as
// interimPolicy says, or a broken head (err says why).
func (c *conn) nextHead(x *exchange, resp *httphead.Response) (headNext, error) {
	err := httphead.ParseResponse(c.ubuf[:x.uw], c.s.cfg.Limits, resp)
	switch {
	case err == httphead.ErrIncomplete:
		return headMore, nil
	case err != nil:
		return headBroken, err
	case resp.Status >= 200:
		return headFinal, nil
	}
	// (The loop never forwards Expect: there a 100 is never the client's.)
	switch interimPolicy(resp.Status, x.req.http10, c.req.Expect100, x.prog.sent100) {
	case interimBroken:
		return headBroken, errBadResponse
	case interimRelay:
		return headInterim, nil
	}
	return headDrop, nil
}

// interimHead is the interim head in c.resp as it goes to the client
// (hop-by-hop fields removed, the route header); a 100 is the exchange's
// one (prog.sent100).
func (c *conn) interimHead(x *exchange, rt routeNote) []byte {
	if c.resp.Status == 100 {
		x.prog.sent100 = true
	}
	out := c.appendResponseHead(c.out[:0], false, false, rt)
	c.out = out[:0]
	return out
}

// dropHead removes the parsed head from the bytes read.
func (c *conn) dropHead(x *exchange) { x.uw = copy(c.ubuf, c.ubuf[c.resp.HeadLen:x.uw]) }

// roomForHead grows ubuf when a head fills it (the parser's limit ends a
// head too long).
func (c *conn) roomForHead(x *exchange) {
	if x.uw == len(c.ubuf) {
		nb := make([]byte, 2*len(c.ubuf))
		copy(nb, c.ubuf[:x.uw])
		c.s.putBuf(c.ubuf)
		c.ubuf = nb
	}
}

// finalHead frames the final head in c.resp (read into ubuf[:x.uw]) for
// x's client: x.fr decided (frameResponse), the head as it goes out and
// the first body bytes behind it framed (frameFirst), x.left and x.sc
// set for the rest; hl is the head's length in out. An error: those
// bytes break the framing (outcome.go's brokenVerdict).
func (c *conn) finalHead(x *exchange, rt routeNote) (out []byte, hl int, err error) {
	resp := c.resp
	x.fr = frameResponse(resp, x.req.head, x.req.http10, x.fr.keep, x.bodySent(), c.s.closing.Load())
	out = c.appendResponseHead(c.out[:0], !x.fr.keep, x.fr.dropTE, rt)
	hl = len(out)
	out, left, extra, err := frameFirst(&x.fr, resp, c.ubuf[resp.HeadLen:x.uw], &x.sc, out)
	if extra {
		x.fr.reuse = false // bytes past the body's framing
	}
	x.left = left
	c.out = out[:0]
	return out, hl, err
}

// frameBody frames response body bytes p by x's framing and returns what
// goes to the client (a framing error: the valid bytes before it, then
// the cut); prog.done once the body ended at its framing.
func (c *conn) frameBody(x *exchange, p []byte) ([]byte, error) {
	switch x.fr.kind {
	case httphead.BodyLength:
		x.left -= int64(len(p))
		x.prog.done = x.left == 0
	case httphead.BodyChunked:
		out, extra, err := frameChunk(&x.sc, p, x.fr.dechunk, c.out[:0])
		if x.fr.dechunk {
			c.out = out[:0]
		}
		if extra {
			x.fr.reuse = false // bytes past the last chunk
		}
		x.prog.done = x.sc.Done()
		return out, err
	}
	return p, nil
}
