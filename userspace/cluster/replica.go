package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/worker"
)

func quietLogger() *zap.Logger { return zap.NewNop() }

// Registry is what a replica applies the table to: the local registry.
type Registry interface {
	Put(slot int, url string, origin registry.Origin) (registry.Info, error)
	Remove(id string) (registry.Info, error)
	Drain(id string) (registry.Info, error)
	Undrain(id string) (registry.Info, error)
	SetCapacity(url string, n uint64) (string, error)
	Get(id string) (registry.Info, error)
	List() []registry.Info
	WaitHealthy(ctx context.Context, url string) error
}

// roleRegistry is a Registry that keeps P/D roles (registry.Registry).
type roleRegistry interface {
	SetRole(url string, spec registry.RoleSpec) (string, error)
	RoleOf(url string) (registry.RoleSpec, bool)
}

// Replica keeps the local registry equal to the cluster's table: it
// lists the table, watches it from that revision, and applies every
// change (within a second: a watch event is applied at once; what cannot
// be applied yet, a slot still retiring, is tried again every 250 ms).
// While etcd is unreachable it keeps the last table (routing goes on),
// reports the link down, and reconciles from a fresh list when it is
// back.
type Replica struct {
	store *Store
	reg   Registry
	log   *slog.Logger

	mu      sync.Mutex
	desired map[int]Spec
	rev     int64
	pending map[string]uint64 // max_in_flight asked before the worker's add
	// KV-event endpoints (kvevents.go): asked before the worker's add,
	// applied (handed to kvHook) by URL.
	pendingKV map[string]KVEndpoints
	kvApplied map[string]KVEndpoints
	kvHook    func(url, endpoint, replay string)

	up        atomic.Bool
	lastErr   atomic.Pointer[string]
	applied   atomic.Uint64 // changes applied to the registry
	skipped   atomic.Uint64 // bad entries skipped
	kick      chan struct{}
	synced    chan struct{} // closed once the first list is applied and its watch created
	syncOnce  sync.Once
	linkWait  atomic.Int64 // how long a write waits for the first list (ns)
	stop      chan struct{}
	done      chan struct{}
	stopOnce  sync.Once
	startOnce sync.Once
	started   bool
}

// Status is what GET /cluster, tetherctl status and /metrics show.
type Status struct {
	Name string `json:"name"`
	Up   bool   `json:"up"`
	// Synced: the first list of the table was applied and its watch
	// created; before, the replica is not ready and admin writes wait.
	Synced    bool   `json:"synced"`
	LastError string `json:"last_error,omitempty"`
	Revision  int64  `json:"revision"`
	Workers   int    `json:"workers"`
	Applied   uint64 `json:"applied"`
	Skipped   uint64 `json:"skipped"`
	// Fleet is the fleet key's link (the weight sync's phase, fleet.go).
	Fleet *FleetStatus `json:"fleet,omitempty"`
}

// DefaultLinkWait bounds how long an admin write that comes before the
// replica's first list of the table waits for it.
const DefaultLinkWait = 10 * time.Second

// NewReplica returns the replica that applies the cluster's table to
// reg once started: Start it when everything the registry's changes reach
// (metrics, hooks) exists.
func NewReplica(store *Store, reg Registry, log *slog.Logger) *Replica {
	r := &Replica{store: store, reg: reg, log: log, desired: map[int]Spec{}, pending: map[string]uint64{},
		pendingKV: map[string]KVEndpoints{}, kvApplied: map[string]KVEndpoints{},
		kick: make(chan struct{}, 1), synced: make(chan struct{}), stop: make(chan struct{}), done: make(chan struct{})}
	r.linkWait.Store(int64(DefaultLinkWait))
	return r
}

// SetLinkWait changes how long a write that comes before the first list
// of the table waits for it (DefaultLinkWait).
func (r *Replica) SetLinkWait(d time.Duration) { r.linkWait.Store(int64(d)) }

