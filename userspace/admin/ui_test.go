package admin

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/history"
	"github.com/tether-rl/tether/userspace/registry"
)

// The page and its state under a token: a Bearer header, or the cookie a
// browser gets from /ui?token= (GET of the page's paths only); / is a
// redirect to /ui; the files come from the binary.
func TestUIToken(t *testing.T) {
	e := newEnv(t, "tok")
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	nofollow := &http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(path string, cookie *http.Cookie, hdr ...string) *http.Response {
		req, _ := http.NewRequest("GET", e.srv.URL+path, nil)
		if cookie != nil {
			req.AddCookie(cookie)
		}
		for i := 0; i+1 < len(hdr); i += 2 {
			req.Header.Set(hdr[i], hdr[i+1])
		}
		resp, err := nofollow.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	for _, p := range []string{"/ui", "/ui/state", "/ui/app.js", "/", "/baseline"} {
		if r := get(p, nil); r.StatusCode != 401 {
			t.Errorf("GET %s without the token: %d", p, r.StatusCode)
		}
	}
	if r := get("/ui?token=wrong", nil); r.StatusCode != 401 {
		t.Fatalf("a wrong token: %d", r.StatusCode)
	}
	r := get("/ui?token=tok", nil)
	if r.StatusCode != 302 || r.Header.Get("Location") != "/ui" || len(r.Cookies()) != 1 {
		t.Fatalf("/ui?token=: %d %q %v", r.StatusCode, r.Header.Get("Location"), r.Cookies())
	}
	c := r.Cookies()[0]
	if !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.Path != "/ui" {
		t.Fatalf("cookie: %+v", c)
	}
	for _, p := range []string{"/ui", "/ui/state", "/ui/app.js", "/ui/style.css"} {
		if r := get(p, c); r.StatusCode != 200 {
			t.Errorf("GET %s with the cookie: %d", p, r.StatusCode)
		}
	}
	// The cookie is good for the page only: not for the API.
	if r := get("/workers", c); r.StatusCode != 401 {
		t.Fatalf("GET /workers with the page's cookie: %d", r.StatusCode)
	}
	if r := get("/workers?token=tok", nil); r.StatusCode != 401 {
		t.Fatalf("GET /workers?token=: %d", r.StatusCode)
	}
	req, _ := http.NewRequest("POST", e.srv.URL+"/add_worker?url=http://127.0.0.1:1&token=tok", nil)
	req.AddCookie(c)
	if resp, err := nofollow.Do(req); err != nil || resp.StatusCode != 401 {
		t.Fatalf("a POST with the page's cookie: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	if r := get("/", nil, "Authorization", "Bearer tok"); r.StatusCode != 302 || r.Header.Get("Location") != "/ui" {
		t.Fatalf("/: %d %q", r.StatusCode, r.Header.Get("Location"))
	}
	if r := get("/nope", nil, "Authorization", "Bearer tok"); r.StatusCode != 404 {
		t.Fatalf("/nope: %d", r.StatusCode)
	}
	var page string
	{
		req, _ := http.NewRequest("GET", e.srv.URL+"/ui", nil)
		req.Header.Set("Authorization", "Bearer tok")
		resp, err := nofollow.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		page = string(b)
		if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/html") || !strings.Contains(resp.Header.Get("Content-Security-Policy"), "script-src 'self'") {
			t.Fatalf("headers: %v", resp.Header)
		}
	}
	if !strings.Contains(page, `<script src="/ui/app.js"`) || strings.Contains(page, "http://") || strings.Contains(page, "https://") {
		t.Fatalf("the page loads something from elsewhere, or not its script:\n%s", page)
	}
}

// GET /ui/state: each worker's row, its state on the page and why; the
// history after ?since=.
func TestUIState(t *testing.T) {
	e := newEnv(t, "")
	for i := 0; i < 3; i++ {
		e.call("POST", "/workers", `{"url":"`+wurl(i)+`"}`, nil)
	}
	ring := history.NewRing(10)
	t0 := time.Unix(1000, 0).UTC()
	for i := 0; i < 4; i++ {
		ring.Add(t0.Add(time.Duration(i)*time.Second), history.Reading{Requests: uint64(i * 10), KV: []history.KV{{Slot: 0, Usage: 0.5}}})
	}
	syncs := history.NewSyncs()
	syncs.Add(history.Step{Kind: "pause", Start: t0, Held: 2})
	srv := New(Config{Registry: e.reg, Fleet: func() any { return fleet.Report{Phase: "paused", Mode: "abort", PhaseSinceS: 3, TargetVersion: "v2"} },
		Decorate: func(in *registry.Info) {
			switch in.Slot {
			case 0:
				in.SyncState = "paused"
			case 1:
				in.SyncState, in.WeightVersion = "fenced", "v1"
			}
		},
		UI: &UIConfig{Instance: "i1", Started: t0, History: ring, Syncs: syncs,
			Baseline:  func() Baseline { return Baseline{Workers: []WorkerBaseline{{Slot: 0, Requests: 5}}} },
			Listeners: func() []Listener { return []Listener{{Slot: 0, Accepted: 3, Share: 1}} }}})
	get := func(q string) UIState {
		w := httptest.NewRecorder()
		srv.ServeHTTP(w, httptest.NewRequest("GET", "/ui/state"+q, nil))
		if w.Code != 200 {
			t.Fatalf("GET /ui/state%s: %d %s", q, w.Code, w.Body)
		}
		var st UIState
		if err := json.Unmarshal(w.Body.Bytes(), &st); err != nil {
			t.Fatal(err)
		}
		return st
	}
	st := get("")
	if len(st.Workers) != 3 || st.Total != 3 || st.Instance != "i1" || len(st.History) != 3 || len(st.Syncs) != 1 || len(st.Listeners) != 1 {
		t.Fatalf("state: %+v", st)
	}
	want := []struct{ view, reason string }{
		{"paused", "fleet paused (abort) for 3.0 s: generation requests held"},
		{"fenced", "weight version v1, fleet target v2: no new work until it matches"},
		{"serving", ""},
	}
	for i, w := range want {
		got := st.Workers[i]
		if got.View != w.view || got.Reason != w.reason || got.Role != "regular" {
			t.Errorf("worker %d: %q %q, want %q %q", i, got.View, got.Reason, w.view, w.reason)
		}
	}
	if st2 := get("?since=" + st.History[1].T.Format(time.RFC3339Nano)); len(st2.History) != 1 || !st2.History[0].T.Equal(st.History[2].T) || st2.Seq <= st.Seq {
		t.Fatalf("since: %+v", st2.History)
	}
	w := httptest.NewRecorder()
	srv.ServeHTTP(w, httptest.NewRequest("GET", "/ui/state?since=yesterday", nil))
	if w.Code != 400 {
		t.Fatalf("a bad since: %d", w.Code)
	}
}

func TestView(t *testing.T) {
	kv := 0.97
	for _, c := range []struct {
		in         registry.Info
		view, want string
	}{
		{registry.Info{State: registry.StateUnhealthy, ConsecutiveFailures: 3, LastError: "connection refused", SyncState: "unhealthy"}, "unhealthy", "health checks failing (3 in a row): connection refused"},
		{registry.Info{State: registry.StateDraining, SyncState: "draining"}, "draining", "draining: no new sessions or keys, existing ones go on"},
		{registry.Info{State: registry.StatePending}, "pending", "waiting for a first good health check"},
		{registry.Info{State: registry.StateRemoved}, "removed", "removed: finishing its requests"},
		{registry.Info{State: registry.StateHealthy, SyncState: "updating"}, "updating", "its weights are being updated: no new work"},
		{registry.Info{State: registry.StateHealthy, Engine: &registry.EngineInfo{Vetoed: true, KVUsage: &kv, Waiting: 4}}, "serving", "engine vetoed (no new keys, sessions or keyless work): KV 97%, 4 waiting"},
		{registry.Info{State: registry.StateUnhealthy}, "unhealthy", "health checks failing"},
	} {
		if v, r := view(c.in, nil); v != c.view || r != c.want {
			t.Errorf("%+v: %q %q, want %q %q", c.in, v, r, c.view, c.want)
		}
	}
}

func TestSince(t *testing.T) {
	for _, c := range [][3]uint64{{10, 4, 6}, {3, 10, 3}, {5, 5, 0}, {0, 0, 0}} {
		if got := Since(c[0], c[1]); got != c[2] {
			t.Errorf("Since(%d, %d) = %d, want %d", c[0], c[1], got, c[2])
		}
	}
}
