package jsonpeek

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/tether-rl/tether/testenv"
)

// walk renders what an Object reads of b: each member as key=value (the
// key decoded, the value as it stands, "…" after a cut one), then the
// final state.
func walk(b []byte) string { return strings.Join(members(b), " ") }

// members are b's members as walk writes them (key=value, … when cut),
// then the status it ends with: one string each, whatever spaces a key or
// value holds.
func members(b []byte) []string {
	var ms []string
	o := Open(b)
	for {
		m, st := o.Next()
		if st != OK {
			return append(ms, st.String())
		}
		key, ok := Unescape(nil, m.Key)
		if !ok {
			panic("a member with a malformed key")
		}
		s := fmt.Sprintf("%s=%s", key, m.Value)
		if !m.Complete {
			s += "…"
		}
		ms = append(ms, s)
	}
}

var walkCases = []struct {
	rule string
	in   string
	want string
}{
	{"members in order", `{"a":1,"b":"x","c":null}`, `a=1 b="x" c=null end`},
	{"white space everywhere", " \r\n\t{ \"a\" \n:\t1 , \"b\":2 } ", `a=1 b=2 end`},
	{"byte order mark", "\xef\xbb\xbf{\"a\":1}", `a=1 end`},
	{"empty object", `{}`, `end`},
	{"nested values whole", `{"a":{"b":[1,{"c":"]}"}]},"d":[]}`, `a={"b":[1,{"c":"]}"}]} d=[] end`},
	{"flat array in one scan", `{"input_ids":[1,2,3,4],"x":0}`, `input_ids=[1,2,3,4] x=0 end`},
	{"escaped quotes and backslashes", `{"a":"x\"y\\","b":"\\\\"}`, `a="x\"y\\" b="\\\\" end`},
	{"escaped key decoded", `{"r\u0069d":"x"}`, `rid="x" end`},
	{"duplicates both read", `{"a":1,"a":2}`, `a=1 a=2 end`},
	{"deep nesting", `{"a":` + strings.Repeat("[", 3000) + strings.Repeat("]", 3000) + `}`, `a=` + strings.Repeat("[", 3000) + strings.Repeat("]", 3000) + ` end`},
	{"literals not spelled out", `{"a":nul,"b":1x}`, `a=nul b=1x end`},

	{"empty input", ``, `more`},
	{"white space only", " \n", `more`},
	{"cut byte order mark", "\xef\xbb", `more`},
	{"cut after the brace", `{`, `more`},
	{"cut in a key", `{"ab`, `more`},
	{"cut in an escaped key", `{"a\u00`, `more`},
	{"cut before the colon", `{"a"`, `more`},
	{"cut after the colon", `{"a": `, `more`},
	{"cut in a string value", `{"a":"xy`, `a="xy… more`},
	{"cut in an escape", `{"a":"x\`, `a="x\… more`},
	{"cut in a number", `{"a":12`, `a=12… more`},
	{"cut in a nested value", `{"a":[1,{"b":"c"`, `a=[1,{"b":"c"… more`},
	{"cut in a flat array", `{"a":[1,2`, `a=[1,2… more`},
	{"cut after a number (it may go on)", `{"a":1`, `a=1… more`},
	{"cut after a member", `{"a":"x"`, `a="x" more`},
	{"cut after a comma", `{"a":1,`, `a=1 more`},

	{"not an object: array", `[{"a":1}]`, `bad`},
	{"not an object: string", `"a"`, `bad`},
	{"garbage before the brace", `x{"a":1}`, `bad`},
	{"unquoted key", `{a:1}`, `bad`},
	{"missing colon", `{"a" 1}`, `bad`},
	{"missing comma", `{"a":1 "b":2}`, `a=1 bad`},
	{"trailing comma", `{"a":1,}`, `a=1 bad`},
	{"closer as a value", `{"a":}`, `bad`},
	{"comma as a value", `{"a":,"b":1}`, `bad`},
	{"a string glued to a literal", `{"a":tr"ue"}`, `bad`},
	{"bad escape in a key", `{"a\q":1}`, `bad`},
	{"bad unicode escape in a key", `{"a\u12g4":1}`, `bad`},
	{"a bracket closing the object", `{"a":1]`, `a=1 bad`},
	{"a brace closing an array", `{"a":[1}`, `bad`},
	{"a brace closing an array, cut", `{"a":[},`, `bad`},
	{"a bracket closing a nested object", `{"a":[{"b":1]]}`, `bad`},
}

func TestWalk(t *testing.T) {
	for _, tc := range walkCases {
		t.Run(tc.rule, func(t *testing.T) {
			if got := walk([]byte(tc.in)); got != tc.want {
				t.Errorf("walk(%.60q) = %.120q, want %.120q", tc.in, got, tc.want)
			}
		})
	}
}

// consistent checks that every prefix of b reads as b does, as far as it
// goes: the same members (the last one possibly cut), then More. (A cut
// member is read before the bytes that make the whole document malformed
// come.)
func consistent(t *testing.T, b []byte) {
	full := members(b)
	for i := 0; i <= len(b); i++ {
		got := members(b[:i])
		last := got[len(got)-1]
		if last != "more" && last != full[len(full)-1] {
			t.Fatalf("prefix %d of %.60q ends %q, the whole %q", i, b, last, full[len(full)-1])
		}
		for k, m := range got[:len(got)-1] {
			cut := k == len(got)-2 && strings.HasSuffix(m, "…")
			if k >= len(full)-1 {
				if cut && full[len(full)-1] == "bad" {
					continue
				}
				t.Fatalf("prefix %d of %.60q: member %q beyond the whole document's %q", i, b, m, full)
			}
			if m != full[k] && !(cut && (strings.HasPrefix(full[k], strings.TrimSuffix(m, "…")) || full[len(full)-1] == "bad")) {
				t.Fatalf("prefix %d of %.60q: member %q, the whole document has %q", i, b, m, full[k])
			}
		}
	}
}

func TestPrefixes(t *testing.T) {
	for _, tc := range walkCases {
		if len(tc.in) < 200 {
			consistent(t, []byte(tc.in))
		}
	}
}

// tokenMembers walks a valid JSON object with encoding/json: its members
// in order, keys decoded, values compact.
func tokenMembers(b []byte) ([]string, bool) {
	dec := json.NewDecoder(bytes.NewReader(b))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, false
	}
	var out []string
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return nil, false
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, false
		}
		out = append(out, k.(string)+"="+string(raw))
	}
	return out, true
}

