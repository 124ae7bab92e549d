package daemon

import (
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/etcdtest"
	"github.com/tether-rl/tether/userspace/admin"
	"github.com/tether-rl/tether/userspace/cluster"
	"github.com/tether-rl/tether/userspace/fleet"
)

// In a cluster every replica's page shows the cluster's worker table and
// the cluster link, and its own traffic and syncs: requests sent through
// A are A's, a pause through A is on A's timeline, while B shows the
// fleet paused (the shared phase).
func TestUIStateInCluster(t *testing.T) {
	etcd := etcdtest.Start(t)
	ds := replicas(t, etcd, 2, Options{Admin: "127.0.0.1:0"})
	a, b := ds[0], ds[1]
	for i := range 2 {
		if r := ctlDo(t, "POST", "http://"+a.AdminAddr()+"/workers", `{"url":"`+startDemo(t, i).URL()+`"}`); r.status != 200 {
			t.Fatalf("add: %d %s", r.status, r.body)
		}
	}
	testenv.WaitFor(t, "the table on both", func() bool { return sameTables(ds) && len(tableOf(b)) == 2 })
	for i := 0; i < 10; i++ {
		workerOf(t, a, "k"+string(rune('a'+i)))
	}
	sum := func(st admin.UIState) (n uint64) {
		for _, w := range st.Workers {
			n += w.RunRequests
		}
		return n
	}
	sa, sb := a.Admin.State(time.Time{}), b.Admin.State(time.Time{})
	if len(sa.Workers) != 2 || len(sb.Workers) != 2 || sa.Workers[1].URL != sb.Workers[1].URL {
		t.Fatalf("tables: %d and %d rows", len(sa.Workers), len(sb.Workers))
	}
	for _, st := range []admin.UIState{sa, sb} {
		cs, ok := st.Cluster.(*cluster.Status)
		if !ok || !cs.Up || cs.Workers != 2 {
			t.Fatalf("cluster on the page: %#v", st.Cluster)
		}
	}
	if sum(sa) != 10 || sum(sb) != 0 || sa.Instance == sb.Instance {
		t.Fatalf("own traffic: A %d requests, B %d (instances %s, %s)", sum(sa), sum(sb), sa.Instance, sb.Instance)
	}
	// The demo workers are no engines (404): 502, the fleet paused all the same.
	if r := ctlDo(t, "POST", "http://"+a.Addr()+"/pause_generation", `{"mode":"abort"}`); r.status != 502 {
		t.Fatalf("pause through A: %d %s", r.status, r.body)
	}
	testenv.WaitFor(t, "B paused", func() bool { return b.Fleet.Phase() == fleet.Paused })
	sa, sb = a.Admin.State(time.Time{}), b.Admin.State(time.Time{})
	if len(sa.Syncs) != 1 || len(sb.Syncs) != 0 {
		t.Fatalf("timelines: A %d syncs, B %d", len(sa.Syncs), len(sb.Syncs))
	}
	for _, w := range sb.Workers {
		if w.View != "paused" {
			t.Fatalf("B's row %d: %s", w.Slot, w.View)
		}
	}
	if r := ctlDo(t, "POST", "http://"+a.Addr()+"/continue_generation", ""); r.status != 502 {
		t.Fatalf("resume: %d %s", r.status, r.body)
	}
}

// GET /baseline: the counters at the start; a worker put in a slot later
// starts from zero.
func TestBaseline(t *testing.T) {
	d := ctlDaemon(t, Options{Admin: "127.0.0.1:0", Workers: []string{startDemo(t, 0).URL()}})
	d.Stats.Worker(5).Requests = 77 // left by an earlier run in an empty slot
	d.snapshotBaseline()
	b := d.ctl.ui.baseline()
	found := false
	for _, w := range b.Workers {
		if w.Slot == 5 {
			found = w.Requests == 77
		}
	}
	if !found || b.Instance != d.InstanceID || len(b.Listeners) != 1 {
		t.Fatalf("baseline: %+v", b)
	}
	if _, err := d.Registry.Put(5, startDemo(t, 5).URL(), "admin"); err != nil {
		t.Fatal(err)
	}
	for _, w := range d.ctl.ui.baseline().Workers {
		if w.Slot == 5 && w.Requests != 0 {
			t.Fatalf("slot 5's new worker keeps the old baseline: %+v", w)
		}
	}
}
