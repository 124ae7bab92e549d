package route

// Routing policies for the requests that name no session (/sessions/w<idx>-
// paths keep their rule, see Route). RL trainers that talk to inference
// engines directly (SGLang, vLLM) want every turn of a trajectory on one
// engine so that its prefix cache stays warm; they name the trajectory in a
// header (SkyRL: X-Session-ID, slime: X-SMG-Routing-Key).
//
// What the rules of a request that names no session do (their precedence
// is the list in rules.go):
//
//   - X-SMG-Target-Worker: <slot> (or the worker's URL) pins the request;
//     400 when there is no such worker. The pin holds whatever the worker's
//     state: the client asked for it.
//   - A request id already in flight goes to the worker serving it.
//   - The routing key: the first non-empty value among KeyHeaders, in the
//     order given, names matched case-insensitively.
//     - hash (default): consistent hashing, bounded only under real
//     overload. The key's ring position (KeyHash) picks an owner among
//     VirtualNodes points per worker. An owner above both c × the mean in
//     flight and the mean + SpillMin, or at its max_in_flight, spills the
//     key to its ring successor, and the spill is remembered (sticky
//     table, SpillTTL) so that the key stays there until the owner is back
//     under the bounds with hysteresis (policy_hash.go). An unhealthy or
//     draining owner passes its keys to their ring successors until it
//     recovers (nothing is stored). Adding or removing one of N workers
//     moves about 1/N of the keys.
//     - sticky: the first request of a key goes to the least loaded
//     healthy worker (rotating tie-break), later ones to the same worker,
//     kept in a sticky.Table (the BPF LRU map shared by every tetherd, or an
//     in-process LRU) for StickyTTL after the last refresh, or until
//     POST /finish_session. An unhealthy or draining owner gets its keys
//     reassigned.
//   - No key: by default the healthy worker with the fewest requests in
//     flight, ties broken by rotation (the counts are exact and shared, so
//     a full scan beats sampling for worker sets of this size), or with
//     engine signals by engine state (policy_engine.go); with
//     Keyless = p2c the less loaded of two random healthy workers (power of
//     two choices, O(1) for very large sets); with Keyless = prefix, the first PrefixBytes of the body
//     (request-id values left out) are hashed on the ring like a
//     key, so that the samples of one GRPO group share a prefix cache.
//
// Routing is a pure function of (key, workers, loads): every tetherd
// process, on any host, given the same workers, routes a key the same way.
// The only state is the sticky table.

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/jsonpeek"
	"github.com/tether-rl/tether/userspace/keyhash"
	"github.com/tether-rl/tether/userspace/sticky"
	"github.com/tether-rl/tether/userspace/worker"
)

// PolicyKind selects how keyed requests are placed.
type PolicyKind int

const (
	PolicyHash   PolicyKind = iota // consistent hashing with bounded load
	PolicySticky                   // sticky least loaded
)

func (k PolicyKind) String() string {
	if k == PolicySticky {
		return "sticky"
	}
	return "hash"
}

// ParsePolicy parses a --policy value.
func ParsePolicy(s string) (PolicyKind, error) {
	switch s {
	case "", "hash":
		return PolicyHash, nil
	case "sticky":
		return PolicySticky, nil
	}
	return 0, fmt.Errorf("--policy %q: want hash or sticky", s)
}

// KeylessMode selects how requests without a key are placed.
type KeylessMode int

const (
	KeylessLeast  KeylessMode = iota // fewest in flight, rotating tie-break (spread)
	KeylessP2C                       // power of two choices
	KeylessPrefix                    // hash the start of the body, bounded load
)

func (m KeylessMode) String() string {
	if m == KeylessLeast {
		return "least"
	}
	if m == KeylessPrefix {
		return "prefix"
	}
	return "p2c"
}

// ParseKeyless parses a --keyless value.
func ParseKeyless(s string) (KeylessMode, error) {
	switch s {
	case "", "least":
		return KeylessLeast, nil
	case "p2c":
		return KeylessP2C, nil
	case "prefix":
		return KeylessPrefix, nil
	}
	return 0, fmt.Errorf("--keyless %q: want least, p2c or prefix", s)
}

// TargetWorkerHeader pins a request to a worker slot.
const TargetWorkerHeader = "X-SMG-Target-Worker"

// Defaults.
const (
	DefaultLoadFactor = 1.25
	// DefaultSpillMin: a key spills only from an owner more than this many
	// requests in flight above the mean. SGLang and vLLM engines batch
	// hundreds of requests at once (vLLM's max_num_seqs defaults to 256,
	// SGLang sizes its running batch from KV memory, typically 128-1024),
	// so 64 more than the mean is a real queue, while a few dozen is noise
	// that a prefix-cache miss would cost far more than; sgl-model-gateway's
	// cache_aware policy balances from the same absolute gap (64).
	DefaultSpillMin = 64
	// DefaultSpillTTL: how long a spilled key is remembered after its last
	// request (a session's turns come seconds to a minute apart).
	DefaultSpillTTL      = 2 * time.Minute
	DefaultStickyTTL     = 30 * time.Minute
	DefaultStickyRefresh = 5 * time.Second
	DefaultPrefixBytes   = 4096
)

