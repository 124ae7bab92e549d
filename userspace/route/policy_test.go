package route

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/worker"
)

// testWorkers returns a table of n workers with heap counters; URLs are
// http://10.0.0.<i>:30000 (distinct, as on a real cluster).
func testWorkers(t testing.TB, n int) (*worker.Table, *stats.Table) {
	t.Helper()
	st := stats.NewHeap()
	tab := worker.NewTable()
	for i := 0; i < n; i++ {
		tab.Put(testWorker(st, i))
	}
	return tab, st
}

func testWorker(st *stats.Table, slot int) *worker.Worker {
	return &worker.Worker{Slot: slot, URL: fmt.Sprintf("http://10.0.%d.%d:30000", slot/250, slot%250+1), Stats: st.Worker(slot)}
}

func testRouter(t testing.TB, tab *worker.Table, cfg PolicyConfig) *Router {
	t.Helper()
	p, err := NewPolicy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	rt := &Router{Table: tab}
	rt.SetPolicy(p)
	return rt
}

// parseReq parses a request head with the given extra header lines.
func parseReq(t testing.TB, target string, headers ...string) *httphead.Request {
	t.Helper()
	var b strings.Builder
	b.WriteString("POST " + target + " HTTP/1.1\r\nHost: x\r\n")
	for _, h := range headers {
		b.WriteString(h + "\r\n")
	}
	b.WriteString("\r\n")
	req := &httphead.Request{}
	if err := httphead.ParseRequest([]byte(b.String()), httphead.Limits{}, req); err != nil {
		t.Fatalf("parse %q: %v", b.String(), err)
	}
	return req
}

func keyReq(t testing.TB, key string) *httphead.Request {
	return parseReq(t, "/generate", "X-Session-ID: "+key)
}

func TestRoutingKey(t *testing.T) {
	p, err := NewPolicy(PolicyConfig{})
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		headers []string
		want    string
	}{
		{nil, ""},
		{[]string{"X-Session-ID: s1"}, "s1"},
		{[]string{"x-session-id: s1"}, "s1"},
		{[]string{"X-SMG-Routing-Key: r1"}, "r1"},
		{[]string{"x-smg-routing-key: r1"}, "r1"},
		// Order of the configured list wins over order in the request.
		{[]string{"X-SMG-Routing-Key: r1", "X-Session-ID: s1"}, "s1"},
		// Empty values are skipped: the next field of the name, then the
		// next header of the list.
		{[]string{"X-Session-ID:", "X-SMG-Routing-Key: r1"}, "r1"},
		{[]string{"X-Session-ID:   ", "X-Session-ID: s2"}, "s2"},
		{[]string{"X-Session-ID:", "X-SMG-Routing-Key:"}, ""},
		{[]string{"X-Session-IDx: s1"}, ""},
		{[]string{"X-SkyRL: 1", "X-SESSION-ID: abc:3"}, "abc:3"},
	}
	for _, c := range cases {
		got := string(p.RoutingKey(parseReq(t, "/generate", c.headers...)))
		if got != c.want {
			t.Errorf("%q: key %q, want %q", c.headers, got, c.want)
		}
	}

	// A configured list: its order, case-insensitive.
	p, err = NewPolicy(PolicyConfig{PolicySettings: PolicySettings{KeyHeaders: []string{"x-smg-routing-key", "X-Trajectory"}}})
	if err != nil {
		t.Fatal(err)
	}
	req := parseReq(t, "/generate", "X-Session-ID: s1", "X-TRAJECTORY: t1", "X-SMG-Routing-Key: r1")
	if got := string(p.RoutingKey(req)); got != "r1" {
		t.Errorf("custom list: %q, want r1", got)
	}
	req = parseReq(t, "/generate", "X-Session-ID: s1", "X-TRAJECTORY: t1")
	if got := string(p.RoutingKey(req)); got != "t1" {
		t.Errorf("custom list: %q, want t1", got)
	}
	if _, err := NewPolicy(PolicyConfig{PolicySettings: PolicySettings{KeyHeaders: []string{"bad header"}}}); err == nil {
		t.Error("invalid header name accepted")
	}
	if _, err := NewPolicy(PolicyConfig{PolicySettings: PolicySettings{LoadFactor: 0.5}}); err == nil {
		t.Error("load factor 0.5 accepted")
	}
	if _, err := NewPolicy(PolicyConfig{Kind: PolicySticky}); err == nil {
		t.Error("sticky without a table accepted")
	}
}

