package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/stats"
)

type env struct {
	t    *testing.T
	reg  *registry.Registry
	srv  *httptest.Server
	mu   sync.Mutex
	down map[string]bool
}

func newEnv(t *testing.T, token string) *env {
	e := &env{t: t, down: map[string]bool{}}
	e.reg = registry.New(registry.Options{
		Stats: stats.NewHeap(),
		Probe: func(ctx context.Context, u string) error {
			e.mu.Lock()
			defer e.mu.Unlock()
			if e.down[u] {
				return errors.New("connection refused")
			}
			return nil
		},
		Config: registry.Config{StartupTimeout: 200 * time.Millisecond, RemoveGrace: time.Second},
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	metrics := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "tether_x 1\n") })
	e.srv = httptest.NewServer(New(Config{Registry: e.reg, Metrics: metrics, Token: token}))
	t.Cleanup(func() { e.srv.Close(); e.reg.Close() })
	return e
}

// call does a request and decodes the JSON answer into out (if not nil).
func (e *env) call(method, path, body string, out any, hdr ...string) int {
	e.t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequest(method, e.srv.URL+path, rd)
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode >= 400 || strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
			e.t.Errorf("%s %s: Content-Type %q", method, path, ct)
		}
	}
	if resp.StatusCode >= 400 {
		var eb ErrorBody
		if err := json.Unmarshal(b, &eb); err != nil || eb.Error.Code != resp.StatusCode || eb.Error.Message == "" {
			e.t.Errorf("%s %s: error body %q", method, path, b)
		}
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			e.t.Fatalf("%s %s: %v: %q", method, path, err, b)
		}
	}
	return resp.StatusCode
}

func wurl(i int) string { return fmt.Sprintf("http://127.0.0.1:%d", 21000+i) }

func TestLegacyEndpoints(t *testing.T) {
	e := newEnv(t, "")
	var a Answer
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(0)), "", &a); c != 200 || a.URL != wurl(0) || a.Slot != 0 || !strings.Contains(a.Message, "Successfully added worker") {
		t.Fatalf("add_worker: %d %+v", c, a)
	}
	if c := e.call("POST", "/add_worker", `{"url":"`+wurl(1)+`"}`, &a); c != 200 || a.Slot != 1 {
		t.Fatalf("add_worker JSON: %d %+v", c, a)
	}
	var l struct{ URLs []string }
	if c := e.call("GET", "/list_workers", "", &l); c != 200 || fmt.Sprint(l.URLs) != fmt.Sprint([]string{wurl(0), wurl(1)}) {
		t.Fatalf("list_workers: %d %v", c, l)
	}
	// Bad input: 4xx, nothing changes.
	for _, c := range []struct {
		method, path, body string
		want               int
	}{
		{"POST", "/add_worker", "", 400},
		{"POST", "/add_worker?url=", "", 400},
		{"POST", "/add_worker", `{"url":""}`, 400},
		{"POST", "/add_worker", `{"url":`, 400},
		{"POST", "/add_worker", `[1]`, 400},
		{"POST", "/add_worker?url=https://127.0.0.1:1", "", 400},
		{"POST", "/add_worker?url=127.0.0.1:1", "", 400},
		{"POST", "/add_worker?url=" + url.QueryEscape(wurl(0)), "", 200}, // a re-add is a no-op
		{"POST", "/add_worker?url=" + url.QueryEscape(wurl(0)+"/"), "", 200},
		{"GET", "/add_worker?url=" + url.QueryEscape(wurl(5)), "", 405},
		{"POST", "/remove_worker", "", 400},
		{"POST", "/remove_worker?url=ftp://x", "", 400},
		{"POST", "/remove_worker?url=" + url.QueryEscape(wurl(9)), "", 404},
		{"POST", "/list_workers", "", 405},
	} {
		if got := e.call(c.method, c.path, c.body, nil); got != c.want {
			t.Errorf("%s %s %q: %d, want %d", c.method, c.path, c.body, got, c.want)
		}
	}
	if c := e.call("GET", "/list_workers", "", &l); c != 200 || len(l.URLs) != 2 {
		t.Fatalf("bad input changed the workers: %v", l)
	}
	// A worker that never becomes healthy: 503, slot freed.
	e.mu.Lock()
	e.down[wurl(3)] = true
	e.mu.Unlock()
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(3)), "", nil); c != 503 {
		t.Fatalf("dead worker: %d", c)
	}
	if c := e.call("POST", "/remove_worker?url="+url.QueryEscape(wurl(0)), "", &a); c != 200 || a.State != registry.StateRemoved || !strings.Contains(a.Message, "Successfully removed") {
		t.Fatalf("remove_worker: %d %+v", c, a)
	}
	if c := e.call("POST", "/remove_worker", `{"url":"`+wurl(1)+`"}`, &a); c != 200 {
		t.Fatalf("remove_worker JSON: %d", c)
	}
	if c := e.call("GET", "/list_workers", "", &l); c != 200 || l.URLs == nil || len(l.URLs) != 0 {
		t.Fatalf("list after removals: %v", l)
	}
}

