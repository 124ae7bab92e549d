package engine

import (
	"sync"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/route"
)

// DefaultMaxOwners bounds the request id table.
const DefaultMaxOwners = 1 << 20

const ownerShards = 64

var _ route.RequestOwners = (*Owners)(nil)

// Owners remembers which worker slot serves each request id in flight, so
// that an abort reaches that worker only (and, as the router's
// RequestOwners, a retry of the id reaches it too). It is bounded: past its capacity
// the oldest ids are dropped (an abort of a dropped id goes to every
// worker). An id sent twice while in flight (a retry) is counted twice; if
// the two went to different workers, the id is marked ambiguous and an
// abort of it goes to every worker.
type Owners struct {
	shards  [ownerShards]ownerShard
	dropped atomic.Uint64
}

type ownerShard struct {
	mu  sync.Mutex
	m   map[string]*owned
	old owned // sentinel of the insertion-ordered list: old.next is the oldest
	max int
}

type owned struct {
	rid        string
	slot       int
	refs       int
	ambiguous  bool
	prev, next *owned
}

// NewOwners returns an empty table of at most capacity ids
// (DefaultMaxOwners when capacity <= 0).
func NewOwners(capacity int) *Owners {
	if capacity <= 0 {
		capacity = DefaultMaxOwners
	}
	o := &Owners{}
	per := max((capacity+ownerShards-1)/ownerShards, 1)
	for i := range o.shards {
		s := &o.shards[i]
		s.m = make(map[string]*owned)
		s.old.next, s.old.prev = &s.old, &s.old
		s.max = per
	}
	return o
}

func (o *Owners) shard(rid []byte) *ownerShard {
	h := uint32(2166136261)
	for _, c := range rid {
		h ^= uint32(c)
		h *= 16777619
	}
	return &o.shards[h%ownerShards]
}

func (s *ownerShard) remove(e *owned) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
	delete(s.m, e.rid)
}

// Acquire records that rid is in flight on slot and returns the function
// that releases it (call it exactly once, when the exchange ended).
func (o *Owners) Acquire(rid string, slot int) func() {
	s := o.shard([]byte(rid))
	s.mu.Lock()
	e, ok := s.m[rid]
	if ok {
		e.refs++
		if e.slot != slot {
			e.ambiguous = true
		}
	} else {
		if len(s.m) >= s.max {
			s.remove(s.old.next) // drop the oldest
			o.dropped.Add(1)
		}
		e = &owned{rid: rid, slot: slot, refs: 1}
		s.m[rid] = e
		// Append at the newest end.
		e.prev, e.next = s.old.prev, &s.old
		s.old.prev.next = e
		s.old.prev = e
	}
	s.mu.Unlock()
	return func() {
		s.mu.Lock()
		// e may have been dropped (and rid reused by a newer entry).
		if e.next != nil {
			if e.refs--; e.refs <= 0 {
				s.remove(e)
			}
		}
		s.mu.Unlock()
	}
}

// Owner returns the slot serving rid, if exactly one worker does.
func (o *Owners) Owner(rid []byte) (int, bool) {
	s := o.shard(rid)
	s.mu.Lock()
	defer s.mu.Unlock()
	e, ok := s.m[string(rid)]
	if !ok || e.ambiguous {
		return 0, false
	}
	return e.slot, true
}

// Len returns the number of ids in flight.
func (o *Owners) Len() int {
	n := 0
	for i := range o.shards {
		s := &o.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}

// Dropped counts ids dropped to stay within capacity.
func (o *Owners) Dropped() uint64 { return o.dropped.Load() }

// OnWorker returns up to limit ids in flight on slot (any order).
func (o *Owners) OnWorker(slot, limit int) []string {
	var out []string
	for i := range o.shards {
		s := &o.shards[i]
		s.mu.Lock()
		for rid, e := range s.m {
			if len(out) >= limit {
				break
			}
			if e.slot == slot {
				out = append(out, rid)
			}
		}
		s.mu.Unlock()
	}
	return out
}
