package jsonedit

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// Member is one top-level member of an object: byte offsets into the body
// of its key (quotes included) and of its value.
type Member struct {
	KeyStart, KeyEnd int
	ValStart, ValEnd int
	escaped          bool
}

// Object is a parsed body: the body itself and its top-level members in
// order.
type Object struct {
	Body    []byte
	Members []Member
	open    int // index of '{'
	close   int // index past '}'
}

// Parse validates body as one JSON object (surrounding space allowed) and
// records its top-level members. It keeps body, not a copy.
func Parse(body []byte) (*Object, error) {
	o := &Object{}
	if err := o.Reset(body); err != nil {
		return nil, err
	}
	return o, nil
}

// Reset parses body into o, reusing its member slice.
func (o *Object) Reset(body []byte) error {
	o.Body, o.Members = body, o.Members[:0]
	i := skipSpace(body, 0)
	if i >= len(body) {
		return synErr(i, "empty body")
	}
	if body[i] != '{' {
		if end, err := skipValue(body, i, 0); err != nil {
			return err
		} else if skipSpace(body, end) != len(body) {
			return synErr(end, "data after the value")
		}
		return ErrNotObject
	}
	o.open = i
	end, err := skipObject(body, i, 1, &o.Members)
	if err != nil {
		return err
	}
	if j := skipSpace(body, end); j != len(body) {
		return synErr(j, "data after the object")
	}
	o.close = end
	return nil
}

// Key returns member m's key, unescaped as encoding/json would.
func (o *Object) Key(m Member) string {
	raw := o.Body[m.KeyStart:m.KeyEnd]
	if !m.escaped {
		return string(raw[1 : len(raw)-1])
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return string(raw[1 : len(raw)-1]) // cannot happen: the string was validated
	}
	return s
}

func (o *Object) keyIs(m Member, key string) bool {
	if !m.escaped {
		return m.KeyEnd-m.KeyStart == len(key)+2 && string(o.Body[m.KeyStart+1:m.KeyEnd-1]) == key
	}
	return o.Key(m) == key
}

// Get returns the raw value of key (its last occurrence, as encoding/json
// decodes it) and whether it is present.
func (o *Object) Get(key string) ([]byte, bool) {
	for i := len(o.Members) - 1; i >= 0; i-- {
		if m := o.Members[i]; o.keyIs(m, key) {
			return o.Body[m.ValStart:m.ValEnd], true
		}
	}
	return nil, false
}

// Has reports whether key is present.
func (o *Object) Has(key string) bool { _, ok := o.Get(key); return ok }

// Edit is one change at the top level: Key set to Value (raw JSON, which
// the caller makes valid: [Apply] checks it) or, with Delete, removed.
type Edit struct {
	Key    string
	Value  []byte
	Delete bool
}

// Set is an edit that sets key to the raw JSON value.
func Set(key string, value []byte) Edit { return Edit{Key: key, Value: value} }

// SetString is an edit that sets key to a JSON string.
func SetString(key, s string) Edit { return Edit{Key: key, Value: AppendString(nil, s)} }

// Delete is an edit that removes key.
func Delete(key string) Edit { return Edit{Key: key, Delete: true} }

// Apply returns a new body: o's with the edits made, in order (a later edit
// of the same key wins). Set keys already present keep their place; new
// ones go at the end. Every member not edited is copied byte for byte; the
// space between members is not kept. o is not changed.
func (o *Object) Apply(edits ...Edit) ([]byte, error) {
	n := len(o.Body)
	for _, e := range edits {
		n += len(e.Key) + len(e.Value) + 8
	}
	return o.AppendApply(make([]byte, 0, n), edits...)
}

// AppendApply is Apply appending to dst.
func (o *Object) AppendApply(dst []byte, edits ...Edit) ([]byte, error) {
	// The edit in force for each key (the last), keys in first-seen order.
	var keys []string
	final := make(map[string]Edit, len(edits))
	for _, e := range edits {
		if !e.Delete && !Valid(e.Value) {
			return dst, fmt.Errorf("jsonedit: the value for %q is not valid JSON", e.Key)
		}
		if _, seen := final[e.Key]; !seen {
			keys = append(keys, e.Key)
		}
		final[e.Key] = e
	}
	placed := make(map[string]bool, len(keys))
	body := o.Body
	dst = append(dst, body[:o.open+1]...)
	first := true
	sep := func() {
		if !first {
			dst = append(dst, ',')
		}
		first = false
	}
	for _, m := range o.Members {
		if len(final) > 0 {
			key := o.Key(m)
			if e, edited := final[key]; edited {
				if e.Delete || placed[key] {
					continue // deleted, or set at its first occurrence already
				}
				placed[key] = true
				sep()
				dst = append(dst, body[m.KeyStart:m.KeyEnd]...)
				dst = append(dst, ':')
				dst = append(dst, e.Value...)
				continue
			}
		}
		sep()
		dst = append(dst, body[m.KeyStart:m.ValEnd]...)
	}
	for _, k := range keys {
		if e := final[k]; !e.Delete && !placed[k] {
			sep()
			dst = AppendString(dst, k)
			dst = append(dst, ':')
			dst = append(dst, e.Value...)
		}
	}
	dst = append(dst, '}')
	dst = append(dst, body[o.close:]...)
	return dst, nil
}

