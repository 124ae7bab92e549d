package stats

import (
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"
)

// TestLayout pins the sizes and offsets that headers/tether.h defines.
func TestLayout(t *testing.T) {
	if s := unsafe.Sizeof(Slot{}); s != 64 {
		t.Fatalf("sizeof(struct tether_slot_load) = 64, Slot is %d", s)
	}
	if s := unsafe.Sizeof(Worker{}); s != 64 {
		t.Fatalf("sizeof(struct tether_worker_stats) = 64, Worker is %d", s)
	}
	var sl Slot
	for _, c := range []struct {
		name string
		off  uintptr
		want uintptr
	}{
		{"active", unsafe.Offsetof(sl.Active), 0},
		{"accepted", unsafe.Offsetof(sl.Accepted), 8},
		{"closed", unsafe.Offsetof(sl.Closed), 16},
		{"pending", unsafe.Offsetof(sl.Pending), 24},
		{"steered", unsafe.Offsetof(sl.Steered), 32},
		{"steer_load", unsafe.Offsetof(sl.SteerLoad), 40},
	} {
		if c.off != c.want {
			t.Errorf("offset of slot %s = %d, want %d", c.name, c.off, c.want)
		}
	}
	var w Worker
	for _, c := range []struct {
		name string
		off  uintptr
		want uintptr
	}{
		{"in_flight", unsafe.Offsetof(w.InFlight), 0},
		{"requests", unsafe.Offsetof(w.Requests), 8},
		{"errors", unsafe.Offsetof(w.Errors), 16},
		{"bytes_up", unsafe.Offsetof(w.BytesUp), 24},
		{"bytes_down", unsafe.Offsetof(w.BytesDown), 32},
		{"retries", unsafe.Offsetof(w.Retries), 40},
		{"conns", unsafe.Offsetof(w.Conns), 48},
	} {
		if c.off != c.want {
			t.Errorf("offset of %s = %d, want %d", c.name, c.off, c.want)
		}
	}
}

func TestFromMemory(t *testing.T) {
	slotMem := make([]byte, MaxSlots*64)
	workerMem := make([]byte, MaxWorkers*64)
	tab, err := FromMemory(slotMem, workerMem)
	if err != nil {
		t.Fatal(err)
	}
	tab.Worker(3).Begin()
	tab.Slot(1).Opened()
	if workerMem[3*64+8] != 1 || workerMem[3*64] != 1 {
		t.Fatalf("worker 3 counters not written through to memory")
	}
	if slotMem[64] != 1 || slotMem[64+8] != 1 {
		t.Fatalf("slot 1 counters not written through to memory")
	}
	if _, err := FromMemory(slotMem[:10], workerMem); err == nil {
		t.Fatal("short slot memory accepted")
	}
	if _, err := FromMemory(slotMem, workerMem[:100]); err == nil {
		t.Fatal("short worker memory accepted")
	}
}

func TestConcurrentCounts(t *testing.T) {
	tab := NewHeap()
	w := tab.Worker(7)
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 1000; j++ {
				w.Begin()
				w.End(j%10 == 0)
			}
		}()
	}
	wg.Wait()
	got := w.Load()
	if got.InFlight != 0 || got.Requests != 8000 || got.Errors != 800 {
		t.Fatalf("got %+v", got)
	}
}

// steer is what the program does when it steers a connection to the slot.
func steer(s *Slot) {
	atomic.AddUint64(&s.Steered, 1)
	atomic.AddUint64(&s.SteerLoad, 1)
	atomic.AddUint64(&s.Pending, 1)
}

// TestOpenedTakesPending: an accept moves a steered connection from
// Pending to Active, SteerLoad unchanged; one the program did not count is
// added to SteerLoad; Pending never goes below 0; a close takes the
// connection off SteerLoad. Allocation-free.
func TestOpenedTakesPending(t *testing.T) {
	s := &NewHeap().slots[2]
	steer(s)
	steer(s)
	s.Opened()
	if got := s.Load(); got.Pending != 1 || got.Active != 1 || got.SteerLoad != 2 {
		t.Fatalf("2 steered, 1 accepted: %+v", got)
	}
	s.Opened()
	s.Opened() // not counted by the program (the kernel hash chose)
	if got := s.Load(); got.Pending != 0 || got.Active != 3 || got.Accepted != 3 || got.SteerLoad != 3 || got.Steered != 2 {
		t.Fatalf("2 steered, 3 accepted: %+v", got)
	}
	for range 3 {
		s.Finished()
	}
	s.Finished() // one too many: SteerLoad stops at 0
	if got := s.Load(); got.SteerLoad != 0 || got.Closed != 4 {
		t.Fatalf("after closing: %+v", got)
	}
	if a := testing.AllocsPerRun(100, func() { s.Opened(); s.Finished() }); a != 0 {
		t.Errorf("Opened/Finished allocate %.1f times", a)
	}
}