func TestKeyHashFixed(t *testing.T) {
	// The hash is part of the contract between tetherd processes and
	// hosts (and of the sticky map): it must never change.
	for _, c := range []struct {
		in   string
		want uint64
	}{
		// FNV-1a 64 + fmix64, checked against an independent Python
		// implementation.
		{"", 0xefd01f60ba992926},
		{"a", 0x82a2a958a9bece5b},
		{"sampling-7:3", 0xcf8b19a1b8cbb2cc},
	} {
		if got := KeyHashString(c.in); got != c.want {
			t.Errorf("KeyHashString(%q) = %#x, want %#x", c.in, got, c.want)
		}
		if got := KeyHash([]byte(c.in)); got != c.want {
			t.Errorf("KeyHash(%q) = %#x, want %#x", c.in, got, c.want)
		}
	}
	if KeyHashString("session-1:0") == KeyHashString("session-1:1") {
		t.Error("collision")
	}
}

// owners routes keys on an idle table and returns the slot of each.
func owners(t testing.TB, rt *Router, keys []string) []int {
	t.Helper()
	out := make([]int, len(keys))
	for i, k := range keys {
		d := rt.Route(keyReq(t, k), nil)
		if d.Worker == nil {
			t.Fatalf("key %q: no worker (%v)", k, d.Reason)
		}
		out[i] = d.Worker.Slot
	}
	return out
}

func sessionKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("sampling-%d:%d", i/16, i%16)
	}
	return keys
}

func TestHashDistribution(t *testing.T) {
	const n, nkeys = 8, 80000
	tab, _ := testWorkers(t, n)
	rt := testRouter(t, tab, PolicyConfig{})
	count := make([]int, n)
	for _, s := range owners(t, rt, sessionKeys(nkeys)) {
		count[s]++
	}
	mean := float64(nkeys) / n
	lo, hi := math.Inf(1), 0.0
	for _, c := range count {
		lo, hi = min(lo, float64(c)/mean), max(hi, float64(c)/mean)
	}
	t.Logf("keys per worker %v: min/mean %.3f max/mean %.3f", count, lo, hi)
	if lo < 0.8 || hi > 1.2 {
		t.Errorf("uneven: min/mean %.3f max/mean %.3f", lo, hi)
	}
	if got := rt.Count(ReasonHash); got != nkeys {
		t.Errorf("hash count %d, want %d", got, nkeys)
	}
}

func TestHashRemapOnAddRemove(t *testing.T) {
	const n, nkeys = 8, 40000
	keys := sessionKeys(nkeys)
	tab, st := testWorkers(t, n)
	rt := testRouter(t, tab, PolicyConfig{})
	before := owners(t, rt, keys)

	// Add a ninth worker: only keys moving to it move, about 1/9.
	tab.Put(testWorker(st, n))
	after := owners(t, rt, keys)
	moved := 0
	for i := range keys {
		if after[i] != before[i] {
			moved++
			if after[i] != n {
				t.Fatalf("key %q moved %d -> %d, not to the new worker", keys[i], before[i], after[i])
			}
		}
	}
	frac := float64(moved) / nkeys
	t.Logf("add 1 to %d workers: %.4f of keys moved (ideal %.4f)", n, frac, 1.0/(n+1))
	if frac < 0.5/(n+1) || frac > 1.5/(n+1) {
		t.Errorf("add: moved %.4f, want about %.4f", frac, 1.0/(n+1))
	}

	// Remove it again: exactly those keys come back.
	tab.Remove(n)
	back := owners(t, rt, keys)
	for i := range keys {
		if back[i] != before[i] {
			t.Fatalf("key %q: %d after remove, %d before add", keys[i], back[i], before[i])
		}
	}

	// Remove worker 3 of 8: only its keys move, about 1/8, to many workers.
	tab.Remove(3)
	gone := owners(t, rt, keys)
	moved = 0
	dest := map[int]int{}
	for i := range keys {
		if gone[i] != before[i] {
			moved++
			dest[gone[i]]++
			if before[i] != 3 {
				t.Fatalf("key %q moved %d -> %d, but its owner stayed", keys[i], before[i], gone[i])
			}
		} else if before[i] == 3 {
			t.Fatalf("key %q still on removed worker", keys[i])
		}
	}
	frac = float64(moved) / nkeys
	t.Logf("remove 1 of %d workers: %.4f of keys moved (ideal %.4f) to %d workers", n, frac, 1.0/n, len(dest))
	if frac < 0.5/n || frac > 1.5/n {
		t.Errorf("remove: moved %.4f, want about %.4f", frac, 1.0/n)
	}
	if len(dest) < n-2 {
		t.Errorf("removed worker's keys went to %d workers only: %v", len(dest), dest)
	}
}