// DefaultKeyHeaders are the routing key headers, in order.
var DefaultKeyHeaders = []string{"X-Session-ID", "X-SMG-Routing-Key"}

// PolicySettings are a policy's settings (tetherd's --key-header,
// --hash-load-factor, --hash-spill-min, --hash-spill-ttl, --sticky-ttl),
// apart from its kind, keyless mode and wiring (PolicyConfig). Zero
// fields take the defaults (Provision); NewPolicy validates them.
type PolicySettings struct {
	KeyHeaders []string // routing key headers in order; nil: DefaultKeyHeaders
	LoadFactor float64  // c of the bounded load, >= 1; 0: DefaultLoadFactor
	// SpillMin: the absolute overload bound (in flight above the mean);
	// unset: DefaultSpillMin, 0: none (the relative bound alone).
	SpillMin config.Optional[int]
	// SpillTTL: a spilled key is remembered this long after its last
	// request; 0: DefaultSpillTTL.
	SpillTTL time.Duration
	// StickyTTL: a sticky key's assignment expires this long after its
	// last use; 0: DefaultStickyTTL.
	StickyTTL time.Duration
}

// DefaultPolicySettings is PolicySettings with every field at its default.
func DefaultPolicySettings() PolicySettings {
	var s PolicySettings
	s.Provision()
	return s
}

// Provision fills s's zero (unset) fields with the defaults.
func (s *PolicySettings) Provision() {
	if s.KeyHeaders == nil {
		s.KeyHeaders = DefaultKeyHeaders
	}
	if s.LoadFactor == 0 {
		s.LoadFactor = DefaultLoadFactor
	}
	if !s.SpillMin.IsSet() {
		s.SpillMin = config.Some(DefaultSpillMin)
	}
	if s.SpillTTL == 0 {
		s.SpillTTL = DefaultSpillTTL
	}
	if s.StickyTTL == 0 {
		s.StickyTTL = DefaultStickyTTL
	}
}

// PolicyConfig configures a Policy: its kind, its settings and its
// wiring. Zero values take the defaults.
type PolicyConfig struct {
	Kind PolicyKind
	PolicySettings
	Keyless KeylessMode
	// PrefixBytes bounds the body bytes hashed by KeylessPrefix; the proxy
	// must peek at least as many (proxy Config.PeekBody).
	PrefixBytes int
	// Sticky holds the sticky assignments (required for PolicySticky) and
	// the remembered spills of PolicyHash (none remembered when nil).
	Sticky sticky.Table
	// StickyRefresh: a used entry's TTL is pushed back (one table write)
	// at most this often. Default min(DefaultStickyRefresh, StickyTTL/4).
	StickyRefresh time.Duration
	// Now is the clock of sticky expiries (CLOCK_MONOTONIC ns); tests set
	// it. Default sticky.Now.
	Now func() int64
}

// Policy routes the requests that name no session. It is safe for
// concurrent use.
type Policy struct {
	cfg      PolicyConfig
	ttl      int64
	refresh  int64
	spillTTL int64

	ringMu sync.Mutex
	ring   atomic.Pointer[ring]
}

// NewPolicy validates cfg and returns the policy.
func NewPolicy(cfg PolicyConfig) (*Policy, error) {
	cfg.PolicySettings.Provision()
	hs := make([]string, 0, len(cfg.KeyHeaders))
	for _, h := range cfg.KeyHeaders {
		h = strings.TrimSpace(h)
		if h == "" {
			continue
		}
		if !httphead.IsToken(h) {
			return nil, fmt.Errorf("--key-header %q: not a valid header name", h)
		}
		hs = append(hs, h)
	}
	cfg.KeyHeaders = hs
	if !(cfg.LoadFactor >= 1 && cfg.LoadFactor <= 100) {
		return nil, fmt.Errorf("--hash-load-factor %v: want 1 <= c <= 100", cfg.LoadFactor)
	}
	if cfg.SpillTTL < time.Second {
		return nil, fmt.Errorf("--hash-spill-ttl %v: want at least 1s", cfg.SpillTTL)
	}
	if cfg.PrefixBytes == 0 {
		cfg.PrefixBytes = DefaultPrefixBytes
	}
	if cfg.PrefixBytes < 0 {
		return nil, fmt.Errorf("prefix bytes %d: want > 0", cfg.PrefixBytes)
	}
	if cfg.StickyTTL < time.Second {
		return nil, fmt.Errorf("--sticky-ttl %v: want at least 1s", cfg.StickyTTL)
	}
	if cfg.StickyRefresh <= 0 {
		cfg.StickyRefresh = min(DefaultStickyRefresh, cfg.StickyTTL/4)
	}
	if cfg.Kind == PolicySticky && cfg.Sticky == nil {
		return nil, errors.New("sticky policy without a sticky table")
	}
	if cfg.Now == nil {
		cfg.Now = sticky.Now
	}
	return &Policy{cfg: cfg, ttl: int64(cfg.StickyTTL), refresh: int64(cfg.StickyRefresh), spillTTL: int64(cfg.SpillTTL)}, nil
}

