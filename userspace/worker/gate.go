package worker

import (
	"sync"
	"sync/atomic"
	"time"
)

// A worker's gate holds its requests in flight to its max_in_flight (as
// HAProxy's per-server maxconn does): a request past it waits in the
// worker's FIFO queue until one ends, and gets no place (503 from the
// proxy) when the queue is full, its wait times out, or its client leaves.
// A worker with no limit costs one atomic add per request and one load
// per end.
//
// The two sides meet without a lost wake-up: Leave decrements admitted and
// then loads queued; a waiter increments queued and then (under mu)
// checks admitted again. Go's atomics are sequentially consistent, so at
// least one of the two sees the other.
type gate struct {
	admitted atomic.Int64 // requests holding a place
	queued   atomic.Int64 // len(waiters), readable without mu
	mu       sync.Mutex
	waiters  []chan struct{}
}

// Admission is the outcome of Worker.Admit.
type Admission uint8

const (
	Admitted     Admission = iota // the request holds a place: call Leave when it ends
	QueueFull                     // the worker is at its limit and its queue is full
	QueueTimeout                  // the wait in the queue timed out
	QueueLeft                     // the client left while waiting
)

// Admit takes a place among the worker's requests in flight. Under the
// worker's max_in_flight (or with none) it returns at once; at it, the
// request waits in the worker's queue (at most queueSize waiting) for up
// to timeout, or until gone is closed. Only Admitted holds a place.
func (w *Worker) Admit(queueSize int, timeout time.Duration, gone <-chan struct{}) Admission {
	g := &w.gate
	limit := w.admitLimit()
	if limit == 0 && g.queued.Load() == 0 {
		g.admitted.Add(1)
		return Admitted
	}
	g.mu.Lock()
	if len(g.waiters) == 0 && (limit == 0 || g.admitted.Load() < limit) {
		g.admitted.Add(1)
		g.mu.Unlock()
		return Admitted
	}
	if len(g.waiters) >= queueSize {
		g.mu.Unlock()
		return QueueFull
	}
	ch := make(chan struct{})
	g.waiters = append(g.waiters, ch)
	g.queued.Add(1)
	// A Leave that ran before queued went up did not see this waiter.
	w.handOffLocked()
	g.mu.Unlock()

	t := time.NewTimer(timeout)
	defer t.Stop()
	var why Admission
	select {
	case <-ch:
		return Admitted
	case <-t.C:
		why = QueueTimeout
	case <-gone:
		why = QueueLeft
	}
	g.mu.Lock()
	for i, c := range g.waiters {
		if c == ch {
			g.waiters = append(g.waiters[:i], g.waiters[i+1:]...)
			g.queued.Add(-1)
			g.mu.Unlock()
			return why
		}
	}
	g.mu.Unlock()
	// Handed a place as the wait ended: give it on.
	w.Leave()
	return why
}

// TryAdmit takes a place only if one is free at once (no limit, or under
// it with nobody queued): an event loop, which must never wait, asks this
// and hands the request to a goroutine (Admit) otherwise.
func (w *Worker) TryAdmit() bool {
	g := &w.gate
	limit := w.admitLimit()
	if g.queued.Load() != 0 {
		return false
	}
	if limit == 0 {
		g.admitted.Add(1)
		return true
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.waiters) == 0 && g.admitted.Load() < limit {
		g.admitted.Add(1)
		return true
	}
	return false
}

// Leave gives back the place of an Admitted request.
func (w *Worker) Leave() {
	g := &w.gate
	g.admitted.Add(-1)
	if g.queued.Load() > 0 {
		g.mu.Lock()
		w.handOffLocked()
		g.mu.Unlock()
	}
}

// handOffLocked gives the free places to the longest waiters (gate.mu
// held).
func (w *Worker) handOffLocked() {
	g := &w.gate
	limit := w.admitLimit()
	for len(g.waiters) > 0 && (limit == 0 || g.admitted.Load() < limit) {
		ch := g.waiters[0]
		g.waiters[0] = nil
		g.waiters = g.waiters[1:]
		g.queued.Add(-1)
		g.admitted.Add(1)
		close(ch)
	}
}

// Queued returns how many requests wait in the worker's queue.
func (w *Worker) Queued() int { return int(w.gate.queued.Load()) }

// Admitted returns how many requests hold a place (are in flight past the
// gate).
func (w *Worker) Admitted() int { return int(w.gate.admitted.Load()) }