// Synced is closed once the replica has applied its first list of the
// table and etcd created the watch that follows it: from then on this
// replica's table is the cluster's (or, while the link is down, the last
// one seen). Before, it is not ready (readiness, systemd READY=1) and
// admin writes wait for it.
func (r *Replica) Synced() <-chan struct{} { return r.synced }

func (r *Replica) isSynced() bool {
	select {
	case <-r.synced:
		return true
	default:
		return false
	}
}

// cause says why the link is down: the last error seen, never empty.
func (r *Replica) cause() string {
	if e := r.lastErr.Load(); e != nil && *e != "" {
		return *e
	}
	return fmt.Sprintf("no answer from etcd at %s yet", strings.Join(r.store.cli.Endpoints(), ","))
}

// writable waits until the replica has listed the table (at most its link
// wait, or until ctx ends), then says whether etcd is reachable: nil, or
// an ErrUnavailable naming the cause. An admin write before the first list
// would decide on an empty local table (a duplicate or a worker not seen)
// and, before the fix, answered 503 with no cause: launchers add workers as
// soon as the admin API answers.
func (r *Replica) writable(ctx context.Context) error {
	if !r.isSynced() {
		wait := time.Duration(r.linkWait.Load())
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-r.synced:
		case <-t.C:
			return storeErr(fmt.Errorf("%w: the table was not listed in %v since start-up (%s)", ErrUnavailable, wait, r.cause()))
		case <-ctx.Done():
			return storeErr(fmt.Errorf("%w: the table not listed yet since start-up (%s): %v", ErrUnavailable, r.cause(), ctx.Err()))
		case <-r.stop:
			return storeErr(fmt.Errorf("%w: replica stopped", ErrUnavailable))
		}
	}
	if !r.up.Load() {
		return storeErr(fmt.Errorf("%w: %s", ErrUnavailable, r.cause()))
	}
	return nil
}

// Start begins listing, watching and applying.
func (r *Replica) Start() {
	r.startOnce.Do(func() {
		r.started = true
		go r.run()
	})
}

// Close stops the replica (the registry keeps what it has).
func (r *Replica) Close() {
	r.stopOnce.Do(func() { close(r.stop) })
	r.startOnce.Do(func() {}) // never started: nothing to wait for
	if r.started {
		<-r.done
	}
}

// Up reports whether etcd answered the last check.
func (r *Replica) Up() bool { return r.up.Load() }

// Status returns the link's state.
func (r *Replica) Status() Status {
	r.mu.Lock()
	st := Status{Name: r.store.prefix, Up: r.up.Load(), Synced: r.isSynced(), Revision: r.rev, Workers: len(r.desired),
		Applied: r.applied.Load(), Skipped: r.skipped.Load()}
	r.mu.Unlock()
	if !st.Up {
		st.LastError = r.cause()
	}
	return st
}

func (r *Replica) setDown(err error) {
	msg := err.Error()
	r.lastErr.Store(&msg)
	if r.up.Swap(false) {
		r.log.Error("cluster link down: routing on the last table seen; admin writes answer 503", "err", err)
	}
}

func (r *Replica) setUp() {
	if !r.up.Swap(true) {
		r.log.Info("cluster link up", "prefix", r.store.prefix)
	}
}

// run lists and watches until stopped; any failure means list again.
func (r *Replica) run() {
	defer close(r.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { <-r.stop; cancel() }()
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		t, err := r.store.Load(ctx)
		if err != nil {
			r.setDown(err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(backoff):
			}
			backoff = min(2*backoff, 2*time.Second)
			continue
		}
		backoff = 100 * time.Millisecond
		for _, b := range t.Bad {
			r.skipped.Add(1)
			r.log.Warn("cluster: skipping a bad entry", "entry", b)
		}
		r.mu.Lock()
		r.desired, r.rev = t.Workers, t.Revision
		r.mu.Unlock()
		r.setUp()
		r.apply()
		r.watch(ctx, t.Revision)
	}
}

