// Package jsonpeek reads top-level members of a JSON object from the first
// bytes of a body, wherever those bytes end: the request id, prompt and
// prefix of a client's request body, the session id of a create answer.
// It is incremental in the sense that matters to a proxy: a prefix that
// ends too early says so (More) instead of guessing, and every prefix of
// a document gives More or the answer of the whole document. Nothing is
// allocated; string values are returned as they stand in the input
// (Unescape decodes them).
//
// It checks the structure that tells where members begin and end
// (strings with their escapes, nesting) and not the spelling of what it
// skips: the contents of skipped strings, numbers and literals are not
// validated, so a malformed document may yield members that
// encoding/json would refuse; on a valid document it finds exactly the
// members encoding/json does, in order.
package jsonpeek

import (
	"bytes"
	"unicode/utf16"
	"unicode/utf8"
)

// State says what a scan found.
type State uint8

const (
	OK   State = iota // a member (Next)
	End               // the object closed: no more members
	More              // the bytes end before the answer is known: more may tell
	Bad               // not a JSON object, or malformed
)

func (s State) String() string {
	switch s {
	case OK:
		return "ok"
	case End:
		return "end"
	case More:
		return "more"
	}
	return "bad"
}

// Object reads the members of the JSON object at the start of its input
// (after white space and a byte order mark), in order. The zero value
// reads nothing; Open starts one.
type Object struct {
	b     []byte
	i     int
	phase uint8 // phaseOpen, phaseFirst, phaseNext, phaseDone
	last  State // the state phaseDone keeps answering
}

const (
	phaseOpen  = iota // before the '{'
	phaseFirst        // after the '{': a member or '}'
	phaseNext         // after a member: ',' or '}'
	phaseDone         // answered End, More or Bad
)

// Open returns the reader of the object at the start of b.
func Open(b []byte) Object { return Object{b: b} }

// Member is one member of an object.
type Member struct {
	// Key is the member's name as it stands between its quotes (escapes
	// undecoded: compare with KeyIs).
	Key []byte
	// Value holds the value's bytes, as far as they lie within the input;
	// Start is its offset in the input.
	Value []byte
	Start int
	// Complete: the value ends within the input. A value cut by the end
	// of the input is returned once, incomplete; Next then says More.
	Complete bool
	keyEsc   bool
}

const bom = "\xef\xbb\xbf"

func (o *Object) done(s State) (Member, State) {
	o.phase, o.last = phaseDone, s
	return Member{}, s
}

func (o *Object) skipSpace() {
	for o.i < len(o.b) {
		switch o.b[o.i] {
		case ' ', '\t', '\n', '\r':
			o.i++
		default:
			return
		}
	}
}

