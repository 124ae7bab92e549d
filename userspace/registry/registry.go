// Package registry owns the life of tetherd's backend workers: it places
// them in the stable slots of a route.Table, keeps their state (pending,
// healthy, unhealthy, draining, removed), turns health observations into
// state changes with hysteresis, and retires removed workers without
// cutting the requests they still serve.
//
// Slots are stable: adding a worker takes the first free slot, removing one
// leaves its slot empty and never moves another worker. A slot stays
// reserved while its removed worker still has requests in flight (bounded
// by Options.RemoveGrace), so that the counters of the slot are never reset
// under a request that still uses them.
//
// Every state change is one structured log line; nothing is logged per
// request or per health probe.
package registry

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
)

// Origin says who manages a worker.
type Origin string

const (
	OriginConfig Origin = "config" // --worker, --demo or the config file; SIGHUP reconciles them
	OriginAdmin  Origin = "admin"  // added through the admin API
	OriginSpawn  Origin = "spawn"  // a process of --spawn; the supervisor owns it
	// OriginCluster: in the cluster's table (etcd, --cluster), applied by
	// the cluster replica; changed only through it.
	OriginCluster Origin = "cluster"
)

// States reported by Info.State (route.State plus the registry's own).
const (
	StatePending   = "pending"   // added, waiting for its first successful health check
	StateHealthy   = "healthy"   // routable
	StateUnhealthy = "unhealthy" // failing health checks: no new sessions (panic mode aside)
	StateDraining  = "draining"  // no new sessions; existing sessions still reach it
	StateRemoved   = "removed"   // out of its slot, finishing the requests it had
)

// Errors returned by the registry; the admin API maps them to statuses.
var (
	ErrBadURL    = errors.New("bad worker url")
	ErrDuplicate = errors.New("worker already registered")
	ErrNotFound  = errors.New("no such worker")
	ErrFull      = errors.New("no free worker slot")
	// ErrTooManyPending: MaxPending adds are waiting for their first good
	// health check; this one is refused at once rather than take a slot.
	ErrTooManyPending = errors.New("too many workers pending their first health check")
	ErrUnavailable    = errors.New("worker did not become healthy")
	ErrManaged        = errors.New("worker is managed by --spawn")
	ErrClosed         = errors.New("registry closed")
)

// ParseURL checks a worker URL (http://host:port, no path, query or
// credentials) and returns its canonical form (no trailing slash, lower
// case scheme and host) and the address to dial. https is refused: tether
// speaks plain HTTP/1.1 upstream.
func ParseURL(raw string) (canon, addr string, err error) {
	if strings.TrimSpace(raw) == "" {
		return "", "", fmt.Errorf("%w: missing url", ErrBadURL)
	}
	if i := strings.Index(raw, "://"); i >= 0 && strings.Contains(raw[i+3:], "@") {
		return "", "", fmt.Errorf("%w %q: data-parallel rank URLs (url@rank) are not supported: register the engine's base URL http://host:port once (the engine spreads over its own ranks)", ErrBadURL, raw)
	}
	u, err := url.Parse(raw)
	if err != nil {
		return "", "", fmt.Errorf("%w %q: %v", ErrBadURL, raw, err)
	}
	switch strings.ToLower(u.Scheme) {
	case "http":
	case "https":
		return "", "", fmt.Errorf("%w %q: https backends are not supported (tether speaks plain HTTP/1.1 upstream)", ErrBadURL, raw)
	default:
		return "", "", fmt.Errorf("%w %q: scheme must be http", ErrBadURL, raw)
	}
	if u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return "", "", fmt.Errorf("%w %q: want http://host:port", ErrBadURL, raw)
	}
	host, port := strings.ToLower(u.Hostname()), u.Port()
	if host == "" {
		return "", "", fmt.Errorf("%w %q: want http://host:port", ErrBadURL, raw)
	}
	if port == "" {
		port = "80"
	} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", "", fmt.Errorf("%w %q: bad port", ErrBadURL, raw)
	}
	addr = net.JoinHostPort(host, port)
	canon = "http://" + strings.ToLower(u.Host)
	return canon, addr, nil
}

