package route

import (
	"slices"
	"strconv"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/keyhash"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// KeyHash is the 64-bit hash of a routing key (keyhash: fixed, the same
// in every process): its ring position and its key in the sticky table.
func KeyHash(key []byte) uint64 { return keyhash.Sum(key) }

// KeyHashString is KeyHash of a string.
func KeyHashString(key string) uint64 { return keyhash.String(key) }

// VirtualNodes is the number of ring positions per worker. With 160 the
// share of keys a worker owns is within about ±10% of 1/N.
const VirtualNodes = 160

// ring is the consistent hash ring of one worker table snapshot. Every
// worker of the snapshot is on it, whatever its state: an unhealthy or
// draining owner is skipped at lookup time, so its keys go to its ring
// successors (each key to its own successor, not all to one worker) and
// come back when it recovers, without a rebuild.
type ring struct {
	ws     []*worker.Worker // the snapshot the ring was built from
	points []ringPoint
}

type ringPoint struct {
	hash uint64
	slot int32
}

// workerRingID names a worker on the ring: its URL, so that every process
// configured with the same workers agrees even if slots differ; the slot
// when there is no URL.
func workerRingID(w *worker.Worker) string {
	if w.URL != "" {
		return w.URL
	}
	return "slot:" + strconv.Itoa(w.Slot)
}

func buildRing(ws []*worker.Worker) *ring {
	r := &ring{ws: ws}
	n := 0
	for _, w := range ws {
		if w != nil {
			n++
		}
	}
	r.points = make([]ringPoint, 0, n*VirtualNodes)
	var buf []byte
	for slot, w := range ws {
		if w == nil {
			continue
		}
		id := workerRingID(w)
		for v := 0; v < VirtualNodes; v++ {
			buf = append(buf[:0], id...)
			buf = append(buf, '#')
			buf = strconv.AppendInt(buf, int64(v), 10)
			r.points = append(r.points, ringPoint{hash: KeyHash(buf), slot: int32(slot)})
		}
	}
	slices.SortFunc(r.points, func(a, b ringPoint) int {
		switch {
		case a.hash < b.hash:
			return -1
		case a.hash > b.hash:
			return 1
		}
		return int(a.slot - b.slot)
	})
	return r
}

// search returns the index of the first point at or after h, wrapping.
func (r *ring) search(h uint64) int {
	lo, hi := 0, len(r.points)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if r.points[mid].hash < h {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo == len(r.points) {
		lo = 0
	}
	return lo
}

// Owner returns the slot owning h on the ring of ws, ignoring states and
// loads (-1 without workers). For tests and tools.
func (p *Policy) Owner(ws []*worker.Worker, h uint64) int {
	r := p.ringFor(ws)
	if len(r.points) == 0 {
		return -1
	}
	return int(r.points[r.search(h)].slot)
}

func sameSnapshot(a, b []*worker.Worker) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// ringFor returns the ring of snapshot ws, building it on the first request
// after the table changed.
func (p *Policy) ringFor(ws []*worker.Worker) *ring {
	if r := p.ring.Load(); r != nil && sameSnapshot(r.ws, ws) {
		return r
	}
	p.ringMu.Lock()
	defer p.ringMu.Unlock()
	if r := p.ring.Load(); r != nil && sameSnapshot(r.ws, ws) {
		return r
	}
	r := buildRing(ws)
	p.ring.Store(r)
	return r
}

// ringOutcome says how pick chose.
type ringOutcome int

const (
	ringOwner    ringOutcome = iota // the key's owner
	ringSpill                       // owner overloaded: a successor
	ringFailover                    // owner unhealthy or draining: a successor
	ringPanic                       // no healthy worker: owner among non-draining
	ringNone                        // nothing to route to
)

// load is the healthy workers' load at one decision: n workers, total
// requests in flight on them.
type load struct {
	n     int
	total uint64
}

func loadOf(ws []*worker.Worker) load {
	var l load
	for _, w := range ws {
		if w != nil && w.State() == worker.Healthy {
			l.n++
			l.total += w.Stats.Pending()
		}
	}
	return l
}

// overloaded reports whether w should take no new request of a key it
// owns (the key spills to a ring successor). That is so only when w is at
// its capacity (max_in_flight), or above both bounds at once once it took
// the request: relative, more than c × the mean in flight, and absolute,
// more than SpillMin above the mean. An inference engine runs hundreds of
// requests at once and one prefix-cache miss costs far more than a few
// dozen requests of imbalance, so a key stays put at light load, where the
// relative bound alone (c × a mean of 2) would move it at 3.
//
// With low set, the bounds are those of the way back (hysteresis): c' =
// 1 + (c-1)/2, SpillMin/2, capacity minus an eighth. A spilled key returns
// to its owner only once the owner is below them, so a load that hovers
// at the bound does not make the key flap.
func (p *Policy) overloaded(w *worker.Worker, l load, low bool) bool {
	c, abs, capacity := p.cfg.LoadFactor, float64(max(p.cfg.SpillMin.Or(0), 0)), w.MaxInFlight()
	if low {
		c, abs = 1+(c-1)/2, abs/2
		if capacity > 1 {
			capacity -= max(capacity/8, 1)
		}
	}
	if w.Full(capacity) {
		return true
	}
	n := max(l.n, 1)
	mean := float64(l.total+1) / float64(n)
	after := float64(w.Stats.Pending() + 1)
	return after > c*mean && after > mean+abs
}

// pick walks the ring from h: the first healthy worker (the owner) takes
// the request unless it is overloaded, then the next healthy one that is
// not (consistent hashing with bounded loads, bounded only under real
// overload). It also returns the owner.
func (p *Policy) pick(ws []*worker.Worker, h uint64, l load) (*worker.Worker, *worker.Worker, ringOutcome) {
	r := p.ringFor(ws)
	np := len(r.points)
	if np == 0 {
		return nil, nil, ringNone
	}
	i := r.search(h)
	if l.n == 0 {
		// Every worker unhealthy: the owner among those not draining,
		// load ignored (the panic rule of spread).
		for k := 0; k < np; k++ {
			if w := ws[r.points[i].slot]; w.State() != worker.Draining {
				return w, w, ringPanic
			}
			if i++; i == np {
				i = 0
			}
		}
		return nil, nil, ringNone
	}
	var owner *worker.Worker
	out := ringOwner
	for k := 0; k < np; k++ {
		w := ws[r.points[i].slot]
		switch {
		case w.State() != worker.Healthy:
			if owner == nil {
				out = ringFailover
			}
		case owner == nil:
			owner = w
			if !p.overloaded(w, l, false) {
				return w, owner, out
			}
			out = ringSpill
		case w != owner && !p.overloaded(w, l, false):
			return w, owner, ringSpill
		}
		if i++; i == np {
			i = 0
		}
	}
	// Every healthy worker is at its capacity: the least loaded one.
	if w := LeastLoaded(ws, h, isHealthy); w != nil {
		return w, owner, ringSpill
	}
	return nil, nil, ringNone
}

func isHealthy(w *worker.Worker) bool { return w.State() == worker.Healthy }

// routeRing routes by ring position h without memory (--keyless=prefix).
func (p *Policy) routeRing(rt *Router, ws []*worker.Worker, h uint64) Decision {
	w, _, out := p.pick(ws, h, loadOf(ws))
	reason := ReasonPrefix
	switch out {
	case ringNone:
		rt.reasons[ReasonNoWorker].Add(1)
		return Decision{Status: 503, Reason: ReasonNoWorker}
	case ringPanic:
		reason = ReasonPanic
	}
	rt.reasons[reason].Add(1)
	return Decision{Worker: w, Reason: reason}
}

// routeKey routes a routing key by its hash h (--policy=hash). A key whose
// owner is overloaded spills to a ring successor and the spill is
// remembered in the sticky table for SpillTTL (pushed back while used):
// while the owner stays overloaded (by the bounds of the way back), the
// key keeps going to the worker it spilled to instead of bouncing between
// successors as loads move; once the owner is below them, the entry is
// dropped and the key returns (hash_return). Until some key spilled, no
// request pays for a table lookup (Router.spillUntil).
func (p *Policy) routeKey(rt *Router, ws []*worker.Worker, h uint64) Decision {
	l := loadOf(ws)
	w, owner, out := p.pick(ws, h, l)
	t := p.cfg.Sticky
	var now int64
	if t != nil && out != ringPanic && out != ringNone {
		if until := rt.spillUntil.Load(); until != 0 {
			if now = p.cfg.Now(); now < until {
				if d, ok := p.remembered(rt, ws, h, l, owner, now); ok {
					return d
				}
			}
		}
	}
	reason := ReasonHash
	moved := NumReasons
	if out == ringOwner || out == ringSpill || out == ringFailover {
		if e := rt.engineOn(); e != nil {
			// With engine signals: off an engine that is vetoed, or
			// clearly worse than the best one (bounded load on engine
			// state, policy_engine.go), remembered like a spill.
			if nw, r, ok := e.moveKey(p, ws, h, w, false); ok {
				w, out, moved = nw, ringSpill, r
			}
		}
	}
	switch out {
	case ringNone:
		rt.reasons[ReasonNoWorker].Add(1)
		return Decision{Status: 503, Reason: ReasonNoWorker}
	case ringPanic:
		reason = ReasonPanic
	case ringFailover:
		reason = ReasonHashFailover
	case ringSpill:
		reason = ReasonHashSpill
		if moved != NumReasons {
			reason = moved
		}
		if t != nil {
			if now == 0 {
				now = p.cfg.Now()
			}
			t.Put(h, sticky.Entry{Worker: uint32(w.Slot), ID: w.Ident(), Expires: now + p.spillTTL})
			if until := now + p.spillTTL; until > rt.spillUntil.Load() {
				rt.spillUntil.Store(until)
			}
		}
	}
	rt.reasons[reason].Add(1)
	return Decision{Worker: w, Reason: reason}
}

// remembered applies a key's remembered spill, if it has one: to the
// spill target while the owner is still overloaded and the target is not;
// back to the owner (entry dropped) once the owner is not. ok false: no
// spill to apply, route as usual (a spill that moves to another target is
// stored again by the caller).
func (p *Policy) remembered(rt *Router, ws []*worker.Worker, h uint64, l load, owner *worker.Worker, now int64) (Decision, bool) {
	t := p.cfg.Sticky
	e, found := t.Lookup(h)
	if !found || !e.Live(now) {
		return Decision{}, false
	}
	sw := entryWorker(ws, e)
	if sw == nil || owner == nil || sw == owner {
		return Decision{}, false
	}
	e2 := rt.engineOn()
	if e2 != nil && sw.State() == worker.Healthy && !p.overloaded(sw, l, false) {
		// With engine signals a moved key stays moved (its cache is
		// there now) until its entry expires: off its target only when
		// that is vetoed and another engine is clearly better.
		if nw, r, ok := e2.moveKey(p, ws, h, sw, true); ok {
			t.Put(h, sticky.Entry{Worker: uint32(nw.Slot), ID: nw.Ident(), Expires: now + p.spillTTL})
			rt.reasons[r].Add(1)
			return Decision{Worker: nw, Reason: r}, true
		}
		if uint32(sw.Slot) != e.Worker || now-(e.Expires-p.spillTTL) >= p.refresh {
			t.Put(h, sticky.Entry{Worker: uint32(sw.Slot), ID: e.ID, Expires: now + p.spillTTL})
		}
		rt.reasons[ReasonHashSpilled].Add(1)
		return Decision{Worker: sw, Reason: ReasonHashSpilled}, true
	}
	if !p.overloaded(owner, l, true) && (e2 == nil || !owner.EngineVetoed()) {
		t.Delete(h)
		rt.reasons[ReasonHashReturn].Add(1)
		return Decision{Worker: owner, Reason: ReasonHashReturn}, true
	}
	if sw.State() != worker.Healthy || p.overloaded(sw, l, false) {
		return Decision{}, false
	}
	if uint32(sw.Slot) != e.Worker || now-(e.Expires-p.spillTTL) >= p.refresh {
		t.Put(h, sticky.Entry{Worker: uint32(sw.Slot), ID: e.ID, Expires: now + p.spillTTL})
	}
	rt.reasons[ReasonHashSpilled].Add(1)
	return Decision{Worker: sw, Reason: ReasonHashSpilled}, true
}

// Reroute places a request again after its worker refused the connection
// (nothing was sent, so another worker may take it): the next healthy
// worker after the failed one on the key's ring (keyed requests of the
// hash policy), else the least loaded healthy one other than failed (new
// sticky keys, keyless requests). Requests pinned to their worker (session
// ids, X-SMG-Target-Worker, request ids, known sticky keys) are not moved:
// the Decision has no Worker. The failed worker is left to the health
// checks (its refused connects count as passive failures).
func (rt *Router) Reroute(req *httphead.Request, body []byte, d Decision) Decision {
	failed := d.Worker
	if failed == nil {
		return Decision{}
	}
	ws := rt.Table.Snapshot()
	ok := func(w *worker.Worker) bool { return w != failed && w.State() == worker.Healthy }
	var w *worker.Worker
	switch d.Reason {
	case ReasonHash, ReasonHashSpill, ReasonHashSpilled, ReasonHashReturn, ReasonHashFailover:
		p := rt.CurrentPolicy()
		key := []byte(nil)
		if p != nil {
			key = p.RoutingKey(req)
		}
		if key == nil {
			return Decision{}
		}
		r := p.ringFor(ws)
		if np := len(r.points); np > 0 {
			i := r.search(KeyHash(key))
			for k := 0; k < np && w == nil; k++ {
				if c := ws[r.points[i].slot]; ok(c) {
					w = c
				}
				if i++; i == np {
					i = 0
				}
			}
		}
	case ReasonSpread, ReasonPrefix, ReasonStickyNew, ReasonBadSessionSpread:
		w = LeastLoaded(ws, rt.rr.Add(1), ok)
	}
	if w == nil {
		return Decision{}
	}
	rt.reasons[ReasonReroute].Add(1)
	w.CountDecision(int(ReasonReroute))
	q := request{req: req, body: body}
	nd := Decision{Worker: w, Reason: ReasonReroute, Learn: d.Learn.retarget(w)}
	rt.trackRequestID(&q, &nd)
	return nd
}