// Next returns the next member. OK: m is the member (its value possibly
// cut, see Member.Complete); End: the object closed; More: the input ends
// first; Bad: the input is not a JSON object or is malformed. After a
// state other than OK, Next keeps returning it.
func (o *Object) Next() (m Member, st State) {
	switch o.phase {
	case phaseDone:
		return Member{}, o.last
	case phaseOpen:
		o.skipSpace()
		if rest := o.b[o.i:]; len(rest) < len(bom) && len(rest) > 0 && string(rest) == bom[:len(rest)] {
			return o.done(More) // a cut byte order mark
		} else if len(rest) >= len(bom) && string(rest[:len(bom)]) == bom {
			o.i += len(bom)
			o.skipSpace()
		}
		if o.i == len(o.b) {
			return o.done(More)
		}
		if o.b[o.i] != '{' {
			return o.done(Bad)
		}
		o.i++
		o.phase = phaseFirst
		o.skipSpace()
		if o.i == len(o.b) {
			return o.done(More)
		}
		if o.b[o.i] == '}' {
			return o.done(End)
		}
	case phaseNext:
		o.skipSpace()
		if o.i == len(o.b) {
			return o.done(More)
		}
		switch o.b[o.i] {
		case ',':
			o.i++
		case '}':
			return o.done(End)
		default:
			return o.done(Bad)
		}
		o.skipSpace()
		if o.i == len(o.b) {
			return o.done(More)
		}
	case phaseFirst:
		o.skipSpace()
		if o.i == len(o.b) {
			return o.done(More)
		}
	}
	// A member: "key" : value
	if o.b[o.i] != '"' { // a trailing comma, or garbage
		return o.done(Bad)
	}
	ke, complete := String(o.b, o.i)
	if !complete {
		return o.done(More)
	}
	m.Key = o.b[o.i+1 : ke-1]
	if bytes.IndexByte(m.Key, '\\') >= 0 {
		if !validEscapes(m.Key) {
			return o.done(Bad)
		}
		m.keyEsc = true
	}
	o.i = ke
	o.skipSpace()
	if o.i == len(o.b) {
		return o.done(More)
	}
	if o.b[o.i] != ':' {
		return o.done(Bad)
	}
	o.i++
	o.skipSpace()
	if o.i == len(o.b) {
		return o.done(More)
	}
	end, vst := Skip(o.b, o.i)
	switch vst {
	case Bad:
		return o.done(Bad)
	case More:
		m.Value, m.Start = o.b[o.i:], o.i
		o.done(More)
		return m, OK
	}
	m.Value, m.Start, m.Complete = o.b[o.i:end], o.i, true
	o.i = end
	o.phase = phaseNext
	return m, OK
}

// KeyIs reports whether the member's name, decoded, is name.
func (m *Member) KeyIs(name string) bool {
	if !m.keyEsc {
		return string(m.Key) == name
	}
	if len(m.Key) > 6*len(name)+6 {
		return false // too long to be name, however escaped
	}
	var buf [64]byte
	dec, ok := Unescape(buf[:0], m.Key)
	return ok && string(dec) == name
}

// Str returns the contents of a complete string value as they stand
// (escapes undecoded) and whether they hold escapes; ok false when the
// value is not a complete string.
func (m *Member) Str() (raw []byte, esc, ok bool) {
	v := m.Value
	if !m.Complete || len(v) < 2 || v[0] != '"' {
		return nil, false, false
	}
	raw = v[1 : len(v)-1]
	return raw, bytes.IndexByte(raw, '\\') >= 0, true
}

// String returns the index after the JSON string that starts at b[i] ==
// '"' and whether it ends within b (else len(b)). The contents are not
// checked: only where the string ends.
func String(b []byte, i int) (int, bool) {
	j := i + 1
	for {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b), false
		}
		j += k
		n := 0 // backslashes before the quote
		for p := j - 1; p > i && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return j + 1, true
		}
		j++
	}
}

// Skip returns the end of the JSON value that starts at b[i] (white space
// skipped before it): OK, More when b ends first (the end is then len(b)),
// Bad when no value can start there or its structure is malformed. A
// flat array (of numbers: input_ids) is passed with one scan for ']'.
func Skip(b []byte, i int) (int, State) {
	if i >= len(b) {
		return len(b), More
	}
	switch b[i] {
	case '"':
		if e, ok := String(b, i); ok {
			return e, OK
		}
		return len(b), More
	case '[', '{':
		if b[i] == '[' {
			if k := bytes.IndexByte(b[i+1:], ']'); k >= 0 {
				if seg := b[i+1 : i+1+k]; !nested(seg) {
					return i + 2 + k, OK
				}
			} else if !nested(b[i+1:]) {
				return len(b), More
			}
		}
		// Each closer must match its opener: the openers of the first 64
		// levels are kept (a bit each, 1: '{'); deeper ones are counted.
		var open uint64
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				e, ok := String(b, j)
				if !ok {
					return len(b), More
				}
				j = e - 1
			case '{', '[':
				if depth < 64 {
					open <<= 1
					if b[j] == '{' {
						open |= 1
					}
				}
				depth++
			case '}', ']':
				if depth <= 64 {
					if open&1 == 1 != (b[j] == '}') {
						return j, Bad
					}
					open >>= 1
				}
				if depth--; depth == 0 {
					return j + 1, OK
				}
			}
		}
		return len(b), More
	case '}', ']', ',', ':', ' ', '\t', '\n', '\r':
		return i, Bad
	}
	// A literal or number: up to the next delimiter.
	for j := i; j < len(b); j++ {
		switch b[j] {
		case ',', '}', ']', ' ', '\t', '\n', '\r':
			return j, OK
		case '"', '{', '[', ':':
			return j, Bad
		}
	}
	return len(b), More
}

