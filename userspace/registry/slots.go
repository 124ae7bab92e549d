// Slots: placing a worker in a slot (at start-up, reserved for a --spawn
// process, activated, moved to another url), the slot's counters, and
// each worker's capacity.

package registry

import (
	"fmt"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// freeSlotLocked returns the first slot with no worker, no pending add and
// no removed worker still finishing, or -1.
func (r *Registry) freeSlotLocked() int {
	for i := 0; i < r.opts.MaxWorkers; i++ {
		if r.entries[i] != nil || r.retiring[i] != nil {
			continue
		}
		return i
	}
	return -1
}

// Put places a worker in slot at once, healthy, without a health check:
// the workers tetherd starts with (--worker, --demo, config file). Their
// slot counters are kept (a restarted tetherd sharing the BPF counters
// memory carries on counting).
func (r *Registry) Put(slot int, rawURL string, origin Origin) (Info, error) {
	canon, addr, err := ParseURL(rawURL)
	if err == nil {
		err = r.notSelf(canon, addr)
	}
	if err != nil {
		return Info{}, err
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return Info{}, ErrClosed
	}
	if slot < 0 || slot >= r.opts.MaxWorkers {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("slot %d: want 0..%d", slot, r.opts.MaxWorkers-1)
	}
	if d := r.findAddrLocked(addr); d != nil {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	if r.entries[slot] != nil || r.retiring[slot] != nil {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("slot %d is taken", slot)
	}
	e := &entry{slot: slot, url: canon, addr: addr, origin: origin}
	r.entries[slot] = e
	r.lastURL[slot] = canon // start-up workers keep the slot's counters
	w := r.activateLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker added", "slot", slot, "url", canon, "origin", origin, "state", StateHealthy)
	r.putHook(w)
	return info, nil
}

// Reserve holds slot for a worker that is not up yet (a --spawn process):
// it is listed as pending and routes nothing until Activate.
func (r *Registry) Reserve(slot int, rawURL string, origin Origin) error {
	canon, addr, err := ParseURL(rawURL)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if slot < 0 || slot >= r.opts.MaxWorkers {
		return fmt.Errorf("slot %d: want 0..%d", slot, r.opts.MaxWorkers-1)
	}
	if d := r.findAddrLocked(addr); d != nil {
		return fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	if r.entries[slot] != nil || r.retiring[slot] != nil {
		return fmt.Errorf("slot %d is taken", slot)
	}
	r.entries[slot] = &entry{slot: slot, url: canon, addr: addr, origin: origin, since: time.Now()}
	return nil
}

// Activate makes the pending worker of slot routable and healthy (its
// health was checked by the caller). Activating an active worker marks it
// healthy at once (a restarted --spawn process).
func (r *Registry) Activate(slot int) error {
	r.mu.Lock()
	e := r.entries[slot]
	if e == nil {
		r.mu.Unlock()
		return fmt.Errorf("%w: slot %d", ErrNotFound, slot)
	}
	if e.w != nil {
		r.mu.Unlock()
		r.ForceHealth(slot, true, "process ready")
		return nil
	}
	w := r.activateLocked(e)
	u, origin := e.url, e.origin
	r.mu.Unlock()
	r.log.Info("worker added", "slot", slot, "url", u, "origin", origin, "state", StateHealthy)
	r.putHook(w)
	return nil
}

// Retarget moves the worker of slot to another url (a --spawn process that
// had to change port). The slot's counters go on; the old pool is retired.
func (r *Registry) Retarget(slot int, rawURL string) error {
	canon, addr, err := ParseURL(rawURL)
	if err != nil {
		return err
	}
	r.mu.Lock()
	e := r.entries[slot]
	if e == nil || r.closed {
		r.mu.Unlock()
		return fmt.Errorf("%w: slot %d", ErrNotFound, slot)
	}
	if d := r.findAddrLocked(addr); d != nil && d != e {
		r.mu.Unlock()
		return fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	old, oldURL := e.w, e.url
	e.url, e.addr = canon, addr
	r.lastURL[slot] = canon
	var w *worker.Worker
	if old != nil {
		w = &worker.Worker{Slot: slot, URL: canon, Addr: addr, ID: worker.ID(canon), Stats: old.Stats,
			Pool: upstream.New(addr, old.Stats, r.opts.Pool)}
		w.SetMaxInFlight(r.capacityLocked(canon))
		w.SetState(old.BaseState())
		w.Fence(old.Fenced())
		e.w = w
		r.opts.Table.Put(w)
		r.wg.Add(1) // under the lock: Close waits for it
	}
	r.mu.Unlock()
	r.log.Info("worker moved", "slot", slot, "from", oldURL, "to", canon)
	if old != nil {
		go func() {
			defer r.wg.Done()
			r.waitIdle(old, r.opts.RemoveGrace)
			old.Pool.Close()
		}()
		r.putHook(w)
	}
	return nil
}

// activateLocked creates e's worker.Worker, healthy, and puts it in the
// table. A slot taken by a worker other than its last one starts its
// counters from zero.
func (r *Registry) activateLocked(e *entry) *worker.Worker {
	ws := r.opts.Stats.Worker(e.slot)
	switch last, seen := r.lastURL[e.slot]; {
	case !seen:
		ws.Reset()
	case last != e.url:
		resetCumulative(ws)
	}
	r.lastURL[e.slot] = e.url
	w := &worker.Worker{Slot: e.slot, URL: e.url, Addr: e.addr, ID: worker.ID(e.url), Stats: ws, Pool: upstream.New(e.addr, ws, r.opts.Pool)}
	w.SetMaxInFlight(r.capacityLocked(e.url))
	// A drain asked while the worker was pending holds from its first
	// moment in the table: it takes no new sessions or keys.
	if e.draining {
		w.SetState(worker.Draining)
	} else {
		w.SetState(worker.Healthy)
	}
	e.w, e.healthy, e.fails, e.succs, e.cancel = w, true, 0, 0, nil
	e.since = time.Now()
	r.opts.Table.Put(w)
	r.changes.Add(1)
	r.updatePanicLocked()
	return w
}

// capacityLocked returns the max_in_flight of the worker at url.
func (r *Registry) capacityLocked(url string) uint64 {
	if n, ok := r.capacity[url]; ok {
		return n
	}
	return r.opts.MaxInFlight
}

// SetCapacity gives the worker at rawURL its own max_in_flight (0: no
// limit), now if it is in a slot and whenever it takes one later (an
// admin add names it before the worker is routable). It returns the
// canonical url.
func (r *Registry) SetCapacity(rawURL string, n uint64) (string, error) {
	canon, _, err := ParseURL(rawURL)
	if err != nil {
		return "", err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.capacity[canon] = n
	for _, e := range r.entries {
		if e.url == canon && e.w != nil {
			e.w.SetMaxInFlight(n)
		}
	}
	return canon, nil
}

// resetCumulative zeroes a slot's running totals but not its gauges (in
// flight, connections): a request of the slot's previous worker that is
// still finishing decrements them back to the truth instead of wrapping
// them below zero.
func resetCumulative(w *stats.Worker) {
	for _, p := range []*uint64{&w.Requests, &w.Errors, &w.BytesUp, &w.BytesDown, &w.Retries} {
		atomic.StoreUint64(p, 0)
	}
}

func (r *Registry) putHook(w *worker.Worker) {
	if r.opts.OnPut != nil && w != nil {
		r.opts.OnPut(w)
	}
}
