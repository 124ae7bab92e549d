// Package route decides which backend worker gets a request: an ordered
// list of rules (rules.go) over the worker table of package worker.
// Workers sit in stable slots: the <idx> of a w<idx>-<rest> session id is
// the slot, so a session's turns always reach the worker that holds its
// state. Requests that name no session go by the policy (a routing key,
// the body's prompt or prefix, the engines' load) or spread to the
// least-loaded worker.
package route

import (
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/worker"
)

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
	ReasonKVPrefix    // token ids: the engine with the least expected work given what it holds (kvprefix.go)
	// Prefill/decode pairs (placed by the daemon's pair chooser: Placed).
	ReasonPDPrefill // the prefill of a P/D request's pair
	ReasonPDDecode  // the decode of a P/D request's pair
	NumReasons
)

// Each worker counts its decisions by reason.
var _ [worker.MaxReasons - NumReasons]struct{}

var reasonNames = [NumReasons]string{"session", "spread", "bad_session_spread", "bad_session_reject", "no_worker", "panic",
	"target", "bad_target", "hash", "hash_spill", "hash_spilled", "hash_return", "hash_failover",
	"sticky", "sticky_new", "sticky_failover", "prefix", "rid", "learned", "reroute",
	"veto", "group", "engine-least", "kv_prefix", "pd_prefill", "pd_decode"}

func (r Reason) String() string { return reasonNames[r] }

// Router applies the routing rules (rules.go) to a table.
type Router struct {
	Table *worker.Table
	// Owners, when set, tracks the request ids in flight: a request whose
	// id is in flight goes to the worker serving it (ruleRequestID), and
	// every routed request's id is recorded until its exchange ends.
	Owners RequestOwners

	// Settings a reload (SIGHUP) may change while requests are routed.
	policy     atomic.Pointer[Policy]   // nil: least in flight (spread)
	badSession atomic.Int32             // BadSession
	learning   atomic.Pointer[Learning] // nil: bare session ids are not learned

	engine atomic.Pointer[EnginePlacement] // nil: no engine-aware placement (policy_engine.go)
	prefix atomic.Pointer[PrefixPlacement] // nil: no placement by the engines' caches (kvprefix.go)

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
	Worker *worker.Worker // nil: answer Status locally
	Status int            // 404 (bad session, reject) or 503 (no worker)
	Reason Reason
	// Done, when set, is called once the exchange with Worker ended
	// (whatever the outcome): policies that track requests in flight by
	// id release them here.
	Done func()
	// Learn, when set, wants to see the response (learn.go): the proxy
	// calls its Status, Body and End before relaying what it shows.
	Learn *Learner
	// Matched, Rank and Ranks (ReasonKVPrefix, kvprefix.go): the prompt
	// tokens the chosen engine holds, its data-parallel rank (-1: none
	// known) and how many ranks the worker has: with several, the proxy
	// names Rank to the engine (dialect.Dialect.RankHeader).
	Matched int
	Rank    int
	Ranks   int
}

// Route picks the worker for a request. body holds the first bytes of the
// request body that were buffered with the head (possibly none). The
// decision is counted by reason, for every worker and for the one chosen.
func (rt *Router) Route(req *httphead.Request, body []byte) Decision {
	d := rt.route(req, body)
	if d.Worker != nil {
		d.Worker.CountDecision(int(d.Reason))
	}
	return d
}

// Placed counts a placement made outside Route (a P/D pair's sides, by
// the daemon's pair chooser) as Route counts its own: for reason r, in
// all and on w.
func (rt *Router) Placed(w *worker.Worker, r Reason) {
	rt.reasons[r].Add(1)
	w.CountDecision(int(r))
}

// Decisions returns the requests routed to w by reason (the reasons with
// a nonzero count).
func Decisions(w *worker.Worker) map[string]uint64 {
	var out map[string]uint64
	for r := Reason(0); r < NumReasons; r++ {
		if n := w.Decided(int(r)); n > 0 {
			if out == nil {
				out = make(map[string]uint64)
			}
			out[Reason(r).String()] = n
		}
	}
	return out
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
	if w := LeastLoaded(ws, rt.rr.Add(1), func(w *worker.Worker) bool { return w.State() == worker.Healthy }); w != nil {
		if reason == ReasonSpread {
			rt.reasons[ReasonSpread].Add(1)
		}
		return Decision{Worker: w, Reason: reason}
	}
	if w := LeastLoaded(ws, rt.rr.Add(1), func(w *worker.Worker) bool { return w.State() != worker.Draining }); w != nil {
		rt.reasons[ReasonPanic].Add(1)
		return Decision{Worker: w, Reason: ReasonPanic}
	}
	rt.reasons[ReasonNoWorker].Add(1)
	return Decision{Status: 503, Reason: ReasonNoWorker}
}

// LeastLoaded returns the worker with the fewest requests in flight among
// those ok accepts, scanning from slot start mod len(ws), or nil.
func LeastLoaded(ws []*worker.Worker, start uint64, ok func(*worker.Worker) bool) *worker.Worker {
	n := len(ws)
	if n == 0 {
		return nil
	}
	var best *worker.Worker
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
