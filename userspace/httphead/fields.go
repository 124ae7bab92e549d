// Field lines: reading them up to the empty line, with the rules for names
// and values, and the hop-by-hop rules: the fixed hop-by-hop fields and
// those the Connection field names are never forwarded.

package httphead

import (
	"bytes"
)

// parseFields reads field lines up to the empty line, validating names and
// values. It returns the head length.
func parseFields(it *lineIter, lim Limits, out *[]Field) (int, error) {
	for {
		line, raw, err := it.next()
		if err == ErrIncomplete {
			if len(it.buf) >= lim.Head {
				return 0, reject(431, "head too large")
			}
			return 0, err
		}
		if err != nil {
			return 0, err
		}
		if it.pos > lim.Head {
			return 0, reject(431, "head too large")
		}
		if len(line) == 0 {
			return it.pos, nil
		}
		if line[0] == ' ' || line[0] == '\t' {
			return 0, reject(400, "obs-fold or whitespace before field")
		}
		colon := bytes.IndexByte(line, ':')
		if colon <= 0 {
			return 0, reject(400, "field without name or colon")
		}
		name := line[:colon]
		if !isToken(name) {
			return 0, reject(400, "bad field name")
		}
		value := line[colon+1:]
		for _, c := range value {
			if c < ' ' && c != '\t' || c == 0x7f {
				return 0, reject(400, "control byte in field value")
			}
		}
		if len(*out) >= lim.Fields {
			return 0, reject(431, "too many fields")
		}
		*out = append(*out, Field{Name: name, Value: trimOWS(value), Line: raw})
	}
}

// hopByHop are removed whatever Connection says (RFC 9110 §7.6.1).
// Trailer is not among them: it is end-to-end (RFC 9110 §6.6.2), and the
// trailers it announces are forwarded with the chunked body.
var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Connection", "TE", "Upgrade"}

// connTokens collects the Connection field's tokens.
type connTokens struct {
	close, keepAlive bool
	named            [8][]byte
	n                int
	more             [][]byte
}

func (c *connTokens) add(v []byte) error {
	for len(v) > 0 {
		var tok []byte
		if i := bytes.IndexByte(v, ','); i >= 0 {
			tok, v = trimOWS(v[:i]), v[i+1:]
		} else {
			tok, v = trimOWS(v), nil
		}
		if len(tok) == 0 {
			continue
		}
		if !isToken(tok) {
			return reject(400, "bad Connection token")
		}
		switch {
		case equalFold(tok, "close"):
			c.close = true
		case equalFold(tok, "keep-alive"):
			c.keepAlive = true
		default:
			if c.n < len(c.named) {
				c.named[c.n] = tok
				c.n++
			} else {
				c.more = append(c.more, tok)
			}
		}
	}
	return nil
}

// apply marks as dropped every field Connection names and every fixed
// hop-by-hop field. For requests, naming a framing field or one tether
// adds is an attack: 400.
func (c *connTokens) apply(fs []Field, request bool) error {
	names := append(c.named[:c.n:c.n], c.more...)
	// Connection may not remove the framing (either direction: the peer
	// would then be left without one), nor the fields tether sets.
	protected, status := protectedResponse, 502
	if request {
		protected, status = protectedRequest, 400
	}
	for _, n := range names {
		for _, bad := range protected {
			if equalFold(n, bad) {
				return reject(status, "Connection names a protected field")
			}
		}
	}
	for i := range fs {
		f := &fs[i]
		if f.Drop {
			continue
		}
		for _, h := range hopByHop {
			if equalFold(f.Name, h) {
				f.Drop = true
				break
			}
		}
		for _, n := range names {
			if bytes.EqualFold(f.Name, n) {
				f.Drop = true
				break
			}
		}
	}
	return nil
}

var (
	protectedRequest  = []string{"Content-Length", "Transfer-Encoding", "Host", "X-Forwarded-For"}
	protectedResponse = []string{"Content-Length", "Transfer-Encoding"}
)
