package fakepd

// The engines' service model, so that a load run on fake engines means
// something (all of it off by default):
//
//   - a prefix cache on every engine that computes prompts (prefills, and
//     an engine serving whole requests as a regular worker): an LRU of
//     Options.BlockTokens-token blocks, chained hashes of the prompt's
//     full blocks, Options.CacheTokens in all; a prompt's cached tokens
//     are its leading blocks found there (Stats.PromptTokens,
//     Stats.CachedTokens);
//   - compute: Options.PrefillPerToken for each uncached prompt token,
//     at most Options.MaxPrefill prompts at once (the others wait: a
//     compute-bound prefill), and Options.TokenDelay for each decoded
//     token, at most Options.MaxRunning requests decoding at once (the
//     others wait for a slot, holding their KV: a decode's batch);
//   - weight versions: a prefill records the version its KV was computed
//     at and hands it to the decode with the KV (the bootstrap server's
//     answer, the NIXL pull's); a decode tags each token with its own
//     version at that token. An answer lists the distinct versions in
//     order (the prefill's first): meta_info.weight_versions for
//     /generate, weight_versions at the top of an OpenAI answer;
//     Stats.MixedVersionOutputs counts the answers with more than one;
//   - a paused engine: a generation request that arrives is counted
//     (Stats.ParkedWhilePaused) and waits for the resume; a decode stops
//     between tokens while paused (a pause that keeps what runs), and an
//     abort (by rid, abort all, or a pause in abort mode) ends a running
//     decode with its partial output and finish reason abort.

