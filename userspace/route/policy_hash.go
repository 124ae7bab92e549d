package route

import (
	"math"
	"slices"
	"strconv"
)

// Hashing: FNV-1a 64 followed by the MurmurHash3 finalizer (fmix64), so
// that short, similar inputs ("http://10.0.0.5:30001#17") still spread over
// the whole ring. It is fixed (no per-process seed, unlike hash/maphash):
// every tetherd process on every host maps a key to the same ring position.
const (
	fnvOffset = 14695981039346656037
	fnvPrime  = 1099511628211
)

func fnv1a(h uint64, b []byte) uint64 {
	for _, c := range b {
		h ^= uint64(c)
		h *= fnvPrime
	}
	return h
}

func fnv1aString(h uint64, s string) uint64 {
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= fnvPrime
	}
	return h
}

func fmix64(h uint64) uint64 {
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	h *= 0xc4ceb9fe1a85ec53
	h ^= h >> 33
	return h
}

// KeyHash is the 64-bit hash of a routing key: its ring position and its
// key in the sticky table.
func KeyHash(key []byte) uint64 { return fmix64(fnv1a(fnvOffset, key)) }

// KeyHashString is KeyHash of a string.
func KeyHashString(key string) uint64 { return fmix64(fnv1aString(fnvOffset, key)) }

// VirtualNodes is the number of ring positions per worker. With 160 the
// share of keys a worker owns is within about ±10% of 1/N.
const VirtualNodes = 160

// ring is the consistent hash ring of one worker table snapshot. Every
// worker of the snapshot is on it, whatever its state: an unhealthy or
// draining owner is skipped at lookup time, so its keys go to its ring
// successors (each key to its own successor, not all to one worker) and
// come back when it recovers, without a rebuild.
type ring struct {
	ws     []*Worker // the snapshot the ring was built from
	points []ringPoint
}

type ringPoint struct {
	hash uint64
	slot int32
}

// workerRingID names a worker on the ring: its URL, so that every process
// configured with the same workers agrees even if slots differ; the slot
// when there is no URL.
func workerRingID(w *Worker) string {
	if w.URL != "" {
		return w.URL
	}
	return "slot:" + strconv.Itoa(w.Slot)
}

func buildRing(ws []*Worker) *ring {
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
func (p *Policy) Owner(ws []*Worker, h uint64) int {
	r := p.ringFor(ws)
	if len(r.points) == 0 {
		return -1
	}
	return int(r.points[r.search(h)].slot)
}

func sameSnapshot(a, b []*Worker) bool {
	return len(a) == len(b) && (len(a) == 0 || &a[0] == &b[0])
}

// ringFor returns the ring of snapshot ws, building it on the first request
// after the table changed.
func (p *Policy) ringFor(ws []*Worker) *ring {
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
	ringOverflow                    // owner above the load bound: a successor
	ringFailover                    // owner unhealthy or draining: a successor
	ringPanic                       // no healthy worker: owner among non-draining
	ringNone                        // nothing to route to
)

// capacity is the bounded-load limit: a worker takes a new request only
// while its in-flight count is below ceil(c × (total+1) / n), total being
// the requests in flight on the n healthy workers. Some healthy worker is
// always below it, and the one chosen ends at most at c × mean + 1.
func (p *Policy) capacity(total uint64, n int) uint64 {
	return uint64(math.Ceil(p.cfg.LoadFactor * float64(total+1) / float64(n)))
}

// pick walks the ring from h: the first healthy worker below the load
// bound takes the request (consistent hashing with bounded loads).
func (p *Policy) pick(ws []*Worker, h uint64) (*Worker, ringOutcome) {
	r := p.ringFor(ws)
	np := len(r.points)
	if np == 0 {
		return nil, ringNone
	}
	n := 0
	var total uint64
	for _, w := range ws {
		if w != nil && w.State() == Healthy {
			n++
			total += w.Stats.Pending()
		}
	}
	i := r.search(h)
	if n == 0 {
		// Every worker unhealthy: the owner among those not draining,
		// load ignored (the panic rule of spread).
		for k := 0; k < np; k++ {
			if w := ws[r.points[i].slot]; w.State() != Draining {
				return w, ringPanic
			}
			if i++; i == np {
				i = 0
			}
		}
		return nil, ringNone
	}
	limit := p.capacity(total, n)
	out := ringOwner
	for k := 0; k < np; k++ {
		w := ws[r.points[i].slot]
		if w.State() != Healthy {
			if out == ringOwner {
				out = ringFailover
			}
		} else if w.Stats.Pending() < limit {
			return w, out
		} else if out == ringOwner {
			out = ringOverflow
		}
		if i++; i == np {
			i = 0
		}
	}
	// Loads moved under us: the least loaded healthy worker.
	if w := LeastLoaded(ws, h, isHealthy); w != nil {
		return w, ringOverflow
	}
	return nil, ringNone
}

func isHealthy(w *Worker) bool { return w.State() == Healthy }

// routeRing routes by ring position h; prefix marks keyless prefix hashing.
func (p *Policy) routeRing(rt *Router, ws []*Worker, h uint64, prefix bool) Decision {
	w, out := p.pick(ws, h)
	var reason Reason
	switch {
	case out == ringNone:
		rt.reasons[ReasonNoWorker].Add(1)
		return Decision{Status: 503, Reason: ReasonNoWorker}
	case out == ringPanic:
		reason = ReasonPanic
	case prefix:
		reason = ReasonPrefix
	case out == ringOverflow:
		reason = ReasonHashOverflow
	case out == ringFailover:
		reason = ReasonHashFailover
	default:
		reason = ReasonHash
	}
	rt.reasons[reason].Add(1)
	return Decision{Worker: w, Reason: reason}
}
