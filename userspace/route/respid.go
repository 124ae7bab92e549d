package route

// The id of a learned session is read from the start of its create answer
// ({"session_id":"3f2a...","worker":0}) in whatever prefix of the answer
// the proxy has seen, with the JSON peek scanner (package jsonpeek): a
// prefix that ends too early says so (FieldMore) instead of guessing;
// nothing is allocated unless the value has escapes. A key of a nested
// object or a string value that spells the field's name never matches.

import (
	"github.com/tether-rl/tether/userspace/jsonpeek"
)

// FieldState says what ResponseField found.
type FieldState int

const (
	// FieldFound: value holds the field's value.
	FieldFound FieldState = iota
	// FieldMore: the prefix ends before the answer is known; more bytes
	// may tell.
	FieldMore
	// FieldAbsent: the outermost object ended without the field, the body
	// is not a JSON object or is malformed, or the value is not a
	// non-empty string or number of at most MaxFieldValue bytes: give up.
	FieldAbsent
)

// MaxFieldValue bounds a returned value: session ids are short.
const MaxFieldValue = 256

// ResponseField scans body, the first bytes of a JSON document, for the
// member named field of its outermost object and returns its value: a
// string decoded (a subslice of body when it has no escapes), or the text
// of a number. FieldAbsent: the object ended without the field, the body
// is not a JSON object or is malformed, or the value is not a non-empty
// string or number of at most MaxFieldValue bytes. The first member of
// that name counts.
func ResponseField(body []byte, field string) (value []byte, st FieldState) {
	o := jsonpeek.Open(body)
	for {
		m, st := o.Next()
		switch st {
		case jsonpeek.More:
			return nil, FieldMore
		case jsonpeek.End, jsonpeek.Bad:
			return nil, FieldAbsent
		}
		if m.KeyIs(field) {
			return responseValue(body, &m)
		}
	}
}

// responseValue checks the matched member's value: a non-empty string
// without control characters, or a well-formed number, of at most
// MaxFieldValue bytes.
func responseValue(body []byte, m *jsonpeek.Member) ([]byte, FieldState) {
	switch c := m.Value[0]; {
	case c == '"':
		raw, esc, ok := m.Str()
		if !ok {
			return nil, FieldMore // cut
		}
		for _, c := range raw {
			if c < 0x20 {
				return nil, FieldAbsent
			}
		}
		v := raw
		if esc {
			if v, ok = jsonpeek.Unescape(nil, raw); !ok {
				return nil, FieldAbsent
			}
		}
		if len(v) == 0 || len(v) > MaxFieldValue {
			return nil, FieldAbsent
		}
		return v, FieldFound
	case c == '-' || c >= '0' && c <= '9':
		n, st := jsonpeek.Number(body[m.Start:])
		switch {
		case st == jsonpeek.More:
			return nil, FieldMore
		case st != jsonpeek.OK || n > MaxFieldValue:
			return nil, FieldAbsent
		}
		return body[m.Start : m.Start+n], FieldFound
	}
	return nil, FieldAbsent
}
