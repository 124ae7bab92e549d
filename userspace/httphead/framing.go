// Framing: the Content-Length and Transfer-Encoding values a head may
// carry, and how a response's body is delimited (Response.Body).

package httphead

import (
	"bytes"
)

// checkTE accepts exactly "chunked" (case-insensitive, OWS trimmed).
func checkTE(v []byte) error {
	if equalFold(v, "chunked") {
		return nil
	}
	// Tell a well-formed list ending in one chunked (an unsupported coding:
	// 501) from anything else (400).
	var chunked, bad bool
	elems := bytes.Split(v, []byte{','})
	for i, e := range elems {
		e = trimOWS(e)
		if !isToken(e) {
			bad = true
			break
		}
		if equalFold(e, "chunked") {
			if chunked || i != len(elems)-1 {
				bad = true
			}
			chunked = true
		}
		if equalFold(e, "identity") {
			bad = true
		}
	}
	if !bad && chunked && len(elems) > 1 {
		return reject(501, "unsupported transfer coding")
	}
	return reject(400, "bad Transfer-Encoding")
}

// parseContentLength accepts 1*DIGIT, at most 19 digits.
func parseContentLength(v []byte) (int64, bool) {
	if len(v) == 0 || len(v) > 19 {
		return 0, false
	}
	var n int64
	for _, c := range v {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	if n < 0 {
		return 0, false
	}
	return n, true
}

// BodyKind says how a response body is framed.
type BodyKind int

const (
	BodyNone   BodyKind = iota // HEAD, 1xx, 204, 304
	BodyLength                 // Content-Length bytes
	BodyChunked
	BodyClose // until the backend closes
)

// Body returns the framing of the response to a request with method
// isHead/not.
func (r *Response) Body(isHead bool) BodyKind {
	switch {
	case isHead || r.Status < 200 || r.Status == 204 || r.Status == 304:
		return BodyNone
	case r.Chunked:
		return BodyChunked
	case r.ContentLength >= 0:
		return BodyLength
	default:
		return BodyClose
	}
}