// Two processes configured with the same workers, even in other slots,
// agree on the owner of every key.
func TestHashSameAcrossProcesses(t *testing.T) {
	keys := sessionKeys(2000)
	tabA, stA := testWorkers(t, 6)
	tabB := worker.NewTable()
	for i := 0; i < 6; i++ {
		w := testWorker(stA, i)
		w.Slot = 5 - i // reversed slots, same URLs
		tabB.Put(&worker.Worker{Slot: w.Slot, URL: w.URL, Stats: stats.NewHeap().Worker(w.Slot)})
	}
	a := owners(t, testRouter(t, tabA, PolicyConfig{}), keys)
	b := owners(t, testRouter(t, tabB, PolicyConfig{}), keys)
	for i := range keys {
		if tabA.Get(a[i]).URL != tabB.Get(b[i]).URL {
			t.Fatalf("key %q: %s vs %s", keys[i], tabA.Get(a[i]).URL, tabB.Get(b[i]).URL)
		}
	}
}

// A hot key (and a background of other keys) never puts a worker above
// both bounds: max(c × mean, mean + SpillMin) + 1 requests in flight.
func TestBoundedLoadHotKey(t *testing.T) {
	for _, tc := range []struct {
		c   float64
		abs int
	}{{1.25, -1}, {1.5, -1}, {2, -1}, {1.25, 8}, {1.25, DefaultSpillMin}} {
		c := tc.c
		abs := float64(max(tc.abs, 0))
		t.Run(fmt.Sprintf("c=%v,spill-min=%v", c, abs), func(t *testing.T) {
			const n = 8
			tab, _ := testWorkers(t, n)
			rt := testRouter(t, tab, PolicyConfig{PolicySettings: PolicySettings{LoadFactor: c, SpillMin: config.Some(max(tc.abs, 0))}})
			ws := tab.Snapshot()
			hot := keyReq(t, "hot-trajectory")
			owner := rt.CurrentPolicy().Owner(ws, KeyHashString("hot-trajectory"))
			worst := 0.0
			total := 0
			for i := 0; i < 4000; i++ {
				req := hot
				if i%4 == 3 {
					req = keyReq(t, fmt.Sprintf("cold-%d", i))
				}
				d := rt.Route(req, nil)
				d.Worker.Stats.Begin()
				total++
				mean := float64(total) / n
				for _, w := range ws {
					l := float64(w.Stats.Pending())
					if bound := max(c*mean, mean+abs) + 1; l > bound {
						t.Fatalf("after %d requests worker %d has %v in flight > max(c×mean, mean+%v)+1 = %.2f", total, w.Slot, l, abs, bound)
					}
					if total >= 4*n {
						worst = max(worst, l/mean)
					}
				}
				// End some requests now and then, as a real load would.
				if i%7 == 6 {
					w := ws[(i/7)%n]
					if w.Stats.Pending() > 0 {
						w.Stats.End(false)
						total--
					}
				}
			}
			loads := make([]uint64, n)
			for i, w := range ws {
				loads[i] = w.Stats.Pending()
			}
			mean := float64(total) / n
			maxl := slicesMax(loads)
			t.Logf("c=%v spill-min=%v: hot key owner %d, final loads %v, max/mean %.3f (bound %.3f), worst max/mean once 4 per worker %.3f, spills %d",
				c, abs, owner, loads, float64(maxl)/mean, max(c, 1+abs/mean)+1/mean, worst, rt.Count(ReasonHashSpill))
			if rt.Count(ReasonHashSpill) == 0 {
				t.Error("hot key never spilled")
			}
		})
	}
}

func slicesMax(s []uint64) uint64 {
	var m uint64
	for _, v := range s {
		m = max(m, v)
	}
	return m
}

