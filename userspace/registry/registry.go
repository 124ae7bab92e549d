// Package registry owns the life of tetherd's backend workers: it places
// them in the stable slots of a worker.Table, keeps their state (pending,
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
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
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

// States reported by Info.State (worker.State plus the registry's own).
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

// Defaults of Config, and of the flags that set them (cmd/tetherd:
// --health-failures, --health-successes, --worker-startup-timeout,
// --remove-grace), and of Options.MaxPending.
const (
	DefaultFailures       = 3
	DefaultSuccesses      = 2
	DefaultStartupTimeout = 5 * time.Minute
	DefaultRemoveGrace    = time.Minute
	DefaultMaxPending     = 64
)

// Config is the registry's settings (tetherd's --health-failures,
// --health-successes, --worker-startup-timeout, --remove-grace,
// --max-in-flight), apart from the wiring (Options). Zero fields take the
// defaults (Provision).
type Config struct {
	// Failures: consecutive failed checks that make a healthy worker
	// unhealthy (DefaultFailures). Successes: consecutive good checks that
	// make an unhealthy worker healthy again (DefaultSuccesses).
	Failures, Successes int
	// StartupTimeout bounds Add's wait for a new worker's first successful
	// health check; DefaultStartupTimeout.
	StartupTimeout time.Duration
	// RemoveGrace bounds the wait for a removed worker's requests in flight
	// before its pool is closed and its slot becomes free;
	// DefaultRemoveGrace.
	RemoveGrace time.Duration
	// MaxInFlight is every worker's capacity unless SetCapacity gave it its
	// own: at or above it in flight a worker takes no new keys (0: none).
	MaxInFlight uint64
}

// DefaultConfig is Config with every field at its default.
func DefaultConfig() Config {
	var c Config
	c.Provision()
	return c
}

// Provision fills c's zero (or negative) fields with the defaults;
// MaxInFlight 0 stays none.
func (c *Config) Provision() {
	if c.Failures <= 0 {
		c.Failures = DefaultFailures
	}
	if c.Successes <= 0 {
		c.Successes = DefaultSuccesses
	}
	if c.StartupTimeout <= 0 {
		c.StartupTimeout = DefaultStartupTimeout
	}
	if c.RemoveGrace <= 0 {
		c.RemoveGrace = DefaultRemoveGrace
	}
}

// Validate refuses out-of-range settings (zero is the default), naming
// tetherd's flag (settings, flags.go).
func (c Config) Validate() error { return config.Validate(c.settings()) }

// Prober checks a worker's health (GET url/health); nil means healthy.
type Prober func(ctx context.Context, url string) error

// Options configure a Registry: its settings (Config) and wiring. Zero
// values take the defaults.
type Options struct {
	Config
	Table *worker.Table
	Stats *stats.Table
	Pool  upstream.Options
	// MaxWorkers bounds the slots; default and maximum stats.MaxWorkers.
	MaxWorkers int
	// Probe checks a pending worker; required for Add.
	Probe Prober
	// Self lists tetherd's own endpoints (ip:port of its data and admin
	// listeners): a worker URL that reaches one of them is refused (a
	// request would loop through tetherd until its descriptors ran out).
	Self []string
	// MaxPending bounds the adds waiting for their first good health check
	// at once (each holds a slot for up to StartupTimeout): beyond it an
	// add is refused (ErrTooManyPending), so that adds of unreachable URLs
	// cannot fill the slots; DefaultMaxPending.
	MaxPending int
	// OnPut is called (outside the registry's lock) when a worker takes a
	// slot, e.g. to create its metric children.
	OnPut func(w *worker.Worker)
	Log   *slog.Logger
}

func (o *Options) setDefaults() {
	if o.MaxWorkers <= 0 || o.MaxWorkers > stats.MaxWorkers {
		o.MaxWorkers = stats.MaxWorkers
	}
	o.Config.Provision()
	if o.MaxPending <= 0 {
		o.MaxPending = DefaultMaxPending
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
	w      *worker.Worker // nil while pending
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

// Registry is the worker registry. All methods are safe for concurrent use.
//
// One mutex guards every field below it: a worker's slot, its pending add,
// its retirement and its health are one state, changed together (a removal
// ends a pending add, a retirement frees a slot, a state change recomputes
// panic mode). Each concern's code is in a file of its own: urls.go
// (canonical URLs, aliases, tetherd itself), slots.go (placing workers,
// counters, capacity), adds.go (pending adds), retire.go (removal and
// retirement), health.go (hysteresis, draining, panic mode), info.go (what
// the admin API lists, SIGHUP's reconcile).
type Registry struct {
	opts Options
	log  *slog.Logger

	mu       sync.Mutex
	entries  map[int]*entry   // by slot, pending ones included
	retiring map[int]*retiree // by slot (retire.go)
	lastURL  map[int]string   // last worker url that held each slot in this process (slots.go)
	// pendingSeq files pending adds under keys below 0 in entries (they
	// hold no slot until their first good health check; adds.go).
	pendingSeq int
	capacity   map[string]uint64 // max_in_flight by worker url (SetCapacity, slots.go)
	panic      bool              // every routable worker unhealthy (health.go)
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
		opts.Table = worker.NewTable()
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
func (r *Registry) Table() *worker.Table { return r.opts.Table }

// Changes returns the number of state changes so far.
func (r *Registry) Changes() uint64 { return r.changes.Load() }

// Close cancels pending adds, stops the registry's goroutines (a
// retirement cut short closes its worker's pool) and closes the pools of
// the workers in slots, which the registry made.
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
