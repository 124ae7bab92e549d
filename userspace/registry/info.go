package registry

import (
	"context"
	"crypto/sha1"
	"fmt"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// Info describes one worker (the JSON of the admin API).
type Info struct {
	// ID names the worker for sglang-router clients (slime reads
	// worker["id"]): a uuid derived from the URL, so the same engine has
	// the same id across restarts. /workers/{id} accepts it, the slot or
	// the URL.
	ID       string `json:"id"`
	WorkerID string `json:"worker_id"` // the slot, in decimal
	Slot     int    `json:"slot"`
	URL      string `json:"url"`
	// State is pending, healthy, unhealthy, draining or removed; Status
	// repeats it for callers of sglang-router's asynchronous worker API.
	State   string `json:"state"`
	Status  string `json:"status"`
	Healthy bool   `json:"healthy"` // last verdict of the health checks
	Origin  Origin `json:"origin"`
	// From the slot's counters (shared with the BPF maps when BPF is on).
	InFlight uint64 `json:"in_flight"`
	// MaxInFlight: the capacity above which the worker takes no new keys
	// (0: none).
	MaxInFlight uint64 `json:"max_in_flight"`
	Requests    uint64 `json:"requests"`
	Errors      uint64 `json:"errors"`

	// The weight sync (userspace/fleet, filled in by the admin API):
	// the worker's weight version as tetherd knows it, and its state in
	// the sync (serving, paused, updating, fenced, unhealthy, draining).
	WeightVersion string `json:"weight_version,omitempty"`
	SyncState     string `json:"sync_state,omitempty"`

	// Engine: what the worker's engine last reported to the load poller
	// (engine.go); absent for a worker whose load was never read.
	Engine *EngineInfo `json:"engine,omitempty"`
	// Pinned: the keys and sessions the sticky table holds for the
	// worker (sticky keys, remembered spills, learned session ids; keys
	// on their ring owner under --policy=hash need no entry), filled in
	// by the admin API; absent where the table cannot be walked.
	Pinned *int `json:"pinned,omitempty"`
	// Decisions: the requests this process routed to the worker, by
	// reason (session, hash, group, engine-least, veto, ...).
	Decisions map[string]uint64 `json:"decisions,omitempty"`
	// KVEvents: the worker's KV-event subscriptions, one per DP rank
	// (daemon.KVEngineStatus), filled in by the admin API.
	KVEvents any `json:"kv_events,omitempty"`

	ConsecutiveFailures int        `json:"consecutive_failures"`
	LastError           string     `json:"last_error,omitempty"`
	LastCheck           *time.Time `json:"last_check,omitempty"`
	Since               time.Time  `json:"since"` // last state change
}

func (r *Registry) stateLocked(e *entry) string {
	switch {
	case e.w == nil:
		return StatePending
	case e.draining:
		return StateDraining
	case e.healthy:
		return StateHealthy
	}
	return StateUnhealthy
}

func (r *Registry) infoLocked(e *entry) Info {
	st := r.stateLocked(e)
	slot, wid := e.slot, strconv.Itoa(e.slot)
	if slot < 0 { // pending: no slot yet
		slot, wid = -1, ""
	}
	in := Info{
		ID:                  StableID(e.url),
		WorkerID:            wid,
		Slot:                slot,
		URL:                 e.url,
		State:               st,
		Status:              st,
		Healthy:             e.w != nil && e.healthy,
		Origin:              e.origin,
		ConsecutiveFailures: e.fails,
		LastError:           e.lastErr,
		Since:               e.since,
	}
	in.MaxInFlight = r.capacityLocked(e.url)
	if !e.checked.IsZero() {
		t := e.checked
		in.LastCheck = &t
	}
	if e.w != nil {
		s := e.w.Stats.Load()
		in.InFlight, in.Requests, in.Errors = s.InFlight, s.Requests, s.Errors
		in.Engine = engineInfo(e.w)
		in.Decisions = route.Decisions(e.w)
	}
	return in
}

// List returns every worker by slot: those in slots, pending ones, and
// removed ones still finishing their requests (state removed).
func (r *Registry) List() []Info {
	r.mu.Lock()
	out := make([]Info, 0, len(r.entries)+len(r.retiring))
	for _, e := range r.entries {
		out = append(out, r.infoLocked(e))
	}
	for _, rt := range r.retiring {
		in := r.infoLocked(rt.e)
		in.State, in.Status, in.Healthy = StateRemoved, StateRemoved, false
		out = append(out, in)
	}
	r.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].Slot != out[j].Slot {
			return out[i].Slot < out[j].Slot
		}
		return out[i].State != StateRemoved // the slot's occupant first
	})
	return out
}

// URLs returns the urls of the workers in slots (pending and removed ones
// excluded), by slot: sglang-router's /list_workers.
func (r *Registry) URLs() []string {
	var urls []string
	for _, in := range r.List() {
		if in.State != StatePending && in.State != StateRemoved {
			urls = append(urls, in.URL)
		}
	}
	return urls
}