// An unhealthy or draining owner hands each of its keys to that key's ring
// successor (many workers, not one), and gets them back when it recovers.
func TestHashFailoverAndReturn(t *testing.T) {
	const n = 8
	keys := sessionKeys(8000)
	tab, _ := testWorkers(t, n)
	rt := testRouter(t, tab, PolicyConfig{})
	before := owners(t, rt, keys)
	for _, st := range []worker.State{worker.Unhealthy, worker.Draining} {
		victim := tab.Get(2)
		victim.SetState(st)
		during := owners(t, rt, keys)
		dest := map[int]int{}
		for i := range keys {
			switch {
			case before[i] == 2:
				if during[i] == 2 {
					t.Fatalf("%v: key %q stayed on worker 2", st, keys[i])
				}
				dest[during[i]]++
				// The successor is what the ring says without worker 2.
			case during[i] != before[i]:
				t.Fatalf("%v: key %q of a live worker moved %d -> %d", st, keys[i], before[i], during[i])
			}
		}
		t.Logf("%v worker 2: its keys went to %d workers: %v", st, len(dest), dest)
		if len(dest) < n-3 || dest[0] > (len(keys)/n)/2 {
			t.Errorf("%v: keys dogpiled: %v", st, dest)
		}
		if rt.Count(ReasonHashFailover) == 0 {
			t.Errorf("%v: no failover counted", st)
		}
		// The successor matches a table without worker 2.
		tab2, _ := testWorkers(t, n)
		tab2.Remove(2)
		want := owners(t, testRouter(t, tab2, PolicyConfig{}), keys)
		for i := range keys {
			if during[i] != want[i] {
				t.Fatalf("%v: key %q went to %d, ring successor is %d", st, keys[i], during[i], want[i])
			}
		}
		victim.SetState(worker.Healthy)
		after := owners(t, rt, keys)
		for i := range keys {
			if after[i] != before[i] {
				t.Fatalf("%v: key %q did not come back: %d, was %d", st, keys[i], after[i], before[i])
			}
		}
	}
	// Everyone unhealthy: panic rule, the ring owner.
	for _, w := range tab.Snapshot() {
		w.SetState(worker.Unhealthy)
	}
	if d := rt.Route(keyReq(t, keys[0]), nil); d.Worker == nil || d.Worker.Slot != before[0] || d.Reason != ReasonPanic {
		t.Errorf("all unhealthy: %+v", d)
	}
	for _, w := range tab.Snapshot() {
		w.SetState(worker.Draining)
	}
	if d := rt.Route(keyReq(t, keys[0]), nil); d.Status != 503 {
		t.Errorf("all draining: %+v", d)
	}
}

func TestTargetWorkerAndSessionPrecedence(t *testing.T) {
	tab, _ := testWorkers(t, 4)
	rt := testRouter(t, tab, PolicyConfig{})
	for _, c := range []struct {
		target, hdr string
		slot        int // -1: status 400
	}{
		{"/generate", "X-SMG-Target-Worker: 2", 2},
		{"/generate", "x-smg-target-worker: 0", 0},
		{"/generate", "X-SMG-Target-Worker: 4", -1},
		{"/generate", "X-SMG-Target-Worker: -1", -1},
		{"/generate", "X-SMG-Target-Worker: two", -1},
		{"/generate", "X-SMG-Target-Worker: " + tab.Get(3).URL, 3},
		// The session path rule keeps precedence over target and key.
		{"/sessions/w1-abc/v1/chat/completions", "X-SMG-Target-Worker: 2", 1},
	} {
		d := rt.Route(parseReq(t, c.target, c.hdr, "X-Session-ID: k"), nil)
		if c.slot < 0 {
			if d.Worker != nil || d.Status != 400 || d.Reason != ReasonBadTarget {
				t.Errorf("%s %s: %+v, want 400", c.target, c.hdr, d)
			}
			continue
		}
		if d.Worker == nil || d.Worker.Slot != c.slot {
			t.Errorf("%s %s: %+v, want slot %d", c.target, c.hdr, d, c.slot)
		}
	}
	// Session path beats the key too.
	for i := 0; i < 20; i++ {
		d := rt.Route(parseReq(t, "/sessions/w3-abc/x", "X-Session-ID: "+fmt.Sprint(i)), nil)
		if d.Worker.Slot != 3 || d.Reason != ReasonSession {
			t.Fatalf("session path: %+v", d)
		}
	}
	// A draining target is still honoured (an explicit pin).
	tab.Get(1).SetState(worker.Draining)
	if d := rt.Route(parseReq(t, "/generate", "X-SMG-Target-Worker: 1"), nil); d.Worker == nil || d.Worker.Slot != 1 {
		t.Errorf("draining target: %+v", d)
	}
}

func TestKeylessPowerOfTwo(t *testing.T) {
	const n = 4
	tab, _ := testWorkers(t, n)
	rt := testRouter(t, tab, PolicyConfig{})
	ws := tab.Snapshot()
	// Worker 0 is busy: p2c sends it only what pairs it with... nothing:
	// its partner is always less loaded.
	for i := 0; i < 50; i++ {
		ws[0].Stats.Begin()
	}
	req := parseReq(t, "/v1/chat/completions")
	hits := make([]int, n)
	for i := 0; i < 3000; i++ {
		d := rt.Route(req, nil)
		if d.Reason != ReasonSpread {
			t.Fatalf("reason %v", d.Reason)
		}
		hits[d.Worker.Slot]++
		d.Worker.Stats.Begin()
		d.Worker.Stats.End(false)
	}
	t.Logf("keyless hits with worker 0 busy: %v", hits)
	if hits[0] != 0 {
		t.Errorf("busy worker got %d", hits[0])
	}
	for i := 1; i < n; i++ {
		if hits[i] < 600 {
			t.Errorf("worker %d got %d of 3000", i, hits[i])
		}
	}
	// Unhealthy workers are never picked while others are healthy.
	ws[1].SetState(worker.Unhealthy)
	ws[2].SetState(worker.Draining)
	for i := 0; i < 200; i++ {
		if d := rt.Route(req, nil); d.Worker.Slot == 1 || d.Worker.Slot == 2 {
			t.Fatalf("picked %v worker %d", d.Worker.State(), d.Worker.Slot)
		}
	}
}

