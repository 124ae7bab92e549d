package daemon

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/userspace/cluster"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
)

// replicas starts n tetherd replicas of one cluster on a real etcd.
func replicas(t *testing.T, etcd *etcdtest.Etcd, n int, opts Options) []*Daemon {
	t.Helper()
	var ds []*Daemon
	for range n {
		o := opts
		o.Cluster = "etcd://" + etcd.Endpoint()
		ds = append(ds, ctlDaemon(t, o))
	}
	for _, d := range ds {
		testenv.WaitFor(t, "the cluster link up", func() bool { return d.ClusterStatus().Up })
	}
	return ds
}

// tableOf returns slot → URL of a replica's routing table.
func tableOf(d *Daemon) map[int]string {
	m := map[int]string{}
	for _, w := range d.Table.Snapshot() {
		if w != nil {
			m[w.Slot] = w.URL
		}
	}
	return m
}

func sameTables(ds []*Daemon) bool {
	a := fmt.Sprint(tableOf(ds[0]))
	for _, d := range ds[1:] {
		if fmt.Sprint(tableOf(d)) != a {
			return false
		}
	}
	return true
}

// workerOf sends a keyed chat through d and returns the demo worker that
// answered.
func workerOf(t *testing.T, d *Daemon, key string) string {
	t.Helper()
	r := ctlDo(t, "POST", "http://"+d.Addr()+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`, "X-Session-ID", key)
	if r.status != 200 {
		t.Fatalf("keyed request through %s: %d %s", d.Addr(), r.status, r.body)
	}
	return r.header.Get("X-Tether-Demo-Worker")
}

// A worker added through one replica's admin API (REST or legacy) is in
// every replica's table within a second, in the same slot: w<idx>- ids and
// keys route identically through A, B and C; drain and removal likewise.
func TestClusterReplicasAgree(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 3, Options{})
	var urls []string
	for i := range 3 {
		urls = append(urls, startDemo(t, i).URL())
	}
	// Through A (REST), B (legacy), C (REST).
	if r := ctlDo(t, "POST", "http://"+ds[0].AdminAddr()+"/workers", `{"url":"`+urls[0]+`"}`); r.status != 200 {
		t.Fatalf("add through A: %d %s", r.status, r.body)
	}
	testenv.WaitForWithin(t, "the add seen by B and C", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[2])) == 1 })
	if r := ctlDo(t, "POST", "http://"+ds[1].AdminAddr()+"/add_worker?url="+url.QueryEscape(urls[1]), ""); r.status != 200 {
		t.Fatalf("add through B: %d %s", r.status, r.body)
	}
	if r := ctlDo(t, "POST", "http://"+ds[2].AdminAddr()+"/workers", `{"url":"`+urls[2]+`","max_in_flight":50}`); r.status != 200 {
		t.Fatalf("add through C: %d %s", r.status, r.body)
	}
	testenv.WaitForWithin(t, "three workers everywhere", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[0])) == 3 })
	// Re-adding through another replica is a no-op, as on one host.
	if r := ctlDo(t, "POST", "http://"+ds[1].AdminAddr()+"/workers", `{"url":"`+urls[0]+`"}`); r.status != 200 {
		t.Fatalf("re-add: %d %s", r.status, r.body)
	}
	if len(tableOf(ds[0])) != 3 {
		t.Fatalf("a re-add changed the table: %v", tableOf(ds[0]))
	}
	for _, d := range ds {
		if w := d.Table.Get(2); w == nil || w.MaxInFlight() != 50 {
			t.Fatalf("max_in_flight not shared: %v", w)
		}
	}

	// w<idx>- ids: the slot's worker, through every replica.
	for slot, u := range tableOf(ds[0]) {
		want := ""
		for i, du := range urls {
			if du == u {
				want = fmt.Sprint(i)
			}
		}
		sid := sessionID(slot)
		for _, d := range ds {
			if r := chat(t, d, sid); r.status != 200 || r.header.Get("X-Tether-Demo-Worker") != want {
				t.Fatalf("%s through %s: %d worker %q, want %s", sid, d.Addr(), r.status, r.header.Get("X-Tether-Demo-Worker"), want)
			}
		}
	}
	// Keys: the same worker through every replica.
	for k := range 30 {
		key := fmt.Sprintf("key-%d", k)
		w := workerOf(t, ds[0], key)
		for _, d := range ds[1:] {
			if got := workerOf(t, d, key); got != w {
				t.Fatalf("key %s: worker %s through A, %s through %s", key, w, got, d.Addr())
			}
		}
	}

	// Drain through C, then undrain through A, remove through B.
	if r := ctlDo(t, "POST", "http://"+ds[2].AdminAddr()+"/workers/0/drain", ""); r.status != 200 {
		t.Fatalf("drain: %d %s", r.status, r.body)
	}
	testenv.WaitForWithin(t, "the drain everywhere", time.Second, func() bool {
		for _, d := range ds {
			if in, err := d.Registry.Get("0"); err != nil || in.State != registry.StateDraining {
				return false
			}
		}
		return true
	})
	if r := ctlDo(t, "POST", "http://"+ds[0].AdminAddr()+"/workers/0/undrain", ""); r.status != 200 {
		t.Fatalf("undrain: %d %s", r.status, r.body)
	}
	if r := ctlDo(t, "DELETE", "http://"+ds[1].AdminAddr()+"/workers/0", ""); r.status != 200 {
		t.Fatalf("remove: %d %s", r.status, r.body)
	}
	testenv.WaitForWithin(t, "the removal everywhere", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[2])) == 2 })
	if st := ds[0].ClusterStatus(); !st.Up || st.Applied == 0 {
		t.Fatalf("status %+v", st)
	}
	if r := ctlDo(t, "GET", "http://"+ds[0].AdminAddr()+"/cluster", ""); r.status != 200 || !strings.Contains(string(r.body), `"up":true`) {
		t.Fatalf("GET /cluster: %d %s", r.status, r.body)
	}
}

// 100 parallel add and remove calls spread over three replicas leave one
// table: unique slots, each URL once, every replica equal to etcd.
func TestClusterParallelAddRemove(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 3, Options{})
	var urls []string
	for i := range 10 {
		urls = append(urls, startDemo(t, i).URL())
	}
	var wg sync.WaitGroup
	var failed atomic.Int64
	for i := range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			admin := "http://" + ds[i%3].AdminAddr()
			u := urls[(i/3)%len(urls)]
			var r ctlReply
			switch i % 4 {
			case 0:
				r = ctlDo(t, "POST", admin+"/add_worker?url="+url.QueryEscape(u), "")
			case 1:
				r = ctlDo(t, "POST", admin+"/workers", `{"url":"`+u+`"}`)
			case 2:
				r = ctlDo(t, "POST", admin+"/remove_worker?url="+url.QueryEscape(u), "")
			case 3:
				r = ctlDo(t, "DELETE", admin+"/workers/"+url.PathEscape(u), "")
			}
			if r.status >= 500 {
				failed.Add(1)
				t.Errorf("call %d: %d %s", i, r.status, r.body)
			}
		}()
	}
	wg.Wait()
	store, err := cluster.Dial([]string{"http://" + etcd.Endpoint()}, DefaultClusterName)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	tab, err := store.Load(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]string{}
	seen := map[string]bool{}
	for slot, s := range tab.Workers {
		if seen[s.URL] {
			t.Fatalf("%s twice in etcd: %v", s.URL, tab.Workers)
		}
		seen[s.URL] = true
		want[slot] = s.URL
	}
	testenv.WaitFor(t, "every replica equal to etcd", func() bool {
		for _, d := range ds {
			if fmt.Sprint(tableOf(d)) != fmt.Sprint(want) {
				return false
			}
		}
		return true
	})
	t.Logf("%d workers left in %d slots, %d calls failed", len(want), len(tab.Workers), failed.Load())
}

// A self-registered worker (a lease) is in every table while it renews,
// leaves when it stops (revoked), and also when it dies (the lease
// expires).
func TestClusterSelfRegistration(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 3, Options{})
	w0, w1 := startDemo(t, 0).URL(), startDemo(t, 1).URL()
	store, err := cluster.Dial([]string{"http://" + etcd.Endpoint()}, DefaultClusterName)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	ctx, cancel := context.WithCancel(context.Background())
	slot, done, err := cluster.Register(ctx, store, w0, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	testenv.WaitForWithin(t, "the registration everywhere", time.Second, func() bool {
		return sameTables(ds) && tableOf(ds[0])[slot] == w0
	})
	time.Sleep(3 * time.Second) // past the TTL: the renewals hold it
	if tableOf(ds[1])[slot] != w0 {
		t.Fatal("a renewed registration left the table")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("revoke: %v", err)
	}
	testenv.WaitForWithin(t, "a stopped registration gone everywhere", time.Second, func() bool { return len(tableOf(ds[2])) == 0 && sameTables(ds) })

	// A registrant that dies: its client goes away without a revoke.
	dying, err := cluster.Dial([]string{"http://" + etcd.Endpoint()}, DefaultClusterName)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := cluster.Register(context.Background(), dying, w1, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, "the second registration", func() bool { return len(tableOf(ds[0])) == 1 })
	dying.Close()
	start := time.Now()
	testenv.WaitFor(t, "the expired lease's worker gone everywhere", func() bool { return len(tableOf(ds[0])) == 0 && sameTables(ds) })
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("gone after %v with a 2s lease", d)
	}
}

// Bad or foreign data under the prefix is logged and skipped: the
// replicas keep the good entries and keep working.
func TestClusterBadData(t *testing.T) {
	etcd := etcdtest.Start(t)
	store, err := cluster.Dial([]string{"http://" + etcd.Endpoint()}, DefaultClusterName)
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	w := startDemo(t, 0).URL()
	cli := store.Client()
	ctx := context.Background()
	cli.Put(ctx, "/tether/default/workers/0003", "{not json")
	cli.Put(ctx, "/tether/default/workers/0004", `{"url":""}`)
	cli.Put(ctx, "/tether/default/workers/banana", `{"url":"http://127.0.0.1:1"}`)
	cli.Put(ctx, "/tether/default/workers/0005", `{"url":"`+w+`"}`)
	ds := replicas(t, etcd, 2, Options{})
	testenv.WaitFor(t, "the good entry applied", func() bool { return tableOf(ds[0])[5] == w && tableOf(ds[1])[5] == w })
	cli.Put(ctx, "/tether/default/workers/0006", "[]")
	testenv.WaitFor(t, "bad entries counted", func() bool { return ds[0].ClusterStatus().Skipped >= 4 })
	if r := chat(t, ds[1], sessionID(5)); r.status != 200 {
		t.Fatalf("routing beside bad data: %d", r.status)
	}
}

// etcd stopped for 30 s under load: no request fails (every replica keeps
// the last table it saw; generation requests wait in its hold, since a
// replica that cannot see the fleet key cannot know whether a weight sync
// began, and go out when the link is back), admin writes answer 503 saying
// why, the link shows down; when etcd is back every replica reconciles.
func TestClusterEtcdOutage(t *testing.T) {
	if testing.Short() {
		t.Skip("30 s outage")
	}
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 3, Options{})
	var urls []string
	for i := range 3 {
		urls = append(urls, startDemo(t, i).URL())
	}
	for _, u := range urls[:2] {
		if r := ctlDo(t, "POST", "http://"+ds[0].AdminAddr()+"/workers", `{"url":"`+u+`"}`); r.status != 200 {
			t.Fatalf("add: %d %s", r.status, r.body)
		}
	}
	testenv.WaitForWithin(t, "two workers everywhere", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[2])) == 2 })

	stop := make(chan struct{})
	var sent, failed atomic.Int64
	var wg sync.WaitGroup
	var stopOnce sync.Once
	halt := func() { stopOnce.Do(func() { close(stop) }); wg.Wait() }
	t.Cleanup(halt)
	// Longer than the outage: requests sent during it are held, not lost.
	client := &http.Client{Timeout: 90 * time.Second}
	for c := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				d := ds[(c+i)%3]
				req, _ := http.NewRequest("POST", "http://"+d.Addr()+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
				req.Header.Set("X-Session-ID", fmt.Sprintf("k%d-%d", c, i%20))
				resp, err := client.Do(req)
				sent.Add(1)
				if err != nil {
					failed.Add(1)
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					failed.Add(1)
				}
			}
		}()
	}
	etcd.Stop()
	testenv.WaitFor(t, "every replica to see the link down", func() bool {
		for _, d := range ds {
			if d.ClusterStatus().Up {
				return false
			}
		}
		return true
	})
	r := ctlDo(t, "POST", "http://"+ds[1].AdminAddr()+"/workers", `{"url":"`+urls[2]+`"}`)
	if r.status != 503 || !strings.Contains(string(r.body), "etcd") {
		t.Fatalf("admin write during the outage: %d %s, want 503 naming etcd", r.status, r.body)
	}
	if m := ctlDo(t, "GET", "http://"+ds[2].AdminAddr()+"/metrics", ""); !strings.Contains(string(m.body), "tether_cluster_up 0") {
		t.Fatal("/metrics does not say the cluster link is down")
	}
	time.Sleep(30 * time.Second) // a 30 s etcd outage, under load
	etcd.Restart()
	testenv.WaitFor(t, "every replica reconnected", func() bool {
		for _, d := range ds {
			if !d.ClusterStatus().Up {
				return false
			}
		}
		return true
	})
	if r := ctlDo(t, "POST", "http://"+ds[1].AdminAddr()+"/workers", `{"url":"`+urls[2]+`"}`); r.status != 200 {
		t.Fatalf("add after the outage: %d %s", r.status, r.body)
	}
	testenv.WaitForWithin(t, "the add after the outage everywhere", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[0])) == 3 })
	halt()
	var held uint64
	for _, d := range ds {
		held += d.Fleet.Counts().Held
	}
	if held == 0 {
		t.Fatal("no request was held while the replicas could not see etcd")
	}
	t.Logf("%d requests during and around a 30s etcd outage (%d held during it), %d failed", sent.Load(), held, failed.Load())
	if failed.Load() != 0 || sent.Load() < 100 {
		t.Fatalf("%d of %d requests failed", failed.Load(), sent.Load())
	}
}

// Clients spread over three replicas under load; one replica dies
// mid-run; its clients move to the others and every session stays on its
// worker.
func TestClusterReplicaKilled(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 3, Options{})
	for i := range 4 {
		u := startDemo(t, i).URL()
		if r := ctlDo(t, "POST", "http://"+ds[i%3].AdminAddr()+"/workers", `{"url":"`+u+`"}`); r.status != 200 {
			t.Fatalf("add: %d %s", r.status, r.body)
		}
	}
	testenv.WaitForWithin(t, "four workers everywhere", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[1])) == 4 })
	const sessions = 60
	owner := make([]string, sessions)
	for k := range sessions {
		owner[k] = workerOf(t, ds[k%3], fmt.Sprintf("traj-%d", k))
	}
	var killed atomic.Bool
	var turns, moved, wrong atomic.Int64
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 10 * time.Second}
	for k := range sessions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d := ds[k%3]
			for turn := 0; turn < 20; turn++ {
				req, _ := http.NewRequest("POST", "http://"+d.Addr()+"/v1/chat/completions", strings.NewReader(`{"messages":[{"role":"user","content":"hi"}]}`))
				req.Header.Set("X-Session-ID", fmt.Sprintf("traj-%d", k))
				resp, err := client.Do(req)
				if err != nil {
					// Its replica died: the client moves to another one
					// and sends the turn again.
					d = ds[(k/3)%2*2]
					moved.Add(1)
					turn--
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				turns.Add(1)
				if got := resp.Header.Get("X-Tether-Demo-Worker"); resp.StatusCode != 200 || got != owner[k] {
					wrong.Add(1)
					t.Errorf("traj-%d turn %d: %d on worker %q, its worker is %s", k, turn, resp.StatusCode, got, owner[k])
					return
				}
				if turn == 5 && k == 0 && killed.CompareAndSwap(false, true) {
					ds[1].Close() // killed mid-run: no drain
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("%d sessions × 20 turns over 3 replicas, one killed mid-run: %d turns, %d client moves, %d on a wrong worker", sessions, turns.Load(), moved.Load(), wrong.Load())
	if moved.Load() == 0 {
		t.Fatal("no client had to move: the kill came too late to test anything")
	}
}

// With --cluster-share-sessions a bare session id learned on one replica
// routes to its creator through the others; without it, they do not know
// it.
func TestClusterSharedSessions(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 2, Options{ClusterShareSessions: true, BadSession: route.BadSessionReject})
	for _, u := range bareSessionServers(t, 3) {
		if r := ctlDo(t, "POST", "http://"+ds[0].AdminAddr()+"/workers", `{"url":"`+u+`"}`); r.status != 200 {
			t.Fatalf("add: %d %s", r.status, r.body)
		}
	}
	testenv.WaitForWithin(t, "three workers on both", time.Second, func() bool { return sameTables(ds) && len(tableOf(ds[1])) == 3 })
	type session struct{ id, engine string }
	var ss []session
	var lag []time.Duration
	for range 30 {
		r := ctlDo(t, "POST", "http://"+ds[0].Addr()+"/sessions", "")
		var s struct {
			SessionID string `json:"session_id"`
		}
		r.json(t, &s)
		created := time.Now()
		ss = append(ss, session{s.SessionID, r.header.Get("X-Engine")})
		// Through B: the first turn may race the copy; it lands within a
		// second.
		testenv.WaitFor(t, "the session known to B", func() bool {
			r := ctlDo(t, "POST", "http://"+ds[1].Addr()+"/sessions/"+s.SessionID+"/turn", "{}")
			return r.status == 200
		})
		lag = append(lag, time.Since(created))
	}
	for _, s := range ss {
		for _, d := range ds {
			r := ctlDo(t, "POST", "http://"+d.Addr()+"/sessions/"+s.id+"/turn", "{}")
			if r.status != 200 || r.header.Get("X-Engine") != s.engine {
				t.Fatalf("session %s through %s: %d engine %q, want %s", s.id, d.Addr(), r.status, r.header.Get("X-Engine"), s.engine)
			}
		}
	}
	w, c, dropped := ds[0].ctl.shared.Counts()
	_, c1, _ := ds[1].ctl.shared.Counts()
	if w < 30 || c1 < 30 || dropped != 0 {
		t.Fatalf("A wrote %d (copied %d, dropped %d), B copied %d", w, c, dropped, c1)
	}
	var max time.Duration
	for _, l := range lag {
		max = maxDur(max, l)
	}
	t.Logf("30 learned sessions shared; slowest seen by B %v after its creation answer", max)
}

func maxDur(a, b time.Duration) time.Duration {
	if a > b {
		return a
	}
	return b
}
