package route

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// engineRouter returns a router over n workers whose engines all report
// an idle load, with engine placement on.
func engineRouter(t testing.TB, n int, kind PolicyKind, ec EngineConfig) (*Router, []*worker.Worker) {
	t.Helper()
	tab, _ := testWorkers(t, n)
	cfg := PolicyConfig{Kind: kind, Sticky: sticky.NewMemory(0)}
	rt := testRouter(t, tab, cfg)
	ep, err := NewEnginePlacement(ec)
	if err != nil {
		t.Fatal(err)
	}
	rt.SetEnginePlacement(ep)
	ws := tab.Snapshot()
	for _, w := range ws {
		setLoad(w, 0, 0, 0.1, false)
	}
	ep.SetKnown(n)
	return rt, ws
}

func setLoad(w *worker.Worker, running, waiting int, kv float64, vetoed bool) {
	w.SetEngineSignals(worker.EngineSignals{Running: running, Waiting: waiting, KVUsage: kv, HitRate: -1}, vetoed, 0, time.Now())
}

// genReq is a keyless /generate request with its body.
func genReq(t testing.TB, body string) (*httphead.Request, []byte) {
	t.Helper()
	req := parseReq(t, "/generate", fmt.Sprintf("Content-Length: %d", len(body)))
	return req, []byte(body)
}

// idsPrompt renders a prompt of token ids: a shared system prompt of sys
// tokens, then the question q (qlen tokens).
func idsPrompt(sys, q, qlen int) string {
	var b strings.Builder
	b.WriteByte('[')
	for i := 0; i < sys; i++ {
		fmt.Fprintf(&b, "%d,", 1000+i%5000)
	}
	for i := 0; i < qlen; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%d", 20000+q*7+i)
	}
	b.WriteByte(']')
	return b.String()
}

func TestGroupHash(t *testing.T) {
	h := func(body string, peek int) (uint64, bool) {
		req, b := genReq(t, body)
		if peek > 0 && peek < len(b) {
			b = b[:peek]
		}
		return GroupHash(req, b)
	}
	p1, p2 := idsPrompt(10, 1, 20), idsPrompt(10, 2, 20)
	long1, long2 := idsPrompt(2000, 1, 200), idsPrompt(2000, 2, 300)
	for _, tc := range []struct {
		name string
		a, b string
		peek int
		same bool
	}{
		{"rid differs", `{"rid":"a-1","input_ids":` + p1 + `,"sampling_params":{"seed":1}}`, `{"rid":"a-22","input_ids":` + p1 + `,"sampling_params":{"seed":777}}`, 0, true},
		{"rid after", `{"input_ids":` + p1 + `,"rid":"x"}`, `{"input_ids":` + p1 + `,"rid":"yyyy"}`, 0, true},
		{"field order", `{"sampling_params":{"temperature":1},"text":"hello"}`, `{"text":"hello","request_id":"r9"}`, 0, true},
		{"other prompt", `{"input_ids":` + p1 + `}`, `{"input_ids":` + p2 + `}`, 0, false},
		{"other text", `{"text":"hello"}`, `{"text":"hellp"}`, 0, false},
		{"messages", `{"messages":[{"role":"user","content":"a}]"}],"n":1}`, `{"messages":[{"role":"user","content":"a}]"}],"n":2}`, 0, true},
		{"messages differ", `{"messages":[{"role":"user","content":"a"}]}`, `{"messages":[{"role":"user","content":"b"}]}`, 0, false},
		{"prompt", `{"prompt":"x y","seed":3}`, `{"seed":4,"prompt":"x y"}`, 0, true},
		// Cut by the peek inside a shared system prompt: the length tells.
		{"cut, other length", `{"input_ids":` + long1 + `}`, `{"input_ids":` + long2 + `}`, 4096, false},
		{"cut, same prompt", `{"rid":"1","input_ids":` + long1 + `,"x":1}`, `{"rid":"22","input_ids":` + long1 + `,"x":1}`, 4096, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ha, oka := h(tc.a, tc.peek)
			hb, okb := h(tc.b, tc.peek)
			if !oka || !okb {
				t.Fatalf("no group: %v %v", oka, okb)
			}
			if (ha == hb) != tc.same {
				t.Fatalf("same = %v, want %v", ha == hb, tc.same)
			}
		})
	}
	for _, body := range []string{``, `[1,2]`, `{"sampling_params":{}}`, `{"rid":"x"`, `not json`, `{"text":`} {
		if _, ok := h(body, 0); ok {
			t.Errorf("%q: grouped", body)
		}
	}
}

