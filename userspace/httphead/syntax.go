// The lexical layer: RFC 9110 tokens, ASCII case folding, optional
// whitespace, digits, and splitting a head into CRLF-terminated lines.

package httphead

import (
	"bytes"
)

// tchar per RFC 9110 §5.6.2.
var tchar = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
		t[c-32] = true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return t
}()

func isToken(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if !tchar[c] {
			return false
		}
	}
	return true
}

// IsToken reports whether s is an RFC 9110 token (a valid field name).
func IsToken(s string) bool { return isToken([]byte(s)) }

// EqualFold compares a received name with an ASCII name, case-insensitively.
func EqualFold(b []byte, s string) bool { return equalFold(b, s) }

// equalFold compares ASCII case-insensitively.
func equalFold(b []byte, s string) bool {
	if len(b) != len(s) {
		return false
	}
	for i := 0; i < len(b); i++ {
		c, d := b[i], s[i]
		if c == d {
			continue
		}
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if 'A' <= d && d <= 'Z' {
			d += 'a' - 'A'
		}
		if c != d {
			return false
		}
	}
	return true
}

func hasPrefixFold(b []byte, p string) bool {
	return len(b) >= len(p) && equalFold(b[:len(p)], p)
}

func trimOWS(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	for len(b) > 0 && (b[len(b)-1] == ' ' || b[len(b)-1] == '\t') {
		b = b[:len(b)-1]
	}
	return b
}

func allDigits(b []byte) bool {
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// lines splits the head in buf into lines ending in CRLF, enforcing the
// line-ending rules (no bare CR or LF). It returns the head length, or
// ErrIncomplete. firstMax bounds the first line (414 for requests).
type lineIter struct {
	buf []byte
	pos int
}

// next returns the next line without its CRLF and the line with it.
func (it *lineIter) next() (line, raw []byte, err error) {
	rest := it.buf[it.pos:]
	i := bytes.IndexByte(rest, '\n')
	if i < 0 {
		if j := bytes.IndexByte(rest, '\r'); j >= 0 && j+1 < len(rest) {
			return nil, nil, reject(400, "bare CR in head")
		}
		return nil, nil, ErrIncomplete
	}
	if i == 0 || rest[i-1] != '\r' {
		return nil, nil, reject(400, "bare LF in head")
	}
	line = rest[:i-1]
	if bytes.IndexByte(line, '\r') >= 0 {
		return nil, nil, reject(400, "bare CR in head")
	}
	raw = rest[:i+1]
	it.pos += i + 1
	return line, raw, nil
}
