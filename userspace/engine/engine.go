// Package engine serves tetherd's inference-engine endpoints on the data
// port (through proxy Config.Local): aborts that reach the worker owning a
// request, and fan-outs to every worker. It also tracks which worker serves
// each request id in flight (Owners, the router's RequestOwners).
//
//	abort (dialect OpAbort, each engine's form: one id or everything, or a
//	     list of ids or everything): to the owner of each id when known,
//	     else to every worker, each in its own dialect
//	POST /abort_until_idle?timeout_s=T
//	                         abort everything in waves until tetherd has nothing
//	                         in flight to any worker, or T seconds (default 30) pass
//	cache flush (dialect OpFlush)
//	                         to every worker in its dialect (GET accepted too)
//	loads (dialect OpLoads)  every worker's own load answer, and the loads list
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
// (a cache flush: not 200 unless every worker flushed). Every call carries
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

	"github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/worker"
	"github.com/tether-rl/tether/userspace/workerclient"
)

// Config configures an Engine. Zero values take the defaults.
type Config struct {
	Table  *worker.Table
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
	client *workerclient.Client
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
// tetherd's flag (settings, flags.go).
func (s Settings) Validate() error { return config.Validate(s.settings()) }

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
	client := workerclient.New(workerclient.Options{
		DialTimeout:        cfg.Timeout,
		DialKeepAlive:      30 * time.Second,
		MaxIdlePerHost:     4,
		IdleTimeout:        60 * time.Second,
		MaxBody:            maxWorkerResponse,
		DisableCompression: true,
		FollowRedirects:    true,
		APIKey:             cfg.WorkerAPIKey,
	})
	e := &Engine{cfg: cfg, client: client}
	if cfg.Fleet != nil {
		cfg.Fleet.SetAsk(e.askVersion)
	}
	return e
}

// Close releases idle connections to the workers.
func (e *Engine) Close() { e.client.Close() }

// tetherd's own endpoint paths (the engines' are dialect's).
const (
	PathAbortUntilIdle = "/abort_until_idle"
	PathFinishSession  = "/finish_session"
)

// Local is the proxy Config.Local hook: the handler of an engine endpoint,
// or nil to proxy the request. It allocates nothing for other paths.
func (e *Engine) Local(method, path []byte) http.Handler {
	if i := bytes.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	switch string(path) {
	case PathAbortUntilIdle:
		return http.HandlerFunc(e.abortUntilIdle)
	case PathFinishSession:
		return http.HandlerFunc(e.finishSession)
	}
	ep, ok := dialect.Served(path)
	if ok {
		switch ep.Op {
		case dialect.OpAbort:
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.abort(w, r, ep.Kind) })
		case dialect.OpFlush:
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.flushCache(w, r, ep.Kind) })
		case dialect.OpLoads:
			return e.GetLoadsHandler()
		}
	}
	if h := e.fleetLocal(path, ep); h != nil {
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

// GetLoadsHandler fans the engines' own load read out to every worker
// (the data port's loads list; the admin listener serves tetherd's own
// counts).
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

// call is a dialect Call to one worker.
type call struct {
	w *worker.Worker
	dialect.Call
	auth  string        // the client's Authorization ("": the worker API key's)
	limit time.Duration // bound of this call (0: Config.Timeout)
}

// maxWorkerResponse bounds a worker's answer kept in a result.
const maxWorkerResponse = 64 << 10

// auth is the Authorization the calls for client request r carry: the
// client's own, else ("") the configured worker API key (workerclient).
func (e *Engine) auth(r *http.Request) string { return r.Header.Get("Authorization") }

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
	r := Result{Worker: c.w.Slot, RequestIDs: c.IDs}
	limit := c.limit
	if limit <= 0 {
		limit = e.cfg.Timeout
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	a, err := e.client.Do(ctx, c.w.URL, c.Call, c.auth)
	switch {
	case errors.Is(err, workerclient.ErrBadURL):
		e.cfg.Log.Warn("engine fan-out: bad request", "worker", c.w.Slot, "path", c.Path, "err", err)
		r.Error = "bad worker url"
		return r
	case errors.Is(err, workerclient.ErrCutShort):
		r.Status = a.Status
		r.Error = "response cut short"
		return r
	case err != nil:
		e.cfg.Log.Warn("engine fan-out: call failed", "worker", c.w.Slot, "path", c.Path, "err", err)
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
	r.Status = a.Status
	if b := bytes.TrimSpace(a.Body); len(b) > 0 && json.Valid(b) {
		r.Response = b
	}
	if !a.OK() {
		r.Error = "worker answered " + strconv.Itoa(a.Status)
	}
	return r
}

// workers returns every worker in the table, whatever its state: an
// unhealthy worker may still run requests worth aborting.
func (e *Engine) workers() []*worker.Worker {
	var out []*worker.Worker
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

// --- cache flush, loads ---

// all makes c to every worker.
func (e *Engine) all(r *http.Request, c dialect.Call) Results {
	ws := e.workers()
	calls := make([]call, len(ws))
	for i, wk := range ws {
		calls[i] = call{w: wk, Call: c}
	}
	return e.fanout(r.Context(), e.auth(r), calls)
}

// FlushAnswer is the answer of a cache flush.
type FlushAnswer struct {
	Results
	TotalWorkers int    `json:"total_workers"`
	Message      string `json:"message"`
}

// flushCache flushes every worker, each in its dialect. The cache is
// flushed only if every worker flushed it (an engine may refuse, 400,
// while it runs requests): otherwise the answer is not 200, so that a client retrying
// until 200 retries. A refusal that every failed worker gave alike is
// passed on (400 from busy engines), anything else is a 502.
func (e *Engine) flushCache(w http.ResponseWriter, r *http.Request, client dialect.Kind) {
	if !allowMethods(w, r, http.MethodPost, http.MethodGet) {
		return
	}
	ws := e.workers()
	auth := e.auth(r)
	res := e.fanoutDialect(r.Context(), auth, ws, client, 0, func(wk *worker.Worker, d *dialect.Dialect) []call {
		return []call{{w: wk, Call: d.FlushCache()}}
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

// LoadsAnswer is the answer of the data port's loads list:
// sgl-model-gateway's, and each worker's own load answer.
type LoadsAnswer struct {
	Loads        []Load `json:"loads"`
	TotalWorkers int    `json:"total_workers"`
	Results
}

func (e *Engine) getLoads(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet) {
		return
	}
	res := e.all(r, dialect.AnyLegacyLoadCall())
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
