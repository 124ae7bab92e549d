package route

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/worker"
)

// Placement by engine state (docs/routing.md, "Engine-aware placement").
// Once some worker's engine reports its load (Worker.SetEngineSignals),
// what is free to go anywhere is placed by engineScore, the expected time
// to serve (work ahead, KV penalty), with the ring as the tie-breaker:
//
//   - keyless requests (--keyless=least): a request whose body carries a
//     prompt (GroupHash) goes where the earlier samples of its prompt are
//     in flight, up to GroupMax there, then to the next best engine
//     (reason group); the first sample of a prompt, and requests without
//     one, go to the best engine (engine-least), ties to the prompt's
//     ring owner (or rotating, without a prompt).
//   - new keys of --policy=sticky and new sessions (POST /sessions, which
//     carry no key): the best engine, ties to the key's ring owner.
//   - keys of --policy=hash stay with their ring owner unless its KV
//     cache nears full and another engine is clearly better
//     (engine-least: bounded load on engine state, which cannot tell a
//     new key from a known one) or the owner is vetoed and another
//     clearly better (veto); a moved key is
//     remembered like a spill and stays moved until its entry expires
//     (--hash-spill-ttl after its last request), unless its new engine
//     is vetoed in turn.
//
// A vetoed engine (KV usage >= KVVeto, or more than WaitingVeto waiting;
// the veto lifts below KVVeto-0.1 and WaitingVeto/2) takes no new keys,
// sessions or keyless work; a key already on it moves only to an engine
// clearly better (score below cur/Margin - Slack). w<idx>- session ids
// never move. When every engine is vetoed, the poller holds admissions
// (Worker.SetEngineHold): requests wait in tetherd's queue.

// Defaults of the engine flags.
const (
	DefaultKVVeto      = 0.9
	DefaultWaitingVeto = 64
	DefaultGroupMax    = 16
	// DefaultMoveMargin and DefaultMoveSlack: an engine is clearly better
	// than the current one when cur > best*Margin + Slack (scores in
	// requests).
	DefaultMoveMargin = 1.5
	DefaultMoveSlack  = 4
	// vetoBand: the KV veto lifts this far below KVVeto.
	vetoBand = 0.1
	// tieSlack: scores within this many requests of the best are ties.
	tieSlack = 0.5
)

// EngineConfig is engine-aware placement's settings (tetherd's --kv-veto,
// --waiting-veto, --group-max). Zero values take the defaults
// (Provision); NewEnginePlacement validates them.
type EngineConfig struct {
	KVVeto      float64              // veto at KV usage >= this; DefaultKVVeto; >= 1: never
	WaitingVeto config.Optional[int] // veto above this many waiting; unset: DefaultWaitingVeto, 0: none
	GroupMax    config.Optional[int] // a prompt's samples in flight per engine; unset: DefaultGroupMax, 0: no grouping
	MoveMargin  float64              // 0: DefaultMoveMargin
	MoveSlack   float64              // 0: DefaultMoveSlack
}

// DefaultEngineConfig is EngineConfig with every field at its default.
func DefaultEngineConfig() EngineConfig {
	var c EngineConfig
	c.Provision()
	return c
}

// Provision fills c's zero fields with the defaults.
func (c *EngineConfig) Provision() {
	if c.KVVeto == 0 {
		c.KVVeto = DefaultKVVeto
	}
	if !c.WaitingVeto.IsSet() {
		c.WaitingVeto = config.Some(DefaultWaitingVeto)
	}
	if !c.GroupMax.IsSet() {
		c.GroupMax = config.Some(DefaultGroupMax)
	}
	if c.MoveMargin == 0 {
		c.MoveMargin = DefaultMoveMargin
	}
	if c.MoveSlack == 0 {
		c.MoveSlack = DefaultMoveSlack
	}
}

// EnginePlacement is the engine-aware placement of a Router
// (Router.SetEnginePlacement). Safe for concurrent use.
type EnginePlacement struct {
	cfg    EngineConfig
	known  atomic.Int32 // workers with signals (SetKnown): 0 turns it all off
	groups *groupTable
}