// TestGroupsTogether: the samples of each prompt land on one engine while
// the prompts spread evenly, whatever the order the samples arrive in.
func TestGroupsTogether(t *testing.T) {
	for _, tc := range []struct {
		name              string
		prompts, samples  int
		interleave        bool
		sysTokens, engine int
	}{
		{"grouped arrival", 48, 8, false, 1024, 8},
		{"interleaved arrival", 48, 8, true, 1024, 8},
		{"few engines", 12, 16, true, 50, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt, ws := engineRouter(t, tc.engine, PolicyHash, EngineConfig{})
			engines := make([]map[int]int, tc.prompts)
			var dones []func()
			place := func(p, s int) {
				body := fmt.Sprintf(`{"rid":"p%d-s%d","input_ids":%s,"sampling_params":{"seed":%d}}`, p, s, idsPrompt(tc.sysTokens, p, 40+p%7), s)
				req, b := genReq(t, body)
				if len(b) > 16384 {
					b = b[:16384]
				}
				d := rt.Route(req, b)
				if d.Worker == nil {
					t.Fatalf("no worker")
				}
				d.Worker.Stats.Begin() // in flight, as the proxy counts it
				if engines[p] == nil {
					engines[p] = map[int]int{}
				}
				engines[p][d.Worker.Slot]++
				if d.Done != nil {
					dones = append(dones, d.Done)
				}
			}
			if tc.interleave {
				for s := 0; s < tc.samples; s++ {
					for p := 0; p < tc.prompts; p++ {
						place(p, s)
					}
				}
			} else {
				for p := 0; p < tc.prompts; p++ {
					for s := 0; s < tc.samples; s++ {
						place(p, s)
					}
				}
			}
			for p, m := range engines {
				if len(m) != 1 {
					t.Errorf("prompt %d on %d engines: %v", p, len(m), m)
				}
			}
			var maxIn, total uint64
			for _, w := range ws {
				n := w.Stats.Pending()
				total += n
				maxIn = max(maxIn, n)
			}
			mean := float64(total) / float64(len(ws))
			if float64(maxIn) > 1.5*mean+float64(tc.samples) {
				t.Errorf("unbalanced: max %d, mean %.1f", maxIn, mean)
			}
			if rt.Count(ReasonGroup) == 0 || rt.Count(ReasonEngineLeast) != uint64(tc.prompts) {
				t.Errorf("reasons: group %d, engine-least %d", rt.Count(ReasonGroup), rt.Count(ReasonEngineLeast))
			}
			for _, d := range dones {
				d()
			}
			if n, _ := rt.EnginePlacement().Groups(); n != 0 {
				t.Errorf("%d prompts still in flight after every Done", n)
			}
		})
	}
}

// TestGroupMax: a prompt's samples beyond --group-max in flight on its
// engine go to the next best engine, and the later ones follow them.
func TestGroupMax(t *testing.T) {
	rt, _ := engineRouter(t, 4, PolicyHash, EngineConfig{GroupMax: config.Some(4)})
	body := `{"text":"one prompt"}`
	per := map[int]int{}
	for i := 0; i < 8; i++ {
		req, b := genReq(t, body)
		d := rt.Route(req, b)
		d.Worker.Stats.Begin()
		per[d.Worker.Slot]++
	}
	if len(per) != 2 {
		t.Fatalf("8 samples, group-max 4: on %v, want 2 engines of 4", per)
	}
	for s, n := range per {
		if n != 4 {
			t.Fatalf("slot %d has %d samples: %v", s, n, per)
		}
	}
}

// TestVetoHysteresis: the veto turns on at the KV bound or the waiting
// bound and off only well below them.
func TestVetoHysteresis(t *testing.T) {
	ep, _ := NewEnginePlacement(EngineConfig{})
	for _, tc := range []struct {
		prev    bool
		kv      float64
		waiting int
		want    bool
	}{
		{false, 0.5, 0, false},
		{false, 0.89, 0, false},
		{false, 0.9, 0, true},
		{true, 0.85, 0, true}, // within the band: stays vetoed
		{true, 0.79, 0, false},
		{false, 0.1, 65, true},
		{true, 0.1, 40, true},
		{true, 0.1, 32, false},
		{false, -1, 0, false}, // unknown usage
	} {
		if got := ep.Veto(tc.prev, worker.EngineSignals{KVUsage: tc.kv, Waiting: tc.waiting}); got != tc.want {
			t.Errorf("Veto(prev %v, kv %v, waiting %d) = %v, want %v", tc.prev, tc.kv, tc.waiting, got, tc.want)
		}
	}
}