// StableID is the id of the worker at canonical url: a name-based uuid
// (version 5 layout over SHA-1 of the url), the same in every process.
func StableID(url string) string {
	h := sha1.Sum([]byte("tether-worker:" + url))
	h[6] = h[6]&0x0f | 0x50
	h[8] = h[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", h[0:4], h[4:6], h[6:8], h[8:10], h[10:16])
}

// Get returns one worker: id is its slot in decimal, its stable id, or its
// url (escaped or not).
func (r *Registry) Get(id string) (Info, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e, err := r.lookupLocked(id)
	if err != nil {
		return Info{}, err
	}
	return r.infoLocked(e), nil
}

func (r *Registry) lookupLocked(id string) (*entry, error) {
	if id == "" {
		return nil, fmt.Errorf("%w: empty id", ErrNotFound)
	}
	if n, err := strconv.Atoi(id); err == nil {
		if e := r.entries[n]; e != nil && n >= 0 {
			return e, nil
		}
		return nil, fmt.Errorf("%w: slot %s is empty", ErrNotFound, id)
	}
	if len(id) == 36 && strings.Count(id, "-") == 4 {
		for _, e := range r.entries {
			if StableID(e.url) == id {
				return e, nil
			}
		}
		return nil, fmt.Errorf("%w: id %s", ErrNotFound, id)
	}
	raw := id
	if u, err := url.PathUnescape(id); err == nil {
		raw = u
	}
	_, addr, err := ParseURL(raw)
	if err != nil {
		return nil, err
	}
	if e := r.findAddrLocked(addr); e != nil {
		return e, nil
	}
	return nil, fmt.Errorf("%w: %s", ErrNotFound, raw)
}

// Workers returns the workers in slots (the health checker's targets).
func (r *Registry) Workers() []*worker.Worker {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*worker.Worker, 0, len(r.entries))
	for _, e := range r.entries {
		if e.w != nil {
			out = append(out, e.w)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Slot < out[j].Slot })
	return out
}

// Counts returns how many workers are in each state.
func (r *Registry) Counts() map[string]int {
	m := map[string]int{StatePending: 0, StateHealthy: 0, StateUnhealthy: 0, StateDraining: 0, StateRemoved: 0}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, e := range r.entries {
		m[r.stateLocked(e)]++
	}
	m[StateRemoved] += len(r.retiring)
	return m
}

// Health returns the health verdict of the worker in slot and whether it
// is in the slot.
func (r *Registry) Health(slot int) (healthy, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.entries[slot]
	if e == nil || e.w == nil {
		return false, false
	}
	return e.healthy, true
}

// Sync reconciles the workers of origin config with urls (a SIGHUP
// reload): workers no longer listed are removed, new ones are added into
// the first free slots (in the order given, health-checked before they
// route, in the background), and the others keep their slots. A listed
// url that the admin API added becomes config-managed. Nothing changes if
// a url is invalid.
func (r *Registry) Sync(urls []string) (added, removed []string, err error) {
	want := make(map[string]string, len(urls)) // addr -> canonical url
	var order []string
	for _, u := range urls {
		canon, addr, err := ParseURL(u)
		if err != nil {
			return nil, nil, fmt.Errorf("worker: %w", err)
		}
		if _, dup := want[addr]; dup {
			return nil, nil, fmt.Errorf("worker: %w: %s listed twice", ErrDuplicate, canon)
		}
		want[addr] = canon
		order = append(order, addr)
	}
	r.mu.Lock()
	var drop []string
	for _, e := range r.entries {
		if _, ok := want[e.addr]; ok {
			if e.origin == OriginAdmin {
				e.origin = OriginConfig
			}
			continue
		}
		if e.origin == OriginConfig {
			drop = append(drop, strconv.Itoa(e.slot))
		}
	}
	r.mu.Unlock()
	sort.Slice(drop, func(i, j int) bool { a, _ := strconv.Atoi(drop[i]); b, _ := strconv.Atoi(drop[j]); return a < b })
	for _, id := range drop {
		if in, err := r.Remove(id); err == nil {
			removed = append(removed, in.URL)
		}
	}
	for _, addr := range order {
		r.mu.Lock()
		exists := r.findAddrLocked(addr) != nil
		r.mu.Unlock()
		if exists {
			continue
		}
		e, ctx, cancel, err := r.addBegin(context.Background(), want[addr], OriginConfig)
		if err != nil {
			r.log.Warn("reload: worker not added", "url", want[addr], "err", err)
			continue
		}
		r.mu.Lock()
		if r.closed {
			r.mu.Unlock()
			cancel()
			break
		}
		r.wg.Add(1) // under the lock: Close waits for it
		r.mu.Unlock()
		added = append(added, want[addr])
		go func() {
			defer r.wg.Done()
			defer cancel()
			r.addWait(ctx, e)
		}()
	}
	return added, removed, nil
}
