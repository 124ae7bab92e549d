package engine_test

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// TestCallsTranscript: every call tetherd makes to workers of each kind
// (learned SGLang, learned vLLM, unknown that 404s the SGLang words) for
// each engine endpoint it serves, headers included, and each answer, as
// recorded from the tree before the engine words moved to dialect
// (testdata/calls.golden; UPDATE_GOLDEN=1 rewrites it).
func TestCallsTranscript(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	var cur string
	rec := func(name string, notFound func(string) bool) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			h := []string{}
			for k, v := range r.Header {
				h = append(h, k+"="+strings.Join(v, ","))
			}
			sort.Strings(h)
			mu.Lock()
			lines = append(lines, fmt.Sprintf("%s | %s | %s %s | %q | %v", cur, name, r.Method, r.URL.RequestURI(), b, h))
			mu.Unlock()
			if notFound != nil && notFound(r.URL.Path) {
				http.NotFound(w, r)
				return
			}
			if r.URL.Path == "/get_weight_version" {
				fmt.Fprint(w, `{"weight_version":"w1"}`)
				return
			}
			fmt.Fprint(w, `{"success":true}`)
		}))
	}
	s0 := rec("sgl", nil)
	s1 := rec("vllm", nil)
	s2 := rec("unk-vllm", func(p string) bool {
		return p == "/abort_request" || p == "/pause_generation" || p == "/continue_generation" || p == "/flush_cache"
	})
	defer s0.Close()
	defer s1.Close()
	defer s2.Close()
	tab := worker.NewTable()
	st := stats.NewHeap()
	tab.Put(&worker.Worker{Slot: 0, URL: s0.URL, Stats: st.Worker(0)})
	tab.Put(&worker.Worker{Slot: 1, URL: s1.URL, Stats: st.Worker(1)})
	tab.Put(&worker.Worker{Slot: 2, URL: s2.URL, Stats: st.Worker(2)})
	tab.Get(0).SetEngine(dialect.SGLang)
	tab.Get(1).SetEngine(dialect.VLLM)
	f := fleet.New(fleet.Config{Table: tab})
	eng := engine.New(engine.Config{Table: tab, Timeout: 2 * time.Second, WorkerAPIKey: "wk", Fleet: f, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer eng.Close()
	h := eng.Handler()
	do := func(method, path, body, auth string) {
		mu.Lock()
		cur = method + " " + path + " " + body
		mu.Unlock()
		req := httptest.NewRequest(method, path, strings.NewReader(body))
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		rw := httptest.NewRecorder()
		h.ServeHTTP(rw, req)
		out := rw.Body.String()
		// elapsed times and held_since vary
		out = varying.ReplaceAllString(out, `"$1":X`)
		mu.Lock()
		lines = append(lines, fmt.Sprintf("ANSWER %s | %d %s", cur, rw.Code, strings.TrimSpace(out)))
		mu.Unlock()
	}
	do("POST", "/abort_request", `{"rid":"r1","x":1}`, "")
	do("POST", "/abort_request", `{"abort_all":true}`, "Bearer client")
	do("POST", "/abort_request", `{"rid":2}`, "")
	do("POST", "/abort_requests", `{"request_ids":["a","b","a"],"y":"z"}`, "")
	do("POST", "/abort_requests", `{}`, "")
	do("POST", "/abort_requests", `{"rid":"x"}`, "")
	do("POST", "/flush_cache", ``, "")
	do("GET", "/get_loads", ``, "")
	do("GET", "/v1/loads", ``, "")
	do("GET", "/get_weight_version", ``, "")
	do("POST", "/pause_generation", `{"mode":"in_place","extra":1}`, "")
	do("POST", "/continue_generation", `{"k":1}`, "")
	do("POST", "/pause?mode=wait&timeout_s=1&clear_cache=true", ``, "")
	do("POST", "/resume", ``, "")
	do("POST", "/pause_generation", `{"mode":"retract"}`, "")
	do("POST", "/resume", `{"r":2}`, "")
	do("POST", "/pause?mode=bogus", ``, "")
	do("POST", "/pause_generation", `[1]`, "")
	do("POST", "/update_weights_from_disk?a=b", `{"model_path":"/m","weight_version":"v2"}`, "")
	do("POST", "/update_weight_version", `{"new_version":"v3"}`, "")
	do("POST", "/update_weight_version", `{"new_version":3}`, "")
	do("POST", "/start_weight_update", `{}`, "")
	do("POST", "/update_weights", `{"x":1}`, "")
	do("POST", "/finish_weight_update", `{"weight_version":"v4"}`, "")
	do("POST", "/reset_prefix_cache", ``, "")
	do("GET", "/is_paused", ``, "")
	do("POST", "/abort_until_idle?timeout_s=0", ``, "")
	sort.Strings(lines)
	got := strings.Join(lines, "\n") + "\n"
	for i, u := range []string{s0.URL, s1.URL, s2.URL} {
		got = strings.ReplaceAll(got, u, "http://worker"+string(rune('0'+i)))
	}
	const golden = "testdata/calls.golden"
	if os.Getenv("UPDATE_GOLDEN") != "" {
		if err := os.WriteFile(golden, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		gl, wl := strings.Split(got, "\n"), strings.Split(string(want), "\n")
		for i := range max(len(gl), len(wl)) {
			g, w := "", ""
			if i < len(gl) {
				g = gl[i]
			}
			if i < len(wl) {
				w = wl[i]
			}
			if g != w {
				t.Errorf("line %d:\n got  %s\n want %s", i+1, g, w)
			}
		}
	}
}

// varying matches the answer fields whose values vary from run to run.
var varying = regexp.MustCompile(`"(elapsed_s|quiesce_s|held_since)":[^,}]*`)
