// Package engine serves tetherd's inference-engine endpoints on the data
// port (through proxy Config.Local): aborts that reach the worker owning a
// request, and fan-outs to every worker. It also tracks which worker serves
// each request id in flight (Owners, Tracker).
//
//	POST /abort_request      SGLang form {"rid": "..."} or {"abort_all": true}:
//	                         to the owner of rid when known, else to every worker
//	POST /abort_requests     vLLM form {"request_ids": [...]}: grouped per owner,
//	                         unknown ids to every worker; {} (abort
//	                         everything) to every worker
//	POST /abort_until_idle?timeout_s=T
//	                         abort_all in waves until tetherd has nothing in
//	                         flight to any worker, or T seconds (default 30) pass
//	POST /flush_cache        to every worker (GET accepted too)
//	GET  /get_loads, /v1/loads
//	                         every worker's GET /get_load, and the loads list
//	                         of sgl-model-gateway ({"loads":[{"worker":url,
//	                         "worker_type":"regular","load":n}]}, n: tetherd's
//	                         requests in flight to it)
//	POST /finish_session?session_id=ID
//	                         forget a sticky routing key (best effort)
//
// Fan-out answers list per-worker results:
//
//	{"successful":[{"worker":0,"status":200,"response":{...}}],
//	 "failed":[{"worker":2,"error":"connect failed"}]}
//
// with status 200, or 502 when every call failed, or 503 without workers
// (/flush_cache: not 200 unless every worker flushed). Every call carries
// the client's Authorization (else Config.WorkerAPIKey as a Bearer token).
// Malformed requests are answered 400 with {"error":{"code":400,"message":...}}
// and nothing is sent to any worker. Error texts are fixed (never a Go
// error string or an address); the details go to the log.
package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/route"
)

// Config configures an Engine. Zero values take the defaults.
type Config struct {
	Table  *route.Table
	Owners *Owners // nil: every abort by id goes to every worker
	// FinishSession forgets a routing key (route.Policy.FinishSession);
	// nil: /finish_session answers "finished": false.
	FinishSession func(key string) bool
	// Timeout bounds each call to a worker; default 5s.
	Timeout time.Duration
	// WaveInterval is the pause between abort waves of
	// /abort_until_idle; default 250ms.
	WaveInterval time.Duration
	// MaxIdleTimeout caps timeout_s of /abort_until_idle; default 1h.
	MaxIdleTimeout time.Duration
	// WorkerAPIKey, when set, goes to the workers as "Authorization:
	// Bearer KEY" on the calls of a client that sent no Authorization of
	// its own (engines started with --api-key). A client's Authorization
	// is always forwarded as it came.
	WorkerAPIKey string
	// Fleet, when set, serves the weight-sync endpoints (fleet.go):
	// pause, update and resume fanned out, and the hold.
	Fleet *fleet.Fleet
	// OnPhase, when set, is told this replica's sync state (cluster mode:
	// it writes the store): phase true after each phase change of a pause
	// or resume through this replica, false after a weight update changed
	// the target or versions. An error (the store was not written) is
	// reported in the call's answer; the change holds here regardless.
	OnPhase func(st fleet.State, phase bool) error
	// Settings: UpdateTimeout (--update-timeout).
	Settings
	Log *slog.Logger
}

// Engine serves the endpoints.
type Engine struct {
	cfg    Config
	client *http.Client
	tr     *http.Transport
}

// DefaultUpdateTimeout is Settings.UpdateTimeout's default (tetherd
// --update-timeout's): a weight update can take long.
const DefaultUpdateTimeout = 30 * time.Minute

// Settings are the engine endpoints' settings (tetherd's
// --update-timeout), apart from the wiring (Config). Zero fields take the
// defaults (Provision).
type Settings struct {
	// UpdateTimeout bounds each worker's weight-update call;
	// DefaultUpdateTimeout.
	UpdateTimeout time.Duration
}

// DefaultSettings is Settings with every field at its default.
func DefaultSettings() Settings {
	var s Settings
	s.Provision()
	return s
}

// Provision fills s's zero (or negative) fields with the defaults.
func (s *Settings) Provision() {
	if s.UpdateTimeout <= 0 {
		s.UpdateTimeout = DefaultUpdateTimeout
	}
}

// Validate refuses a negative setting (zero is the default), naming
// tetherd's flag.
func (s Settings) Validate() error {
	if s.UpdateTimeout < 0 {
		return errors.New("--update-timeout: negative")
	}
	return nil
}

