package cluster

import (
	"context"
	"fmt"
	"sort"

	"github.com/tether-rl/tether/userspace/registry"
)

// KV-event endpoints in the table (Spec.KVEvents, KVEventsReplay): an
// admin add or change through one replica writes a worker's own publisher
// into its entry, and every replica that applies the entry (its first
// list of the table and every watch event) hands it to its KV-event
// wiring through the hook (SetKVEventsHook); when the entry goes, or
// stops naming one, the hook is called with "" and the replica falls back
// on its own flags (--worker-kv-events, the --kv-events template). The
// endpoints are checked by the caller (tetherd's, as the admin API's) on
// the way in and by the hook on the way out: the cluster package carries
// them.

// KVEndpoints is a worker's KV-event publisher and its replay endpoint
// (both tcp://host:port; Replay "" for none).
type KVEndpoints struct{ Endpoint, Replay string }

// kv returns the entry's endpoints (a replay alone names nothing).
func (s Spec) kv() KVEndpoints {
	if s.KVEvents == "" {
		return KVEndpoints{}
	}
	return KVEndpoints{s.KVEvents, s.KVEventsReplay}
}

// SetKVEventsHook sets what the replica calls as it applies the table's
// KV-event endpoints: (url, endpoint, replay), endpoint "" when the
// worker's entry went or names none any more. Calls come from one
// goroutine (the replica's), by URL, and only on a change. Set it before
// Start.
func (r *Replica) SetKVEventsHook(f func(url, endpoint, replay string)) { r.kvHook = f }

// KVEvents returns the endpoints the table names for each worker, as
// this replica applied them.
func (r *Replica) KVEvents() map[string]KVEndpoints {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]KVEndpoints, len(r.kvApplied))
	for u, e := range r.kvApplied {
		out[u] = e
	}
	return out
}

// applyKV hands the desired table's endpoints that changed since the last
// apply to the hook (called by apply, its only writer of kvApplied).
func (r *Replica) applyKV(desired map[int]Spec) {
	want := map[string]KVEndpoints{}
	for _, d := range desired {
		if e := d.kv(); e.Endpoint != "" {
			want[d.URL] = e
		}
	}
	type change struct {
		url string
		e   KVEndpoints
	}
	var changes []change
	r.mu.Lock()
	for u := range r.kvApplied {
		if _, ok := want[u]; !ok {
			changes = append(changes, change{u, KVEndpoints{}})
		}
	}
	for u, e := range want {
		if cur, ok := r.kvApplied[u]; !ok || cur != e {
			changes = append(changes, change{u, e})
		}
	}
	r.mu.Unlock()
	if len(changes) == 0 {
		return
	}
	sort.Slice(changes, func(i, j int) bool { return changes[i].url < changes[j].url })
	for _, c := range changes {
		if r.kvHook != nil {
			r.kvHook(c.url, c.e.Endpoint, c.e.Replay)
		}
	}
	r.mu.Lock()
	for _, c := range changes {
		if c.e.Endpoint == "" {
			delete(r.kvApplied, c.url)
		} else {
			r.kvApplied[c.url] = c.e
		}
	}
	r.mu.Unlock()
}

// SetKVEvents sets the worker's KV-event endpoints on every replica
// (endpoint "": none in the table, each replica's own flags apply); for a
// URL not in the table yet they are kept for its add (as SetCapacity
// keeps a capacity). It returns the canonical URL once this replica has
// applied the change. The caller checks the endpoints.
func (r *Replica) SetKVEvents(rawURL, endpoint, replay string) (string, error) {
	canon, _, err := registry.ParseURL(rawURL)
	if err != nil {
		return "", err
	}
	want := Spec{KVEvents: endpoint, KVEventsReplay: replay}.kv()
	if !r.isSynced() {
		// Whether the URL is in the table is known only once listed.
		if err := r.writable(context.Background()); err != nil {
			return "", err
		}
	}
	in, err := r.reg.Get(canon)
	if err != nil || in.Origin != registry.OriginCluster {
		r.mu.Lock()
		if want.Endpoint == "" {
			delete(r.pendingKV, canon)
		} else {
			r.pendingKV[canon] = want
		}
		r.mu.Unlock()
		return canon, nil
	}
	r.mu.Lock()
	cur, ok := r.desired[in.Slot]
	r.mu.Unlock()
	if ok && cur.URL == canon && cur.kv() == want {
		return canon, nil
	}
	if !r.up.Load() {
		return "", storeErr(fmt.Errorf("%w: %s", ErrUnavailable, r.cause()))
	}
	if err := r.store.Update(context.Background(), in.Slot, in.URL, func(s *Spec) {
		s.KVEvents, s.KVEventsReplay = want.Endpoint, want.Replay
	}); err != nil {
		return "", storeErr(err)
	}
	return canon, r.waitApplied(func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.kvApplied[canon] == want
	})
}
