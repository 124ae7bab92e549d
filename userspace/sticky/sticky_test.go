package sticky_test

import (
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/sticky"
)

// tables returns the implementations under test: the in-process LRU and a
// throwaway (unpinned) BPF map of the sticky_sessions spec.
func tables(t *testing.T) map[string]sticky.Table {
	out := map[string]sticky.Table{"memory": sticky.NewMemory(0)}
	t.Run("bpf-available", func(t *testing.T) { testenv.RequireBPF(t) })
	if m := throwawayMap(t); m != nil {
		bt, err := sticky.NewBPF(m)
		if err != nil {
			t.Fatal(err)
		}
		out["bpf"] = bt
	}
	return out
}

// throwawayMap creates an unpinned map of the sticky_sessions spec, or
// returns nil when BPF is unavailable (RequireBPF already reported it).
func throwawayMap(t *testing.T) *ebpf.Map {
	spec := sticky.MapSpec()
	spec.Pinning = ebpf.PinNone
	m, err := ebpf.NewMap(spec)
	if err != nil {
		if testenv.InCI() {
			t.Fatalf("create map: %v", err)
		}
		t.Logf("no BPF map (%v): BPF table not tested", err)
		return nil
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func TestTableSemantics(t *testing.T) {
	for name, tab := range tables(t) {
		t.Run(name, func(t *testing.T) {
			now := sticky.Now()
			if _, ok := tab.Lookup(1); ok {
				t.Fatal("empty table has key 1")
			}
			e := sticky.Entry{Worker: 3, Expires: now + int64(time.Minute)}
			if got, ok := tab.Insert(1, e); !ok || got != e {
				t.Fatalf("Insert new: %v %v", got, ok)
			}
			// Insert does not replace; it returns the holder.
			if got, ok := tab.Insert(1, sticky.Entry{Worker: 5, Expires: now}); ok || got != e {
				t.Fatalf("Insert existing: %v %v, want %v false", got, ok, e)
			}
			if got, ok := tab.Lookup(1); !ok || got != e || !got.Live(now) {
				t.Fatalf("Lookup: %v %v", got, ok)
			}
			e2 := sticky.Entry{Worker: 7, Expires: now - 1}
			tab.Put(1, e2)
			if got, ok := tab.Lookup(1); !ok || got != e2 || got.Live(now) {
				t.Fatalf("Lookup after Put: %v %v (an expired entry is returned, not live)", got, ok)
			}
			if !tab.Delete(1) {
				t.Fatal("Delete existing: false")
			}
			if tab.Delete(1) {
				t.Fatal("Delete missing: true")
			}
			if _, ok := tab.Lookup(1); ok {
				t.Fatal("key 1 after Delete")
			}
			if tab.Errors() != 0 {
				t.Fatalf("%d errors", tab.Errors())
			}
			if tab.Shared() != (name == "bpf") {
				t.Fatalf("Shared = %v", tab.Shared())
			}
		})
	}
}

// Both tables are bounded LRUs: filling past capacity keeps the entries
// written recently. (A lookup through the bpf syscall does not mark a BPF
// LRU entry used; the sticky policy's TTL refresh writes are what keep a
// key in use alive there.)
func TestTableEvictsLeastRecentlyUsed(t *testing.T) {
	for name, tab := range tables(t) {
		t.Run(name, func(t *testing.T) {
			now := sticky.Now()
			const hot = 0xfeed
			tab.Put(hot, sticky.Entry{Worker: 1, Expires: now + int64(time.Hour)})
			for k := uint64(1); k <= sticky.MaxEntries*5/4; k++ {
				key := k * 0x9e3779b97f4a7c15 // spread over shards and buckets
				tab.Put(key, sticky.Entry{Worker: uint32(k % 8), Expires: now + int64(time.Hour)})
				if k%1024 == 0 {
					if _, ok := tab.Lookup(hot); !ok {
						t.Fatalf("recently written key evicted after %d puts", k)
					}
					tab.Put(hot, sticky.Entry{Worker: 1, Expires: now + int64(time.Hour)})
				}
			}
			n := 0
			for k := uint64(1); k <= sticky.MaxEntries*5/4; k++ {
				if _, ok := tab.Lookup(k * 0x9e3779b97f4a7c15); ok {
					n++
				}
			}
			t.Logf("%d of %d keys kept (capacity %d)", n, sticky.MaxEntries*5/4, sticky.MaxEntries)
			if n > sticky.MaxEntries || n < sticky.MaxEntries/2 {
				t.Errorf("kept %d keys, capacity %d", n, sticky.MaxEntries)
			}
		})
	}
}

func TestTableConcurrentInsertOneWinner(t *testing.T) {
	for name, tab := range tables(t) {
		t.Run(name, func(t *testing.T) {
			now := sticky.Now()
			const key = 42
			var wg sync.WaitGroup
			wins := make(chan uint32, 16)
			got := make(chan uint32, 16)
			for i := 0; i < 16; i++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					e, ok := tab.Insert(key, sticky.Entry{Worker: uint32(i), Expires: now + int64(time.Minute)})
					if ok {
						wins <- e.Worker
					}
					got <- e.Worker
				}()
			}
			wg.Wait()
			close(wins)
			close(got)
			if len(wins) != 1 {
				t.Fatalf("%d winners", len(wins))
			}
			w := <-wins
			for g := range got {
				if g != w {
					t.Fatalf("a loser sees worker %d, winner %d", g, w)
				}
			}
		})
	}
}

