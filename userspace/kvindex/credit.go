package kvindex

import (
	"math"
	"sync"
	"time"
)

// Credits: right after a decision the chosen engine is credited with the
// request's blocks for CreditTTL, so that requests with the same start
// arriving before the engine's events (a GRPO group's samples, n samples)
// follow it. A credit is keyed by the request's prompt's identity
// (Match.ident: its token-id list), whatever its scan read of it.

// CreditTTL is how long a credit lasts.
const CreditTTL = 3 * time.Second

const creditEntries = 4096

type credit struct {
	mu     sync.Mutex
	key    uint64
	engine EngineID
	blocks uint16
	prompt int32 // the credited request's prompt tokens (Match.Prompt)
	body   int64 // its body's length (0: unknown)
	n      int32 // requests placed under this credit within its TTL
	until  int64
}

type creditTable struct {
	e []credit
	// The groups credits saw: samples per prompt (a GRPO group's size,
	// n samples; 1 for prompts of their own), learned from the keyless
	// requests placed (decaying over groupTau), and per engine the
	// samples still expected of the groups placed there lately (pending,
	// decaying over pendingTau): work a group's first sample brings with
	// it, which placement counts before the siblings arrive.
	groups  decaying2
	pending [MaxEngines]Decaying
	// The deepest held prefixes keyless prompts matched lately, and
	// by which prompt (SharedPrefix).
	prefixes []prefixSeen
}

type prefixSeen struct {
	mu         sync.Mutex
	key, ident uint64
	at         int64
}

const (
	prefixEntries = 1024
	sharedWindow  = 2 * time.Second
)

// SharedPrefix reports whether the deepest prefix of m's prompt that an
// engine's events hold was the deepest held prefix of another prompt
// placed within the last two seconds, and notes it as m's. A prefix many
// prompts share (a system prompt, the start of a GRPO wave's prompts) is
// no session's own context: a request holding no more than that is free
// to go to the cheapest engine, where a keyless session's later turns
// (whose deepest held prefix is their own last turn) keep to the engine
// that holds them. Without it, every prompt of a wave went where the
// system prompt was first computed.
func (x *Index) SharedPrefix(m *Match) bool {
	if m.heldKey == 0 {
		return false
	}
	k := m.heldKey
	e := &x.credits.prefixes[(k^k>>29)%prefixEntries]
	now := time.Now().UnixNano()
	e.mu.Lock()
	shared := e.key == k && e.ident != m.ident && now-e.at < int64(sharedWindow)
	e.key, e.ident, e.at = k, m.ident, now
	e.mu.Unlock()
	return shared
}

const (
	groupTau   = 60 * time.Second
	pendingTau = time.Second
)

// Decaying is a value that decays exponentially with time constant tau,
// never below 0 (placement's bookkeeping: the samples pending per engine
// here, route's prefill sent lately per engine). Padded to a cache line.
type Decaying struct {
	mu sync.Mutex
	v  float64
	at int64
	_  [40]byte
}

// Add adds v at now (Unix nanoseconds).
func (d *Decaying) Add(v float64, now int64, tau time.Duration) {
	d.mu.Lock()
	d.v = max(d.v*decay(now-d.at, tau)+v, 0)
	d.at = now
	d.mu.Unlock()
}

// Get returns the value at now.
func (d *Decaying) Get(now int64, tau time.Duration) float64 {
	d.mu.Lock()
	v := d.v * decay(now-d.at, tau)
	d.mu.Unlock()
	return v
}

// decaying2: two values decaying together (requests, prompts).
type decaying2 struct {
	mu   sync.Mutex
	a, b float64
	at   int64
}

func (d *decaying2) add(a, b float64, now int64) {
	d.mu.Lock()
	f := decay(now-d.at, groupTau)
	d.a, d.b, d.at = d.a*f+a, d.b*f+b, now
	d.mu.Unlock()
}

func (d *decaying2) ratio() float64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.b < 1 {
		return 1
	}
	return max(d.a/d.b, 1)
}

func decay(dt int64, tau time.Duration) float64 {
	if dt <= 0 {
		return 1
	}
	return math.Exp(-float64(dt) / float64(tau))
}

func (t *creditTable) init() {
	t.e = make([]credit, creditEntries)
	t.prefixes = make([]prefixSeen, prefixEntries)
}

// GroupSize is the requests per prompt among the keyless requests placed
// lately (decaying over a minute): a GRPO group's samples, 1 where every
// prompt is its own.
func (x *Index) GroupSize() float64 { return x.credits.groups.ratio() }

// Pending is how many requests engine id is expected to receive still:
// the siblings of the groups placed on it lately that have not arrived
// (GroupSize less those that did, decaying over a second).
func (x *Index) Pending(id EngineID) float64 {
	if int(id) >= MaxEngines {
		return 0
	}
	return x.credits.pending[id].Get(time.Now().UnixNano(), pendingTau)
}

// sibling counts a sibling of the group credited on engine id as arrived.
func (t *creditTable) sibling(id EngineID, now int64) {
	t.groups.add(1, 0, now)
	t.pending[id].Add(-1, now, pendingTau)
}

func (t *creditTable) slot(k uint64) *credit { return &t.e[(k^k>>29)%creditEntries] }