// Prober checks a worker's health (GET url/health); nil means healthy.
type Prober func(ctx context.Context, url string) error

// Options configure a Registry. Zero values take the defaults.
type Options struct {
	Table *route.Table
	Stats *stats.Table
	Pool  upstream.Options
	// MaxWorkers bounds the slots; default and maximum stats.MaxWorkers.
	MaxWorkers int
	// Failures: consecutive failed checks that make a healthy worker
	// unhealthy (default 3). Successes: consecutive good checks that make
	// an unhealthy worker healthy again (default 2).
	Failures, Successes int
	// StartupTimeout bounds Add's wait for a new worker's first successful
	// health check; default 5 minutes.
	StartupTimeout time.Duration
	// RemoveGrace bounds the wait for a removed worker's requests in flight
	// before its pool is closed and its slot becomes free; default 60s.
	RemoveGrace time.Duration
	// Probe checks a pending worker; required for Add.
	Probe Prober
	// Self lists tetherd's own endpoints (ip:port of its data and admin
	// listeners): a worker URL that reaches one of them is refused (a
	// request would loop through tetherd until its descriptors ran out).
	Self []string
	// MaxPending bounds the adds waiting for their first good health check
	// at once (each holds a slot for up to StartupTimeout): beyond it an
	// add is refused (ErrTooManyPending), so that adds of unreachable URLs
	// cannot fill the slots; default 64.
	MaxPending int
	// MaxInFlight is every worker's capacity unless SetCapacity gave it its
	// own: at or above it in flight a worker takes no new keys (0: none).
	MaxInFlight uint64
	// OnPut is called (outside the registry's lock) when a worker takes a
	// slot, e.g. to create its metric children.
	OnPut func(w *route.Worker)
	Log   *slog.Logger
}

func (o *Options) setDefaults() {
	if o.MaxWorkers <= 0 || o.MaxWorkers > stats.MaxWorkers {
		o.MaxWorkers = stats.MaxWorkers
	}
	if o.Failures <= 0 {
		o.Failures = 3
	}
	if o.Successes <= 0 {
		o.Successes = 2
	}
	if o.StartupTimeout <= 0 {
		o.StartupTimeout = 5 * time.Minute
	}
	if o.RemoveGrace <= 0 {
		o.RemoveGrace = 60 * time.Second
	}
	if o.MaxPending <= 0 {
		o.MaxPending = 64
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
}

// entry is one worker known to the registry.
type entry struct {
	slot   int
	url    string
	addr   string
	origin Origin
	w      *route.Worker // nil while pending
	// cancel ends a pending Add (remove while starting).
	cancel context.CancelFunc

	keys   []string // the ip:port endpoints addr resolved to (findAddrLocked)
	keysOf string   // the addr keys belong to

	draining bool
	healthy  bool
	fails    int // consecutive failed checks
	succs    int // consecutive good checks
	lastErr  string
	checked  time.Time
	since    time.Time // last state change
}

// retiree is a removed worker finishing its requests.
type retiree struct {
	e    *entry
	done chan struct{}
}

// Registry is the worker registry. All methods are safe for concurrent use.
type Registry struct {
	opts Options
	log  *slog.Logger

	mu       sync.Mutex
	entries  map[int]*entry   // by slot, pending ones included
	retiring map[int]*retiree // by slot
	lastURL  map[int]string   // last worker url that held each slot in this process
	// pendingSeq files pending adds under keys below 0 in entries (they
	// hold no slot until their first good health check).
	pendingSeq int
	capacity   map[string]uint64 // max_in_flight by worker url (SetCapacity)
	panic      bool              // every routable worker unhealthy
	closed     bool
	stop       chan struct{}
	wg         sync.WaitGroup
	changes    atomic.Uint64 // state changes, for tests and metrics
	panics     atomic.Uint64 // times panic mode was entered
}

// New returns an empty registry over opts.Table.
func New(opts Options) *Registry {
	opts.setDefaults()
	if opts.Table == nil {
		opts.Table = route.NewTable()
	}
	if opts.Stats == nil {
		opts.Stats = stats.NewHeap()
	}
	return &Registry{
		opts:     opts,
		log:      opts.Log,
		entries:  make(map[int]*entry),
		retiring: make(map[int]*retiree),
		lastURL:  make(map[int]string),
		capacity: make(map[string]uint64),
		stop:     make(chan struct{}),
	}
}

// Table returns the route table the registry fills.
func (r *Registry) Table() *route.Table { return r.opts.Table }

// Changes returns the number of state changes so far.
func (r *Registry) Changes() uint64 { return r.changes.Load() }

// Panic reports whether every routable worker is unhealthy (the router
// then spreads over all of them rather than answer 503).
func (r *Registry) Panic() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.panic
}

