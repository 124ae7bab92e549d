package daemon

import (
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/kvevents"
)

// TestKVEventsPastThePeek: two engines hold the same 4,000-token context
// (28 KB of token ids, past the 16 KiB a peek once held), each followed
// by its own 800 tokens; a prompt that differs only after that context
// goes to the engine holding its continuation, the route header counting
// the whole match, and the body reaches the engine whole (--kv-peek-max:
// the body read further while both engines held every block).
func TestKVEventsPastThePeek(t *testing.T) {
	es, urls := fakeFleet(t, 2, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, BlockTokens: 16})
	var pubs [2]*kvevents.Publisher
	for i := range pubs {
		p, err := kvevents.NewPublisher(kvevents.PublisherConfig{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(p.Close)
		pubs[i] = p
	}
	d, do := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{RouteHeader: "X-Tether-Route",
		StickyStore: "memory", KVEvents: KVEventsOptions{On: true}}})
	for i, p := range pubs {
		if err := d.SetWorkerKVEvents(urls[i], p.Endpoint(), ""); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, "both engines subscribed", func() bool {
		return pubs[0].Subscribers() > 0 && pubs[1].Subscribers() > 0
	})
	const ctxTokens, ownTokens = 4000, 800
	ctx := kvIDs(100000, ctxTokens)
	own := [2]string{kvIDs(300000, ownTokens), kvIDs(400000, ownTokens)}
	for i, p := range pubs {
		var toks []uint32
		for k := 0; k < ctxTokens; k++ {
			toks = append(toks, uint32(100000+k))
		}
		for k := 0; k < ownTokens; k++ {
			toks = append(toks, uint32(300000+100000*i+k))
		}
		ev := kvevents.Event{Kind: kvevents.Stored, BlockSize: 16, Tokens: toks}
		for b := 0; b < len(toks)/16; b++ {
			ev.Hashes = append(ev.Hashes, uint64(1+b))
		}
		if _, err := p.Publish(&kvevents.Batch{TS: 1, Events: []kvevents.Event{ev}}, kvevents.MapForm, kvevents.HashInt); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, "both engines' blocks indexed", func() bool {
		st, _, _ := d.KVEventsStatus()
		return len(st[urls[0]]) == 1 && st[urls[0]][0].Blocks == 300 && len(st[urls[1]]) == 1 && st[urls[1]][0].Blocks == 300
	})
	if len(ctx) <= 16<<10 {
		t.Fatalf("the shared context is %d bytes: within a 16 KiB peek", len(ctx))
	}
	for k, i := range []int{1, 0, 1} {
		// (Each its own question: the same prompt again would be a
		// sibling of the first, credited with its whole prompt.)
		body := `{"input_ids":[` + ctx + "," + own[i] + "," + kvIDs(900000+1000*k, 100) + `],"sampling_params":{"max_new_tokens":4}}`
		st, h, b := do("POST", "/generate", body)
		if st != 200 || !strings.Contains(string(b), "output_ids") {
			t.Fatalf("generate: %d %s", st, b)
		}
		if got, want := h.Get("X-Tether-Route"), []string{"0 prefix 4800", "1 prefix 4800"}[i]; got != want {
			t.Fatalf("the prompt continuing engine %d's: route %q, want %q", i, got, want)
		}
		if got := string(es[i].LastBody("/generate")); got != body {
			t.Fatalf("engine %d got a body of %d bytes, sent %d", i, len(got), len(body))
		}
	}
	if n := d.Proxy.Counters().PeekMore.Load(); n != 3 {
		t.Fatalf("%d requests read past the peek, want 3", n)
	}
}
