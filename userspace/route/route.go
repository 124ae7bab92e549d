// Package route decides which backend worker gets a request. Workers sit in
// stable slots: the <idx> of a w<idx>-<rest> session id is the slot, so a
// session's turns always reach the worker that holds its state. Requests
// that name no session spread to the least-loaded worker.
//
// The worker set is a copy-on-write snapshot: the hot path reads it with
// one atomic load and never takes a lock.
package route

import (
	"strconv"
	"sync"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/httphead"
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

// Worker is one backend in its slot.
type Worker struct {
	Slot  int
	URL   string // as configured, e.g. http://10.0.0.5:30001
	Addr  string // host:port to dial
	Pool  *upstream.Pool
	Stats *stats.Worker
	state atomic.Int32
	// ID names the worker in the sticky table (WorkerID of its URL): an
	// entry whose ID is not the ID of the worker in its slot is stale, so
	// a worker added into a removed worker's slot inherits none of its
	// keys, and one that moved to another slot keeps them. 0: computed
	// from URL on use.
	ID uint32
	// maxInFlight: at or above this many requests in flight the worker
	// takes no new keys (0: no limit).
	maxInFlight atomic.Uint64
	gate        gate          // holds requests in flight to maxInFlight (gate.go)
	engine      atomic.Int32  // EngineKind (engine.go)
	fence       atomic.Uint32 // Fence* bits (fence.go)
	// decided counts the requests routed to this worker, by reason
	// (Router.Route): GET /workers and /metrics show them per worker.
	decided [NumReasons]atomic.Uint64

	load engineLoad // engine signals (engine_load.go)
}

// WorkerID is the identity of the worker at url in sticky entries: 32 bits
// of its fixed hash, never 0 (0 marks entries written before identities
// existed, which match no worker).
func WorkerID(url string) uint32 {
	if id := uint32(KeyHashString(url)); id != 0 {
		return id
	}
	return 1
}

// Ident returns the worker's identity (ID, or WorkerID of its URL).
func (w *Worker) Ident() uint32 {
	if w.ID != 0 {
		return w.ID
	}
	if w.URL == "" {
		return WorkerID("slot:" + strconv.Itoa(w.Slot))
	}
	return WorkerID(w.URL)
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

// full reports whether the worker is at or above limit requests in flight
// (limit 0: never).
func (w *Worker) full(limit uint64) bool { return limit > 0 && w.Stats.Pending() >= limit }

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

// Table holds the workers by slot.
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

// BadSession says what to do with a session id that names no worker.
type BadSession int

const (
	BadSessionSpread BadSession = iota // route like a request without a session
	BadSessionReject                   // 404
)

// Reason says why a request went where it did; it labels counters.
type Reason int

const (
	ReasonSession          Reason = iota // w<idx>- prefix named a worker
	ReasonSpread                         // no session: least in flight
	ReasonBadSessionSpread               // bad session id, spread
	ReasonBadSessionReject               // bad session id, rejected
	ReasonNoWorker                       // nothing to route to
	ReasonPanic                          // every worker unhealthy: routed anyway
	// Policy reasons (policy*.go).
	ReasonTarget         // X-SMG-Target-Worker named the worker
	ReasonBadTarget      // X-SMG-Target-Worker named no worker: 400
	ReasonHash           // key: its ring owner
	ReasonHashSpill      // key: owner overloaded, spilled to a ring successor (remembered)
	ReasonHashSpilled    // key: owner still overloaded, to the worker it spilled to before
	ReasonHashReturn     // key: owner no longer overloaded, back from its spill target
	ReasonHashFailover   // key: owner unhealthy or draining, a ring successor
	ReasonSticky         // key: its sticky owner
	ReasonStickyNew      // key: first seen, least loaded
	ReasonStickyFailover // key: owner unhealthy, draining or gone, reassigned
	ReasonPrefix         // no key, --keyless=prefix: body prefix on the ring
	ReasonRid            // request id already in flight: its owner
	ReasonLearned        // bare session id: the worker that created it
	ReasonReroute        // the first worker refused the connection: another one
	// Engine-aware placement (policy_engine.go).
	ReasonVeto        // key moved off a vetoed engine (KV or queue full)
	ReasonGroup       // keyless: where the earlier samples of its prompt are
	ReasonEngineLeast // free to go anywhere: the engine with the least expected time to serve
	ReasonKVPrefix    // token ids: the engine with the least expected work given what it holds (kvprefix.go, issue 28)
	NumReasons
)

var reasonNames = [NumReasons]string{"session", "spread", "bad_session_spread", "bad_session_reject", "no_worker", "panic",
	"target", "bad_target", "hash", "hash_spill", "hash_spilled", "hash_return", "hash_failover",
	"sticky", "sticky_new", "sticky_failover", "prefix", "rid", "learned", "reroute",
	"veto", "group", "engine-least", "kv_prefix"}

func (r Reason) String() string { return reasonNames[r] }

// Router applies the routing rules to a table.
type Router struct {
	Table *Table

	// Settings a reload (SIGHUP) may change while requests are routed.
	policy     atomic.Pointer[Policy]   // nil: least in flight (spread)
	badSession atomic.Int32             // BadSession
	learning   atomic.Pointer[Learning] // nil: bare session ids are not learned

	engine atomic.Pointer[EnginePlacement] // nil: no engine-aware placement (policy_engine.go)
	prefix atomic.Pointer[PrefixPlacement] // nil: no placement by the engines' caches (kvprefix.go, issue 28)

	rr      atomic.Uint64
	reasons [NumReasons]atomic.Uint64
	// spillUntil: until this CLOCK_MONOTONIC time some key may have a
	// remembered spill (policy_hash.go); before, keyed requests skip the
	// sticky table lookup. Kept here, not in the Policy, so a reload does
	// not forget that spills exist.
	spillUntil atomic.Int64
}

// Count returns how many requests were routed for reason r.
func (rt *Router) Count(r Reason) uint64 { return rt.reasons[r].Load() }

// SetBadSession sets what happens to a session id that names no worker.
func (rt *Router) SetBadSession(b BadSession) { rt.badSession.Store(int32(b)) }

// BadSessionMode returns the bad-session mode in effect.
func (rt *Router) BadSessionMode() BadSession { return BadSession(rt.badSession.Load()) }

// Decision is the result of routing.
type Decision struct {
	Worker *Worker // nil: answer Status locally
	Status int     // 404 (bad session, reject) or 503 (no worker)
	Reason Reason
	// Done, when set, is called once the exchange with Worker ended
	// (whatever the outcome): policies that track requests in flight by
	// id release them here.
	Done func()
	// Learn, when set, wants to see the response (learn.go): the proxy
	// calls its Status, Body and End before relaying what it shows.
	Learn *Learner
	// Matched and Rank (ReasonKVPrefix, kvprefix.go): the prompt tokens
	// the chosen engine holds, and its data-parallel rank (-1: none known).
	Matched int
	Rank    int
}

// Route picks the worker for a request. body holds the first bytes of the
// request body that were buffered with the head (possibly none). The
// decision is counted by reason, for every worker and for the one chosen.
func (rt *Router) Route(req *httphead.Request, body []byte) Decision {
	d := rt.route(req, body)
	if d.Worker != nil {
		d.Worker.decided[d.Reason].Add(1)
	}
	return d
}

// Decisions returns the requests routed to the worker by reason (the
// reasons with a nonzero count).
func (w *Worker) Decisions() map[string]uint64 {
	var out map[string]uint64
	for r := range w.decided {
		if n := w.decided[r].Load(); n > 0 {
			if out == nil {
				out = make(map[string]uint64)
			}
			out[Reason(r).String()] = n
		}
	}
	return out
}

func (rt *Router) route(req *httphead.Request, body []byte) Decision {
	l := rt.learning.Load()
	if id, ok := SessionID(req.Path); ok && (l == nil || !l.isCreate(req)) {
		slot, stamped := SessionSlot(id)
		if stamped {
			if w := rt.Table.Get(slot); w != nil {
				rt.reasons[ReasonSession].Add(1)
				return Decision{Worker: w, Reason: ReasonSession}
			}
		} else if l != nil {
			if w := l.lookup(rt.Table.Snapshot(), id); w != nil {
				rt.reasons[ReasonLearned].Add(1)
				d := Decision{Worker: w, Reason: ReasonLearned}
				if req.IsMethod("DELETE") && isSessionRoot(req.Path) {
					d.Learn = l.deleting(id)
				}
				return d
			}
		}
		if rt.BadSessionMode() == BadSessionReject {
			rt.reasons[ReasonBadSessionReject].Add(1)
			return Decision{Status: 404, Reason: ReasonBadSessionReject}
		}
		rt.reasons[ReasonBadSessionSpread].Add(1)
		return rt.spread(ReasonBadSessionSpread)
	}
	if l != nil && l.isCreate(req) {
		// A new session, placed like any request that names none: its id
		// is learned from the answer.
		return l.creating(rt.unnamed(req, body))
	}
	return rt.unnamed(req, body)
}

// unnamed routes a request that names no session: the policy, else spread.
func (rt *Router) unnamed(req *httphead.Request, body []byte) Decision {
	if p := rt.CurrentPolicy(); p != nil {
		return p.route(rt, req, body)
	}
	return rt.spread(ReasonSpread)
}

// SetLearning sets (nil: turns off) the learning of bare session ids. A
// new Learning (a reload) carries on the counts of the one it replaces.
func (rt *Router) SetLearning(l *Learning) {
	if old := rt.learning.Load(); old != nil && l != nil && l != old {
		l.n = old.n
	}
	rt.learning.Store(l)
}

// CurrentLearning returns the learning in effect, or nil.
func (rt *Router) CurrentLearning() *Learning { return rt.learning.Load() }

// spread picks the routable worker with the fewest requests in flight,
// starting at a rotating slot so that ties rotate instead of always
// falling on the lowest slot. With every worker unhealthy it routes among
// all of them (Envoy's panic threshold) rather than answer 503 to all.
func (rt *Router) spread(reason Reason) Decision {
	ws := rt.Table.Snapshot()
	if w := LeastLoaded(ws, rt.rr.Add(1), func(w *Worker) bool { return w.State() == Healthy }); w != nil {
		if reason == ReasonSpread {
			rt.reasons[ReasonSpread].Add(1)
		}
		return Decision{Worker: w, Reason: reason}
	}
	if w := LeastLoaded(ws, rt.rr.Add(1), func(w *Worker) bool { return w.State() != Draining }); w != nil {
		rt.reasons[ReasonPanic].Add(1)
		return Decision{Worker: w, Reason: ReasonPanic}
	}
	rt.reasons[ReasonNoWorker].Add(1)
	return Decision{Status: 503, Reason: ReasonNoWorker}
}

// LeastLoaded returns the worker with the fewest requests in flight among
// those ok accepts, scanning from slot start mod len(ws), or nil.
func LeastLoaded(ws []*Worker, start uint64, ok func(*Worker) bool) *Worker {
	n := len(ws)
	if n == 0 {
		return nil
	}
	var best *Worker
	var bestLoad uint64
	i := int(start % uint64(n))
	for k := 0; k < n; k++ {
		w := ws[i]
		if i++; i == n {
			i = 0
		}
		if w == nil || !ok(w) {
			continue
		}
		if load := w.Stats.Pending(); best == nil || load < bestLoad {
			best, bestLoad = w, load
		}
	}
	return best
}

// SessionID extracts {id} from /sessions/{id} or /sessions/{id}/...
// (the query, if any, is not part of it).
func SessionID(path []byte) ([]byte, bool) {
	const prefix = "/sessions/"
	if len(path) <= len(prefix) || string(path[:len(prefix)]) != prefix {
		return nil, false
	}
	rest := path[len(prefix):]
	for i, c := range rest {
		if c == '/' || c == '?' {
			rest = rest[:i]
			break
		}
	}
	return rest, len(rest) > 0
}

// isSessionRoot reports whether path is /sessions/{id} itself (no
// sub-path; a query is allowed).
func isSessionRoot(path []byte) bool {
	const prefix = "/sessions/"
	for _, c := range path[len(prefix):] {
		if c == '/' {
			return false
		}
		if c == '?' {
			break
		}
	}
	return true
}

// SessionSlot parses the worker slot of a w<idx>-<rest> session id: a
// decimal idx without sign or leading zeros, and a non-empty rest.
func SessionSlot(id []byte) (int, bool) {
	if len(id) < 4 || id[0] != 'w' {
		return 0, false
	}
	n, i := 0, 1
	for ; i < len(id) && id[i] >= '0' && id[i] <= '9'; i++ {
		if i-1 >= 6 { // more than 6 digits: beyond any slot
			return 0, false
		}
		n = n*10 + int(id[i]-'0')
	}
	digits := i - 1
	if digits == 0 || digits > 1 && id[1] == '0' {
		return 0, false
	}
	if i >= len(id)-1 || id[i] != '-' {
		return 0, false
	}
	return n, true
}
