package worker

import (
	"testing"

	"github.com/tether-rl/tether/userspace/stats"
)

// Slots are stable: removing a worker shifts no other, trailing empty
// slots are dropped, the first free slot is reused.
func TestTableSlotsStable(t *testing.T) {
	st := stats.NewHeap()
	tab := NewTable()
	for i := 0; i < 4; i++ {
		tab.Put(&Worker{Slot: i, Stats: st.Worker(i)})
	}
	if w := tab.Remove(1); w == nil || w.Slot != 1 {
		t.Fatal("remove slot 1")
	}
	if tab.Get(2).Slot != 2 || tab.Get(1) != nil {
		t.Fatal("removing a slot shifted the others")
	}
	if got := tab.FreeSlot(10); got != 1 {
		t.Fatalf("first free slot %d, want 1", got)
	}
	tab.Remove(3)
	if n := len(tab.Snapshot()); n != 3 {
		t.Fatalf("trailing empty slots kept: len %d", n)
	}
	if tab.Remove(7) != nil || tab.Remove(-1) != nil {
		t.Fatal("removing a missing slot returned a worker")
	}
}

// Every change of membership moves the epoch and is told to the hook, in
// order: Putting before the worker is routable, PutDone once it is.
func TestTableHookAndEpoch(t *testing.T) {
	tab := NewTable()
	var seen []string
	tab.SetHook(func(w *Worker, ev TableEvent) {
		routable := tab.Get(w.Slot) == w
		seen = append(seen, [...]string{"putting", "put", "removed"}[ev]+map[bool]string{true: "+", false: "-"}[routable])
	})
	w := &Worker{Slot: 2, Stats: stats.NewHeap().Worker(2)}
	e0 := tab.Epoch()
	tab.Put(w)
	if tab.Epoch() == e0 {
		t.Fatal("Put did not move the epoch")
	}
	e1 := tab.Epoch()
	if tab.Remove(2) != w || tab.Epoch() == e1 {
		t.Fatal("Remove: wrong worker or epoch unchanged")
	}
	if got, want := len(seen), 3; got != want || seen[0] != "putting-" || seen[1] != "put+" || seen[2] != "removed-" {
		t.Fatalf("hook saw %v, want [putting- put+ removed-]", seen)
	}
}

func TestIdentity(t *testing.T) {
	a := &Worker{Slot: 0, URL: "http://10.0.0.5:30001"}
	b := &Worker{Slot: 3, URL: "http://10.0.0.5:30001"}
	if a.Ident() != b.Ident() || a.Ident() != ID(a.URL) || a.Ident() == 0 {
		t.Fatalf("identity depends on the slot or is 0: %#x %#x", a.Ident(), b.Ident())
	}
	if (&Worker{Slot: 1}).Ident() == (&Worker{Slot: 2}).Ident() {
		t.Fatal("workers without URL share an identity")
	}
	if c := (&Worker{ID: 7, URL: a.URL}); c.Ident() != 7 {
		t.Fatalf("an explicit ID is not the identity: %#x", c.Ident())
	}
}
