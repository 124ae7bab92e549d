package route

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/worker"
)

// prefixRouter: n idle engines, one index engine each, prefix placement on.
func prefixRouter(t *testing.T, n int) (*Router, []*worker.Worker, *kvindex.Index, []kvindex.EngineID) {
	t.Helper()
	rt, ws := engineRouter(t, n, PolicyHash, EngineConfig{})
	x := kvindex.New(kvindex.Config{})
	p, err := NewPrefixPlacement(PrefixConfig{Index: x})
	if err != nil {
		t.Fatal(err)
	}
	rt.SetPrefixPlacement(p)
	ids := make([]kvindex.EngineID, n)
	for i, w := range ws {
		ids[i], _ = x.Register(fmt.Sprint(i))
		p.SetEngines(w.Slot, []kvindex.EngineID{ids[i]})
	}
	return rt, ws, x, ids
}

func tokenRun(start, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(start + i)
	}
	return t
}

func storeOn(x *kvindex.Index, id kvindex.EngineID, toks []uint32, salt uint64) {
	ev := kvevents.Event{Kind: kvevents.Stored, BlockSize: 16}
	for i := 0; i+16 <= len(toks); i += 16 {
		ev.Hashes = append(ev.Hashes, salt+uint64(i)+1)
	}
	ev.Tokens = toks[:len(ev.Hashes)*16]
	x.Apply(id, []kvevents.Event{ev})
}

func idsBody(toks []uint32) string {
	var b strings.Builder
	b.WriteString(`{"input_ids":[`)
	for i, t := range toks {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, t)
	}
	b.WriteString(`],"sampling_params":{"max_new_tokens":8}}`)
	return b.String()
}

func TestPrefixPlacement(t *testing.T) {
	rt, ws, x, ids := prefixRouter(t, 4)
	sess := tokenRun(1000, 640)
	storeOn(x, ids[2], sess, 0)

	// Keyless, token ids: the engine that holds the prefix, with the count.
	req, body := genReq(t, idsBody(append(append([]uint32{}, sess...), tokenRun(9000, 100)...)))
	d := rt.Route(req, body)
	if d.Worker != ws[2] || d.Reason != ReasonKVPrefix || d.Matched != 640 {
		t.Fatalf("keyless: slot %d reason %v matched %d", d.Worker.Slot, d.Reason, d.Matched)
	}
	// A text prompt: placed as before.
	req, body = genReq(t, `{"text":"hello","sampling_params":{}}`)
	if d := rt.Route(req, body); d.Reason == ReasonKVPrefix {
		t.Fatalf("text prompt placed by the index")
	}
	// Busy engine 2 (40 requests more than the others: 2,560 tokens of
	// work at 64 each) loses to an idle one for a 740-token prompt.
	setLoad(ws[2], 40, 0, 0.1, false)
	req, body = genReq(t, idsBody(append(append([]uint32{}, sess...), tokenRun(9000, 100)...)))
	if d := rt.Route(req, body); d.Worker == ws[2] {
		t.Fatalf("placed on the busy engine")
	}
	// A vetoed engine takes nothing new, whatever it holds.
	setLoad(ws[2], 0, 0, 0.95, true)
	req, body = genReq(t, idsBody(sess))
	if d := rt.Route(req, body); d.Worker == ws[2] {
		t.Fatalf("placed on a vetoed engine")
	}
	setLoad(ws[2], 0, 0, 0.1, false)

	// Siblings follow the first sample before any event (credit).
	q := tokenRun(50000, 300)
	req, body = genReq(t, idsBody(q))
	first := rt.Route(req, body).Worker
	for s := 0; s < 7; s++ {
		req, body = genReq(t, idsBody(q))
		if d := rt.Route(req, body); d.Worker != first {
			t.Fatalf("sample %d: slot %d, first on %d", s, d.Worker.Slot, first.Slot)
		}
	}
	// Clearing an engine (restart) loses its match (a prompt of its own:
	// sess itself was placed on another engine above, and is credited
	// there).
	x.Clear(ids[2])
	req, body = genReq(t, idsBody(append(append([]uint32{}, sess...), tokenRun(7000, 50)...)))
	if d := rt.Route(req, body); d.Matched != 0 {
		t.Fatalf("matched %d after clear", d.Matched)
	}
}

