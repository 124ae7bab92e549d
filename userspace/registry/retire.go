// Retirement: a removed worker leaves the table at once and keeps its
// slot until its requests in flight end (or RemoveGrace passes).

package registry

import (
	"context"
	"fmt"
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// retiree is a removed worker finishing its requests.
type retiree struct {
	e    *entry
	done chan struct{}
}

// Remove takes a worker out of its slot. Requests for its sessions follow
// --bad-session from now on; requests in flight finish. Its pool is closed
// once they did (or after RemoveGrace), and only then can a new worker take
// the slot. A pending worker's Add is cancelled.
func (r *Registry) Remove(id string) (Info, error) {
	return r.remove(id, false)
}

func (r *Registry) remove(id string, force bool) (Info, error) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return Info{}, ErrClosed
	}
	e, err := r.lookupLocked(id)
	if err != nil {
		r.mu.Unlock()
		return Info{}, err
	}
	if e.origin == OriginSpawn && !force {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w: %s (slot %d) is a --spawn process; drain it instead", ErrManaged, e.url, e.slot)
	}
	delete(r.entries, e.slot)
	if e.w == nil { // pending
		if e.cancel != nil {
			e.cancel()
		}
		info := r.infoLocked(e)
		info.State, info.Status = StateRemoved, StateRemoved
		r.mu.Unlock()
		r.log.Info("worker removed", "url", e.url, "state_was", StatePending)
		return info, nil
	}
	was := r.stateLocked(e)
	r.opts.Table.Remove(e.slot)
	rt := &retiree{e: e, done: make(chan struct{})}
	r.retiring[e.slot] = rt
	r.wg.Add(1) // under the lock: Close waits for it
	r.changes.Add(1)
	r.updatePanicLocked()
	info := r.infoLocked(e)
	info.State, info.Status = StateRemoved, StateRemoved
	r.mu.Unlock()
	r.log.Info("worker removed", "slot", e.slot, "url", e.url, "state_was", was, "in_flight", e.w.Stats.Pending())
	go r.retire(rt)
	return info, nil
}

// retire waits for a removed worker's requests, closes its pool and frees
// its slot.
func (r *Registry) retire(rt *retiree) {
	defer r.wg.Done()
	defer close(rt.done)
	w := rt.e.w
	left := r.waitIdle(w, r.opts.RemoveGrace)
	w.Pool.Close()
	r.mu.Lock()
	if r.retiring[rt.e.slot] == rt {
		delete(r.retiring, rt.e.slot)
	}
	r.mu.Unlock()
	if left > 0 {
		r.log.Warn("worker retired with requests in flight", "slot", rt.e.slot, "url", rt.e.url, "in_flight", left, "grace", r.opts.RemoveGrace)
	} else {
		r.log.Info("worker retired", "slot", rt.e.slot, "url", rt.e.url)
	}
}

// waitIdle waits until w has nothing in flight, for at most grace, and
// returns what is still in flight. A request routed just before the
// worker left its slot may begin a moment later: idle must hold for a
// short settle time.
func (r *Registry) waitIdle(w *worker.Worker, grace time.Duration) uint64 {
	const settle = 20 * time.Millisecond
	deadline := time.Now().Add(grace)
	var idleSince time.Time
	for {
		n := w.Stats.Pending()
		now := time.Now()
		if n == 0 {
			if idleSince.IsZero() {
				idleSince = now
			}
			if now.Sub(idleSince) >= settle {
				return 0
			}
		} else {
			idleSince = time.Time{}
		}
		if now.After(deadline) {
			return n
		}
		select {
		case <-r.stop:
			return w.Stats.Pending()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// WaitRetired waits until slot has no removed worker finishing (tests).
func (r *Registry) WaitRetired(ctx context.Context, slot int) error {
	r.mu.Lock()
	rt := r.retiring[slot]
	r.mu.Unlock()
	if rt == nil {
		return nil
	}
	select {
	case <-rt.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
