package main

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"regexp"
	"testing"

	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/kvevents"
)

// The KV EVENTS section of tetherctl status: per worker and DP rank, the
// subscription's events, gaps, replays, restarts and blocks indexed, read
// from GET /workers "kv_events" as the daemon writes it.
func TestStatusKVEvents(t *testing.T) {
	kv, err := json.Marshal([]daemon.KVEngineStatus{
		{Slot: 1, Rank: 0, Endpoint: "tcp://10.0.0.6:5557", Replay: "tcp://10.0.0.6:5558", Blocks: 812,
			Stats: kvevents.Stats{Connected: true, Events: 4711, Gaps: 2, Replays: 2, Restarts: 1, Lost: 3}},
		{Slot: 1, Rank: 1, Endpoint: "tcp://10.0.0.6:5558", Blocks: 0, Stats: kvevents.Stats{ReplayFailures: 5, Malformed: 9}},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/workers" {
			w.WriteHeader(404)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"workers":[{"slot":0,"url":"http://10.0.0.5:30001","state":"healthy"},
			{"slot":1,"url":"http://10.0.0.6:30001","state":"healthy","kv_events":` + string(kv) + `}]}`))
	}))
	defer srv.Close()
	st := &Status{}
	if err := st.readCurrent(&adminClient{base: srv.URL, http: srv.Client()}); err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := st.printKVEvents(&out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, re := range []string{
		`KV EVENTS`,
		`(?m)^1\s+0\s+tcp://10\.0\.0\.6:5557\s+true\s+4711\s+2\s+2\s+0\s+1\s+3\s+0\s+812$`,
		`(?m)^1\s+1\s+tcp://10\.0\.0\.6:5558\s+false\s+0\s+0\s+0\s+5\s+0\s+0\s+9\s+0$`,
	} {
		if !regexp.MustCompile(re).MatchString(got) {
			t.Errorf("no %s in:\n%s", re, got)
		}
	}
	if regexp.MustCompile(`(?m)^0\s`).MatchString(got) {
		t.Errorf("slot 0 has no subscription, shown:\n%s", got)
	}
	// Off: no section at all.
	out.Reset()
	if err := (&Status{Workers: []WorkerStatus{{Slot: 0}}}).printKVEvents(&out); err != nil || out.Len() != 0 {
		t.Fatalf("placement off: %q, %v", out.String(), err)
	}
}
