package stats

import (
	"sync"
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
