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
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"
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

// ServeHTTP implements http.Handler.
func (w *Worker) ServeHTTP(rw http.ResponseWriter, r *http.Request) {
	w.requests.Add(1)
	w.active.Add(1)
	defer w.active.Add(-1)
	rw.Header()["X-Tether-Demo-Worker"] = w.hdrWorker

	path := r.URL.Path
	get, post := r.Method == http.MethodGet, r.Method == http.MethodPost
	if !get || !probePath(path) {
		// The server never modifies a request's headers once the handler
		// runs, so keeping a pointer is safe; LastHeaders copies.
		w.last.Store(&r.Header)
	}

	switch path {
	case "/health":
		if get {
			w.writeBody(rw, http.StatusOK, w.health)
			return
		}
	case "/sessions":
		if post {
			w.createSession(rw)
			return
		}
	case "/v1/chat/completions":
		if post {
			w.chat(rw, r, "", false)
			return
		}
	case "/generate":
		if post {
			w.generate(rw, r)
			return
		}
	case "/abort_request", "/abort_requests":
		if post {
			w.abort(rw, r)
			return
		}
	case "/flush_cache":
		if post || get {
			w.writeBody(rw, http.StatusOK, w.flushed)
			return
		}
	case "/get_load":
		if get {
			w.getLoad(rw)
			return
		}
	default:
		rest, ok := strings.CutPrefix(path, "/sessions/")
		if !ok {
			break
		}
		id, sub, _ := strings.Cut(rest, "/")
		if id == "" {
			break
		}
		switch {
		case sub == "" && get:
			w.getSession(rw, id)
			return
		case sub == "" && r.Method == http.MethodDelete:
			w.deleteSession(rw, id)
			return
		case sub == "v1/chat/completions" && post:
			w.chat(rw, r, id, true)
			return
		case sub == "echo" && post:
			w.echo(rw, r)
			return
		case sub == "sha256" && post:
			w.sha256(rw, r)
			return
		case sub == "blob" && get:
			w.blob(rw, r)
			return
		case sub == "slow" && post:
			w.slow(rw, r)
			return
		}
	}
	w.writeError(rw, http.StatusNotFound, "not_found_error", "no route for "+r.Method+" "+path)
}

// --- buffers and small writers ---

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 4096); return &b }}

func getBuf() *[]byte { return bufPool.Get().(*[]byte) }

func putBuf(b *[]byte) {
	if cap(*b) > 1<<20 {
		return
	}
	*b = (*b)[:0]
	bufPool.Put(b)
}

var piecePool = sync.Pool{New: func() any { b := make([]byte, blobPiece); return &b }}

// writeBody answers code with a JSON body.
func (w *Worker) writeBody(rw http.ResponseWriter, code int, body []byte) {
	rw.Header()["Content-Type"] = ctJSON
	rw.WriteHeader(code)
	rw.Write(body)
}