// PanicEntered returns how many times panic mode was entered.
func (r *Registry) PanicEntered() uint64 { return r.panics.Load() }

// Thresholds returns the failures and successes of the health hysteresis.
func (r *Registry) Thresholds() (failures, successes int) {
	return r.opts.Failures, r.opts.Successes
}

// findLocked returns the entry whose canonical url or address is addr.
// findAddrLocked returns the entry at addr, or at an alias of it (a host
// name and the address it resolves to, localhost and 127.0.0.1: one
// engine, one slot).
func (r *Registry) findAddrLocked(addr string) *entry {
	for _, e := range r.entries {
		if e.addr == addr {
			return e
		}
	}
	keys := endpointKeys(addr)
	for _, e := range r.entries {
		if e.keys == nil || e.keysOf != e.addr {
			e.keys, e.keysOf = endpointKeys(e.addr), e.addr // resolved once per address
		}
		for _, k := range e.keys {
			if slices.Contains(keys, k) {
				return e
			}
		}
	}
	return nil
}

// AddSelf adds endpoints of tetherd's own (a listener bound after the
// registry was made) to Options.Self.
func (r *Registry) AddSelf(endpoints ...string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.opts.Self = append(slices.Clone(r.opts.Self), endpoints...)
}

// pendingLocked counts the adds waiting for their first good check.
func (r *Registry) pendingLocked() int {
	n := 0
	for _, e := range r.entries {
		if e.w == nil && e.cancel != nil {
			n++
		}
	}
	return n
}

// notSelf refuses a worker address that is tetherd itself.
func (r *Registry) notSelf(canon, addr string) error {
	r.mu.Lock()
	self := r.opts.Self
	r.mu.Unlock()
	if len(self) == 0 {
		return nil
	}
	for _, k := range endpointKeys(addr) {
		if slices.Contains(self, k) {
			return fmt.Errorf("%w %q: that is tetherd itself (%s), not a worker", ErrBadURL, canon, k)
		}
	}
	return nil
}

// endpointKeys returns the ip:port endpoints addr names: itself for an IP
// address, else those its host resolves to (at most a few; none when it
// does not resolve).
func endpointKeys(addr string) []string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil {
		return []string{net.JoinHostPort(ip.String(), port)}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ips, err := net.DefaultResolver.LookupHost(ctx, host)
	if err != nil {
		return nil
	}
	out := make([]string, 0, len(ips))
	for _, ip := range ips {
		if p := net.ParseIP(ip); p != nil {
			out = append(out, net.JoinHostPort(p.String(), port))
		}
	}
	return out
}

// freeSlotLocked returns the first slot with no worker, no pending add and
// no removed worker still finishing, or -1.
func (r *Registry) freeSlotLocked() int {
	for i := 0; i < r.opts.MaxWorkers; i++ {
		if r.entries[i] != nil || r.retiring[i] != nil {
			continue
		}
		return i
	}
	return -1
}

