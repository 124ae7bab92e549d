package kvindex

import (
	"sync"
	"time"
)

// Credits: right after a decision the chosen engine is credited with the
// request's blocks for CreditTTL, so that requests with the same start
// arriving before the engine's events (a GRPO group's samples, n samples)
// follow it. A credit is keyed by the last block the request's scan
// hashed: the first block no engine held, or its last full block.

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
}

func (t *creditTable) init() { t.e = make([]credit, creditEntries) }

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
	if c.key == k && c.until > now.UnixNano() && !m.Credited && c.engine != id {
		// Claimed by a sibling between this request's scan and now.
		c.n++
		return c.engine
	}
	if c.key == k && c.until > now.UnixNano() && m.Credited && c.engine != id && c.engine == m.CreditEngine {
		// A sibling placed elsewhere (its group's engine too busy): the
		// group's engine stays the one its later samples follow.
		return id
	}
	if c.key == k && c.engine == id && c.until > now.UnixNano() {
		c.n++
	} else {
		c.n = 1
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
	if m.body > 0 && c.body > 0 {
		d := m.body - c.body
		return d < lengthBucket && d > -lengthBucket
	}
	d := m.Prompt - int(c.prompt)
	return d <= m.BlockSize && d >= -m.BlockSize
}

// lengthBucket is the width, in body bytes, of a credit key's length.
const lengthBucket = 128

// creditKeys returns a credit's key: the scan's last block and the
// prompt's length, so that prompts sharing only a start (a GRPO wave's
// prompts before any engine holds their system prompt) each keep their
// own group's credit. The length is the body's in buckets of
// lengthBucket bytes, the same for the samples of one prompt however much
// of each was read (their bodies differ in a sample's own fields only);
// alt, the neighbouring bucket nearer the body's length, is where a
// sibling just across a bucket's edge looks too (0: none). Without a
// body length, the prompt's tokens in blocks.
func creditKeys(m *Match) (k, alt uint64) {
	const mix = 0x9e3779b97f4a7c15
	if m.body <= 0 {
		return m.Last ^ uint64(m.Prompt/max(m.BlockSize, 1)+1)*mix, 0
	}
	b := uint64(m.body / lengthBucket)
	k = m.Last ^ (b+1)*mix ^ 1<<63
	switch {
	case m.body%lengthBucket >= lengthBucket/2:
		alt = m.Last ^ (b+2)*mix ^ 1<<63
	case b > 0:
		alt = m.Last ^ b*mix ^ 1<<63
	}
	return k, alt
}