// watch applies events from rev+1 until the watch fails or etcd stops
// answering (checked every second: a watch alone can sit silent through an
// outage).
func (r *Replica) watch(parent context.Context, rev int64) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(parent))
	defer cancel()
	wch := r.store.cli.Watch(ctx, r.store.workersPrefix(), clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithCreatedNotify())
	ping := time.NewTicker(time.Second)
	defer ping.Stop()
	retry := time.NewTicker(250 * time.Millisecond)
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-r.kick:
			r.apply()
		case <-retry.C:
			r.apply()
		case <-ping.C:
			if err := r.store.Ping(ctx); err != nil {
				r.setDown(err)
				return // list again once it answers
			}
		case wr, ok := <-wch:
			if !ok || wr.Err() != nil {
				if ok {
					r.setDown(wr.Err())
				}
				return
			}
			if wr.Created {
				// The first list and its watch are in place.
				r.syncOnce.Do(func() { close(r.synced) })
				continue
			}
			r.mu.Lock()
			for _, ev := range wr.Events {
				slot, spec, err := r.store.decode(ev.Kv.Key, ev.Kv.Value)
				switch {
				case ev.Type == clientv3.EventTypeDelete:
					if n, ok := r.store.slotOf(ev.Kv.Key); ok {
						delete(r.desired, n)
					}
				case err != nil:
					r.skipped.Add(1)
					r.log.Warn("cluster: skipping a bad entry", "key", string(ev.Kv.Key), "err", err)
				default:
					spec.Lease = ev.Kv.Lease
					r.desired[slot] = spec
				}
			}
			r.rev = wr.Header.Revision
			r.mu.Unlock()
			r.apply()
		}
	}
}

// apply makes the registry's cluster workers equal to the desired table:
// removals first (a URL may have moved), then additions and changes.
func (r *Replica) apply() {
	r.mu.Lock()
	desired := make(map[int]Spec, len(r.desired))
	for k, v := range r.desired {
		desired[k] = v
	}
	r.mu.Unlock()
	r.applyKV(desired) // before the adds: a new worker's subscriber is there as it takes its slot
	have := map[int]registry.Info{}
	for _, in := range r.reg.List() {
		if in.State == registry.StateRemoved || in.State == registry.StatePending || in.Origin != registry.OriginCluster {
			continue
		}
		have[in.Slot] = in
	}
	for slot, in := range have {
		if d, ok := desired[slot]; !ok || d.URL != in.URL {
			if _, err := r.reg.Remove(in.URL); err == nil {
				r.applied.Add(1)
			}
			delete(have, slot)
		}
	}
	for slot, d := range desired {
		in, ok := have[slot]
		applyRole(r.reg, d)
		if !ok {
			var err error
			if in, err = r.reg.Put(slot, d.URL, registry.OriginCluster); err != nil {
				continue // the slot is still retiring, or the URL still in another: next round
			}
			r.applied.Add(1)
		}
		if in.MaxInFlight != d.MaxInFlight {
			r.reg.SetCapacity(d.URL, d.MaxInFlight)
		}
		switch draining := in.State == registry.StateDraining; {
		case d.Draining && !draining:
			r.reg.Drain(d.URL)
		case !d.Draining && draining:
			r.reg.Undrain(d.URL)
		}
	}
}

// poke asks for an apply now.
func (r *Replica) poke() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// waitApplied waits until cond holds on the local registry (the watch
// applied a write), for at most 3 s.
func (r *Replica) waitApplied(cond func() bool) error {
	deadline := time.Now().Add(3 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			return storeErr(fmt.Errorf("%w: the change was written but not seen back from the watch in 3s", ErrUnavailable))
		}
		r.poke()
		time.Sleep(5 * time.Millisecond)
	}
	return nil
}

// storeErr maps a store error onto the registry's, which the admin API
// turns into statuses (503 for ErrUnavailable, 409, 404).
func storeErr(err error) error {
	switch {
	case errors.Is(err, ErrUnavailable):
		// A 503, in etcd's words: not registry.ErrUnavailable's text ("worker
		// did not become healthy"), which would blame the worker.
		return linkError{err}
	case errors.Is(err, ErrDuplicate):
		return fmt.Errorf("%w: %v", registry.ErrDuplicate, err)
	case errors.Is(err, ErrNotFound):
		return fmt.Errorf("%w: %v", registry.ErrNotFound, err)
	case errors.Is(err, ErrFull):
		return fmt.Errorf("%w: %v", registry.ErrFull, err)
	}
	return err
}