// Put places a worker in slot at once, healthy, without a health check:
// the workers tetherd starts with (--worker, --demo, config file). Their
// slot counters are kept (a restarted tetherd sharing the BPF counters
// memory carries on counting).
func (r *Registry) Put(slot int, rawURL string, origin Origin) (Info, error) {
	canon, addr, err := ParseURL(rawURL)
	if err == nil {
		err = r.notSelf(canon, addr)
	}
	if err != nil {
		return Info{}, err
	}
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return Info{}, ErrClosed
	}
	if slot < 0 || slot >= r.opts.MaxWorkers {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("slot %d: want 0..%d", slot, r.opts.MaxWorkers-1)
	}
	if d := r.findAddrLocked(addr); d != nil {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	if r.entries[slot] != nil || r.retiring[slot] != nil {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("slot %d is taken", slot)
	}
	e := &entry{slot: slot, url: canon, addr: addr, origin: origin}
	r.entries[slot] = e
	r.lastURL[slot] = canon // start-up workers keep the slot's counters
	w := r.activateLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker added", "slot", slot, "url", canon, "origin", origin, "state", StateHealthy)
	r.putHook(w)
	return info, nil
}

// Reserve holds slot for a worker that is not up yet (a --spawn process):
// it is listed as pending and routes nothing until Activate.
func (r *Registry) Reserve(slot int, rawURL string, origin Origin) error {
	canon, addr, err := ParseURL(rawURL)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrClosed
	}
	if slot < 0 || slot >= r.opts.MaxWorkers {
		return fmt.Errorf("slot %d: want 0..%d", slot, r.opts.MaxWorkers-1)
	}
	if d := r.findAddrLocked(addr); d != nil {
		return fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	if r.entries[slot] != nil || r.retiring[slot] != nil {
		return fmt.Errorf("slot %d is taken", slot)
	}
	r.entries[slot] = &entry{slot: slot, url: canon, addr: addr, origin: origin, since: time.Now()}
	return nil
}

// Activate makes the pending worker of slot routable and healthy (its
// health was checked by the caller). Activating an active worker marks it
// healthy at once (a restarted --spawn process).
func (r *Registry) Activate(slot int) error {
	r.mu.Lock()
	e := r.entries[slot]
	if e == nil {
		r.mu.Unlock()
		return fmt.Errorf("%w: slot %d", ErrNotFound, slot)
	}
	if e.w != nil {
		r.mu.Unlock()
		r.ForceHealth(slot, true, "process ready")
		return nil
	}
	w := r.activateLocked(e)
	u, origin := e.url, e.origin
	r.mu.Unlock()
	r.log.Info("worker added", "slot", slot, "url", u, "origin", origin, "state", StateHealthy)
	r.putHook(w)
	return nil
}

