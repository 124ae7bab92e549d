// Package demo is tether's built-in demo session worker: a small, fast and
// deterministic stand-in for an RL "session server" or an inference engine
// (SGLang / vLLM shaped), used by `tetherd --demo N`, by the proxy's
// end-to-end tests and by the benchmarks.
//
// A [Worker] is an [http.Handler]; [Start] serves one on a loopback listener.
// Every response carries the header X-Tether-Demo-Worker: <index> and, unless
// it is a byte stream or server-sent events, a JSON body.
//
// Sessions (ids "w<index>-<32 lowercase hex>", or with Options.BareIDs plain
// uuids such as "3f2a9c1e-4b7d-4e21-9a0b-1c2d3e4f5a6b", as a session server
// that knows nothing of tether mints them):
//
//	POST   /sessions                               201 {"session_id":id,"worker":i}
//	GET    /sessions/{id}                          200 {"session_id":id,"worker":i,"turns":n} or 404
//	DELETE /sessions/{id}                          200 {"deleted":true,"worker":i} or 404
//	POST   /sessions/{id}/v1/chat/completions      OpenAI chat completion; counts a turn
//	POST   /sessions/{id}/echo                     streams the request body back (chunked)
//	POST   /sessions/{id}/sha256                   {"sha256":hex,"bytes":n,"worker":i}
//	GET    /sessions/{id}/blob?size=N&seed=S&chunked=0|1   exactly the bytes of [Blob](N, S)
//	POST   /sessions/{id}/slow?chunks=K&delay_ms=D K server-sent events D ms apart
//
// The chat endpoint creates a session it has never seen ("reseeding": a
// rolling resize may route a foreign id here), except with BareIDs, where a
// turn of an id this worker did not mint is a 404; GET and DELETE of an unknown
// id are 404. echo, sha256, blob and slow accept any id and neither create
// nor count a session.
//
// Engine endpoints, keyed by request id (rid) rather than by session:
//
//	POST /v1/chat/completions    chat without a session
//	POST /generate               SGLang generate, abortable
//	POST /abort_request          {"rid":x} or {"abort_all":true} -> {"aborted":[rids]}
//	POST /abort_requests         vLLM form {"request_ids":[...]}
//	POST /flush_cache            {"flushed":true,"worker":i}
//	GET  /get_load               {"worker":i,"num_reqs":n,"num_waiting_reqs":0}
//	GET  /health                 {"status":"ok","worker":i}
//
// A streamed chat and every generate are registered under their rid (the
// body's "rid" or "request_id", else the X-Request-ID header, else a
// generated one) while they run, and an abort ends them early with finish
// reason "abort". Anything else is a 404 JSON error, a wrong method included.
//
// Streams are server-sent events, flushed one by one, Options.StreamDelay
// apart (the first at once). A streamed chat sends Options.StreamChunks
// chat.completion.chunk events whose contents concatenate to the non-stream
// content (the first also carries the role), then one with an empty delta and
// the finish reason, then "data: [DONE]". A streamed generate sends
// StreamChunks events of cumulative text, the last with finish reason stop
// (or one more with abort), then "data: [DONE]".
package demo