func TestPrefixKeyStays(t *testing.T) {
	rt, ws, x, ids := prefixRouter(t, 4)
	ctx := tokenRun(1000, 320)
	keyed := func(toks []uint32) Decision {
		body := idsBody(toks)
		req := parseReq(t, "/generate", fmt.Sprintf("Content-Length: %d", len(body)), "X-Session-ID: s1")
		return rt.Route(req, []byte(body))
	}
	d := keyed(ctx)
	home := d.Worker
	storeOn(x, ids[home.Slot], ctx, 0)
	// A little busier than the rest: the key stays.
	setLoad(home, 3, 0, 0.1, false)
	if d := keyed(append(ctx, tokenRun(7000, 40)...)); d.Worker != home {
		t.Fatalf("moved to %d for a small difference", d.Worker.Slot)
	}
	// Much busier: it moves, and is counted.
	setLoad(home, 200, 0, 0.1, false)
	if d := keyed(append(ctx, tokenRun(7000, 40)...)); d.Worker == home {
		t.Fatalf("stayed on an engine 200 requests deep")
	}
	if rt.PrefixPlacement().Counts().Moved != 1 {
		t.Fatalf("counts %+v", rt.PrefixPlacement().Counts())
	}
	_ = ws
}

func TestPrefixPlacementAllocs(t *testing.T) {
	rt, _, x, ids := prefixRouter(t, 8)
	sess := tokenRun(1000, 2000)
	storeOn(x, ids[3], sess, 0)
	req, body := genReq(t, idsBody(sess))
	if n := testing.AllocsPerRun(100, func() { rt.Route(req, body) }); n != 0 {
		t.Fatalf("%v allocations per decision", n)
	}
}

// A group follows its first sample's engine while that engine stays
// within a margin of the best; past it, the next sample goes elsewhere.
func TestPrefixGroupFollowsWithinMargin(t *testing.T) {
	rt, ws, _, _ := prefixRouter(t, 4)
	q := tokenRun(50000, 300)
	req, body := genReq(t, idsBody(q))
	first := rt.Route(req, body).Worker
	// A little busier than the rest: the sample follows.
	setLoad(first, 3, 0, 0.1, false)
	req, body = genReq(t, idsBody(q))
	if d := rt.Route(req, body); d.Worker != first {
		t.Fatalf("left the group's engine for a small difference: slot %d, first %d", d.Worker.Slot, first.Slot)
	}
	// Far busier (40 requests more: 2,560 tokens of work against a
	// 300-token prefill elsewhere): the next sample goes elsewhere.
	setLoad(first, 40, 0, 0.1, false)
	req, body = genReq(t, idsBody(q))
	if d := rt.Route(req, body); d.Worker == first {
		t.Fatalf("followed the group onto an engine 40 requests deep")
	}
	_ = ws
}

// Every engine vetoed (KV caches full): the request still goes where its
// prefix is (the cheapest vetoed engine), not to the least loaded one.
func TestPrefixAllVetoed(t *testing.T) {
	rt, ws, x, ids := prefixRouter(t, 4)
	sess := tokenRun(1000, 640)
	storeOn(x, ids[1], sess, 0)
	for _, w := range ws {
		setLoad(w, 4, 0, 0.97, true)
	}
	req, body := genReq(t, idsBody(append(append([]uint32{}, sess...), tokenRun(9000, 100)...)))
	if d := rt.Route(req, body); d.Worker != ws[1] || d.Reason != ReasonKVPrefix || d.Matched != 640 {
		t.Fatalf("all vetoed: slot %d reason %v matched %d", d.Worker.Slot, d.Reason, d.Matched)
	}
}

func keyedReq(t *testing.T, key string, toks []uint32) (*httphead.Request, []byte) {
	t.Helper()
	body := idsBody(toks)
	return parseReq(t, "/generate", fmt.Sprintf("Content-Length: %d", len(body)), "X-Session-ID: "+key), []byte(body)
}