func TestRESTEndpoints(t *testing.T) {
	e := newEnv(t, "")
	var a Answer
	if c := e.call("POST", "/workers", `{"url":"`+wurl(0)+`","worker_type":"regular","priority":50}`, &a); c != 200 || a.WorkerID != "0" || a.Status != "healthy" || a.URL != wurl(0) || a.Location != "/workers/0" {
		t.Fatalf("POST /workers: %d %+v", c, a)
	}
	e.call("POST", "/workers", `{"url":"`+wurl(1)+`"}`, nil)
	e.call("POST", "/workers", `{"url":"`+wurl(2)+`"}`, nil)
	var l List
	if c := e.call("GET", "/workers", "", &l); c != 200 || l.Total != 3 || l.Healthy != 3 || len(l.Workers) != 3 || l.Workers[2].Slot != 2 {
		t.Fatalf("GET /workers: %d %+v", c, l)
	}
	var in registry.Info
	if c := e.call("GET", "/workers/1", "", &in); c != 200 || in.URL != wurl(1) || in.State != "healthy" {
		t.Fatalf("GET /workers/1: %d %+v", c, in)
	}
	if c := e.call("GET", "/workers/"+url.PathEscape(wurl(2)), "", &in); c != 200 || in.Slot != 2 {
		t.Fatalf("GET /workers/<url>: %d %+v", c, in)
	}
	if c := e.call("POST", "/workers/1/drain", "", &in); c != 200 || in.State != "draining" {
		t.Fatalf("drain: %d %+v", c, in)
	}
	if c := e.call("POST", "/workers/"+url.PathEscape(wurl(1))+"/drain", "", &in); c != 200 || in.State != "draining" {
		t.Fatalf("drain by url: %d %+v", c, in)
	}
	if c := e.call("DELETE", "/workers/"+url.PathEscape(wurl(0)), "", &a); c != 200 || a.State != "removed" || a.Slot != 0 {
		t.Fatalf("DELETE by url: %d %+v", c, a)
	}
	if c := e.call("DELETE", "/workers/2", "", &a); c != 200 || a.URL != wurl(2) {
		t.Fatalf("DELETE by id: %d %+v", c, a)
	}
	for _, c := range []struct {
		method, path, body string
		want               int
	}{
		{"POST", "/workers", "", 400},
		{"POST", "/workers", `{}`, 400},
		{"POST", "/workers", `{"url":"https://127.0.0.1:2"}`, 400},
		{"POST", "/workers", `{"url":"` + wurl(1) + `"}`, 200}, // a re-add is a no-op
		{"POST", "/workers", strings.Repeat(" ", 2<<20), 400},
		{"GET", "/workers/0", "", 404},
		{"GET", "/workers/77", "", 404},
		{"GET", "/workers/" + url.PathEscape(wurl(42)), "", 404},
		{"GET", "/workers/not-a-url", "", 400},
		{"DELETE", "/workers/0", "", 404},
		{"POST", "/workers/9/drain", "", 404},
		{"GET", "/workers/1/drain", "", 405},
		{"PUT", "/workers", "", 405},
		{"PUT", "/workers/1", "", 405},
		{"PATCH", "/workers/1", "", 400},
		{"PATCH", "/workers/1", `{"max_in_flight":-1}`, 400},
		{"PATCH", "/workers/1", `{"max_inflight":3}`, 400},
		{"PATCH", "/workers/77", `{"max_in_flight":3}`, 404},
		{"GET", "/nothing", "", 404},
	} {
		if got := e.call(c.method, c.path, c.body, nil); got != c.want {
			t.Errorf("%s %s: %d, want %d", c.method, c.path, got, c.want)
		}
	}
	// Removed workers show as such while they finish (here: at once gone
	// or "removed"); the draining one is still listed.
	if c := e.call("GET", "/workers", "", &l); c != 200 || l.Total != 1 || l.Workers[0].State == "" {
		t.Fatalf("GET /workers after: %+v", l)
	}
}

