package daemon

import (
	"fmt"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/kvevents"
)

// The cluster table carries each worker's own KV-event publisher: a
// start-up worker named by --worker-kv-events on replica A, and a worker
// added with "kv_events" through A's admin API, are subscribed to at
// those endpoints by replica B (which has no template, and was never told
// of them but through the table); a re-add through B with another replay
// endpoint changes it on A; a removal drops the endpoint on every
// replica. Replica C, without KV-event placement, says so once.
func TestClusterKVEvents(t *testing.T) {
	etcd := etcdtest.Start(t)
	es, urls := fakeFleet(t, 2, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, BlockTokens: 16,
		KVEvents: &fakeengine.KVEventsConfig{Form: kvevents.MapForm, Hashes: kvevents.HashInt, Replay: true}})
	ep := func(i int) string { return es[i].KVEventsEndpoint() }
	rp := func(i int) string { return es[i].KVEventsReplayEndpoint() }
	cl := "etcd://" + etcd.Endpoint()
	a := ctlDaemon(t, Options{Cluster: cl, Workers: urls[:1],
		Routing: RoutingOptions{KVEvents: KVEventsOptions{Workers: []string{urls[0] + "=" + ep(0) + "," + rp(0)}}}})
	b := ctlDaemon(t, Options{Cluster: cl, Routing: RoutingOptions{KVEvents: KVEventsOptions{On: true}}})
	logs := &testenv.Buffer{}
	c := ctlDaemon(t, Options{Cluster: cl, Log: slog.New(slog.NewTextHandler(logs, nil))})
	subscribed := func(d *Daemon, u, ep, rp string) func() bool {
		return func() bool {
			st, _, _ := d.KVEventsStatus()
			s := st[u]
			return len(s) == 1 && s[0].Endpoint == ep && s[0].Replay == rp && s[0].Connected
		}
	}
	testenv.WaitFor(t, "B subscribed to the start-up worker at A's flag's endpoint", subscribed(b, urls[0], ep(0), rp(0)))
	testenv.WaitFor(t, "A subscribed to it", subscribed(a, urls[0], ep(0), rp(0)))

	add := fmt.Sprintf(`{"url":%q,"kv_events":%q,"kv_events_replay":%q}`, urls[1], ep(1), rp(1))
	if r := ctlDo(t, "POST", "http://"+a.AdminAddr()+"/workers", add); r.status != 200 {
		t.Fatalf("add through A: %d %s", r.status, r.body)
	}
	testenv.WaitFor(t, "B subscribed to the worker added through A", subscribed(b, urls[1], ep(1), rp(1)))
	testenv.WaitFor(t, "A subscribed to it", subscribed(a, urls[1], ep(1), rp(1)))
	if r := ctlDo(t, "GET", "http://"+b.AdminAddr()+"/workers", ""); r.status != 200 || !strings.Contains(string(r.body), `"endpoint":"`+ep(1)+`"`) {
		t.Fatalf("B's GET /workers: %d %s", r.status, r.body)
	}
	testenv.WaitFor(t, "engine 1's publisher counts A and B", func() bool { return es[1].KVEventsSubscribers() == 2 })

	// A re-add through B with no replay: the entry changes everywhere.
	if r := ctlDo(t, "POST", "http://"+b.AdminAddr()+"/workers", fmt.Sprintf(`{"url":%q,"kv_events":%q}`, urls[1], ep(1))); r.status != 200 {
		t.Fatalf("re-add through B: %d %s", r.status, r.body)
	}
	testenv.WaitFor(t, "A without the replay", subscribed(a, urls[1], ep(1), ""))
	// A bad endpoint is refused through B, as on one host.
	if r := ctlDo(t, "POST", "http://"+b.AdminAddr()+"/workers", fmt.Sprintf(`{"url":%q,"kv_events":"tcp://*:5557"}`, urls[1])); r.status != 400 {
		t.Fatalf("a bind-form endpoint: %d %s", r.status, r.body)
	}

	// C applies the same table with placement off: one warning for both.
	testenv.WaitFor(t, "C has both workers", func() bool { return len(tableOf(c)) == 2 })
	if n := strings.Count(logs.String(), "KV-event placement is off on this replica"); n != 1 {
		t.Fatalf("C warned %d times:\n%s", n, logs.String())
	}

	// Removed through B: every replica drops the worker's endpoint.
	if r := ctlDo(t, "POST", "http://"+b.AdminAddr()+"/remove_worker?url="+url.QueryEscape(urls[1]), ""); r.status != 200 {
		t.Fatalf("remove through B: %d %s", r.status, r.body)
	}
	for _, d := range []*Daemon{a, b} {
		testenv.WaitFor(t, "the endpoint dropped", func() bool {
			d.kv.mu.Lock()
			defer d.kv.mu.Unlock()
			_, ok := d.kv.overrides[urls[1]]
			return !ok
		})
	}
	testenv.WaitFor(t, "engine 1 unsubscribed", func() bool { return es[1].KVEventsSubscribers() == 0 })
}
