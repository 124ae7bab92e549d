package proxy

// The response framing rules, decided here for both data paths (the
// loop's loop_relay.go and the goroutine's gor_response.go call these;
// neither decides framing itself; the rules cited are docs/http-framing.md's):
//
//   - interimPolicy: what becomes of a 1xx head (docs/http-framing.md
//     rules 17, 20);
//   - frameResponse: a final head's body framing and the fate of both
//     connections (docs/http-framing.md rules 19, 22, 24);
//   - frameFirst, frameChunk: which body bytes go to the client, and
//     whether bytes past the framing forbid reusing the upstream
//     connection (docs/http-framing.md rules 14, 22, 23, 24);
//   - spliceBody: which response body bytes may move by splice(2),
//     unseen by the framing;
//   - bodyIdle: how long a body may go without a byte;
//   - lingerBytes: what a lingering close reads at most.

import (
	"bytes"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
)

// interim is what becomes of a 1xx response head.
type interim uint8

const (
	interimDrop   interim = iota // not for the client: skipped
	interimRelay                 // relayed to the client, then the final head is awaited
	interimBroken                // a 101 tether never asked for: a broken response (502)
)

// interimPolicy decides a 1xx head of status: a 100 goes to a client that
// asked for it (Expect: 100-continue), once; any other 1xx to an HTTP/1.1
// client; a 101 is never expected (tether forwards no Upgrade).
func interimPolicy(status int, http10, expect100, sent100 bool) interim {
	switch {
	case status == 101:
		return interimBroken
	case status == 100:
		if expect100 && !sent100 {
			return interimRelay
		}
		return interimDrop // unsolicited or repeated
	case http10:
		return interimDrop
	}
	return interimRelay
}

// respFraming is what a final response head decides: how its body is
// relayed and what becomes of both connections.
type respFraming struct {
	kind     httphead.BodyKind
	dechunk  bool // an HTTP/1.0 client gets a chunked body's data only, ended by the close
	closeCut bool // the client's copy ends at the close: a cut must be a reset
	dropTE   bool // no Transfer-Encoding or Trailer in the head (HTTP/1.0 client)
	keep     bool // the client connection may carry another request
	reuse    bool // the upstream connection may be reused, if the body ends at its framing
}

// frameResponse decides the framing of resp, the final answer to a request
// (isHead: a HEAD; http10: from an HTTP/1.0 client; keepAlive: it allows
// another request; bodySent: its whole body went up; closing: the server
// is shutting down). An upstream connection left mid-request (an early
// answer) is never reused, and a client connection whose body was not all
// read never carries another request.
func frameResponse(resp *httphead.Response, isHead, http10, keepAlive, bodySent, closing bool) respFraming {
	kind := resp.Body(isHead)
	f := respFraming{kind: kind}
	f.dechunk = kind == httphead.BodyChunked && http10
	f.closeCut = kind == httphead.BodyClose || f.dechunk
	f.dropTE = http10 && resp.Chunked
	f.keep = keepAlive && bodySent && !f.closeCut && !closing
	f.reuse = bodySent && !resp.Close && kind != httphead.BodyClose
	return f
}

// frameFirst frames the body bytes that came behind the final head: it
// appends to out what goes to the client, and returns the Content-Length
// bytes still to come (left), whether bytes past the framing came (extra:
// never reuse the upstream connection) and a broken chunked framing (502:
// nothing went out yet). sc is the chunked body's scanner, advanced.
func frameFirst(f *respFraming, resp *httphead.Response, body []byte, sc *httphead.Chunked, out []byte) (_ []byte, left int64, extra bool, err error) {
	switch f.kind {
	case httphead.BodyNone:
		return out, 0, len(body) > 0, nil // a body where none may be
	case httphead.BodyLength:
		left = resp.ContentLength
		if int64(len(body)) > left {
			body, extra = body[:left], true // more than Content-Length
		}
		return append(out, body...), left - int64(len(body)), extra, nil
	case httphead.BodyChunked:
		if f.dechunk {
			out, extra, err = frameChunk(sc, body, true, out)
			return out, 0, extra, err
		}
		body, extra, err = frameChunk(sc, body, false, nil)
		return append(out, body...), 0, extra, err
	}
	return append(out, body...), 0, false, nil // to the close
}

// frameChunk passes p, bytes of a chunked body, through sc and returns
// what goes to the client: p's validly framed prefix (no copy), or, when
// dechunking, out with their data appended. It reports bytes past the
// last chunk (extra) and a framing error (the valid bytes before it are
// returned: they go out before the cut).
func frameChunk(sc *httphead.Chunked, p []byte, dechunk bool, out []byte) (_ []byte, extra bool, err error) {
	var m int
	if dechunk {
		out, m, err = appendDechunked(out, sc, p)
	} else {
		m, err = sc.Scan(p)
		out = p[:m]
	}
	return out, m < len(p) && sc.Done(), err
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

// spliceBody returns how many response body bytes may move by splice(2)
// next, unseen by the framing, or 0 if the next bytes must be read and
// framed (copied). left is a Content-Length body's bytes still to come;
// sc the scanner of a chunked one, whose chunk data, the rest of the
// current chunk, moves by splice when at least min bytes of it are left
// (so SSE events and small chunks are copied and framed at once) and the
// client reads chunked (a dechunked body is rewritten). A body that ends
// at the close moves by splice to its end (-1: no bound).
func spliceBody(kind httphead.BodyKind, left int64, sc *httphead.Chunked, dechunk bool, min int64) int64 {
	switch kind {
	case httphead.BodyLength:
		if left >= min {
			return left
		}
	case httphead.BodyClose:
		return -1
	case httphead.BodyChunked:
		if d := sc.Data(); d >= min && !dechunk {
			return d
		}
	}
	return 0
}

// bodyIdle is how long a response body may go without a byte: a
// Content-Length one the I/O timeout, a streamed one (chunked, to the
// close) the stream idle timeout.
func (c *Config) bodyIdle(kind httphead.BodyKind) time.Duration {
	if kind == httphead.BodyLength {
		return c.IOTimeout
	}
	return c.StreamIdleTimeout
}

// lingerBytes: a lingering close (an answer before the client's whole
// body was read) reads and drops at most this much, for at most
// Waits.Linger, before it closes.
const lingerBytes = 256 << 10

// appendResponseHead writes the response head for the client: HTTP/1.1,
// status and reason as received, fields as received minus hop-by-hop ones
// (and, dropTE, Transfer-Encoding and Trailer), Connection: close when the
// client connection will close, the route header (rt).
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
