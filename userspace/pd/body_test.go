package pd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

func decodeMap(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(&m); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return m
}

func TestSGLangBody(t *testing.T) {
	p := Worker{URL: "http://10.0.0.7:30000", BootstrapPort: 8999}
	for _, tc := range []struct {
		name, body string
		batch      int
		clientRid  bool
	}{
		{"one text", `{"text":"hi","bootstrap_room":5,"bootstrap_host":"evil"}`, 0, false},
		{"one ids", `{"input_ids":[1,2,3],"rid":"mine"}`, 0, true},
		{"batch text", `{"text":["a","b","c"]}`, 3, false},
		{"batch ids", `{"input_ids":[[1],[2]],"rid":["x","y"]}`, 2, true},
		{"batch prompt", `{"prompt":["a","b"]}`, 2, false},
		{"prompt ids", `{"prompt":[1,2,3]}`, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := inspect([]byte(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			if r.batch != tc.batch {
				t.Fatalf("batch %d, want %d", r.batch, tc.batch)
			}
			b1, rids, err := sglangBody(r, p)
			if err != nil {
				t.Fatal(err)
			}
			b2, _, _ := sglangBody(r, p)
			m1, m2 := decodeMap(t, b1), decodeMap(t, b2)
			if tc.batch == 0 {
				if m1["bootstrap_host"] != "10.0.0.7" || m1["bootstrap_port"].(json.Number) != "8999" {
					t.Errorf("fields %v", m1)
				}
				if m1["bootstrap_room"] == m2["bootstrap_room"] {
					t.Errorf("the same room twice: %v", m1["bootstrap_room"])
				}
				if len(rids) != 1 || m1["rid"] != rids[0] {
					t.Errorf("rid %v, rids %v", m1["rid"], rids)
				}
			} else {
				rooms := m1["bootstrap_room"].([]any)
				if len(rooms) != tc.batch || len(m1["bootstrap_host"].([]any)) != tc.batch || len(m1["bootstrap_port"].([]any)) != tc.batch {
					t.Fatalf("lists %v", m1)
				}
				seen := map[any]bool{}
				for _, room := range rooms {
					if seen[room] {
						t.Errorf("room %v shared", room)
					}
					seen[room] = true
				}
				if len(rids) != tc.batch {
					t.Errorf("rids %v", rids)
				}
			}
			if tc.clientRid && !strings.Contains(string(b1), `"rid":`) {
				t.Error("the client's rid was lost")
			}
			if tc.clientRid && rids[0] != "mine" && rids[0] != "x" {
				t.Errorf("rids %v, not the client's", rids)
			}
		})
	}
	p.BootstrapPort = 0
	r, _ := inspect([]byte(`{"text":"x"}`))
	b, _, _ := sglangBody(r, p)
	if m := decodeMap(t, b); m["bootstrap_port"] != nil {
		t.Errorf("bootstrap_port %v, want null", m["bootstrap_port"])
	}
	v6, _, _ := sglangBody(r, Worker{URL: "http://[fd00::1]:80"})
	if m := decodeMap(t, v6); m["bootstrap_host"] != "[fd00::1]" {
		t.Errorf("IPv6 host %v", m["bootstrap_host"])
	}
}

func TestRoomsUniform(t *testing.T) {
	var high, odd int
	const n = 4000
	for i := 0; i < n; i++ {
		r := newRoom()
		if r>>63 != 0 {
			t.Fatalf("room %d over 2^63-1", r)
		}
		if r>>62 == 1 {
			high++
		}
		odd += int(r & 1)
	}
	// Each bit is set about half the time (5 sigma bounds).
	if high < n/2-160 || high > n/2+160 || odd < n/2-160 || odd > n/2+160 {
		t.Errorf("rooms not uniform: top bit %d, low bit %d of %d", high, odd, n)
	}
}

func TestVLLMPrefillBody(t *testing.T) {
	r, err := inspect([]byte(`{"prompt":"p","stream":true,"stream_options":{"include_usage":true},"max_tokens":50,` +
		`"max_completion_tokens":50,"min_tokens":3,"min_completion_tokens":2,"n":1,"kv_transfer_params":{"x":1}}`))
	if err != nil {
		t.Fatal(err)
	}
	b, err := vllmPrefillBody(r)
	if err != nil {
		t.Fatal(err)
	}
	m := decodeMap(t, b)
	kv := m["kv_transfer_params"].(map[string]any)
	if kv["do_remote_decode"] != true || kv["do_remote_prefill"] != false || len(kv) != 6 || kv["remote_block_ids"] != nil {
		t.Errorf("kv_transfer_params %v", kv)
	}
	for k, want := range map[string]any{"stream": false, "max_tokens": json.Number("1"), "max_completion_tokens": json.Number("1"), "n": json.Number("1"), "prompt": "p"} {
		if m[k] != want {
			t.Errorf("%s = %v, want %v", k, m[k], want)
		}
	}
	for _, k := range []string{"stream_options", "min_tokens", "min_completion_tokens"} {
		if _, ok := m[k]; ok {
			t.Errorf("%s kept", k)
		}
	}
	r, _ = inspect([]byte(`{"prompt":"p"}`))
	b, _ = vllmPrefillBody(r)
	if m := decodeMap(t, b); m["max_tokens"] != json.Number("1") || m["max_completion_tokens"] != nil || m["n"] != nil {
		t.Errorf("body %s", b)
	}
	if kvParams([]byte(`{"kv_transfer_params":null}`)) != nil || kvParams([]byte(`{}`)) != nil ||
		string(kvParams([]byte(`{"a":1,"kv_transfer_params":{"remote_block_ids":[[1]]}}`))) != `{"remote_block_ids":[[1]]}` {
		t.Error("kvParams")
	}
}

func TestInspectSamples(t *testing.T) {
	for body, refused := range map[string]bool{
		`{"n":2}`: true, `{"n":1}`: false, `{"n":2.0}`: true, `{"sampling_params":{"n":3}}`: true,
		`{"sampling_params":[{"n":1},{"n":2}]}`: true, `{"sampling_params":{"max_new_tokens":8}}`: false,
	} {
		if _, err := inspect([]byte(body)); (err == errSamples) != refused {
			t.Errorf("%s: %v", body, err)
		}
	}
}

// TestSSEPassesThrough: events with nothing to merge, [DONE] and partial
// events across reads come out as they went in.
func TestSSEPassesThrough(t *testing.T) {
	in := "data: {\"a\":1}\n\n: comment\n\ndata: [DONE]\n\n"
	var n atomic.Uint64
	x := &sse{m: newMerger(nil, &n)}
	var out []byte
	for i := 0; i < len(in); i += 5 {
		out = x.feed(out, []byte(in[i:min(i+5, len(in))]))
	}
	out = x.rest(out)
	if string(out) != in {
		t.Errorf("got %q", out)
	}
}

// FuzzSSE: the rewriter never loses or reorders bytes of events it does
// not rewrite, whatever the read boundaries, and what it rewrites stays
// valid JSON.
func FuzzSSE(f *testing.F) {
	f.Add([]byte("data: {\"meta_info\":{\"input_token_logprobs\":[[1,2,null]]}}\n\ndata: [DONE]\n\n"), uint8(3))
	f.Add([]byte("data: {\"index\":1,\"meta_info\":{}}\n\n"), uint8(1))
	f.Fuzz(func(t *testing.T, in []byte, step uint8) {
		var n atomic.Uint64
		m := newMerger([]byte(`{"meta_info":{"input_token_logprobs":[[null,5,null]]}}`), &n)
		x0 := &sse{m: m}
		whole := x0.rest(x0.feed(nil, in))
		x := &sse{m: m}
		var out []byte
		s := int(step%16) + 1
		for i := 0; i < len(in); i += s {
			out = x.feed(out, in[i:min(i+s, len(in))])
		}
		out = x.rest(out)
		if !bytes.Equal(out, whole) {
			t.Fatalf("read boundaries changed the output: %q vs %q", out, whole)
		}
		if n.Load() == 0 && !bytes.Equal(out, in) {
			t.Fatalf("changed without a merge: %q -> %q", in, out)
		}
		for _, ev := range bytes.Split(out, []byte("\n\n")) {
			if p, ok := dataPayload(ev); ok && len(p) > 0 && p[0] == '{' && n.Load() > 0 && bytes.Contains(p, []byte("input_token_logprobs")) && !json.Valid(p) {
				t.Fatalf("invalid merged event %q", p)
			}
		}
	})
}

// FuzzInspect: any body is inspected without a panic, and a body set with
// the bootstrap fields stays a valid object.
func FuzzInspect(f *testing.F) {
	f.Add([]byte(`{"text":["a"],"n":1}`))
	f.Add([]byte(`{"input_ids":[[1],[2]],"rid":["a","b"],"sampling_params":[{"n":1}]}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := inspect(body)
		if err != nil {
			return
		}
		b, _, err := sglangBody(r, Worker{URL: "http://127.0.0.1:1"})
		if err != nil {
			t.Fatal(err)
		}
		if !json.Valid(b) {
			t.Fatalf("invalid body %q", b)
		}
		if b, err = vllmPrefillBody(r); err != nil || !json.Valid(b) {
			t.Fatalf("prefill body %q: %v", b, err)
		}
	})
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("connection reset by peer") }

// TestRelayErrorEvent: a decode that breaks off mid-event: the client gets
// the whole events before it, then one valid JSON error event, never half
// an event glued to it.
func TestRelayErrorEvent(t *testing.T) {
	s := New(Config{})
	defer s.Close()
	for _, tx := range []*sse{nil, {m: newMerger([]byte(`{"meta_info":{"input_token_logprobs":[[null,1,null]]}}`), &s.Counters.LogprobMerges)}} {
		w := httptest.NewRecorder()
		d := &legResult{resp: &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}},
			Body: io.NopCloser(io.MultiReader(strings.NewReader("data: {\"meta_info\":{}}\n\ndata: {\"te"), failingReader{}))}}
		err := s.relay(context.Background(), w, d, "p0+d0", tx, nil)
		if !errors.Is(err, errDecodeBroke) {
			t.Fatalf("err %v", err)
		}
		events := strings.Split(strings.TrimSuffix(w.Body.String(), "\n\n"), "\n\n")
		if len(events) != 2 {
			t.Fatalf("events %q", events)
		}
		for _, ev := range events {
			p, ok := strings.CutPrefix(ev, "data: ")
			if !ok || !json.Valid([]byte(p)) {
				t.Errorf("event %q", ev)
			}
		}
		if !strings.Contains(events[1], `"error"`) {
			t.Errorf("last event %q", events[1])
		}
	}
}
