package daemon

import (
	"net"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/worker"
)

func kvIDs(start, n int) string {
	var b strings.Builder
	for i := 0; i < n; i++ {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(start + i))
	}
	return b.String()
}

// TestKVEventsEndToEnd: tetherd subscribes to each fake engine's events
// (per-worker endpoints), places a session's next turn where its context
// is cached and says how much in the route header, clears a restarted
// engine's entries, clears an unhealthy one's, and keeps routing while an
// engine's publisher is gone.
func TestKVEventsEndToEnd(t *testing.T) {
	es, urls := fakeFleet(t, 3, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, BlockTokens: 16,
		KVEvents: &fakeengine.KVEventsConfig{Form: kvevents.MapForm, Hashes: kvevents.HashInt, Replay: true}})
	d, do := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{RouteHeader: "X-Tether-Route",
		StickyStore: "memory", KVEvents: KVEventsOptions{On: true}}})
	if err := d.SetWorkerKVEvents(urls[0], "http://x", ""); err == nil {
		t.Fatal("an http:// endpoint accepted")
	}
	for _, e := range es {
		if err := d.SetWorkerKVEvents(e.URL(), e.KVEventsEndpoint(), e.KVEventsReplayEndpoint()); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, "subscribed to every engine", func() bool {
		for _, e := range es {
			if e.KVEventsSubscribers() == 0 {
				return false
			}
		}
		return true
	})
	ctx := kvIDs(1000, 320) // 20 blocks
	gen := func(ids string) (int, int) {
		t.Helper()
		st, h, b := do("POST", "/generate", `{"input_ids":[`+ids+`],"sampling_params":{"max_new_tokens":4}}`)
		if st != 200 {
			t.Fatalf("generate: %d %s", st, b)
		}
		f := strings.Fields(h.Get("X-Tether-Route"))
		slot, _ := strconv.Atoi(f[0])
		matched := -1
		if len(f) == 3 && f[1] == "prefix" {
			matched, _ = strconv.Atoi(f[2])
		}
		return slot, matched
	}
	// No events yet: placed as before (no block size known).
	first, _ := gen(ctx)
	testenv.WaitFor(t, "the first turn indexed", func() bool {
		st, _, _ := d.KVEventsStatus()
		return len(st[urls[first]]) == 1 && st[urls[first]][0].Blocks >= 20
	})
	slot, matched := gen(ctx + "," + kvIDs(5000, 40))
	if slot != first || matched != 320 {
		t.Fatalf("next turn on %d (first %d) matched %d", slot, first, matched)
	}
	st, ix, ok := d.KVEventsStatus()
	if !ok || ix.Entries == 0 || st[urls[first]][0].Batches == 0 || !st[urls[first]][0].Connected {
		t.Fatalf("status %+v index %+v", st, ix)
	}
	// /metrics shows it.
	rec := httptest.NewRecorder()
	d.Metrics.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for _, m := range []string{"tether_kv_blocks_indexed{rank=\"0\",url=\"" + urls[first] + "\"} 22", "tether_kv_prefix_decisions_total 2", "tether_kv_index_entries 22"} {
		if !strings.Contains(rec.Body.String(), m) {
			t.Fatalf("/metrics lacks %q", m)
		}
	}
	// The engine restarts: its entries go, routing goes on.
	es[first].Restart()
	testenv.WaitFor(t, "restarted engine cleared", func() bool {
		st, _, _ := d.KVEventsStatus()
		return st[urls[first]][0].Blocks == 0 && st[urls[first]][0].Lost == 1
	})
	if slot, matched := gen(ctx); matched > 0 {
		st, _, _ := d.KVEventsStatus()
		t.Fatalf("matched %d on a restarted fleet: slot %d (first %d) %+v", matched, slot, first, st)
	}
	// An unhealthy worker's entries are cleared.
	slot, _ = gen(ctx)
	testenv.WaitFor(t, "indexed again", func() bool {
		st, _, _ := d.KVEventsStatus()
		return st[urls[slot]][0].Blocks > 0
	})
	d.Table.Get(slot).SetState(worker.Unhealthy)
	testenv.WaitFor(t, "unhealthy worker cleared", func() bool {
		st, _, _ := d.KVEventsStatus()
		return st[urls[slot]][0].Blocks == 0
	})
	d.Table.Get(slot).SetState(worker.Healthy)
	// A publisher lost again and again: requests are still routed.
	es[2].Restart()
	for i := 0; i < 5; i++ {
		gen(kvIDs(7000+100*i, 50))
	}
}