// Credit credits engine id with the request of m (Scan) placed on it. It
// returns the engine the request should go to: id, or the engine a
// request with the same start claimed since m was scanned (samples of one
// prompt arriving together), which the caller should follow.
func (x *Index) Credit(m *Match, id EngineID) EngineID {
	if m.NBlocks == 0 || m.BlockSize == 0 {
		return id
	}
	blocks := max(m.Prompt/m.BlockSize, m.NBlocks)
	k := m.ckey
	if k == 0 {
		k, _ = creditKeys(m)
	}
	c := x.credits.slot(k)
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	live := c.key == k && c.until > now.UnixNano()
	if live && (m.Strict || !samePrompt(m, c)) {
		// Another prompt with the same start (nothing cached yet): the
		// credit stays with the group that holds it.
		return id
	}
	ns := now.UnixNano()
	if c.key == k && c.until > ns && !m.Credited && c.engine != id {
		// Claimed by a sibling between this request's scan and now.
		c.n++
		x.credits.sibling(c.engine, ns)
		return c.engine
	}
	if c.key == k && c.until > ns && m.Credited && c.engine != id && c.engine == m.CreditEngine {
		// A sibling placed elsewhere (its group's engine too busy): the
		// group's engine stays the one its later samples follow.
		if !m.Strict {
			x.credits.sibling(c.engine, ns)
		}
		return id
	}
	if c.key == k && c.engine == id && c.until > ns {
		c.n++
		if !m.Strict {
			x.credits.sibling(id, ns)
		}
	} else {
		c.n = 1
		if !m.Strict {
			// A new prompt: its group's other samples are expected here.
			g := x.credits.groups.ratio()
			x.credits.groups.add(1, 1, ns)
			x.credits.pending[id].Add(g-1, ns, pendingTau)
		}
	}
	c.key, c.engine, c.blocks, c.prompt, c.body = k, id, uint16(min(blocks, 1<<16-1)), int32(m.Prompt), max(m.body, 0)
	c.until = now.Add(CreditTTL).UnixNano()
	return id
}

func (t *creditTable) apply(m *Match, now int64) {
	k, alt := creditKeys(m)
	c := t.slot(k)
	c.mu.Lock()
	if a := t.slot(alt); alt != 0 && a != c && !(c.key == k && c.until > now) {
		// None under the first key: a sibling whose length fell in the
		// neighbouring bucket? (One slot locked at a time.)
		c.mu.Unlock()
		a.mu.Lock()
		if a.key == alt && a.until > now {
			c, k = a, alt
		} else {
			a.mu.Unlock()
			c.mu.Lock()
		}
	}
	m.ckey = k
	if c.key == k && c.until > now {
		b := c.blocks
		sibling := samePrompt(m, c)
		if !sibling {
			// Another prompt with the same start (sessions sharing a
			// system prompt): only the blocks up to the key are known
			// shared, not the credited request's whole prompt, and it
			// is no sibling to follow.
			b = uint16(min(m.NBlocks, 1<<16-1))
		}
		if limit := max(m.Prompt/m.BlockSize, m.NBlocks); int(b) > limit {
			b = uint16(min(limit, 1<<16-1))
		}
		pre := m.Blocks[c.engine]
		if b > pre {
			m.Blocks[c.engine] = b
		}
		if sibling {
			m.Credited, m.CreditEngine, m.Siblings = true, c.engine, int(c.n)
			m.precredit = pre
		}
	}
	c.mu.Unlock()
}

// DropSibling undoes the credit Scan applied as a sibling's (a Strict
// request): the credited engine keeps the blocks known shared, those up
// to the credit's key.
func (m *Match) DropSibling() {
	if !m.Credited {
		return
	}
	id := m.CreditEngine
	m.Blocks[id] = max(m.precredit, min(m.Blocks[id], uint16(min(m.NBlocks, 1<<16-1))))
	if m.Blocks[id] == 0 {
		m.Engines &^= 1 << uint(id)
	}
	m.Credited, m.Siblings = false, 0
}

// forget drops the credits of an engine (cleared, or its events arrived).
func (t *creditTable) forget(id EngineID) {
	for i := range t.e {
		c := &t.e[i]
		c.mu.Lock()
		if c.engine == id {
			c.until = 0
		}
		c.mu.Unlock()
	}
}

// samePrompt: m's prompt is the credited request's, by its length: the
// body's, within a bucket (what a scan reads before routing, and so its
// estimate of the prompt's tokens, differs from request to request: with
// the engines' events, a body may be read further, or whole), or where a
// length is unknown the prompt's tokens, within a block.
func samePrompt(m *Match, c *credit) bool {
	if m.identExact {
		return true // the same key: the same token-id list
	}
	if m.body > 0 && c.body > 0 {
		d := m.body - c.body
		return d < lengthBucket && d > -lengthBucket
	}
	d := m.Prompt - int(c.prompt)
	return d <= m.BlockSize && d >= -m.BlockSize
}

// lengthBucket is the width, in body bytes, of a credit key's length.
const lengthBucket = 128

// creditKeys returns a credit's key: the prompt's identity, exact where
// its whole token-id list was within CreditWindow (alt 0). A longer list
// is named by the window and the body's length, in buckets of
// lengthBucket bytes (the same for the samples of one prompt, whose
// bodies differ in a sample's own fields only); alt, the neighbouring
// bucket nearer the body's length, is where a sibling just across a
// bucket's edge looks too (0: none). Without a body length, the prompt's
// tokens in blocks.
func creditKeys(m *Match) (k, alt uint64) {
	const mix = 0x9e3779b97f4a7c15
	if m.identExact {
		return m.ident | 1, 0
	}
	if m.body <= 0 {
		return m.ident ^ uint64(m.Prompt/max(m.BlockSize, 1)+1)*mix, 0
	}
	b := uint64(m.body / lengthBucket)
	k = m.ident ^ (b+1)*mix ^ 1<<63
	switch {
	case m.body%lengthBucket >= lengthBucket/2:
		alt = m.ident ^ (b+2)*mix ^ 1<<63
	case b > 0:
		alt = m.ident ^ b*mix ^ 1<<63
	}
	return k, alt
}
