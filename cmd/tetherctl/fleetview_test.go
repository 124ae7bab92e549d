package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

const uiStateJSON = `{"seq":3,"fleet":{"phase":"paused","mode":"abort","phase_since_s":4.2,"epoch":3,"target_version":"v2","held":5,
 "released_total":9,"hold_timeouts_total":0,"hold_full_total":0,"pauses_total":2,"workers":[]},
 "workers":[{"slot":0,"url":"http://e0:30000","state":"healthy","in_flight":1,"weight_version":"v2","view":"paused","reason":"fleet paused (abort) for 4.2 s: generation requests held",
   "engine":{"kind":"sglang","signals":true,"running":3,"waiting":1,"kv_usage":0.42,"prefix_hit_rate":0.5}},
  {"slot":1,"url":"http://e1:30000","state":"healthy","in_flight":0,"view":"fenced","reason":"weight version v1, fleet target v2: no new work until it matches",
   "engine":{"kind":"vllm","signals":true,"running":0,"waiting":0,"kv_usage":0.1,"weight_version":"v1"}}],
 "syncs":[{"id":2,"start":"2026-01-01T10:00:00Z","open":true,"failed":1,"held_peak":5,"steps":[
   {"kind":"quiesce","path":"/pause_generation","start":"2026-01-01T10:00:00Z","duration_s":0.25,"status":200,"mode":"abort","abort_waves":2,"quiet":true,"failed":0},
   {"kind":"pause","path":"/pause_generation","start":"2026-01-01T10:00:00.25Z","duration_s":0.01,"status":200,"held":5,"failed":0,"engines":[{"slot":0,"duration_s":0.004},{"slot":1,"duration_s":0.006}]},
   {"kind":"update","path":"/update_weights_from_disk","start":"2026-01-01T10:00:01Z","duration_s":0.8,"status":502,"version":"v2","fenced":[1],"failed":1,
    "engines":[{"slot":0,"duration_s":0.7},{"slot":1,"duration_s":0.02,"error":"worker answered 500"}]}]}]}`

func TestFleetView(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/ui/state" {
			w.WriteHeader(404)
			return
		}
		w.Write([]byte(uiStateJSON))
	}))
	defer srv.Close()
	var out bytes.Buffer
	if code := run([]string{"fleet", "--admin", srv.URL}, &out, &out); code != 0 {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	got := out.String()
	for _, re := range []string{
		`FLEET paused \(abort\) for 4\.2s · 5 requests held \(9 released, 0 timed out, 0 refused: hold full\) · target version v2 · epoch 3 · 2 pauses`,
		`(?m)^0\s+sglang\s+paused\s+v2\s+42%\s+3/1\s+1\s+http://e0:30000\s+fleet paused`,
		`(?m)^1\s+vllm\s+fenced\s+v1\s+10%\s+0/0\s+0\s+http://e1:30000\s+weight version v1, fleet target v2`,
		`LAST SYNC 2 at \d\d:\d\d:\d\d \(open; held peak 5; 1 engine calls failed\)`,
		`(?m)^\s+quiesce\s+0\.250s\s+abort, 2 abort waves, quiet`,
		`(?m)^\s+update\s+0\.800s\s+/update_weights_from_disk, version v2, fenced \[1\], 1 FAILED \(502\)\s+0:0\.700s 1:0\.020s\(worker answered 500\)`,
	} {
		if !regexp.MustCompile(re).MatchString(got) {
			t.Errorf("no match for %s in:\n%s", re, got)
		}
	}
}

// A tetherd without the page: GET /fleet.
func TestFleetViewOlderTetherd(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/fleet" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(404)
			w.Write([]byte(`{"error":{"code":404,"message":"no such endpoint"}}`))
			return
		}
		w.Write([]byte(`{"phase":"serving","epoch":1,"workers":[{"slot":0,"url":"http://e0:1","engine":"sglang","state":"serving","weight_version":"v0"}]}`))
	}))
	defer srv.Close()
	var out bytes.Buffer
	if code := run([]string{"fleet", "--admin", srv.URL}, &out, &out); code != 0 {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	if !regexp.MustCompile(`(?m)^0\s+sglang\s+serving\s+v0\s+0\s+http://e0:1$`).MatchString(out.String()) {
		t.Fatalf("got:\n%s", out.String())
	}
}

