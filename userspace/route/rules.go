package route

import (
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/worker"
)

// The decision is an ordered list of rules: each looks at the request and
// either decides where it goes or passes, and the first that decides
// wins. The order below is the precedence of every rule over the others,
// written once.
var rules = [...]rule{
	ruleSession,    // /sessions/w<idx>-…: the worker in slot idx
	ruleLearned,    // /sessions/{id} of a learned bare id: the worker that created it
	ruleBadSession, // any other /sessions/{id}: 404 or spread (--bad-session)
	ruleTarget,     // X-SMG-Target-Worker: that worker, whatever its state (400: none)
	ruleRequestID,  // a request id already in flight: the worker serving it
	ruleKVPrefix,   // token ids in the body, KV events on: the engine with the least expected work (kvprefix.go)
	ruleKey,        // a routing key: its ring owner (--policy=hash) or sticky owner
	ruleGroup,      // keyless, engine signals: where the earlier samples of its prompt are
	rulePrefix,     // keyless, --keyless=prefix: the body's start on the ring
	ruleP2C,        // keyless, --keyless=p2c: the less loaded of two random workers
	ruleEngine,     // keyless, engine signals: the engine with the least expected time to serve
	ruleLeast,      // the least loaded worker (spread), all unhealthy: panic, none: 503
}

// rule is one rule of the decision (Router.apply).
type rule uint8

const (
	ruleSession rule = iota
	ruleLearned
	ruleBadSession
	ruleTarget
	ruleRequestID
	ruleKVPrefix
	ruleKey
	ruleGroup
	rulePrefix
	ruleP2C
	ruleEngine
	ruleLeast
)

// request is what the rules read of one request, each fact found once.
type request struct {
	req  *httphead.Request
	body []byte
	ws   []*worker.Worker
	p    *Policy   // nil: no policy (rules of keys and keyless modes pass)
	l    *Learning // nil: bare session ids are not learned
	// id is the session id of /sessions/{id}; named: the path has one;
	// session: it names a session to reach (not the create path).
	id      []byte
	named   bool
	session bool
	create  bool // POST to the learning's create path
	rid     []byte
	ridRead bool
	key     []byte // the policy's routing key (routingKey)
	keyRead bool
}

// requestID returns the request's id (RequestID), read once.
func (q *request) requestID() []byte {
	if !q.ridRead {
		q.rid, q.ridRead = RequestID(q.req, q.body), true
	}
	return q.rid
}

// routingKey returns the request's routing key under policy p (nil: none),
// read once.
func (q *request) routingKey() []byte {
	if !q.keyRead {
		q.key, q.keyRead = q.p.RoutingKey(q.req), true
	}
	return q.key
}

// route applies the rules in order. A create request (learning on) gets
// the Learner of its answer unless it was pinned by its request id (the
// first copy's Learner learns the id); a request with an id in flight is
// tracked until its exchange ends.
func (rt *Router) route(req *httphead.Request, body []byte) Decision {
	q := request{req: req, body: body, ws: rt.Table.Snapshot(), p: rt.CurrentPolicy(), l: rt.learning.Load()}
	q.create = q.l != nil && q.l.isCreate(req)
	q.id, q.named = SessionID(req.Path)
	q.session = q.named && !q.create
	var d Decision
	for _, r := range rules {
		if rt.apply(r, &q, &d) {
			break
		}
	}
	if q.create && d.Reason != ReasonRid {
		d = q.l.creating(d)
	}
	rt.trackRequestID(&q, &d)
	return d
}

// apply applies rule r to q: true when it decides (into d), false when it
// passes (d untouched).
func (rt *Router) apply(r rule, q *request, d *Decision) bool {
	p := q.p
	switch r {
	case ruleSession:
		if !q.session {
			return false
		}
		if slot, stamped := SessionSlot(q.id); stamped {
			if w := rt.Table.Get(slot); w != nil {
				*d = rt.decide(w, ReasonSession)
				return true
			}
		}
	case ruleLearned:
		if !q.session || q.l == nil {
			return false
		}
		if _, stamped := SessionSlot(q.id); stamped {
			return false
		}
		if w := q.l.lookup(q.ws, q.id); w != nil {
			*d = rt.decide(w, ReasonLearned)
			if q.req.IsMethod("DELETE") && isSessionRoot(q.req.Path) {
				d.Learn = q.l.deleting(q.id)
			}
			return true
		}
	case ruleBadSession:
		if !q.session {
			return false
		}
		if rt.BadSessionMode() == BadSessionReject {
			rt.reasons[ReasonBadSessionReject].Add(1)
			*d = Decision{Status: 404, Reason: ReasonBadSessionReject}
			return true
		}
		rt.reasons[ReasonBadSessionSpread].Add(1)
		*d = rt.spread(ReasonBadSessionSpread)
		return true
	case ruleTarget:
		if p == nil {
			return false
		}
		if v := fieldValue(q.req, TargetWorkerHeader); v != nil {
			*d = routeTarget(rt, q.ws, v)
			return true
		}
	case ruleRequestID:
		// A request that names a session or a target (even without a
		// policy to honour it) is not moved by its id.
		if rt.Owners == nil || q.named {
			return false
		}
		if _, target := q.req.Lookup(TargetWorkerHeader); target {
			return false
		}
		if rid := q.requestID(); rid != nil {
			if slot, ok := rt.Owners.Owner(rid); ok {
				if w := rt.Table.Get(slot); w != nil && w.State() == worker.Healthy {
					rt.reasons[ReasonRid].Add(1)
					*d = Decision{Worker: w, Reason: ReasonRid}
					return true
				}
			}
		}
	case ruleKVPrefix:
		if p == nil {
			return false
		}
		if dd, ok := rt.placeByPrefix(q.ws, q.req, q.body, q.routingKey()); ok {
			*d = dd
			return true
		}
	case ruleKey:
		if p == nil {
			return false
		}
		if key := q.routingKey(); key != nil {
			h := KeyHash(key)
			if p.cfg.Kind == PolicySticky {
				*d = p.routeSticky(rt, q.ws, h)
				return true
			}
			*d = p.routeKey(rt, q.ws, h)
			return true
		}
	case ruleGroup:
		if p == nil || p.cfg.Keyless != KeylessLeast {
			return false
		}
		if e := rt.engineOn(); e != nil && e.cfg.GroupMax.Or(0) > 0 {
			if gh, ok := GroupHash(q.req, q.body); ok {
				return e.group(rt, p, q.ws, gh, d)
			}
		}
	case rulePrefix:
		if p == nil || p.cfg.Keyless != KeylessPrefix || len(q.body) == 0 {
			return false
		}
		if b := PeekedBody(q.req, q.body); len(b) > 0 {
			if len(b) > p.cfg.PrefixBytes {
				b = b[:p.cfg.PrefixBytes]
			}
			*d = p.routeRing(rt, q.ws, PrefixHash(b))
			return true
		}
	case ruleP2C:
		if p != nil && p.cfg.Keyless == KeylessP2C {
			*d = p2c(rt, q.ws)
			return true
		}
	case ruleEngine:
		if p == nil || p.cfg.Keyless != KeylessLeast {
			return false
		}
		if e := rt.engineOn(); e != nil {
			return e.least(rt, p, q.ws, d)
		}
	case ruleLeast:
		*d = rt.spread(ReasonSpread)
		return true
	}
	return false
}

// decide counts a decision for reason and returns it.
func (rt *Router) decide(w *worker.Worker, reason Reason) Decision {
	rt.reasons[reason].Add(1)
	return Decision{Worker: w, Reason: reason}
}
