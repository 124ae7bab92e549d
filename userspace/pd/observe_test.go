package pd_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/pd"
)

// observing is a RoundRobin chooser that is a pd.Observer.
type observing struct {
	pd.RoundRobin
	mu   sync.Mutex
	seen []observed
}

type observed struct {
	pair   string
	status int
}

func (o *observing) Observe(p pd.Pair, status int, took time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if took <= 0 {
		status = -1 // a time that cannot be: the test fails on it
	}
	o.seen = append(o.seen, observed{p.String(), status})
}

// TestObserver: the chooser is told once per request, of the pair that
// answered and the client's status; an attempt that failed and was tried
// again on another pair is not observed. A chooser that is no Observer
// changes nothing (the other tests).
func TestObserver(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close() // connections refused: the first attempt's prefill fails
	good := newRecorder(t, `{"kv_transfer_params":{"remote_block_ids":[1]}}`)
	dec := newRecorder(t, `{"choices":[{"text":"ok"}]}`)
	c := &observing{RoundRobin: pd.RoundRobin{
		Prefills: []pd.Worker{{URL: dead.URL, Slot: 0}, {URL: good.URL, Slot: 1}},
		Decodes:  []pd.Worker{{URL: dec.URL, Slot: 2}},
	}}
	s := pd.New(pd.Config{Protocol: pd.VLLM})
	defer s.Close()
	for i, want := range []observed{{"p1+d2", 200}, {"p1+d2", 400}} {
		body := `{"prompt":"p","max_tokens":2}`
		if want.status == 400 {
			body = `{"prompt":"p","n":3,"stream":true}` // refused before a pair is chosen: not observed
		}
		w := httptest.NewRecorder()
		s.Serve(context.Background(), w, &pd.Request{Method: "POST", Path: "/v1/completions", Header: http.Header{}, Body: []byte(body)}, c)
		if w.Code != want.status {
			t.Fatalf("request %d: status %d %s", i, w.Code, w.Body)
		}
	}
	// Choose picks prefills in turn: this one fails on p0 again first.
	w := httptest.NewRecorder()
	s.Serve(context.Background(), w, &pd.Request{Method: "POST", Path: "/v1/completions", Header: http.Header{}, Body: []byte(`{"prompt":"q"}`)}, c)
	c.mu.Lock()
	defer c.mu.Unlock()
	want := []observed{{"p1+d2", 200}, {"p1+d2", 200}}
	if len(c.seen) != len(want) || c.seen[0] != want[0] || c.seen[1] != want[1] {
		t.Errorf("observed %v, want %v", c.seen, want)
	}
	if v := s.Counters.Values(); v.Retries != 2 || v.PrefillFailed != 2 || v.RefusedN != 1 {
		t.Errorf("counters %+v", v)
	}
}
