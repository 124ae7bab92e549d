package route

import (
	"errors"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/httphead"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/worker"
)

// Placement from what each engine holds: once the engines'
// KV-cache events fill a kvindex.Index (daemon/kvevents.go subscribes),
// a request whose body carries token ids (SGLang input_ids, vLLM prompt
// ids) is placed on the engine with the least expected work, in tokens:
//
//	cost(e) = prompt tokens - tokens e holds of the prompt
//	        + TokensPerRequest × e's engine score (work reported + routed since, KV penalty: engine_load.go)
//	        + the prefill tetherd sent e lately (uncached tokens, decaying over Backlog)
//	        + keyed requests, and keyless ones no engine holds more of than
//	          a prefix two engines hold (a keyless session's first turn, a
//	          group's first sample): the prompt tokens of tetherd's requests
//	          in flight on e, past that shared prefix (for a new key: past
//	          what any engine holds) (kvinflight.go)
//
// Keyless requests, new keys and new sessions go to the cheapest engine;
// a key already placed here stays on its engine unless another one is
// clearly cheaper (cost × MoveMargin + MoveSlack × TokensPerRequest,
// judged without the tokens in flight, its engine taken to hold its last
// prompt where the scan cannot see: a move recomputes the session's
// context), vetoed or not, and so does a keyless session's context (the
// engine holding the most of a prompt, past a shared prefix); a vetoed
// engine takes nothing new. A keyed
// request never follows a credit (kvindex.Match.Strict): its key keeps
// its session together. Right after a decision the chosen
// engine is credited with the request's blocks (kvindex credits) so that
// siblings (GRPO samples) follow it before its events arrive. Requests
// without token ids, and requests whose scan finds no block size yet (no
// events), are placed as before: the seam returns false and the policy
// goes on.

// Defaults of PrefixConfig.
const (
	DefaultTokensPerRequest = 64
	DefaultPrefixBacklog    = time.Second
	prefixKeyEntries        = 1 << 14
)

// PrefixConfig configures prefix placement.
type PrefixConfig struct {
	Index *kvindex.Index
	// TokensPerRequest: the work one request in flight on an engine
	// counts for, in prompt tokens. Default 64.
	TokensPerRequest float64
	// Backlog: how long the prefill sent to an engine counts (decaying).
	Backlog    time.Duration
	MoveMargin float64 // default DefaultMoveMargin
	MoveSlack  float64 // in requests; default DefaultMoveSlack
	KeyTTL     time.Duration
}

// PrefixPlacement is the placement of a Router by its engines' caches.
type PrefixPlacement struct {
	cfg     PrefixConfig
	x       *kvindex.Index
	engines atomic.Pointer[map[int][]kvindex.EngineID] // worker slot -> engine per DP rank
	backlog [kvindex.MaxEngines]kvindex.Decaying
	flight  inflight
	keys    []prefixKey

	decisions, matched, scanned, moved atomic.Uint64
}

type prefixKey struct {
	mu   sync.Mutex
	hash uint64
	slot int32
	rank int32
	// prompt: the prompt tokens of the key's last request, which its
	// engine holds since (with that request's output) unless its events
	// say otherwise.
	prompt int32
	until  int64
}

// NewPrefixPlacement validates cfg.
func NewPrefixPlacement(cfg PrefixConfig) (*PrefixPlacement, error) {
	if cfg.Index == nil {
		return nil, errors.New("prefix placement: no index")
	}
	if cfg.TokensPerRequest <= 0 {
		cfg.TokensPerRequest = DefaultTokensPerRequest
	}
	if cfg.Backlog <= 0 {
		cfg.Backlog = DefaultPrefixBacklog
	}
	if cfg.MoveMargin < 1 {
		cfg.MoveMargin = DefaultMoveMargin
	}
	if cfg.MoveSlack <= 0 {
		cfg.MoveSlack = DefaultMoveSlack
	}
	if cfg.KeyTTL <= 0 {
		cfg.KeyTTL = 10 * time.Minute
	}
	p := &PrefixPlacement{cfg: cfg, x: cfg.Index, keys: make([]prefixKey, prefixKeyEntries)}
	p.flight.init()
	m := map[int][]kvindex.EngineID{}
	p.engines.Store(&m)
	return p, nil
}

// Index returns the index placement reads.
func (p *PrefixPlacement) Index() *kvindex.Index { return p.x }

