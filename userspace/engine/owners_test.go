package engine

import (
	"fmt"
	"sync"
	"testing"
)

func TestOwners(t *testing.T) {
	o := NewOwners(0)
	rel := o.Acquire("r1", 3)
	if s, ok := o.Owner([]byte("r1")); !ok || s != 3 {
		t.Fatalf("owner %d %v", s, ok)
	}
	// A retry on the same worker: counted twice.
	rel2 := o.Acquire("r1", 3)
	rel()
	if s, ok := o.Owner([]byte("r1")); !ok || s != 3 {
		t.Fatal("released with a retry still in flight")
	}
	rel2()
	if _, ok := o.Owner([]byte("r1")); ok || o.Len() != 0 {
		t.Fatal("not released")
	}
	// The same id on two workers: ambiguous, abort goes everywhere.
	a := o.Acquire("r2", 1)
	b := o.Acquire("r2", 2)
	if _, ok := o.Owner([]byte("r2")); ok {
		t.Fatal("ambiguous id has an owner")
	}
	a()
	b()
	if o.Len() != 0 {
		t.Fatal("leak")
	}

	// Bounded: the oldest ids are dropped.
	small := NewOwners(ownerShards * 4)
	var rels []func()
	for i := 0; i < 10000; i++ {
		rels = append(rels, small.Acquire(fmt.Sprint("id-", i), i%8))
	}
	if n := small.Len(); n > ownerShards*4 || n < ownerShards*2 {
		t.Fatalf("len %d, cap %d", n, ownerShards*4)
	}
	if _, ok := small.Owner([]byte("id-0")); ok {
		t.Error("oldest id kept")
	}
	if s, ok := small.Owner([]byte("id-9999")); !ok || s != 9999%8 {
		t.Error("newest id dropped")
	}
	if small.Dropped() == 0 {
		t.Error("no drops counted")
	}
	// Releasing dropped ids is harmless, and a reused id is not released
	// by its dropped predecessor.
	for _, r := range rels {
		r()
	}
	if small.Len() != 0 {
		t.Fatalf("len %d after releasing all", small.Len())
	}
	old := small.Acquire("x", 1)
	for i := 0; i < 10000; i++ {
		small.Acquire(fmt.Sprint("y-", i), 0)
	}
	cur := small.Acquire("x", 2)
	old() // the dropped one
	if s, ok := small.Owner([]byte("x")); !ok || s != 2 {
		t.Fatal("stale release removed the new entry")
	}
	cur()

	// Concurrent use (-race).
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				r := o.Acquire(fmt.Sprint(g, "-", i%50), g)
				o.Owner([]byte(fmt.Sprint(g, "-", i%50)))
				r()
			}
		}()
	}
	wg.Wait()
	if o.Len() != 0 {
		t.Fatalf("len %d", o.Len())
	}
}
