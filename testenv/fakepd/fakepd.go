// Package fakepd holds fake prefill and decode engines that keep to the
// two P/D protocols a router must speak (/work/shared/pd-protocols.md),
// and a direct client that speaks them correctly (the baseline a router is
// compared with).
//
// SGLang ([SGLangPrefill], [SGLangDecode]): both legs get the same body
// with bootstrap_host, bootstrap_port and bootstrap_room; a generation
// request without them is refused with 400 "Disaggregated request received
// without bootstrap room id". The prefill registers the room, computes
// (Options.PrefillDelay), and holds the room until the decode pulls its KV
// through the prefill's bootstrap server (its own port: GET /kv?room=R, a
// long poll), then answers with a finish of length 0 (and, with
// return_logprob, meta_info.input_token_logprobs for the prompt). It frees
// the room when its connection closes, when /abort_request names its rid,
// or after Options.WaitTimeout (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT).
// The decode waits for its room (while its client is connected, no
// /abort_request names its rid and Options.WaitTimeout has not passed:
// then 500), then decodes. With Options.Notify a prefill that drops a room
// tells the waiting decode, which fails at once; without (older engines)
// the decode waits on.
//
// vLLM ([VLLMPrefill], [VLLMDecode]): a prefill request with
// kv_transfer_params.do_remote_decode computes and pins the prompt's
// blocks under a lease (Options.Lease) with one consumer, and answers the
// kv_transfer_params a decode needs. The decode pulls them (POST
// /_nixl/pull on the prefill's port: the first pull frees them, a second
// gets 410); a decode request without complete params, or whose pull
// fails, is decoded after recomputing the whole prompt, silently, as vLLM
// does: Stats.Recomputes counts it. With Options.Notify a decode that ends
// before pulling tells the prefill (POST /_nixl/release), which frees the
// blocks at once; without, they stay until the lease ends. A prefill leg
// whose body breaks the protocol (stream true, max_tokens not 1,
// min_tokens, stream_options, n above 1) is counted in Stats.BadPrefill.
//
// Every engine: Held() is what it still holds (rooms, waiting or running
// requests, pinned blocks), Kill() closes its listeners and connections at
// once (a crash: what it held goes with it), FailNext(status, n) answers
// the next n generation requests with status, SlowNext(d, n) makes the
// next n prompts computed take d longer. Output token i of a prompt is
// fakeengine.OutputToken(prompt, seed, i).
//
// model.go: the service model a load run needs (a prefix cache, compute
// per uncached token, decode slots, all off by default), weight versions
// on every answer (the prefill's KV and each decoded token), requests
// parked while paused, aborts answered with their partial output, and
// Regular mode (a prefill engine serving whole requests).
package fakepd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/kvevents"
)

// Options are an engine's timings and behaviour.
type Options struct {
	PrefillDelay time.Duration // a prefill's compute time (default 0)
	TokenDelay   time.Duration // each decoded token (default 0)
	WaitTimeout  time.Duration // SGLang: a room's wait on either side (default 300 s)
	Lease        time.Duration // vLLM: pinned blocks' lease (default 30 s)
	Notify       bool          // abort notification between the sides
	BlockTokens  int           // tokens per KV block (default 16)

	// The service model (model.go), all off by default.
	PrefillPerToken time.Duration // compute per uncached prompt token
	MaxPrefill      int           // prompts computed at once (0: no bound)
	MaxRunning      int           // requests decoding at once (0: no bound)
	CacheTokens     int           // prefix cache size in tokens (0: none)
	// Regular: a prefill engine also serves a generation request without
	// P/D fields whole (compute, then decode), as a regular worker (an
	// SGLang prefill refuses it otherwise; a vLLM prefill serves it
	// either way, this only adds the decode's slots).
	Regular bool
	// KVEvents: an engine with a prefix cache publishes its KV-cache
	// events (kvevents.go; nil: none).
	KVEvents *KVEventsConfig
}

func (o *Options) defaults() {
	if o.WaitTimeout <= 0 {
		o.WaitTimeout = 300 * time.Second
	}
	if o.Lease <= 0 {
		o.Lease = 30 * time.Second
	}
	if o.BlockTokens <= 0 {
		o.BlockTokens = 16
	}
}

// Stats count what an engine saw.
type Stats struct {
	Requests    atomic.Int64 // generation requests
	Refused     atomic.Int64 // 400s: no bootstrap fields, bad body
	Failed      atomic.Int64 // FailNext answers
	Served      atomic.Int64 // answered whole
	Aborted     atomic.Int64 // ended by a closed connection or /abort_request
	AbortCalls  atomic.Int64 // /abort_request calls
	Timeouts    atomic.Int64 // SGLang: room waits that timed out
	Notified    atomic.Int64 // rooms or blocks dropped on a notification from the other side
	Pulls       atomic.Int64 // vLLM: successful pulls (prefill side)
	LeaseExpiry atomic.Int64 // vLLM: blocks freed by the lease's end
	Recomputes  atomic.Int64 // vLLM decode: prompts recomputed (no params, or a failed pull)
	BadPrefill  atomic.Int64 // vLLM prefill: a leg body against the protocol

	PromptTokens        atomic.Int64 // prompt tokens computed or found cached (model.go)
	CachedTokens        atomic.Int64 // of those, found in the prefix cache
	OutputTokens        atomic.Int64 // tokens decoded
	ParkedWhilePaused   atomic.Int64 // generation requests that arrived while paused
	MixedVersionOutputs atomic.Int64 // answers whose KV and tokens span weight versions
}

