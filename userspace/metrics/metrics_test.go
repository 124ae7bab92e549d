package metrics

import (
	"io"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

func scrape(t *testing.T, m *Metrics) string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 {
		t.Fatalf("scrape: %d %s", rec.Code, rec.Body)
	}
	return rec.Body.String()
}

func has(t *testing.T, body string, lines ...string) {
	t.Helper()
	for _, l := range lines {
		if !strings.Contains(body, l+"\n") {
			t.Errorf("missing %q", l)
		}
	}
}

func TestCollectorAndObserve(t *testing.T) {
	st := stats.NewHeap()
	var m *Metrics
	reg := registry.New(registry.Options{Stats: st, Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		OnPut: func(w *worker.Worker) {
			if m != nil {
				m.SetWorker(w)
			}
		}})
	defer reg.Close()
	reg.Put(0, "http://127.0.0.1:9001", registry.OriginConfig)
	reg.Put(1, "http://127.0.0.1:9002", registry.OriginConfig)
	rt := &route.Router{Table: reg.Table()}
	var pc proxy.Counters
	m = New(Sources{Stats: st, Table: reg.Table(), Router: rt, Registry: reg, Proxy: &pc,
		Listeners: func() int { return 2 },
		Steering: func() (Steering, bool) {
			return Steering{Selected: []uint64{5, 6}, MigratedTo: []uint64{0, 1}, Fallbacks: map[string]uint64{"no_slot": 2}}, true
		}})
	for _, w := range reg.Table().Snapshot() {
		m.SetWorker(w)
	}

	w0 := reg.Table().Get(0)
	w0.Stats.Begin()
	w0.Stats.Begin()
	w0.Stats.End(true)
	w0.Stats.AddUp(10)
	w0.Stats.AddDown(20)
	st.Slot(1).Opened()
	pc.Requests.Add(3)
	pc.BadGateway.Add(1)
	pc.Buffers.Add(2)
	rt.Route(&httphead.Request{Path: []byte("/v1/chat/completions")}, nil) // spread
	m.Observe(0, 2, 20*time.Millisecond)
	m.Observe(0, 5, 2*time.Second)
	m.Observe(0, 0, time.Millisecond)
	m.Observe(7, 2, time.Millisecond)  // empty slot: ignored
	m.Observe(-1, 2, time.Millisecond) // out of range: ignored
	m.Observe(1, 9, time.Millisecond)  // bad class: "none"
	reg.Drain("1")

	body := scrape(t, m)
	u0, u1 := `url="http://127.0.0.1:9001"`, `url="http://127.0.0.1:9002"`
	has(t, body,
		`tether_worker_requests_total{slot="0",`+u0+`} 2`,
		`tether_worker_errors_total{slot="0",`+u0+`} 1`,
		`tether_worker_in_flight{slot="0",`+u0+`} 1`,
		`tether_worker_bytes_total{direction="up",slot="0",`+u0+`} 10`,
		`tether_worker_bytes_total{direction="down",slot="0",`+u0+`} 20`,
		`tether_worker_retries_total{reason="connect",slot="0",`+u0+`} 0`,
		`tether_worker_healthy{slot="1",`+u1+`} 1`,
		`tether_worker_state{slot="1",state="draining",`+u1+`} 1`,
		`tether_worker_state{slot="1",state="healthy",`+u1+`} 0`,
		`tether_workers{state="healthy"} 1`,
		`tether_workers{state="draining"} 1`,
		`tether_panic 0`,
		`tether_route_decisions_total{reason="spread"} 1`,
		`tether_route_decisions_total{reason="panic"} 0`,
		`tether_listener_connections_active{listener="1"} 1`,
		`tether_listener_connections_accepted_total{listener="1"} 1`,
		`tether_listener_selections_total{listener="1"} 6`,
		`tether_listener_migrations_total{listener="1"} 1`,
		`tether_steering_fallbacks_total{reason="no_slot"} 2`,
		`tether_proxy_requests_total 3`,
		`tether_proxy_errors_total{reason="bad_gateway"} 1`,
		`tether_proxy_buffers 2`,
		`tether_responses_total{code_class="2xx",slot="0",`+u0+`} 1`,
		`tether_responses_total{code_class="5xx",slot="0",`+u0+`} 1`,
		`tether_responses_total{code_class="none",slot="0",`+u0+`} 1`,
		`tether_responses_total{code_class="none",slot="1",`+u1+`} 1`,
		`tether_request_duration_seconds_count{slot="0",`+u0+`} 3`,
		`tether_request_duration_seconds_bucket{slot="0",`+u0+`,le="0.025"} 2`,
	)
	if strings.Contains(body, `listener="2"`) {
		t.Error("listener slots beyond those in use exported")
	}
	if t.Failed() {
		t.Log(body)
	}

	// Another url takes slot 1: its series replace the old ones.
	reg.Remove("1")
	reg.WaitRetired(t.Context(), 1)
	reg.Put(1, "http://127.0.0.1:9003", registry.OriginConfig)
	m.Observe(1, 2, time.Millisecond)
	body = scrape(t, m)
	if strings.Contains(body, u1) {
		t.Error("series of the removed worker still exported")
	}
	has(t, body, `tether_responses_total{code_class="2xx",slot="1",url="http://127.0.0.1:9003"} 1`)
}

func TestObserveDoesNotAllocate(t *testing.T) {
	m := New(Sources{})
	m.SetWorker(&worker.Worker{Slot: 3, URL: "http://127.0.0.1:1"})
	if n := testing.AllocsPerRun(1000, func() { m.Observe(3, 2, time.Millisecond) }); n != 0 {
		t.Fatalf("Observe allocates %v times", n)
	}
}

func BenchmarkObserve(b *testing.B) {
	m := New(Sources{})
	m.SetWorker(&worker.Worker{Slot: 3, URL: "http://127.0.0.1:1"})
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			m.Observe(3, 2, time.Millisecond)
		}
	})
}
