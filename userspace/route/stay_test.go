package route

import (
	"fmt"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// putLoad puts n requests in flight on w (test counters).
func putLoad(w *worker.Worker, n int) {
	for i := 0; i < n; i++ {
		w.Stats.Begin()
	}
}

// unload ends all of w's requests in flight.
func unload(w *worker.Worker) {
	for w.Stats.Pending() > 0 {
		w.Stats.End(false)
	}
}

// At light and moderate load, keys never leave their ring owner: 256 keys
// with one request in flight each over 8 workers (mean 32, the worst
// worker ~45), 5 turns each, every turn on the first turn's worker and no
// spill at all. With the relative bound alone (spill-min 0: the old rule)
// the same load spills keys off their owners: that is what the absolute
// bound is for.
func TestNoSpillBelowAbsoluteBound(t *testing.T) {
	for _, tc := range []struct {
		spillMin   config.Optional[int]
		wantSpills bool
	}{{config.Optional[int]{}, false}, {config.Some(0), true}} {
		t.Run(fmt.Sprint("spill-min=", tc.spillMin), func(t *testing.T) {
			const n, keys, turns = 8, 256, 5
			tab, _ := testWorkers(t, n)
			rt := testRouter(t, tab, PolicyConfig{PolicySettings: PolicySettings{SpillMin: tc.spillMin}, Sticky: sticky.NewMemory(0)})
			first := make([]*worker.Worker, keys)
			moved := 0
			for turn := 0; turn < turns; turn++ {
				var inflight []*worker.Worker
				for k := 0; k < keys; k++ {
					d := rt.Route(keyReq(t, fmt.Sprintf("traj-%d", k)), nil)
					d.Worker.Stats.Begin() // every key has its turn in flight at once
					inflight = append(inflight, d.Worker)
					if turn == 0 {
						first[k] = d.Worker
					} else if d.Worker != first[k] {
						moved++
					}
				}
				for _, w := range inflight {
					w.Stats.End(false)
				}
			}
			spills := rt.Count(ReasonHashSpill)
			t.Logf("spill-min %v: %d of %d later turns moved; spills %d, kept on their spill target %d", tc.spillMin, moved, keys*(turns-1), spills, rt.Count(ReasonHashSpilled))
			if got := spills > 0; got != tc.wantSpills {
				t.Errorf("%d spills, want spills: %v", spills, tc.wantSpills)
			}
			if !tc.wantSpills && moved > 0 {
				t.Errorf("%d turns moved", moved)
			}
		})
	}
}

// A key that spills keeps going to its spill target while the owner stays
// overloaded (no bouncing as loads move), stays there while the owner is
// between the bounds of the way back and the way out (hysteresis), and
// returns once it is below them; spills and returns are counted.
func TestSpillRememberedThenReturns(t *testing.T) {
	for name, newTable := range stickyTables(t) {
		t.Run(name, func(t *testing.T) {
			const n = 4
			tab, _ := testWorkers(t, n)
			ws := tab.Snapshot()
			clock := sticky.Now()
			rt := testRouter(t, tab, PolicyConfig{PolicySettings: PolicySettings{SpillMin: config.Some(8)}, Sticky: newTable(), Now: func() int64 { return clock }})
			const key = "traj-hot"
			p := rt.CurrentPolicy()
			owner := ws[p.Owner(ws, KeyHashString(key))]
			route := func() Decision {
				t.Helper()
				d := rt.Route(keyReq(t, key), nil)
				if d.Worker == nil {
					t.Fatalf("%+v", d)
				}
				return d
			}
			if d := route(); d.Worker != owner || d.Reason != ReasonHash {
				t.Fatalf("idle: %+v, want owner %d", d, owner.Slot)
			}
			// Owner at 40, others idle: mean after = 41/4 = 10.25; 41 >
			// 1.25×10.25 and > 10.25+8: spill.
			putLoad(owner, 40)
			d := route()
			if d.Worker == owner || d.Reason != ReasonHashSpill {
				t.Fatalf("overloaded owner: %+v", d)
			}
			target := d.Worker
			// The other workers' loads move: the key stays on its target
			// (without memory it would go to whichever successor is free).
			for _, w := range ws {
				if w != owner && w != target {
					putLoad(w, 7)
				}
			}
			for i := 0; i < 10; i++ {
				if d := route(); d.Worker != target || d.Reason != ReasonHashSpilled {
					t.Fatalf("turn %d while owner overloaded: %+v, want spill target %d", i, d, target.Slot)
				}
			}
			// Owner down to a load between the bounds: with 14 in flight
			// elsewhere, owner L is overloaded from L = 15 (L+1 > mean+8)
			// and back under the way-back bounds below L = 10 (L+1 <=
			// mean+4).
			unload(owner)
			putLoad(owner, 12)
			l := loadOf(ws)
			if p.overloaded(owner, l, false) || !p.overloaded(owner, l, true) {
				t.Fatalf("test setup: owner at 12 should be between the bounds (loads %+v)", l)
			}
			if d := route(); d.Worker != target || d.Reason != ReasonHashSpilled {
				t.Fatalf("owner between the bounds: %+v, want still on target %d", d, target.Slot)
			}
			// Below the way-back bound: the key returns, once.
			unload(owner)
			putLoad(owner, 9)
			if d := route(); d.Worker != owner || d.Reason != ReasonHashReturn {
				t.Fatalf("owner relieved: %+v, want return to %d", d, owner.Slot)
			}
			if d := route(); d.Worker != owner || d.Reason != ReasonHash {
				t.Fatalf("after return: %+v", d)
			}
			if rt.Count(ReasonHashSpill) != 1 || rt.Count(ReasonHashReturn) != 1 {
				t.Errorf("spills %d returns %d, want 1 and 1", rt.Count(ReasonHashSpill), rt.Count(ReasonHashReturn))
			}
			// A remembered spill expires: overloaded again later, the key
			// spills anew (and is counted anew).
			putLoad(owner, 40)
			route()
			clock += int64(3 * time.Minute)
			unload(owner)
			if d := route(); d.Worker != owner || d.Reason != ReasonHash {
				t.Fatalf("after the spill TTL: %+v", d)
			}
		})
	}
}

// A worker at its max_in_flight takes no new keys: its keys spill even at
// light load, and come back when it has room.
func TestCapacitySpills(t *testing.T) {
	tab, _ := testWorkers(t, 4)
	ws := tab.Snapshot()
	rt := testRouter(t, tab, PolicyConfig{Sticky: sticky.NewMemory(0)})
	const key = "traj-cap"
	owner := ws[rt.CurrentPolicy().Owner(ws, KeyHashString(key))]
	owner.SetMaxInFlight(2)
	putLoad(owner, 2)
	d := rt.Route(keyReq(t, key), nil)
	if d.Worker == owner || d.Reason != ReasonHashSpill {
		t.Fatalf("owner at capacity: %+v", d)
	}
	target := d.Worker
	owner.Stats.End(false) // 1 in flight: not below the way back (capacity minus an eighth, at least 1)
	if d := rt.Route(keyReq(t, key), nil); d.Worker != target || d.Reason != ReasonHashSpilled {
		t.Fatalf("owner one below capacity: %+v, want still spilled", d)
	}
	unload(owner)
	if d := rt.Route(keyReq(t, key), nil); d.Worker != owner || d.Reason != ReasonHashReturn {
		t.Fatalf("owner with room: %+v", d)
	}
	// Sticky policy: a new key skips a full worker; a known key stays.
	owner.SetMaxInFlight(1)
	st := testRouter(t, tab, PolicyConfig{Kind: PolicySticky, Sticky: sticky.NewMemory(0)})
	putLoad(owner, 1)
	for i := 0; i < 20; i++ {
		if d := st.Route(keyReq(t, fmt.Sprint("new-", i)), nil); d.Worker == owner {
			t.Fatalf("new key %d went to the full worker", i)
		}
	}
}

// Entries name their worker, not its slot: a worker added into a removed
// worker's slot inherits none of its keys, and the same worker in another
// slot (a restart with --worker in another order) keeps them.
func TestEntriesNameTheirWorker(t *testing.T) {
	for name, newTable := range stickyTables(t) {
		t.Run(name, func(t *testing.T) {
			st := newTable()
			tab, stats := testWorkers(t, 4)
			rt := testRouter(t, tab, PolicyConfig{Kind: PolicySticky, Sticky: st})
			keys := map[string]string{} // key -> worker URL
			for i := 0; i < 20; i++ {
				k := fmt.Sprint("k", i)
				keys[k] = rt.Route(keyReq(t, k), nil).Worker.URL
			}
			// Restart with the same workers in reverse order: every key
			// finds its worker.
			rev := worker.NewTable()
			for i, w := range tab.Snapshot() {
				rev.Put(&worker.Worker{Slot: 3 - i, URL: w.URL, Stats: stats.Worker(3 - i)})
			}
			rt2 := testRouter(t, rev, PolicyConfig{Kind: PolicySticky, Sticky: st})
			for k, u := range keys {
				if d := rt2.Route(keyReq(t, k), nil); d.Worker.URL != u || d.Reason != ReasonSticky {
					t.Fatalf("key %s after reorder: %s (%v), want %s", k, d.Worker.URL, d.Reason, u)
				}
			}
			// Slot 0 now holds a new worker: slot 0's keys are placed anew.
			tab.Put(&worker.Worker{Slot: 0, URL: "http://10.9.9.9:1", Stats: stats.Worker(0)})
			old := tab.Get(0)
			for k, u := range keys {
				d := rt.Route(keyReq(t, k), nil)
				if u == "http://10.0.0.1:30000" { // slot 0's old worker
					if d.Reason != ReasonStickyFailover {
						t.Fatalf("key %s of the replaced worker: %v to %s", k, d.Reason, d.Worker.URL)
					}
				} else if d.Worker.URL != u {
					t.Fatalf("key %s moved from %s to %s", k, u, d.Worker.URL)
				}
			}
			_ = old
		})
	}
}

// parseReqMethod parses a bodyless request head.
func parseReqMethod(t testing.TB, method, target string) *httphead.Request {
	t.Helper()
	req := &httphead.Request{}
	if err := httphead.ParseRequest([]byte(method+" "+target+" HTTP/1.1\r\nHost: x\r\n\r\n"), httphead.Limits{}, req); err != nil {
		t.Fatal(err)
	}
	return req
}

// A fake response: what the proxy shows a Learner.
func respond(t *testing.T, d Decision, status int, body ...string) {
	t.Helper()
	if d.Learn == nil {
		t.Fatalf("no learner on %+v", d)
	}
	if d.Learn.Status(status) {
		for _, b := range body {
			if !d.Learn.Body([]byte(b)) {
				break
			}
		}
	}
	d.Learn.End()
}

func TestLearnedSessions(t *testing.T) {
	for name, newTable := range stickyTables(t) {
		t.Run(name, func(t *testing.T) {
			tab, stats := testWorkers(t, 4)
			st := newTable()
			rt := testRouter(t, tab, PolicyConfig{Sticky: st})
			l, err := NewLearning(LearnConfig{Table: st})
			if err != nil {
				t.Fatal(err)
			}
			rt.SetLearning(l)
			create := func() Decision { return rt.Route(parseReq(t, "/sessions"), nil) }
			turn := func(id string) Decision { return rt.Route(parseReq(t, "/sessions/"+id+"/v1/chat/completions"), nil) }

			ids := map[string]*worker.Worker{}
			for i := 0; i < 16; i++ {
				d := create()
				id := fmt.Sprintf("3f2a9c1e-4b7d-4e21-9a0b-%012d", i)
				// Split anywhere: the id is learned from the pieces.
				body := fmt.Sprintf(`{"session_id": "%s", "worker": %d}`, id, d.Worker.Slot)
				cut := 5 + i*3
				respond(t, d, 201, body[:cut], body[cut:])
				ids[id] = d.Worker
			}
			if c := l.Counts(); c.Learned != 16 || c.NoID != 0 {
				t.Fatalf("counts %+v", c)
			}
			for id, w := range ids {
				for i := 0; i < 3; i++ {
					if d := turn(id); d.Worker != w || d.Reason != ReasonLearned {
						t.Fatalf("turn of %s: %+v, want worker %d", id, d, w.Slot)
					}
				}
			}
			// A learned session follows its worker to another slot; a new
			// worker in its slot does not inherit it.
			var id0 string
			for id, w := range ids {
				if w.Slot == 0 {
					id0 = id
					break
				}
			}
			if id0 != "" {
				moved := &worker.Worker{Slot: 7, URL: tab.Get(0).URL, Stats: stats.Worker(7)}
				tab.Put(&worker.Worker{Slot: 0, URL: "http://10.9.9.9:1", Stats: stats.Worker(0)})
				if d := turn(id0); d.Worker == tab.Get(0) {
					t.Fatalf("new worker in slot 0 inherited %s", id0)
				}
				tab.Put(moved)
				if d := turn(id0); d.Worker != moved || d.Reason != ReasonLearned {
					t.Fatalf("moved worker: %+v", d)
				}
			}
			// An id never learned follows --bad-session.
			if d := turn("never-seen"); d.Reason != ReasonBadSessionSpread {
				t.Fatalf("unknown id: %+v", d)
			}
			rt.SetBadSession(BadSessionReject)
			if d := turn("never-seen"); d.Status != 404 {
				t.Fatalf("unknown id, reject: %+v", d)
			}
			// Failed creates and answers without an id learn nothing.
			respond(t, create(), 500, `{"session_id":"failed-one"}`)
			respond(t, create(), 201, `{"id":"other-field"}`)
			respond(t, create(), 201, `not json`)
			if d := turn("failed-one"); d.Status != 404 {
				t.Fatalf("id of a 500: %+v", d)
			}
			if c := l.Counts(); c.NoID != 2 {
				t.Errorf("no_id %d, want 2", c.NoID)
			}
			// DELETE forgets once the worker answered it; a failed DELETE
			// does not.
			var id string
			for id = range ids {
				if ids[id].Slot != 0 { // slot 0's worker moved above
					break
				}
			}
			del := rt.Route(parseReqMethod(t, "DELETE", "/sessions/"+id), nil)
			if del.Worker != ids[id] {
				t.Fatalf("delete: %+v", del)
			}
			respond(t, del, 503)
			if d := turn(id); d.Reason != ReasonLearned {
				t.Fatalf("after a failed delete: %+v", d)
			}
			respond(t, rt.Route(parseReqMethod(t, "DELETE", "/sessions/"+id), nil), 200, `{"deleted":true}`)
			if d := turn(id); d.Status != 404 {
				t.Fatalf("after delete: %+v", d)
			}
			if c := l.Counts(); c.Forgotten != 1 {
				t.Errorf("forgotten %d, want 1", c.Forgotten)
			}
			// A sub-path DELETE is a turn, not the end of the session.
			other := ""
			for o := range ids {
				if o != id && ids[o].Slot != 0 {
					other = o
					break
				}
			}
			if d := rt.Route(parseReqMethod(t, "DELETE", "/sessions/"+other+"/files/x"), nil); d.Learn != nil {
				t.Fatalf("sub-path delete has a learner")
			}
			// w<idx>- ids are routed by slot and not stored.
			respond(t, create(), 201, `{"session_id":"w2-abc"}`)
			if c := l.Counts(); c.Learned != 16 {
				t.Errorf("a w<idx>- id was stored: %+v", c)
			}
		})
	}
}

// The learned entry is stored before the answer's bytes are relayed: the
// Body call that completes the id stores it.
func TestLearnedBeforeRelay(t *testing.T) {
	tab, _ := testWorkers(t, 2)
	st := sticky.NewMemory(0)
	rt := testRouter(t, tab, PolicyConfig{Sticky: st})
	l, _ := NewLearning(LearnConfig{Table: st, LearnSettings: LearnSettings{IDField: "id", CreatePath: "/v2/sessions"}})
	rt.SetLearning(l)
	d := rt.Route(parseReq(t, "/v2/sessions?x=1"), nil)
	if !d.Learn.Status(200) || d.Learn.Body([]byte(`{"id":"abc-1"}`)) {
		t.Fatal("learner wants more after the id")
	}
	if got := rt.Route(parseReq(t, "/sessions/abc-1/x"), nil); got.Worker != d.Worker || got.Reason != ReasonLearned {
		t.Fatalf("before End: %+v", got)
	}
	d.Learn.End()
	// The prefix read is bounded: an id beyond MaxScan is not found.
	d = rt.Route(parseReq(t, "/v2/sessions"), nil)
	d.Learn.Status(200)
	pad := make([]byte, DefaultLearnScan)
	for i := range pad {
		pad[i] = ' '
	}
	pad[0] = '{'
	if d.Learn.Body(pad) {
		t.Fatal("learner wants more than MaxScan bytes")
	}
	d.Learn.End()
	if c := l.Counts(); c.Learned != 1 || c.NoID != 1 {
		t.Fatalf("counts %+v", c)
	}
}
