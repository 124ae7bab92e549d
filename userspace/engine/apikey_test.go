package engine_test

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// keyedEngine is a fake engine started with --api-key: every call without
// "Authorization: Bearer <key>" is a 401. It records the calls it took and
// answers /flush_cache with flushStatus.
type keyedEngine struct {
	srv         *httptest.Server
	mu          sync.Mutex
	calls       []string // "METHOD path body"
	flushStatus int
}

func newKeyedEngine(t *testing.T, key string) *keyedEngine {
	e := &keyedEngine{flushStatus: 200}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer "+key {
			w.WriteHeader(401)
			io.WriteString(w, `{"error":"unauthorized"}`)
			return
		}
		b, _ := io.ReadAll(r.Body)
		e.mu.Lock()
		e.calls = append(e.calls, r.Method+" "+r.URL.Path+" "+string(b))
		st := e.flushStatus
		e.mu.Unlock()
		if r.URL.Path == "/flush_cache" && st != 200 {
			w.WriteHeader(st)
			io.WriteString(w, `{"error":"cannot flush while requests run"}`)
			return
		}
		io.WriteString(w, `{"ok":true}`)
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *keyedEngine) took() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := e.calls
	e.calls = nil
	return out
}

// Fan-outs carry the client's Authorization (or the configured worker API
// key) to engines that require one; vLLM's {} aborts everything; a flush
// that a busy engine refuses is not a 200.
func TestFanoutToKeyedEngines(t *testing.T) {
	const key = "sk-test"
	engines := []*keyedEngine{newKeyedEngine(t, key), newKeyedEngine(t, key)}
	tab := worker.NewTable()
	st := stats.NewHeap()
	for i, e := range engines {
		tab.Put(&worker.Worker{Slot: i, URL: e.srv.URL, Stats: st.Worker(i)})
	}
	newEngine := func(workerKey string) http.Handler {
		eng := engine.New(engine.Config{Table: tab, WorkerAPIKey: workerKey, Timeout: 2 * time.Second,
			Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
		t.Cleanup(eng.Close)
		return eng.Handler()
	}
	call := func(h http.Handler, path, body, auth string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("POST", path, strings.NewReader(body))
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	h := newEngine("")
	for _, c := range []struct{ path, body string }{
		{"/abort_request", `{"abort_all":true}`},
		{"/abort_request", `{"rid":"r-1"}`},
		{"/abort_requests", `{"request_ids":["a","b"]}`},
		{"/abort_requests", `{}`},
		{"/flush_cache", ``},
	} {
		if rec := call(h, c.path, c.body, "Bearer "+key); rec.Code != 200 {
			t.Fatalf("%s %s with the client's key: %d %s", c.path, c.body, rec.Code, rec.Body)
		}
		for i, e := range engines {
			if got := e.took(); len(got) != 1 || !strings.HasPrefix(got[0], "POST "+c.path) {
				t.Fatalf("%s: engine %d took %q", c.path, i, got)
			}
		}
		// Without a key: every engine refuses, and the client hears it
		// (a flush passes on the refusal all engines gave alike).
		want := http.StatusBadGateway
		if c.path == "/flush_cache" {
			want = http.StatusUnauthorized
		}
		if rec := call(h, c.path, c.body, ""); rec.Code != want {
			t.Fatalf("%s without a key: %d", c.path, rec.Code)
		}
	}
	// {} reaches the engines as {}: vLLM's abort everything.
	call(h, "/abort_requests", `{}`, "Bearer "+key)
	if got := engines[0].took(); len(got) != 1 || got[0] != "POST /abort_requests {}" {
		t.Fatalf("abort everything: %q", got)
	}
	// A configured worker key stands in for a client that sent none.
	hk := newEngine(key)
	if rec := call(hk, "/abort_request", `{"abort_all":true}`, ""); rec.Code != 200 {
		t.Fatalf("worker API key: %d %s", rec.Code, rec.Body)
	}
	engines[0].took()
	engines[1].took()

	// One busy engine refuses the flush (SGLang: 400 while requests run):
	// 400, not 200, so "retry until 200" retries.
	engines[1].mu.Lock()
	engines[1].flushStatus = 400
	engines[1].mu.Unlock()
	rec := call(h, "/flush_cache", "", "Bearer "+key)
	var ans engine.FlushAnswer
	json.Unmarshal(rec.Body.Bytes(), &ans)
	if rec.Code != 400 || len(ans.Successful) != 1 || len(ans.Failed) != 1 || ans.Failed[0].Status != 400 {
		t.Fatalf("flush refused by a busy engine: %d %s", rec.Code, rec.Body)
	}
}
