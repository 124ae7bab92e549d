package route

import (
	"testing"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

func TestSessionSlot(t *testing.T) {
	for _, tc := range []struct {
		id   string
		slot int
		ok   bool
	}{
		{"w0-abc", 0, true},
		{"w3-0123456789abcdef0123456789abcdef", 3, true},
		{"w17-x", 17, true},
		{"w999999-x", 999999, true},
		{"w01-abc", 0, false},    // leading zero
		{"w00-abc", 0, false},    // leading zero
		{"w-abc", 0, false},      // no digits
		{"w+1-abc", 0, false},    // sign
		{"w1-", 0, false},        // empty rest
		{"w1abc", 0, false},      // no dash
		{"x1-abc", 0, false},     // no w
		{"W1-abc", 0, false},     // case matters
		{"w1000000-x", 0, false}, // beyond any slot
		{"", 0, false},
	} {
		slot, ok := SessionSlot([]byte(tc.id))
		if ok != tc.ok || ok && slot != tc.slot {
			t.Errorf("SessionSlot(%q) = %d, %v; want %d, %v", tc.id, slot, ok, tc.slot, tc.ok)
		}
	}
}

func TestSessionID(t *testing.T) {
	for _, tc := range []struct {
		path, id string
		ok       bool
	}{
		{"/sessions/w1-a", "w1-a", true},
		{"/sessions/w1-a/v1/chat/completions", "w1-a", true},
		{"/sessions/w1-a?x=1", "w1-a", true},
		{"/sessions", "", false},
		{"/sessions/", "", false},
		{"/sessionsx/w1-a", "", false},
		{"/v1/sessions/w1-a", "", false},
	} {
		id, ok := SessionID([]byte(tc.path))
		if ok != tc.ok || string(id) != tc.id {
			t.Errorf("SessionID(%q) = %q, %v", tc.path, id, ok)
		}
	}
}

func newTable(n int) (*worker.Table, *stats.Table) {
	st := stats.NewHeap()
	tab := worker.NewTable()
	for i := 0; i < n; i++ {
		tab.Put(&worker.Worker{Slot: i, Stats: st.Worker(i)})
	}
	return tab, st
}

func TestSpreadRotatesAndPrefersIdle(t *testing.T) {
	tab, st := newTable(4)
	rt := &Router{Table: tab}
	req := &httphead.Request{Path: []byte("/v1/chat/completions")}
	hits := make([]int, 4)
	for i := 0; i < 400; i++ {
		hits[rt.Route(req, nil).Worker.Slot]++
	}
	for i, h := range hits {
		if h != 100 {
			t.Fatalf("idle workers: slot %d got %d of 400, want an even rotation %v", i, h, hits)
		}
	}
	// A loaded worker is avoided.
	st.Worker(0).Begin()
	st.Worker(1).Begin()
	st.Worker(2).Begin()
	for i := 0; i < 10; i++ {
		if d := rt.Route(req, nil); d.Worker.Slot != 3 {
			t.Fatalf("routed to loaded slot %d", d.Worker.Slot)
		}
	}
	if rt.Count(ReasonSpread) != 410 {
		t.Fatalf("spread count %d", rt.Count(ReasonSpread))
	}
}

func TestPanicAndDraining(t *testing.T) {
	tab, _ := newTable(3)
	rt := &Router{Table: tab}
	req := &httphead.Request{Path: []byte("/x")}
	tab.Get(0).SetState(worker.Draining)
	tab.Get(1).SetState(worker.Unhealthy)
	if d := rt.Route(req, nil); d.Worker.Slot != 2 {
		t.Fatalf("routed to slot %d, want the only healthy one", d.Worker.Slot)
	}
	tab.Get(2).SetState(worker.Unhealthy)
	d := rt.Route(req, nil)
	if d.Worker == nil || d.Reason != ReasonPanic || d.Worker.Slot == 0 {
		t.Fatalf("all unhealthy: %+v, want panic routing among the unhealthy, never the draining", d)
	}
	// Sessions still reach a draining worker.
	if d := rt.Route(&httphead.Request{Path: []byte("/sessions/w0-abc")}, nil); d.Worker == nil || d.Worker.Slot != 0 {
		t.Fatalf("session of a draining worker: %+v", d)
	}
	tab.Get(1).SetState(worker.Draining)
	tab.Get(2).SetState(worker.Draining)
	if d := rt.Route(req, nil); d.Status != 503 {
		t.Fatalf("every worker draining: %+v, want 503", d)
	}
}

func TestBadSessionModes(t *testing.T) {
	tab, _ := newTable(2)
	req := &httphead.Request{Path: []byte("/sessions/w5-abc/x")}
	rt := &Router{Table: tab}
	if d := rt.Route(req, nil); d.Worker == nil || rt.Count(ReasonBadSessionSpread) != 1 {
		t.Fatalf("spread mode: %+v", d)
	}
	rt.SetBadSession(BadSessionReject)
	if d := rt.Route(req, nil); d.Status != 404 || rt.Count(ReasonBadSessionReject) != 1 {
		t.Fatalf("reject mode: %+v", d)
	}
}

func BenchmarkRouteSession(b *testing.B) {
	tab, _ := newTable(8)
	rt := &Router{Table: tab}
	req := &httphead.Request{Path: []byte("/sessions/w5-0123456789abcdef0123456789abcdef/v1/chat/completions")}
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		rt.Route(req, nil)
	}
}

func TestKeylessModes(t *testing.T) {
	req := &httphead.Request{Path: []byte("/generate")}
	for _, tc := range []struct {
		mode KeylessMode
		even bool // idle workers get an exact rotation
	}{
		{KeylessLeast, true},
		{KeylessP2C, false},
	} {
		t.Run(tc.mode.String(), func(t *testing.T) {
			tab, _ := newTable(4)
			p, err := NewPolicy(PolicyConfig{Keyless: tc.mode})
			if err != nil {
				t.Fatal(err)
			}
			rt := &Router{Table: tab}
			rt.SetPolicy(p)
			hits := make([]int, 4)
			for i := 0; i < 400; i++ {
				hits[rt.Route(req, nil).Worker.Slot]++
			}
			for slot, h := range hits {
				if tc.even && h != 100 || h < 50 {
					t.Fatalf("slot %d got %d of 400: %v", slot, h, hits)
				}
			}
		})
	}
}

// Every decision is counted for the worker it chose, by reason.
func TestDecisionsPerWorker(t *testing.T) {
	tab, _ := newTable(3)
	rt := &Router{Table: tab}
	for i := 0; i < 4; i++ {
		if d := rt.Route(parseReq(t, "/sessions/w1-abc/turn"), nil); d.Worker == nil || d.Worker.Slot != 1 {
			t.Fatalf("session decision: %+v", d)
		}
	}
	for i := 0; i < 3; i++ {
		rt.Route(parseReq(t, "/generate"), nil)
	}
	if got := Decisions(tab.Get(1))["session"]; got != 4 {
		t.Fatalf("worker 1: %d session decisions, want 4 (%v)", got, Decisions(tab.Get(1)))
	}
	var spread uint64
	for i := 0; i < 3; i++ {
		spread += Decisions(tab.Get(i))["spread"]
	}
	if spread != 3 || rt.Count(ReasonSpread) != 3 {
		t.Fatalf("spread decisions per worker sum to %d, router counted %d; want 3", spread, rt.Count(ReasonSpread))
	}
	if Decisions(tab.Get(0))["session"] != 0 {
		t.Fatal("a session decision counted for a worker it did not choose")
	}
}
