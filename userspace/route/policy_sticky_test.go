package route

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cilium/ebpf"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// countingTable counts the writes that reach a table.
type countingTable struct {
	sticky.Table
	writes atomic.Int64
}

func (c *countingTable) Insert(k uint64, e sticky.Entry) (sticky.Entry, bool) {
	c.writes.Add(1)
	return c.Table.Insert(k, e)
}

func (c *countingTable) Put(k uint64, e sticky.Entry) {
	c.writes.Add(1)
	c.Table.Put(k, e)
}

// stickyTables returns fresh tables of both kinds: the in-process LRU and a
// throwaway BPF LRU map (not the pinned one) when BPF is available.
func stickyTables(t *testing.T) map[string]func() sticky.Table {
	out := map[string]func() sticky.Table{
		"memory": func() sticky.Table { return sticky.NewMemory(0) },
	}
	t.Run("bpf-available", func(t *testing.T) { testenv.RequireBPF(t) })
	spec := sticky.MapSpec()
	spec.Pinning = ebpf.PinNone
	if m, err := ebpf.NewMap(spec); err == nil {
		m.Close()
		out["bpf"] = func() sticky.Table {
			m, err := ebpf.NewMap(spec)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Close() })
			bt, err := sticky.NewBPF(m)
			if err != nil {
				t.Fatal(err)
			}
			return bt
		}
	}
	return out
}

func TestStickyPolicy(t *testing.T) {
	for name, newTable := range stickyTables(t) {
		t.Run(name, func(t *testing.T) {
			const n = 4
			tab, _ := testWorkers(t, n)
			ws := tab.Snapshot()
			ct := &countingTable{Table: newTable()}
			clock := sticky.Now()
			now := func() int64 { return clock }
			advance := func(d time.Duration) { clock += int64(d) }
			rt := testRouter(t, tab, PolicyConfig{Kind: PolicySticky, Sticky: ct, PolicySettings: PolicySettings{StickyTTL: time.Minute}, Now: now})

			route := func(key string) Decision {
				t.Helper()
				d := rt.Route(keyReq(t, key), nil)
				if d.Worker == nil {
					t.Fatalf("key %q: %+v", key, d)
				}
				return d
			}

			// New keys on idle workers: least loaded, rotating tie-break.
			seen := map[int]bool{}
			for i := 0; i < n; i++ {
				d := route(fmt.Sprintf("new-%d", i))
				if d.Reason != ReasonStickyNew {
					t.Fatalf("reason %v", d.Reason)
				}
				seen[d.Worker.Slot] = true
			}
			if len(seen) != n {
				t.Errorf("%d idle new keys went to %d workers only", n, len(seen))
			}

			// A new key goes to the least loaded; later turns follow it
			// even once it is the busiest.
			for i, w := range ws {
				for j := 0; j < 10-i; j++ { // loads 10, 9, 8, 7
					w.Stats.Begin()
				}
			}
			d := route("traj-1")
			if d.Worker.Slot != n-1 || d.Reason != ReasonStickyNew {
				t.Fatalf("new key: %+v, want least loaded slot %d", d, n-1)
			}
			owner := d.Worker
			for j := 0; j < 20; j++ {
				owner.Stats.Begin()
			}
			writes := ct.writes.Load()
			for i := 0; i < 50; i++ {
				if d := route("traj-1"); d.Worker != owner || d.Reason != ReasonSticky {
					t.Fatalf("turn %d: %+v", i, d)
				}
			}
			// No table write for turns within the refresh interval.
			if w := ct.writes.Load() - writes; w != 0 {
				t.Errorf("%d table writes for 50 turns within the refresh interval", w)
			}
			// After the refresh interval: one write pushes the TTL back.
			advance(6 * time.Second)
			route("traj-1")
			route("traj-1")
			if w := ct.writes.Load() - writes; w != 1 {
				t.Errorf("%d writes after the refresh interval, want 1", w)
			}
			// Used every 40s, a 1-minute TTL never expires.
			for i := 0; i < 5; i++ {
				advance(40 * time.Second)
				if d := route("traj-1"); d.Worker != owner {
					t.Fatalf("refreshed key moved to %d", d.Worker.Slot)
				}
			}

			// TTL: idle for longer than the TTL, the key is placed anew
			// (least loaded is now slot 2).
			advance(61 * time.Second)
			if d := route("traj-1"); d.Reason != ReasonStickyNew || d.Worker.Slot != 2 {
				t.Fatalf("after TTL: %+v, want new on slot 2", d)
			}
			if d := route("traj-1"); d.Reason != ReasonSticky || d.Worker.Slot != 2 {
				t.Fatalf("after reassignment: %+v", d)
			}

			// finish_session forgets the key; an unknown one is a no-op.
			if !rt.CurrentPolicy().FinishSession("traj-1") {
				t.Error("FinishSession of a known key: false")
			}
			if rt.CurrentPolicy().FinishSession("traj-1") || rt.CurrentPolicy().FinishSession("never-seen") {
				t.Error("FinishSession of an unknown key: true")
			}
			d = route("traj-1")
			if d.Reason != ReasonStickyNew {
				t.Fatalf("after finish: %+v", d)
			}

			// An unhealthy owner loses its keys to the least loaded healthy
			// worker; they stay there after it recovers.
			lost := d.Worker
			lost.SetState(worker.Unhealthy)
			d2 := route("traj-1")
			if d2.Worker == lost || d2.Reason != ReasonStickyFailover {
				t.Fatalf("unhealthy owner: %+v", d2)
			}
			lost.SetState(worker.Healthy)
			if d3 := route("traj-1"); d3.Worker != d2.Worker {
				t.Fatalf("after recovery: %d, want %d", d3.Worker.Slot, d2.Worker.Slot)
			}
			// A target worker header still wins over the sticky entry.
			if d := rt.Route(parseReq(t, "/generate", "X-Session-ID: traj-1", "X-SMG-Target-Worker: 0"), nil); d.Worker.Slot != 0 {
				t.Fatalf("target: %+v", d)
			}
			if ct.Errors() != 0 {
				t.Errorf("%d table errors", ct.Errors())
			}
		})
	}
}

