// Package worker is tether's model of its backend workers, which every
// plane reads and writes: the worker table (a copy-on-write snapshot by
// stable slot), each Worker's state and identity, its gate (the requests
// in flight held to max_in_flight, gate.go), its fences (fence.go), the
// kind of engine behind it (engine.go) and that engine's last load
// reading (engine_load.go). It decides nothing: package route picks a
// worker for a request, health checks, drains, the fleet control and the
// load poller set what this package holds.
//
// The hot path reads the table with one atomic load and each worker's
// state, fence and engine signals with one atomic load each; nothing here
// takes a lock on the way of a request without a queue.
package worker

import (
	"strconv"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/keyhash"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
)

// State of a worker.
type State int32

const (
	Healthy   State = iota // routable
	Unhealthy              // failing health checks: no new sessions or keys
	Draining               // no new sessions or keys; existing sessions still reach it
)

func (s State) String() string {
	switch s {
	case Healthy:
		return "healthy"
	case Unhealthy:
		return "unhealthy"
	case Draining:
		return "draining"
	}
	return "unknown"
}

// MaxReasons bounds the routing reasons a worker counts its decisions by
// (route.NumReasons).
const MaxReasons = 32

// Worker is one backend in its slot.
type Worker struct {
	Slot  int
	URL   string // as configured, e.g. http://10.0.0.5:30001
	Addr  string // host:port to dial
	Pool  *upstream.Pool
	Stats *stats.Worker
	state atomic.Int32
	// ID names the worker in the sticky table (ID of its URL): an entry
	// whose ID is not the ID of the worker in its slot is stale, so a
	// worker added into a removed worker's slot inherits none of its
	// keys, and one that moved to another slot keeps them. 0: computed
	// from URL on use.
	ID uint32
	// maxInFlight: at or above this many requests in flight the worker
	// takes no new keys (0: no limit).
	maxInFlight atomic.Uint64
	gate        gate          // holds requests in flight to maxInFlight (gate.go)
	engine      atomic.Int32  // dialect.Kind (engine.go)
	fence       atomic.Uint32 // Fence* bits (fence.go)
	// decided counts the requests routed to this worker, by route.Reason:
	// GET /workers and /metrics show them per worker.
	decided [MaxReasons]atomic.Uint64

	load engineLoad // engine signals (engine_load.go)
}

// ID is the identity of the worker at url in sticky entries: 32 bits of
// its fixed hash (keyhash), never 0 (0 marks entries written before
// identities existed, which match no worker).
func ID(url string) uint32 {
	if id := uint32(keyhash.String(url)); id != 0 {
		return id
	}
	return 1
}

// Ident returns the worker's identity (its ID, or ID of its URL).
func (w *Worker) Ident() uint32 {
	if w.ID != 0 {
		return w.ID
	}
	if w.URL == "" {
		return ID("slot:" + strconv.Itoa(w.Slot))
	}
	return ID(w.URL)
}

// MaxInFlight returns the worker's capacity (0: no limit).
func (w *Worker) MaxInFlight() uint64 { return w.maxInFlight.Load() }

// SetMaxInFlight sets the worker's capacity: at or above n requests in
// flight it takes no new keys, and a request routed to it waits in its
// queue (Admit); 0 removes the limit. A raised limit lets waiters in.
func (w *Worker) SetMaxInFlight(n uint64) {
	w.maxInFlight.Store(n)
	w.gate.mu.Lock()
	w.handOffLocked()
	w.gate.mu.Unlock()
}

// Full reports whether the worker is at or above limit requests in flight
// (limit 0: never).
func (w *Worker) Full(limit uint64) bool { return limit > 0 && w.Stats.Pending() >= limit }

// State returns the worker's state for placement: a Healthy worker that
// is fenced (fence.go) is Unhealthy to it.
func (w *Worker) State() State {
	s := State(w.state.Load())
	if s == Healthy && w.fence.Load() != 0 {
		return Unhealthy
	}
	return s
}

// SetState changes the worker's state and returns the previous one.
func (w *Worker) SetState(s State) State { return State(w.state.Swap(int32(s))) }

// CountDecision counts one request routed to the worker for reason r
// (a route.Reason, below MaxReasons).
func (w *Worker) CountDecision(r int) { w.decided[r].Add(1) }

// Decided returns how many requests were routed to the worker for
// reason r.
func (w *Worker) Decided(r int) uint64 { return w.decided[r].Load() }
