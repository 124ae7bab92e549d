package route

import (
	"sync"
	"sync/atomic"

	"github.com/tether-rl/tether/userspace/kvindex"
)

// Work in flight, in tokens: each request the kv-prefix rule places adds
// the prompt tokens it pins in its engine's KV cache (its prompt past
// what the index shows the engine holding already, a shared system
// prompt; a sibling credited with its group's prefix only what the
// credit did not cover) to that engine (DP rank) until its exchange ends
// (Decision.Done). Keyed requests weigh it (kvprefix.go): an engine's
// load is then what its sessions hold, not a count of requests: a
// session ten times as long weighs ten times as much, and the next
// session goes elsewhere. The holds come from a fixed pool, each
// with its Done bound once, so that a decision allocates nothing; with
// the pool empty (more requests in flight than it holds) a request is not
// counted.

const inflightHolds = 1 << 15

type inflight struct {
	tokens [kvindex.MaxEngines]paddedInt64
	mu     sync.Mutex
	free   []*tokenHold
}

type paddedInt64 struct {
	atomic.Int64
	_ [56]byte
}

type tokenHold struct {
	f      *inflight
	id     kvindex.EngineID
	tokens int64
	done   func()
}

func (f *inflight) init() {
	holds := make([]tokenHold, inflightHolds)
	f.free = make([]*tokenHold, 0, inflightHolds)
	for i := range holds {
		h := &holds[i]
		h.f = f
		h.done = h.release
		f.free = append(f.free, h)
	}
}

// hold adds tokens to engine id until the returned Done is called (nil:
// the pool is empty, nothing counted).
func (f *inflight) hold(id kvindex.EngineID, tokens int) func() {
	if tokens <= 0 || int(id) >= len(f.tokens) {
		return nil
	}
	f.mu.Lock()
	n := len(f.free)
	if n == 0 {
		f.mu.Unlock()
		return nil
	}
	h := f.free[n-1]
	f.free = f.free[:n-1]
	f.mu.Unlock()
	h.id, h.tokens = id, int64(tokens)
	f.tokens[id].Add(h.tokens)
	return h.done
}

func (h *tokenHold) release() {
	f := h.f
	f.tokens[h.id].Add(-h.tokens)
	h.tokens = 0
	f.mu.Lock()
	f.free = append(f.free, h)
	f.mu.Unlock()
}

// get returns the tokens in flight on engine id.
func (f *inflight) get(id kvindex.EngineID) float64 {
	if int(id) >= len(f.tokens) {
		return 0
	}
	return float64(max(f.tokens[id].Load(), 0))
}