// NewEnginePlacement validates cfg.
func NewEnginePlacement(cfg EngineConfig) (*EnginePlacement, error) {
	cfg.Provision()
	if !(cfg.KVVeto > 0) {
		return nil, fmt.Errorf("--kv-veto %v: want > 0 (>= 1: never)", cfg.KVVeto)
	}
	if cfg.MoveMargin < 1 || cfg.MoveSlack < 0 {
		return nil, errors.New("engine move margin: want margin >= 1, slack >= 0")
	}
	return &EnginePlacement{cfg: cfg, groups: newGroupTable()}, nil
}

// Config returns the settings, defaults applied.
func (e *EnginePlacement) Config() EngineConfig { return e.cfg }

// SetKnown tells how many workers have engine signals now (the poller,
// after each round): with none, placement is exactly as without engines.
func (e *EnginePlacement) SetKnown(n int) { e.known.Store(int32(n)) }

// Veto decides an engine's veto from a reading, with hysteresis: on at KV
// usage >= KVVeto or more than WaitingVeto waiting; once on, off only when
// KV usage is below KVVeto-0.1 and at most WaitingVeto/2 wait.
func (e *EnginePlacement) Veto(prev bool, s worker.EngineSignals) bool {
	kv := e.cfg.KVVeto
	wait, bound := e.waitingBound()
	if prev {
		kv -= vetoBand
		wait /= 2
	}
	if s.KVUsage >= 0 && s.KVUsage >= kv && e.cfg.KVVeto < 1 {
		return true
	}
	return bound && s.Waiting > wait
}

// waitingBound is WaitingVeto, and whether it bounds at all (0, or a
// negative value: no bound).
func (e *EnginePlacement) waitingBound() (int, bool) {
	w := e.cfg.WaitingVeto.Or(0)
	return w, w > 0
}

// VetoLow is the KV low mark of a veto decided by Veto for s: the usage
// below which the veto lifts between readings (Worker.SetEngineSignals),
// or 0 when the waiting queue vetoes it too (that lifts at a reading).
func (e *EnginePlacement) VetoLow(s worker.EngineSignals) float64 {
	if wait, bound := e.waitingBound(); bound && s.Waiting > wait/2 {
		return 0
	}
	return max(e.cfg.KVVeto-vetoBand, 0.01)
}

// SetEnginePlacement turns engine-aware placement on (nil: off). A new
// one (a reload) keeps the groups of the one it replaces.
func (rt *Router) SetEnginePlacement(e *EnginePlacement) {
	if old := rt.engine.Load(); old != nil && e != nil && old != e {
		e.groups = old.groups
		e.known.Store(old.known.Load())
	}
	rt.engine.Store(e)
}

// EnginePlacement returns the engine-aware placement (nil: off).
func (rt *Router) EnginePlacement() *EnginePlacement { return rt.engine.Load() }

// engineOn returns the engine placement when some worker has signals.
func (rt *Router) engineOn() *EnginePlacement {
	if e := rt.engine.Load(); e != nil && e.known.Load() > 0 {
		return e
	}
	return nil
}

// clearlyBetter reports whether score b beats cur by the move margin.
func (e *EnginePlacement) clearlyBetter(b, cur float64) bool {
	return cur > b*e.cfg.MoveMargin+e.cfg.MoveSlack
}

