package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"
)

// The FLEET section of tetherctl status: the weight sync's phase, what is
// held, the target version and each worker's version and sync state, from
// the admin API's GET /fleet.
func TestStatusFleet(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/fleet" {
			w.WriteHeader(404)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"phase":"paused","mode":"abort","phase_since_s":2.5,"epoch":7,"target_version":"v5","held":12,
			"held_total":40,"released_total":28,"hold_full_total":0,"hold_timeouts_total":1,"pauses_total":3,
			"workers":[{"slot":0,"url":"http://10.0.0.5:30001","engine":"sglang","state":"paused","weight_version":"v5","in_flight":0},
			{"slot":1,"url":"http://10.0.0.6:30001","engine":"vllm","state":"fenced","weight_version":"v4","in_flight":0}]}`))
	}))
	defer srv.Close()
	r, err := readFleet(&adminClient{base: srv.URL, http: srv.Client()})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := (&Status{Fleet: r}).printFleet(&out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{"FLEET: paused (abort) for 2.5s, epoch 7, target version v5; 12 requests held now (28 released, 1 timed out, 0 refused: hold full); 3 pauses",
		"fenced", "v4", "vllm", "http://10.0.0.6:30001"} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in:\n%s", want, got)
		}
	}
}

// Each worker's pinned keys and decisions by reason, from GET /workers.
func TestStatusWorkerDecisions(t *testing.T) {
	var out bytes.Buffer
	three := 3
	st := &Status{Workers: []WorkerStatus{{Slot: 0, Pinned: &three, Decisions: map[string]uint64{"hash": 40, "group": 7}}, {Slot: 1}}}
	if err := st.printWorkerDecisions(&out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	if !strings.Contains(got, "KEYS AND DECISIONS PER WORKER") || !regexp.MustCompile(`(?m)^0\s+3\s+group=7 hash=40$`).MatchString(got) || regexp.MustCompile(`(?m)^1\s`).MatchString(got) {
		t.Fatalf("got:\n%s", got)
	}
}