// linkError is an etcd failure that the admin API answers as the
// registry's ErrUnavailable (503), with the store's own message.
type linkError struct{ err error }

func (e linkError) Error() string        { return e.err.Error() }
func (e linkError) Unwrap() error        { return e.err }
func (e linkError) Is(target error) bool { return target == registry.ErrUnavailable }

// Add is the admin API's add in cluster mode: the worker must pass this
// replica's health check first (as on one host), then it claims the lowest
// free slot in etcd; it returns once this replica's watch applied it.
func (r *Replica) Add(ctx context.Context, rawURL string, origin registry.Origin) (registry.Info, error) {
	canon, _, err := registry.ParseURL(rawURL)
	if err != nil {
		return registry.Info{}, err
	}
	if err := r.writable(ctx); err != nil {
		return registry.Info{}, err
	}
	if in, err := r.reg.Get(canon); err == nil && in.State != registry.StateRemoved {
		return in, fmt.Errorf("%w: %s (slot %d)", registry.ErrDuplicate, in.URL, in.Slot)
	}
	if err := r.reg.WaitHealthy(ctx, canon); err != nil {
		return registry.Info{}, fmt.Errorf("%w: %s: %v", registry.ErrUnavailable, canon, err)
	}
	r.mu.Lock()
	capacity, kv := r.pending[canon], r.pendingKV[canon]
	delete(r.pending, canon)
	delete(r.pendingKV, canon)
	r.mu.Unlock()
	spec := Spec{URL: canon, MaxInFlight: capacity, KVEvents: kv.Endpoint, KVEventsReplay: kv.Replay}
	if rr, ok := r.reg.(roleRegistry); ok {
		if rs, ok := rr.RoleOf(canon); ok && rs.Role != worker.Regular {
			spec.Role, spec.BootstrapPort = rs.Role.String(), rs.BootstrapPort
		}
	}
	slot, err := r.store.Claim(ctx, spec, 0)
	if err != nil {
		return registry.Info{}, storeErr(err)
	}
	return r.infoWhen(canon, func(in registry.Info) bool { return in.Slot == slot && in.State != registry.StateRemoved })
}

// infoWhen waits until the local registry shows url as ok says.
func (r *Replica) infoWhen(u string, ok func(registry.Info) bool) (registry.Info, error) {
	var in registry.Info
	err := r.waitApplied(func() bool {
		var err error
		in, err = r.reg.Get(u)
		return err == nil && ok(in)
	})
	return in, err
}

// locate resolves an admin id (slot, id, URL) to the worker's slot and URL.
func (r *Replica) locate(id string) (registry.Info, error) {
	if err := r.writable(context.Background()); err != nil {
		return registry.Info{}, err
	}
	in, err := r.reg.Get(id)
	if err != nil {
		return registry.Info{}, err
	}
	if in.Origin != registry.OriginCluster {
		return registry.Info{}, fmt.Errorf("%w: %s (slot %d) is not in the cluster table", registry.ErrManaged, in.URL, in.Slot)
	}
	return in, nil
}

// Remove deletes the worker from the cluster's table.
func (r *Replica) Remove(id string) (registry.Info, error) {
	in, err := r.locate(id)
	if err != nil {
		return registry.Info{}, err
	}
	if err := r.store.Release(context.Background(), in.Slot, in.URL); err != nil {
		return registry.Info{}, storeErr(err)
	}
	err = r.waitApplied(func() bool {
		cur, err := r.reg.Get(in.URL)
		return err != nil || cur.State == registry.StateRemoved
	})
	in.State, in.Status = registry.StateRemoved, registry.StateRemoved
	return in, err
}