// best returns the healthy, not vetoed worker with the lowest score, ties
// (within tieSlack) broken by the ring from h (useRing) or by rotation
// from h, skipping skip (may be nil); nil when every healthy worker is
// vetoed or none is healthy. It also returns the best score.
func (e *EnginePlacement) best(p *Policy, ws []*worker.Worker, h uint64, useRing bool, skip *worker.Worker) (*worker.Worker, float64) {
	var scores [64]float64
	bestScore := -1.0
	n := 0
	for i, w := range ws {
		if w == nil || w == skip || w.State() != worker.Healthy {
			continue
		}
		s, vetoed := w.EngineScore()
		if vetoed {
			continue
		}
		if i < len(scores) {
			scores[i] = s
		}
		if bestScore < 0 || s < bestScore {
			bestScore = s
		}
		n++
	}
	if n == 0 {
		return nil, 0
	}
	isTie := func(slot int) bool {
		w := ws[slot]
		if w == nil || w == skip || w.State() != worker.Healthy {
			return false
		}
		var s float64
		if slot < len(scores) {
			s = scores[slot]
			if s == 0 {
				return false // vetoed or not seen above
			}
		} else {
			var vetoed bool
			if s, vetoed = w.EngineScore(); vetoed {
				return false
			}
		}
		return s <= bestScore+tieSlack
	}
	if useRing && p != nil {
		r := p.ringFor(ws)
		if np := len(r.points); np > 0 {
			i := r.search(h)
			for k := 0; k < np; k++ {
				if slot := int(r.points[i].slot); isTie(slot) {
					return ws[slot], bestScore
				}
				if i++; i == np {
					i = 0
				}
			}
		}
	}
	nw := len(ws)
	start := int(h % uint64(nw))
	for k := 0; k < nw; k++ {
		if slot := (start + k) % nw; isTie(slot) {
			return ws[slot], bestScore
		}
	}
	return nil, 0
}

// leastVetoed is the healthy worker with the lowest score, vetoed or not
// (every engine is vetoed: the request waits in that worker's queue while
// the poller holds admissions).
func leastVetoed(ws []*worker.Worker, start uint64) *worker.Worker {
	var best *worker.Worker
	var bs float64
	n := len(ws)
	for k := 0; k < n; k++ {
		w := ws[(int(start%uint64(n))+k)%n]
		if w == nil || w.State() != worker.Healthy {
			continue
		}
		if s, _ := w.EngineScore(); best == nil || s < bs {
			best, bs = w, s
		}
	}
	return best
}

// least places a request without a key (--keyless=least) on the best
// engine, ties rotating; every engine vetoed: the least loaded vetoed one.
// false: no healthy worker (d untouched); the least rule applies its panic
// rule.
func (e *EnginePlacement) least(rt *Router, p *Policy, ws []*worker.Worker, d *Decision) bool {
	w, _ := e.best(p, ws, rt.rr.Add(1), false, nil)
	if w == nil {
		if w = leastVetoed(ws, rt.rr.Add(1)); w == nil {
			return false
		}
	}
	*d = rt.decide(w, ReasonEngineLeast)
	return true
}

// newKey places a key seen for the first time (--policy=sticky): the best
// engine, ties to the key's ring owner; nil when every engine is vetoed
// (the caller uses its own rule).
func (e *EnginePlacement) newKey(p *Policy, ws []*worker.Worker, h uint64) *worker.Worker {
	w, _ := e.best(p, ws, h, true, nil)
	return w
}

// moveKey decides whether a key on cur moves: to the best engine when it
// is clearly better than cur and cur is vetoed (reason veto) or, with
// onlyVetoed false, when cur's KV cache is nearing full (usage at least
// KVVeto-0.2: the load of one hot key alone never moves it)
// (engine-least). ok false: the key stays.
func (e *EnginePlacement) moveKey(p *Policy, ws []*worker.Worker, h uint64, cur *worker.Worker, onlyVetoed bool) (*worker.Worker, Reason, bool) {
	cs, vetoed, u := cur.EngineEstimate()
	if !vetoed && (onlyVetoed || u < e.cfg.KVVeto-2*vetoBand) {
		return nil, 0, false
	}
	b, bs := e.best(p, ws, h, true, cur)
	if b == nil || !e.clearlyBetter(bs, cs) {
		return nil, 0, false
	}
	if vetoed {
		return b, ReasonVeto, true
	}
	return b, ReasonEngineLeast, true
}