// Retarget moves the worker of slot to another url (a --spawn process that
// had to change port). The slot's counters go on; the old pool is retired.
func (r *Registry) Retarget(slot int, rawURL string) error {
	canon, addr, err := ParseURL(rawURL)
	if err != nil {
		return err
	}
	r.mu.Lock()
	e := r.entries[slot]
	if e == nil || r.closed {
		r.mu.Unlock()
		return fmt.Errorf("%w: slot %d", ErrNotFound, slot)
	}
	if d := r.findAddrLocked(addr); d != nil && d != e {
		r.mu.Unlock()
		return fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	old, oldURL := e.w, e.url
	e.url, e.addr = canon, addr
	r.lastURL[slot] = canon
	var w *route.Worker
	if old != nil {
		w = &route.Worker{Slot: slot, URL: canon, Addr: addr, ID: route.WorkerID(canon), Stats: old.Stats,
			Pool: upstream.New(addr, old.Stats, r.opts.Pool)}
		w.SetMaxInFlight(r.capacityLocked(canon))
		w.SetState(old.BaseState())
		w.Fence(old.Fenced())
		e.w = w
		r.opts.Table.Put(w)
		r.wg.Add(1) // under the lock: Close waits for it
	}
	r.mu.Unlock()
	r.log.Info("worker moved", "slot", slot, "from", oldURL, "to", canon)
	if old != nil {
		go func() {
			defer r.wg.Done()
			r.waitIdle(old, r.opts.RemoveGrace)
			old.Pool.Close()
		}()
		r.putHook(w)
	}
	return nil
}

// activateLocked creates e's route.Worker, healthy, and puts it in the
// table. A slot taken by a worker other than its last one starts its
// counters from zero.
func (r *Registry) activateLocked(e *entry) *route.Worker {
	ws := r.opts.Stats.Worker(e.slot)
	switch last, seen := r.lastURL[e.slot]; {
	case !seen:
		ws.Reset()
	case last != e.url:
		resetCumulative(ws)
	}
	r.lastURL[e.slot] = e.url
	w := &route.Worker{Slot: e.slot, URL: e.url, Addr: e.addr, ID: route.WorkerID(e.url), Stats: ws, Pool: upstream.New(e.addr, ws, r.opts.Pool)}
	w.SetMaxInFlight(r.capacityLocked(e.url))
	// A drain asked while the worker was pending holds from its first
	// moment in the table: it takes no new sessions or keys.
	if e.draining {
		w.SetState(route.Draining)
	} else {
		w.SetState(route.Healthy)
	}
	e.w, e.healthy, e.fails, e.succs, e.cancel = w, true, 0, 0, nil
	e.since = time.Now()
	r.opts.Table.Put(w)
	r.changes.Add(1)
	r.updatePanicLocked()
	return w
}

// capacityLocked returns the max_in_flight of the worker at url.
func (r *Registry) capacityLocked(url string) uint64 {
	if n, ok := r.capacity[url]; ok {
		return n
	}
	return r.opts.MaxInFlight
}

// SetCapacity gives the worker at rawURL its own max_in_flight (0: no
// limit), now if it is in a slot and whenever it takes one later (an
// admin add names it before the worker is routable). It returns the
// canonical url.
func (r *Registry) SetCapacity(rawURL string, n uint64) (string, error) {
	canon, _, err := ParseURL(rawURL)
	if err != nil {
		return "", err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.capacity[canon] = n
	for _, e := range r.entries {
		if e.url == canon && e.w != nil {
			e.w.SetMaxInFlight(n)
		}
	}
	return canon, nil
}

// resetCumulative zeroes a slot's running totals but not its gauges (in
// flight, connections): a request of the slot's previous worker that is
// still finishing decrements them back to the truth instead of wrapping
// them below zero.
func resetCumulative(w *stats.Worker) {
	for _, p := range []*uint64{&w.Requests, &w.Errors, &w.BytesUp, &w.BytesDown, &w.Retries} {
		atomic.StoreUint64(p, 0)
	}
}

func (r *Registry) putHook(w *route.Worker) {
	if r.opts.OnPut != nil && w != nil {
		r.opts.OnPut(w)
	}
}

// Add registers a worker in the first free slot and returns once it passed
// a health check and is routable (or failed to within StartupTimeout, or
// ctx ended: the slot is then freed and nothing changed).
func (r *Registry) Add(ctx context.Context, rawURL string, origin Origin) (Info, error) {
	e, ctx, cancel, err := r.addBegin(ctx, rawURL, origin)
	if err != nil {
		return Info{}, err
	}
	defer cancel()
	return r.addWait(ctx, e)
}

// addBegin validates rawURL and reserves the first free slot for it.
func (r *Registry) addBegin(ctx context.Context, rawURL string, origin Origin) (*entry, context.Context, context.CancelFunc, error) {
	canon, addr, err := ParseURL(rawURL)
	if err == nil {
		err = r.notSelf(canon, addr)
	}
	if err != nil {
		return nil, nil, nil, err
	}
	if r.opts.Probe == nil {
		return nil, nil, nil, errors.New("registry: no health prober")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, nil, nil, ErrClosed
	}
	if d := r.findAddrLocked(addr); d != nil {
		return nil, nil, nil, fmt.Errorf("%w: %s (slot %d)", ErrDuplicate, d.url, d.slot)
	}
	if n := r.pendingLocked(); n >= r.opts.MaxPending {
		return nil, nil, nil, fmt.Errorf("%w (%d, at most %d at once): retry once some are up or gone", ErrTooManyPending, n, r.opts.MaxPending)
	}
	if r.freeSlotLocked() < 0 {
		return nil, nil, nil, fmt.Errorf("%w (at most %d workers)", ErrFull, r.opts.MaxWorkers)
	}
	// A pending worker holds no slot: it gets one when it first passes a
	// health check, so adds of URLs that never come up cannot fill the
	// slots. Until then it is filed under a key of its own below 0.
	r.pendingSeq--
	ctx, cancel := context.WithTimeout(ctx, r.opts.StartupTimeout)
	e := &entry{slot: r.pendingSeq, url: canon, addr: addr, origin: origin, cancel: cancel, since: time.Now()}
	r.entries[e.slot] = e
	r.log.Info("worker pending", "url", canon, "origin", origin)
	return e, ctx, cancel, nil
}

// addWait waits for a pending worker's first good health check and makes
// it routable, or frees its slot.
func (r *Registry) addWait(ctx context.Context, e *entry) (Info, error) {
	perr := r.waitHealthy(ctx, e.url)
	r.mu.Lock()
	if r.entries[e.slot] != e { // removed while pending
		u := e.url
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w: %s was removed while starting", ErrNotFound, u)
	}
	if perr != nil {
		delete(r.entries, e.slot)
		u := e.url
		r.mu.Unlock()
		r.log.Warn("worker not added", "url", u, "err", perr)
		return Info{}, fmt.Errorf("%w: %s: %v", ErrUnavailable, u, perr)
	}
	// Up: now it takes the first free slot.
	slot := r.freeSlotLocked()
	if slot < 0 {
		delete(r.entries, e.slot)
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w (at most %d workers)", ErrFull, r.opts.MaxWorkers)
	}
	delete(r.entries, e.slot)
	e.slot = slot
	r.entries[slot] = e
	w := r.activateLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker added", "slot", info.Slot, "url", info.URL, "origin", info.Origin, "state", StateHealthy)
	r.putHook(w)
	return info, nil
}

// WaitHealthy probes url until it answers, ctx ends or the startup
// timeout passes: the check an add makes before the worker takes a slot
// (the cluster's add makes it on the adding replica).
func (r *Registry) WaitHealthy(ctx context.Context, url string) error {
	if r.opts.Probe == nil {
		return errors.New("registry: no health prober")
	}
	ctx, cancel := context.WithTimeout(ctx, r.opts.StartupTimeout)
	defer cancel()
	return r.waitHealthy(ctx, url)
}

// waitHealthy probes url until it answers or ctx ends.
func (r *Registry) waitHealthy(ctx context.Context, url string) error {
	delay := 50 * time.Millisecond
	var last error
	for {
		err := r.opts.Probe(ctx, url)
		if err == nil {
			return nil
		}
		last = err
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			if errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("no healthy answer in time (last: %v)", last)
			}
			return fmt.Errorf("%v (last: %v)", ctx.Err(), last)
		case <-r.stop:
			t.Stop()
			return ErrClosed
		case <-t.C:
		}
		if delay < time.Second {
			delay *= 2
		}
	}
}