func TestLoadsAndMetrics(t *testing.T) {
	e := newEnv(t, "")
	e.call("POST", "/workers", `{"url":"`+wurl(0)+`"}`, nil)
	e.call("POST", "/workers", `{"url":"`+wurl(1)+`"}`, nil)
	e.reg.Table().Get(1).Stats.Begin()
	e.reg.Table().Get(1).Stats.Begin()
	for _, p := range []string{"/get_loads", "/v1/loads"} {
		var l LoadsAnswer
		// sgl-model-gateway's shape: a client summing loads[].load reads 2.
		if c := e.call("GET", p, "", &l); c != 200 || len(l.Loads) != 2 || l.TotalWorkers != 2 ||
			l.Loads[0] != (Load{Worker: wurl(0), WorkerType: "regular", Load: 0}) || l.Loads[1] != (Load{Worker: wurl(1), WorkerType: "regular", Load: 2}) || len(l.Workers) != 2 {
			t.Fatalf("%s: %d %+v", p, c, l)
		}
		if c := e.call("POST", p, "", nil); c != 405 {
			t.Fatalf("POST %s: %d", p, c)
		}
	}
	resp, err := http.Get(e.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(b), "tether_x 1") {
		t.Fatalf("metrics: %d %q", resp.StatusCode, b)
	}
	var h map[string]string
	if c := e.call("GET", "/health", "", &h); c != 200 || h["status"] != "ok" {
		t.Fatalf("health: %d %v", c, h)
	}
}

func TestToken(t *testing.T) {
	e := newEnv(t, "s3cret")
	for _, p := range []string{"/workers", "/list_workers", "/get_loads", "/metrics", "/health", "/nothing"} {
		if c := e.call("GET", p, "", nil); c != 401 {
			t.Errorf("GET %s without token: %d", p, c)
		}
		if c := e.call("GET", p, "", nil, "Authorization", "Bearer wrong"); c != 401 {
			t.Errorf("GET %s wrong token: %d", p, c)
		}
		if c := e.call("GET", p, "", nil, "Authorization", "Basic s3cret"); c != 401 {
			t.Errorf("GET %s basic: %d", p, c)
		}
	}
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(0)), "", nil); c != 401 || len(e.reg.List()) != 0 {
		t.Fatalf("unauthorized add: %d", c)
	}
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(0)), "", nil, "Authorization", "Bearer s3cret"); c != 200 {
		t.Fatalf("authorized add: %d", c)
	}
	if c := e.call("GET", "/workers", "", nil, "Authorization", "bearer s3cret"); c != 200 {
		t.Fatalf("case-insensitive scheme: %d", c)
	}
}

func TestIsAdminPath(t *testing.T) {
	for _, p := range []string{"/add_worker", "/add_worker?url=x", "/remove_worker", "/list_workers", "/workers",
		"/workers?x", "/workers/1", "/workers/1/drain", "/get_loads", "/v1/loads", "/metrics", "/ui", "/ui/state", "/ui/app.js", "/baseline"} {
		if !IsAdminPath([]byte(p)) {
			t.Errorf("%s not an admin path", p)
		}
	}
	for _, p := range []string{"/", "/health", "/sessions", "/workers/", "/workersx", "/add_workers", "/v1/chat/completions",
		"/sessions/w0-abcd/add_worker", "/metricsx", "/get_load", "/v1/loads/x", "/ui/", "/uix", "/baselines"} {
		if IsAdminPath([]byte(p)) {
			t.Errorf("%s is an admin path", p)
		}
	}
	s := New(Config{Registry: registry.New(registry.Options{})})
	path, method := []byte("/v1/chat/completions"), []byte("POST")
	if n := testing.AllocsPerRun(100, func() { s.DataPort(method, path) }); n != 0 {
		t.Fatalf("DataPort allocates %v times per call", n)
	}
	if s.DataPort(method, []byte("/workers/3")) == nil {
		t.Fatal("DataPort missed an admin path")
	}
}

