package engine

import (
	"bytes"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
)

// Request ids come from the first bytes of client bodies, possibly cut
// anywhere by the peek: never a panic, never a byte outside the body, and
// a rid found is the value of a top-level request-id key.
func FuzzRequestID(f *testing.F) {
	for _, s := range []string{`{"rid":"abc","text":"x"}`, `{"text":"x","rid":"a\"b"}`, `{"rid":["a","b"]}`,
		`{"a":{"rid":"inner"},"rid":"outer"}`, `{"rid":"cut`, `  {"rid" : "x\u0041"}`, `[{"rid":"x"}]`, "5\r\n{\"rid\":\"y\"}"} {
		f.Add([]byte(s), false)
		f.Add([]byte(s), true)
	}
	f.Fuzz(func(t *testing.T, body []byte, chunked bool) {
		req := &httphead.Request{Chunked: chunked, ContentLength: -1}
		rid := RequestID(req, body)
		if !testenv.Within(rid, body) {
			t.Fatalf("rid %q is not within the body", rid)
		}
		if len(rid) > 0 {
			keyed := false
			for _, k := range dialect.RequestIDKeys() {
				keyed = keyed || bytes.Contains(body, []byte(k))
			}
			if !keyed {
				t.Fatalf("rid %q from a body without a request-id key: %q", rid, body)
			}
			ridString(rid) // unescapes without panicking
		}
	})
}