// New returns an Engine.
func New(cfg Config) *Engine {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.WaveInterval <= 0 {
		cfg.WaveInterval = 250 * time.Millisecond
	}
	if cfg.MaxIdleTimeout <= 0 {
		cfg.MaxIdleTimeout = time.Hour
	}
	cfg.Settings.Provision()
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	tr := &http.Transport{
		Proxy:               nil, // never an environment proxy: workers are direct
		DialContext:         (&net.Dialer{Timeout: cfg.Timeout, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 4,
		IdleConnTimeout:     60 * time.Second,
		DisableCompression:  true,
	}
	e := &Engine{cfg: cfg, tr: tr, client: &http.Client{Transport: tr}}
	if cfg.Fleet != nil {
		cfg.Fleet.SetAsk(e.askVersion)
	}
	return e
}

// Close releases idle connections to the workers.
func (e *Engine) Close() { e.tr.CloseIdleConnections() }

// Endpoint paths.
const (
	PathAbortRequest   = "/abort_request"
	PathAbortRequests  = "/abort_requests"
	PathAbortUntilIdle = "/abort_until_idle"
	PathFlushCache     = "/flush_cache"
	PathGetLoads       = "/get_loads"
	PathV1Loads        = "/v1/loads"
	PathFinishSession  = "/finish_session"
)

// Local is the proxy Config.Local hook: the handler of an engine endpoint,
// or nil to proxy the request. It allocates nothing for other paths.
func (e *Engine) Local(method, path []byte) http.Handler {
	if i := bytes.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	switch string(path) {
	case PathAbortRequest:
		return http.HandlerFunc(e.abortRequest)
	case PathAbortRequests:
		return http.HandlerFunc(e.abortRequests)
	case PathAbortUntilIdle:
		return http.HandlerFunc(e.abortUntilIdle)
	case PathFlushCache:
		return http.HandlerFunc(e.flushCache)
	case PathGetLoads, PathV1Loads:
		return e.GetLoadsHandler()
	case PathFinishSession:
		return http.HandlerFunc(e.finishSession)
	}
	if h := e.fleetLocal(path); h != nil {
		return h
	}
	return nil
}

// Handler serves every endpoint (404 for other paths), for use outside the
// proxy.
func (e *Engine) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if h := e.Local([]byte(r.Method), []byte(r.URL.Path)); h != nil {
			h.ServeHTTP(w, r)
			return
		}
		writeError(w, http.StatusNotFound, "not found")
	})
}

// GetLoadsHandler fans GET /get_load out to every worker (the data-port
// /get_loads; the admin listener serves tetherd's own counts).
func (e *Engine) GetLoadsHandler() http.Handler { return http.HandlerFunc(e.getLoads) }

// Result is one worker's answer.
type Result struct {
	Worker     int             `json:"worker"`
	Status     int             `json:"status,omitempty"`
	RequestIDs []string        `json:"request_ids,omitempty"`
	InFlight   *uint64         `json:"in_flight,omitempty"` // tetherd's count (get_loads)
	Response   json.RawMessage `json:"response,omitempty"`
	Error      string          `json:"error,omitempty"`
	// ElapsedS: how long the worker took to answer (the sync's
	// timeline, userspace/history).
	ElapsedS float64 `json:"elapsed_s"`
}

// Results are the per-worker outcomes of a fan-out, by slot.
type Results struct {
	Successful []Result `json:"successful"`
	Failed     []Result `json:"failed"`
}

type call struct {
	w      *route.Worker
	method string
	path   string
	body   []byte
	rids   []string
	auth   string        // Authorization to send (the client's, or the worker API key)
	limit  time.Duration // bound of this call (0: Config.Timeout)
}

// maxWorkerResponse bounds a worker's answer kept in a result.
const maxWorkerResponse = 64 << 10

// auth is the Authorization the calls for client request r carry: the
// client's own, else the configured worker API key.
func (e *Engine) auth(r *http.Request) string {
	if a := r.Header.Get("Authorization"); a != "" {
		return a
	}
	if e.cfg.WorkerAPIKey != "" {
		return "Bearer " + e.cfg.WorkerAPIKey
	}
	return ""
}

// fanout runs the calls concurrently, each bounded by the Timeout, with
// the Authorization auth.
func (e *Engine) fanout(ctx context.Context, auth string, calls []call) Results {
	return e.fanoutTimeout(ctx, auth, calls, 0)
}

