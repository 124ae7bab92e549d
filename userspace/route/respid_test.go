package route

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/tether-rl/tether/testenv"
)

var responseFieldCases = []struct {
	rule  string
	body  string
	value string
	st    FieldState
}{
	{"plain hit", `{"session_id":"3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b","worker":0}`, "3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b", FieldFound},
	{"hit after other members", `{"ok":true,"n":[1,2,{"a":"}"}],"session_id":"abc"}`, "abc", FieldFound},
	{"whitespace everywhere", " \r\n\t{ \"session_id\" \n:\t\"abc\" }", "abc", FieldFound},
	{"byte order mark", "\xef\xbb\xbf{\"session_id\":\"abc\"}", "abc", FieldFound},
	{"number value", `{"session_id": 12345, "x": 1}`, "12345", FieldFound},
	{"negative exponent number", `{"session_id":-1.5e+3}`, "-1.5e+3", FieldFound},
	{"escaped value decoded", `{"session_id":"a\"b\\c\/d\u00e9\ud83d\ude00"}`, "a\"b\\c/d\u00e9\U0001F600", FieldFound},
	{"escaped key matches", `{"session\u005fid":"abc"}`, "abc", FieldFound},
	{"nested decoy key", `{"a":{"session_id":"x"},"session_id":"y"}`, "y", FieldFound},
	{"nested decoy in array", `{"a":[{"session_id":"x"}],"session_id":"y"}`, "y", FieldFound},
	{"value spelling the field name", `{"name":"session_id","session_id":"y"}`, "y", FieldFound},
	{"quoted field inside a string", `{"msg":"\"session_id\": \"x\"","session_id":"y"}`, "y", FieldFound},
	{"first duplicate wins", `{"session_id":"first","session_id":"second"}`, "first", FieldFound},
	{"braces brackets and escaped quotes in skipped strings", `{"a":"{[\"\\","b":["]}\"",{"c":"\\\"}"}],"session_id":"y"}`, "y", FieldFound},
	{"every kind of skipped value", `{"a":true,"b":false,"c":null,"d":-1.5e3,"e":[],"f":{},"g":"","session_id":"y"}`, "y", FieldFound},
	{"escaped key that is not the field", `{"sess\u0069on":"x","session_id":"y"}`, "y", FieldFound},
	{"lone surrogate decoded as replacement", `{"session_id":"\ud83dx"}`, "\uFFFDx", FieldFound},
	{"zero", `{"session_id":0}`, "0", FieldFound},
	{"byte order mark then whitespace", "\xef\xbb\xbf \n{\"session_id\":\"abc\"}", "abc", FieldFound},
	{"value of exactly the bound", `{"session_id":"` + strings.Repeat("a", MaxFieldValue) + `"}`, strings.Repeat("a", MaxFieldValue), FieldFound},
	{"deep nesting skipped", `{"a":` + strings.Repeat("[", 5000) + strings.Repeat("]", 5000) + `,"session_id":"y"}`, "y", FieldFound},

	{"object ends without the field", `{"id":"abc","worker":1}`, "", FieldAbsent},
	{"empty object", `{}`, "", FieldAbsent},
	{"not an object: array", `[{"session_id":"x"}]`, "", FieldAbsent},
	{"not an object: string", `"session_id"`, "", FieldAbsent},
	{"not an object: null", `null`, "", FieldAbsent},
	{"not JSON", `Created`, "", FieldAbsent},
	{"missing colon", `{"session_id" "x"}`, "", FieldAbsent},
	{"garbage where a key belongs", `{session_id:"x"}`, "", FieldAbsent},
	{"garbage between members", `{"a":1 "session_id":"x"}`, "", FieldAbsent},
	{"trailing comma", `{"a":1,}`, "", FieldAbsent},
	{"value is an object", `{"session_id":{"id":"x"}}`, "", FieldAbsent},
	{"value is true", `{"session_id":true}`, "", FieldAbsent},
	{"value is null", `{"session_id":null}`, "", FieldAbsent},
	{"empty value", `{"session_id":""}`, "", FieldAbsent},
	{"value too long", `{"session_id":"` + strings.Repeat("a", MaxFieldValue+1) + `"}`, "", FieldAbsent},
	{"bad escape in value", `{"session_id":"a\x"}`, "", FieldAbsent},
	{"control character in value", "{\"session_id\":\"a\nb\"}", "", FieldAbsent},
	{"bad number", `{"session_id":01}`, "", FieldAbsent},
	{"number followed by a bracket", `{"session_id":1]`, "", FieldAbsent},
	{"number too long", `{"session_id":` + strings.Repeat("1", MaxFieldValue+1) + `}`, "", FieldAbsent},
	{"value is an array", `{"session_id":["x"]}`, "", FieldAbsent},
	{"value is false", `{"session_id":false}`, "", FieldAbsent},
	{"bad hex in unicode escape", `{"session_id":"\u12g4"}`, "", FieldAbsent},
	{"bad escape in key", `{"se\qssion_id":"x"}`, "", FieldAbsent},
	{"not an object: number", `42`, "", FieldAbsent},
	{"garbage before the brace", `x{"session_id":"y"}`, "", FieldAbsent},
	{"closer first", `}`, "", FieldAbsent},
	{"closer as a member value", `{"a":}`, "", FieldAbsent},

	{"empty", ``, "", FieldMore},
	{"whitespace only", " \n ", "", FieldMore},
	{"cut after brace", `{`, "", FieldMore},
	{"cut in key", `{"sess`, "", FieldMore},
	{"cut before colon", `{"session_id"`, "", FieldMore},
	{"cut after colon", `{"session_id": `, "", FieldMore},
	{"cut in value", `{"session_id":"3f2a`, "", FieldMore},
	{"cut in escape", `{"session_id":"3f2a\`, "", FieldMore},
	{"cut in number", `{"session_id":123`, "", FieldMore},
	{"cut in skipped string", `{"a":"}{`, "", FieldMore},
	{"cut in skipped nesting", `{"a":{"session_id":"x"`, "", FieldMore},
	{"cut in skipped literal", `{"a":tru`, "", FieldMore},
	{"cut after a member", `{"a":1,`, "", FieldMore},
	{"cut in byte order mark", "\xef\xbb", "", FieldMore},
	{"cut in escaped key", `{"session\u00`, "", FieldMore},
	{"cut in unicode escape of the value", `{"session_id":"a\u00`, "", FieldMore},
	{"cut between surrogates", `{"session_id":"\ud83d`, "", FieldMore},
	{"cut after minus", `{"session_id":-`, "", FieldMore},
	{"cut after decimal point", `{"session_id":1.`, "", FieldMore},
	{"cut after exponent sign", `{"session_id":1e+`, "", FieldMore},
	{"cut after a skipped value", `{"a":"x"`, "", FieldMore},
	{"cut after a closed nested value", `{"a":{}`, "", FieldMore},
	{"cut in skipped escape", `{"a":"\`, "", FieldMore},
	{"cut in deep skipped nesting", `{"a":` + strings.Repeat("[{\"b\":", 100), "", FieldMore},
	{"cut in an overlong value", `{"session_id":"` + strings.Repeat("a", 2*MaxFieldValue), "", FieldMore},
}

// validDocs are complete, valid JSON documents: every prefix of each must
// give FieldMore or the whole document's answer, and the whole document
// never FieldMore.
var validDocs = []string{
	`{"session_id":"3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b","worker":0}`,
	`{"worker":3,"session_id":"3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b"}`,
	`{"meta":{"session_id":"decoy","list":[1,{"session_id":2},"]}"]},"name":"session_id","session_id":"real"}`,
	`{"session_id":-12.5E-3,"x":[]}`,
	`{"session_id":7}`,
	`{"session\u005fid":"a\"b\\c\/\u00e9\ud83d\ude00\n"}`,
	`{"msg":"\"session_id\":\"no\"","session_id":"yes","session_id":"dup"}`,
	` { "a" : [ [ ] , { } , "\\" ] , "session_id" : "spaced" } `,
	`{"id":"nope","worker":1}`,
	`{"session_id":null,"x":"y"}`,
	`{"session_id":""}`,
	`{"session_id":{"session_id":"x"}}`,
	`{}`,
	`[{"session_id":"x"}]`,
	`"session_id"`,
	`null`,
}

func TestResponseField(t *testing.T) {
	for _, tc := range responseFieldCases {
		t.Run(tc.rule, func(t *testing.T) {
			v, st := ResponseField([]byte(tc.body), "session_id")
			if st != tc.st || string(v) != tc.value {
				t.Errorf("ResponseField(%.80q) = %q, %v; want %q, %v", tc.body, v, st, tc.value, tc.st)
			}
		})
	}
}

// Every prefix of a document gives FieldMore or the full document's answer:
// the proxy may stop reading anywhere.
func TestResponseFieldPrefixes(t *testing.T) {
	for _, tc := range responseFieldCases {
		full, fst := ResponseField([]byte(tc.body), "session_id")
		for i := 0; i < len(tc.body); i++ {
			v, st := ResponseField([]byte(tc.body[:i]), "session_id")
			if st != FieldMore && (st != fst || !bytes.Equal(v, full)) {
				t.Fatalf("%s: prefix %d %.60q = %q, %v; full document %q, %v", tc.rule, i, tc.body[:i], v, st, full, fst)
			}
		}
	}
}

func TestResponseFieldValidDocPrefixes(t *testing.T) {
	for _, doc := range validDocs {
		if !json.Valid([]byte(doc)) {
			t.Fatalf("not valid JSON: %q", doc)
		}
		full, fst := ResponseField([]byte(doc), "session_id")
		if fst == FieldMore {
			t.Fatalf("%q: a complete document gave FieldMore", doc)
		}
		for i := 0; i < len(doc); i++ {
			v, st := ResponseField([]byte(doc[:i]), "session_id")
			if st != FieldMore && (st != fst || !bytes.Equal(v, full)) {
				t.Fatalf("%q: prefix %d %q = %q, %v; full document %q, %v", doc, i, doc[:i], v, st, full, fst)
			}
		}
	}
}

// firstMember returns the raw value of the first top-level member named
// field of a valid JSON object, walking tokens (encoding/json's Unmarshal
// would keep the last duplicate).
func firstMember(body []byte, field string) (json.RawMessage, bool, bool) {
	dec := json.NewDecoder(bytes.NewReader(body))
	tok, err := dec.Token()
	if err != nil || tok != json.Delim('{') {
		return nil, false, false
	}
	for dec.More() {
		k, err := dec.Token()
		if err != nil {
			return nil, false, false
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, false, false
		}
		if k.(string) == field {
			return raw, true, true
		}
	}
	return nil, false, true
}

func FuzzResponseField(f *testing.F) {
	for _, tc := range responseFieldCases {
		if len(tc.body) < 1024 { // big seeds make minimizing slow
			f.Add([]byte(tc.body), uint16(len(tc.body)/2))
		}
	}
	for _, doc := range validDocs {
		f.Add([]byte(doc), uint16(len(doc)/3))
	}
	f.Fuzz(func(t *testing.T, body []byte, cut uint16) {
		v, st := ResponseField(body, "session_id")
		if st == FieldFound && (len(v) == 0 || len(v) > MaxFieldValue) {
			t.Fatalf("found %q", v)
		}
		if st == FieldFound && len(v) > 0 && !testenv.Within(v, body) && bytes.IndexByte(body, '\\') < 0 {
			t.Fatalf("a value without escapes was copied: %q", v)
		}
		// Prefix consistency at a few cut points drawn from cut.
		if len(body) > 0 {
			x := uint32(cut)
			for range 4 {
				i := int(x % uint32(len(body)))
				pv, pst := ResponseField(body[:i], "session_id")
				if pst != FieldMore && (pst != st || !bytes.Equal(pv, v)) {
					t.Fatalf("prefix %d: %q %v, full: %q %v", i, pv, pst, v, st)
				}
				x = x*1664525 + 1013904223
			}
		}
		// Differential against encoding/json on valid objects.
		if !json.Valid(body) || !utf8.Valid(body) {
			return
		}
		raw, ok, isObj := firstMember(body, "session_id")
		if !isObj {
			if st == FieldFound {
				t.Fatalf("found %q in a non-object %q", v, body)
			}
			return
		}
		want, wantSt := []byte(nil), FieldAbsent
		if ok {
			var s string
			var n json.Number
			d := json.NewDecoder(bytes.NewReader(raw))
			d.UseNumber()
			var any any
			if d.Decode(&any) == nil {
				switch x := any.(type) {
				case string:
					s = x
					if len(s) > 0 && len(s) <= MaxFieldValue {
						want, wantSt = []byte(s), FieldFound
					}
				case json.Number:
					n = x
					if len(n) <= MaxFieldValue {
						want, wantSt = []byte(n), FieldFound
					}
				}
			}
		}
		if st != wantSt || !bytes.Equal(v, want) {
			// A valid document is never "more": it is complete (a bare
			// trailing number aside, which cannot be an object).
			t.Fatalf("%q: got %q %v, encoding/json says %q %v", body, v, st, want, wantSt)
		}
	})
}

func BenchmarkResponseField(b *testing.B) {
	body := []byte(`{"session_id":"3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b","worker":3}`)
	b.ReportAllocs()
	for b.Loop() {
		if _, st := ResponseField(body, "session_id"); st != FieldFound {
			b.Fatal(st)
		}
	}
}