func (r *Replica) setDraining(id string, draining bool) (registry.Info, error) {
	in, err := r.locate(id)
	if err != nil {
		return registry.Info{}, err
	}
	if err := r.store.Update(context.Background(), in.Slot, in.URL, func(s *Spec) { s.Draining = draining }); err != nil {
		return registry.Info{}, storeErr(err)
	}
	return r.infoWhen(in.URL, func(cur registry.Info) bool { return (cur.State == registry.StateDraining) == draining })
}

// Drain marks the worker draining on every replica.
func (r *Replica) Drain(id string) (registry.Info, error) { return r.setDraining(id, true) }

// Undrain ends a drain on every replica.
func (r *Replica) Undrain(id string) (registry.Info, error) { return r.setDraining(id, false) }

// SetCapacity sets the worker's max_in_flight on every replica; for a URL
// not in the table yet it is kept for its add.
func (r *Replica) SetCapacity(rawURL string, n uint64) (string, error) {
	canon, _, err := registry.ParseURL(rawURL)
	if err != nil {
		return "", err
	}
	if !r.isSynced() {
		// Whether the URL is in the table is known only once listed.
		if err := r.writable(context.Background()); err != nil {
			return "", err
		}
	}
	in, err := r.reg.Get(canon)
	if err != nil || in.Origin != registry.OriginCluster {
		r.mu.Lock()
		r.pending[canon] = n
		r.mu.Unlock()
		return canon, nil
	}
	if !r.up.Load() {
		return "", storeErr(fmt.Errorf("%w: %s", ErrUnavailable, r.cause()))
	}
	if err := r.store.Update(context.Background(), in.Slot, in.URL, func(s *Spec) { s.MaxInFlight = n }); err != nil {
		return "", storeErr(err)
	}
	_, err = r.infoWhen(canon, func(cur registry.Info) bool { return cur.MaxInFlight == n })
	return canon, err
}

// Register keeps url in the cluster's table on a lease of ttl until ctx
// ends (then the lease is revoked and the worker leaves every replica's
// table); if the process dies, the lease expires after ttl. It returns the
// slot once claimed, and runs the renewals in the background: done is
// closed when they stop (err says why, nil after ctx ended).
func Register(ctx context.Context, s *Store, rawURL string, ttl time.Duration) (slot int, done <-chan error, err error) {
	canon, _, err := registry.ParseURL(rawURL)
	if err != nil {
		return 0, nil, err
	}
	secs := int64(ttl / time.Second)
	if secs < 1 {
		return 0, nil, fmt.Errorf("--lease %v: want at least 1s", ttl)
	}
	lctx, cancel := s.ctx(ctx)
	lease, err := s.cli.Grant(lctx, secs)
	cancel()
	if err != nil {
		return 0, nil, storeErr(unavailable(err))
	}
	slot, err = s.Claim(ctx, Spec{URL: canon}, lease.ID)
	if err != nil {
		rctx, cancel := s.ctx(context.Background())
		s.cli.Revoke(rctx, lease.ID)
		cancel()
		return slot, nil, err
	}
	ka, err := s.cli.KeepAlive(ctx, lease.ID)
	if err != nil {
		return slot, nil, unavailable(err)
	}
	ch := make(chan error, 1)
	go func() {
		for range ka {
		}
		rctx, cancel := s.ctx(context.Background())
		defer cancel()
		if ctx.Err() != nil {
			_, err := s.cli.Revoke(rctx, lease.ID)
			if err != nil {
				err = unavailable(err)
			}
			ch <- err
			return
		}
		ch <- fmt.Errorf("%w: lease renewals stopped", ErrUnavailable)
	}()
	return slot, ch, nil
}

// applyRole gives the local registry the P/D role the table names for d
// (before its worker takes its slot, or at once if it holds one).
func applyRole(r Registry, d Spec) {
	reg, ok := r.(roleRegistry)
	if d.Role == "" || !ok {
		return
	}
	role, err := worker.ParseRole(d.Role)
	if err != nil {
		return
	}
	want := registry.RoleSpec{Role: role, BootstrapPort: d.BootstrapPort}
	if cur, ok := reg.RoleOf(d.URL); !ok || cur != want {
		reg.SetRole(d.URL, want)
	}
}
