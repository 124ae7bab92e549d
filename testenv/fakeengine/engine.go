package fakeengine

import (
	"container/list"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/userspace/kvevents"
)

// Kind is the engine an Engine imitates.
type Kind int

const (
	SGLang Kind = iota
	VLLM
)

func (k Kind) String() string {
	switch k {
	case SGLang:
		return "sglang"
	case VLLM:
		return "vllm"
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// ParseKind parses "sglang" or "vllm" (case-insensitive).
func ParseKind(s string) (Kind, error) {
	switch strings.ToLower(s) {
	case "sglang":
		return SGLang, nil
	case "vllm":
		return VLLM, nil
	}
	return 0, fmt.Errorf("fakeengine: unknown kind %q (sglang or vllm)", s)
}

// LoadMode says how the load endpoints (/v1/loads, /get_load, /metrics)
// answer.
type LoadMode int32

const (
	LoadOK      LoadMode = iota // the truth
	LoadTimeout                 // hang until the client gives up (or the engine closes)
	LoadLie                     // report an idle engine: zero requests, usage and hit rate
	LoadNone                    // 404, as an engine without the endpoint
)

// Config configures an Engine. Zero fields take the defaults below.
type Config struct {
	Kind            Kind
	Name            string          // in logs and answers (the model name); default "fake-<kind>"
	KVBlocks        int             // paged KV capacity in blocks (default 2048)
	BlockTokens     int             // tokens per block (default 16)
	MaxRunning      int             // running batch size cap (default 64); beyond: waiting queue
	PrefillPerToken time.Duration   // simulated compute per uncached prompt token (default 2µs)
	DecodeStep      time.Duration   // one decode step for the whole running batch (default 2ms)
	WeightVersion   string          // initial version (default "v0")
	UpdateDelay     time.Duration   // how long an update takes (default 50ms)
	APIKey          string          // when set, require "Authorization: Bearer KEY"
	KVEvents        *KVEventsConfig // publish KV-cache events (kvevents.go); nil: none
	Log             *slog.Logger    // default: discard
}

func (c *Config) defaults() {
	if c.Name == "" {
		c.Name = "fake-" + c.Kind.String()
	}
	if c.KVBlocks <= 0 {
		c.KVBlocks = 2048
	}
	if c.BlockTokens <= 0 {
		c.BlockTokens = 16
	}
	if c.MaxRunning <= 0 {
		c.MaxRunning = 64
	}
	if c.PrefillPerToken <= 0 {
		c.PrefillPerToken = 2 * time.Microsecond
	}
	if c.DecodeStep <= 0 {
		c.DecodeStep = 2 * time.Millisecond
	}
	if c.WeightVersion == "" {
		c.WeightVersion = "v0"
	}
	if c.UpdateDelay <= 0 {
		c.UpdateDelay = 50 * time.Millisecond
	}
	if c.Log == nil {
		c.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
}

// Stats is a snapshot of an Engine's counters and gauges.
type Stats struct {
	// Requests counts the generation requests that entered the scheduler
	// (parsed, past the SGLang gate); Completed those that finished by
	// length; Aborted those that ended early (abort, pause abort, the
	// client gone, Close, Kill).
	Requests, Completed, Aborted int64
	// ParkedWhilePaused counts the requests that arrived while the engine
	// was paused and had to wait inside it (vLLM parks them in waiting;
	// SGLang holds them at its pause gate).
	ParkedWhilePaused int64
	// HeldForUpdate counts the SGLang requests that arrived while an
	// unpaused weight update held the writer lock and waited for it.
	HeldForUpdate int64
	// MixedVersionOutputs counts the outputs whose tokens were generated
	// under more than one weight version.
	MixedVersionOutputs int64
	// Prompt tokens seen at each admission (a recompute after a preemption
	// counts again), those found in the prefix cache, and those computed:
	// PrefillTokens = PromptTokens - CachedTokens.
	PromptTokens, CachedTokens, PrefillTokens int64
	// GeneratedTokens counts the output tokens decoded.
	GeneratedTokens int64
	// RoutedRanks counts the SGLang requests that named a data-parallel
	// rank (routed_dp_rank, as a DP-aware router pins one), by rank.
	RoutedRanks [MaxDPRanks]int64
	// Preemptions counts the running requests retracted to waiting because
	// the KV cache ran out during decode (their blocks freed, recomputed
	// later).
	Preemptions int64
	// KVUsage is the fraction of KV blocks held by requests now (evictable
	// prefix-cache blocks not counted, as both engines report it);
	// PeakKVUsage its highest value.
	KVUsage, PeakKVUsage float64
	// CachedBlocks is the number of blocks in the prefix cache (held or
	// evictable).
	CachedBlocks int
	// Running (the running batch, frozen ones included), Waiting (the
	// scheduler's waiting queue, vLLM's parked requests included) and Gated
	// (SGLang requests held at the pause gate or by an update's writer
	// lock, not yet in the scheduler).
	Running, Waiting, Gated int
	Updates, FailedUpdates  int64
	Pauses, Resumes         int64
	// Flushes counts the prefix-cache flushes that took effect
	// (flush_cache, reset_prefix_cache, pause with clear_cache).
	Flushes int64
	// FlushRefused counts SGLang flush_cache calls refused (400) because
	// requests were running or waiting.
	FlushRefused int64
}

// request is one generation in the engine.
type request struct {
	rid    string
	prompt []int
	maxNew int
	seed   uint64
	phash  uint64

	out  []int
	vers []string // weight version of each output token

	parked  bool // vLLM: arrived while paused, waits for /resume
	running bool
	ended   bool
	finish  string // "length" or "abort"
	cached  int    // prompt tokens found in the prefix cache at the first admission
	admits  int
	epoch   uint64   // cache epoch of its blocks
	shared  []uint64 // prefix-cache entries it holds a reference on
	private int      // blocks it holds alone
	seq     uint64   // admission order, for "newest"

	done   chan struct{} // closed when it ends
	notify chan struct{} // a token or the end, cap 1
}

func (r *request) tokens() []int {
	s := make([]int, 0, len(r.prompt)+len(r.out))
	return append(append(s, r.prompt...), r.out...)
}

func (r *request) poke() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// versions returns the distinct versions of the output, in order.
func versionsOf(vers []string) []string {
	out := []string{}
	for i, v := range vers {
		if (i == 0 || vers[i-1] != v) && !contains(out, v) {
			out = append(out, v)
		}
	}
	return out
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// centry is one prefix-cache block.
type centry struct {
	hash  uint64
	ref   int
	epoch uint64
	elem  *list.Element // in lru while ref == 0
}

// Engine is one fake inference engine: an http.Handler with its own
// scheduler goroutine. Build one with New (then Serve) or Start.
type Engine struct {
	cfg Config
	log *slog.Logger

	mu        sync.Mutex
	version   string
	waiting   []*request
	running   []*request
	byID      map[string]*request
	paused    bool
	pauseMode string
	holds     int           // SGLang updates holding the writer lock
	gate      chan struct{} // SGLang: closed when the gate opens; nil while open
	gated     int
	updating  int // updates in progress: the scheduler does not step
	sleeping  bool
	staging   bool   // vLLM: start_weight_update seen, finish pending
	staged    string // vLLM: version named during staging
	changed   chan struct{}
	closing   bool

	// KV
	cache     map[uint64]*centry
	lru       *list.List
	inUse     int
	evictable int
	epoch     uint64
	seq       uint64
	ridN      uint64
	pub       *kvevents.Publisher // KV-cache events (kvevents.go)
	quiet     bool                // no events (Restart)
	evicted   []uint64            // blocks evicted by the current allocation

	st       Stats
	lastBody map[string][]byte
	pqueries int64 // vLLM prefix_cache_queries_total
	phits    int64

	failUpdates atomic.Bool
	loadMode    atomic.Int32

	wake      chan struct{}
	quit      chan struct{}
	quitOnce  sync.Once
	schedDone chan struct{}
	closeOnce sync.Once
	stopping  chan struct{} // closed when Close or Kill begins

	srv    *http.Server
	ln     net.Listener
	url    string
	served chan struct{}
	connMu sync.Mutex
	conns  map[net.Conn]struct{}
}

// New returns an Engine with its scheduler running. It serves nothing by
// itself: it is an http.Handler (Serve, or any http.Server, serves it).
func New(cfg Config) *Engine {
	cfg.defaults()
	e := &Engine{
		cfg:       cfg,
		log:       cfg.Log.With("engine", cfg.Name, "kind", cfg.Kind.String()),
		version:   cfg.WeightVersion,
		byID:      map[string]*request{},
		changed:   make(chan struct{}),
		cache:     map[uint64]*centry{},
		lru:       list.New(),
		lastBody:  map[string][]byte{},
		wake:      make(chan struct{}, 1),
		quit:      make(chan struct{}),
		schedDone: make(chan struct{}),
		stopping:  make(chan struct{}),
		conns:     map[net.Conn]struct{}{},
	}
	if err := e.startEvents(); err != nil {
		e.log.Error("kv events: no publisher", "err", err)
	}
	go e.loop()
	return e
}

// Start serves a new Engine on 127.0.0.1 on a free port.
func Start(cfg Config) (*Engine, error) { return StartAt(cfg, "127.0.0.1:0") }

// StartAt serves a new Engine on addr.
func StartAt(cfg Config, addr string) (*Engine, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	e := New(cfg)
	e.serve(ln)
	return e, nil
}

// StartFleet starts n engines configured by cfg, named "<Name>-<i>"
// ("fake-<kind>-<i>" by default). On error it closes those it started.
func StartFleet(n int, cfg Config) ([]*Engine, error) {
	base := cfg.Name
	if base == "" {
		base = "fake-" + cfg.Kind.String()
	}
	out := make([]*Engine, 0, n)
	for i := 0; i < n; i++ {
		c := cfg
		c.Name = base + "-" + strconv.Itoa(i)
		e, err := Start(c)
		if err != nil {
			for _, x := range out {
				x.Close()
			}
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

// Serve serves the engine on ln until Close or Kill; it returns nil then.
func (e *Engine) Serve(ln net.Listener) error {
	e.serve(ln)
	<-e.served
	return nil
}

func (e *Engine) serve(ln net.Listener) {
	e.ln = ln
	e.url = "http://" + ln.Addr().String()
	e.served = make(chan struct{})
	e.srv = &http.Server{
		Handler:           e,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          nil,
		ConnState: func(c net.Conn, s http.ConnState) {
			e.connMu.Lock()
			defer e.connMu.Unlock()
			switch s {
			case http.StateNew:
				e.conns[c] = struct{}{}
			case http.StateClosed, http.StateHijacked:
				delete(e.conns, c)
			}
		},
	}
	go func() {
		defer close(e.served)
		if err := e.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			e.log.Error("serve", "err", err)
		}
	}()
	e.log.Info("fake engine serving", "url", e.url)
}

// URL returns http://host:port (empty for an Engine not served by Serve or
// Start).
func (e *Engine) URL() string { return e.url }

// Addr returns host:port.
func (e *Engine) Addr() string { return strings.TrimPrefix(e.url, "http://") }

// Kind returns the engine kind.
func (e *Engine) Kind() Kind { return e.cfg.Kind }

// Name returns the engine's name.
func (e *Engine) Name() string { return e.cfg.Name }

// Close shuts the engine down gracefully: no new requests (503), requests
// that cannot progress (parked, gated, frozen by a pause, or asleep) are
// aborted, running ones finish (within 5 s), then the listener and the
// scheduler stop. It is idempotent and safe after Kill.
func (e *Engine) Close() {
	e.closeOnce.Do(func() {
		close(e.stopping)
		e.mu.Lock()
		e.closing = true
		stuck := e.paused || e.sleeping
		for _, r := range append(append([]*request(nil), e.running...), e.waiting...) {
			if stuck || r.parked {
				e.finishLocked(r, "abort")
			}
		}
		e.broadcastLocked()
		e.mu.Unlock()
		if e.srv != nil {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			if err := e.srv.Shutdown(ctx); err != nil {
				e.srv.Close()
			}
			cancel()
			<-e.served
		}
		e.stop()
	})
}

// Kill stops the engine abruptly: the listener and every connection close
// now, in-flight requests get no answer, the scheduler stops. Stats stay
// readable.
func (e *Engine) Kill() {
	e.closeOnce.Do(func() {
		close(e.stopping)
		e.mu.Lock()
		e.closing = true
		e.mu.Unlock()
		if e.srv != nil {
			// The listener and every connection first: no answer goes out.
			e.srv.Close()
			e.connMu.Lock()
			for c := range e.conns {
				c.Close()
			}
			e.connMu.Unlock()
		}
		e.stop()
		e.mu.Lock()
		for _, r := range append(append([]*request(nil), e.running...), e.waiting...) {
			e.finishLocked(r, "abort")
		}
		e.broadcastLocked()
		e.mu.Unlock()
		if e.srv != nil {
			<-e.served
		}
	})
}

func (e *Engine) stop() {
	e.quitOnce.Do(func() { close(e.quit) })
	<-e.schedDone
	if e.pub != nil {
		e.pub.Close()
	}
}

// SetFailUpdates makes weight updates answer 500 (and change nothing)
// while on.
func (e *Engine) SetFailUpdates(on bool) { e.failUpdates.Store(on) }

// SetLoadMode sets how the load endpoints answer.
func (e *Engine) SetLoadMode(m LoadMode) { e.loadMode.Store(int32(m)) }

// WeightVersion returns the weight version in effect.
func (e *Engine) WeightVersion() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.version
}

// Paused reports whether the engine is paused (SGLang pause_generation,
// vLLM /pause).
func (e *Engine) Paused() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.paused
}

// LastBody returns a copy of the body of the last request to path (any
// method), nil if none came.
func (e *Engine) LastBody(path string) []byte {
	e.mu.Lock()
	defer e.mu.Unlock()
	b, ok := e.lastBody[path]
	if !ok {
		return nil
	}
	return append([]byte{}, b...)
}

// Stats returns a snapshot of the counters and gauges.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.st
	s.KVUsage = e.usageLocked()
	s.Running = len(e.running)
	s.Waiting = len(e.waiting)
	s.Gated = e.gated
	s.CachedBlocks = len(e.cache)
	return s
}

// Reset aborts every request, clears the prefix cache, unpauses, wakes
// and zeroes the counters (the weight version stays).
func (e *Engine) Reset() {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, r := range append(append([]*request(nil), e.running...), e.waiting...) {
		e.finishLocked(r, "abort")
	}
	e.paused, e.pauseMode, e.sleeping, e.staging = false, "", false, false
	e.dropCacheLocked()
	e.gateLocked()
	e.st = Stats{}
	e.pqueries, e.phits = 0, 0
	e.broadcastLocked()
	e.kick()
}

// --- scheduler ---

func (e *Engine) kick() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// broadcastLocked wakes whoever waits for a change of state.
func (e *Engine) broadcastLocked() {
	close(e.changed)
	e.changed = make(chan struct{})
}

// waitLocked waits (unlocking e.mu meanwhile) until cond holds, ctx ends or
// the engine stops; it returns whether cond holds.
func (e *Engine) waitLocked(ctx context.Context, cond func() bool) bool {
	for !cond() {
		ch := e.changed
		e.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			e.mu.Lock()
			return cond()
		case <-e.quit:
			e.mu.Lock()
			return cond()
		}
		e.mu.Lock()
	}
	return true
}

// eligibleLocked says whether the scheduler may work on r now.
func (e *Engine) eligibleLocked(r *request) bool {
	if e.sleeping || e.updating > 0 {
		return false
	}
	if !e.paused {
		return true
	}
	// vLLM mode=wait drains what came before the pause.
	return e.cfg.Kind == VLLM && e.pauseMode == "wait" && !r.parked
}

func (e *Engine) loop() {
	defer close(e.schedDone)
	t := time.NewTimer(time.Hour)
	t.Stop()
	for {
		e.mu.Lock()
		prefill, work := e.admitLocked()
		e.mu.Unlock()
		if !work {
			select {
			case <-e.wake:
				continue
			case <-e.quit:
				return
			}
		}
		end := time.Now().Add(e.cfg.DecodeStep + time.Duration(prefill)*e.cfg.PrefillPerToken)
		t.Reset(time.Until(end))
	step:
		for {
			select {
			case <-t.C:
				break step
			case <-e.wake:
				// Arrivals join the batch during the step (they decode at
				// its end), as a long step would not make them wait a
				// whole step more; their prefill lengthens the step, for
				// the whole batch, as it would on an engine.
				e.mu.Lock()
				n, _ := e.admitLocked()
				e.mu.Unlock()
				if n > 0 {
					end = end.Add(time.Duration(n) * e.cfg.PrefillPerToken)
					if !t.Stop() {
						select {
						case <-t.C:
						default:
						}
					}
					t.Reset(time.Until(end))
				}
			case <-e.quit:
				t.Stop()
				return
			}
		}
		e.mu.Lock()
		e.decodeLocked()
		e.mu.Unlock()
	}
}

// admitLocked moves waiting requests (FIFO) into the running batch while a
// slot and the KV blocks for their tokens are free. It returns the tokens
// to prefill and whether there is a step to run.
func (e *Engine) admitLocked() (prefill int, work bool) {
	for i := 0; i < len(e.waiting) && len(e.running) < e.cfg.MaxRunning; {
		r := e.waiting[i]
		if !e.eligibleLocked(r) {
			i++
			continue
		}
		n, ok := e.allocLocked(r)
		if !ok {
			break // the head waits for blocks: FIFO
		}
		prefill += n
		e.waiting = append(e.waiting[:i], e.waiting[i+1:]...)
		e.seq++
		r.seq = e.seq
		r.running = true
		e.running = append(e.running, r)
	}
	for _, r := range e.running {
		if e.eligibleLocked(r) {
			work = true
			break
		}
	}
	if u := e.usageLocked(); u > e.st.PeakKVUsage {
		e.st.PeakKVUsage = u
	}
	return prefill, work
}

// decodeLocked decodes one token for every eligible running request.
func (e *Engine) decodeLocked() {
	for i := 0; i < len(e.running); i++ {
		r := e.running[i]
		if !e.eligibleLocked(r) {
			continue
		}
		// Room for one more token.
		bt := e.cfg.BlockTokens
		if len(r.prompt)+len(r.out)+1 > (len(r.shared)+r.private)*bt {
			for !e.allocBlocksLocked(1) {
				v := e.newestRunningLocked()
				e.preemptLocked(v)
				if v == r {
					break
				}
			}
			if !r.running {
				i-- // r left the batch: the next one is at i now
				continue
			}
			r.private++
		}
		pos := len(r.out)
		r.out = append(r.out, outToken(r.phash, r.seed, pos))
		r.vers = append(r.vers, e.version)
		e.st.GeneratedTokens++
		if len(r.out) >= r.maxNew {
			e.finishLocked(r, "length")
			i--
			continue
		}
		r.poke()
	}
	if u := e.usageLocked(); u > e.st.PeakKVUsage {
		e.st.PeakKVUsage = u
	}
	e.broadcastLocked()
}

func (e *Engine) newestRunningLocked() *request {
	var v *request
	for _, r := range e.running {
		if v == nil || r.seq > v.seq {
			v = r
		}
	}
	return v
}

// preemptLocked retracts a running request to the front of the waiting
// queue and frees its blocks (what it computed stays in the prefix cache).
func (e *Engine) preemptLocked(r *request) {
	e.removeRunningLocked(r)
	e.releaseLocked(r)
	r.running = false
	e.waiting = append([]*request{r}, e.waiting...)
	e.st.Preemptions++
	e.log.Debug("preempted", "rid", r.rid, "tokens", len(r.prompt)+len(r.out))
}

func (e *Engine) removeRunningLocked(r *request) {
	for i, x := range e.running {
		if x == r {
			e.running = append(e.running[:i], e.running[i+1:]...)
			return
		}
	}
}

func (e *Engine) removeWaitingLocked(r *request) {
	for i, x := range e.waiting {
		if x == r {
			e.waiting = append(e.waiting[:i], e.waiting[i+1:]...)
			return
		}
	}
}

// enqueueLocked puts a new request in the waiting queue.
func (e *Engine) enqueueLocked(r *request) {
	e.byID[r.rid] = r
	e.waiting = append(e.waiting, r)
	e.st.Requests++
	e.kick()
}

// finishLocked ends r (running or waiting) with reason.
func (e *Engine) finishLocked(r *request, reason string) {
	if r.ended {
		return
	}
	if r.running {
		e.removeRunningLocked(r)
		e.releaseLocked(r)
		r.running = false
	} else {
		e.removeWaitingLocked(r)
	}
	r.ended = true
	r.finish = reason
	if e.byID[r.rid] == r {
		delete(e.byID, r.rid)
	}
	if reason == "abort" {
		e.st.Aborted++
	} else {
		e.st.Completed++
	}
	if len(versionsOf(r.vers)) > 1 {
		e.st.MixedVersionOutputs++
	}
	close(r.done)
	e.kick()
}

// abortLocked aborts requests by id (all of them when all), among the
// scheduler's; it returns the ids aborted. withParked says whether vLLM's
// parked requests are reached too.
func (e *Engine) abortLocked(ids []string, all bool) []string {
	out := []string{}
	for _, r := range append(append([]*request(nil), e.running...), e.waiting...) {
		if all || contains(ids, r.rid) {
			out = append(out, r.rid)
			e.finishLocked(r, "abort")
		}
	}
	e.broadcastLocked()
	return out
}

// --- KV cache ---

func (e *Engine) usageLocked() float64 {
	return float64(e.inUse) / float64(e.cfg.KVBlocks)
}

func (e *Engine) freeLocked() int { return e.cfg.KVBlocks - e.inUse - e.evictable }

// allocBlocksLocked takes n blocks, evicting LRU prefix-cache blocks as
// needed; false (nothing taken) if they are not there.
func (e *Engine) allocBlocksLocked(n int) bool {
	if e.freeLocked()+e.evictable < n {
		return false
	}
	for e.freeLocked() < n {
		c := e.lru.Front().Value.(*centry)
		e.evictLocked(c)
		if e.pub != nil {
			e.evicted = append(e.evicted, c.hash)
		}
	}
	if len(e.evicted) > 0 {
		e.publishLocked(kvevents.Event{Kind: kvevents.Removed, Hashes: e.evicted, Medium: "GPU"})
		e.evicted = e.evicted[:0]
	}
	e.inUse += n
	return true
}

func (e *Engine) evictLocked(c *centry) {
	e.lru.Remove(c.elem)
	c.elem = nil
	e.evictable--
	delete(e.cache, c.hash)
}

func (e *Engine) refLocked(c *centry) {
	if c.ref == 0 {
		e.lru.Remove(c.elem)
		c.elem = nil
		e.evictable--
		e.inUse++
	}
	c.ref++
}

func (e *Engine) unrefLocked(h uint64) {
	c := e.cache[h]
	if c == nil {
		return
	}
	c.ref--
	if c.ref > 0 {
		return
	}
	e.inUse--
	if c.epoch != e.epoch {
		delete(e.cache, h) // stale KV: freed
		return
	}
	e.evictable++
	c.elem = e.lru.PushBack(c)
}

// allocLocked admits r's tokens into the KV cache: the longest chain of its
// full blocks already cached is shared, the rest allocated (full blocks
// enter the cache at once, so a request admitted later shares them). It
// returns the tokens to compute, false if the blocks are not there.
func (e *Engine) allocLocked(r *request) (int, bool) {
	toks := r.tokens()
	bt := e.cfg.BlockTokens
	full := len(toks) / bt
	need := (len(toks) + bt - 1) / bt
	hashes := chainHashes(toks, bt, e.epoch)
	m := 0
	for m < full && e.cache[hashes[m]] != nil {
		m++
	}
	if m*bt >= len(toks) && m > 0 {
		m-- // at least one token is computed
	}
	for _, h := range hashes[:m] {
		e.refLocked(e.cache[h])
	}
	// Full blocks past the match that happen to be cached (a chain whose
	// head was evicted) are shared too, but computed: not a hit.
	var held []uint64
	fresh := need - full
	for _, h := range hashes[m:full] {
		if c := e.cache[h]; c != nil {
			e.refLocked(c)
			held = append(held, h)
		} else {
			fresh++
		}
	}
	if !e.allocBlocksLocked(fresh) {
		for _, h := range hashes[:m] {
			e.unrefLocked(h)
		}
		for _, h := range held {
			e.unrefLocked(h)
		}
		return 0, false
	}
	r.epoch = e.epoch
	r.shared = append(r.shared[:0], hashes[:full]...)
	r.private = need - full
	var stored []int
	for i := m; i < full; i++ {
		if h := hashes[i]; e.cache[h] == nil {
			e.cache[h] = &centry{hash: h, ref: 1, epoch: e.epoch}
			stored = append(stored, i)
		}
	}
	e.storedLocked(toks, hashes, stored)
	cached := m * bt
	e.st.PromptTokens += int64(len(toks))
	e.st.CachedTokens += int64(cached)
	e.st.PrefillTokens += int64(len(toks) - cached)
	e.pqueries += int64(len(toks))
	e.phits += int64(cached)
	if r.admits == 0 {
		r.cached = cached
	}
	r.admits++
	return len(toks) - cached, true
}

// releaseLocked gives r's blocks back: shared ones lose a reference, the
// full blocks it computed alone enter the prefix cache (evictable) unless
// the cache was flushed or the weights changed since, the rest is freed.
//
// The blocks enter the LRU from the chain's tail to its root, so that
// the tail goes first (vLLM frees a request's blocks in reverse order;
// SGLang's radix cache evicts leaves): an eviction shortens a context
// instead of taking its root and with it every block after.
func (e *Engine) releaseLocked(r *request) {
	if r.epoch == e.epoch && r.private > 0 {
		toks := r.tokens()
		bt := e.cfg.BlockTokens
		full := len(toks) / bt
		// The chain of the shared part is needed to extend it.
		hashes := chainHashes(toks, bt, e.epoch)
		var stored []int
		for i := len(r.shared); i < full && r.private > 0; i++ {
			if e.cache[hashes[i]] != nil {
				continue
			}
			e.cache[hashes[i]] = &centry{hash: hashes[i], epoch: e.epoch}
			r.private--
			e.inUse--
			e.evictable++
			stored = append(stored, i)
		}
		for k := len(stored) - 1; k >= 0; k-- {
			c := e.cache[hashes[stored[k]]]
			c.elem = e.lru.PushBack(c)
		}
		e.storedLocked(toks, hashes, stored)
	}
	for i := len(r.shared) - 1; i >= 0; i-- {
		e.unrefLocked(r.shared[i])
	}
	e.inUse -= r.private
	r.private = 0
	r.shared = r.shared[:0]
}

// dropCacheLocked forgets the prefix cache: evictable blocks are freed,
// blocks held by requests are freed when they let go (a new epoch).
func (e *Engine) dropCacheLocked() {
	for e.lru.Len() > 0 {
		e.evictLocked(e.lru.Front().Value.(*centry))
	}
	e.epoch++
	e.publishLocked(kvevents.Event{Kind: kvevents.Cleared})
}

// --- pause, update ---

// gateLocked opens or closes the SGLang gate to match the state.
func (e *Engine) gateLocked() {
	shut := e.cfg.Kind == SGLang && (e.paused || e.holds > 0)
	if shut && e.gate == nil {
		e.gate = make(chan struct{})
	}
	if !shut && e.gate != nil {
		close(e.gate)
		e.gate = nil
	}
}

// nextVersionLocked names the version an update without a name brings:
// "v<N+1>" after "v<N>", else "v<updates+1>".
func (e *Engine) nextVersionLocked() string {
	if n, err := strconv.Atoi(strings.TrimPrefix(e.version, "v")); err == nil && strings.HasPrefix(e.version, "v") && n >= 0 {
		return "v" + strconv.Itoa(n+1)
	}
	return "v" + strconv.FormatInt(e.st.Updates+1, 10)
}

var errUpdateFailed = errors.New("weight update failed (SetFailUpdates)")

// update runs a weight update: SGLang without a pause first takes the
// writer lock (new requests held at the gate, in-flight ones drained); the
// scheduler does not step while the update takes UpdateDelay; then the
// version changes and the prefix cache is dropped. apply false only
// spends the time (vLLM's update_weights inside start/finish).
func (e *Engine) update(ctx context.Context, version string, apply bool) (string, error) {
	if e.failUpdates.Load() {
		e.mu.Lock()
		e.st.FailedUpdates++
		e.mu.Unlock()
		return "", errUpdateFailed
	}
	e.mu.Lock()
	writer := e.cfg.Kind == SGLang && !e.paused
	if writer {
		e.holds++
		e.gateLocked()
		ok := e.waitLocked(ctx, func() bool { return len(e.running) == 0 && len(e.waiting) == 0 })
		if !ok {
			e.holds--
			e.gateLocked()
			e.mu.Unlock()
			return "", errors.New("update abandoned: " + context.Cause(ctx).Error())
		}
	}
	e.updating++
	e.mu.Unlock()

	t := time.NewTimer(e.cfg.UpdateDelay)
	select {
	case <-t.C:
	case <-e.quit:
		t.Stop()
	}

	e.mu.Lock()
	defer e.mu.Unlock()
	e.updating--
	if writer {
		e.holds--
		e.gateLocked()
	}
	if apply {
		e.applyVersionLocked(version)
	}
	e.broadcastLocked()
	e.kick()
	return e.version, nil
}

func (e *Engine) applyVersionLocked(version string) {
	if version == "" {
		version = e.nextVersionLocked()
	}
	old := e.version
	e.version = version
	e.st.Updates++
	e.dropCacheLocked()
	e.log.Info("weights updated", "from", old, "to", version)
}