import (
	"container/list"
	"context"
	"errors"
	"hash/fnv"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// prefixCache is an LRU of prompt blocks, by their chained hash.
type prefixCache struct {
	mu     sync.Mutex
	block  int
	cap    int // blocks; 0: no cache
	lru    *list.List
	blocks map[uint64]*list.Element
	// publish sends the cache's changes as KV events (kvevents.go; nil:
	// none), called with mu held.
	publish func([]kvevents.Event)
}

func newPrefixCache(tokens, block int) *prefixCache {
	return &prefixCache{block: block, cap: tokens / block, lru: list.New(), blocks: map[uint64]*list.Element{}}
}

// take returns how many leading tokens of prompt were cached, and caches
// all its full blocks (the most recent first in the LRU).
func (c *prefixCache) take(prompt []int) int {
	if c == nil || c.cap == 0 {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	h := fnv.New64a()
	var buf [8]byte
	cached, hit := 0, true
	var touched []*list.Element
	var hashes []uint64 // every full block's, for the events
	var news []int      // the blocks new in the cache
	defer func() {
		// The prompt's first block the most recent: a prefix outlives
		// its extensions, as in a radix cache that evicts leaves first.
		for i := len(touched) - 1; i >= 0; i-- {
			c.lru.MoveToFront(touched[i])
		}
		var evicted []uint64
		for c.lru.Len() > c.cap {
			last := c.lru.Back()
			delete(c.blocks, last.Value.(uint64))
			c.lru.Remove(last)
			if c.publish != nil {
				evicted = append(evicted, last.Value.(uint64))
			}
		}
		if c.publish != nil {
			c.publish(blockEvents(prompt, c.block, hashes, news, evicted))
		}
	}()
	for i := 0; i+c.block <= len(prompt); i += c.block {
		for _, t := range prompt[i : i+c.block] {
			v := uint64(t)
			for k := range buf {
				buf[k] = byte(v >> (8 * k))
			}
			h.Write(buf[:])
		}
		key := h.Sum64()
		hashes = append(hashes, key)
		e, ok := c.blocks[key]
		if ok && hit {
			cached += c.block
		}
		if !ok {
			hit = false
			news = append(news, i/c.block)
			e = c.lru.PushFront(key)
			c.blocks[key] = e
		}
		touched = append(touched, e)
	}
	return cached
}

// slots bounds how many at once; nil: unbounded.
type slots chan struct{}

func newSlots(n int) slots {
	if n <= 0 {
		return nil
	}
	return make(slots, n)
}

func (s slots) acquire(ctx context.Context) bool {
	if s == nil {
		return ctx.Err() == nil
	}
	select {
	case s <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (s slots) release() {
	if s != nil {
		<-s
	}
}

// compute prefills prompt: it waits for a prefill slot, looks the prompt
// up in the prefix cache and computes its uncached tokens. It returns the
// cached tokens and the version the KV was computed at; false if ctx
// ended first.
func (s *server) compute(ctx context.Context, prompt []int) (cached int, version string, ok bool) {
	if !s.prefillSlots.acquire(ctx) {
		return 0, "", false
	}
	defer s.prefillSlots.release()
	cached = s.cache.take(prompt)
	d := s.opts.PrefillDelay + time.Duration(len(prompt)-cached)*s.opts.PrefillPerToken + s.slow()
	if !sleep(ctx, d) {
		return 0, "", false
	}
	s.Stats.PromptTokens.Add(int64(len(prompt)))
	s.Stats.CachedTokens.Add(int64(cached))
	return cached, s.WeightVersion(), true
}

// admit counts a generation request that arrives while the engine is
// paused and waits for the resume; false if ctx ended first.
func (s *server) admit(ctx context.Context) bool {
	s.mu.Lock()
	paused := s.ctl.paused
	s.mu.Unlock()
	if paused {
		s.Stats.ParkedWhilePaused.Add(1)
	}
	return s.serving(ctx)
}

// serving waits while the engine is paused; false if ctx ended first.
func (s *server) serving(ctx context.Context) bool {
	for {
		s.mu.Lock()
		if !s.ctl.paused {
			s.mu.Unlock()
			return ctx.Err() == nil
		}
		if s.ctl.resumed == nil {
			s.ctl.resumed = make(chan struct{})
		}
		ch := s.ctl.resumed
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return false
		}
	}
}

// errAborted ends a decode that was aborted (not one whose client left).
var errAborted = errors.New("fakepd: aborted")

// tracked is a request /abort_request, /abort_requests and a pause can end.
type tracked struct {
	cancel  context.CancelFunc
	aborted bool // under server.mu
	nth     int  // the rid's nth request (Tracking)
}

// wasAborted reports whether the engine aborted t (not a kill, a
// timeout or its client).
func (s *server) wasAborted(t *tracked) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return t.aborted
}

// abortLocked aborts t; s.mu held.
func abortLocked(t *tracked) {
	t.aborted = true
	t.cancel()
}

// decoding is what a decode tells answer: the versions before its tokens
// (the prefill's) and the prompt tokens the prefill had cached.
type decoding struct {
	before []string
	cached int
}

// out is one answer's decoding: a slot, the pause, an abort, versions.
type out struct {
	s        *server
	ctx      context.Context
	tr       *tracked
	versions []string
	aborted  bool
}

func (s *server) newOut(ctx context.Context, tr *tracked, dec decoding) *out {
	o := &out{s: s, ctx: ctx, tr: tr, versions: []string{}}
	for _, v := range dec.before {
		o.tag(v)
	}
	return o
}

func (o *out) tag(v string) {
	if n := len(o.versions); n == 0 || o.versions[n-1] != v {
		o.versions = append(o.versions, v)
	}
}

// step decodes one token: it waits while the engine is paused, then the
// token's time, and tags it with the engine's version. errAborted if the
// engine aborted it, ctx's error if it ended otherwise.
func (o *out) step() error {
	if o.s.serving(o.ctx) && sleep(o.ctx, o.s.opts.TokenDelay) {
		o.tag(o.s.WeightVersion())
		return nil
	}
	if o.tr != nil && o.s.wasAborted(o.tr) {
		o.aborted = true
		return errAborted
	}
	return o.ctx.Err()
}

// done counts an answer that ends with more than one version.
func (o *out) done() {
	if len(o.versions) > 1 {
		o.s.Stats.MixedVersionOutputs.Add(1)
	}
}

// handoffAnswer is what a prefill's side channel answers a decode that
// takes its KV: the version it was computed at and the cached tokens.
type handoffAnswer struct {
	WeightVersion string `json:"weight_version"`
	CachedTokens  int    `json:"cached_tokens"`
}

func ridKey(rid string, n uint64) string {
	if rid != "" {
		return rid
	}
	return "#" + strconv.FormatUint(n, 10)
}

// serveWhole serves g whole, as a regular engine does: parked while
// paused, its prompt computed (prefix cache), decoded in a slot. An abort
// before its first token answers finish abort with no output.
func (s *server) serveWhole(w http.ResponseWriter, r *http.Request, g *genRequest) {
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	tr, untrack := s.track(g.rid, cancel)
	defer untrack()
	cached, version, ok := 0, "", s.admit(ctx)
	if ok {
		cached, version, ok = s.compute(ctx, g.prompt)
	}
	if ok && s.decodeSlots.acquire(ctx) {
		defer s.decodeSlots.release()
	} else {
		ok = false
	}
	if !ok && !s.wasAborted(tr) {
		s.Stats.Aborted.Add(1)
		return
	}
	dec := decoding{before: []string{version}}
	if !ok {
		dec.before = nil
	}
	o := s.newOut(ctx, tr, dec)
	if answer(ctx, w, g, g.maxNew, o, cached, nil) {
		s.Stats.Served.Add(1)
	} else {
		s.Stats.Aborted.Add(1)
	}
}
