package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// The ROUTING section of tetherctl status: decisions with a nonzero count
// from the admin API's GET /routing (with the token), and a clear line
// when the API cannot be reached.
func TestStatusRouting(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/routing" || r.Header.Get("Authorization") != "Bearer tok" {
			w.WriteHeader(404)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"policy":"hash","decisions":{"hash":90,"hash_spill":3,"hash_spilled":5,"hash_return":2,"learned":40,"bad_session_spread":1,"sticky":0},
			"learned_sessions":{"learned":8,"no_id":1,"forgotten":2},"sticky_shared":true}`))
	}))
	defer srv.Close()
	rs, err := readRouting(&adminClient{base: srv.URL, token: "tok", http: srv.Client()})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	if err := (&Status{Routing: rs}).printRouting(&out); err != nil {
		t.Fatal(err)
	}
	got := out.String()
	for _, want := range []string{"ROUTING (policy hash)", "hash_spill", "hash_return", "learned", "bad_session_spread",
		"learned sessions: 8 learned, 1 create answers without an id, 2 forgotten", "pinned BPF map"} {
		if !strings.Contains(got, want) {
			t.Errorf("missing %q in:\n%s", want, got)
		}
	}
	if strings.Contains(got, "\nsticky ") {
		t.Errorf("a zero count is printed:\n%s", got)
	}

	// No token: the API refuses, status says why instead of failing.
	_, err = readRouting(&adminClient{base: srv.URL, http: &http.Client{Timeout: time.Second}})
	if err == nil {
		t.Fatal("no error without the token")
	}
	out.Reset()
	(&Status{RoutingError: err.Error()}).printRouting(&out)
	if !strings.Contains(out.String(), "ROUTING: not available") {
		t.Errorf("unreachable: %q", out.String())
	}
}