// TestSettle: the watcher's compare-and-swap on Pending, which also takes
// the settled count off SteerLoad; ResetPending and Restart.
func TestSettle(t *testing.T) {
	s := &NewHeap().slots[0]
	s.Opened() // one active connection, not counted by the program
	for range 5 {
		steer(s)
	}
	if s.Settle(4, 1) {
		t.Error("Settle with a stale pending value succeeded")
	}
	if !s.Settle(5, 2) {
		t.Fatal("Settle(5, 2) failed")
	}
	if got := s.Load(); got.Pending != 3 || got.SteerLoad != 4 {
		t.Fatalf("Settle(5, 2): %+v, want pending 3, steer_load 4", got)
	}
	if !s.Settle(3, 10) {
		t.Fatal("Settle(3, 10) failed")
	}
	if got := s.Load(); got.Pending != 0 || got.SteerLoad != 1 {
		t.Fatalf("Settle(3, 10): %+v, want pending 0 (capped), steer_load 1", got)
	}
	if s.Settle(0, 1) {
		t.Error("Settle(0, 1) reported a change")
	}

	steer(s)
	steer(s)
	s.ResetPending()
	if got := s.Load(); got.Pending != 0 || got.SteerLoad != 1 || got.Active != 1 {
		t.Fatalf("ResetPending: %+v, want pending 0, steer_load = active = 1", got)
	}

	steer(s)
	s.Restart()
	if got := s.Load(); got.Pending != 0 || got.SteerLoad != 0 || got.Active != 0 || got.Closed != 1 || got.Accepted != 1 || got.Steered != 8 {
		t.Fatalf("Restart: %+v", got)
	}
}

// TestPendingConcurrent: the program's increments (simulated), Opened and
// Finished race; Pending never wraps and SteerLoad ends = Active + Pending.
func TestPendingConcurrent(t *testing.T) {
	s := &NewHeap().slots[1]
	const n = 4000
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // the program: one count per connection it steers
		defer wg.Done()
		for range n {
			steer(s)
		}
	}()
	go func() { // the accept loop, sometimes ahead of the program
		defer wg.Done()
		for i := range n {
			s.Opened()
			if i%2 == 0 {
				s.Finished()
			}
			if p := s.Load().Pending; p > n {
				t.Errorf("pending wrapped: %d", p)
				return
			}
		}
	}()
	wg.Wait()
	got := s.Load()
	if got.Active != n/2 || got.SteerLoad != got.Active+got.Pending {
		t.Fatalf("got %+v: want active %d, steer_load = active + pending", got, n/2)
	}
}

// What counts the present never wraps below 0: after ResetGauges (a new
// owner of the maps), the previous owner's connections and requests that
// end late stop at 0, while totals carry on.
func TestGaugesResetAndClamp(t *testing.T) {
	tab := NewHeap()
	s, w := tab.Slot(1), tab.Worker(3)
	s.Opened()
	w.Begin()
	w.ConnOpened()
	tab.ResetGauges()
	if got := s.Load(); got.Active != 0 || got.Accepted != 1 || got.Closed != 1 {
		t.Fatalf("slot after reset %+v", got)
	}
	s.Finished()
	w.End(true)
	w.ConnClosed()
	if got := s.Load(); got.Active != 0 || got.SteerLoad != 0 || got.Closed != 2 {
		t.Errorf("slot after a late close %+v", got)
	}
	if got := w.Load(); got.InFlight != 0 || got.Conns != 0 || got.Requests != 1 || got.Errors != 1 {
		t.Errorf("worker after a late end %+v", got)
	}
}