// The value layout is struct tether_sticky: {u32 worker; u32 pad; u64
// expires_ns}, and the spec that of sticky_sessions in bpf/steer.c.
func TestMapSpec(t *testing.T) {
	spec := sticky.MapSpec()
	if spec.Type != ebpf.LRUHash || spec.KeySize != 8 || spec.ValueSize != 16 || spec.MaxEntries != 65536 || spec.Name != "sticky_sessions" {
		t.Fatalf("spec %+v", spec)
	}
	if unsafe.Sizeof(sticky.Entry{}) != 16 {
		t.Fatal("Entry size")
	}
	m := throwawayMap(t)
	if m == nil {
		return
	}
	// Raw bytes written by another process (or the BPF side) read back.
	var raw [16]byte
	raw[0] = 9
	raw[8], raw[9] = 0x34, 0x12
	if err := m.Put(uint64(77), raw[:]); err != nil {
		t.Fatal(err)
	}
	bt, _ := sticky.NewBPF(m)
	if e, ok := bt.Lookup(77); !ok || e.Worker != 9 || e.Expires != 0x1234 {
		t.Fatalf("raw value read as %+v %v", e, ok)
	}
	// A map of another layout is refused.
	bad, err := ebpf.NewMap(&ebpf.MapSpec{Type: ebpf.Hash, KeySize: 8, ValueSize: 8, MaxEntries: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer bad.Close()
	if _, err := sticky.NewBPF(bad); err == nil {
		t.Error("wrong map accepted")
	}
}

// OpenPinned creates the pinned map once and reopens it: two "processes"
// see one table.
func TestOpenPinnedShared(t *testing.T) {
	testenv.RequireBPF(t)
	dir := testenv.BPFFS(t)
	a, err := sticky.OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := sticky.OpenPinned(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	e := sticky.Entry{Worker: 4, Expires: sticky.Now() + int64(time.Minute)}
	a.Put(5, e)
	if got, ok := b.Lookup(5); !ok || got != e {
		t.Fatalf("other handle reads %v %v", got, ok)
	}
}

func TestNowIsMonotonicClock(t *testing.T) {
	a := sticky.Now()
	time.Sleep(10 * time.Millisecond) // the span Now must measure
	b := sticky.Now()
	if d := time.Duration(b - a); d < 10*time.Millisecond || d > time.Second {
		t.Fatalf("Now advanced %v over a 10ms sleep", d)
	}
}

// CountLive walks a table and counts its live entries by worker identity
// (the operator's "keys and sessions pinned there"); expired ones are not
// counted.
func TestCountLive(t *testing.T) {
	for name, tab := range tables(t) {
		t.Run(name, func(t *testing.T) {
			now := sticky.Now()
			live, dead := now+int64(time.Minute), now-1
			for k := uint64(1); k <= 5; k++ {
				tab.Put(k, sticky.Entry{Worker: 0, ID: 11, Expires: live})
			}
			tab.Put(6, sticky.Entry{Worker: 1, ID: 22, Expires: live})
			tab.Put(7, sticky.Entry{Worker: 1, ID: 22, Expires: dead})
			got := sticky.CountLive(tab, now)
			if got[11] != 5 || got[22] != 1 || len(got) != 2 {
				t.Fatalf("counts %v, want 11:5 22:1", got)
			}
		})
	}
}
