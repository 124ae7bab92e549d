package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/cilium/ebpf"

	"github.com/tether-rl/tether/bpf"
	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/listener"
	"github.com/tether-rl/tether/userspace/loadpoll"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sticky"
)

// RoutingOptions are the settings of the routing policy for requests that
// name no session, and of the engine endpoints (abort, fan-out). Zero
// values take the defaults, package route's (route.Default*: --policy=hash
// over route.DefaultKeyHeaders, keyless requests to the fewest in flight
// with a rotating tie-break ("p2c" gives two random choices, "prefix"
// hashes the body's start), request ids tracked from X-Request-ID and the
// first route.DefaultPrefixBytes of the body). Keys, Learn and Engine are
// route's own settings structs, passed on whole.
type RoutingOptions struct {
	Policy route.PolicyKind // hash (default) or sticky
	// Keys: the policy's settings (--key-header, --hash-load-factor,
	// --hash-spill-min, --hash-spill-ttl, --sticky-ttl).
	Keys route.PolicySettings
	// LearnSessions: the learning of bare session ids (unset: on):
	// Learn.CreatePath is the create path whose 2xx JSON answer's
	// Learn.IDField is remembered for Learn.TTL after the session's last
	// request (--learn-session-path, --learn-session-field,
	// --learn-session-ttl).
	LearnSessions config.Optional[bool]
	Learn         route.LearnSettings
	// StickyStore: where the sticky table (--policy=sticky assignments,
	// remembered spills, learned session ids) is kept. StickyAuto (default, also ""):
	// StickyMap if set, else the sticky_sessions map pinned in StickyPinDir
	// (created if missing) when BPF works, else in-process; "bpf": fail
	// without BPF; "memory": in-process only.
	StickyStore StickyStore
	// StickyMap is a sticky_sessions map to use; default: that of the
	// listener group's BPF steering when it loaded.
	StickyMap *ebpf.Map
	// StickyPinDir: the bpffs directory of the pinned map when steering
	// did not load; default Options.PinDir, else bpf.DefaultPinDir. With
	// --bpf=off, auto keeps the table in process.
	StickyPinDir string
	Keyless      route.KeylessMode // least (default), p2c or prefix
	// PeekBytes: body bytes buffered before routing, for the request id
	// ("rid") and --keyless=prefix; default route.DefaultPrefixBytes, -1
	// disables (ids from X-Request-ID only; prefix then needs it).
	PeekBytes int
	// MaxTrackedRequests bounds the request id table; default
	// engine.DefaultMaxOwners.
	MaxTrackedRequests int
	// EngineEndpoints: tetherd serves /abort_request, /abort_requests,
	// /abort_until_idle, /flush_cache, /get_loads and /finish_session
	// (unset: it does); false leaves them to the workers (proxied).
	EngineEndpoints config.Optional[bool]
	// Engine-aware placement (route/policy_engine.go, userspace/loadpoll).
	// EnginePoll: how often every worker's engine load is read; unset:
	// loadpoll's default; 0 (or negative): never (placement as without
	// engines).
	EnginePoll config.Optional[time.Duration]
	// Engine: the placement's settings (--kv-veto, --waiting-veto,
	// --group-max).
	Engine route.EngineConfig
	// RouteHeader: the response header naming the worker and the reason
	// of each request (--route-header; "" none).
	RouteHeader string
	// KVEvents: placement from the engines' KV-cache events
	// (kvevents.go); off unless a template or a worker's endpoint is set.
	KVEvents KVEventsOptions
}

// routing is what setupRouting built.
type routing struct {
	rt     *route.Router
	log    *slog.Logger
	opts   RoutingOptions // as started (sticky store, pin dir)
	bpfOff bool
	owners *engine.Owners
	engine *engine.Engine
	router proxy.Router
	peek   int
	local  func(method, path []byte) http.Handler

	poller *loadpoll.Poller // nil: --engine-poll 0

	mu     sync.Mutex    // serializes reloads
	policy *route.Policy // the policy set up first (the one in use: rt.CurrentPolicy)
	// sticky holds sticky assignments, remembered spills and learned
	// session ids; opened at setup, kept across reloads.
	sticky sticky.Table
	pinned pinnedCounts // its live entries per worker, for GET /workers
}

