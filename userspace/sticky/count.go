package sticky

// Ranger is a Table whose entries can be walked (for the operator's view:
// how many keys and sessions each worker holds), not for the data path.
type Ranger interface {
	// Range calls f for each entry, expired ones included, until f
	// returns false. Entries added or removed meanwhile may be missed.
	Range(f func(key uint64, e Entry) bool)
}

// CountLive counts t's live entries (sticky keys, remembered spills,
// learned sessions) by the identity of the worker they name; nil if t
// cannot be walked.
func CountLive(t Table, now int64) map[uint32]int {
	r, ok := t.(Ranger)
	if !ok {
		return nil
	}
	out := map[uint32]int{}
	r.Range(func(_ uint64, e Entry) bool {
		if e.Live(now) {
			out[e.ID]++
		}
		return true
	})
	return out
}

// Range implements Ranger, a shard at a time.
func (t *Memory) Range(f func(key uint64, e Entry) bool) {
	for i := range t.shards {
		s := &t.shards[i]
		s.mu.Lock()
		type kv struct {
			k uint64
			e Entry
		}
		items := make([]kv, 0, len(s.m))
		for k, n := range s.m {
			items = append(items, kv{k, n.e})
		}
		s.mu.Unlock()
		for _, it := range items {
			if !f(it.k, it.e) {
				return
			}
		}
	}
}

// Range implements Ranger with the map's iterator (no LRU update).
func (t *BPF) Range(f func(key uint64, e Entry) bool) {
	var k uint64
	var v bpfValue
	it := t.m.Iterate()
	for it.Next(&k, &v) {
		if !f(k, Entry{Worker: v.Worker, ID: v.WorkerID, Expires: int64(v.ExpiresNs)}) {
			return
		}
	}
	if it.Err() != nil {
		t.errors.Add(1)
	}
}
