package route

import "github.com/tether-rl/tether/userspace/sticky"

// routeSticky implements --policy=sticky for key hash h: one table lookup
// per request; a table write only on a first assignment, a reassignment,
// or a TTL refresh (at most every StickyRefresh per key).
func (p *Policy) routeSticky(rt *Router, ws []*Worker, h uint64) Decision {
	t := p.cfg.Sticky
	now := p.cfg.Now()
	e, found := t.Lookup(h)
	if found && e.Live(now) {
		if w := liveOwner(ws, e.Worker); w != nil {
			if now-(e.Expires-p.ttl) >= p.refresh {
				t.Put(h, sticky.Entry{Worker: e.Worker, Expires: now + p.ttl})
			}
			rt.reasons[ReasonSticky].Add(1)
			return Decision{Worker: w, Reason: ReasonSticky}
		}
	}
	w := LeastLoaded(ws, rt.rr.Add(1), isHealthy)
	if w == nil {
		// Nothing healthy: spread's panic rule, nothing stored.
		return rt.spread(ReasonStickyNew)
	}
	ne := sticky.Entry{Worker: uint32(w.Slot), Expires: now + p.ttl}
	if found {
		t.Put(h, ne) // expired, or its worker gone or unhealthy
	} else if cur, ok := t.Insert(h, ne); !ok {
		// Another request or tetherd process assigned the key first.
		if cur.Live(now) {
			if cw := liveOwner(ws, cur.Worker); cw != nil {
				rt.reasons[ReasonSticky].Add(1)
				return Decision{Worker: cw, Reason: ReasonSticky}
			}
		}
		t.Put(h, ne)
	}
	rt.reasons[ReasonStickyNew].Add(1)
	return Decision{Worker: w, Reason: ReasonStickyNew}
}

// liveOwner returns the healthy worker in slot, or nil.
func liveOwner(ws []*Worker, slot uint32) *Worker {
	if int(slot) >= len(ws) {
		return nil
	}
	if w := ws[slot]; w != nil && w.State() == Healthy {
		return w
	}
	return nil
}
