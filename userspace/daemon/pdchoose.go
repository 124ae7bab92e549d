package daemon

import (
	"context"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/keyhash"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/pd"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// pairChooser places P/D requests over the worker table (pd.PairChooser):
// the prefill by affinity (the routing key of --key-header, else the
// prompt's group, route.PromptGroup: a session's turns and a GRPO group's
// samples reach the same prefill while it is healthy and under its bounded
// load, prefillBound; rendezvous hashing, so a prefill that leaves moves
// only its own keys; prompts that share only a system prompt are other
// groups, spread over the prefills; where the prefills publish KV-cache
// events, the prefill whose cache holds the longest prefix of the
// request's token ids first, the affinity among equals: a keyless
// session's turns follow the prefill that computed its last prompt),
// the decode by load (the engine signals and
// tetherd's in-flight count, EngineScore); a pair whose sides are on
// different weight versions (fleet.Version) takes no work. Both sides
// count the request as a routed request counts on its worker: from Choose
// their gate, in-flight and request counts and a decision (pd_prefill,
// pd_decode: GET /workers' decisions, tether_worker_decisions_total and
// tether_route_decisions_total) until Release (errors); the answer's
// status class and time on both (Observe: tether_responses_total,
// tether_request_duration_seconds).
type pairChooser struct {
	table      *worker.Table
	fleet      *fleet.Fleet
	keyHeaders []string
	router     *route.Router                              // counts the decisions (nil: on the workers only)
	observe    func(slot, codeClass int, d time.Duration) // the proxy's Config.Observe (nil: none)

	mu    sync.Mutex
	taken map[pairSide]*worker.Worker // the worker objects counted, for Release

	// by counts the pairs Choose returned by what decided the prefill
	// (chooseBy; not /health_generate's, nor a pair given back as a
	// pause began); heldTokens sums the prompt tokens the prefill's
	// cache held when its KV events decided (tether_pd_prefill_*).
	by         [numChooseBy]atomic.Uint64
	heldTokens atomic.Uint64
}

// What decided a pair's prefill: its cache (KV events), the request's
// key, its prompt's group, the least load, or a spill (the prefill the
// cache or the affinity named was at its bounded load or refused: the
// next one).
const (
	chooseByKV = iota
	chooseByKey
	chooseByPrompt
	chooseByLoad
	chooseBySpill
	numChooseBy
)

var chooseByNames = [numChooseBy]string{"kv", "key", "prompt", "load", "spill"}

// choice is what decided a pair's prefill, and the prompt tokens its
// cache held where that was its KV events.
type choice struct {
	by, held int
}

func chooseByOf(why string) int {
	switch why {
	case "kv":
		return chooseByKV
	case "key":
		return chooseByKey
	case "prompt":
		return chooseByPrompt
	}
	return chooseByLoad
}

type pairSide struct {
	slot int
	url  string
}

// prefillBound: a prefill takes work by affinity while its requests in
// flight are under this many times the prefills' average, plus
// prefillSlack (bounded-load consistent hashing; at 2, two prefills
// could never spill: one holding all the load is under twice the average).
const (
	prefillBound = 1.25
	prefillSlack = 2
)

// affinity returns the request's affinity hash and what it came from.
func (c *pairChooser) affinity(req *pd.Request) (uint64, string) {
	for _, h := range c.keyHeaders {
		if v := req.Header.Get(h); v != "" {
			return keyhash.String(v), "key"
		}
	}
	if h, ok := route.PromptGroup(req.Body); ok {
		return h, "prompt"
	}
	return 0, ""
}

type scored struct {
	w     *worker.Worker
	score float64
	held  int  // a prefill: prompt tokens its cache holds (KV events)
	over  bool // a prefill at its bounded load
}

// held sets each prefill's held tokens of the request's token ids from
// the KV index (KV-event placement on, route.PrefixPlacement: the same
// subscriptions as regular workers'); false when none holds any (no
// events, no token ids in the body: a text prompt, chat messages).
func (c *pairChooser) held(req *pd.Request, ps []scored) bool {
	if c.router == nil {
		return false
	}
	pp := c.router.PrefixPlacement()
	if pp == nil || pp.Index().BlockSize() == 0 {
		return false
	}
	var m kvindex.Match
	if !pp.Index().Scan(req.Body, int64(len(req.Body)), &m) || m.Engines == 0 {
		return false
	}
	some := false
	for i := range ps {
		for _, id := range pp.Engines(ps[i].w.Slot) {
			ps[i].held = max(ps[i].held, m.Matched(id))
		}
		some = some || ps[i].held > 0
	}
	return some
}

// holding reports whether the fleet holds generation requests (a weight
// sync, or a retiring tetherd's hand-over).
func (c *pairChooser) holding() bool {
	return c.fleet != nil && (c.fleet.Phase() != fleet.Serving || c.fleet.Forwarding() != nil)
}

// Holds implements pd.PauseCounter: the fleet's holds (none without one).
func (c *pairChooser) Holds() (uint64, bool) {
	if c.fleet == nil {
		return 0, false
	}
	return c.fleet.Holds()
}

// Choose implements pd.PairChooser. While the fleet holds (a retry, or a
// pause that began after the proxy's hold let the request through) it
// waits in the hold first; a pair taken as a pause began is given back
// and the request waits, so no leg reaches an engine the pause saw quiet.
func (c *pairChooser) Choose(ctx context.Context, req *pd.Request, attempt int, failed *pd.Pair) (pd.Pair, error) {
	return c.pick(ctx, req, failed, true)
}

// pick is Choose; count false leaves the pair out of the choices'
// counters (/health_generate's probe).
func (c *pairChooser) pick(ctx context.Context, req *pd.Request, failed *pd.Pair, count bool) (pd.Pair, error) {
	var until time.Time
	for {
		if c.holding() {
			if until.IsZero() {
				until = time.Now().Add(c.fleet.Timeout())
			}
			if c.fleet.Wait(nil, ctx.Done(), until) != worker.HoldReleased {
				return pd.Pair{}, pd.ErrNoPair
			}
			continue
		}
		p, ch, err := c.choose(req, failed)
		if err != nil {
			return p, err
		}
		if !c.holding() {
			if count {
				c.by[ch.by].Add(1)
				c.heldTokens.Add(uint64(ch.held))
			}
			return p, nil
		}
		c.Release(p, false)
	}
}

func (c *pairChooser) choose(req *pd.Request, failed *pd.Pair) (pd.Pair, choice, error) {
	snap := c.table.Snapshot()
	var ps, ds []scored
	var load float64
	for _, w := range snap {
		if w == nil || w.State() != worker.Healthy {
			continue
		}
		switch w.Role() {
		case worker.Prefill:
			ps = append(ps, scored{w: w})
			load += float64(w.Stats.Pending())
		case worker.Decode:
			s, vetoed := w.EngineScore()
			if vetoed {
				s += 1e9 // last resort
			}
			ds = append(ds, scored{w: w, score: s})
		}
	}
	if len(ps) == 0 || len(ds) == 0 {
		return pd.Pair{}, choice{}, pd.ErrNoPair
	}
	if failed != nil {
		ps = avoid(ps, failed.Prefill)
		ds = avoid(ds, failed.Decode)
	}
	h, why := c.affinity(req)
	bound := prefillBound*load/float64(len(ps)) + prefillSlack
	for i := range ps {
		w := ps[i].w
		if why != "" {
			ps[i].score = -float64(keyhash.Mix(h^uint64(w.Ident())) >> 11)
		} else {
			ps[i].score = float64(w.Stats.Pending())
		}
		ps[i].over = float64(w.Stats.Pending()) >= bound // over its bounded load: the others first
	}
	byHeld := c.held(req, ps)
	sort.SliceStable(ps, func(i, j int) bool {
		a, b := &ps[i], &ps[j]
		if a.over != b.over {
			return !a.over
		}
		if a.held != b.held {
			return a.held > b.held
		}
		return a.score < b.score
	})
	sort.SliceStable(ds, func(i, j int) bool { return ds[i].score < ds[j].score })
	if byHeld && !ps[0].over {
		for _, p := range ps[1:] {
			if !p.over && p.held < ps[0].held {
				why = "kv" // what the caches hold decided, not the affinity
				break
			}
		}
	}
	reason := "prefill-least"
	if why != "" {
		reason = "prefill-" + why
	}
	for pi, p := range ps {
		pv := c.version(p.w)
		if !p.w.TryAdmit() {
			continue
		}
		for _, d := range ds {
			if c.version(d.w) != pv || !d.w.TryAdmit() {
				continue
			}
			p.w.Stats.Begin()
			d.w.Stats.Begin()
			c.placed(p.w, route.ReasonPDPrefill)
			c.placed(d.w, route.ReasonPDDecode)
			r, ch := reason, choice{by: chooseByOf(why)}
			if ch.by == chooseByKV {
				ch.held = p.held
			}
			if pi > 0 && why != "" {
				r, ch = "prefill-"+why+"-spill", choice{by: chooseBySpill}
			}
			pair := pd.Pair{
				Prefill: pd.Worker{URL: p.w.URL, Slot: p.w.Slot, BootstrapPort: p.w.BootstrapPort()},
				Decode:  pd.Worker{URL: d.w.URL, Slot: d.w.Slot},
				Reason:  r + " decode-least-load",
			}
			c.mu.Lock()
			if c.taken == nil {
				c.taken = map[pairSide]*worker.Worker{}
			}
			c.taken[pairSide{p.w.Slot, p.w.URL}] = p.w
			c.taken[pairSide{d.w.Slot, d.w.URL}] = d.w
			c.mu.Unlock()
			return pair, ch, nil
		}
		p.w.Leave()
	}
	return pd.Pair{}, choice{}, pd.ErrNoPair
}

// placed counts a side's decision, with the router's where there is one.
func (c *pairChooser) placed(w *worker.Worker, r route.Reason) {
	if c.router != nil {
		c.router.Placed(w, r)
		return
	}
	w.CountDecision(int(r))
}

// Observe implements pd.Observer: both sides see the answer's status
// class and time, as a routed request's worker does.
func (c *pairChooser) Observe(p pd.Pair, status int, took time.Duration) {
	if c.observe == nil {
		return
	}
	c.observe(p.Prefill.Slot, status/100, took)
	c.observe(p.Decode.Slot, status/100, took)
}

// version is w's weight version as the fleet knows it ("" unknown).
func (c *pairChooser) version(w *worker.Worker) string {
	if c.fleet == nil {
		return ""
	}
	return c.fleet.Version(w.URL)
}

// avoid drops the failed side where another is left.
func avoid(ws []scored, failed pd.Worker) []scored {
	if len(ws) < 2 {
		return ws
	}
	out := ws[:0:0]
	for _, s := range ws {
		if s.w.Slot != failed.Slot || s.w.URL != failed.URL {
			out = append(out, s)
		}
	}
	if len(out) == 0 {
		return ws
	}
	return out
}

// Release implements pd.PairChooser.
func (c *pairChooser) Release(p pd.Pair, failed bool) {
	c.mu.Lock()
	pw := c.taken[pairSide{p.Prefill.Slot, p.Prefill.URL}]
	dw := c.taken[pairSide{p.Decode.Slot, p.Decode.URL}]
	c.mu.Unlock()
	for _, w := range []*worker.Worker{pw, dw} {
		if w != nil {
			w.Stats.End(failed)
			w.Leave()
		}
	}
}

// keyHeadersOf returns the routing key headers in canonical form.
func keyHeadersOf(hs []string) []string {
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = http.CanonicalHeaderKey(h)
	}
	return out
}