// A worker's capacity: given with the add (JSON or query), changed with
// PATCH, listed in the worker's JSON and set on the routed worker.
func TestMaxInFlight(t *testing.T) {
	e := newEnv(t, "")
	var info registry.Info
	if c := e.call("POST", "/workers", `{"url":"`+wurl(1)+`","max_in_flight":32}`, &info); c != 200 || info.MaxInFlight != 32 {
		t.Fatalf("add with max_in_flight: %d %+v", c, info)
	}
	if w := e.reg.Table().Get(info.Slot); w == nil || w.MaxInFlight() != 32 {
		t.Fatalf("routed worker capacity: %+v", w)
	}
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(2))+"&max_in_flight=7", "", &info); c != 200 || info.MaxInFlight != 7 {
		t.Fatalf("legacy add with max_in_flight: %d %+v", c, info)
	}
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(3))+"&max_in_flight=-7", "", nil); c != 400 {
		t.Fatalf("negative max_in_flight: %d", c)
	}
	if c := e.call("PATCH", "/workers/0", `{"max_in_flight":0}`, &info); c != 200 || info.MaxInFlight != 0 {
		t.Fatalf("PATCH: %d %+v", c, info)
	}
	if w := e.reg.Table().Get(0); w.MaxInFlight() != 0 {
		t.Fatalf("after PATCH: capacity %d", w.MaxInFlight())
	}
	var l struct{ Workers []registry.Info }
	if c := e.call("GET", "/workers", "", &l); c != 200 || len(l.Workers) != 2 || l.Workers[1].MaxInFlight != 7 {
		t.Fatalf("GET /workers: %+v", l)
	}
}

// sglang-router clients (slime, miles) as their code is written: worker
// "id" in the list, stable for a url; removal by that id; a re-add of a
// registered engine (restarted on the same host:port) is a no-op 200;
// dp-rank urls and prefill/decode workers are refused with a clear
// message; aliases of one engine share a slot; drain and undrain.
func TestSGLangRouterClients(t *testing.T) {
	e := newEnv(t, "")
	var a Answer
	if c := e.call("POST", "/workers", `{"url":"`+wurl(1)+`","worker_type":"regular"}`, &a); c != 200 || a.ID == "" {
		t.Fatalf("add: %d %+v", c, a)
	}
	id := a.ID
	// The same url again (slime/miles raise_for_status after registering).
	if c := e.call("POST", "/add_worker?url="+url.QueryEscape(wurl(1)), "", &a); c != 200 || a.ID != id || a.Slot != 0 {
		t.Fatalf("re-add: %d %+v", c, a)
	}
	// An alias of the same engine: same slot.
	alias := fmt.Sprintf("http://localhost:%d", 21001)
	if c := e.call("POST", "/workers", `{"url":"`+alias+`"}`, &a); c != 200 || a.Slot != 0 {
		t.Fatalf("alias: %d %+v", c, a)
	}
	var l struct {
		Workers []map[string]any `json:"workers"`
	}
	if c := e.call("GET", "/workers", "", &l); c != 200 || len(l.Workers) != 1 || l.Workers[0]["id"] != id {
		t.Fatalf("GET /workers: %+v", l)
	}
	for _, c := range []struct {
		body, want string
	}{
		{`{"url":"` + wurl(2) + `@1"}`, "data-parallel rank"},
		{`{"url":"` + wurl(2) + `","worker_type":"prefill","bootstrap_port":8998}`, "prefill/decode"},
		{`{"url":"` + wurl(2) + `","worker_type":"decode"}`, "prefill/decode"},
		{`{"url":"` + wurl(2) + `","bootstrap_port":8998}`, "bootstrap_port"},
	} {
		var eb ErrorBody
		if code := e.call("POST", "/workers", c.body, &eb); code != 400 || !strings.Contains(eb.Error.Message, c.want) {
			t.Errorf("%s: %d %q", c.body, code, eb.Error.Message)
		}
	}
	// Drain, undrain by id.
	var info registry.Info
	if c := e.call("POST", "/workers/"+id+"/drain", "", &info); c != 200 || info.State != "draining" {
		t.Fatalf("drain: %d %+v", c, info)
	}
	if c := e.call("POST", "/workers/"+id+"/undrain", "", &info); c != 200 || info.State != "healthy" {
		t.Fatalf("undrain: %d %+v", c, info)
	}
	// slime's shutdown: DELETE /workers/{id}.
	if c := e.call("DELETE", "/workers/"+id, "", nil); c != 200 {
		t.Fatalf("delete by id: %d", c)
	}
	if c := e.call("GET", "/workers/"+id, "", nil); c != 404 {
		t.Fatalf("after delete: %d", c)
	}
	// The id is the url's: the same after a restart (a new registry).
	if registry.StableID("http://127.0.0.1:21001") != id {
		t.Error("id is not a function of the url")
	}
}