func FuzzObject(f *testing.F) {
	for _, tc := range walkCases {
		if len(tc.in) < 1024 {
			f.Add([]byte(tc.in))
		}
	}
	f.Add([]byte(`{"rid":"a","text":"\u00e9\ud83d\ude00","sampling_params":{"n":[1,2]},"stream":true}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		o := Open(b)
		var got []string
		for {
			m, st := o.Next()
			if st != OK {
				break
			}
			if !testenv.Within(m.Key, b) || !testenv.Within(m.Value, b) || len(m.Value) == 0 || &b[m.Start] != &m.Value[0] {
				t.Fatalf("member %q=%q (at %d) is not a span of the input", m.Key, m.Value, m.Start)
			}
			key, ok := Unescape(nil, m.Key)
			if !ok {
				t.Fatalf("member with a malformed key %q", m.Key)
			}
			m.KeyIs(string(key)) // never panics
			if !m.KeyIs(string(key)) && bytes.IndexByte(key, 0xff) < 0 && !bytes.Contains(m.Key, []byte(`\u`)) {
				t.Fatalf("KeyIs(%q) false for its own key %q", key, m.Key)
			}
			// encoding/json decodes keys with each invalid UTF-8 byte replaced.
			got = append(got, replaceInvalid(string(key))+"="+string(m.Value))
		}
		if len(b) < 512 {
			consistent(t, b)
		}
		// Differential against encoding/json on valid objects.
		if !json.Valid(b) {
			return
		}
		want, isObj := tokenMembers(b)
		if !isObj {
			if len(got) > 0 {
				t.Fatalf("members %q in a non-object %q", got, b)
			}
			return
		}
		if len(got) != len(want) {
			t.Fatalf("%q: members %q, encoding/json %q", b, got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%q: member %d %q, encoding/json %q", b, i, got[i], want[i])
			}
		}
	})
}

// replaceInvalid replaces each byte of s that is not valid UTF-8 with
// U+FFFD, as encoding/json decodes strings.
func replaceInvalid(s string) string {
	var sb strings.Builder
	for _, r := range s {
		sb.WriteRune(r) // an invalid byte ranges as utf8.RuneError, one per byte
	}
	return sb.String()
}

// KeyIs and a whole scan of a request body allocate nothing.
func TestNoAllocs(t *testing.T) {
	body := []byte(`{"text":"` + strings.Repeat("a", 4000) + `","sampling_params":{"max_new_tokens":16},"r\u0069d":"x"}`)
	if n := testing.AllocsPerRun(100, func() {
		o := Open(body)
		for {
			m, st := o.Next()
			if st != OK || m.KeyIs("rid") {
				break
			}
		}
	}); n != 0 {
		t.Fatalf("%v allocations", n)
	}
}

func BenchmarkObject(b *testing.B) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("hello ", 600) + `"}],"rid":"3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b"}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		o := Open(body)
		for {
			m, st := o.Next()
			if st != OK {
				b.Fatal(st)
			}
			if m.KeyIs("rid") {
				break
			}
		}
	}
}