// Remove takes a worker out of its slot. Requests for its sessions follow
// --bad-session from now on; requests in flight finish. Its pool is closed
// once they did (or after RemoveGrace), and only then can a new worker take
// the slot. A pending worker's Add is cancelled.
func (r *Registry) Remove(id string) (Info, error) {
	return r.remove(id, false)
}

func (r *Registry) remove(id string, force bool) (Info, error) {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return Info{}, ErrClosed
	}
	e, err := r.lookupLocked(id)
	if err != nil {
		r.mu.Unlock()
		return Info{}, err
	}
	if e.origin == OriginSpawn && !force {
		r.mu.Unlock()
		return Info{}, fmt.Errorf("%w: %s (slot %d) is a --spawn process; drain it instead", ErrManaged, e.url, e.slot)
	}
	delete(r.entries, e.slot)
	if e.w == nil { // pending
		if e.cancel != nil {
			e.cancel()
		}
		info := r.infoLocked(e)
		info.State, info.Status = StateRemoved, StateRemoved
		r.mu.Unlock()
		r.log.Info("worker removed", "url", e.url, "state_was", StatePending)
		return info, nil
	}
	was := r.stateLocked(e)
	r.opts.Table.Remove(e.slot)
	rt := &retiree{e: e, done: make(chan struct{})}
	r.retiring[e.slot] = rt
	r.wg.Add(1) // under the lock: Close waits for it
	r.changes.Add(1)
	r.updatePanicLocked()
	info := r.infoLocked(e)
	info.State, info.Status = StateRemoved, StateRemoved
	r.mu.Unlock()
	r.log.Info("worker removed", "slot", e.slot, "url", e.url, "state_was", was, "in_flight", e.w.Stats.Pending())
	go r.retire(rt)
	return info, nil
}

