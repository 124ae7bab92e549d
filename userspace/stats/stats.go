// Package stats holds tether's live counters: per listener slot and per
// backend worker. The memory is either an ordinary Go allocation (no BPF) or
// the mmap of a BPF_F_MMAPABLE array map pinned in bpffs, so that the data
// plane, every tetherd process, tetherctl and the Prometheus collector read
// and write one copy. Writers use atomic adds on the shared memory: no
// syscall on the hot path.
//
// The layouts mirror struct tether_slot_load and struct tether_worker_stats
// in headers/tether.h; TestLayout keeps them in step.
package stats

import (
	"fmt"
	"sync/atomic"
	"unsafe"
)

// Sizes mirrored from headers/tether.h.
const (
	MaxSlots   = 64   // TETHER_MAX_SLOTS
	MaxWorkers = 1024 // TETHER_MAX_WORKERS
)

// Slot mirrors struct tether_slot_load: one listener's load.
//
// The steering program balances on SteerLoad, which is Active + Pending
// kept as one word so that an accept (a connection moving from Pending to
// Active) never looks half done to it. The program adds to SteerLoad,
// Pending and Steered when it steers a new or migrating connection here;
// Opened moves one connection from Pending to Active; Finished takes it off
// Active and SteerLoad. See headers/tether.h.
type Slot struct {
	Active    uint64 // connections accepted and not yet closed
	Accepted  uint64 // connections accepted, ever
	Closed    uint64 // connections closed, ever
	Pending   uint64 // steered here by the program, not yet accepted
	Steered   uint64 // connections the program counted pending here, ever
	SteerLoad uint64 // Active + Pending, as one word: what the program balances on
	_         [2]uint64
}

// Worker mirrors struct tether_worker_stats: one backend's counters.
type Worker struct {
	InFlight  uint64
	Requests  uint64
	Errors    uint64
	BytesUp   uint64
	BytesDown uint64
	Retries   uint64
	Conns     uint64
	_         uint64
}

// Table is the counters memory for all slots and workers.
type Table struct {
	slots   []Slot
	workers []Worker
	shared  bool
}

// NewHeap returns counters kept in this process only (no BPF).
func NewHeap() *Table {
	return &Table{slots: make([]Slot, MaxSlots), workers: make([]Worker, MaxWorkers)}
}

// FromMemory returns counters backed by the given memory, typically the
// mmap of the slot_load and worker_stats BPF arrays. The slices must hold
// exactly MaxSlots and MaxWorkers entries, stay mapped for the life of the
// Table, and be 8-byte aligned (mmap memory is page aligned).
func FromMemory(slotMem, workerMem []byte) (*Table, error) {
	slots, err := view[Slot](slotMem, MaxSlots)
	if err != nil {
		return nil, fmt.Errorf("slot load memory: %w", err)
	}
	workers, err := view[Worker](workerMem, MaxWorkers)
	if err != nil {
		return nil, fmt.Errorf("worker stats memory: %w", err)
	}
	return &Table{slots: slots, workers: workers, shared: true}, nil
}

func view[T any](mem []byte, n int) ([]T, error) {
	var zero T
	size := int(unsafe.Sizeof(zero))
	if len(mem) < n*size {
		return nil, fmt.Errorf("have %d bytes, need %d", len(mem), n*size)
	}
	if uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%8 != 0 {
		return nil, fmt.Errorf("memory not 8-byte aligned")
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(mem))), n), nil
}

// Shared reports whether the counters live in BPF maps (visible to other
// processes) rather than in this process only.
func (t *Table) Shared() bool { return t.shared }

// Slot returns listener slot i's counters; i must be in [0, MaxSlots).
func (t *Table) Slot(i int) *Slot { return &t.slots[i] }

// Worker returns worker slot i's counters; i must be in [0, MaxWorkers).
func (t *Table) Worker(i int) *Worker { return &t.workers[i] }

// ResetGauges zeroes what counts the present rather than the past: every
// slot restarts (Slot.Restart) and every worker's InFlight and Conns go to
// 0. For a process that takes over counters whose previous owner is gone
// (killed): its requests and connections died with it. Totals carry on.
func (t *Table) ResetGauges() {
	for i := range t.slots {
		t.slots[i].Restart()
	}
	for i := range t.workers {
		atomic.StoreUint64(&t.workers[i].InFlight, 0)
		atomic.StoreUint64(&t.workers[i].Conns, 0)
	}
}

// Opened counts an accepted connection. The steering program counted it
// in Pending and SteerLoad when it chose this listener for its SYN: the
// connection moves from Pending to Active, SteerLoad stays. If Pending is 0, the
// program did not count it (the kernel hash chose, or a syncookie ACK), so
// it is added to SteerLoad instead: Pending never wraps below 0 and
// SteerLoad stays Active + Pending. (Counts and connections are not matched
// one to one: an uncounted connection accepted while another is pending
// takes that one's count, and the other, accepted later, is added to
// SteerLoad then; the sum is the same.) Allocation-free; 3 atomic adds, one of them a CAS that repeats
// only if the program changes Pending at the same instant.
func (s *Slot) Opened() {
	atomic.AddUint64(&s.Accepted, 1)
	atomic.AddUint64(&s.Active, 1)
	for {
		p := atomic.LoadUint64(&s.Pending)
		if p == 0 {
			atomic.AddUint64(&s.SteerLoad, 1)
			return
		}
		if atomic.CompareAndSwapUint64(&s.Pending, p, p-1) {
			return
		}
	}
}