// group places a sample of the prompt gh.
func (e *EnginePlacement) group(rt *Router, p *Policy, ws []*worker.Worker, gh uint64, d *Decision) bool {
	g := e.groups.entry(gh)
	g.mu.Lock()
	if g.hash != gh || !g.set {
		if g.set && (g.n[0] > 0 || g.n[1] > 0) {
			// Another prompt in flight holds the entry: place alone.
			g.mu.Unlock()
			w, _ := e.best(p, ws, gh, true, nil)
			if w == nil {
				if w = leastVetoed(ws, gh); w == nil {
					return false
				}
			}
			rt.reasons[ReasonEngineLeast].Add(1)
			*d = Decision{Worker: w, Reason: ReasonEngineLeast}
			return true
		}
		g.hash, g.set = gh, true
		g.slot, g.n = [2]int32{-1, -1}, [2]int32{}
	}
	max := int32(e.cfg.GroupMax.Or(0))
	var skip *worker.Worker
	for k := 0; k < 2; k++ {
		s := int(g.slot[k])
		if s < 0 || s >= len(ws) || ws[s] == nil {
			continue
		}
		w := ws[s]
		if w.State() != worker.Healthy || w.EngineVetoedNow() {
			continue
		}
		if g.n[k] < max {
			g.n[k]++
			g.mu.Unlock()
			rt.reasons[ReasonGroup].Add(1)
			*d = Decision{Worker: w, Reason: ReasonGroup, Done: g.rel[k]}
			return true
		}
		skip = w // full: the next best engine
	}
	w, _ := e.best(p, ws, gh, true, skip)
	if w == nil {
		w = leastVetoed(ws, gh)
	}
	if w == nil {
		g.mu.Unlock()
		return false
	}
	// Record it where no sample is in flight (the later samples follow).
	k := -1
	for i := 0; i < 2; i++ {
		if int(g.slot[i]) == w.Slot {
			k = i
			break
		}
	}
	if k < 0 {
		for i := 0; i < 2; i++ {
			if g.slot[i] < 0 || g.n[i] == 0 {
				k = i
				g.slot[i], g.n[i] = int32(w.Slot), 0
				break
			}
		}
	}
	reason := ReasonEngineLeast
	if g.slot[0] >= 0 && g.slot[1] >= 0 {
		reason = ReasonGroup // the prompt's next engine
	}
	var done func()
	if k >= 0 {
		g.n[k]++
		done = g.rel[k]
	}
	g.mu.Unlock()
	rt.reasons[reason].Add(1)
	*d = Decision{Worker: w, Reason: reason, Done: done}
	return true
}

// groupTable remembers where the samples of recent prompts went: a
// direct-mapped table (a prompt in flight keeps its entry; a colliding
// prompt is placed alone), with preallocated release functions so that
// a decision allocates nothing.
type groupTable struct {
	e [groupEntries]groupEntry
}

const groupEntries = 4096

type groupEntry struct {
	mu   sync.Mutex
	set  bool
	hash uint64
	slot [2]int32 // engines of the prompt (-1: none)
	n    [2]int32 // its samples in flight there
	rel  [2]func()
}

func newGroupTable() *groupTable {
	t := &groupTable{}
	for i := range t.e {
		g := &t.e[i]
		g.rel[0] = func() { g.release(0) }
		g.rel[1] = func() { g.release(1) }
	}
	return t
}

func (t *groupTable) entry(h uint64) *groupEntry { return &t.e[(h^h>>32)%groupEntries] }

func (g *groupEntry) release(k int) {
	g.mu.Lock()
	if g.n[k] > 0 {
		g.n[k]--
	}
	g.mu.Unlock()
}

// Groups returns the prompts with samples in flight and, per slot, how
// many samples of tracked prompts are in flight there (display, tests).
func (e *EnginePlacement) Groups() (prompts int, perSlot map[int]int) {
	perSlot = map[int]int{}
	for i := range e.groups.e {
		g := &e.groups.e[i]
		g.mu.Lock()
		if g.set && (g.n[0] > 0 || g.n[1] > 0) {
			prompts++
			for k := 0; k < 2; k++ {
				if g.n[k] > 0 {
					perSlot[int(g.slot[k])] += int(g.n[k])
				}
			}
		}
		g.mu.Unlock()
	}
	return prompts, perSlot
}
