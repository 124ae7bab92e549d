package jsonedit

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

func decode(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(&m); err != nil {
		t.Fatalf("decode %q: %v", b, err)
	}
	return m
}

func TestApply(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		edits      []Edit
		want       string
	}{
		{"inject into empty", `{}`, []Edit{Set("a", []byte(`1`))}, `{"a":1}`},
		{"inject keeps the rest verbatim", ` {"x": [1, 2,  3], "y":"z"} `, []Edit{Set("room", []byte(`42`))}, ` {"x": [1, 2,  3],"y":"z","room":42} `},
		{"replace in place", `{"a":1,"b":2,"c":3}`, []Edit{Set("b", []byte(`"two"`))}, `{"a":1,"b":"two","c":3}`},
		{"delete middle", `{"a":1,"b":2,"c":3}`, []Edit{Delete("b")}, `{"a":1,"c":3}`},
		{"delete first", `{"a":1,"b":2}`, []Edit{Delete("a")}, `{"b":2}`},
		{"delete last", `{"a":1,"b":2}`, []Edit{Delete("b")}, `{"a":1}`},
		{"delete only", `{"a":1}`, []Edit{Delete("a")}, `{}`},
		{"delete absent", `{"a":1}`, []Edit{Delete("z")}, `{"a":1}`},
		{"duplicates: set at first, others dropped", `{"a":1,"b":2,"a":3}`, []Edit{Set("a", []byte(`9`))}, `{"a":9,"b":2}`},
		{"duplicates: delete all", `{"a":1,"b":2,"a":3}`, []Edit{Delete("a")}, `{"b":2}`},
		{"escaped key matched", `{"st\u0072eam":true}`, []Edit{Set("stream", []byte(`false`))}, `{"st\u0072eam":false}`},
		{"later edit wins", `{"a":1}`, []Edit{Set("a", []byte(`2`)), Delete("a")}, `{}`},
		{"delete then set", `{"a":1}`, []Edit{Delete("a"), Set("a", []byte(`3`))}, `{"a":3}`},
		{"nested keys untouched", `{"m":{"stream":true},"stream":true}`, []Edit{Set("stream", []byte(`false`))}, `{"m":{"stream":true},"stream":false}`},
		{"several", `{"stream":true,"stream_options":{"include_usage":true},"max_tokens":100,"min_tokens":5,"prompt":"hi"}`,
			[]Edit{Set("stream", []byte(`false`)), Delete("stream_options"), Set("max_tokens", []byte(`1`)), Delete("min_tokens"), Set("kv_transfer_params", []byte(`{"do_remote_decode":true}`))},
			`{"stream":false,"max_tokens":1,"prompt":"hi","kv_transfer_params":{"do_remote_decode":true}}`},
		{"new key quoted", `{}`, []Edit{SetString("k\"é", "v\n")}, `{"k\"é":"v\n"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Apply([]byte(tc.body), tc.edits...)
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("got  %s\nwant %s", got, tc.want)
			}
		})
	}
}

func TestParseErrors(t *testing.T) {
	for _, body := range []string{``, ` `, `[]`, `1`, `"s"`, `null`, `{`, `{"a"}`, `{"a":}`, `{"a":1,}`, `{"a":1}x`, `{"a":01}`, `{"a":1.}`,
		`{"a":"\x"}`, "{\"a\":\"\x01\"}", `{"a":[1,]}`, `{"a":tru}`, `{a:1}`, `{"a":1 "b":2}`, `{"a":"\u12"}`, `{}{}`} {
		if _, err := Parse([]byte(body)); err == nil {
			t.Errorf("Parse(%q): no error", body)
		}
		if json.Valid([]byte(body)) && strings.HasPrefix(strings.TrimSpace(body), "{") {
			t.Errorf("%q is valid JSON: not an error case", body)
		}
	}
	if _, err := Parse([]byte(`[1]`)); !errors.Is(err, ErrNotObject) {
		t.Errorf("array: %v, want ErrNotObject", err)
	}
	if _, err := Apply([]byte(`{}`), Set("a", []byte(`{`))); err == nil {
		t.Error("an invalid value was accepted")
	}
}

func TestGet(t *testing.T) {
	o, err := Parse([]byte(`{"n": 2 , "a":{"b":1},"n":3,"s\u0074ream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{"n": "3", "a": `{"b":1}`, "stream": "true"} {
		if v, ok := o.Get(key); !ok || string(v) != want {
			t.Errorf("Get(%q) = %q %v, want %q", key, v, ok, want)
		}
	}
	if _, ok := o.Get("b"); ok {
		t.Error("a nested key was found at the top")
	}
}

func TestArrays(t *testing.T) {
	for _, tc := range []struct{ a, b, want string }{
		{`[1,2]`, `[3]`, `[1,2,3]`},
		{`[]`, `[3]`, `[3]`},
		{`[ [1,"x"] ]`, ` [ ] `, `[[1,"x"]]`},
		{`[]`, `[]`, `[]`},
	} {
		got, err := ConcatArrays([]byte(tc.a), []byte(tc.b))
		if err != nil || string(got) != tc.want {
			t.Errorf("ConcatArrays(%s, %s) = %s, %v; want %s", tc.a, tc.b, got, err, tc.want)
		}
	}
	if _, err := ConcatArrays([]byte(`{}`), []byte(`[]`)); err == nil {
		t.Error("an object concatenated")
	}
	if f, err := First([]byte(` [ [1,2], 3 ] `)); err != nil || string(f) != "[1,2]" {
		t.Errorf("First = %s, %v", f, err)
	}
	if f, err := First([]byte(`[]`)); err != nil || f != nil {
		t.Errorf("First([]) = %s, %v", f, err)
	}
	for arr, want := range map[string]int{`[]`: 0, `[1]`: 1, ` [ 1 , [2,3] , {"a":[]} ] `: 3} {
		if n, err := Len([]byte(arr)); err != nil || n != want {
			t.Errorf("Len(%s) = %d, %v", arr, n, err)
		}
	}
	if _, err := Len([]byte(`[1,]`)); err == nil {
		t.Error("Len([1,]) accepted")
	}
	els, err := Elements([]byte(` [ {"a":1} , 2,"x" ] `))
	if err != nil || len(els) != 3 || string(els[0]) != `{"a":1}` || string(els[2]) != `"x"` {
		t.Errorf("Elements = %q, %v", els, err)
	}
}

func TestReadBody(t *testing.T) {
	if b, err := ReadBody(strings.NewReader("12345"), 5); err != nil || string(b) != "12345" {
		t.Fatalf("at the limit: %q %v", b, err)
	}
	if _, err := ReadBody(strings.NewReader("123456"), 5); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("over the limit: %v", err)
	}
}

// FuzzApply checks Parse against encoding/json (same bodies accepted, same
// values) and that an edited body decodes to the original map with the
// edit made.
func FuzzApply(f *testing.F) {
	f.Add([]byte(`{"a":1,"b":[1,2,{"c":null}],"a":"x"}`), "a", []byte(`{"k":[1]}`), false)
	f.Add([]byte(`{"text":"hi","stream":true}`), "stream", []byte(`false`), true)
	f.Add([]byte(`{"st\u0072eam":1e5}`), "stream", []byte(`"\u00e9"`), false)
	f.Add([]byte(` {} `), "bootstrap_room", []byte(`[1,2]`), false)
	f.Add([]byte(`[1]`), "a", []byte(`1`), false)
	f.Fuzz(func(t *testing.T, body []byte, key string, value []byte, del bool) {
		o, err := Parse(body)
		var want map[string]any
		d := json.NewDecoder(bytes.NewReader(body))
		d.UseNumber()
		jerr := d.Decode(&want)
		if jerr == nil && !json.Valid(body) {
			jerr = errors.New("trailing data")
		}
		if jerr == nil && want == nil {
			jerr = errors.New("null") // encoding/json decodes null into a map
		}
		if (err == nil) != (jerr == nil) {
			t.Fatalf("Parse(%q): %v; encoding/json: %v", body, err, jerr)
		}
		if err != nil {
			return
		}
		got := decode(t, body)
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("decode mismatch")
		}
		for k, v := range want {
			raw, ok := o.Get(k)
			if !ok {
				t.Fatalf("Get(%q): absent", k)
			}
			var gv any
			dd := json.NewDecoder(bytes.NewReader(raw))
			dd.UseNumber()
			if err := dd.Decode(&gv); err != nil || !reflect.DeepEqual(gv, v) {
				t.Fatalf("Get(%q) = %s, want %v", k, raw, v)
			}
		}
		if !utf8.ValidString(key) {
			return
		}
		e := Delete(key)
		if !del {
			e = Set(key, value)
		}
		out, err := o.Apply(e)
		if !del && !Valid(value) {
			if err == nil {
				t.Fatalf("invalid value %q accepted", value)
			}
			return
		}
		if err != nil {
			t.Fatalf("Apply: %v", err)
		}
		if del {
			delete(want, key)
		} else {
			var v any
			dd := json.NewDecoder(bytes.NewReader(value))
			dd.UseNumber()
			if err := dd.Decode(&v); err != nil {
				t.Fatalf("Valid accepted %q that encoding/json refuses: %v", value, err)
			}
			want[key] = v
		}
		if got := decode(t, out); !reflect.DeepEqual(got, want) {
			t.Fatalf("edited body %s decodes to %v, want %v", out, got, want)
		}
	})
}