// writeError answers an OpenAI-shaped JSON error.
func (w *Worker) writeError(rw http.ResponseWriter, code int, typ, msg string) {
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"error":{"message":`...)
	b = appendJSONString(b, msg)
	b = appendStringField(b, "type", typ)
	b = appendIntField(b, "code", int64(code))
	b = append(b, '}')
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, code, b)
}

var errTooLarge = errors.New("request body too large")

// readBody appends the whole of r to b, at most maxBody bytes.
func readBody(r io.Reader, b []byte) ([]byte, error) {
	for {
		if len(b) == cap(b) {
			if len(b) >= maxBody {
				return b, errTooLarge
			}
			b = append(b, 0)[:len(b)]
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			return b, err
		}
	}
}

// readJSON reads the request body whole into *bp and decodes it into v. An
// empty body decodes as {}. It answers the error itself and returns false.
func (w *Worker) readJSON(rw http.ResponseWriter, r *http.Request, bp *[]byte, v any) ([]byte, bool) {
	body, err := readBody(r.Body, (*bp)[:0])
	*bp = body
	if err != nil {
		if err == errTooLarge {
			w.writeError(rw, http.StatusRequestEntityTooLarge, "invalid_request_error", err.Error())
			return nil, false
		}
		w.cancelled.Add(1)
		w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "reading body: "+err.Error())
		return nil, false
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return body, true
	}
	if err := json.Unmarshal(body, v); err != nil {
		w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "malformed JSON body: "+err.Error())
		return nil, false
	}
	return body, true
}

// newRid returns a generated request id, "w<i>-req-<n>".
func (w *Worker) newRid() string {
	return w.idPrefix + "req-" + strconv.FormatUint(w.seq.Add(1), 10)
}

// --- sessions ---

// newSessionID returns a fresh id: w<i>-<32 hex>, or with BareIDs a uuid.
func (w *Worker) newSessionID(buf []byte) []byte {
	var raw [16]byte
	rand.Read(raw[:]) // never fails
	if !w.opts.BareIDs {
		buf = append(buf[:0], w.idPrefix...)
		n := len(buf)
		buf = append(buf, make([]byte, 32)...)
		hex.Encode(buf[n:], raw[:])
		return buf
	}
	raw[6] = raw[6]&0x0f | 0x40 // version 4
	raw[8] = raw[8]&0x3f | 0x80 // RFC 4122 variant
	var h [32]byte
	hex.Encode(h[:], raw[:])
	buf = append(buf[:0], h[0:8]...)
	for _, part := range [][]byte{h[8:12], h[12:16], h[16:20], h[20:32]} {
		buf = append(append(buf, '-'), part...)
	}
	return buf
}

func (w *Worker) createSession(rw http.ResponseWriter) {
	buf := make([]byte, 0, len(w.idPrefix)+36)
	var id string
	w.mu.Lock()
	for {
		buf = w.newSessionID(buf)
		if _, dup := w.sessions[string(buf)]; !dup {
			id = string(buf)
			w.sessions[id] = 0
			break
		}
	}
	w.mu.Unlock()

	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"session_id":`...)
	b = appendJSONString(b, id)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusCreated, b)
}

func (w *Worker) getSession(rw http.ResponseWriter, id string) {
	w.mu.Lock()
	turns, ok := w.sessions[id]
	w.mu.Unlock()
	if !ok {
		w.writeError(rw, http.StatusNotFound, "not_found_error", "unknown session "+id)
		return
	}
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"session_id":`...)
	b = appendJSONString(b, id)
	b = append(b, w.workerField...)
	b = appendIntField(b, "turns", int64(turns))
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

func (w *Worker) deleteSession(rw http.ResponseWriter, id string) {
	w.mu.Lock()
	_, ok := w.sessions[id]
	delete(w.sessions, id)
	w.mu.Unlock()
	if !ok {
		w.writeError(rw, http.StatusNotFound, "not_found_error", "unknown session "+id)
		return
	}
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"deleted":true`...)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

// --- abortable runs ---

// run is one abortable request in flight.
type run struct {
	rid     string
	abort   chan struct{} // closed on abort
	aborted bool          // guarded by Worker.mu
}

func (w *Worker) register(rid string) *run {
	rn := &run{rid: rid, abort: make(chan struct{})}
	w.mu.Lock()
	w.runs[rn] = struct{}{}
	w.mu.Unlock()
	return rn
}

func (w *Worker) unregister(rn *run) {
	w.mu.Lock()
	delete(w.runs, rn)
	w.mu.Unlock()
}

// abortRuns aborts the running requests whose rid is in rids, or all of
// them, and returns the sorted distinct rids it aborted.
func (w *Worker) abortRuns(rids []string, all bool) []string {
	out := []string{}
	w.mu.Lock()
	for rn := range w.runs {
		if rn.aborted || !(all || slices.Contains(rids, rn.rid)) {
			continue
		}
		rn.aborted = true
		close(rn.abort)
		w.aborted = append(w.aborted, rn.rid)
		out = append(out, rn.rid)
	}
	w.mu.Unlock()
	slices.Sort(out)
	return slices.Compact(out)
}

type abortRequest struct {
	Rid        string   `json:"rid"`
	AbortAll   bool     `json:"abort_all"`
	RequestIDs []string `json:"request_ids"`
}