// Config returns the policy's settings, defaults applied.
func (p *Policy) Config() PolicyConfig { return p.cfg }

// fieldValue returns the first non-empty value of the fields named name.
func fieldValue(req *httphead.Request, name string) []byte {
	for i := range req.Fields {
		f := &req.Fields[i]
		if len(f.Value) > 0 && httphead.EqualFold(f.Name, name) {
			return f.Value
		}
	}
	return nil
}

// RoutingKey returns the request's routing key: the first non-empty value
// of the key headers, in their order; nil when there is none.
func (p *Policy) RoutingKey(req *httphead.Request) []byte {
	for _, name := range p.cfg.KeyHeaders {
		if v := fieldValue(req, name); v != nil {
			return v
		}
	}
	return nil
}

// FinishSession forgets the sticky assignment (or, with the hash policy,
// the remembered spill) of a routing key (POST /finish_session). It
// reports whether there was one.
func (p *Policy) FinishSession(key string) bool {
	if p.cfg.Sticky == nil {
		return false
	}
	return p.cfg.Sticky.Delete(KeyHashString(key))
}

// PeekedBody returns the body data at the start of the peeked bytes: for a
// chunked body, the data of the first chunk (as much as was peeked), without
// the chunk framing; nil when the framing is cut or malformed (as
// httphead.Chunked reads it).
func PeekedBody(req *httphead.Request, body []byte) []byte {
	if !req.Chunked {
		return body
	}
	j := bytes.IndexByte(body, '\n')
	if j < 0 {
		return nil
	}
	var c httphead.Chunked
	if n, err := c.Scan(body[:j+1]); err != nil || n != j+1 {
		return nil
	}
	data := body[j+1:]
	if n := c.Data(); int64(len(data)) > n {
		data = data[:n]
	}
	return data
}

// routeTarget honours X-SMG-Target-Worker: a slot number or a worker URL.
func routeTarget(rt *Router, ws []*worker.Worker, v []byte) Decision {
	var w *worker.Worker
	if slot, ok := parseSlot(v); ok {
		if slot < len(ws) {
			w = ws[slot]
		}
	} else {
		for _, c := range ws {
			if c != nil && c.URL == string(v) {
				w = c
				break
			}
		}
	}
	if w == nil {
		rt.reasons[ReasonBadTarget].Add(1)
		return Decision{Status: 400, Reason: ReasonBadTarget}
	}
	rt.reasons[ReasonTarget].Add(1)
	return Decision{Worker: w, Reason: ReasonTarget}
}

// parseSlot parses a decimal slot without sign (at most 6 digits).
func parseSlot(b []byte) (int, bool) {
	if len(b) == 0 || len(b) > 6 {
		return 0, false
	}
	n := 0
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int(c-'0')
	}
	return n, true
}

// p2c routes a request without a key: of two distinct random slots, the
// healthy one with fewer requests in flight. When the draw finds no healthy
// worker it falls back to the scan of spread (panic rule, 503).
func p2c(rt *Router, ws []*worker.Worker) Decision {
	n := len(ws)
	var a, b *worker.Worker
	switch {
	case n == 1:
		a = ws[0]
	case n > 1:
		i := rand.IntN(n)
		j := rand.IntN(n - 1)
		if j >= i {
			j++
		}
		a, b = ws[i], ws[j]
	}
	if a == nil || a.State() != worker.Healthy {
		a = nil
	}
	if b != nil && b.State() == worker.Healthy && (a == nil || b.Stats.Pending() < a.Stats.Pending()) {
		a = b
	}
	if a == nil {
		return rt.spread(ReasonSpread)
	}
	rt.reasons[ReasonSpread].Add(1)
	return Decision{Worker: a, Reason: ReasonSpread}
}

// PrefixHash hashes the start of a request body for --keyless=prefix: the
// samples of a GRPO group share their prompt but not their request id, so
// the string values of the top-level request-id members (the first of
// each field, as far as they are within body) are left out.
func PrefixHash(body []byte) uint64 {
	var skip [maxIDFields][2]int
	ns := 0
	var seen [maxIDFields]bool
	o := jsonpeek.Open(body)
	for n := 0; n < len(requestIDFields); {
		m, st := o.Next()
		if st != jsonpeek.OK {
			break
		}
		if k, ok := isRequestIDField(&m); ok && !seen[k] {
			seen[k] = true
			n++
			if m.Value[0] == '"' {
				skip[ns] = [2]int{m.Start, m.Start + len(m.Value)}
				ns++
			}
		}
	}
	h := uint64(keyhash.Offset)
	at := 0
	for i := 0; i < ns; i++ {
		h = keyhash.FNV1a(h, body[at:skip[i][0]])
		at = skip[i][1]
	}
	return keyhash.Mix(keyhash.FNV1a(h, body[at:]))
}

// SetPolicy replaces the policy of a router in use (a reload).
func (rt *Router) SetPolicy(p *Policy) { rt.policy.Store(p) }

// CurrentPolicy returns the policy in effect (nil: spread).
func (rt *Router) CurrentPolicy() *Policy { return rt.policy.Load() }