func TestKeylessPrefix(t *testing.T) {
	const n = 8
	tab, _ := testWorkers(t, n)
	rt := testRouter(t, tab, PolicyConfig{Keyless: KeylessPrefix, PrefixBytes: 64})
	req := parseReq(t, "/generate", "Content-Length: 100")
	prompt := func(p, rid int) []byte {
		return []byte(fmt.Sprintf(`{"rid": "sample-%d-%d", "text": "prompt %d: %s", "sampling_params": {}}`, p, rid, p, strings.Repeat("x", 80)))
	}
	// The samples of a group share a worker; groups spread.
	used := map[int]bool{}
	for p := 0; p < 64; p++ {
		first := rt.Route(req, prompt(p, 0))
		if first.Reason != ReasonPrefix {
			t.Fatalf("reason %v", first.Reason)
		}
		used[first.Worker.Slot] = true
		for s := 1; s < 8; s++ {
			if d := rt.Route(req, prompt(p, s)); d.Worker != first.Worker {
				t.Fatalf("group %d sample %d on %d, sample 0 on %d", p, s, d.Worker.Slot, first.Worker.Slot)
			}
		}
	}
	if len(used) < n-2 {
		t.Errorf("64 groups on %d workers only", len(used))
	}
	// Only the first PrefixBytes count.
	a := PrefixHash([]byte(`{"text":"same start`))
	if a != PrefixHash([]byte(`{"text":"same start`)) {
		t.Error("not deterministic")
	}
	if PrefixHash([]byte(`{"rid":"a","x":1}`)) != PrefixHash([]byte(`{"rid":"bbbb","x":1}`)) {
		t.Error("rid not ignored")
	}
	if PrefixHash([]byte(`{"request_id": "a", "x":1}`)) != PrefixHash([]byte(`{"request_id": "b\"c", "x":1}`)) {
		t.Error("request_id not ignored")
	}
	if PrefixHash([]byte(`{"rid":"a","x":1}`)) == PrefixHash([]byte(`{"rid":"a","x":2}`)) {
		t.Error("body ignored")
	}
	// No body: power of two.
	if d := rt.Route(req, nil); d.Reason != ReasonSpread {
		t.Errorf("no body: %v", d.Reason)
	}
}

func TestPolicyAllocations(t *testing.T) {
	tab, _ := testWorkers(t, 8)
	rt := testRouter(t, tab, PolicyConfig{})
	keyless := parseReq(t, "/v1/chat/completions", "Content-Type: application/json", "User-Agent: x")
	keyed := keyReq(t, "sampling-1:2")
	rt.Route(keyed, nil) // build the ring
	for name, req := range map[string]*httphead.Request{"keyless": keyless, "keyed": keyed} {
		if a := testing.AllocsPerRun(1000, func() { rt.Route(req, nil) }); a != 0 {
			t.Errorf("%s: %v allocations per request", name, a)
		}
	}
	rtp := testRouter(t, tab, PolicyConfig{Keyless: KeylessPrefix})
	body := []byte(`{"rid":"r1","text":"hello"}`)
	rtp.Route(keyless, body)
	if a := testing.AllocsPerRun(1000, func() { rtp.Route(keyless, body) }); a != 0 {
		t.Errorf("prefix: %v allocations per request", a)
	}
}

func BenchmarkRouteKeyed(b *testing.B) {
	tab, _ := testWorkers(b, 16)
	rt := testRouter(b, tab, PolicyConfig{})
	req := keyReq(b, "sampling-1:2")
	b.ReportAllocs()
	for b.Loop() {
		rt.Route(req, nil)
	}
}

func BenchmarkRouteKeyless(b *testing.B) {
	tab, _ := testWorkers(b, 16)
	rt := testRouter(b, tab, PolicyConfig{})
	req := parseReq(b, "/v1/chat/completions")
	b.ReportAllocs()
	for b.Loop() {
		rt.Route(req, nil)
	}
}