// Finished counts a closed connection. Active stops at 0: a connection of
// a previous owner may finish after the slot restarted.
func (s *Slot) Finished() {
	atomic.AddUint64(&s.Closed, 1)
	subClamped(&s.Active, 1)
	subClamped(&s.SteerLoad, 1)
}

// subClamped takes n off *p, stopping at 0: SteerLoad must never wrap, or
// the program would see a slot of 2^64 connections.
func subClamped(p *uint64, n uint64) {
	for {
		v := atomic.LoadUint64(p)
		d := min(v, n)
		if d == 0 || atomic.CompareAndSwapUint64(p, v, v-d) {
			return
		}
	}
}

// Settle takes n off Pending, and off SteerLoad, if Pending still holds seen (n
// is capped at seen), and reports whether it did. The listener watcher uses
// it to drop counts that can no longer be accepted (a SYN whose handshake
// never completed); the compare-and-swap makes it a no-op when the program
// or Opened changed Pending since seen was read.
func (s *Slot) Settle(seen, n uint64) bool {
	n = min(n, seen)
	if n == 0 || !atomic.CompareAndSwapUint64(&s.Pending, seen, seen-n) {
		return false
	}
	subClamped(&s.SteerLoad, n)
	return true
}

// ResetPending drops every pending count, from Pending and SteerLoad: the
// slot's listener closed (what was queued migrated, counted on the slot it
// moved to).
func (s *Slot) ResetPending() {
	if p := atomic.SwapUint64(&s.Pending, 0); p != 0 {
		subClamped(&s.SteerLoad, p)
	}
}

// Restart starts the slot over for a new listening socket, which has no
// connections, accepted or queued: Active, Pending and SteerLoad go to 0, the
// connections a previous owner left uncounted are counted closed; Accepted,
// Closed and Steered carry on. Connections of the previous socket that
// finish later stop Active and SteerLoad at 0.
func (s *Slot) Restart() {
	if stale := atomic.SwapUint64(&s.Active, 0); stale != 0 {
		atomic.AddUint64(&s.Closed, stale)
	}
	atomic.StoreUint64(&s.Pending, 0)
	atomic.StoreUint64(&s.SteerLoad, 0)
}

// SlotSnapshot is a consistent-enough copy of a Slot for reporting.
type SlotSnapshot struct{ Active, Accepted, Closed, Pending, Steered, SteerLoad uint64 }

// Load reads the slot's counters.
func (s *Slot) Load() SlotSnapshot {
	return SlotSnapshot{
		Active:    atomic.LoadUint64(&s.Active),
		Accepted:  atomic.LoadUint64(&s.Accepted),
		Closed:    atomic.LoadUint64(&s.Closed),
		Pending:   atomic.LoadUint64(&s.Pending),
		Steered:   atomic.LoadUint64(&s.Steered),
		SteerLoad: atomic.LoadUint64(&s.SteerLoad),
	}
}

// Begin counts a request routed to the worker and now in flight.
func (w *Worker) Begin() {
	atomic.AddUint64(&w.Requests, 1)
	atomic.AddUint64(&w.InFlight, 1)
}

// End counts the end of a request begun with Begin. InFlight stops at 0
// (see Table.ResetGauges): a wrapped count would look like a worker with
// 2^64 requests, and placement would never choose it again.
func (w *Worker) End(failed bool) {
	subClamped(&w.InFlight, 1)
	if failed {
		atomic.AddUint64(&w.Errors, 1)
	}
}

// Pending is the number of requests in flight to the worker.
func (w *Worker) Pending() uint64 { return atomic.LoadUint64(&w.InFlight) }

// AddUp counts bytes relayed towards the worker.
func (w *Worker) AddUp(n int64) { atomic.AddUint64(&w.BytesUp, uint64(n)) }

// AddDown counts bytes relayed from the worker.
func (w *Worker) AddDown(n int64) { atomic.AddUint64(&w.BytesDown, uint64(n)) }

// Retried counts one retry (failed connect or dead pooled connection).
func (w *Worker) Retried() { atomic.AddUint64(&w.Retries, 1) }

// ConnOpened and ConnClosed track open upstream connections.
func (w *Worker) ConnOpened() { atomic.AddUint64(&w.Conns, 1) }
func (w *Worker) ConnClosed() { subClamped(&w.Conns, 1) }

// WorkerSnapshot is a copy of a Worker for reporting.
type WorkerSnapshot struct {
	InFlight, Requests, Errors, BytesUp, BytesDown, Retries, Conns uint64
}

// Load reads the worker's counters.
func (w *Worker) Load() WorkerSnapshot {
	return WorkerSnapshot{
		InFlight:  atomic.LoadUint64(&w.InFlight),
		Requests:  atomic.LoadUint64(&w.Requests),
		Errors:    atomic.LoadUint64(&w.Errors),
		BytesUp:   atomic.LoadUint64(&w.BytesUp),
		BytesDown: atomic.LoadUint64(&w.BytesDown),
		Retries:   atomic.LoadUint64(&w.Retries),
		Conns:     atomic.LoadUint64(&w.Conns),
	}
}

// Reset zeroes a worker slot's counters (a new worker took the slot).
func (w *Worker) Reset() {
	for _, p := range []*uint64{&w.InFlight, &w.Requests, &w.Errors, &w.BytesUp, &w.BytesDown, &w.Retries, &w.Conns} {
		atomic.StoreUint64(p, 0)
	}
}
