package pd

import (
	"context"
	"sync"
)

// RoundRobin is a PairChooser over fixed lists: prefills in turn, and the
// decode with the fewest requests in flight (the first of them after the
// last one picked); a retry avoids the failed pair's prefill and decode
// where there is another. It stands in until the router's placement
// (prefix affinity for prefills, engine load for decodes) chooses pairs.
type RoundRobin struct {
	Prefills, Decodes []Worker

	mu       sync.Mutex
	nextP    int
	nextD    int
	inFlight map[string]int // by decode URL
}

// Choose implements PairChooser.
func (c *RoundRobin) Choose(_ context.Context, _ *Request, _ int, failed *Pair) (Pair, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.Prefills) == 0 || len(c.Decodes) == 0 {
		return Pair{}, ErrNoPair
	}
	if c.inFlight == nil {
		c.inFlight = map[string]int{}
	}
	var p Worker
	for i := 0; i < len(c.Prefills); i++ {
		p = c.Prefills[c.nextP%len(c.Prefills)]
		c.nextP++
		if failed == nil || p.URL != failed.Prefill.URL || len(c.Prefills) == 1 {
			break
		}
	}
	best := -1
	for i := 0; i < len(c.Decodes); i++ {
		j := (c.nextD + i) % len(c.Decodes)
		d := c.Decodes[j]
		if failed != nil && d.URL == failed.Decode.URL && len(c.Decodes) > 1 {
			continue
		}
		if best < 0 || c.inFlight[d.URL] < c.inFlight[c.Decodes[best].URL] {
			best = j
		}
	}
	c.nextD = best + 1
	d := c.Decodes[best]
	c.inFlight[d.URL]++
	return Pair{Prefill: p, Decode: d, Reason: "round-robin"}, nil
}

// Release implements PairChooser.
func (c *RoundRobin) Release(p Pair, _ bool) {
	c.mu.Lock()
	c.inFlight[p.Decode.URL]--
	c.mu.Unlock()
}