// setupRouting builds the policy, the sticky table, the request id table
// and the engine endpoints around rt. With BPF steering loaded (g), the
// sticky table is its sticky_sessions map. onPhase (cluster mode) is told
// the fleet's sync changes (engine.Config.OnPhase).
func setupRouting(opts Options, g *listener.Group, rt *route.Router, share func(sticky.Table) sticky.Table, fl *fleet.Fleet, onPhase func(fleet.State, bool) error) (*routing, error) {
	o := opts.Routing
	if o.StickyMap == nil && g != nil && g.Steering() != nil {
		o.StickyMap = g.Steering().StickyMap()
	}
	if o.StickyPinDir == "" {
		o.StickyPinDir = opts.PinDir
	}
	var err error
	peek := o.PeekBytes
	switch {
	case peek == 0:
		peek = route.DefaultPrefixBytes
	case peek < 0:
		peek = 0
	case peek > MaxPeekBytes:
		return nil, fmt.Errorf("--peek-bytes %d: at most %d", peek, MaxPeekBytes)
	}
	r := &routing{rt: rt, log: opts.Log, opts: o, bpfOff: opts.BPF == bpf.ModeOff, peek: peek}
	if r.sticky, err = r.openSticky(); err != nil {
		return nil, err
	}
	if share != nil {
		r.sticky = share(r.sticky)
	}
	p, err := r.newPolicy(o)
	if err != nil {
		r.close()
		return nil, err
	}
	l, err := r.newLearning(o)
	if err != nil {
		r.close()
		return nil, err
	}
	ep, err := newEnginePlacement(o)
	if err != nil {
		r.close()
		return nil, err
	}
	r.policy = p
	rt.SetPolicy(p)
	rt.SetLearning(l)
	rt.SetEnginePlacement(ep)
	if ep != nil {
		r.poller = loadpoll.New(loadpoll.Options{
			Config: loadpoll.Config{Interval: o.enginePoll(), Timeout: min(o.enginePoll(), healthTimeout(opts))},
			APIKey: opts.WorkerAPIKey,
			Table:  rt.Table,
			Router: rt,
			Log:    opts.Log,
		})
		r.poller.Start()
	}
	r.owners = engine.NewOwners(o.MaxTrackedRequests)
	rt.Owners = r.owners
	r.router = rt
	if o.EngineEndpoints.Or(true) {
		r.engine = engine.New(engine.Config{
			Table:  rt.Table,
			Owners: r.owners,
			// The policy in use, across reloads.
			FinishSession: func(key string) bool { return rt.CurrentPolicy().FinishSession(key) },
			WorkerAPIKey:  opts.WorkerAPIKey,
			Fleet:         fl,
			OnPhase:       onPhase,
			Settings:      opts.Engine,
			Log:           opts.Log,
		})
		r.local = r.engine.Local
	}
	r.logPolicy("routing policy", p)
	return r, nil
}

// newPolicy builds a policy from o (opening the sticky table on first use).
func (r *routing) newPolicy(o RoutingOptions) (*route.Policy, error) {
	kind, keyless := o.Policy, o.Keyless
	if keyless == route.KeylessPrefix && r.peek == 0 {
		return nil, errors.New("--keyless=prefix needs --peek-bytes > 0")
	}
	return route.NewPolicy(route.PolicyConfig{
		Kind:           kind,
		PolicySettings: o.Keys,
		Keyless:        keyless,
		PrefixBytes:    max(r.peek, 1),
		Sticky:         r.sticky,
	})
}

// newEnginePlacement builds the engine-aware placement from o (nil: off,
// --engine-poll 0).
func newEnginePlacement(o RoutingOptions) (*route.EnginePlacement, error) {
	if o.enginePoll() <= 0 {
		return nil, nil
	}
	return route.NewEnginePlacement(o.Engine)
}

// enginePoll is EnginePoll, loadpoll's default when unset; <= 0: off.
func (o RoutingOptions) enginePoll() time.Duration {
	return o.EnginePoll.Or(loadpoll.DefaultInterval)
}

func healthTimeout(opts Options) time.Duration {
	h := opts.Health
	h.Provision()
	return h.Timeout
}

// newLearning builds the learning of bare session ids from o (nil: off).
func (r *routing) newLearning(o RoutingOptions) (*route.Learning, error) {
	if !o.LearnSessions.Or(true) {
		return nil, nil
	}
	return route.NewLearning(route.LearnConfig{
		LearnSettings: o.Learn,
		Table:         r.sticky,
	})
}

func (r *routing) logPolicy(msg string, p *route.Policy) {
	cfg := p.Config()
	args := []any{"policy", cfg.Kind.String(), "key_headers", cfg.KeyHeaders,
		"hash_load_factor", cfg.LoadFactor, "hash_spill_min", cfg.SpillMin, "keyless", cfg.Keyless.String(), "peek_bytes", r.peek}
	if cfg.Kind == route.PolicySticky {
		args = append(args, "sticky_ttl", cfg.StickyTTL)
	}
	if l := r.rt.CurrentLearning(); l != nil {
		lc := l.Config()
		args = append(args, "learn_sessions", lc.CreatePath, "learn_field", lc.IDField, "learn_ttl", lc.TTL)
	} else {
		args = append(args, "learn_sessions", false)
	}
	args = append(args, "sticky_shared", r.sticky.Shared())
	if ep := r.rt.EnginePlacement(); ep != nil {
		ec := ep.Config()
		args = append(args, "engine_poll", r.opts.enginePoll(), "kv_veto", ec.KVVeto, "waiting_veto", ec.WaitingVeto, "group_max", ec.GroupMax)
	} else {
		args = append(args, "engine_poll", "off")
	}
	r.log.Info(msg, args...)
}