import (
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultStreamChunks is the number of content chunks of a stream when
// Options.StreamChunks is not positive.
const DefaultStreamChunks = 4

// maxBody bounds the JSON request bodies that are read whole.
const maxBody = 32 << 20

// Options configures a Worker.
type Options struct {
	Index        int           // worker index i: session ids are "w<i>-<32 lowercase hex>"
	StreamDelay  time.Duration // pause between SSE chunks / generate chunks (default 0)
	StreamChunks int           // number of content chunks in a stream (default 4)
	// BareIDs: mint plain uuids (8-4-4-4-12 lowercase hex, version 4) as
	// a session server that knows nothing of tether does (miles'
	// single-process server), and be strict about them: a chat turn of a
	// session this worker did not mint is a 404, no reseeding.
	BareIDs bool
}

// Worker is the demo session worker, an http.Handler. It is safe for
// concurrent use.
type Worker struct {
	opts Options

	requests  atomic.Int64
	active    atomic.Int64
	cancelled atomic.Int64
	seq       atomic.Uint64 // generated request ids
	last      atomic.Pointer[http.Header]

	mu       sync.Mutex
	sessions map[string]int // session id -> turns
	runs     map[*run]struct{}
	aborted  []string

	// Precomputed response pieces.
	hdrWorker   []string // X-Tether-Demo-Worker value
	idPrefix    string   // "w<i>-"
	workerField []byte   // `,"worker":i`
	chatPrefix  string   // "worker i "
	health      []byte
	flushed     []byte
	genText     string // the generate output: StreamChunks pieces
	genCuts     []int  // genText[:genCuts[j]] is the text after j chunks
}

// Shared header values. They are only ever replaced in a header map, never
// modified in place, and len == cap so an Add copies.
var (
	ctJSON   = []string{"application/json"}[:1:1]
	ctSSE    = []string{"text/event-stream"}[:1:1]
	ctOctets = []string{"application/octet-stream"}[:1:1]
	noCache  = []string{"no-cache"}[:1:1]
)

// New returns a Worker configured by opts.
func New(opts Options) *Worker {
	if opts.StreamChunks <= 0 {
		opts.StreamChunks = DefaultStreamChunks
	}
	if opts.StreamDelay < 0 {
		opts.StreamDelay = 0
	}
	idx := strconv.Itoa(opts.Index)
	w := &Worker{
		opts:        opts,
		sessions:    make(map[string]int),
		runs:        make(map[*run]struct{}),
		hdrWorker:   []string{idx}[:1:1],
		idPrefix:    "w" + idx + "-",
		workerField: []byte(`,"worker":` + idx),
		chatPrefix:  "worker " + idx + " ",
		health:      []byte(`{"status":"ok","worker":` + idx + "}\n"),
		flushed:     []byte(`{"flushed":true,"worker":` + idx + "}\n"),
	}
	var text strings.Builder
	w.genCuts = make([]int, opts.StreamChunks+1)
	for j := range opts.StreamChunks {
		text.WriteString("w" + idx + "-t" + strconv.Itoa(j) + " ")
		w.genCuts[j+1] = text.Len()
	}
	w.genText = text.String()
	return w
}

// Turns returns the turns recorded for a session, 0 if it is unknown.
func (w *Worker) Turns(sessionID string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.sessions[sessionID]
}

// Requests returns the number of requests served, probes included.
func (w *Worker) Requests() int64 { return w.requests.Load() }

// Active returns the number of requests being handled now.
func (w *Worker) Active() int64 { return w.active.Load() }

// Cancelled returns the number of handlers that ended early because the
// client went away (context cancelled or a failed write or body read).
func (w *Worker) Cancelled() int64 { return w.cancelled.Load() }

// Aborted returns a copy of the rids aborted so far, in abort order.
func (w *Worker) Aborted() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.aborted)
}

// Running returns the sorted rids of the abortable requests (generates and
// streamed chats) running now; a test waits on it before aborting.
func (w *Worker) Running() []string {
	w.mu.Lock()
	rids := make([]string, 0, len(w.runs))
	for r := range w.runs {
		rids = append(rids, r.rid)
	}
	w.mu.Unlock()
	slices.Sort(rids)
	return rids
}

// LastHeaders returns a copy of the headers of the last request, not counting
// the GET probes of a router's control plane (/health, /get_load, and the
// engine load poller's /v1/loads, /metrics, /get_weight_version), so that
// they do not hide the request a test is looking at. It is nil before any
// request.
func (w *Worker) LastHeaders() http.Header {
	h := w.last.Load()
	if h == nil {
		return nil
	}
	return h.Clone()
}
