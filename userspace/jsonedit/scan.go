// Package jsonedit reads and edits the top level of a JSON object body
// without decoding or re-encoding the rest: [Parse] validates the whole
// body in one pass (the grammar of RFC 8259, as encoding/json accepts it)
// and records where each top-level member's key and value lie; [Apply]
// splices the members to set, replace or delete, copying every other
// member's bytes as they came. A router that must add a few keys
// (bootstrap rooms, kv_transfer_params) to a request whose body is mostly
// a long prompt or token list pays one scan and one copy, not a decode
// and an encode.
//
// Bodies are whole in memory: [ReadBody] reads one under a limit and
// answers [ErrTooLarge] (a 413) above it. Streaming edits are not
// offered: a key to replace may come last, after the whole prompt.
//
// Keys are compared after unescaping, as encoding/json compares them for a
// map. A key present more than once (encoding/json keeps the last) is read
// at its last occurrence; a set replaces its first occurrence and drops the
// others, a delete drops all.
package jsonedit

import (
	"errors"
	"fmt"
)

// maxDepth is encoding/json's nesting limit.
const maxDepth = 10000

// SyntaxError is an invalid body: what was wrong and at which byte.
type SyntaxError struct {
	Offset int
	Msg    string
}

func (e *SyntaxError) Error() string {
	return fmt.Sprintf("jsonedit: invalid JSON at byte %d: %s", e.Offset, e.Msg)
}

// ErrNotObject is a valid JSON body that is not an object.
var ErrNotObject = errors.New("jsonedit: the body is not a JSON object")

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func skipSpace(b []byte, i int) int {
	for i < len(b) && isSpace(b[i]) {
		i++
	}
	return i
}

func synErr(i int, msg string) error { return &SyntaxError{Offset: i, Msg: msg} }

// skipValue validates the value starting at b[i] (no leading space) and
// returns the index just past it.
func skipValue(b []byte, i, depth int) (int, error) {
	if i >= len(b) {
		return i, synErr(i, "unexpected end, a value expected")
	}
	switch c := b[i]; {
	case c == '"':
		end, _, err := skipString(b, i)
		return end, err
	case c == '{':
		return skipObject(b, i, depth+1, nil)
	case c == '[':
		return skipArray(b, i, depth+1)
	case c == '-' || (c >= '0' && c <= '9'):
		return skipNumber(b, i)
	case c == 't':
		return skipLiteral(b, i, "true")
	case c == 'f':
		return skipLiteral(b, i, "false")
	case c == 'n':
		return skipLiteral(b, i, "null")
	default:
		return i, synErr(i, fmt.Sprintf("unexpected %q, a value expected", c))
	}
}

func skipLiteral(b []byte, i int, lit string) (int, error) {
	if len(b)-i < len(lit) || string(b[i:i+len(lit)]) != lit {
		return i, synErr(i, "invalid literal, "+lit+" expected")
	}
	return i + len(lit), nil
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func skipNumber(b []byte, i int) (int, error) {
	start := i
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i] >= '1' && b[i] <= '9':
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	default:
		return i, synErr(start, "invalid number")
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return i, synErr(start, "invalid number: a digit after '.' expected")
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || !isDigit(b[i]) {
			return i, synErr(start, "invalid number: an exponent digit expected")
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	return i, nil
}

func isHex(c byte) bool {
	return isDigit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')
}

// skipString validates the string starting at b[i] == '"' and returns the
// index past its closing quote and whether it needs unescaping (a
// backslash, or a byte outside printable ASCII that encoding/json may
// replace).
func skipString(b []byte, i int) (int, bool, error) {
	start := i
	i++
	plain := true
	for i < len(b) {
		c := b[i]
		switch {
		case c == '"':
			return i + 1, !plain, nil
		case c == '\\':
			plain = false
			if i+1 >= len(b) {
				return i, false, synErr(start, "unterminated string")
			}
			switch b[i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				i += 2
			case 'u':
				if len(b)-i < 6 || !isHex(b[i+2]) || !isHex(b[i+3]) || !isHex(b[i+4]) || !isHex(b[i+5]) {
					return i, false, synErr(i, "invalid \\u escape")
				}
				i += 6
			default:
				return i, false, synErr(i, "invalid escape")
			}
		case c < 0x20:
			return i, false, synErr(i, "control character in string")
		default:
			if c >= 0x80 {
				plain = false
			}
			i++
		}
	}
	return i, false, synErr(start, "unterminated string")
}

func skipArray(b []byte, i, depth int) (int, error) {
	if depth > maxDepth {
		return i, synErr(i, "nesting too deep")
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == ']' {
		return i + 1, nil
	}
	for {
		var err error
		if i, err = skipValue(b, i, depth); err != nil {
			return i, err
		}
		i = skipSpace(b, i)
		if i >= len(b) {
			return i, synErr(i, "unterminated array")
		}
		switch b[i] {
		case ',':
			i = skipSpace(b, i+1)
		case ']':
			return i + 1, nil
		default:
			return i, synErr(i, "',' or ']' expected")
		}
	}
}

// skipObject validates the object at b[i] == '{'; with members non-nil it
// records each member (the top level only calls it so).
func skipObject(b []byte, i, depth int, members *[]Member) (int, error) {
	if depth > maxDepth {
		return i, synErr(i, "nesting too deep")
	}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return i + 1, nil
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return i, synErr(i, "a string key expected")
		}
		keyStart := i
		keyEnd, escaped, err := skipString(b, i)
		if err != nil {
			return keyEnd, err
		}
		i = skipSpace(b, keyEnd)
		if i >= len(b) || b[i] != ':' {
			return i, synErr(i, "':' expected")
		}
		i = skipSpace(b, i+1)
		valStart := i
		if i, err = skipValue(b, i, depth); err != nil {
			return i, err
		}
		if members != nil {
			*members = append(*members, Member{
				KeyStart: keyStart, KeyEnd: keyEnd, ValStart: valStart, ValEnd: i, escaped: escaped,
			})
		}
		i = skipSpace(b, i)
		if i >= len(b) {
			return i, synErr(i, "unterminated object")
		}
		switch b[i] {
		case ',':
			i = skipSpace(b, i+1)
		case '}':
			return i + 1, nil
		default:
			return i, synErr(i, "',' or '}' expected")
		}
	}
}

// Valid reports whether b is one valid JSON value (with surrounding space).
func Valid(b []byte) bool {
	i := skipSpace(b, 0)
	i, err := skipValue(b, i, 0)
	return err == nil && skipSpace(b, i) == len(b)
}
