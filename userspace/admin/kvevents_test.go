package admin

import (
	"errors"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/tether-rl/tether/userspace/registry"
)

// POST /workers {"url": ..., "kv_events": "tcp://host:port"}: the worker's
// own KV-event publisher goes to SetKVEvents (the daemon's subscriber
// wiring) before the worker is added, under the worker's canonical URL;
// an endpoint SetKVEvents refuses, or KV-event placement off, is a 400
// and no worker is added.
func TestAddWorkerKVEvents(t *testing.T) {
	type call struct{ url, endpoint, replay string }
	var mu sync.Mutex
	var calls []call
	set := func(u, endpoint, replay string) error {
		if !strings.HasPrefix(endpoint, "tcp://") {
			return errors.New("kv_events: want tcp://host:port")
		}
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, call{u, endpoint, replay})
		return nil
	}
	e := newEnv(t, "")
	e.srv.Close()
	e.srv = httptest.NewServer(New(Config{Registry: e.reg, SetKVEvents: set}))

	var info registry.Info
	if c := e.call("POST", "/workers", `{"url":"`+wurl(1)+`","kv_events":"tcp://10.0.0.5:5557"}`, &info); c != 200 || info.URL != wurl(1) {
		t.Fatalf("add with kv_events: %d %+v", c, info)
	}
	if c := e.call("POST", "/workers", `{"url":"`+wurl(2)+`/","kv_events":"tcp://10.0.0.5:5567","kv_events_replay":"tcp://10.0.0.5:5568"}`, &info); c != 200 {
		t.Fatalf("add with kv_events and replay: %d %+v", c, info)
	}
	canonical := info.URL
	if c := e.call("POST", "/workers", `{"url":"`+wurl(3)+`","kv_events":"udp://10.0.0.5:5557"}`, nil); c != 400 {
		t.Fatalf("refused endpoint: %d", c)
	}
	if _, err := e.reg.Get(wurl(3)); err == nil {
		t.Fatalf("a worker whose endpoint was refused was added")
	}
	if c := e.call("POST", "/workers", `{"url":"`+wurl(4)+`"}`, nil); c != 200 {
		t.Fatalf("add without kv_events: %d", c)
	}
	mu.Lock()
	got := append([]call(nil), calls...)
	mu.Unlock()
	if len(got) < 2 || got[0] != (call{wurl(1), "tcp://10.0.0.5:5557", ""}) ||
		got[1].endpoint != "tcp://10.0.0.5:5567" || got[1].replay != "tcp://10.0.0.5:5568" {
		t.Fatalf("SetKVEvents calls %+v", got)
	}
	if last := got[len(got)-1]; last.url != canonical || last.endpoint != "tcp://10.0.0.5:5567" {
		t.Fatalf("the endpoint is not set under the canonical URL %q: %+v", canonical, got)
	}
	for _, c := range got {
		if c.url == wurl(4) || c.url == wurl(3) {
			t.Fatalf("SetKVEvents called for %s: %+v", c.url, got)
		}
	}

	// KV-event placement off: the field is refused, not ignored.
	off := newEnv(t, "")
	if c := off.call("POST", "/workers", `{"url":"`+wurl(5)+`","kv_events":"tcp://10.0.0.5:5557"}`, nil); c != 400 {
		t.Fatalf("kv_events with placement off: %d", c)
	}
	if _, err := off.reg.Get(wurl(5)); err == nil {
		t.Fatalf("added with placement off")
	}
}