// nested reports whether seg may hold a string or a nested value, or a
// closer that is not the array's (read with the full scan, as the whole
// document would be: a cut array must not read otherwise).
func nested(seg []byte) bool {
	return bytes.IndexByte(seg, '[') >= 0 || bytes.IndexByte(seg, '{') >= 0 || bytes.IndexByte(seg, '"') >= 0 ||
		bytes.IndexByte(seg, '}') >= 0
}

// Number returns the length of the JSON number at the start of b and OK
// when a delimiter that may follow a member's value (white space, ',' or
// '}') follows it; More when it reaches the end of b (it may go on), Bad
// when it is malformed.
func Number(b []byte) (int, State) {
	i := 0
	if i < len(b) && b[i] == '-' {
		i++
	}
	digits := func() int {
		n := 0
		for i < len(b) && b[i] >= '0' && b[i] <= '9' {
			i++
			n++
		}
		return n
	}
	if i == len(b) {
		return 0, More
	}
	if b[i] == '0' {
		i++
	} else if digits() == 0 {
		return 0, Bad
	}
	if i < len(b) && b[i] == '.' {
		i++
		if digits() == 0 {
			if i == len(b) {
				return 0, More
			}
			return 0, Bad
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if digits() == 0 {
			if i == len(b) {
				return 0, More
			}
			return 0, Bad
		}
	}
	if i == len(b) {
		return 0, More
	}
	switch b[i] {
	case ' ', '\t', '\n', '\r', ',', '}':
		return i, OK
	}
	return 0, Bad
}

// validEscapes reports whether every escape of a string's contents is a
// JSON escape.
func validEscapes(raw []byte) bool {
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		if i++; i == len(raw) {
			return false
		}
		switch raw[i] {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		case 'u':
			if _, ok := hex4(raw[i+1:]); !ok {
				return false
			}
			i += 4
		default:
			return false
		}
	}
	return true
}

// Unescape appends the decoded contents of a JSON string (raw: between
// its quotes) to dst; false on a malformed escape. A lone surrogate
// decodes as U+FFFD, as encoding/json does.
func Unescape(dst, raw []byte) ([]byte, bool) {
	for i := 0; i < len(raw); i++ {
		c := raw[i]
		if c != '\\' {
			dst = append(dst, c)
			continue
		}
		if i++; i == len(raw) {
			return dst, false
		}
		switch raw[i] {
		case '"', '\\', '/':
			dst = append(dst, raw[i])
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r, ok := hex4(raw[i+1:])
			if !ok {
				return dst, false
			}
			i += 4
			if utf16.IsSurrogate(r) {
				r2 := rune(-1)
				if i+2 < len(raw) && raw[i+1] == '\\' && raw[i+2] == 'u' {
					if v, ok := hex4(raw[i+3:]); ok {
						r2 = v
					}
				}
				if d := utf16.DecodeRune(r, r2); d != utf8.RuneError {
					r = d
					i += 6
				} else {
					r = utf8.RuneError
				}
			}
			dst = utf8.AppendRune(dst, r)
		default:
			return dst, false
		}
	}
	return dst, true
}

func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	var r rune
	for _, c := range b[:4] {
		var d byte
		switch {
		case c >= '0' && c <= '9':
			d = c - '0'
		case c >= 'a' && c <= 'f':
			d = c - 'a' + 10
		case c >= 'A' && c <= 'F':
			d = c - 'A' + 10
		default:
			return 0, false
		}
		r = r<<4 | rune(d)
	}
	return r, true
}