// SetEngines names the index engines of the worker in slot, one per DP
// rank (nil: none; the worker is then placed with nothing matched).
func (p *PrefixPlacement) SetEngines(slot int, ids []kvindex.EngineID) {
	old := *p.engines.Load()
	m := make(map[int][]kvindex.EngineID, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	if ids == nil {
		delete(m, slot)
	} else {
		m[slot] = append([]kvindex.EngineID(nil), ids...)
	}
	p.engines.Store(&m)
}

// Engines returns the index engines of the worker in slot (nil: none),
// for other placements that read the index (P/D's prefill chooser).
func (p *PrefixPlacement) Engines(slot int) []kvindex.EngineID { return (*p.engines.Load())[slot] }

// PrefixCounts are prefix placement's counters.
type PrefixCounts struct {
	Decisions     uint64 // requests placed by the index
	MatchedTokens uint64 // prompt tokens the chosen engine held, summed
	ScannedTokens uint64 // prompt tokens of those requests, summed (estimated past the peek)
	Moved         uint64 // keys moved to a clearly cheaper engine
}

// Counts returns the counters.
func (p *PrefixPlacement) Counts() PrefixCounts {
	return PrefixCounts{Decisions: p.decisions.Load(), MatchedTokens: p.matched.Load(),
		ScannedTokens: p.scanned.Load(), Moved: p.moved.Load()}
}

// SetPrefixPlacement turns placement by the engines' caches on (nil: off).
func (rt *Router) SetPrefixPlacement(p *PrefixPlacement) { rt.prefix.Store(p) }

// PrefixPlacement returns it (nil: off).
func (rt *Router) PrefixPlacement() *PrefixPlacement { return rt.prefix.Load() }

// placeByPrefix is the seam in Policy.route: ok false leaves the request
// to the policy.
func (rt *Router) placeByPrefix(ws []*worker.Worker, req *httphead.Request, body []byte, key []byte) (Decision, bool) {
	p := rt.prefix.Load()
	if p == nil || len(body) == 0 {
		return Decision{}, false
	}
	var m kvindex.Match
	if !p.x.Scan(PeekedBody(req, body), req.ContentLength, &m) {
		return Decision{}, false
	}
	if key != nil {
		// A keyed request follows its key, never a credit's group
		// (kvindex.Match.Strict): sessions sharing a system prompt and a
		// length looked like one GRPO group at a cold start, 5 to 20
		// sessions piled on one engine.
		m.Strict = true
		m.DropSibling()
	}
	now := time.Now().UnixNano()
	tau := p.cfg.Backlog
	engines := *p.engines.Load()
	// Keyed requests weigh the prompt tokens in flight on each engine
	// (what its sessions hold): a session ten times as long weighs ten
	// times as much. So does a keyless request that no engine holds more
	// of than a shared prefix (a keyless session's first turn, a group's
	// first sample): new work, free to go anywhere, as a new key is; no
	// engine keeps it for holding its start. Other keyless ones (a
	// session's later turns, a group's siblings) are judged as before:
	// weighing their tokens too split GRPO groups (2.59 engines per
	// prompt in one run, seed 2).
	var ke *prefixKey
	var kh uint64
	known := false // the key has an engine
	if key != nil {
		kh = KeyHash(key)
		ke = &p.keys[(kh^kh>>29)%prefixKeyEntries]
		ke.mu.Lock()
		known = ke.hash == kh && ke.until > now && int(ke.slot) < len(ws)
	}
	held, shared := heldPrefix(&m, engines)
	if key != nil && !known {
		// A new key's session has no context anywhere yet: what an
		// engine holds of its prompt is a shared prefix, also while
		// only one engine's events show it.
		shared = held
	}
	// A keyless prompt holding no more than a prefix another prompt
	// matched lately (kvindex SharedPrefix: a system prompt, even while
	// one engine's events show it) is fresh work too: without it, every
	// prompt of a GRPO wave went where the system prompt was computed
	// first, and then its group.
	sharedLately := key == nil && !m.Credited && p.x.SharedPrefix(&m)
	fresh := key == nil && !m.Credited && (held <= shared || sharedLately)
	tokens := key != nil || fresh
	group := p.x.GroupSize()
	// cost of w for this request; assume: prompt tokens w is taken to
	// hold past what the scan could see (a key's engine: its last
	// request's prompt), while its events agree with it as far as the
	// scan read.
	cost := func(w *worker.Worker, assume int) (float64, int, int, bool) {
		score, vetoed := w.EngineScore()
		ids := engines[w.Slot]
		// The samples still expected of the groups placed here lately
		// (kvindex Pending): a GRPO group's first sample brings its
		// siblings' work, which the engine's load shows only once they
		// arrive; without it every new prompt goes where a shared
		// system prompt is held, and its group finds the engine full.
		var pend float64
		for _, id := range ids {
			pend += p.x.Pending(id)
		}
		if m.Credited && containsID(ids, m.CreditEngine) {
			// The siblings placed here moments ago (the same prompt:
			// kvindex credits mark no other) are this request's group,
			// not work in its way: they share its prefill; and the
			// group's samples still expected are its own.
			score = max(score-float64(m.Siblings), 1)
			pend = max(pend-max(group-1-float64(m.Siblings), 0), 0)
		}
		score += pend
		base := p.cfg.TokensPerRequest * score
		if v, ok := w.EngineState(); ok && v.MaxRunning > 0 && score >= float64(v.MaxRunning) {
			// Past the running batch's bound a request waits a whole
			// request's time: worth far more than any prefill.
			base += (score - float64(v.MaxRunning) + 1) * 16 * p.cfg.TokensPerRequest
		}
		if len(ids) == 0 {
			return float64(m.Prompt) + base, -1, 0, vetoed
		}
		best, rank, held := math.Inf(1), 0, 0
		for r, id := range ids {
			h := m.Matched(id)
			if assume > h && !m.Complete && m.NBlocks > 0 && int(m.Blocks[id]) >= m.NBlocks {
				h = min(assume, m.Prompt)
			}
			bl := p.backlog[id].Get(now, tau)
			if tokens {
				bl += p.flight.get(id)
			}
			if m.Credited && id == m.CreditEngine {
				bl = max(bl-float64(m.Prompt), 0) // its group's own prefill
			}
			c := float64(m.Prompt-h) + base + bl
			if c < best {
				best, rank, held = c, r, h
			}
		}
		return best, rank, held, vetoed
	}
	var bw, vw, hw *worker.Worker
	var bc, vc, hc float64
	var brank, bheld, vrank, vheld, hrank, hheld int
	n := len(ws)
	start := int(rt.rr.Add(1) % uint64(max(n, 1)))
	for k := 0; k < n; k++ {
		w := ws[(start+k)%n]
		if w == nil || w.State() != worker.Healthy {
			continue
		}
		c, r, h, vetoed := cost(w, 0)
		// The engine that holds the most, vetoed or not: a keyless
		// session's context stays there unless another is clearly
		// cheaper, its KV penalty in its cost, as a key's does. When
		// every cache is full (a fleet past its KV), a veto alone moved
		// sessions from one full engine to another, each move a whole
		// context recomputed.
		if h > hheld || (h == hheld && hw != nil && c < hc) {
			hw, hc, hrank, hheld = w, c, r, h
		}
		if vetoed {
			if vw == nil || c < vc {
				vw, vc, vrank, vheld = w, c, r, h
			}
			continue
		}
		if bw == nil || c < bc {
			bw, bc, brank, bheld = w, c, r, h
		}
	}
	allVetoed := bw == nil
	if allVetoed {
		if vw == nil {
			if ke != nil {
				ke.mu.Unlock()
			}
			return Decision{}, false // none healthy: the policy's rules
		}
		// Every engine vetoed (KV caches full): the cheapest of them,
		// as the engine rule takes the least loaded one, but counting
		// what each holds (the poller holds admissions meanwhile).
		bw, bc, brank, bheld = vw, vc, vrank, vheld
	}
	if m.Credited && key == nil {
		// A group (GRPO samples, n samples) follows the engine its first
		// request went to while that engine's expected work, less the
		// group's own samples there, stays within MoveSlack requests of
		// the best, and its whole expected work within the keys' margin
		// (MoveMargin), up to DefaultGroupMax samples (cf. --group-max):
		// its credited prefix already counts for it in its cost.
		if cw, r, ok := workerOf(ws, engines, m.CreditEngine); ok && cw != bw && cw.State() == worker.Healthy && m.Siblings < DefaultGroupMax {
			slack := p.cfg.MoveSlack * p.cfg.TokensPerRequest
			own := float64(m.Siblings) * p.cfg.TokensPerRequest
			// Its engine vetoed: the next best, unless every engine is.
			if c, rr, h, vetoed := cost(cw, 0); (!vetoed || allVetoed) && rr == r && c-own <= bc+slack && c <= bc*p.cfg.MoveMargin+slack {
				bw, bc, brank, bheld = cw, c, r, h
			}
		}
	}
	if key == nil && !fresh && !m.Credited && hw != nil && hw != bw && hheld > bheld &&
		hc <= bc*p.cfg.MoveMargin+p.cfg.MoveSlack*p.cfg.TokensPerRequest {
		// Keyless, the engine that holds the most of the prompt (a
		// session's earlier turns, a group whose events arrived) keeps
		// it unless another is clearly cheaper, vetoed or not, as a
		// key's engine does.
		// Not a shared prefix only (a system prompt two engines show, or
		// one another prompt matched lately): that is no session's, and
		// new sessions, or a GRPO wave's prompts and then their groups,
		// would pile onto the engine whose events came first.
		bw, bc, brank, bheld = hw, hc, hrank, hheld
	}
	stayed := false // a key stays on its engine
	if known {
		if cur := ws[ke.slot]; cur == bw {
			stayed = true
		} else if cur != nil && cur.State() == worker.Healthy {
			// What the key's engine holds counts in tokens (its last
			// prompt): a move recomputes the session's context
			// elsewhere, as a preemption would. A vetoed engine
			// takes nothing new, but a key already there moves only
			// to a clearly cheaper engine, as elsewhere (its KV
			// penalty is in its cost).
			// Judged without the tokens in flight, which chose
			// where new work goes: what the key's engine has in
			// flight is its other sessions' context, not work in
			// this request's way; its queue (the engine score) is.
			tokens = false
			c, r, hd, _ := cost(cur, int(ke.prompt))
			b0, _, _, _ := cost(bw, 0)
			if !(c > b0*p.cfg.MoveMargin+p.cfg.MoveSlack*p.cfg.TokensPerRequest) {
				bw, bc, brank, bheld, stayed = cur, c, r, hd, true
			} else {
				p.moved.Add(1)
			}
		}
	}
	var done func()
	if ids := engines[bw.Slot]; brank >= 0 && brank < len(ids) {
		id := ids[brank]
		if got := p.x.Credit(&m, id); got != id && !stayed {
			// A sibling arriving together claimed another engine: follow
			// (not a key staying on its engine).
			if w, r, ok := workerOf(ws, engines, got); ok && w.State() == worker.Healthy {
				bw, brank, bheld, id = w, r, 0, got
			}
		}
		p.backlog[id].Add(float64(max(m.Prompt-bheld, 0)), now, tau)
		// In flight: what the request pins beyond what the index shows
		// the engine shares already (a system prompt), or beyond a
		// prefix two engines hold (a shared prefix: each engine computes
		// it once, it is no request's own), or, a sibling, beyond its
		// group's prefix.
		pin := m.Prompt - max(m.Matched(id), shared)
		if m.Credited && id == m.CreditEngine {
			pin = m.Prompt - bheld
		}
		done = p.flight.hold(id, pin)
	}
	if ke != nil {
		// Where the request went (after a sibling's follow).
		ke.hash, ke.slot, ke.rank, ke.prompt = kh, int32(bw.Slot), int32(brank), int32(min(m.Prompt, math.MaxInt32))
		ke.until = now + p.cfg.KeyTTL.Nanoseconds()
		ke.mu.Unlock()
	}
	p.decisions.Add(1)
	p.matched.Add(uint64(bheld))
	p.scanned.Add(uint64(m.Prompt))
	rt.reasons[ReasonKVPrefix].Add(1)
	return Decision{Worker: bw, Reason: ReasonKVPrefix, Done: done, Matched: bheld, Rank: brank, Ranks: len(engines[bw.Slot])}, true
}

// heldPrefix returns the longest prefix of m's prompt an engine holds and
// the longest that at least two engines hold (shared): a system prompt,
// not a session's context (held where the session lives). An engine
// whose events have not shown the shared prefix yet (its first requests
// still in flight) would otherwise count it in every request it is sent,
// and look fuller than the engines that show it by a system prompt per
// request.
func heldPrefix(m *kvindex.Match, engines map[int][]kvindex.EngineID) (held, shared int) {
	for _, ids := range engines {
		for _, id := range ids {
			switch h := m.Matched(id); {
			case h > held:
				held, shared = h, held
			case h > shared:
				shared = h
			}
		}
	}
	return held, shared
}

func containsID(ids []kvindex.EngineID, id kvindex.EngineID) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// workerOf finds the worker and rank of an index engine.
func workerOf(ws []*worker.Worker, engines map[int][]kvindex.EngineID, id kvindex.EngineID) (*worker.Worker, int, bool) {
	for slot, ids := range engines {
		for r, x := range ids {
			if x == id && slot < len(ws) && ws[slot] != nil {
				return ws[slot], r, true
			}
		}
	}
	return nil, 0, false
}
