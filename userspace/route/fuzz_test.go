package route

import (
	"bytes"
	"strconv"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
)

// The peeked body comes straight from the client, before its framing is
// validated: any bytes, never a panic, never a byte outside the peek.
func FuzzPeekedBody(f *testing.F) {
	for _, s := range []string{"5\r\nhello\r\n0\r\n\r\n", "ffffffffffffffff\r\nabc", "8000000000000000;x=y\r\nab",
		"0\r\n\r\n", "zz\r\n", "5", "5;\nab", `{"rid":"a","text":"t"}`} {
		f.Add([]byte(s), true)
		f.Add([]byte(s), false)
	}
	f.Fuzz(func(t *testing.T, body []byte, chunked bool) {
		req := &httphead.Request{Chunked: chunked, ContentLength: -1}
		got := PeekedBody(req, body)
		if !testenv.Within(got, body) {
			t.Fatalf("%q is not within the peek %q", got, body)
		}
		if !chunked && !bytes.Equal(got, body) {
			t.Fatalf("Content-Length body changed: %q", got)
		}
		if chunked && len(got) > 0 {
			size, _, _ := bytes.Cut(body, []byte("\n"))
			size, _, _ = bytes.Cut(bytes.TrimSuffix(size, []byte("\r")), []byte(";"))
			if n, err := strconv.ParseUint(string(size), 16, 64); err == nil && uint64(len(got)) > n {
				t.Fatalf("%d bytes of a %d-byte first chunk", len(got), n)
			}
		}
		PrefixHash(got) // never panics on any bytes
	})
}

// Session ids come from client paths.
func FuzzSessionID(f *testing.F) {
	for _, s := range []string{"/sessions/w0-abc", "/sessions/w12-x/turn?q=1", "/sessions/", "/sessions/w01-a", "/sessions/w9999999-a", "/x"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, path []byte) {
		id, ok := SessionID(path)
		if !ok {
			return
		}
		if !testenv.Within(id, path) || len(id) == 0 || bytes.ContainsAny(id, "/?") {
			t.Fatalf("id %q from %q", id, path)
		}
		slot, ok := SessionSlot(id)
		if !ok {
			return
		}
		// Canonical decimal, then '-' and a non-empty rest.
		prefix := "w" + strconv.Itoa(slot) + "-"
		if slot < 0 || !bytes.HasPrefix(id, []byte(prefix)) || len(id) == len(prefix) {
			t.Fatalf("slot %d from id %q", slot, id)
		}
	})
}

// Request ids come from the first bytes of client bodies, possibly cut
// anywhere by the peek: never a panic, never a byte outside the body, and
// an id found is the string value of a top-level request-id member.
func FuzzRequestID(f *testing.F) {
	for _, s := range []string{`{"rid":"abc","text":"x"}`, `{"text":"x","rid":"a\"b"}`, `{"rid":["a","b"]}`,
		`{"a":{"rid":"inner"},"rid":"outer"}`, `{"rid":"cut`, `  {"rid" : "x\u0041"}`, `[{"rid":"x"}]`, "5\r\n{\"rid\":\"y\"}",
		`{"request_id":"v1"}`, `{"r\u0069d":"esc"}`} {
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
			keyed := bytes.Contains(body, []byte(`\u`)) // an escaped key
			for _, k := range dialect.RequestIDKeys() {
				keyed = keyed || bytes.Contains(body, []byte(k))
			}
			if !keyed {
				t.Fatalf("rid %q from a body without a request-id key: %q", rid, body)
			}
			RequestIDString(rid) // unescapes without panicking
		}
	})
}
