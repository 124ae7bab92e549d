package route

import (
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// routeSticky implements --policy=sticky for key hash h: one table lookup
// per request; a table write only on a first assignment, a reassignment,
// or a TTL refresh (at most every StickyRefresh per key).
//
// A key whose owner is unhealthy, draining or gone is reassigned (reason
// sticky_failover) and stays with its new worker when the old one
// recovers: the new worker holds the session's cache by then, and moving
// it back would cost a second miss.
func (p *Policy) routeSticky(rt *Router, ws []*worker.Worker, h uint64) Decision {
	t := p.cfg.Sticky
	now := p.cfg.Now()
	e, found := t.Lookup(h)
	lost := false
	if found && e.Live(now) {
		if w := entryWorker(ws, e); w != nil && w.State() == worker.Healthy {
			if eng := rt.engineOn(); eng != nil {
				if nw, r, ok := eng.moveKey(p, ws, h, w, true); ok {
					// Off a vetoed engine, to one clearly better: it stays there.
					t.Put(h, sticky.Entry{Worker: uint32(nw.Slot), ID: nw.Ident(), Expires: now + p.ttl})
					rt.reasons[r].Add(1)
					return Decision{Worker: nw, Reason: r}
				}
			}
			if uint32(w.Slot) != e.Worker || now-(e.Expires-p.ttl) >= p.refresh {
				t.Put(h, sticky.Entry{Worker: uint32(w.Slot), ID: e.ID, Expires: now + p.ttl})
			}
			rt.reasons[ReasonSticky].Add(1)
			return Decision{Worker: w, Reason: ReasonSticky}
		}
		lost = true
	}
	// A new key: the least loaded healthy worker with room (capacity);
	// with engine signals, the best engine (ties to the ring owner).
	var w *worker.Worker
	newReason := ReasonStickyNew
	if eng := rt.engineOn(); eng != nil {
		if w = eng.newKey(p, ws, h); w != nil && !hasRoom(w) {
			w = nil
		}
		if w != nil {
			newReason = ReasonEngineLeast
		}
	}
	if w == nil {
		w = LeastLoaded(ws, rt.rr.Add(1), hasRoom)
	}
	if w == nil {
		w = LeastLoaded(ws, rt.rr.Add(1), isHealthy)
	}
	if w == nil {
		// Nothing healthy: spread's panic rule, nothing stored.
		return rt.spread(ReasonStickyNew)
	}
	ne := sticky.Entry{Worker: uint32(w.Slot), ID: w.Ident(), Expires: now + p.ttl}
	if found {
		t.Put(h, ne) // expired, or its worker gone or unhealthy
	} else if cur, ok := t.Insert(h, ne); !ok {
		// Another request or tetherd process assigned the key first.
		if cur.Live(now) {
			if cw := entryWorker(ws, cur); cw != nil && cw.State() == worker.Healthy {
				rt.reasons[ReasonSticky].Add(1)
				return Decision{Worker: cw, Reason: ReasonSticky}
			}
		}
		t.Put(h, ne)
	}
	reason := newReason
	if lost {
		reason = ReasonStickyFailover
	}
	rt.reasons[reason].Add(1)
	return Decision{Worker: w, Reason: reason}
}

// entryWorker returns the worker a sticky entry names, whatever its state:
// the worker in the entry's slot if it has the entry's identity, else the
// worker with that identity in another slot (the same engine after a
// restart with the workers in another order), else nil (the worker is
// gone, or the entry predates identities).
func entryWorker(ws []*worker.Worker, e sticky.Entry) *worker.Worker {
	if e.ID == 0 {
		return nil
	}
	if int(e.Worker) < len(ws) {
		if w := ws[e.Worker]; w != nil && w.Ident() == e.ID {
			return w
		}
	}
	for _, w := range ws {
		if w != nil && w.Ident() == e.ID {
			return w
		}
	}
	return nil
}

// hasRoom: healthy and below its capacity (max_in_flight).
func hasRoom(w *worker.Worker) bool { return w.State() == worker.Healthy && !w.Full(w.MaxInFlight()) }