// New sessions sharing a system prompt, of one length, arriving before
// any event (a cold start): each is its own session, placed by the work
// on each engine, not followed onto the first one's engine as a GRPO
// group's samples would be (keyless, the same prompt follows).
func TestPrefixKeyedSessionsAreNoGroup(t *testing.T) {
	rt, _, _, _ := prefixRouter(t, 4)
	sys := tokenRun(1000, 320)
	seen := map[int]bool{}
	for s := 0; s < 4; s++ {
		prompt := append(append([]uint32{}, sys...), tokenRun(100000*(s+1), 64)...)
		req, body := keyedReq(t, fmt.Sprintf("sess-%d", s), prompt)
		d := rt.Route(req, body)
		if d.Reason != ReasonKVPrefix {
			t.Fatalf("session %d: reason %v", s, d.Reason)
		}
		seen[d.Worker.Slot] = true
	}
	if len(seen) != 4 {
		t.Fatalf("4 new sessions on 4 idle engines went to %d of them", len(seen))
	}
	// The same prompts keyless: one group, one engine.
	q := append(append([]uint32{}, sys...), tokenRun(900000, 64)...)
	first := -1
	for s := 0; s < 4; s++ {
		req, body := genReq(t, idsBody(q))
		d := rt.Route(req, body)
		if first < 0 {
			first = d.Worker.Slot
		} else if d.Worker.Slot != first {
			t.Fatalf("keyless sample %d on slot %d, its group on %d", s, d.Worker.Slot, first)
		}
	}
}

