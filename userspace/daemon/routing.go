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
	"github.com/tether-rl/tether/userspace/engine"
	"github.com/tether-rl/tether/userspace/listener"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/sticky"
)

// RoutingOptions are the settings of the routing policy for requests that
// name no session, and of the engine endpoints (abort, fan-out). Zero
// values take the defaults: --policy=hash over X-Session-ID then
// X-SMG-Routing-Key, c = 1.25, keyless requests to the fewest in flight
// with a rotating tie-break (issue 2's rule; "p2c" gives two random
// choices, "prefix" hashes the body's start), request ids tracked from X-Request-ID and the first 4 KiB of the body.
type RoutingOptions struct {
	Policy         string        // "hash" (default) or "sticky"
	KeyHeaders     []string      // routing key headers in order; nil: route.DefaultKeyHeaders
	HashLoadFactor float64       // bounded load c; 0: 1.25
	StickyTTL      time.Duration // 0: 30m
	// StickyStore: where --policy=sticky keeps its table. "auto" (default):
	// StickyMap if set, else the sticky_sessions map pinned in StickyPinDir
	// (created if missing) when BPF works, else in-process; "bpf": fail
	// without BPF; "memory": in-process only.
	StickyStore string
	// StickyMap is a sticky_sessions map to use; default: that of the
	// listener group's BPF steering when it loaded.
	StickyMap *ebpf.Map
	// StickyPinDir: the bpffs directory of the pinned map when steering
	// did not load; default Options.PinDir, else bpf.DefaultPinDir. With
	// --bpf=off, auto keeps the table in process.
	StickyPinDir string
	Keyless      string // "least" (default), "p2c" or "prefix"
	// PeekBytes: body bytes buffered before routing, for the request id
	// ("rid") and --keyless=prefix; default 4096, -1 disables (ids from
	// X-Request-ID only; prefix then needs it).
	PeekBytes int
	// MaxTrackedRequests bounds the request id table; default 1<<20.
	MaxTrackedRequests int
	// NoEngineEndpoints leaves /abort_request, /abort_requests,
	// /abort_until_idle, /flush_cache, /get_loads and /finish_session to
	// the workers (proxied) instead of serving them.
	NoEngineEndpoints bool
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

	mu     sync.Mutex    // serializes reloads
	policy *route.Policy // the policy set up first (the one in use: rt.CurrentPolicy)
	sticky sticky.Table  // opened by the first sticky policy, kept across reloads
}

// setupRouting builds the policy, the sticky table, the request id table
// and the engine endpoints around rt. With BPF steering loaded (g), the
// sticky table is its sticky_sessions map.
func setupRouting(opts Options, g *listener.Group, rt *route.Router) (*routing, error) {
	o := opts.Routing
	if o.StickyMap == nil && g != nil && g.Steering() != nil {
		o.StickyMap = g.Steering().StickyMap()
	}
	if o.StickyPinDir == "" {
		o.StickyPinDir = opts.PinDir
	}
	peek := o.PeekBytes
	switch {
	case peek == 0:
		peek = route.DefaultPrefixBytes
	case peek < 0:
		peek = 0
	case peek > 8192:
		return nil, fmt.Errorf("--peek-bytes %d: at most 8192", peek)
	}
	r := &routing{rt: rt, log: opts.Log, opts: o, bpfOff: opts.BPF == string(bpf.ModeOff), peek: peek}
	p, err := r.newPolicy(o)
	if err != nil {
		r.close()
		return nil, err
	}
	r.policy = p
	rt.SetPolicy(p)
	r.owners = engine.NewOwners(o.MaxTrackedRequests)
	r.router = &engine.Tracker{Router: rt, Owners: r.owners}
	if !o.NoEngineEndpoints {
		r.engine = engine.New(engine.Config{
			Table:  rt.Table,
			Owners: r.owners,
			// The policy in use, across reloads.
			FinishSession: func(key string) bool { return rt.CurrentPolicy().FinishSession(key) },
			Log:           opts.Log,
		})
		r.local = r.engine.Local
	}
	r.logPolicy("routing policy", p)
	return r, nil
}

// newPolicy builds a policy from o (opening the sticky table on first use).
func (r *routing) newPolicy(o RoutingOptions) (*route.Policy, error) {
	kind, err := route.ParsePolicy(o.Policy)
	if err != nil {
		return nil, err
	}
	keyless, err := route.ParseKeyless(o.Keyless)
	if err != nil {
		return nil, err
	}
	if keyless == route.KeylessPrefix && r.peek == 0 {
		return nil, errors.New("--keyless=prefix needs --peek-bytes > 0")
	}
	if kind == route.PolicySticky && r.sticky == nil {
		if r.sticky, err = r.openSticky(); err != nil {
			return nil, err
		}
	}
	return route.NewPolicy(route.PolicyConfig{
		Kind:        kind,
		KeyHeaders:  o.KeyHeaders,
		LoadFactor:  o.HashLoadFactor,
		Keyless:     keyless,
		PrefixBytes: max(r.peek, 1),
		Sticky:      r.sticky,
		StickyTTL:   o.StickyTTL,
	})
}

func (r *routing) logPolicy(msg string, p *route.Policy) {
	cfg := p.Config()
	args := []any{"policy", cfg.Kind.String(), "key_headers", cfg.KeyHeaders,
		"hash_load_factor", cfg.LoadFactor, "keyless", cfg.Keyless.String(), "peek_bytes", r.peek}
	if cfg.Kind == route.PolicySticky {
		args = append(args, "sticky_ttl", cfg.StickyTTL, "sticky_shared", cfg.Sticky.Shared())
	}
	r.log.Info(msg, args...)
}

// reload applies the reloadable routing options of a SIGHUP: --policy,
// --key-header, --hash-load-factor, --sticky-ttl and --keyless. The others
// (--peek-bytes, --sticky-store, --max-tracked-requests,
// --engine-endpoints) need a restart.
func (r *routing) reload(opts Options) (func(), error) {
	r.mu.Lock()
	p, err := r.newPolicy(opts.Routing)
	r.mu.Unlock()
	if err != nil {
		return nil, fmt.Errorf("routing: %w", err)
	}
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.rt.SetPolicy(p)
		r.logPolicy("routing policy reloaded", p)
	}, nil
}

// RoutingReloadable are the routing flags a SIGHUP applies.
var RoutingReloadable = []string{"policy", "key-header", "hash-load-factor", "sticky-ttl", "keyless"}

func (r *routing) openSticky() (sticky.Table, error) {
	o := r.opts
	switch o.StickyStore {
	case "memory":
		return sticky.NewMemory(0), nil
	case "", "auto", "bpf":
	default:
		return nil, fmt.Errorf("--sticky-store %q: want auto, bpf or memory", o.StickyStore)
	}
	if o.StickyMap != nil {
		return sticky.NewBPF(o.StickyMap)
	}
	if r.bpfOff && o.StickyStore != "bpf" {
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
	if o.StickyStore == "bpf" {
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
}
