package daemon

import (
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
)

// Three replicas started on a fresh etcd, and workers added through A's
// admin API as soon as it answers (what launchers do): every add succeeds
// and every replica routes to every worker: an add that comes before A's
// first list of the table waits for it (bounded) instead of failing with
// a 503 that names no cause. Repeated: the window is a race with the
// first list.
func TestClusterStartupAdds(t *testing.T) {
	workers := []string{startDemo(t, 0).URL(), startDemo(t, 1).URL()}
	for run := range 6 {
		t.Run(fmt.Sprint("run", run), func(t *testing.T) {
			etcd := etcdtest.Start(t)
			var ds []*Daemon
			for range 3 {
				ds = append(ds, ctlDaemon(t, Options{Cluster: "etcd://" + etcd.Endpoint()}))
			}
			a := "http://" + ds[0].AdminAddr()
			// REST and legacy, each right after start-up.
			if r := ctlDo(t, "POST", a+"/workers", `{"url":"`+workers[0]+`"}`); r.status != 200 {
				t.Fatalf("add through A at start-up: %d %s", r.status, r.body)
			}
			if r := ctlDo(t, "POST", a+"/add_worker?url="+url.QueryEscape(workers[1]), ""); r.status != 200 {
				t.Fatalf("legacy add through A at start-up: %d %s", r.status, r.body)
			}
			testenv.WaitFor(t, "both workers on every replica", func() bool { return sameTables(ds) && len(tableOf(ds[2])) == 2 })
			// Synced is closed once the list is applied and its watch
			// created: a replica may route the listed workers a moment
			// before it says so.
			for _, d := range ds {
				select {
				case <-d.ClusterSynced():
				case <-time.After(30 * time.Second):
					t.Fatal("a replica routes the table's workers but never says it listed it")
				}
			}
			for _, d := range ds {
				testenv.WaitFor(t, "readiness", func() bool {
					return ctlDo(t, "GET", "http://"+d.Addr()+"/readiness", "").status == 200
				})
			}
		})
	}
}

// A replica whose etcd does not answer yet is not ready and does not fail
// admin writes at once: a write waits for the first list of the table
// (bounded) and goes through once etcd answers; past the bound the 503
// names its cause.
func TestClusterNotReadyBeforeFirstList(t *testing.T) {
	etcd := etcdtest.Start(t)
	etcd.Stop() // its address known, nothing answering yet
	w := startDemo(t, 0).URL()
	d := ctlDaemon(t, Options{Cluster: "etcd://" + etcd.Endpoint()})
	d.ctl.replica.SetLinkWait(500 * time.Millisecond)
	a := "http://" + d.AdminAddr()

	if st := d.ClusterStatus(); st.Synced || st.Up {
		t.Fatalf("status before etcd answered: %+v", st)
	}
	r := ctlDo(t, "GET", "http://"+d.Addr()+"/readiness", "")
	if r.status != 503 || !strings.Contains(string(r.body), "not ready") {
		t.Fatalf("/readiness before the first list: %d %s", r.status, r.body)
	}
	// Past the bound: 503 with a cause.
	r = ctlDo(t, "POST", a+"/workers", `{"url":"`+w+`"}`)
	if r.status != 503 || !strings.Contains(string(r.body), "cluster store (etcd) unavailable: ") ||
		strings.Contains(string(r.body), `unavailable: "`) || strings.Contains(string(r.body), "did not become healthy") {
		t.Fatalf("add with etcd down at start-up: %d %s", r.status, r.body)
	}
	t.Logf("add with etcd down at start-up: %d %s", r.status, r.body)

	// A write that comes while etcd is still down waits, and succeeds once
	// it answers.
	d.ctl.replica.SetLinkWait(time.Minute)
	done := make(chan ctlReply, 1)
	go func() { done <- ctlDo(t, "POST", a+"/workers", `{"url":"`+w+`"}`) }()
	select {
	case r := <-done:
		t.Fatalf("an add answered before etcd did: %d %s", r.status, r.body)
	case <-time.After(300 * time.Millisecond):
	}
	etcd.Restart()
	if r := <-done; r.status != 200 {
		t.Fatalf("add held for the first list: %d %s", r.status, r.body)
	}
	if !d.ClusterStatus().Synced {
		t.Fatal("not synced after an add went through")
	}
	testenv.WaitFor(t, "readiness", func() bool { return ctlDo(t, "GET", "http://"+d.Addr()+"/readiness", "").status == 200 })
}