// A new session goes where the fewest prompt tokens are in flight: one
// long session weighs more than a few short ones, and its weight leaves
// with its request (Decision.Done).
func TestPrefixTokensInFlight(t *testing.T) {
	rt, ws, x, ids := prefixRouter(t, 2)
	// The recent prefill (Backlog) out of the way: in flight alone.
	p, err := NewPrefixPlacement(PrefixConfig{Index: x, Backlog: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range ws {
		p.SetEngines(w.Slot, []kvindex.EngineID{ids[i]})
	}
	rt.SetPrefixPlacement(p)
	req, body := keyedReq(t, "long", tokenRun(100000, 4000))
	long := rt.Route(req, body)
	if long.Done == nil {
		t.Fatal("a kv-prefix decision with no Done: its tokens are never released")
	}
	other := ws[1-long.Worker.Slot]
	// Three short requests in flight on the other engine (its reading),
	// one long one on the first: a new session goes to the other.
	setLoad(other, 3, 0, 0.1, false)
	setLoad(long.Worker, 1, 0, 0.1, false)
	req, body = keyedReq(t, "short", tokenRun(200000, 200))
	d := rt.Route(req, body)
	if d.Worker != other {
		t.Fatalf("placed beside 4,000 tokens in flight (slot %d) rather than 3 short requests (slot %d)", d.Worker.Slot, other.Slot)
	}
	d.Done()
	// The long request ended: its engine is the lighter one again.
	long.Done()
	setLoad(long.Worker, 0, 0, 0.1, false)
	req, body = keyedReq(t, "next", tokenRun(300000, 200))
	if d := rt.Route(req, body); d.Worker != long.Worker {
		t.Fatalf("the long request's tokens stayed after its Done: slot %d", d.Worker.Slot)
	}
}

// A key's engine holds its session's context past what the scan reads
// (the body beyond the peek): the key stays while its engine is busier
// by less than that context, also when vetoed (a move recomputes the
// context, as a preemption would), and moves when another is clearly
// cheaper.
func TestPrefixKeyStaysPastThePeek(t *testing.T) {
	rt, ws, x, ids := prefixRouter(t, 2)
	// The recent prefill (Backlog) out of the way: the engines' queues
	// alone.
	p, err := NewPrefixPlacement(PrefixConfig{Index: x, Backlog: time.Nanosecond})
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range ws {
		p.SetEngines(w.Slot, []kvindex.EngineID{ids[i]})
	}
	rt.SetPrefixPlacement(p)
	sys := tokenRun(1000, 320)
	ctx := append(append([]uint32{}, sys...), tokenRun(50000, 3000)...)
	// Both engines hold the system prompt; the scan sees only its start.
	storeOn(x, ids[0], sys, 0)
	storeOn(x, ids[1], sys, 0)
	route := func(toks []uint32) Decision {
		body := idsBody(toks)
		req := parseReq(t, "/generate", fmt.Sprintf("Content-Length: %d", len(body)), "X-Session-ID: s1")
		peek := body[:2048] // what routing read of it
		d := rt.Route(req, []byte(peek))
		if d.Done != nil {
			d.Done()
		}
		return d
	}
	home := route(ctx).Worker
	other := ws[1-home.Slot]
	// Its engine holds the context now; routing sees only its start.
	storeOn(x, ids[home.Slot], ctx, 0)
	ctx = append(ctx, tokenRun(70000, 200)...)
	// 40 requests there (vetoed: its queue), none on the other: 3,500
	// tokens of work at 64 each (KV penalty 1.33), against recomputing
	// the 3,200 tokens of the session's own.
	setLoad(home, 40, 0, 0.5, true)
	setLoad(other, 0, 0, 0, false)
	if d := route(ctx); d.Worker != home {
		t.Fatalf("a 3,500-token session left its engine (40 requests) for an idle one (slot %d)", d.Worker.Slot)
	}
	// Far busier (300 requests deep): it moves.
	setLoad(home, 300, 0, 0.5, true)
	if d := route(append(ctx, tokenRun(80000, 200)...)); d.Worker != other {
		t.Fatalf("stayed on an engine 300 requests deep")
	}
}

// A new prompt sharing a system prompt that one engine holds (a GRPO
// wave's prompts, whose first computed it there) is placed by cost once
// another prompt matched the same prefix (kvindex SharedPrefix): what
// that engine holds is then no session's own context, and keeping every
// new prompt there within the keys' margin drew a whole wave, and then
// each prompt's group, to one engine. A keyless session's next turn,
// whose deepest held prefix is its own last turn, still keeps to its
// engine within the margin.
func TestPrefixSharedSystemPromptDrawsNoWave(t *testing.T) {
	rt, ws, x, ids := prefixRouter(t, 4)
	sys := tokenRun(1000, 1024)
	storeOn(x, ids[0], sys, 0)
	// Engine 0 busier than the rest by 20 requests (1,280 tokens of
	// work), more than the 1,024-token system prompt saves but within
	// the keys' margin.
	setLoad(ws[0], 20, 0, 0.1, false)
	prompt := func(p int) []uint32 {
		return append(append([]uint32{}, sys...), tokenRun(100000+1000*p, 200)...)
	}
	req, body := genReq(t, idsBody(prompt(0)))
	if d := rt.Route(req, body); d.Reason != ReasonKVPrefix {
		t.Fatalf("first prompt: reason %v", d.Reason)
	}
	req, body = genReq(t, idsBody(prompt(1)))
	if d := rt.Route(req, body); d.Worker == ws[0] || d.Reason != ReasonKVPrefix {
		t.Fatalf("the second prompt of a wave went to the busier engine holding only their shared system prompt (slot %d, %v)", d.Worker.Slot, d.Reason)
	}

	// A keyless session's context on engine 1 of a fresh fleet, busier
	// (15 requests) than engine 0, which holds the system prompt and is
	// cheaper by cost, though within the margin: each turn stays (the
	// engine's events of the last turn in before the next, as an engine
	// publishes a turn's blocks).
	rt, ws, x, ids = prefixRouter(t, 4)
	storeOn(x, ids[0], sys, 0)
	sess := append(append([]uint32{}, sys...), tokenRun(300000, 640)...)
	setLoad(ws[1], 15, 0, 0.1, false)
	for turn := 0; turn < 3; turn++ {
		storeOn(x, ids[1], sess, uint64(turn+1)<<20)
		sess = append(sess, tokenRun(400000+100*turn, 48)...)
		req, body := genReq(t, idsBody(sess))
		if d := rt.Route(req, body); d.Worker != ws[1] {
			t.Fatalf("turn %d of a keyless session left the engine holding its context for slot %d", turn, d.Worker.Slot)
		}
	}
}

// What engines hold of a new session's prompt (a system prompt) is no
// session's own: a session placed on an engine whose events do not show
// it yet (its first requests still in flight) pins its own tokens there,
// not the system prompt again, or that engine looks fuller by a system
// prompt per session and new sessions pile onto the engines that show
// it: a keyed one whether one engine shows it yet or two, a keyless one
// (a keyless session's first turn: new work, weighed in tokens in flight
// as a new key is) once two do.
func TestPrefixSharedPrefixNotInFlight(t *testing.T) {
	for _, tc := range []struct {
		keyed   bool
		holders []int
	}{{true, []int{0, 1}}, {true, []int{0}}, {false, []int{0, 1}}} {
		holders := tc.holders
		t.Run(fmt.Sprint(tc.keyed, holders), func(t *testing.T) {
			rt, ws, x, ids := prefixRouter(t, 3)
			p, err := NewPrefixPlacement(PrefixConfig{Index: x, Backlog: time.Nanosecond})
			if err != nil {
				t.Fatal(err)
			}
			for i, w := range ws {
				p.SetEngines(w.Slot, []kvindex.EngineID{ids[i]})
			}
			rt.SetPrefixPlacement(p)
			sys := tokenRun(1000, 1024)
			for _, h := range holders {
				storeOn(x, ids[h], sys, 0)
			}
			per := map[int]int{}
			session := func(n int) {
				toks := append(append([]uint32{}, sys...), tokenRun(100000+1000*n, 320)...)
				req, body := keyedReq(t, fmt.Sprintf("s%d", n), toks)
				if !tc.keyed {
					body = []byte(idsBody(toks))
					req = parseReq(t, "/generate", fmt.Sprintf("Content-Length: %d", len(body)))
				}
				d := rt.Route(req, body)
				if d.Reason != ReasonKVPrefix {
					t.Fatalf("session %d: reason %v", n, d.Reason)
				}
				per[d.Worker.Slot]++ // in flight: never Done
			}
			n := 0
			for ; per[ws[2].Slot] == 0; n++ {
				if n == 12 {
					t.Fatalf("no session on the engine without the system prompt: %v", per)
				}
				session(n)
			}
			if got := p.flight.get(ids[2]); got != 320 {
				t.Fatalf("in flight on the engine without the system prompt: %.0f tokens, want the session's own 320", got)
			}
			// Their events arrive: the engines are alike, and so are
			// their sessions.
			storeOn(x, ids[1], sys, 0)
			storeOn(x, ids[2], sys, 0)
			for ; n < 21; n++ {
				session(n)
			}
			lo, hi := n, 0
			for _, w := range ws {
				lo, hi = min(lo, per[w.Slot]), max(hi, per[w.Slot])
			}
			if hi-lo > 1 {
				t.Fatalf("sessions per engine %v: spread %d", per, hi-lo)
			}
		})
	}
}

// A keyless session's context stays on its engine when that engine is
// vetoed for its KV cache, as a key does, unless another is clearly
// cheaper: with every cache full (a fleet past its KV), a move
// recomputes the whole context on an engine just as full. An engine
// clearly emptier still takes it.
func TestPrefixKeylessStaysOnVetoedEngine(t *testing.T) {
	for _, tc := range []struct {
		name          string
		otherKV       float64
		otherVetoed   bool
		holderRunning int
		stay          bool
	}{
		{"all full", 0.95, true, 8, true},
		{"the other clearly emptier", 0.5, false, 4, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt, ws, x, ids := prefixRouter(t, 2)
			ctx := tokenRun(1000, 1024)
			storeOn(x, ids[0], ctx, 0)
			setLoad(ws[0], tc.holderRunning, 0, 0.95, true)
			setLoad(ws[1], 4, 0, tc.otherKV, tc.otherVetoed)
			req, body := genReq(t, idsBody(append(append([]uint32{}, ctx...), tokenRun(50000, 100)...)))
			d := rt.Route(req, body)
			if d.Reason != ReasonKVPrefix {
				t.Fatalf("reason %v", d.Reason)
			}
			if stayed := d.Worker == ws[0]; stayed != tc.stay {
				t.Fatalf("placed on slot %d (held %d); want the holder: %v", d.Worker.Slot, d.Matched, tc.stay)
			}
		})
	}
}

// A GRPO group's sibling follows its group's engine within the margin
// when every engine is vetoed too (the cheapest vetoed one is the
// fallback then, and the group's own engine is as good a fallback); with
// only its group's engine vetoed it goes to the next best.
func TestPrefixGroupFollowsAllVetoed(t *testing.T) {
	for _, tc := range []struct {
		name        string
		otherVetoed bool
		follow      bool
	}{{"all vetoed", true, true}, {"only its engine vetoed", false, false}} {
		t.Run(tc.name, func(t *testing.T) {
			rt, ws, x, ids := prefixRouter(t, 2)
			storeOn(x, ids[0], tokenRun(900000, 16), 0) // the block size
			prompt := idsBody(append(tokenRun(1000, 1024), tokenRun(70000, 100)...))
			req, body := genReq(t, prompt)
			first := rt.Route(req, body)
			if first.Reason != ReasonKVPrefix {
				t.Fatalf("first sample: reason %v", first.Reason)
			}
			other := ws[1-first.Worker.Slot]
			// Its engine costlier than the other by less than the follow slack:
			// 25 requests there (1,600 tokens) against 4 and the 1,124-token
			// prompt (1,444).
			setLoad(first.Worker, 25, 0, 0, true)
			setLoad(other, 4, 0, 0, tc.otherVetoed)
			req, body = genReq(t, prompt)
			d := rt.Route(req, body)
			if followed := d.Worker == first.Worker; followed != tc.follow {
				t.Fatalf("sibling on slot %d, its group on %d: followed %v, want %v", d.Worker.Slot, first.Worker.Slot, followed, tc.follow)
			}
		})
	}
}