func (w *Worker) abort(rw http.ResponseWriter, r *http.Request) {
	bp := getBuf()
	defer putBuf(bp)
	var req abortRequest
	if _, ok := w.readJSON(rw, r, bp, &req); !ok {
		return
	}
	rids := req.RequestIDs
	if req.Rid != "" {
		rids = append(rids, req.Rid)
	}
	done := w.abortRuns(rids, req.AbortAll)
	b := append((*bp)[:0], `{"aborted":`...)
	b = appendStringList(b, done)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

func (w *Worker) getLoad(rw http.ResponseWriter) {
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"worker":`...)
	b = strconv.AppendInt(b, int64(w.opts.Index), 10)
	// Requests in flight other than this probe.
	b = appendIntField(b, "num_reqs", max(w.active.Load()-1, 0))
	b = append(b, `,"num_waiting_reqs":0}`+"\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

// stop says why a stream ended.
type stop int

const (
	stopNone  stop = iota
	stopAbort      // aborted by rid
	stopGone       // client went away
)

// pause waits d, or only polls when d is 0, for an abort or the client going
// away. *tp holds a timer reused across the pauses of one request.
func pause(ctx context.Context, abort <-chan struct{}, tp **time.Timer, d time.Duration) stop {
	if d <= 0 {
		select {
		case <-ctx.Done():
			return stopGone
		case <-abort:
			return stopAbort
		default:
			return stopNone
		}
	}
	if *tp == nil {
		*tp = time.NewTimer(d)
	} else {
		(*tp).Reset(d)
	}
	select {
	case <-(*tp).C:
		return stopNone
	case <-ctx.Done():
		return stopGone
	case <-abort:
		return stopAbort
	}
}

func stopTimer(t *time.Timer) {
	if t != nil {
		t.Stop()
	}
}

// flush flushes rw if it can.
func flush(rw http.ResponseWriter) {
	if f, ok := rw.(http.Flusher); ok {
		f.Flush()
	}
}

// --- chat ---

type chatRequest struct {
	Model     string `json:"model"`
	Stream    bool   `json:"stream"`
	Rid       string `json:"rid"`
	RequestID string `json:"request_id"`
}

// chat answers an OpenAI chat completion. With session, id is the session
// whose turn it counts (created if unknown); without, the content names the
// rid instead.
func (w *Worker) chat(rw http.ResponseWriter, r *http.Request, id string, session bool) {
	bp := getBuf()
	defer putBuf(bp)
	var req chatRequest
	body, ok := w.readJSON(rw, r, bp, &req)
	if !ok {
		return
	}
	promptTokens := int64(len(body) / 4)

	rid := req.Rid
	if rid == "" {
		rid = req.RequestID
	}
	if rid == "" {
		rid = r.Header.Get("X-Request-Id") // canonical form: no allocation
	}
	model := req.Model
	if model == "" {
		model = "tether-demo"
	}
	turn := 0
	if session {
		w.mu.Lock()
		prev, known := w.sessions[id]
		if known || !w.opts.BareIDs {
			turn = prev + 1
			w.sessions[id] = turn
		}
		w.mu.Unlock()
		if !known && w.opts.BareIDs {
			w.writeError(rw, http.StatusNotFound, "not_found_error", "unknown session "+id)
			return
		}
	}

	if req.Stream {
		if rid == "" {
			rid = w.newRid()
		}
		w.chatStream(rw, r, id, session, turn, rid, model, bp)
		return
	}

	b := append((*bp)[:0], `{"id":"chatcmpl-`...)
	if rid != "" {
		b = appendJSONChars(b, rid)
	} else {
		b = append(b, w.idPrefix...)
		b = strconv.AppendUint(b, w.seq.Add(1), 10)
	}
	b = append(b, `","object":"chat.completion","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = appendStringField(b, "model", model)
	b = append(b, `,"choices":[{"index":0,"message":{"role":"assistant","content":"`...)
	b = appendJSONChars(b, w.chatPrefix)
	if session {
		b = append(b, "session "...)
		b = appendJSONChars(b, id)
		b = append(b, " turn "...)
		b = strconv.AppendInt(b, int64(turn), 10)
	} else {
		b = append(b, "rid "...)
		b = appendJSONChars(b, rid)
	}
	b = append(b, `"},"logprobs":null,"finish_reason":"stop"}],"usage":{"prompt_tokens":`...)
	b = strconv.AppendInt(b, promptTokens, 10)
	b = appendIntField(b, "completion_tokens", int64(w.opts.StreamChunks))
	b = appendIntField(b, "total_tokens", promptTokens+int64(w.opts.StreamChunks))
	b = append(b, '}')
	b = append(b, w.workerField...)
	b = appendChatIdentity(b, session, id, turn, rid)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

// appendChatIdentity appends the top-level fields naming the session and turn
// (or the rid for a chat without session).
func appendChatIdentity(b []byte, session bool, id string, turn int, rid string) []byte {
	if session {
		b = appendStringField(b, "session_id", id)
		b = appendIntField(b, "turn", int64(turn))
	}
	if rid != "" {
		b = appendStringField(b, "rid", rid)
	}
	return b
}

// chatContent is the assistant message of a chat.
func (w *Worker) chatContent(session bool, id string, turn int, rid string) string {
	if session {
		return w.chatPrefix + "session " + id + " turn " + strconv.Itoa(turn)
	}
	return w.chatPrefix + "rid " + rid
}

// cut returns the end of piece j of k pieces of s, on a rune boundary.
func cut(s string, j, k int) int {
	e := len(s) * j / k
	for e < len(s) && !utf8.RuneStart(s[e]) {
		e++
	}
	return e
}

func (w *Worker) chatStream(rw http.ResponseWriter, r *http.Request, id string, session bool, turn int, rid, model string, bp *[]byte) {
	rn := w.register(rid)
	defer w.unregister(rn)
	content := w.chatContent(session, id, turn, rid)

	// Every event is "data: " + head + delta + mid + finish + tail.
	b := append((*bp)[:0], `data: {"id":"chatcmpl-`...)
	b = appendJSONChars(b, rid)
	b = append(b, `","object":"chat.completion.chunk","created":`...)
	b = strconv.AppendInt(b, time.Now().Unix(), 10)
	b = appendStringField(b, "model", model)
	b = append(b, `,"choices":[{"index":0,"delta":{`...)
	headLen := len(b)
	b = append(b, `},"logprobs":null,"finish_reason":`...)
	midEnd := len(b)
	b = append(b, ']')
	b = append(b, w.workerField...)
	b = appendChatIdentity(b, session, id, turn, rid)
	b = append(b, "}\n\n"...)
	tailEnd := len(b)
	*bp = b
	fixed := b[:tailEnd:tailEnd]
	head, mid, tail := fixed[:headLen], fixed[headLen:midEnd], fixed[midEnd:]

	ev := getBuf()
	defer putBuf(ev)
	event := func(delta string, role bool, finish string) bool {
		e := append((*ev)[:0], head...)
		if role {
			e = append(e, `"role":"assistant",`...)
		}
		if finish == "" {
			e = append(e, `"content":`...)
			e = appendJSONString(e, delta)
		}
		e = append(e, mid...)
		if finish == "" {
			e = append(e, "null}"...)
		} else {
			e = append(e, '"')
			e = append(e, finish...)
			e = append(e, `"}`...)
		}
		e = append(e, tail...)
		*ev = e
		if _, err := rw.Write(e); err != nil {
			return false
		}
		flush(rw)
		return true
	}

	h := rw.Header()
	h["Content-Type"] = ctSSE
	h["Cache-Control"] = noCache
	rw.WriteHeader(http.StatusOK)

	var t *time.Timer
	defer func() { stopTimer(t) }()
	k := w.opts.StreamChunks
	why := stopNone
	for j := range k {
		d := w.opts.StreamDelay
		if j == 0 {
			d = 0
		}
		if why = pause(r.Context(), rn.abort, &t, d); why != stopNone {
			break
		}
		piece := content[cut(content, j, k):cut(content, j+1, k)]
		if !event(piece, j == 0, "") {
			why = stopGone
			break
		}
	}
	switch why {
	case stopGone:
		w.cancelled.Add(1)
		return
	case stopAbort:
		if !event("", false, "abort") {
			w.cancelled.Add(1)
			return
		}
	default:
		if !event("", false, "stop") {
			w.cancelled.Add(1)
			return
		}
	}
	if _, err := io.WriteString(rw, "data: [DONE]\n\n"); err != nil {
		w.cancelled.Add(1)
		return
	}
	flush(rw)
}

// --- generate ---

type generateRequest struct {
	Rid    string `json:"rid"`
	Stream bool   `json:"stream"`
}

func (w *Worker) generate(rw http.ResponseWriter, r *http.Request) {
	bp := getBuf()
	defer putBuf(bp)
	var req generateRequest
	body, ok := w.readJSON(rw, r, bp, &req)
	if !ok {
		return
	}
	promptTokens := int64(len(body) / 4)
	rid := req.Rid
	if rid == "" {
		rid = r.Header.Get("X-Request-Id") // canonical form: no allocation
	}
	if rid == "" {
		rid = w.newRid()
	}
	rn := w.register(rid)
	defer w.unregister(rn)

	// appendResult appends a generate result object after n chunks.
	appendResult := func(b []byte, n int, finish string) []byte {
		b = append(b, `{"text":`...)
		b = appendJSONString(b, w.genText[:w.genCuts[n]])
		b = append(b, `,"meta_info":{"id":`...)
		b = appendJSONString(b, rid)
		b = append(b, `,"finish_reason":`...)
		switch finish {
		case "":
			b = append(b, "null"...)
		case "abort":
			b = append(b, `{"type":"abort","message":"aborted by request"}`...)
		default:
			b = append(b, `{"type":"stop","matched":null}`...)
		}
		b = appendIntField(b, "prompt_tokens", promptTokens)
		b = appendIntField(b, "completion_tokens", int64(n))
		b = append(b, `},"index":0`...)
		b = append(b, w.workerField...)
		return append(b, '}')
	}
	send := func(n int, finish string) bool {
		b := append((*bp)[:0], "data: "...)
		b = appendResult(b, n, finish)
		b = append(b, "\n\n"...)
		*bp = b
		if _, err := rw.Write(b); err != nil {
			return false
		}
		flush(rw)
		return true
	}

	if req.Stream {
		h := rw.Header()
		h["Content-Type"] = ctSSE
		h["Cache-Control"] = noCache
		rw.WriteHeader(http.StatusOK)
		flush(rw)
	}
	var t *time.Timer
	defer func() { stopTimer(t) }()
	k := w.opts.StreamChunks
	n := 0
	why := stopNone
	for j := range k {
		d := w.opts.StreamDelay
		if j == 0 {
			d = 0
		}
		if why = pause(r.Context(), rn.abort, &t, d); why != stopNone {
			break
		}
		n = j + 1
		if req.Stream {
			finish := ""
			if n == k {
				finish = "stop"
			}
			if !send(n, finish) {
				why = stopGone
				break
			}
		}
	}
	if why == stopGone {
		w.cancelled.Add(1)
		return
	}
	if !req.Stream {
		finish := "stop"
		if why == stopAbort {
			finish = "abort"
		}
		b := appendResult((*bp)[:0], n, finish)
		b = append(b, '\n')
		*bp = b
		w.writeBody(rw, http.StatusOK, b)
		return
	}
	if why == stopAbort && !send(n, "abort") {
		w.cancelled.Add(1)
		return
	}
	if _, err := io.WriteString(rw, "data: [DONE]\n\n"); err != nil {
		w.cancelled.Add(1)
		return
	}
	flush(rw)
}

// --- byte streams ---

// echo copies the request body to the response as it arrives, flushing each
// read, in full duplex: nothing is buffered whole.
func (w *Worker) echo(rw http.ResponseWriter, r *http.Request) {
	_ = http.NewResponseController(rw).EnableFullDuplex() // unsupported: half duplex
	rw.Header()["Content-Type"] = ctOctets
	rw.WriteHeader(http.StatusOK)
	pp := piecePool.Get().(*[]byte)
	defer piecePool.Put(pp)
	buf := *pp
	for {
		n, err := r.Body.Read(buf)
		if n > 0 {
			if _, werr := rw.Write(buf[:n]); werr != nil {
				w.cancelled.Add(1)
				return
			}
			flush(rw)
		}
		if err == io.EOF {
			return
		}
		if err != nil {
			w.cancelled.Add(1)
			return
		}
	}
}

func (w *Worker) sha256(rw http.ResponseWriter, r *http.Request) {
	pp := piecePool.Get().(*[]byte)
	defer piecePool.Put(pp)
	h := sha256.New()
	n, err := io.CopyBuffer(h, struct{ io.Reader }{r.Body}, *pp)
	if err != nil {
		w.cancelled.Add(1)
		w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "reading body: "+err.Error())
		return
	}
	var sum [sha256.Size]byte
	bp := getBuf()
	defer putBuf(bp)
	b := append(*bp, `{"sha256":"`...)
	b = hex.AppendEncode(b, h.Sum(sum[:0]))
	b = append(b, '"')
	b = appendIntField(b, "bytes", n)
	b = append(b, w.workerField...)
	b = append(b, "}\n"...)
	*bp = b
	w.writeBody(rw, http.StatusOK, b)
}

func (w *Worker) blob(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	var size int64
	var seed uint64
	var chunked bool
	var err error
	if s := q.Get("size"); s != "" {
		if size, err = strconv.ParseInt(s, 10, 64); err != nil || size < 0 {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad size "+strconv.Quote(s))
			return
		}
	}
	if s := q.Get("seed"); s != "" {
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad seed "+strconv.Quote(s))
			return
		}
	}
	if s := q.Get("chunked"); s != "" {
		if chunked, err = strconv.ParseBool(s); err != nil {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad chunked "+strconv.Quote(s))
			return
		}
	}
	h := rw.Header()
	h["Content-Type"] = ctOctets
	if !chunked {
		h["Content-Length"] = []string{strconv.FormatInt(size, 10)}
	}
	rw.WriteHeader(http.StatusOK)

	pp := piecePool.Get().(*[]byte)
	defer piecePool.Put(pp)
	rng := newBlobRNG(seed)
	ctx := r.Context()
	for left := size; left > 0; {
		p := (*pp)[:min(left, blobPiece)]
		rng.Read(p)
		if _, err := rw.Write(p); err != nil || ctx.Err() != nil {
			w.cancelled.Add(1)
			return
		}
		if chunked {
			flush(rw)
		}
		left -= int64(len(p))
	}
}

// slow sends chunks server-sent events, the first at once and then delay_ms
// apart (defaults: StreamChunks and StreamDelay), and records in Cancelled
// a client that leaves before the end.
func (w *Worker) slow(rw http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	k := w.opts.StreamChunks
	d := w.opts.StreamDelay
	if s := q.Get("chunks"); s != "" {
		v, err := strconv.Atoi(s)
		if err != nil || v < 0 {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad chunks "+strconv.Quote(s))
			return
		}
		k = v
	}
	if s := q.Get("delay_ms"); s != "" {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil || v < 0 {
			w.writeError(rw, http.StatusBadRequest, "invalid_request_error", "bad delay_ms "+strconv.Quote(s))
			return
		}
		d = time.Duration(v) * time.Millisecond
	}
	// Drain the body: the server notices a client going away (and cancels
	// the context) only once the body has been read.
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		w.cancelled.Add(1)
		return
	}
	h := rw.Header()
	h["Content-Type"] = ctSSE
	h["Cache-Control"] = noCache
	rw.WriteHeader(http.StatusOK)
	flush(rw)

	bp := getBuf()
	defer putBuf(bp)
	var t *time.Timer
	defer func() { stopTimer(t) }()
	for j := range k {
		dj := d
		if j == 0 {
			dj = 0
		}
		if pause(r.Context(), nil, &t, dj) != stopNone {
			w.cancelled.Add(1)
			return
		}
		b := append((*bp)[:0], `data: {"seq":`...)
		b = strconv.AppendInt(b, int64(j), 10)
		b = appendIntField(b, "chunks", int64(k))
		b = append(b, w.workerField...)
		b = append(b, "}\n\n"...)
		*bp = b
		if _, err := rw.Write(b); err != nil {
			w.cancelled.Add(1)
			return
		}
		flush(rw)
	}
}

// probePath reports whether a GET of path is a router's control-plane
// probe (health checks, load polling), not a request a test looks at.
func probePath(path string) bool {
	switch path {
	case "/health", "/get_load", "/v1/loads", "/metrics", "/get_weight_version":
		return true
	}
	return false
}