// server is what every fake engine shares: the HTTP server, the kill, the
// fault, the aborts by rid.
type server struct {
	opts  Options
	Stats Stats
	srv   *http.Server
	ln    net.Listener
	url   string

	mu     sync.Mutex
	dead   bool
	failN  int
	failSt int
	slowN  int
	slowD  time.Duration
	rids   map[string]*tracked
	ridSeq uint64
	ridNth map[string]int // requests seen per client rid
	ctl    control        // control.go

	cache        *prefixCache // model.go
	prefillSlots slots
	decodeSlots  slots
	pub          *kvevents.Publisher // kvevents.go; nil: no events
}

func (s *server) start(h http.Handler) error {
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("fakepd: %w", err)
	}
	s.ln, s.url = ln, "http://"+ln.Addr().String()
	s.rids, s.ridNth = map[string]*tracked{}, map[string]int{}
	s.cache = newPrefixCache(s.opts.CacheTokens, s.opts.BlockTokens)
	s.prefillSlots, s.decodeSlots = newSlots(s.opts.MaxPrefill), newSlots(s.opts.MaxRunning)
	if m, ok := h.(*http.ServeMux); ok {
		s.controlRoutes(m)
	}
	s.srv = &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go s.srv.Serve(ln)
	return nil
}

// URL is the engine's base URL.
func (s *server) URL() string { return s.url }

// Port is its HTTP port.
func (s *server) Port() int { return s.ln.Addr().(*net.TCPAddr).Port }

// FailNext answers the next n generation requests with status.
func (s *server) FailNext(status, n int) {
	s.mu.Lock()
	s.failSt, s.failN = status, n
	s.mu.Unlock()
}

// SlowNext makes the next n prompts it computes take d longer (a
// prefill that a fault should find busy).
func (s *server) SlowNext(d time.Duration, n int) {
	s.mu.Lock()
	s.slowD, s.slowN = d, n
	s.mu.Unlock()
}

func (s *server) slow() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.slowN > 0 {
		s.slowN--
		return s.slowD
	}
	return 0
}

func (s *server) fault() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failN > 0 {
		s.failN--
		return s.failSt
	}
	return 0
}

// track registers rid's cancel for /abort_request, /abort_requests and
// a pause (a request without a rid is found by abort all and the pause);
// the returned func unregisters it.
func (s *server) track(rid string, cancel context.CancelFunc) (*tracked, func()) {
	t := &tracked{cancel: cancel}
	s.mu.Lock()
	if rid != "" {
		s.ridNth[rid]++
		t.nth = s.ridNth[rid]
	}
	s.ridSeq++
	key := ridKey(rid, s.ridSeq)
	s.rids[key] = t
	s.mu.Unlock()
	return t, func() {
		s.mu.Lock()
		if s.rids[key] == t {
			delete(s.rids, key)
		}
		s.mu.Unlock()
	}
}

// Tracking reports which request of rid (1: its first) an abort by rid
// would reach now, 0: none. A request takes the rid's place from when it
// is tracked, before it waits for anything.
func (s *server) Tracking(rid string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if t := s.rids[rid]; t != nil {
		return t.nth
	}
	return 0
}

// abortRequest serves POST /abort_request {"rid"} or {"abort_all": true}.
func (s *server) abortRequest(w http.ResponseWriter, r *http.Request) {
	s.Stats.AbortCalls.Add(1)
	var body struct {
		Rid      string `json:"rid"`
		AbortAll bool   `json:"abort_all"`
	}
	if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	for rid, t := range s.rids {
		if body.AbortAll || rid == body.Rid {
			abortLocked(t)
		}
	}
	s.mu.Unlock()
	w.WriteHeader(http.StatusOK)
}

// kill closes the engine's listener and connections at once.
func (s *server) kill() {
	s.mu.Lock()
	s.dead = true
	s.mu.Unlock()
	// The connections first: a handler its cancel ends must not get to
	// answer (an empty 200) before its connection goes, as a crash.
	s.srv.Close()
	if s.pub != nil {
		s.pub.Close()
	}
	s.mu.Lock()
	for _, t := range s.rids {
		t.cancel()
	}
	s.mu.Unlock()
}

// Close is Kill, for a test's cleanup.
func (s *server) Close() { s.kill() }

// Dead reports a killed engine.
func (s *server) Dead() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dead
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	w.Write(b)
}

func writeEvent(w http.ResponseWriter, v any) error {
	b, _ := json.Marshal(v)
	if _, err := fmt.Fprintf(w, "data: %s\n\n", b); err != nil {
		return err
	}
	w.(http.Flusher).Flush()
	return nil
}

func startSSE(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	w.(http.Flusher).Flush()
}

// sleep waits d, or less if ctx ends: false then.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// genRequest is a generation request as the fakes read it.
type genRequest struct {
	path    string
	rid     string
	prompt  []int
	maxNew  int
	seed    uint64
	stream  bool
	logprob bool
	raw     map[string]json.RawMessage
}

func parseGen(kind fakeengine.Kind, r *http.Request, body []byte) (*genRequest, error) {
	rid, prompt, maxNew, seed, stream, err := fakeengine.ParseRequest(kind, r.URL.Path, body, r.Header)
	if err != nil {
		return nil, err
	}
	g := &genRequest{path: r.URL.Path, rid: rid, prompt: prompt, maxNew: maxNew, seed: seed, stream: stream}
	if err := json.Unmarshal(body, &g.raw); err != nil {
		return nil, err
	}
	if v, ok := g.raw["return_logprob"]; ok {
		g.logprob = string(v) == "true"
	}
	return g, nil
}

var errGone = errors.New("fakepd: gone")

// tokens returns the output tokens from..to of g.
func (g *genRequest) token(i int) int { return fakeengine.OutputToken(g.prompt, g.seed, i) }

type atomic32 = atomic.Int32

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }
