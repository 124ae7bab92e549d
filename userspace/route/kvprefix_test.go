package route

import (
	"fmt"
	"strings"
	"testing"

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
	// Clearing an engine (restart) loses its match.
	x.Clear(ids[2])
	req, body = genReq(t, idsBody(sess))
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
