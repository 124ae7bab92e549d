package engine

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/route"
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
	if s := ridString([]byte(`a\"b\u0041`)); s != `a"bA` {
		t.Errorf("unescape: %q", s)
	}
}

func TestOwners(t *testing.T) {
	o := NewOwners(0)
	rel := o.Acquire("r1", 3)
	if s, ok := o.Owner([]byte("r1")); !ok || s != 3 {
		t.Fatalf("owner %d %v", s, ok)
	}
	// A retry on the same worker: counted twice.
	rel2 := o.Acquire("r1", 3)
	rel()
	if s, ok := o.Owner([]byte("r1")); !ok || s != 3 {
		t.Fatal("released with a retry still in flight")
	}
	rel2()
	if _, ok := o.Owner([]byte("r1")); ok || o.Len() != 0 {
		t.Fatal("not released")
	}
	// The same id on two workers: ambiguous, abort goes everywhere.
	a := o.Acquire("r2", 1)
	b := o.Acquire("r2", 2)
	if _, ok := o.Owner([]byte("r2")); ok {
		t.Fatal("ambiguous id has an owner")
	}
	a()
	b()
	if o.Len() != 0 {
		t.Fatal("leak")
	}

	// Bounded: the oldest ids are dropped.
	small := NewOwners(ownerShards * 4)
	var rels []func()
	for i := 0; i < 10000; i++ {
		rels = append(rels, small.Acquire(fmt.Sprint("id-", i), i%8))
	}
	if n := small.Len(); n > ownerShards*4 || n < ownerShards*2 {
		t.Fatalf("len %d, cap %d", n, ownerShards*4)
	}
	if _, ok := small.Owner([]byte("id-0")); ok {
		t.Error("oldest id kept")
	}
	if s, ok := small.Owner([]byte("id-9999")); !ok || s != 9999%8 {
		t.Error("newest id dropped")
	}
	if small.Dropped() == 0 {
		t.Error("no drops counted")
	}
	// Releasing dropped ids is harmless, and a reused id is not released
	// by its dropped predecessor.
	for _, r := range rels {
		r()
	}
	if small.Len() != 0 {
		t.Fatalf("len %d after releasing all", small.Len())
	}
	old := small.Acquire("x", 1)
	for i := 0; i < 10000; i++ {
		small.Acquire(fmt.Sprint("y-", i), 0)
	}
	cur := small.Acquire("x", 2)
	old() // the dropped one
	if s, ok := small.Owner([]byte("x")); !ok || s != 2 {
		t.Fatal("stale release removed the new entry")
	}
	cur()

	// Concurrent use (-race).
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				r := o.Acquire(fmt.Sprint(g, "-", i%50), g)
				o.Owner([]byte(fmt.Sprint(g, "-", i%50)))
				r()
			}
		}()
	}
	wg.Wait()
	if o.Len() != 0 {
		t.Fatalf("len %d", o.Len())
	}
}

func TestTrackerRoutesAndReleases(t *testing.T) {
	st := stats.NewHeap()
	tab := worker.NewTable()
	for i := 0; i < 4; i++ {
		tab.Put(&worker.Worker{Slot: i, URL: fmt.Sprintf("http://127.0.0.1:%d", 1000+i), Stats: st.Worker(i)})
	}
	p, err := route.NewPolicy(route.PolicyConfig{})
	if err != nil {
		t.Fatal(err)
	}
	rt := &route.Router{Table: tab}
	rt.SetPolicy(p)
	tr := &Tracker{Router: rt, Owners: NewOwners(0)}

	keyless := parseHead(t, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n")
	body := []byte(`{"messages":[{"role":"user","content":"hi"}]}`)
	if a := testing.AllocsPerRun(1000, func() { tr.Route(keyless, body) }); a != 0 {
		t.Errorf("request without id: %v allocations", a)
	}

	req := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nX-SMG-Target-Worker: 2\r\nContent-Length: 40\r\n\r\n")
	d := tr.Route(req, []byte(`{"rid":"g1","text":"x"}`))
	if d.Worker.Slot != 2 || d.Done == nil {
		t.Fatalf("%+v", d)
	}
	if s, ok := tr.Owners.Owner([]byte("g1")); !ok || s != 2 {
		t.Fatal("not tracked")
	}
	// A retry of g1 (no target, another key) goes to its owner.
	retry := parseHead(t, "POST /generate HTTP/1.1\r\nHost: x\r\nX-Session-ID: other\r\nContent-Length: 40\r\n\r\n")
	d2 := tr.Route(retry, []byte(`{"rid":"g1","text":"x"}`))
	if d2.Worker.Slot != 2 || d2.Reason != route.ReasonRid {
		t.Fatalf("retry: %+v", d2)
	}
	d.Done()
	if _, ok := tr.Owners.Owner([]byte("g1")); !ok {
		t.Fatal("released while the retry is in flight")
	}
	d2.Done()
	if tr.Owners.Len() != 0 {
		t.Fatal("not released")
	}
	if rt.Count(route.ReasonRid) != 1 {
		t.Fatal("rid reason not counted")
	}
}
