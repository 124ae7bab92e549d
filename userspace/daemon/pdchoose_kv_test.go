package daemon

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/pd"
	"github.com/tether-rl/tether/userspace/route"
)

// idsRequest is a /generate request of token ids (spans: from, n pairs,
// each from..from+n-1), with a key when key is not "".
func idsRequest(key string, spans ...int) *pd.Request {
	h := http.Header{}
	if key != "" {
		h.Set("X-Session-Id", key)
	}
	var b strings.Builder
	b.WriteString(`{"input_ids":[`)
	sep := ""
	for k := 0; k+1 < len(spans); k += 2 {
		for i := 0; i < spans[k+1]; i++ {
			fmt.Fprint(&b, sep, spans[k]+i)
			sep = ","
		}
	}
	b.WriteString(`],"sampling_params":{"max_new_tokens":4}}`)
	return &pd.Request{Method: "POST", Path: "/generate", Header: h, Body: []byte(b.String())}
}

// stored is a BlockStored of the 16-token blocks of ids from..from+n-1
// (n a multiple of 16), hashed h0, h0+1, ...
func stored(h0 uint64, from, n int) kvevents.Event {
	ev := kvevents.Event{Kind: kvevents.Stored, BlockSize: 16}
	for i := 0; i < n; i++ {
		if i%16 == 0 {
			ev.Hashes = append(ev.Hashes, h0+uint64(i/16))
		}
		ev.Tokens = append(ev.Tokens, uint32(from+i))
	}
	return ev
}

// TestPairChooserKVEvents: with the prefills' KV events indexed, the
// prefill holding the longest prefix of the request's token ids takes it
// (reason prefill-kv), a key's or a prompt's affinity notwithstanding;
// equal holdings leave it to the affinity; at its bounded load the holder
// spills to the other; requests without token ids are placed as before.
func TestPairChooserKVEvents(t *testing.T) {
	tab, ws := chooserTable(2, 2)
	rt := &route.Router{Table: tab}
	x := kvindex.New(kvindex.Config{})
	pp, err := route.NewPrefixPlacement(route.PrefixConfig{Index: x})
	if err != nil {
		t.Fatal(err)
	}
	rt.SetPrefixPlacement(pp)
	c := &pairChooser{table: tab, router: rt, keyHeaders: keyHeadersOf([]string{"X-Session-ID"})}
	ids := [2]kvindex.EngineID{}
	for i := range ids {
		ids[i], _ = x.Register(fmt.Sprint("p", i))
		pp.SetEngines(i, []kvindex.EngineID{ids[i]})
	}
	ctx := context.Background()
	var tally [numChooseBy]uint64 // by the reasons seen
	choose := func(req *pd.Request) pd.Pair {
		t.Helper()
		p, err := c.Choose(ctx, req, 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		c.Release(p, false)
		why := strings.TrimPrefix(strings.Fields(p.Reason)[0], "prefill-")
		if strings.HasSuffix(why, "-spill") {
			tally[chooseBySpill]++
		} else {
			tally[chooseByOf(why)]++
		}
		return p
	}
	// Both hold the shared start (a system prompt: 64 tokens); each
	// holds another session's context past it.
	x.Apply(ids[0], []kvevents.Event{stored(100, 1000, 64)})
	x.Apply(ids[1], []kvevents.Event{stored(200, 1000, 64)})
	for s, holder := range []int{0, 1} {
		ev := stored(uint64(300+100*s), 1000+64+1000*s, 48)
		ev.Parent, ev.HasParent = uint64(100*(holder+1)+3), true // the shared start's last block
		x.Apply(ids[holder], []kvevents.Event{ev})
	}
	session := func(s, extra int) *pd.Request {
		// The shared start, session s's context, its next turn.
		return idsRequest("", 1000, 64, 1000+64+1000*s, 48+extra)
	}
	for s, holder := range []int{0, 1} {
		for turn := 0; turn < 4; turn++ {
			p := choose(session(s, 16+turn*7))
			if p.Prefill.Slot != holder || !strings.HasPrefix(p.Reason, "prefill-kv ") {
				t.Errorf("session %d, keyless: prefill %d (%s), its context on %d", s, p.Prefill.Slot, p.Reason, holder)
			}
		}
		// A key whose affinity is the other prefill: still the holder.
		for k := 0; k < 8; k++ {
			req := session(s, 5)
			req.Header.Set("X-Session-Id", fmt.Sprint("key-", k))
			if p := choose(req); p.Prefill.Slot != holder {
				t.Errorf("session %d, key %d: prefill %d, its context on %d", s, k, p.Prefill.Slot, holder)
			}
		}
	}
	// Equal holdings (only the shared start): the key decides, as
	// without events, whatever the prompt after it.
	var keyed0 pd.Pair
	for turn := 0; turn < 4; turn++ {
		p := choose(idsRequest("k", 1000, 64, 90000+turn*10, 2))
		if turn == 0 {
			keyed0 = p
		} else if p.Prefill != keyed0.Prefill {
			t.Errorf("a key over equal holdings moved from prefill %d to %d", keyed0.Prefill.Slot, p.Prefill.Slot)
		}
		if strings.Contains(p.Reason, "prefill-kv") {
			t.Errorf("equal holdings placed by the cache: %s", p.Reason)
		}
	}
	// The holder at its bounded load (1.25 × the average + 2): the other.
	for i := 0; i < 6; i++ {
		ws[0].Stats.Begin()
	}
	if p := choose(session(0, 30)); p.Prefill.Slot != 1 {
		t.Errorf("prefill 0 with 6 in flight, the other idle: chosen %d (%s)", p.Prefill.Slot, p.Reason)
	}
	for i := 0; i < 6; i++ {
		ws[0].Stats.End(false)
	}
	// A text prompt: the prompt's group, as before.
	if p := choose(keyed("", "text")); strings.Contains(p.Reason, "kv") {
		t.Errorf("a text prompt placed by the cache: %s", p.Reason)
	}
	// tether_pd_prefill_choices_total counts each pair by what decided
	// its prefill, as its route reason says; the held tokens are summed
	// over the pairs the caches decided (each held more than the start).
	for i, name := range chooseByNames {
		if got := c.by[i].Load(); got != tally[i] {
			t.Errorf("choices by %s: counted %d, the reasons say %d", name, got, tally[i])
		}
	}
	if tally[chooseByKV] == 0 || tally[chooseByKey] == 0 || tally[chooseByPrompt] == 0 {
		t.Errorf("reasons seen %v: want kv, key and prompt", tally)
	}
	if held := c.heldTokens.Load(); held <= 64*tally[chooseByKV] {
		t.Errorf("held tokens %d over %d pairs decided by the caches: each held more than the 64-token start", held, tally[chooseByKV])
	}
}
