// Adds: a worker added at run time waits, holding no slot, for its first
// good health check; then it takes the first free slot.

package registry

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// pendingLocked counts the adds waiting for their first good check.
func (r *Registry) pendingLocked() int {
	n := 0
	for _, e := range r.entries {
		if e.w == nil && e.cancel != nil {
			n++
		}
	}
	return n
}

// Add registers a worker in the first free slot and returns once it passed
// a health check and is routable (or failed to within StartupTimeout, or
// ctx ended: the slot is then freed and nothing changed).
func (r *Registry) Add(ctx context.Context, rawURL string, origin Origin) (Info, error) {
	e, ctx, cancel, err := r.addBegin(ctx, rawURL, origin)
	if err != nil {
		return Info{}, err
	}
	defer cancel()
	return r.addWait(ctx, e)
}

// addBegin validates rawURL and reserves the first free slot for it.
func (r *Registry) addBegin(ctx context.Context, rawURL string, origin Origin) (*entry, context.Context, context.CancelFunc, error) {
	canon, addr, err := ParseURL(rawURL)
	if err == nil {
		err = r.notSelf(canon, addr)
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if r.opts.Probe == nil {
		return nil, nil, nil, errors.New("registry: no health prober")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, nil, nil, ErrClosed
	}
	if d := r.findAddrLocked(addr); d != nil {
		return nil, nil, nil, fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	if n := r.pendingLocked(); n >= r.opts.MaxPending {
		return nil, nil, nil, fmt.Errorf("%w (%d, at most %d at once): retry once some are up or gone", ErrTooManyPending, n, r.opts.MaxPending)
	}
	if r.freeSlotLocked() < 0 {
		return nil, nil, nil, fmt.Errorf("%w (at most %d workers)", ErrFull, r.opts.MaxWorkers)
	}
	// A pending worker holds no slot: it gets one when it first passes a
	// health check, so adds of URLs that never come up cannot fill the
	// slots. Until then it is filed under a key of its own below 0.
	r.pendingSeq--
	ctx, cancel := context.WithTimeout(ctx, r.opts.StartupTimeout)
	e := &entry{slot: r.pendingSeq, url: canon, addr: addr, origin: origin, cancel: cancel, since: time.Now()}
	r.entries[e.slot] = e
	r.log.Info("worker pending", "url", canon, "origin", origin)
	return e, ctx, cancel, nil
}

// addWait waits for a pending worker's first good health check and makes
// it routable, or frees its slot.
func (r *Registry) addWait(ctx context.Context, e *entry) (Info, error) {
	perr := r.waitHealthy(ctx, e.url)
	r.mu.Lock()
	if r.entries[e.slot] != e { // removed while pending
		u := e.url
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w: %s was removed while starting", ErrNotFound, u)
	}
	if perr != nil {
		delete(r.entries, e.slot)
		u := e.url
		r.mu.Unlock()
		r.log.Warn("worker not added", "url", u, "err", perr)
		return Info{}, fmt.Errorf("%w: %s: %v", ErrUnavailable, u, perr)
	}
	// Up: now it takes the first free slot.
	slot := r.freeSlotLocked()
	if slot < 0 {
		delete(r.entries, e.slot)
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w (at most %d workers)", ErrFull, r.opts.MaxWorkers)
	}
	delete(r.entries, e.slot)
	e.slot = slot
	r.entries[slot] = e
	w := r.activateLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker added", "slot", info.Slot, "url", info.URL, "origin", info.Origin, "state", StateHealthy)
	r.putHook(w)
	return info, nil
}

// WaitHealthy probes url until it answers, ctx ends or the startup
// timeout passes: the check an add makes before the worker takes a slot
// (the cluster's add makes it on the adding replica).
func (r *Registry) WaitHealthy(ctx context.Context, url string) error {
	if r.opts.Probe == nil {
		return errors.New("registry: no health prober")
	}
	ctx, cancel := context.WithTimeout(ctx, r.opts.StartupTimeout)
	defer cancel()
	return r.waitHealthy(ctx, url)
}

// waitHealthy probes url until it answers or ctx ends.
func (r *Registry) waitHealthy(ctx context.Context, url string) error {
	delay := 50 * time.Millisecond
	var last error
	for {
		err := r.opts.Probe(ctx, url)
		if err == nil {
			return nil
		}
		last = err
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("no healthy answer in time (last: %v)", last)
			}
			return fmt.Errorf("%v (last: %v)", ctx.Err(), last)
		case <-r.stop:
			t.Stop()
			return ErrClosed
		case <-t.C:
		}
		if delay < time.Second {
			delay *= 2
		}
	}
}