// reload applies the reloadable routing options of a SIGHUP (see
// RoutingReloadable). The others (--peek-bytes, --sticky-store,
// --max-tracked-requests, --engine-endpoints) need a restart.
func (r *routing) reload(opts Options) (func(), error) {
	r.mu.Lock()
	p, err := r.newPolicy(opts.Routing)
	var l *route.Learning
	if err == nil {
		l, err = r.newLearning(opts.Routing)
	}
	var ep *route.EnginePlacement
	if err == nil && r.poller != nil {
		o := opts.Routing
		o.EnginePoll = config.Optional[time.Duration]{} // needs a restart: on while the poller runs
		ep, err = newEnginePlacement(o)
	}
	r.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("routing: %w", err)
	}
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.rt.SetPolicy(p)
		r.rt.SetLearning(l)
		if ep != nil {
			r.rt.SetEnginePlacement(ep)
		}
		r.logPolicy("routing policy reloaded", p)
	}, nil
}

// RoutingReloadable are the routing flags a SIGHUP applies.
var RoutingReloadable = []string{"policy", "key-header", "hash-load-factor", "hash-spill-min", "hash-spill-ttl",
	"sticky-ttl", "keyless", "learn-sessions", "learn-session-path", "learn-session-field", "learn-session-ttl",
	"kv-veto", "waiting-veto", "group-max"}

// MaxPeekBytes bounds --peek-bytes: the body bytes routing reads must fit
// the proxy's 16 KiB request buffer behind the head (a longer head leaves
// fewer: the peek then takes what fits). Past them, with KV-event
// placement, the router asks for more of a body of token ids while the
// engines hold every block read (route.Router.PeekMore): the proxy's
// buffer grows for it, up to --kv-peek-max (proxy.Config.PeekMax).
const MaxPeekBytes = 16384

func (r *routing) openSticky() (sticky.Table, error) {
	o := r.opts
	switch o.StickyStore {
	case StickyMemory:
		return sticky.NewMemory(0), nil
	case "", StickyAuto, StickyBPF:
	default:
		return nil, fmt.Errorf("--sticky-store %q: want auto, bpf or memory", o.StickyStore)
	}
	if o.StickyMap != nil {
		return sticky.NewBPF(o.StickyMap)
	}
	if r.bpfOff && o.StickyStore != StickyBPF {
		return sticky.NewMemory(0), nil
	}
	dir := o.StickyPinDir
	if dir == "" {
		dir = bpf.DefaultPinDir
	}
	t, err := sticky.OpenPinned(dir)
	if err == nil {
		return t, nil
	}
	if o.StickyStore == StickyBPF {
		return nil, fmt.Errorf("--sticky-store=bpf: %w", err)
	}
	// Without bpffs, steering has already warned (once) under --bpf=auto:
	// the same cause is not a second warning.
	level := slog.LevelWarn
	if errors.Is(err, bpf.ErrNoBPFFS) {
		level = slog.LevelInfo
	}
	r.log.Log(context.Background(), level, "sticky table kept in this process only (other tetherd processes and the next one after an upgrade will not see it)", "err", err)
	return sticky.NewMemory(0), nil
}

// close releases the sticky map descriptor and the engine's connections.
func (r *routing) close() {
	if r == nil {
		return
	}
	if c, ok := r.sticky.(interface{ Close() error }); ok {
		c.Close()
	}
	if r.engine != nil {
		r.engine.Close()
	}
	if r.poller != nil {
		r.poller.Stop()
	}
}

// RoutingCounts is GET /routing of the admin API and the routing part of
// tetherctl status: routing decisions by reason since start, and the
// learning of bare session ids.
type RoutingCounts struct {
	Policy    string            `json:"policy"`
	Decisions map[string]uint64 `json:"decisions"`
	Learned   *LearnedCounts    `json:"learned_sessions,omitempty"`
	// StickyShared: the sticky table (spills, sticky keys, learned ids) is
	// the pinned BPF map, kept across restarts; false: in this process.
	StickyShared bool `json:"sticky_shared"`
}

// LearnedCounts are the learned-session events.
type LearnedCounts struct {
	Learned   uint64 `json:"learned"`
	NoID      uint64 `json:"no_id"`
	Forgotten uint64 `json:"forgotten"`
}

// RoutingCounts returns the routing decision counts.
func (d *Daemon) RoutingCounts() RoutingCounts {
	rc := RoutingCounts{Decisions: make(map[string]uint64, route.NumReasons)}
	for r := route.Reason(0); r < route.NumReasons; r++ {
		rc.Decisions[r.String()] = d.Router.Count(r)
	}
	rc.Policy = "spread"
	if p := d.Router.CurrentPolicy(); p != nil {
		rc.Policy = p.Config().Kind.String()
	}
	if l := d.Router.CurrentLearning(); l != nil {
		c := l.Counts()
		rc.Learned = &LearnedCounts{Learned: c.Learned, NoID: c.NoID, Forgotten: c.Forgotten}
	}
	if d.routing != nil && d.routing.sticky != nil {
		rc.StickyShared = d.routing.sticky.Shared()
	}
	return rc
}