// fleet watch: a frame per interval, the screen cleared before each, a
// bounded number of frames (--count), each read afresh; and it ends when
// its context does (Ctrl-C).
func TestFleetWatch(t *testing.T) {
	var reads atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := reads.Add(1)
		w.Write([]byte(strings.Replace(uiStateJSON, `"held":5`, `"held":`+string(rune('0'+n)), 1)))
	}))
	defer srv.Close()
	var out bytes.Buffer
	if code := run([]string{"fleet", "watch", "--interval", "1ms", "--count", "3", "--admin", srv.URL}, &out, &out); code != 0 {
		t.Fatalf("exit %d: %s", code, out.String())
	}
	got := out.String()
	if n := strings.Count(got, "\x1b[H\x1b[2JEvery 1ms: tetherctl fleet"); n != 3 || reads.Load() != 3 {
		t.Fatalf("%d frames, %d reads", n, reads.Load())
	}
	for _, held := range []string{"1 requests held", "2 requests held", "3 requests held"} {
		if !strings.Contains(got, held) {
			t.Fatalf("a frame is missing (%q):\n%s", held, got)
		}
	}
	// Unbounded, it runs until cancelled.
	ac, _ := newAdminClient(srv.URL, "", time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	out.Reset()
	go func() { done <- fleetWatch(ctx, &bytes.Buffer{}, ac, time.Millisecond, 0) }()
	before := reads.Load()
	testenv.WaitFor(t, "frames to keep coming", func() bool { return reads.Load() >= before+3 })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if code := run([]string{"fleet", "watch", "--interval", "0s"}, &out, &out); code != 2 {
		t.Fatalf("--interval 0: exit %d", code)
	}
}

// status: this run's counters apart from the pinned totals.
func TestStatusThisRun(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"instance_id":"abc","started":"2026-01-01T10:00:00Z","workers":[{"slot":0,"requests":100,"errors":2},{"slot":3,"requests":50}],
			"listeners":[{"slot":0,"accepted":10,"closed":9}]}`))
	}))
	defer srv.Close()
	yes, no := true, false
	st := &Status{CurrentKnown: true, Listeners: []ListenerStatus{{Slot: 0, Accepted: 25, Closed: 20}, {Slot: 5, Accepted: 7}},
		Workers: []WorkerStatus{
			{Slot: 0, Current: &yes, URL: "http://a", Requests: 130, Errors: 2}, // 30 this run
			{Slot: 3, Current: &yes, URL: "http://b", Requests: 12},             // reset since the start (another worker): all 12
			{Slot: 4, Current: &yes, URL: "http://c", Requests: 8},              // nothing at the start
			{Slot: 7, Current: &no, Requests: 999},                              // stale: not this run's
		}}
	ac, _ := newAdminClient(srv.URL, "", time.Second)
	if err := st.readRun(ac); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := st.print(&out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, re := range []string{
		`WORKERS: PINNED TOTALS \(the BPF maps keep them`,
		`THIS RUN \(since this tetherd started at .*; instance abc\)`,
		`(?m)^0\s+30\s+0\s+0\s+0\s+0\s+http://a$`,
		`(?m)^3\s+12\s+0\s+0\s+0\s+0\s+http://b$`,
		`(?m)^4\s+8\s+0\s+0\s+0\s+0\s+http://c$`,
		`(?m)^listener 0\s+15 accepted\s+11 closed`,
	} {
		if !regexp.MustCompile(re).MatchString(got) {
			t.Errorf("no match for %s in:\n%s", re, got)
		}
	}
	if strings.Contains(got[strings.Index(got, "\nTHIS RUN ("):], "999") || len(st.Run.Listeners) != 1 {
		t.Errorf("a stale slot or another listener counted as this run's:\n%s", got)
	}
}
