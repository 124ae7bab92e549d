package worker

import (
	"sync"
	"sync/atomic"
)

// Table holds the workers by slot: the <idx> of a w<idx>-<rest> session
// id is the slot, so a session's turns always reach the worker that holds
// its state. It is a copy-on-write snapshot: readers take it with one
// atomic load and never a lock.
type Table struct {
	mu    sync.Mutex // serializes writers
	slots atomic.Pointer[[]*Worker]
	// epoch counts membership changes (a worker put into or removed from
	// a slot): a fan-out that began at one epoch and ends at another did
	// not reach the fleet as it is now.
	epoch atomic.Uint64
	// hook, when set, sees every change of membership (SetHook).
	hook atomic.Pointer[func(w *Worker, ev TableEvent)]
}

// TableEvent is a change of the table's membership.
type TableEvent uint8

const (
	Putting TableEvent = iota // w is about to become routable (Put)
	PutDone                   // w is routable
	Removed                   // w left its slot
)

// SetHook sets the function told of every change of membership: a worker
// before it becomes routable (the fleet fences a worker whose weights are
// not the fleet's), once it is, and once it is removed.
func (t *Table) SetHook(f func(w *Worker, ev TableEvent)) { t.hook.Store(&f) }

// Epoch returns the membership epoch: it changes whenever a worker is
// put into or removed from a slot.
func (t *Table) Epoch() uint64 { return t.epoch.Load() }

// NewTable returns an empty table.
func NewTable() *Table {
	t := &Table{}
	empty := []*Worker{}
	t.slots.Store(&empty)
	return t
}

// Snapshot returns the workers indexed by slot; nil entries are empty
// slots. The slice must not be modified.
func (t *Table) Snapshot() []*Worker { return *t.slots.Load() }

// Get returns the worker in slot i, or nil.
func (t *Table) Get(i int) *Worker {
	s := t.Snapshot()
	if i < 0 || i >= len(s) {
		return nil
	}
	return s[i]
}

// Put places w in slot w.Slot, replacing whatever was there.
func (t *Table) Put(w *Worker) {
	h := t.hook.Load()
	if h != nil {
		(*h)(w, Putting)
	}
	t.put(w)
	if h != nil {
		(*h)(w, PutDone)
	}
}

func (t *Table) put(w *Worker) {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.Snapshot()
	n := len(old)
	if w.Slot >= n {
		n = w.Slot + 1
	}
	next := make([]*Worker, n)
	copy(next, old)
	next[w.Slot] = w
	t.slots.Store(&next)
	t.epoch.Add(1)
}

// Remove empties slot i and returns the worker that was there.
func (t *Table) Remove(i int) *Worker {
	w := t.remove(i)
	if h := t.hook.Load(); h != nil && w != nil {
		(*h)(w, Removed)
	}
	return w
}

func (t *Table) remove(i int) *Worker {
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.Snapshot()
	if i < 0 || i >= len(old) || old[i] == nil {
		return nil
	}
	next := make([]*Worker, len(old))
	copy(next, old)
	w := next[i]
	next[i] = nil
	for len(next) > 0 && next[len(next)-1] == nil {
		next = next[:len(next)-1]
	}
	t.slots.Store(&next)
	t.epoch.Add(1)
	return w
}

// FreeSlot returns the first empty slot below max, or -1.
func (t *Table) FreeSlot(max int) int {
	s := t.Snapshot()
	for i, w := range s {
		if w == nil {
			return i
		}
	}
	if len(s) < max {
		return len(s)
	}
	return -1
}