// AppendString appends s as a JSON string.
func AppendString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x80 || c == '"' || c == '\\' {
			b, _ := json.Marshal(s) // a string always marshals
			return append(dst, b...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// Apply parses body and applies the edits: [Parse] then [Object.Apply].
func Apply(body []byte, edits ...Edit) ([]byte, error) {
	o, err := Parse(body)
	if err != nil {
		return nil, err
	}
	return o.Apply(edits...)
}

// Elements returns the raw elements of a JSON array (validated).
func Elements(arr []byte) ([][]byte, error) {
	i := skipSpace(arr, 0)
	if i >= len(arr) || arr[i] != '[' {
		return nil, errors.New("jsonedit: not an array")
	}
	var out [][]byte
	i = skipSpace(arr, i+1)
	if i < len(arr) && arr[i] == ']' {
		if skipSpace(arr, i+1) != len(arr) {
			return nil, synErr(i+1, "data after the array")
		}
		return out, nil
	}
	for {
		start := i
		end, err := skipValue(arr, i, 1)
		if err != nil {
			return nil, err
		}
		out = append(out, arr[start:end])
		i = skipSpace(arr, end)
		if i >= len(arr) {
			return nil, synErr(i, "unterminated array")
		}
		switch arr[i] {
		case ',':
			i = skipSpace(arr, i+1)
		case ']':
			if skipSpace(arr, i+1) != len(arr) {
				return nil, synErr(i+1, "data after the array")
			}
			return out, nil
		default:
			return nil, synErr(i, "',' or ']' expected")
		}
	}
}

// First returns the first element of a valid JSON array (nil for an
// empty one) without reading the rest.
func First(arr []byte) ([]byte, error) {
	i := skipSpace(arr, 0)
	if i >= len(arr) || arr[i] != '[' {
		return nil, errors.New("jsonedit: not an array")
	}
	i = skipSpace(arr, i+1)
	if i < len(arr) && arr[i] == ']' {
		return nil, nil
	}
	end, err := skipValue(arr, i, 1)
	if err != nil {
		return nil, err
	}
	return arr[i:end], nil
}

// Len returns the number of elements of a JSON array, validating it,
// without keeping them.
func Len(arr []byte) (int, error) {
	i := skipSpace(arr, 0)
	if i >= len(arr) || arr[i] != '[' {
		return 0, errors.New("jsonedit: not an array")
	}
	i = skipSpace(arr, i+1)
	if i < len(arr) && arr[i] == ']' {
		return 0, nil
	}
	n := 0
	for {
		end, err := skipValue(arr, i, 1)
		if err != nil {
			return 0, err
		}
		n++
		i = skipSpace(arr, end)
		if i >= len(arr) {
			return 0, synErr(i, "unterminated array")
		}
		switch arr[i] {
		case ',':
			i = skipSpace(arr, i+1)
		case ']':
			return n, nil
		default:
			return 0, synErr(i, "',' or ']' expected")
		}
	}
}

// ConcatArrays returns one array with a's elements then b's, splicing the
// bytes of both (each must be a valid array).
func ConcatArrays(a, b []byte) ([]byte, error) {
	ai, err := arrayInner(a)
	if err != nil {
		return nil, err
	}
	bi, err := arrayInner(b)
	if err != nil {
		return nil, err
	}
	out := make([]byte, 0, len(ai)+len(bi)+3)
	out = append(out, '[')
	out = append(out, ai...)
	if len(ai) > 0 && len(bi) > 0 {
		out = append(out, ',')
	}
	out = append(out, bi...)
	return append(out, ']'), nil
}

// arrayInner returns what lies between an array's brackets, trimmed.
func arrayInner(a []byte) ([]byte, error) {
	i := skipSpace(a, 0)
	if i >= len(a) || a[i] != '[' {
		return nil, errors.New("jsonedit: not an array")
	}
	end, err := skipArray(a, i, 1)
	if err != nil {
		return nil, err
	}
	if skipSpace(a, end) != len(a) {
		return nil, synErr(end, "data after the array")
	}
	inner := a[skipSpace(a, i+1) : end-1]
	for len(inner) > 0 && isSpace(inner[len(inner)-1]) {
		inner = inner[:len(inner)-1]
	}
	return inner, nil
}

// ErrTooLarge is a body over ReadBody's limit: answer 413.
var ErrTooLarge = errors.New("jsonedit: request body too large")

// ReadBody reads r whole, up to limit bytes; more is ErrTooLarge.
func ReadBody(r io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, fmt.Errorf("jsonedit: reading the body: %w", err)
	}
	if int64(len(b)) > limit {
		return nil, fmt.Errorf("%w (over %d bytes)", ErrTooLarge, limit)
	}
	return b, nil
}
