package engine_test

import (
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// Every abort, flush and pause speaks each engine's own dialect, learned
// per worker: a call in the other engine's words is translated, and a
// worker of unknown kind that answers 404 is asked in the other dialect
// (and remembered), so nothing is a silent 404.
func TestDialects(t *testing.T) {
	sgl, err := fakeengine.Start(fakeengine.Config{Kind: fakeengine.SGLang})
	if err != nil {
		t.Fatal(err)
	}
	defer sgl.Close()
	vllm, err := fakeengine.Start(fakeengine.Config{Kind: fakeengine.VLLM})
	if err != nil {
		t.Fatal(err)
	}
	defer vllm.Close()
	tab := worker.NewTable()
	st := stats.NewHeap()
	tab.Put(&worker.Worker{Slot: 0, URL: sgl.URL(), Stats: st.Worker(0)})
	tab.Put(&worker.Worker{Slot: 1, URL: vllm.URL(), Stats: st.Worker(1)})
	eng := engine.New(engine.Config{Table: tab, Timeout: 2 * time.Second, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer eng.Close()
	h := eng.Handler()
	post := func(path, body string) (int, map[string]any) {
		req := httptest.NewRequest("POST", path, strings.NewReader(body))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		var m map[string]any
		json.Unmarshal(rec.Body.Bytes(), &m)
		return rec.Code, m
	}
	for _, c := range []struct{ path, body string }{
		{"/abort_request", `{"rid":"r-1"}`},              // SGLang words: the vLLM engine learned on its 404
		{"/abort_request", `{"abort_all":true}`},         // to vLLM as {}
		{"/abort_requests", `{"request_ids":["a","b"]}`}, // to SGLang as one /abort_request per id
		{"/abort_requests", `{}`},                        // to SGLang as abort_all
		{"/flush_cache", ``},                             // to vLLM as /reset_prefix_cache
	} {
		code, m := post(c.path, c.body)
		if code != http.StatusOK {
			t.Fatalf("%s %s: %d %v", c.path, c.body, code, m)
		}
		if failed, _ := m["failed"].([]any); len(failed) != 0 {
			t.Fatalf("%s %s: failed on %v", c.path, c.body, failed)
		}
	}
	if k := tab.Get(0).Engine(); k != dialect.SGLang {
		t.Errorf("worker 0 learned as %v", k)
	}
	if k := tab.Get(1).Engine(); k != dialect.VLLM {
		t.Errorf("worker 1 learned as %v", k)
	}
	if b := string(vllm.LastBody("/abort_requests")); b != `{}` {
		t.Errorf("vLLM's last abort: %q", b)
	}
	if b := string(sgl.LastBody("/abort_request")); b != `{"abort_all":true}` {
		t.Errorf("SGLang's last abort: %q", b)
	}
	if vllm.LastBody("/reset_prefix_cache") == nil {
		t.Error("the vLLM engine's cache was not reset")
	}
	if sgl.Stats().Flushes != 1 || vllm.Stats().Flushes != 1 {
		t.Errorf("flushes: SGLang %d, vLLM %d", sgl.Stats().Flushes, vllm.Stats().Flushes)
	}
}