// fanoutTimeout is fanout with each call bounded by limit (0: Timeout).
func (e *Engine) fanoutTimeout(ctx context.Context, auth string, calls []call, limit time.Duration) Results {
	for i := range calls {
		calls[i].auth = auth
		if limit > 0 {
			calls[i].limit = limit
		}
	}
	out := make([]Result, len(calls))
	var wg sync.WaitGroup
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			out[i] = e.do(ctx, &calls[i])
			out[i].ElapsedS = math.Round(time.Since(t0).Seconds()*1000) / 1000
		}()
	}
	wg.Wait()
	res := Results{Successful: []Result{}, Failed: []Result{}}
	for _, r := range out {
		if r.Error == "" {
			res.Successful = append(res.Successful, r)
		} else {
			res.Failed = append(res.Failed, r)
		}
	}
	bySlot := func(a, b Result) int { return a.Worker - b.Worker }
	slices.SortFunc(res.Successful, bySlot)
	slices.SortFunc(res.Failed, bySlot)
	return res
}

func (e *Engine) do(ctx context.Context, c *call) Result {
	r := Result{Worker: c.w.Slot, RequestIDs: c.rids}
	limit := c.limit
	if limit <= 0 {
		limit = e.cfg.Timeout
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var body io.Reader
	if c.body != nil {
		body = bytes.NewReader(c.body)
	}
	req, err := http.NewRequestWithContext(ctx, c.method, c.w.URL+c.path, body)
	if err != nil {
		e.cfg.Log.Warn("engine fan-out: bad request", "worker", c.w.Slot, "path", c.path, "err", err)
		r.Error = "bad worker url"
		return r
	}
	if c.body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.auth != "" {
		req.Header.Set("Authorization", c.auth)
	}
	resp, err := e.client.Do(req)
	if err != nil {
		e.cfg.Log.Warn("engine fan-out: call failed", "worker", c.w.Slot, "path", c.path, "err", err)
		var op *net.OpError
		switch {
		case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded):
			r.Error = "timeout"
		case ctx.Err() != nil:
			r.Error = "cancelled"
		case errors.As(err, &op) && op.Op == "dial":
			r.Error = "connect failed"
		default:
			r.Error = "connection failed"
		}
		return r
	}
	defer resp.Body.Close()
	r.Status = resp.StatusCode
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxWorkerResponse))
	if err != nil {
		r.Error = "response cut short"
		return r
	}
	if b = bytes.TrimSpace(b); len(b) > 0 && json.Valid(b) {
		r.Response = b
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		r.Error = "worker answered " + strconv.Itoa(resp.StatusCode)
	}
	return r
}

// workers returns every worker in the table, whatever its state: an
// unhealthy worker may still run requests worth aborting.
func (e *Engine) workers() []*route.Worker {
	var out []*route.Worker
	for _, w := range e.cfg.Table.Snapshot() {
		if w != nil {
			out = append(out, w)
		}
	}
	return out
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.Encode(v)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(buf.Bytes())
}

func writeError(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]any{"error": map[string]any{"code": code, "message": msg}})
}

func allowMethods(w http.ResponseWriter, r *http.Request, methods ...string) bool {
	if slices.Contains(methods, r.Method) {
		return true
	}
	w.Header().Set("Allow", joinComma(methods))
	writeError(w, http.StatusMethodNotAllowed, "method not allowed: use "+joinComma(methods))
	return false
}

func joinComma(s []string) string {
	var b []byte
	for i, m := range s {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = append(b, m...)
	}
	return string(b)
}

// fanoutStatus is the status of a fan-out answer.
func fanoutStatus(res Results) int {
	switch {
	case len(res.Successful) == 0 && len(res.Failed) == 0:
		return http.StatusServiceUnavailable
	case len(res.Successful) == 0:
		return http.StatusBadGateway
	}
	return http.StatusOK
}

// readObject reads a JSON object body; it answers 400 itself.
func readObject(w http.ResponseWriter, r *http.Request) (map[string]json.RawMessage, bool) {
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "could not read the body")
		return nil, false
	}
	body = bytes.TrimSpace(body)
	if len(body) == 0 || body[0] != '{' {
		writeError(w, http.StatusBadRequest, "body must be a JSON object")
		return nil, false
	}
	var m map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&m); err != nil {
		writeError(w, http.StatusBadRequest, "body is not valid JSON")
		return nil, false
	}
	if dec.More() {
		writeError(w, http.StatusBadRequest, "trailing data after the JSON object")
		return nil, false
	}
	return m, true
}