// TestKVEventsSGLangRank: a worker of two data-parallel ranks (events at
// the endpoint's port + rank); a request whose prefix rank 1 holds goes
// to that worker with routed_dp_rank 1 in its body, which the fake SGLang
// engine receives (it refuses a malformed body), and the answer is whole.
func TestKVEventsSGLangRank(t *testing.T) {
	es, urls := fakeFleet(t, 1, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, BlockTokens: 16})
	var pubs [2]*kvevents.Publisher
	for try := 0; pubs[1] == nil; try++ {
		if try == 50 {
			t.Fatal("no two free consecutive ports for the ranks' publishers")
		}
		p0, err := kvevents.NewPublisher(kvevents.PublisherConfig{})
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(strings.TrimPrefix(p0.Endpoint(), "tcp://"))
		n, _ := strconv.Atoi(port)
		p1, err := kvevents.NewPublisher(kvevents.PublisherConfig{Addr: "127.0.0.1:" + strconv.Itoa(n+1)})
		if err != nil {
			p0.Close()
			continue
		}
		pubs = [2]*kvevents.Publisher{p0, p1}
	}
	for _, p := range pubs {
		t.Cleanup(p.Close)
	}
	d, do := runRouting(t, Options{Workers: urls, BPF: "off", Routing: RoutingOptions{RouteHeader: "X-Tether-Route",
		StickyStore: "memory", KVEvents: KVEventsOptions{On: true, Ranks: 2}}})
	if err := d.SetWorkerKVEvents(urls[0], pubs[0].Endpoint(), ""); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "both ranks subscribed, the engine known as SGLang", func() bool {
		w := d.Table.Snapshot()[0]
		return pubs[0].Subscribers() > 0 && pubs[1].Subscribers() > 0 && w.Engine() == dialect.SGLang
	})
	toks := make([]uint32, 320) // 20 blocks
	ev := kvevents.Event{Kind: kvevents.Stored, BlockSize: 16}
	for i := range toks {
		toks[i] = uint32(7000 + i)
	}
	for b := 0; b < 20; b++ {
		ev.Hashes = append(ev.Hashes, uint64(100+b))
	}
	ev.Tokens = toks
	if _, err := pubs[1].Publish(&kvevents.Batch{TS: 1, Rank: 1, Events: []kvevents.Event{ev}}, kvevents.MapForm, kvevents.HashInt); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "rank 1's blocks indexed", func() bool {
		st, _, _ := d.KVEventsStatus()
		for _, s := range st[urls[0]] {
			if s.Rank == 1 && s.Blocks >= 20 {
				return true
			}
		}
		return false
	})
	st, h, b := do("POST", "/generate", `{"input_ids":[`+kvIDs(7000, 320)+`,5,6,7],"sampling_params":{"max_new_tokens":4}}`)
	if st != 200 || !strings.Contains(string(b), "output_ids") {
		t.Fatalf("generate: %d %s", st, b)
	}
	if got := h.Get("X-Tether-Route"); got != "0 prefix 320" {
		t.Fatalf("route %q", got)
	}
	if r := es[0].Stats().RoutedRanks; r[1] != 1 || r[0] != 0 {
		t.Fatalf("the engine got ranks %v, want one request on rank 1", r)
	}
	if last := string(es[0].LastBody("/generate")); !strings.HasPrefix(last, `{"routed_dp_rank":1,"input_ids":[7000,`) {
		t.Fatalf("body upstream %.80q", last)
	}
}
