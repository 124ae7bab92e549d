package fleet

import (
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/worker"
)

// safe reports whether a method never generates (never held).
func safe(method []byte) bool {
	switch string(method) {
	case "GET", "HEAD", "OPTIONS":
		return true
	}
	return false
}

// Held reports whether req must wait now: the fleet is not serving, or w
// (nil: not routed yet) is fenced, or this tetherd is retiring (Forward).
// Serving and unfenced, it is one atomic load or two.
func (f *Fleet) Held(req *httphead.Request, w *worker.Worker) bool {
	fw := f.forward.Load()
	if fw == nil && f.phase.Load() == int32(Serving) && (w == nil || w.Fenced() == 0) {
		return false
	}
	if w != nil && w == fw {
		return false
	}
	return !safe(req.Method) && !dialect.IsNeverHeld(req.Path)
}

func (f *Fleet) clearLocked(w *worker.Worker) bool {
	return f.forward.Load() != nil || f.Phase() == Serving && (w == nil || w.Fenced() == 0)
}

// Forward hands every held request, now and from now on, to w (nil: no
// more): a tetherd that retires after an upgrade while the fleet is held
// sends them to its successor through the data port, where they are held
// again until the resume, instead of keeping them until its pause timeout.
func (f *Fleet) Forward(w *worker.Worker) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.forward.Store(w)
	if w != nil {
		f.wakeLocked()
	}
}

// Forwarding returns where held requests go instead (nil: they wait).
func (f *Fleet) Forwarding() *worker.Worker { return f.forward.Load() }

// Wait holds a request until the fleet serves and w (nil: any) is not
// fenced, or something changed that may free it (a fence lifted, a worker
// added, a phase changed: the caller routes it again and asks Held
// again, so a worker removed or replaced meanwhile is not waited for),
// gone closes, or until passes. Waiters are woken in arrival order.
func (f *Fleet) Wait(w *worker.Worker, gone <-chan struct{}, until time.Time) worker.HoldResult {
	f.mu.Lock()
	if f.clearLocked(w) {
		f.mu.Unlock()
		return worker.HoldReleased
	}
	if len(f.waiters) >= f.maxHeldLocked() {
		f.mu.Unlock()
		f.full.Add(1)
		return worker.HoldFull
	}
	wt := &waiter{ch: make(chan struct{})}
	f.waiters = append(f.waiters, wt)
	f.heldTotal.Add(1)
	f.mu.Unlock()
	d := until.Sub(f.cfg.Now())
	if d < 0 {
		d = 0
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-wt.ch:
		f.released.Add(1)
		return worker.HoldReleased
	case <-t.C:
		f.drop(wt)
		f.timeouts.Add(1)
		return worker.HoldTimeout
	case <-gone:
		f.drop(wt)
		f.left.Add(1)
		return worker.HoldLeft
	}
}

// drop removes a waiter that stopped waiting.
func (f *Fleet) drop(wt *waiter) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, x := range f.waiters {
		if x == wt {
			f.waiters = append(f.waiters[:i], f.waiters[i+1:]...)
			return
		}
	}
}

func (f *Fleet) maxHeldLocked() int {
	n := 0
	if f.cfg.Table != nil {
		for _, w := range f.cfg.Table.Snapshot() {
			if w != nil {
				n++
			}
		}
	}
	return f.cfg.MaxHeldPerWorker * max(n, 1)
}

// wakeLocked wakes every waiter, in arrival order: each checks whether
// it may go (f.mu held).
func (f *Fleet) wakeLocked() {
	ws := f.waiters
	f.waiters = nil
	for _, wt := range ws {
		if !wt.done {
			wt.done = true
			close(wt.ch)
		}
	}
}

// Held returns how many requests wait in the hold now.
func (f *Fleet) HeldNow() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.waiters)
}

// Counts are the hold's totals.
type Counts struct {
	Held, Released, Full, Timeouts uint64
	Cycles                         uint64
}

// Counts returns the hold's totals.
func (f *Fleet) Counts() Counts {
	f.mu.Lock()
	c := f.cycles
	f.mu.Unlock()
	return Counts{Held: f.heldTotal.Load(), Released: f.released.Load(), Full: f.full.Load(), Timeouts: f.timeouts.Load(), Cycles: c}
}