// TestKeysStayPut: with engine signals, keys keep their ring owner under
// ordinary load differences; a vetoed owner's keys move to a clearly
// better engine and stay there once the veto lifts.
func TestKeysStayPut(t *testing.T) {
	for _, kind := range []PolicyKind{PolicyHash, PolicySticky} {
		t.Run(kind.String(), func(t *testing.T) {
			rt, ws := engineRouter(t, 4, kind, EngineConfig{})
			p := rt.CurrentPolicy()
			// Ordinary differences: 10..16 running, KV 0.3..0.45.
			for i, w := range ws {
				setLoad(w, 10+2*i, 0, 0.3+0.05*float64(i), false)
			}
			home := map[string]int{}
			for k := 0; k < 200; k++ {
				key := fmt.Sprintf("sess-%d", k)
				d := rt.Route(keyReq(t, key), nil)
				home[key] = d.Worker.Slot
				if kind == PolicyHash && d.Worker.Slot != p.Owner(ws, KeyHashString(key)) {
					t.Fatalf("%s not on its ring owner under ordinary load (%s)", key, d.Reason)
				}
			}
			for k := 0; k < 200; k++ {
				key := fmt.Sprintf("sess-%d", k)
				if d := rt.Route(keyReq(t, key), nil); d.Worker.Slot != home[key] {
					t.Fatalf("%s moved %d -> %d (%s)", key, home[key], d.Worker.Slot, d.Reason)
				}
			}
			// Slot 0 fills its KV cache: its keys move, to engines with room.
			setLoad(ws[0], 30, 10, 0.95, true)
			moved := 0
			for k := 0; k < 200; k++ {
				key := fmt.Sprintf("sess-%d", k)
				d := rt.Route(keyReq(t, key), nil)
				if home[key] == 0 {
					if d.Worker.Slot == 0 || d.Reason != ReasonVeto && d.Reason != ReasonHashSpilled {
						t.Fatalf("%s stayed on the vetoed engine (%s)", key, d.Reason)
					}
					home[key] = d.Worker.Slot
					moved++
				} else if d.Worker.Slot != home[key] {
					t.Fatalf("%s of a healthy engine moved (%s)", key, d.Reason)
				}
			}
			if moved == 0 || rt.Count(ReasonVeto) == 0 {
				t.Fatalf("no key moved off the vetoed engine")
			}
			// The veto lifts (an ordinary load again): moved keys stay
			// where they are now.
			setLoad(ws[0], 12, 0, 0.35, false)
			for k := 0; k < 200; k++ {
				key := fmt.Sprintf("sess-%d", k)
				if d := rt.Route(keyReq(t, key), nil); d.Worker.Slot != home[key] {
					t.Fatalf("%s bounced %d -> %d (%s)", key, home[key], d.Worker.Slot, d.Reason)
				}
			}
		})
	}
}

// TestNoSaturatedPins: new sessions and keyless work avoid a vetoed
// engine; a lying engine (idle while tetherd has many requests there) is
// still charged tetherd's own requests in flight.
func TestNoSaturatedPins(t *testing.T) {
	rt, ws := engineRouter(t, 4, PolicySticky, EngineConfig{})
	setLoad(ws[2], 0, 0, 0.93, true)
	for i := 0; i < 100; i++ {
		d := rt.Route(parseReq(t, "/sessions"), nil)
		if d.Worker.Slot == 2 {
			t.Fatalf("new session on the vetoed engine (%s)", d.Reason)
		}
		d = rt.Route(keyReq(t, fmt.Sprintf("new-%d", i)), nil)
		if d.Worker.Slot == 2 {
			t.Fatalf("new key on the vetoed engine (%s)", d.Reason)
		}
		d.Worker.Stats.Begin()
	}
	// Liar: slot 1 reports idle, but tetherd has 50 requests there.
	for _, w := range ws {
		for w.Stats.Pending() > 0 {
			w.Stats.End(false)
		}
	}
	for i := 0; i < 50; i++ {
		ws[1].Stats.Begin()
	}
	setLoad(ws[1], 0, 0, 0, false)
	for i := 0; i < 40; i++ {
		req, b := genReq(t, `{"sampling_params":{}}`)
		d := rt.Route(req, b)
		if d.Worker.Slot == 1 {
			t.Fatalf("keyless request on the engine that lies (%s)", d.Reason)
		}
		d.Worker.Stats.Begin()
	}
}