// jsonKind names the JSON type of a raw value for error messages.
func jsonKind(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '"':
		return "a string"
	case '[':
		return "a list"
	case '{':
		return "an object"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	return "a number"
}

// --- /flush_cache, /get_loads ---

func (e *Engine) all(r *http.Request, method, path string) Results {
	ws := e.workers()
	calls := make([]call, len(ws))
	for i, wk := range ws {
		calls[i] = call{w: wk, method: method, path: path}
	}
	return e.fanout(r.Context(), e.auth(r), calls)
}

// FlushAnswer is the answer of /flush_cache.
type FlushAnswer struct {
	Results
	TotalWorkers int    `json:"total_workers"`
	Message      string `json:"message"`
}

// flushCache flushes every worker. The cache is flushed only if every
// worker flushed it (an SGLang engine refuses, 400, while it runs
// requests): otherwise the answer is not 200, so that a client retrying
// until 200 retries. A refusal that every failed worker gave alike is
// passed on (400 from busy engines), anything else is a 502.
func (e *Engine) flushCache(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost, http.MethodGet) {
		return
	}
	ws := e.workers()
	auth := e.auth(r)
	res := e.fanoutDialect(r.Context(), auth, ws, route.EngineSGLang, 0, func(wk *route.Worker, k route.EngineKind) []call {
		if k == route.EngineVLLM {
			return []call{{w: wk, method: http.MethodPost, path: "/reset_prefix_cache"}}
		}
		return []call{{w: wk, method: http.MethodPost, path: PathFlushCache}}
	})
	ans := FlushAnswer{Results: res, TotalWorkers: len(res.Successful) + len(res.Failed)}
	code := fanoutStatus(res)
	switch {
	case ans.TotalWorkers == 0:
		ans.Message = "no workers"
	case len(res.Failed) == 0:
		ans.Message = "cache flushed on all " + strconv.Itoa(ans.TotalWorkers) + " workers"
	default:
		ans.Message = "cache not flushed on " + strconv.Itoa(len(res.Failed)) + " of " + strconv.Itoa(ans.TotalWorkers) + " workers"
		code = res.Failed[0].Status
		for _, f := range res.Failed {
			if f.Status != code || f.Status < 400 || f.Status > 499 {
				code = http.StatusBadGateway
				break
			}
		}
	}
	writeJSON(w, code, ans)
}

// Load is one worker's load in sgl-model-gateway's shape: load is the
// requests tetherd has in flight to the worker (exact: every request goes
// through tetherd).
type Load struct {
	Worker     string `json:"worker"`
	WorkerType string `json:"worker_type"`
	Load       int64  `json:"load"`
}

// LoadsAnswer is the answer of the data port's /get_loads and /v1/loads:
// sgl-model-gateway's loads list, and each worker's own /get_load answer.
type LoadsAnswer struct {
	Loads        []Load `json:"loads"`
	TotalWorkers int    `json:"total_workers"`
	Results
}

func (e *Engine) getLoads(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet) {
		return
	}
	res := e.all(r, http.MethodGet, "/get_load")
	ans := LoadsAnswer{Loads: []Load{}, Results: res}
	for _, list := range [][]Result{res.Successful, res.Failed} {
		for i := range list {
			if wk := e.cfg.Table.Get(list[i].Worker); wk != nil {
				n := wk.Stats.Pending()
				list[i].InFlight = &n
			}
		}
	}
	for _, wk := range e.workers() {
		ans.Loads = append(ans.Loads, Load{Worker: wk.URL, WorkerType: "regular", Load: int64(wk.Stats.Pending())})
	}
	ans.TotalWorkers = len(ans.Loads)
	writeJSON(w, fanoutStatus(res), ans)
}

// --- /finish_session ---

func (e *Engine) finishSession(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	id := r.URL.Query().Get("session_id")
	if id == "" {
		// Also accepted: {"session_id": "..."}.
		if body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20)); len(bytes.TrimSpace(body)) > 0 {
			var v struct {
				SessionID string `json:"session_id"`
			}
			if json.Unmarshal(body, &v) != nil {
				writeError(w, http.StatusBadRequest, `give ?session_id= or a JSON body {"session_id": "..."}`)
				return
			}
			id = v.SessionID
		}
	}
	if id == "" {
		writeError(w, http.StatusBadRequest, "missing session_id")
		return
	}
	finished := false
	if e.cfg.FinishSession != nil {
		finished = e.cfg.FinishSession(id)
	}
	writeJSON(w, http.StatusOK, map[string]any{"session_id": id, "finished": finished})
}