// retire waits for a removed worker's requests, closes its pool and frees
// its slot.
func (r *Registry) retire(rt *retiree) {
	defer r.wg.Done()
	defer close(rt.done)
	w := rt.e.w
	left := r.waitIdle(w, r.opts.RemoveGrace)
	w.Pool.Close()
	r.mu.Lock()
	if r.retiring[rt.e.slot] == rt {
		delete(r.retiring, rt.e.slot)
	}
	r.mu.Unlock()
	if left > 0 {
		r.log.Warn("worker retired with requests in flight", "slot", rt.e.slot, "url", rt.e.url, "in_flight", left, "grace", r.opts.RemoveGrace)
	} else {
		r.log.Info("worker retired", "slot", rt.e.slot, "url", rt.e.url)
	}
}

// waitIdle waits until w has nothing in flight, for at most grace, and
// returns what is still in flight. A request routed just before the
// worker left its slot may begin a moment later: idle must hold for a
// short settle time.
func (r *Registry) waitIdle(w *route.Worker, grace time.Duration) uint64 {
	const settle = 20 * time.Millisecond
	deadline := time.Now().Add(grace)
	var idleSince time.Time
	for {
		n := w.Stats.Pending()
		now := time.Now()
		if n == 0 {
			if idleSince.IsZero() {
				idleSince = now
			}
			if now.Sub(idleSince) >= settle {
				return 0
			}
		} else {
			idleSince = time.Time{}
		}
		if now.After(deadline) {
			return n
		}
		select {
		case <-r.stop:
			return w.Stats.Pending()
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// WaitRetired waits until slot has no removed worker finishing (tests).
func (r *Registry) WaitRetired(ctx context.Context, slot int) error {
	r.mu.Lock()
	rt := r.retiring[slot]
	r.mu.Unlock()
	if rt == nil {
		return nil
	}
	select {
	case <-rt.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Drain stops new sessions (and new keys) going to a worker; requests for
// its existing sessions still reach it. It stays draining until removed.
func (r *Registry) Drain(id string) (Info, error) {
	r.mu.Lock()
	e, err := r.lookupLocked(id)
	if err != nil {
		r.mu.Unlock()
		return Info{}, err
	}
	if e.draining {
		info := r.infoLocked(e)
		r.mu.Unlock()
		return info, nil
	}
	was := r.stateLocked(e)
	e.draining = true
	r.applyLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker draining", "slot", info.Slot, "url", info.URL, "state_was", was, "in_flight", info.InFlight)
	return info, nil
}

// Undrain ends a worker's draining (weight-sync cycles drain and resume
// engines): it routes new sessions and keys again as soon as it is
// healthy. A worker that is not draining is left as it is.
func (r *Registry) Undrain(id string) (Info, error) {
	r.mu.Lock()
	e, err := r.lookupLocked(id)
	if err != nil {
		r.mu.Unlock()
		return Info{}, err
	}
	if !e.draining {
		info := r.infoLocked(e)
		r.mu.Unlock()
		return info, nil
	}
	e.draining = false
	r.applyLocked(e)
	info := r.infoLocked(e)
	r.mu.Unlock()
	r.log.Info("worker undrained", "slot", info.Slot, "url", info.URL, "state", info.State)
	return info, nil
}

// Report feeds one health observation about w (an active check, or a
// passive one: a failed connect). It is ignored if w no longer holds its
// slot. ok=false with passive=true counts like a failed check.
func (r *Registry) Report(w *route.Worker, ok bool, err error, passive bool) {
	r.mu.Lock()
	e := r.entries[w.Slot]
	if e == nil || e.w != w {
		r.mu.Unlock()
		return
	}
	e.checked = time.Now()
	wasHealthy := e.healthy
	if ok {
		e.fails = 0
		e.succs++
		if !e.healthy && e.succs >= r.opts.Successes {
			e.healthy = true
		}
	} else {
		e.succs = 0
		e.fails++
		if err != nil {
			e.lastErr = err.Error()
		}
		if e.healthy && e.fails >= r.opts.Failures {
			e.healthy = false
		}
	}
	if e.healthy == wasHealthy {
		r.mu.Unlock()
		return
	}
	r.applyLocked(e)
	fails, lastErr, healthy, draining, u := e.fails, e.lastErr, e.healthy, e.draining, e.url
	r.mu.Unlock()
	if healthy {
		r.log.Info("worker healthy", "slot", w.Slot, "url", u, "draining", draining)
	} else {
		r.log.Warn("worker unhealthy", "slot", w.Slot, "url", u, "failures", fails, "passive", passive, "err", lastErr, "draining", draining)
	}
}

// ForceHealth sets a worker's health at once, bypassing the hysteresis
// (the supervisor saw its process exit, or come back ready).
func (r *Registry) ForceHealth(slot int, healthy bool, reason string) {
	r.mu.Lock()
	e := r.entries[slot]
	if e == nil || e.w == nil || e.healthy == healthy {
		r.mu.Unlock()
		return
	}
	e.healthy, e.fails, e.succs = healthy, 0, 0
	if !healthy {
		e.lastErr = reason
	}
	r.applyLocked(e)
	u := e.url
	r.mu.Unlock()
	if healthy {
		r.log.Info("worker healthy", "slot", slot, "url", u, "reason", reason)
	} else {
		r.log.Warn("worker unhealthy", "slot", slot, "url", u, "reason", reason)
	}
}

// applyLocked sets e's route state from its health and drain flag and
// returns the state it had.
func (r *Registry) applyLocked(e *entry) string {
	was := r.stateLocked(e)
	if e.w == nil {
		return was
	}
	s := route.Unhealthy
	switch {
	case e.draining:
		s = route.Draining
	case e.healthy:
		s = route.Healthy
	}
	if e.w.SetState(s) != s {
		e.since = time.Now()
		r.changes.Add(1)
	}
	r.updatePanicLocked()
	return was
}

// updatePanicLocked recomputes panic mode: workers to route new sessions
// to exist, and none of them is healthy. The router then spreads over the
// unhealthy ones (reason "panic") instead of answering 503 to everything.
func (r *Registry) updatePanicLocked() {
	routable, healthy := 0, 0
	for _, e := range r.entries {
		if e.w == nil || e.draining {
			continue
		}
		routable++
		if e.healthy {
			healthy++
		}
	}
	p := routable > 0 && healthy == 0
	if p == r.panic {
		return
	}
	r.panic = p
	if p {
		r.panics.Add(1)
		r.log.Warn("all workers unhealthy: panic mode, routing to all of them rather than answer 503", "workers", routable)
	} else {
		r.log.Info("panic mode over", "healthy_workers", healthy, "workers", routable)
	}
}

// Close stops the registry's goroutines and closes the pools of retired
// and pending workers (the table's own workers are closed by their owner).
func (r *Registry) Close() {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return
	}
	r.closed = true
	close(r.stop)
	var pools []*upstream.Pool
	for _, e := range r.entries {
		if e.w == nil && e.cancel != nil {
			e.cancel()
		}
		if e.w != nil {
			pools = append(pools, e.w.Pool)
		}
	}
	r.mu.Unlock()
	r.wg.Wait()
	// The registry made the workers' pools: it closes them (their idle
	// connections and janitors). Requests still running put theirs back
	// into a closed pool, which closes them.
	for _, p := range pools {
		p.Close()
	}
}