// TestAllVetoedHold: with every engine vetoed, a hold keeps requests in
// the worker's queue until it lifts.
func TestAllVetoedHold(t *testing.T) {
	_, ws := engineRouter(t, 1, PolicyHash, EngineConfig{})
	w := ws[0]
	if w.Admit(8, time.Second, nil) != worker.Admitted {
		t.Fatal("no place")
	}
	w.SetEngineHold(1)
	got := make(chan worker.Admission, 1)
	go func() { got <- w.Admit(8, time.Minute, nil) }()
	testenv.WaitFor(t, "a queued request", func() bool { return w.Queued() == 1 })
	w.SetEngineHold(0)
	if a := <-got; a != worker.Admitted {
		t.Fatalf("after the hold: %v", a)
	}
}

// TestEngineOffUnchanged: without signals (no worker reports), keyless
// requests spread as before.
func TestEngineOffUnchanged(t *testing.T) {
	rt, ws := engineRouter(t, 3, PolicyHash, EngineConfig{})
	rt.EnginePlacement().SetKnown(0)
	for _, w := range ws {
		w.ForgetEngineSignals(3, nil)
	}
	req, b := genReq(t, `{"text":"x"}`)
	if d := rt.Route(req, b); d.Reason != ReasonSpread {
		t.Fatalf("reason %s, want spread", d.Reason)
	}
}

func TestEngineRouteAllocs(t *testing.T) {
	rt, _ := engineRouter(t, 8, PolicyHash, EngineConfig{})
	req, b := genReq(t, `{"rid":"r1","input_ids":`+idsPrompt(1024, 3, 100)+`}`)
	kreq := keyReq(t, "k1")
	n := testing.AllocsPerRun(200, func() {
		d := rt.Route(req, b)
		if d.Done != nil {
			d.Done()
		}
		rt.Route(kreq, nil)
	})
	if n != 0 {
		t.Fatalf("%v allocations per request", n)
	}
}

func BenchmarkRouteGroup(b *testing.B) {
	rt, _ := engineRouter(b, 8, PolicyHash, EngineConfig{})
	req, body := genReq(b, `{"rid":"r1","input_ids":`+idsPrompt(1024, 3, 100)+`}`)
	if len(body) > 12288 {
		body = body[:12288]
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		d := rt.Route(req, body)
		d.Done()
	}
}

func BenchmarkRouteEngineKeyed(b *testing.B) {
	rt, _ := engineRouter(b, 8, PolicyHash, EngineConfig{})
	req := keyReq(b, "session-1")
	b.ReportAllocs()
	for b.Loop() {
		rt.Route(req, nil)
	}
}

// TestHotKeyOneNeighbour: many concurrent requests of one key stay on its
// engine until that is vetoed, then all go to one other engine, never
// spread; the key stays there once the veto lifts.
func TestHotKeyOneNeighbour(t *testing.T) {
	rt, ws := engineRouter(t, 6, PolicyHash, EngineConfig{})
	req := keyReq(t, "num-samples-64")
	first := rt.Route(req, nil).Worker
	for i := 0; i < 63; i++ {
		d := rt.Route(req, nil)
		if d.Worker != first {
			t.Fatalf("request %d of the hot key on slot %d, not %d (%s)", i, d.Worker.Slot, first.Slot, d.Reason)
		}
		d.Worker.Stats.Begin()
	}
	setLoad(first, 64, 20, 0.95, true)
	seen := map[int]int{}
	for i := 0; i < 64; i++ {
		d := rt.Route(req, nil)
		seen[d.Worker.Slot]++
		d.Worker.Stats.Begin()
	}
	if len(seen) != 1 || seen[first.Slot] != 0 {
		t.Fatalf("overflow spread over %v (vetoed slot %d)", seen, first.Slot)
	}
	setLoad(first, 0, 0, 0.1, false)
	for i := 0; i < 8; i++ {
		if d := rt.Route(req, nil); seen[d.Worker.Slot] == 0 {
			t.Fatalf("the moved hot key bounced to slot %d (%s)", d.Worker.Slot, d.Reason)
		}
	}
	_ = ws
}
