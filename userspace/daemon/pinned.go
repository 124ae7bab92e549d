package daemon

import (
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/sticky"
)

// pinnedEvery bounds how often the sticky table is walked for GET
// /workers' per-worker count (a BPF map of a million entries takes a
// while; the count is an operator's view, not the data path's).
const pinnedEvery = 2 * time.Second

// pinnedCounts caches the sticky table's live entries per worker identity.
type pinnedCounts struct {
	mu     sync.Mutex
	at     time.Time
	counts map[uint32]int
}

// get returns the counts, walking t at most every pinnedEvery; nil when
// t cannot be walked.
func (p *pinnedCounts) get(t sticky.Table) map[uint32]int {
	if t == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.counts == nil || time.Since(p.at) >= pinnedEvery {
		p.counts, p.at = sticky.CountLive(t, sticky.Now()), time.Now()
	}
	return p.counts
}
