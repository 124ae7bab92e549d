package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/cluster"
	"github.com/tether-rl/tether/userspace/fleet"
)

// The weight sync across replicas (docs/cluster.md, "Weight sync across
// replicas"): the fleet's phase, target and versions live in etcd's fleet
// key; a pause through one replica holds arrivals at every replica, an
// update fences the same workers everywhere, a resume through any replica
// releases them all, and a replica that cannot see etcd holds rather than
// admits.

// clusterFleet starts one replica per opts, all of one cluster on etcd,
// in front of engines (claimed in etcd at start-up), and waits until each
// routes to every engine and has read the fleet key.
func clusterFleet(t *testing.T, etcd *etcdtest.Etcd, engines []*fakeengine.Engine, opts ...Options) []*fleetFixture {
	t.Helper()
	var urls []string
	for _, e := range engines {
		urls = append(urls, e.URL())
	}
	tr := &http.Transport{MaxIdleConnsPerHost: 16, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	client := &http.Client{Transport: tr, Timeout: 60 * time.Second}
	var fxs []*fleetFixture
	for _, o := range opts {
		o.Cluster = "etcd://" + etcd.Endpoint()
		o.Workers = urls
		d := ctlDaemon(t, o)
		fxs = append(fxs, &fleetFixture{d: d, engines: engines, base: "http://" + d.Addr(), client: client})
	}
	testenv.WaitFor(t, "every replica routing to every engine, the fleet key in sight", func() bool {
		for _, fx := range fxs {
			st := fx.d.ClusterStatus()
			if !st.Up || st.Fleet == nil || !st.Fleet.Up || len(tableOf(fx.d)) != len(engines) || fx.d.Fleet.Phase() != fleet.Serving {
				return false
			}
		}
		return true
	})
	return fxs
}

// engineRequests sums the generation requests the engines took, and
// those that waited inside a paused engine.
func engineRequests(engines []*fakeengine.Engine) (requests, parked int64) {
	for _, e := range engines {
		st := e.Stats()
		requests += st.Requests
		parked += st.ParkedWhilePaused
	}
	return
}

// fleetKey reads the fleet key as another etcd client sees it.
func fleetKey(t *testing.T, etcd *etcdtest.Etcd) (cluster.FleetRecord, bool) {
	t.Helper()
	eps, _ := cluster.ParseEndpoints("etcd://" + etcd.Endpoint())
	s, err := cluster.Dial(eps, DefaultClusterName)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	rec, ok, _, _, err := s.LoadFleet(context.Background())
	if err != nil {
		t.Fatalf("fleet key: %v", err)
	}
	return rec, ok
}

func TestClusterWeightSync(t *testing.T) {
	etcd := etcdtest.Start(t)
	engines, err := fakeengine.StartFleet(3, fakeengine.Config{Kind: fakeengine.SGLang, DecodeStep: time.Millisecond, UpdateDelay: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, e := range engines {
			e.Close()
		}
	})
	fxs := clusterFleet(t, etcd, engines, Options{}, Options{}, Options{})
	a, b, c := fxs[0], fxs[1], fxs[2]
	if _, ok := fleetKey(t, etcd); ok {
		t.Fatal("a fleet key before any sync")
	}
	for _, fx := range fxs {
		if o := fx.generate(fakeengine.SGLang, "", "before", 2); o.status != 200 {
			t.Fatalf("before the sync, through %s: %d %v", fx.base, o.status, o.err)
		}
	}

	// A pause through A: written before A answers; B and C hold.
	code, ans := a.call(t, "/pause_generation", `{"mode":"abort"}`)
	if code != 200 || ans["phase"] != "paused" || ans["cluster_error"] != nil {
		t.Fatalf("pause through A: %d %v", code, ans)
	}
	if rec, ok := fleetKey(t, etcd); !ok || rec.Phase != "paused" || rec.Mode != "abort" || rec.PhaseBy != a.d.InstanceID || rec.At == "" {
		t.Fatalf("the fleet key after A's answer: %+v (there: %v)", rec, ok)
	}
	testenv.WaitFor(t, "B and C paused", func() bool {
		return b.d.Fleet.Phase() == fleet.Paused && c.d.Fleet.Phase() == fleet.Paused
	})
	if r, err := do(b.client, "GET", b.base+"/fleet", ""); err != nil || r.status != 200 || !strings.Contains(string(r.body), `"phase":"paused"`) {
		t.Fatalf("B's /fleet while A's pause holds: %v %s", err, r.body)
	}
	before, _ := engineRequests(engines)
	done := make(chan syncOut, 6)
	for i := range 6 {
		fx := []*fleetFixture{b, c}[i%2]
		go func() { done <- fx.generate(fakeengine.SGLang, fmt.Sprintf("s%d", i), "held at B or C", 3) }()
	}
	testenv.WaitFor(t, "3 requests held at B and 3 at C", func() bool { return b.d.Fleet.HeldNow() == 3 && c.d.Fleet.HeldNow() == 3 })

	// An update through A: engine 1 refuses it. B and C learn the target
	// and fence the same worker.
	engines[1].SetFailUpdates(true)
	code, ans = a.call(t, "/update_weights_from_disk", `{"model_path":"/ckpt/v1","weight_version":"v1"}`)
	if code == 200 || ans["weight_version"] != "v1" {
		t.Fatalf("update with a refusing engine through A: %d %v", code, ans)
	}
	if rec, _ := fleetKey(t, etcd); rec.Target != "v1" || rec.Phase != "paused" || rec.Versions[engines[0].URL()] != "v1" || rec.Versions[engines[1].URL()] == "v1" {
		t.Fatalf("the fleet key after the update: %+v", rec)
	}
	for _, fx := range []*fleetFixture{b, c} {
		testenv.WaitFor(t, "the target and fences at "+fx.base, func() bool {
			f := fx.d.Fleet
			return f.Target() == "v1" && f.WorkerState(fx.d.Table.Get(1)) == "fenced" &&
				f.WorkerState(fx.d.Table.Get(0)) == "paused" && f.WorkerState(fx.d.Table.Get(2)) == "paused"
		})
	}
	if got, parked := engineRequests(engines); got != before || parked != 0 {
		t.Fatalf("while paused through A, the engines took %d requests through B and C (%d parked)", got-before, parked)
	}

	// A resume through B ends A's pause: every replica serves, the held
	// requests go out at the new version, none to the fenced engine.
	fenced := engines[1].Stats().Requests
	code, ans = b.call(t, "/continue_generation", "")
	if code != 200 || ans["phase"] != "serving" {
		t.Fatalf("resume through B: %d %v", code, ans)
	}
	testenv.WaitFor(t, "A and C serving", func() bool {
		return a.d.Fleet.Phase() == fleet.Serving && c.d.Fleet.Phase() == fleet.Serving
	})
	if p, _ := a.d.Fleet.LocalPhase(); p != fleet.Serving {
		t.Fatalf("A's own phase after B's resume: %v", p)
	}
	for range 6 {
		if o := <-done; o.status != 200 || o.finish == "abort" || len(o.versions) != 1 || o.versions[0] != "v1" {
			t.Fatalf("a request held at B or C: %d %q %v %v", o.status, o.finish, o.versions, o.err)
		}
	}
	if got := engines[1].Stats().Requests; got != fenced {
		t.Fatalf("the fenced engine took %d requests", got-fenced)
	}
	if rec, _ := fleetKey(t, etcd); rec.Phase != "serving" || rec.PhaseBy != b.d.InstanceID || rec.Target != "v1" {
		t.Fatalf("the fleet key after B's resume: %+v", rec)
	}

	// The next cycle through C and A: the fixed engine catches up.
	engines[1].SetFailUpdates(false)
	if code, ans := c.call(t, "/pause_generation", `{"mode":"in_place"}`); code != 200 {
		t.Fatalf("pause through C: %d %v", code, ans)
	}
	testenv.WaitFor(t, "A and B paused", func() bool {
		return a.d.Fleet.Phase() == fleet.Paused && b.d.Fleet.Phase() == fleet.Paused
	})
	if code, ans := c.call(t, "/update_weights_from_disk", `{"model_path":"/ckpt/v2","weight_version":"v2"}`); code != 200 {
		t.Fatalf("update through C: %d %v", code, ans)
	}
	testenv.WaitFor(t, "A and B at v2, nothing fenced", func() bool {
		for _, fx := range []*fleetFixture{a, b} {
			if fx.d.Fleet.Target() != "v2" || fx.d.Fleet.WorkerState(fx.d.Table.Get(1)) != "paused" {
				return false
			}
		}
		return true
	})
	if code, ans := a.call(t, "/continue_generation", ""); code != 200 || ans["phase"] != "serving" {
		t.Fatalf("resume through A: %d %v", code, ans)
	}
	testenv.WaitFor(t, "B and C serving", func() bool {
		return b.d.Fleet.Phase() == fleet.Serving && c.d.Fleet.Phase() == fleet.Serving
	})
	for i, fx := range fxs {
		if o := fx.generate(fakeengine.SGLang, "", "after", 2); o.status != 200 || len(o.versions) != 1 || o.versions[0] != "v2" {
			t.Fatalf("after the second cycle, through replica %d: %d %v %v", i, o.status, o.versions, o.err)
		}
	}
	if _, parked := engineRequests(engines); parked != 0 {
		t.Fatalf("%d requests waited inside a paused engine", parked)
	}
}

// A replica that cannot see etcd holds generation requests rather than
// admits them: past --pause-timeout they get 503 with Retry-After; those
// still held when the link returns are served. GETs go through. A pause
// through a replica that cannot write the key says so (not a 200), and is
// written once etcd answers.
func TestClusterLinkLossHolds(t *testing.T) {
	etcd := etcdtest.Start(t)
	engines, err := fakeengine.StartFleet(2, fakeengine.Config{Kind: fakeengine.VLLM, DecodeStep: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, e := range engines {
			e.Close()
		}
	})
	logs := &testenv.Buffer{}
	fxs := clusterFleet(t, etcd, engines,
		Options{Fleet: fleet.Settings{HoldTimeout: 300 * time.Millisecond}},
		Options{Fleet: fleet.Settings{HoldTimeout: time.Minute}, Log: slog.New(slog.NewTextHandler(logs, nil))})
	short, long := fxs[0], fxs[1]

	etcd.Stop()
	testenv.WaitFor(t, "both replicas holding, the link down", func() bool {
		for _, fx := range fxs {
			if rep := fx.d.Fleet.Report(); rep.ClusterLink != "down" || rep.Phase != "paused" {
				return false
			}
		}
		return true
	})
	before, _ := engineRequests(engines)
	// Bounded by the pause timeout: 503 with Retry-After, not a drop.
	req, _ := http.NewRequest("POST", short.base+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"x","max_tokens":2}`))
	resp, err := short.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("held past the pause timeout with the link down: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	// GETs are not held.
	if r, err := do(long.client, "GET", long.base+"/v1/models", ""); err != nil || r.status != 200 {
		t.Fatalf("GET with the link down: %d %v", r.status, err)
	}
	// Held at the other replica until the link returns.
	done := make(chan syncOut, 1)
	go func() { done <- long.generate(fakeengine.VLLM, "k", "held through the outage", 2) }()
	testenv.WaitFor(t, "1 request held", func() bool { return long.d.Fleet.HeldNow() == 1 })
	if got, _ := engineRequests(engines); got != before {
		t.Fatalf("replicas that cannot see etcd admitted %d requests", got-before)
	}
	etcd.Restart()
	if o := <-done; o.status != 200 || o.err != nil {
		t.Fatalf("the request held through the outage: %d %v", o.status, o.err)
	}
	if logs.Count("cluster link down: generation requests are held") == 0 {
		t.Fatalf("no log of the hold on link loss:\n%s", logs.String())
	}

	// A pause through a replica that cannot write the key: held there, the
	// answer says the other replicas do not know; it is written once etcd
	// answers (nobody wrote the key meanwhile).
	testenv.WaitFor(t, "the fleet key in sight again", func() bool {
		for _, fx := range fxs {
			if st := fx.d.ClusterStatus(); st.Fleet == nil || !st.Fleet.Up {
				return false
			}
		}
		return true
	})
	etcd.Stop()
	testenv.WaitFor(t, "the link down again", func() bool {
		for _, fx := range fxs {
			if fx.d.Fleet.Report().ClusterLink != "down" {
				return false
			}
		}
		return true
	})
	code, ans := short.call(t, "/pause?mode=keep&timeout_s=1", "")
	if code != http.StatusServiceUnavailable || ans["cluster_error"] == nil || ans["phase"] != "paused" {
		t.Fatalf("pause with etcd down: %d %v", code, ans)
	}
	if st := short.d.ClusterStatus(); !st.Fleet.Unwritten {
		t.Fatalf("the pause made with etcd down is not waiting to be written: %+v", st.Fleet)
	}
	etcd.Restart()
	testenv.WaitFor(t, "the pause made during the outage in the fleet key", func() bool {
		st := long.d.ClusterStatus()
		return st.Fleet != nil && st.Fleet.Up && st.Fleet.Phase == "paused"
	})
	if rec, ok := fleetKey(t, etcd); !ok || rec.Phase != "paused" || rec.PhaseBy != short.d.InstanceID {
		t.Fatalf("the fleet key after the outage: %+v (there: %v)", rec, ok)
	}
	if rep := long.d.Fleet.Report(); rep.Phase != "paused" || rep.ClusterLink != "" {
		t.Fatalf("the other replica after the outage: %+v", rep)
	}
	if code, ans := long.call(t, "/resume", ""); code != 200 || ans["phase"] != "serving" {
		t.Fatalf("resume through the other replica: %d %v", code, ans)
	}
	testenv.WaitFor(t, "the pausing replica serving", func() bool { return short.d.Fleet.Phase() == fleet.Serving })
}
