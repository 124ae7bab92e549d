package pd_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/tether-rl/tether/userspace/pd"
)

// recorder is an engine stand-in that keeps what it was sent.
type recorder struct {
	*httptest.Server
	mu     sync.Mutex
	bodies [][]byte
	ids    []string
}

func newRecorder(t *testing.T, answer string) *recorder {
	r := &recorder{}
	r.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		b, _ := io.ReadAll(q.Body)
		r.mu.Lock()
		r.bodies = append(r.bodies, b)
		r.ids = append(r.ids, q.Header.Get("X-Request-Id"))
		r.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		io.WriteString(w, answer)
	}))
	t.Cleanup(r.Close)
	return r
}

func jsonMap(t *testing.T, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber()
	if err := d.Decode(&m); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	return m
}

// TestWireSGLang: P and D get the same bytes: the client's body with the
// bootstrap lists of a batch (one room per item, the client's room
// replaced) and the client's rids; the client gets D's answer.
func TestWireSGLang(t *testing.T) {
	p := newRecorder(t, `{"text":"","meta_info":{}}`)
	d := newRecorder(t, `[{"text":"a"},{"text":"b"}]`)
	s := pd.New(pd.Config{Protocol: pd.SGLang})
	defer s.Close()
	w := httptest.NewRecorder()
	in := `{"input_ids":[[1,2],[3,4]],"rid":["r1","r2"],"bootstrap_room":[1,1],"sampling_params":{"max_new_tokens":2}}`
	err := s.Serve(context.Background(), w, &pd.Request{Method: "POST", Path: "/generate", Header: http.Header{}, Body: []byte(in)},
		onePair{pd.Pair{Prefill: pd.Worker{URL: p.URL, BootstrapPort: 9000}, Decode: pd.Worker{URL: d.URL}}})
	if err != nil || w.Code != 200 || w.Body.String() != `[{"text":"a"},{"text":"b"}]` {
		t.Fatalf("%v %d %s", err, w.Code, w.Body)
	}
	s.Close() // the prefill's leg may still be going: Serve does not wait for it
	if len(p.bodies) != 1 || len(d.bodies) != 1 || !bytes.Equal(p.bodies[0], d.bodies[0]) {
		t.Fatalf("legs differ:\nP %s\nD %s", p.bodies, d.bodies)
	}
	m := jsonMap(t, p.bodies[0])
	rooms := m["bootstrap_room"].([]any)
	if len(rooms) != 2 || rooms[0] == rooms[1] || rooms[0] == json.Number("1") {
		t.Errorf("rooms %v", rooms)
	}
	if h := m["bootstrap_host"].([]any); len(h) != 2 || h[0] != "127.0.0.1" {
		t.Errorf("hosts %v", h)
	}
	if pt := m["bootstrap_port"].([]any); len(pt) != 2 || pt[0] != json.Number("9000") {
		t.Errorf("ports %v", pt)
	}
	if r := m["rid"].([]any); len(r) != 2 || r[0] != "r1" {
		t.Errorf("rids %v", r)
	}
}

// TestWireVLLM: one X-Request-Id on both legs; D gets the client's body
// with P's kv_transfer_params object, exactly.
func TestWireVLLM(t *testing.T) {
	kv := `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[7,8]],"remote_engine_id":"e1","remote_request_id":"x","remote_host":"10.1.1.1","remote_port":5600,"tp_size":1}`
	p := newRecorder(t, `{"choices":[{"text":" t"}],"kv_transfer_params":`+kv+`}`)
	d := newRecorder(t, `{"choices":[{"text":"decoded"}]}`)
	s := pd.New(pd.Config{Protocol: pd.VLLM})
	defer s.Close()
	w := httptest.NewRecorder()
	in := `{"model":"m","prompt":"hello","max_tokens":20,"min_tokens":2,"stream":false}`
	err := s.Serve(context.Background(), w, &pd.Request{Method: "POST", Path: "/v1/completions", Header: http.Header{"X-Request-Id": {"client-1"}}, Body: []byte(in)},
		onePair{pd.Pair{Prefill: pd.Worker{URL: p.URL}, Decode: pd.Worker{URL: d.URL}}})
	if err != nil || w.Code != 200 || w.Body.String() != `{"choices":[{"text":"decoded"}]}` {
		t.Fatalf("%v %d %s", err, w.Code, w.Body)
	}
	if p.ids[0] != "client-1" || d.ids[0] != "client-1" {
		t.Errorf("request ids %q %q", p.ids, d.ids)
	}
	dm, want := jsonMap(t, d.bodies[0]), jsonMap(t, []byte(in))
	want["kv_transfer_params"] = jsonMap(t, []byte(kv))
	if got, _ := json.Marshal(dm); string(got) != string(must(json.Marshal(want))) {
		t.Errorf("decode body %s, want %s", got, must(json.Marshal(want)))
	}
	pm := jsonMap(t, p.bodies[0])
	if pm["max_tokens"] != json.Number("1") || pm["stream"] != false || pm["min_tokens"] != nil || pm["prompt"] != "hello" {
		t.Errorf("prefill body %s", p.bodies[0])
	}
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}
