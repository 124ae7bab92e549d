package worker

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/stats"
)

func gateWorker() *Worker { return &Worker{Stats: stats.NewHeap().Worker(0)} }

// Under load the gate never lets more than max_in_flight through, loses no
// waiter (every request is admitted in the end) and gives back every place.
func TestGateHoldsLimit(t *testing.T) {
	w := gateWorker()
	w.SetMaxInFlight(3)
	var now, max atomic.Int64
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				if a := w.Admit(1<<20, time.Minute, nil); a != Admitted {
					t.Errorf("admission %d", a)
					return
				}
				n := now.Add(1)
				for m := max.Load(); n > m && !max.CompareAndSwap(m, n); m = max.Load() {
				}
				now.Add(-1)
				w.Leave()
			}
		}()
	}
	wg.Wait()
	if m := max.Load(); m > 3 {
		t.Fatalf("%d at once through a gate of 3", m)
	}
	if w.Admitted() != 0 || w.Queued() != 0 {
		t.Fatalf("admitted %d queued %d after all left", w.Admitted(), w.Queued())
	}
}

// Waiters are let in first come, first served; raising the limit lets
// them in at once; a full queue refuses; a wait that ends returns its
// place in line.
func TestGateQueue(t *testing.T) {
	w := gateWorker()
	w.SetMaxInFlight(1)
	if w.Admit(2, time.Minute, nil) != Admitted {
		t.Fatal("first")
	}
	order := make(chan int, 2)
	for i := range 2 {
		go func() {
			if w.Admit(2, time.Minute, nil) == Admitted {
				order <- i
			}
		}()
		testenv.WaitFor(t, "the waiter queued", func() bool { return w.Queued() == i+1 })
	}
	if a := w.Admit(2, time.Minute, nil); a != QueueFull {
		t.Fatalf("third waiter: %d, want QueueFull", a)
	}
	w.Leave()
	if i := <-order; i != 0 {
		t.Fatalf("waiter %d went first", i)
	}
	w.SetMaxInFlight(0) // no limit: the other waiter goes at once
	if i := <-order; i != 1 {
		t.Fatalf("waiter %d", i)
	}
	w.SetMaxInFlight(2)
	gone := make(chan struct{})
	close(gone)
	if a := w.Admit(4, time.Minute, gone); a != QueueLeft {
		t.Fatalf("client gone: %d", a)
	}
	if a := w.Admit(4, time.Millisecond, nil); a != QueueTimeout {
		t.Fatalf("timeout: %d", a)
	}
	w.Leave()
	w.Leave()
	if w.Admitted() != 0 || w.Queued() != 0 {
		t.Fatalf("admitted %d queued %d", w.Admitted(), w.Queued())
	}
}

// TryAdmit takes a place only when one is free at once: never past the
// limit, never while a request waits in the queue.
func TestGateTryAdmit(t *testing.T) {
	w := gateWorker()
	if !w.TryAdmit() || !w.TryAdmit() {
		t.Fatal("no limit: TryAdmit refused")
	}
	w.Leave()
	w.Leave()
	w.SetMaxInFlight(1)
	if !w.TryAdmit() {
		t.Fatal("under the limit: refused")
	}
	if w.TryAdmit() {
		t.Fatal("at the limit: admitted")
	}
	got := make(chan Admission, 1)
	go func() { got <- w.Admit(8, 5*time.Second, nil) }()
	testenv.WaitFor(t, "the waiter queued", func() bool { return w.Queued() == 1 })
	if w.TryAdmit() {
		t.Fatal("admitted while one waits at the limit")
	}
	w.Leave() // the first place: handed to the waiter
	if a := <-got; a != Admitted {
		t.Fatalf("the waiter got %v", a)
	}
	w.Leave()
	if w.Admitted() != 0 {
		t.Fatalf("%d places held, want 0", w.Admitted())
	}
}