// Two tetherd processes sharing the BPF map place a key once: the second
// follows the first's assignment even though its own least loaded worker
// differs.
func TestStickySharedAcrossProcesses(t *testing.T) {
	tables := stickyTables(t)
	newTable, ok := tables["bpf"]
	if !ok {
		t.Skip("no BPF")
	}
	shared := newTable()
	tabA, _ := testWorkers(t, 4)
	tabB, _ := testWorkers(t, 4) // own counters: loads differ
	for i := 0; i < 5; i++ {
		tabA.Get(0).Stats.Begin()
		tabB.Get(3).Stats.Begin()
	}
	a := testRouter(t, tabA, PolicyConfig{Kind: PolicySticky, Sticky: shared})
	b := testRouter(t, tabB, PolicyConfig{Kind: PolicySticky, Sticky: shared})
	for i := 0; i < 20; i++ {
		key := fmt.Sprintf("k%d", i)
		da := a.Route(keyReq(t, key), nil)
		db := b.Route(keyReq(t, key), nil)
		if da.Worker.Slot != db.Worker.Slot || db.Reason != ReasonSticky {
			t.Fatalf("key %s: process A %d (%v), process B %d (%v)", key, da.Worker.Slot, da.Reason, db.Worker.Slot, db.Reason)
		}
	}
	// finish_session in one process is seen by the other.
	if !b.CurrentPolicy().FinishSession("k1") {
		t.Fatal("FinishSession k1")
	}
	if d := a.Route(keyReq(t, "k1"), nil); d.Reason != ReasonStickyNew {
		t.Fatalf("after finish in B, A: %v", d.Reason)
	}
}

func BenchmarkRouteStickyBPF(b *testing.B) {
	spec := sticky.MapSpec()
	spec.Pinning = ebpf.PinNone
	m, err := ebpf.NewMap(spec)
	if err != nil {
		b.Skip(err)
	}
	defer m.Close()
	bt, _ := sticky.NewBPF(m)
	tab, _ := testWorkers(b, 16)
	rt := testRouter(b, tab, PolicyConfig{Kind: PolicySticky, Sticky: bt})
	req := keyReq(b, "sampling-1:2")
	b.ReportAllocs()
	for b.Loop() {
		rt.Route(req, nil)
	}
}
