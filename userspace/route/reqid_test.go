package route

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

func parseHead(t testing.TB, head string) *httphead.Request {
	t.Helper()
	req := &httphead.Request{}
	if err := httphead.ParseRequest([]byte(head), httphead.Limits{}, req); err != nil {
		t.Fatalf("parse: %v", err)
	}
	return req
}

func TestRequestID(t *testing.T) {
	plain := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n")
	withHdr := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nx-request-id: hdr-1\r\nContent-Length: 10\r\n\r\n")
	emptyHdr := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nX-Request-ID:\r\nContent-Length: 10\r\n\r\n")
	chunked := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
	for _, c := range []struct {
		req  *httphead.Request
		body string
		want string
	}{
		{plain, `{"rid":"r1","text":"hi"}`, "r1"},
		{plain, ` { "text" : "a \"rid\": \"no\"", "n": [1, {"rid":"nested"}], "rid" : "r2" }`, "r2"},
		{plain, `{"sampling_params":{"rid":"nested"},"x":null,"y":true,"z":-1.5e3,"rid":"r3"}`, "r3"},
		{plain, `{"rid":"a\"b"}`, `a\"b`},
		{plain, `{"rid":["r1","r2"]}`, ""}, // batch: not tracked
		{plain, `{"rid":7}`, ""},
		{plain, `{"request_id":"vllm-1","prompt":"hi"}`, "vllm-1"}, // vLLM
		{plain, `{"request_id":"v2","rid":"s2"}`, "v2"},            // the first of the two
		{plain, `{"x":{"request_id":"nested"},"rid":"s3"}`, "s3"},
		{plain, `{"text":"` + strings.Repeat("x", 100), ""}, // cut by the peek
		{plain, `["rid","r1"]`, ""},
		{plain, `not json "rid":"r1"`, ""},
		{plain, ``, ""},
		{withHdr, `{"text":"hi"}`, "hdr-1"},
		{withHdr, `{"rid":"body"}`, "body"},
		{withHdr, ``, "hdr-1"},
		{emptyHdr, `{}`, ""},
		{chunked, "1a\r\n{\"rid\":\"c1\",\"text\":\"hi\"}\r\n", "c1"},
		{chunked, "\r\n{\"rid\":\"c1\"}", ""},
	} {
		got := string(RequestID(c.req, []byte(c.body)))
		if got != c.want {
			t.Errorf("%q: rid %q, want %q", c.body, got, c.want)
		}
	}
	if s := RequestIDString([]byte(`a\"b\u0041`)); s != `a"bA` {
		t.Errorf("unescape: %q", s)
	}
}

// fakeOwners is engine.Owners reduced to what the router asks (route cannot
// import engine): a count per id and its slot; an id on two slots has no
// owner.
type fakeOwners struct {
	mu sync.Mutex
	n  map[string]int
	at map[string]int
}

func newFakeOwners() *fakeOwners { return &fakeOwners{n: map[string]int{}, at: map[string]int{}} }

func (o *fakeOwners) Owner(rid []byte) (int, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.at[string(rid)]
	return s, ok && s >= 0 && o.n[string(rid)] > 0
}

func (o *fakeOwners) Acquire(rid string, slot int) func() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if s, ok := o.at[rid]; ok && s != slot {
		slot = -1
	}
	o.n[rid]++
	o.at[rid] = slot
	return func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		if o.n[rid]--; o.n[rid] == 0 {
			delete(o.n, rid)
			delete(o.at, rid)
		}
	}
}

func (o *fakeOwners) len() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.n)
}

func TestRequestIDRule(t *testing.T) {
	st := stats.NewHeap()
	tab := worker.NewTable()
	for i := 0; i < 4; i++ {
		tab.Put(&worker.Worker{Slot: i, URL: fmt.Sprintf("http://127.0.0.1:%d", 1000+i), Stats: st.Worker(i)})
	}
	p, err := NewPolicy(PolicyConfig{})
	if err != nil {
		t.Fatal(err)
	}
	o := newFakeOwners()
	rt := &Router{Table: tab, Owners: o}
	rt.SetPolicy(p)

	keyless := parseHead(t, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
	body := []byte(`{"messages":[{"role":"user","content":"hi"}]}`)
	if a := testing.AllocsPerRun(1000, func() { rt.Route(keyless, body) }); a != 0 {
		t.Errorf("request without id: %v allocations", a)
	}

	req := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nX-SMG-Target-Worker: 2\r\nContent-Length: 40\r\n\r\n")
	d := rt.Route(req, []byte(`{"rid":"g1","text":"x"}`))
	if d.Worker.Slot != 2 || d.Done == nil {
		t.Fatalf("%+v", d)
	}
	if s, ok := o.Owner([]byte("g1")); !ok || s != 2 {
		t.Fatal("not tracked")
	}
	// A retry of g1 (no target, another key) goes to its owner.
	retry := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nX-Session-ID: other\r\nContent-Length: 40\r\n\r\n")
	d2 := rt.Route(retry, []byte(`{"rid":"g1","text":"x"}`))
	if d2.Worker.Slot != 2 || d2.Reason != ReasonRid {
		t.Fatalf("retry: %+v", d2)
	}
	d.Done()
	if _, ok := o.Owner([]byte("g1")); !ok {
		t.Fatal("released while the retry is in flight")
	}
	d2.Done()
	if o.len() != 0 {
		t.Fatal("not released")
	}
	if rt.Count(ReasonRid) != 1 {
		t.Fatalf("rid reason counted %d times, want 1", rt.Count(ReasonRid))
	}
	// An owner that is not healthy does not pin: the key's rule places it.
	to3 := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nX-SMG-Target-Worker: 3\r\nContent-Length: 40\r\n\r\n")
	d5 := rt.Route(to3, []byte(`{"rid":"u1"}`))
	tab.Get(3).SetState(worker.Unhealthy)
	if d4 := rt.Route(retry, []byte(`{"rid":"u1"}`)); d4.Reason == ReasonRid || d4.Worker.Slot == 3 {
		t.Fatalf("pinned to an unhealthy owner: %+v", d4)
	} else {
		d4.Done()
	}
	d5.Done()
	tab.Get(3).SetState(worker.Healthy)
	// A session path keeps its worker, and its id is tracked there too.
	sess := parseHead(t, "POST /sessions/w1-abc/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
	d3 := rt.Route(sess, []byte(`{"rid":"s1"}`))
	if d3.Worker.Slot != 1 || d3.Reason != ReasonSession || d3.Done == nil {
		t.Fatalf("session path: %+v", d3)
	}
	if s, ok := o.Owner([]byte("s1")); !ok || s != 1 {
		t.Fatal("the id of a session request is not tracked")
	}
	d3.Done()
	if o.len() != 0 {
		t.Fatal("not released")
	}
	if n := Decisions(tab.Get(2))["rid"]; n != 1 {
		t.Fatalf("worker 2 counts %d rid decisions, want 1", n)
	}
}
