// Health and state: the hysteresis that turns observations into healthy
// and unhealthy, draining, and panic mode (every routable worker
// unhealthy).

package registry

import (
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// Panic reports whether every routable worker is unhealthy (the router
// then spreads over all of them rather than answer 503).
func (r *Registry) Panic() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.panic
}

// PanicEntered returns how many times panic mode was entered.
func (r *Registry) PanicEntered() uint64 { return r.panics.Load() }

// Thresholds returns the failures and successes of the health hysteresis.
func (r *Registry) Thresholds() (failures, successes int) {
	return r.opts.Failures, r.opts.Successes
}

// Drain stops new sessions (and new keys) going to a worker; requests for
// its existing sessions still reach it. It stays draining until removed.
func (r *Registry) Drain(id string) (Info, error) {
	r.mu.Lock()
	e, err := r.lookupLocked(id)
	if err != nil {
		r.mu.Unlock()
		return Info{}, err
	}
	if e.draining {
		info := r.infoLocked(e)
		r.mu.Unlock()
		return info, nil
	}
	was := r.stateLocked(e)
	e.draining = true
	r.applyLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker draining", "slot", info.Slot, "url", info.URL, "state_was", was, "in_flight", info.InFlight)
	return info, nil
}

// Undrain ends a worker's draining (weight-sync cycles drain and resume
// engines): it routes new sessions and keys again as soon as it is
// healthy. A worker that is not draining is left as it is.
func (r *Registry) Undrain(id string) (Info, error) {
	r.mu.Lock()
	e, err := r.lookupLocked(id)
	if err != nil {
		r.mu.Unlock()
		return Info{}, err
	}
	if !e.draining {
		info := r.infoLocked(e)
		r.mu.Unlock()
		return info, nil
	}
	e.draining = false
	r.applyLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker undrained", "slot", info.Slot, "url", info.URL, "state", info.State)
	return info, nil
}

// Report feeds one health observation about w (an active check, or a
// passive one: a failed connect). It is ignored if w no longer holds its
// slot. ok=false with passive=true counts like a failed check.
func (r *Registry) Report(w *worker.Worker, ok bool, err error, passive bool) {
	r.mu.Lock()
	e := r.entries[w.Slot]
	if e == nil || e.w != w {
		r.mu.Unlock()
		return
	}
	e.checked = time.Now()
	wasHealthy := e.healthy
	if ok {
		e.fails = 0
		e.succs++
		if !e.healthy && e.succs >= r.opts.Successes {
			e.healthy = true
		}
	} else {
		e.succs = 0
		e.fails++
		if err != nil {
			e.lastErr = err.Error()
		}
		if e.healthy && e.fails >= r.opts.Failures {
			e.healthy = false
		}
	}
	if e.healthy == wasHealthy {
		r.mu.Unlock()
		return
	}
	r.applyLocked(e)
	fails, lastErr, healthy, draining, u := e.fails, e.lastErr, e.healthy, e.draining, e.url
	r.mu.Unlock()
	if healthy {
		r.log.Info("worker healthy", "slot", w.Slot, "url", u, "draining", draining)
	} else {
		r.log.Warn("worker unhealthy", "slot", w.Slot, "url", u, "failures", fails, "passive", passive, "err", lastErr, "draining", draining)
	}
}

// ForceHealth sets a worker's health at once, bypassing the hysteresis
// (the supervisor saw its process exit, or come back ready).
func (r *Registry) ForceHealth(slot int, healthy bool, reason string) {
	r.mu.Lock()
	e := r.entries[slot]
	if e == nil || e.w == nil || e.healthy == healthy {
		r.mu.Unlock()
		return
	}
	e.healthy, e.fails, e.succs = healthy, 0, 0
	if !healthy {
		e.lastErr = reason
	}
	r.applyLocked(e)
	u := e.url
	r.mu.Unlock()
	if healthy {
		r.log.Info("worker healthy", "slot", slot, "url", u, "reason", reason)
	} else {
		r.log.Warn("worker unhealthy", "slot", slot, "url", u, "reason", reason)
	}
}

// applyLocked sets e's route state from its health and drain flag and
// returns the state it had.
func (r *Registry) applyLocked(e *entry) string {
	was := r.stateLocked(e)
	if e.w == nil {
		return was
	}
	s := worker.Unhealthy
	switch {
	case e.draining:
		s = worker.Draining
	case e.healthy:
		s = worker.Healthy
	}
	if e.w.SetState(s) != s {
		e.since = time.Now()
		r.changes.Add(1)
	}
	r.updatePanicLocked()
	return was
}

// updatePanicLocked recomputes panic mode: workers to route new sessions
// to exist, and none of them is healthy. The router then spreads over the
// unhealthy ones (reason "panic") instead of answering 503 to everything.
func (r *Registry) updatePanicLocked() {
	routable, healthy := 0, 0
	for _, e := range r.entries {
		if e.w == nil || e.draining {
			continue
		}
		routable++
		if e.healthy {
			healthy++
		}
	}
	p := routable > 0 && healthy == 0
	if p == r.panic {
		return
	}
	r.panic = p
	if p {
		r.panics.Add(1)
		r.log.Warn("all workers unhealthy: panic mode, routing to all of them rather than answer 503", "workers", routable)
	} else {
		r.log.Info("panic mode over", "healthy_workers", healthy, "workers", routable)
	}
}
