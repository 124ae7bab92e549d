package engine_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/demo"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// harness is tetherd's data plane in-process: demo workers (SGLang-like
// engines), the policy router tracking request ids in Owners, and the
// proxy serving the engine endpoints through Config.Local, on loopback.
type harness struct {
	t      *testing.T
	demos  []*demo.Server
	tab    *worker.Table
	rt     *route.Router
	owners *engine.Owners
	addr   string
	client *http.Client
}

func newHarness(t *testing.T, n int, dopts demo.Options, pcfg route.PolicyConfig) *harness {
	t.Helper()
	h := &harness{t: t, tab: worker.NewTable(), owners: engine.NewOwners(0)}
	st := stats.NewHeap()
	for i := 0; i < n; i++ {
		o := dopts
		o.Index = i
		s, err := demo.Start("127.0.0.1:0", o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		h.demos = append(h.demos, s)
		ws := st.Worker(i)
		pool := upstream.New(s.Addr(), ws, upstream.Options{})
		t.Cleanup(pool.Close)
		h.tab.Put(&worker.Worker{Slot: i, URL: s.URL(), Addr: s.Addr(), Stats: ws, Pool: pool})
	}
	p, err := route.NewPolicy(pcfg)
	if err != nil {
		t.Fatal(err)
	}
	h.rt = &route.Router{Table: h.tab, Owners: h.owners}
	h.rt.SetPolicy(p)
	eng := engine.New(engine.Config{Table: h.tab, Owners: h.owners, FinishSession: p.FinishSession,
		Timeout: 2 * time.Second, WaveInterval: 100 * time.Millisecond, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	t.Cleanup(eng.Close)
	srv := proxy.New(proxy.Config{
		Router:          h.rt,
		Table:           h.tab,
		PeekBody:        4096,
		Local:           eng.Local,
		ResponseTimeout: 20 * time.Second,
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln, nil)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		srv.Shutdown(ctx)
	})
	h.addr = ln.Addr().String()
	tr := &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64}
	t.Cleanup(tr.CloseIdleConnections)
	h.client = &http.Client{Transport: tr, Timeout: 20 * time.Second}
	return h
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func (h *harness) do(method, path, body string, headers ...string) response {
	h.t.Helper()
	req, err := http.NewRequest(method, "http://"+h.addr+path, strings.NewReader(body))
	if err != nil {
		h.t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := h.client.Do(req)
	if err != nil {
		h.t.Errorf("%s %s: %v", method, path, err)
		return response{}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		h.t.Errorf("%s %s: read: %v", method, path, err)
	}
	return response{resp.StatusCode, resp.Header, b}
}

func decode[T any](t *testing.T, r response) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(r.body, &v); err != nil {
		t.Fatalf("decode %q: %v", r.body, err)
	}
	return v
}

// generate starts a slow POST /generate through the proxy and returns a
// channel with its response.
func (h *harness) generate(body string, headers ...string) <-chan response {
	ch := make(chan response, 1)
	go func() { ch <- h.do("POST", "/generate", body, headers...) }()
	return ch
}

func (h *harness) running() int {
	n := 0
	for _, d := range h.demos {
		n += len(d.Running())
	}
	return n
}

func (h *harness) requests() []int64 {
	out := make([]int64, len(h.demos))
	for i, d := range h.demos {
		out[i] = d.Requests()
	}
	return out
}

func await(t *testing.T, ch <-chan response) response {
	t.Helper()
	select {
	case r := <-ch:
		return r
	case <-time.After(15 * time.Second):
		t.Fatal("request did not end")
	}
	return response{}
}

// slow makes a generate run for about 20s unless aborted.
var slow = demo.Options{StreamDelay: 50 * time.Millisecond, StreamChunks: 400}

func TestAbortReachesOwnerOnly(t *testing.T) {
	h := newHarness(t, 4, slow, route.PolicyConfig{})
	gen := h.generate(`{"rid":"gen-1","text":"a long prompt","sampling_params":{}}`, "X-Session-ID", "trajectory-7:0")
	testenv.WaitFor(t, "gen-1 running", func() bool { return h.running() == 1 })
	owner, ok := h.owners.Owner([]byte("gen-1"))
	if !ok {
		t.Fatal("gen-1 not tracked")
	}
	if got := h.demos[owner].Running(); !slices.Equal(got, []string{"gen-1"}) {
		t.Fatalf("owner %d runs %v", owner, got)
	}
	before := h.requests()

	r := h.do("POST", "/abort_request", `{"rid":"gen-1"}`)
	if r.status != 200 {
		t.Fatalf("abort: %d %s", r.status, r.body)
	}
	ans := decode[engine.AbortAnswer](t, r)
	if ans.Routed != "owner" || len(ans.Successful) != 1 || ans.Successful[0].Worker != owner || len(ans.Failed) != 0 {
		t.Fatalf("abort answer %s", r.body)
	}
	if !bytes.Contains(ans.Successful[0].Response, []byte(`"aborted":["gen-1"]`)) {
		t.Errorf("worker response %s", ans.Successful[0].Response)
	}
	// Only the owner heard of the abort.
	after := h.requests()
	for i := range h.demos {
		want := before[i]
		if i == owner {
			want++
		}
		if after[i] != want {
			t.Errorf("worker %d: %d requests, want %d", i, after[i], want)
		}
		if i != owner && len(h.demos[i].Aborted()) != 0 {
			t.Errorf("worker %d aborted %v", i, h.demos[i].Aborted())
		}
	}
	g := await(t, gen)
	if g.status != 200 || !bytes.Contains(g.body, []byte(`"type":"abort"`)) {
		t.Fatalf("generate: %d %s", g.status, g.body)
	}
	// The id is released once the exchange ended.
	testenv.WaitFor(t, "gen-1 released", func() bool { return h.owners.Len() == 0 })

	// An id nobody knows goes to every worker.
	r = h.do("POST", "/abort_request", `{"rid":"never-seen","extra":{"kept":true}}`)
	ans = decode[engine.AbortAnswer](t, r)
	if r.status != 200 || ans.Routed != "all" || len(ans.Successful) != 4 {
		t.Fatalf("unknown rid: %d %s", r.status, r.body)
	}
}

// An id sent in the X-Request-ID header (vLLM) is tracked too.
func TestAbortByHeaderRequestID(t *testing.T) {
	h := newHarness(t, 3, slow, route.PolicyConfig{})
	gen := h.generate(`{"text":"x"}`, "X-Request-ID", "hdr-9", "X-SMG-Target-Worker", "2")
	testenv.WaitFor(t, "hdr-9 running", func() bool { return slices.Equal(h.demos[2].Running(), []string{"hdr-9"}) })
	r := h.do("POST", "/abort_requests", `{"request_ids":["hdr-9"]}`)
	ans := decode[engine.AbortAnswer](t, r)
	if r.status != 200 || ans.Routed != "owners" || len(ans.Successful) != 1 || ans.Successful[0].Worker != 2 {
		t.Fatalf("abort_requests: %d %s", r.status, r.body)
	}
	await(t, gen)
}

func TestAbortRequestsGroupedPerOwner(t *testing.T) {
	h := newHarness(t, 3, slow, route.PolicyConfig{})
	var gens []<-chan response
	for _, g := range []struct{ rid, slot string }{{"a", "0"}, {"b", "1"}, {"c", "1"}} {
		gens = append(gens, h.generate(`{"rid":"`+g.rid+`"}`, "X-SMG-Target-Worker", g.slot))
	}
	testenv.WaitFor(t, "3 running", func() bool { return h.running() == 3 })
	r := h.do("POST", "/abort_requests", `{"request_ids":["a","b","c","zz","b"]}`)
	if r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	ans := decode[engine.AbortAnswer](t, r)
	got := map[int][]string{}
	for _, res := range ans.Successful {
		got[res.Worker] = res.RequestIDs
	}
	want := map[int][]string{0: {"a", "zz"}, 1: {"b", "c", "zz"}, 2: {"zz"}}
	if ans.Routed != "all" || ans.RequestIDs != 4 || len(ans.Failed) != 0 || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("grouping %v, want %v (%s)", got, want, r.body)
	}
	for _, g := range gens {
		if res := await(t, g); !bytes.Contains(res.body, []byte(`"type":"abort"`)) {
			t.Errorf("not aborted: %s", res.body)
		}
	}
	sorted := func(s []string) []string { slices.Sort(s); return s }
	if !slices.Equal(h.demos[0].Aborted(), []string{"a"}) || !slices.Equal(sorted(h.demos[1].Aborted()), []string{"b", "c"}) || len(h.demos[2].Aborted()) != 0 {
		t.Errorf("aborted: %v %v %v", h.demos[0].Aborted(), h.demos[1].Aborted(), h.demos[2].Aborted())
	}
}

func TestAbortAllFansOut(t *testing.T) {
	h := newHarness(t, 3, slow, route.PolicyConfig{})
	var gens []<-chan response
	for i := 0; i < 3; i++ {
		gens = append(gens, h.generate(fmt.Sprintf(`{"rid":"x%d","stream":true}`, i), "X-SMG-Target-Worker", fmt.Sprint(i)))
	}
	testenv.WaitFor(t, "3 running", func() bool { return h.running() == 3 })
	r := h.do("POST", "/abort_request", `{"abort_all":true}`)
	ans := decode[engine.AbortAnswer](t, r)
	if r.status != 200 || ans.Routed != "all" || len(ans.Successful) != 3 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	for i, g := range gens {
		res := await(t, g)
		if !bytes.Contains(res.body, []byte(`"type":"abort"`)) || !bytes.HasSuffix(res.body, []byte("data: [DONE]\n\n")) {
			t.Errorf("stream %d: %s", i, res.body)
		}
	}
}

func TestAbortUntilIdle(t *testing.T) {
	h := newHarness(t, 3, slow, route.PolicyConfig{})
	var gens []<-chan response
	for i := 0; i < 9; i++ {
		body := fmt.Sprintf(`{"rid":"u%d","stream":%v}`, i, i%2 == 0)
		if i%3 == 0 {
			body = `{"text":"no id"}` // the engine generates one: abort_all only
		}
		gens = append(gens, h.generate(body, "X-Session-ID", fmt.Sprint("k", i)))
	}
	testenv.WaitFor(t, "9 running", func() bool { return h.running() == 9 })
	start := time.Now()
	r := h.do("POST", "/abort_until_idle?timeout_s=10", "")
	took := time.Since(start)
	ans := decode[engine.IdleAnswer](t, r)
	if r.status != 200 || !ans.Idle || ans.Waves < 1 || len(ans.StillRunning) != 0 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	t.Logf("9 slow generates idle after %v, %d waves", took, ans.Waves)
	if took > 5*time.Second {
		t.Errorf("took %v", took)
	}
	for _, w := range h.tab.Snapshot() {
		if n := w.Stats.Pending(); n != 0 {
			t.Errorf("worker %d: %d in flight", w.Slot, n)
		}
	}
	for _, g := range gens {
		await(t, g)
	}

	// Something abort cannot stop: answered at the timeout, with what is
	// still running.
	slowReq := make(chan response, 1)
	go func() { slowReq <- h.do("POST", "/sessions/w1-abc/slow?chunks=8&delay_ms=100", "") }()
	testenv.WaitFor(t, "slow session request in flight", func() bool { return h.tab.Get(1).Stats.Pending() == 1 })
	r = h.do("POST", "/abort_until_idle?timeout_s=0.3", "")
	ans = decode[engine.IdleAnswer](t, r)
	if r.status != 200 || ans.Idle || len(ans.StillRunning) != 1 || ans.StillRunning[0].Worker != 1 || ans.StillRunning[0].InFlight != 1 || ans.Waves < 1 {
		t.Fatalf("not idle: %d %s", r.status, r.body)
	}
	if ans.ElapsedS < 0.3 || ans.ElapsedS > 2 {
		t.Errorf("elapsed %v", ans.ElapsedS)
	}
	await(t, slowReq)
}

func TestBadAbortBodies(t *testing.T) {
	h := newHarness(t, 2, demo.Options{}, route.PolicyConfig{})
	cases := []struct{ method, path, body, msg string }{
		{"POST", "/abort_request", `[]`, "JSON object"},
		{"POST", "/abort_request", `"rid"`, "JSON object"},
		{"POST", "/abort_request", `null`, "JSON object"},
		{"POST", "/abort_request", ``, "JSON object"},
		{"POST", "/abort_request", `not json`, "JSON object"},
		{"POST", "/abort_request", `{"rid":`, "not valid JSON"},
		{"POST", "/abort_request", `{"rid":"a"} {}`, "trailing"},
		{"POST", "/abort_request", `{}`, `give "rid"`},
		{"POST", "/abort_request", `{"rid":""}`, `give "rid"`},
		{"POST", "/abort_request", `{"rid":1}`, `"rid" must be a string, not a number`},
		{"POST", "/abort_request", `{"rid":["a"]}`, `"rid" must be a string, not a list`},
		{"POST", "/abort_request", `{"rid":null}`, `"rid" must be a string, not null`},
		{"POST", "/abort_request", `{"abort_all":"yes"}`, `"abort_all" must be a boolean, not a string`},
		{"POST", "/abort_request", `{"abort_all":1}`, `"abort_all" must be a boolean`},
		{"POST", "/abort_requests", `{"request_ids":"a"}`, `"request_ids" must be a list of strings, not a string`},
		{"POST", "/abort_requests", `{"request_ids":"a,b"}`, `not a string`},
		{"POST", "/abort_requests", `{"request_ids":[1]}`, `"request_ids"[0] must be a non-empty string, not a number`},
		{"POST", "/abort_requests", `{"request_ids":["a",null]}`, `"request_ids"[1]`},
		{"POST", "/abort_requests", `{"request_ids":["a",""]}`, `"request_ids"[1]`},
		{"POST", "/abort_requests", `{"request_ids":[]}`, `empty`},
		{"POST", "/abort_requests", `{"request_ids":null}`, `not null`},
		{"POST", "/abort_requests", `{"rid":"a"}`, `missing "request_ids"`},
		{"POST", "/abort_requests", `[["a"]]`, "JSON object"},
		{"POST", "/abort_until_idle?timeout_s=abc", ``, "timeout_s"},
		{"POST", "/abort_until_idle?timeout_s=-1", ``, "timeout_s"},
		{"POST", "/abort_until_idle?timeout_s=NaN", ``, "timeout_s"},
		{"POST", "/abort_until_idle?timeout_s=99999", ``, "timeout_s"},
		{"POST", "/finish_session", ``, "session_id"},
		{"POST", "/finish_session", `[1]`, "session_id"},
	}
	for _, c := range cases {
		r := h.do(c.method, c.path, c.body, "Content-Type", "application/json")
		var e struct {
			Error struct {
				Code    int    `json:"code"`
				Message string `json:"message"`
			} `json:"error"`
		}
		json.Unmarshal(r.body, &e)
		if r.status != 400 || e.Error.Code != 400 || !strings.Contains(e.Error.Message, c.msg) {
			t.Errorf("%s %s %q: %d %s, want 400 mentioning %q", c.method, c.path, c.body, r.status, r.body, c.msg)
		}
	}
	for _, m := range []string{"GET", "PUT", "DELETE"} {
		if r := h.do(m, "/abort_request", `{"rid":"a"}`); r.status != 405 || r.header.Get("Allow") != "POST" {
			t.Errorf("%s /abort_request: %d", m, r.status)
		}
	}
	if r := h.do("POST", "/get_loads", ""); r.status != 405 {
		t.Errorf("POST /get_loads: %d", r.status)
	}
	// Nothing reached any worker.
	for i, n := range h.requests() {
		if n != 0 {
			t.Errorf("worker %d got %d requests", i, n)
		}
	}
}

func TestFlushCacheAndGetLoads(t *testing.T) {
	h := newHarness(t, 3, demo.Options{}, route.PolicyConfig{})
	h.demos[1].Close() // a dead engine: reported, not fatal
	for _, m := range []string{"POST", "GET"} {
		r := h.do(m, "/flush_cache", "")
		res := decode[engine.FlushAnswer](t, r)
		// Not flushed everywhere: not a 200 (a client retries until 200).
		if r.status != 502 || len(res.Successful) != 2 || len(res.Failed) != 1 || res.Failed[0].Worker != 1 || res.Failed[0].Error == "" ||
			res.TotalWorkers != 3 || res.Message != "cache not flushed on 1 of 3 workers" {
			t.Fatalf("%s flush_cache: %d %s", m, r.status, r.body)
		}
		if !bytes.Contains(res.Successful[1].Response, []byte(`"flushed":true`)) {
			t.Errorf("flush response %s", res.Successful[1].Response)
		}
	}
	for _, path := range []string{"/get_loads", "/v1/loads"} {
		r := h.do("GET", path, "")
		res := decode[engine.LoadsAnswer](t, r)
		if r.status != 200 || len(res.Successful) != 2 || len(res.Failed) != 1 || res.TotalWorkers != 3 || len(res.Loads) != 3 ||
			res.Loads[0].WorkerType != "regular" || !strings.HasPrefix(res.Loads[0].Worker, "http://") {
			t.Fatalf("%s: %d %s", path, r.status, r.body)
		}
	}
	r := h.do("GET", "/get_loads", "")
	res := decode[engine.Results](t, r)
	for _, s := range res.Successful {
		if s.InFlight == nil || !bytes.Contains(s.Response, []byte(fmt.Sprintf(`"worker":%d`, s.Worker))) || !bytes.Contains(s.Response, []byte(`"num_reqs"`)) {
			t.Errorf("get_loads entry %+v", s)
		}
	}
	// Every engine dead: 502.
	h.demos[0].Close()
	h.demos[2].Close()
	if r := h.do("POST", "/flush_cache", ""); r.status != 502 {
		t.Errorf("all dead: %d %s", r.status, r.body)
	}
}

func TestFinishSession(t *testing.T) {
	h := newHarness(t, 4, demo.Options{}, route.PolicyConfig{Kind: route.PolicySticky, Sticky: sticky.NewMemory(0)})
	worker := func() string {
		r := h.do("POST", "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`, "X-Session-ID", "traj-1")
		if r.status != 200 {
			t.Fatalf("chat: %d %s", r.status, r.body)
		}
		return r.header.Get("X-Tether-Demo-Worker")
	}
	first := worker()
	for i := 0; i < 5; i++ {
		if w := worker(); w != first {
			t.Fatalf("turn %d on %s, first on %s", i, w, first)
		}
	}
	type fin struct {
		SessionID string `json:"session_id"`
		Finished  bool   `json:"finished"`
	}
	if f := decode[fin](t, h.do("POST", "/finish_session?session_id=traj-1", "")); !f.Finished || f.SessionID != "traj-1" {
		t.Fatalf("%+v", f)
	}
	if f := decode[fin](t, h.do("POST", "/finish_session?session_id=traj-1", "")); f.Finished {
		t.Fatal("finished twice")
	}
	if f := decode[fin](t, h.do("POST", "/finish_session", `{"session_id":"unknown"}`)); f.Finished || f.SessionID != "unknown" {
		t.Fatalf("unknown: %+v", f)
	}
	if h.rt.Count(route.ReasonStickyNew) != 1 || h.rt.Count(route.ReasonSticky) != 5 {
		t.Errorf("sticky_new %d sticky %d", h.rt.Count(route.ReasonStickyNew), h.rt.Count(route.ReasonSticky))
	}
	worker()
	if h.rt.Count(route.ReasonStickyNew) != 2 {
		t.Error("finished key not placed anew")
	}
}

// Many concurrent keyed and keyless requests with ids through the proxy:
// every id released at the end (-race).
func TestTrackingUnderLoad(t *testing.T) {
	h := newHarness(t, 3, demo.Options{}, route.PolicyConfig{})
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 25; i++ {
				hdr := []string{"X-Session-ID", fmt.Sprint("k", i%5)}
				if i%2 == 1 {
					hdr = nil
				}
				if r := h.do("POST", "/generate", fmt.Sprintf(`{"rid":"g%d-%d"}`, g, i), hdr...); r.status != 200 {
					t.Errorf("generate: %d", r.status)
					return
				}
			}
		}()
	}
	wg.Wait()
	testenv.WaitFor(t, "all ids released", func() bool { return h.owners.Len() == 0 })
}
