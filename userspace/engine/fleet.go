package engine

// The fleet's weight sync, driven through tetherd in the engines' own
// words (userspace/fleet holds the state; this file the fan-outs):
//
//	POST /pause_generation {"mode":"abort"|"in_place"|"retract"}   SGLang
//	POST /pause?mode=abort|wait|keep                               vLLM
//	     From the first moment tetherd admits no new generation request to
//	     any engine (they wait in its hold). abort: what is in flight is
//	     aborted at its owner, in waves, until nothing is (partial outputs
//	     return on their streams); wait: until nothing is in flight; both
//	     bounded by ?timeout_s= (default 30). Then the pause goes to every
//	     engine in its own dialect, and the answer reports each worker and
//	     the requests held: 200, or 504 when the fleet did not go quiet in
//	     time, or 502 when an engine refused (the hold stays either way).
//	     in_place, retract and keep freeze what runs, by design.
//	POST /continue_generation   SGLang;   POST /resume   vLLM
//	     to every engine, then the held requests are released in arrival
//	     order (even if an engine failed: reported, never a stuck fleet).
//	POST /update_weights_from_disk, _from_distributed, _from_tensor,
//	     /init_weights_update_group, /destroy_weights_update_group,
//	     /update_weight_version (SGLang); /init_weight_transfer_engine,
//	     /start_weight_update, /update_weights, /finish_weight_update
//	     (vLLM); /release_memory_occupation, /resume_memory_occupation,
//	     /sleep, /wake_up, /reset_prefix_cache
//	     to every worker with the body and query byte-for-byte; each
//	     worker is fenced (no new work) while its call runs; per-worker
//	     results; any failure is not a 200; a worker added or removed
//	     during the fan-out is a 409 naming the epoch. A call that changes
//	     weights sets the fleet's target version (the body's
//	     "weight_version", SGLang's "new_version", else "tether-<n>") and
//	     every worker it failed on stays fenced until its version matches.
//	GET  /is_paused, /get_weight_version, /fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/route"
)

// Fleet endpoint paths.
const (
	PathPauseGeneration    = "/pause_generation"
	PathContinueGeneration = "/continue_generation"
	PathPause              = "/pause"
	PathResume             = "/resume"
	PathIsPaused           = "/is_paused"
	PathGetWeightVersion   = "/get_weight_version"
	PathFleet              = "/fleet"
)

// fleetLocal returns the handler of a fleet path, or nil. It runs on
// every proxied request: no allocation (string(path) in a switch and a
// map index is not converted).
func (e *Engine) fleetLocal(path []byte) http.Handler {
	if e.cfg.Fleet == nil {
		return nil
	}
	if e.cfg.Fleet.Forwarding() != nil && string(path) != PathFleet {
		// Retiring: the successor owns the fleet's phase; the call is
		// proxied there (a POST is held, so forwarded).
		return nil
	}
	switch string(path) {
	case PathPauseGeneration:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.pause(w, r, route.EngineSGLang) })
	case PathPause:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.pause(w, r, route.EngineVLLM) })
	case PathContinueGeneration:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.resume(w, r, route.EngineSGLang) })
	case PathResume:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.resume(w, r, route.EngineVLLM) })
	case PathIsPaused:
		return http.HandlerFunc(e.isPaused)
	case PathGetWeightVersion:
		return http.HandlerFunc(e.getWeightVersion)
	case PathFleet:
		return e.FleetHandler()
	}
	if k, ok := controlPaths[string(path)]; ok {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.control(w, r, k) })
	}
	return nil
}

// FleetHandler serves GET /fleet (the admin listener serves it too).
func (e *Engine) FleetHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !allowMethods(w, r, http.MethodGet, http.MethodHead) {
			return
		}
		writeJSON(w, http.StatusOK, e.cfg.Fleet.Report())
	})
}

// pauseMode normalizes a pause's mode to one of abort, wait, keep
// (SGLang's in_place), retract.
func pauseMode(client route.EngineKind, mode string) (string, bool) {
	if client == route.EngineSGLang {
		switch mode {
		case "", "abort":
			return "abort", true
		case "in_place":
			return "keep", true
		case "retract":
			return "retract", true
		}
		return "", false
	}
	switch mode {
	case "", "abort", "wait", "keep":
		if mode == "" {
			mode = "abort"
		}
		return mode, true
	}
	return "", false
}

// nativePause is the pause call for a worker of kind k in normalized
// mode m; quiet: nothing is in flight (a wait may be sent as is).
func nativePause(w *route.Worker, k route.EngineKind, m string, quiet bool) call {
	if k == route.EngineVLLM {
		vm := m
		switch {
		case m == "retract":
			vm = "keep"
		case m == "wait" && !quiet:
			vm = "keep" // a vLLM wait would block on what did not finish
		}
		return call{w: w, method: http.MethodPost, path: PathPause + "?mode=" + vm}
	}
	sm := map[string]string{"abort": "abort", "wait": "in_place", "keep": "in_place", "retract": "retract"}[m]
	return call{w: w, method: http.MethodPost, path: PathPauseGeneration, body: []byte(`{"mode":"` + sm + `"}`)}
}

// PauseAnswer is the answer of a pause.
type PauseAnswer struct {
	Phase        string    `json:"phase"`
	Mode         string    `json:"mode"`
	Quiet        bool      `json:"quiet"`      // nothing in flight to any engine
	Held         int       `json:"held"`       // requests waiting in tetherd
	HeldSince    string    `json:"held_since"` // from this moment nothing new reached an engine
	AbortWaves   int       `json:"abort_waves,omitempty"`
	QuiesceS     float64   `json:"quiesce_s"` // of ElapsedS, the time until nothing was in flight (or the timeout)
	ElapsedS     float64   `json:"elapsed_s"`
	Epoch        uint64    `json:"epoch"`
	StillRunning []Running `json:"still_running"`
	Successful   []Result  `json:"successful"`
	Failed       []Result  `json:"failed"`
	Message      string    `json:"message"`
	ClusterError string    `json:"cluster_error,omitempty"` // the cluster store was not written
}

func (e *Engine) pause(w http.ResponseWriter, r *http.Request, client route.EngineKind) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	q := r.URL.Query()
	var mode string
	var clientBody []byte
	if client == route.EngineSGLang {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			writeError(w, http.StatusBadRequest, "could not read the body")
			return
		}
		if b := bytes.TrimSpace(body); len(b) > 0 {
			var v struct {
				Mode *string `json:"mode"`
			}
			if b[0] != '{' || json.Unmarshal(b, &v) != nil {
				writeError(w, http.StatusBadRequest, `body must be a JSON object such as {"mode":"abort"}`)
				return
			}
			if v.Mode != nil {
				mode = *v.Mode
			}
			clientBody = body
		}
	} else {
		mode = q.Get("mode")
	}
	m, ok := pauseMode(client, mode)
	if !ok {
		modes := "abort, in_place or retract"
		if client == route.EngineVLLM {
			modes = "abort, wait or keep"
		}
		writeError(w, http.StatusBadRequest, "mode must be "+modes+", not "+strconv.Quote(mode))
		return
	}
	timeout, ok := e.timeoutParam(w, r, 30*time.Second)
	if !ok {
		return
	}
	if mode == "" {
		mode = "abort" // both engines' default
	}
	f := e.cfg.Fleet
	start := time.Now()
	// From here on nothing new is admitted to any engine.
	seq := f.BeginPause(mode)
	heldSince := time.Now()
	cerr := e.phaseChanged()
	ctx, cancel := context.WithDeadline(r.Context(), start.Add(timeout))
	defer cancel()
	auth := e.auth(r)
	ans := PauseAnswer{Mode: mode, Quiet: true, HeldSince: heldSince.UTC().Format(time.RFC3339Nano), Successful: []Result{}, Failed: []Result{}, StillRunning: []Running{}}
	stillOurs := func() bool { return f.PauseState(seq) == fleet.PauseOurs }
	switch m {
	case "abort":
		ans.Quiet, ans.AbortWaves = e.quiesce(ctx, auth, true, stillOurs)
	case "wait":
		ans.Quiet, _ = e.quiesce(ctx, auth, false, stillOurs)
	}
	ans.QuiesceS = math.Round(time.Since(start).Seconds()*1000) / 1000
	if st := f.PauseState(seq); st != fleet.PauseOurs {
		// Resumed (or paused again by another call) while it quiesced:
		// the engines are not paused by this call.
		e.pauseOvertaken(w, st, ans, start)
		return
	}
	// The pause itself, to every engine in its dialect (its own deadline:
	// a quiesce that used the whole timeout still pauses the engines).
	pctx, pcancel := context.WithTimeout(context.WithoutCancel(r.Context()), e.cfg.Timeout)
	defer pcancel()
	ws := e.workers()
	res := e.fanoutDialect(pctx, auth, ws, client, 0, func(wk *route.Worker, k route.EngineKind) []call {
		c := nativePause(wk, k, m, ans.Quiet)
		if k == client {
			// The client's own words: SGLang's body byte for byte; vLLM's
			// query with the engine's mode (a wait not drained in time
			// goes as keep) and without tetherd's own timeout_s.
			if client == route.EngineSGLang && clientBody != nil {
				c.body = clientBody
			} else if client == route.EngineVLLM && r.URL.RawQuery != "" {
				q := r.URL.Query()
				q.Del("timeout_s")
				native, _ := url.ParseQuery(strings.TrimPrefix(c.path, PathPause+"?"))
				q.Set("mode", native.Get("mode"))
				c.path = PathPause + "?" + q.Encode()
			}
		}
		return []call{c}
	})
	if st := f.FinishPause(seq); st != fleet.PauseOurs {
		// A resume came while the engines were being paused: they may
		// have paused after it. Resume them again, so that nothing is
		// parked in an engine of a serving fleet.
		if st == fleet.PauseResumed {
			e.fanoutDialect(pctx, auth, ws, client, 0, nativeResume(client, nil))
		}
		e.pauseOvertaken(w, st, ans, start)
		return
	}
	if err := e.phaseChanged(); cerr == nil {
		cerr = err
	}
	ans.Successful, ans.Failed = res.Successful, res.Failed
	ans.Phase = f.Phase().String()
	ans.Held = f.HeldNow()
	ans.Epoch = e.cfg.Table.Epoch()
	ans.StillRunning = e.running()
	ans.ElapsedS = math.Round(time.Since(start).Seconds()*1000) / 1000
	code := http.StatusOK
	switch {
	case !ans.Quiet:
		code = http.StatusGatewayTimeout
		ans.Message = "paused, but requests were still in flight after " + strconv.FormatFloat(timeout.Seconds(), 'f', -1, 64) + " s (still_running); new requests are held"
	case len(res.Failed) > 0:
		code = http.StatusBadGateway
		ans.Message = "paused on " + strconv.Itoa(len(res.Successful)) + " of " + strconv.Itoa(len(ws)) + " workers; new requests are held"
	default:
		ans.Message = "fleet paused and quiet: " + strconv.Itoa(len(ws)) + " workers; new requests are held"
	}
	code = clusterFailed(cerr, code, &ans.ClusterError, &ans.Message)
	writeJSON(w, code, ans)
}

// pauseOvertaken answers a pause that a resume (or a later pause) took
// over while it ran: 409, the engines' state is the other call's.
func (e *Engine) pauseOvertaken(w http.ResponseWriter, st fleet.PauseState, ans PauseAnswer, start time.Time) {
	ans.Phase = e.cfg.Fleet.Phase().String()
	ans.Held = e.cfg.Fleet.HeldNow()
	ans.Epoch = e.cfg.Table.Epoch()
	ans.ElapsedS = math.Round(time.Since(start).Seconds()*1000) / 1000
	ans.Message = "a resume came while this pause ran: the fleet serves, the engines were resumed"
	if st == fleet.PauseSuperseded {
		ans.Message = "another pause began while this one ran: that one pauses the engines"
	}
	writeJSON(w, http.StatusConflict, ans)
}

// nativeResume builds each engine's resume call; body, in the client's
// dialect, is sent as it came.
func nativeResume(client route.EngineKind, body []byte) func(wk *route.Worker, k route.EngineKind) []call {
	return func(wk *route.Worker, k route.EngineKind) []call {
		c := call{w: wk, method: http.MethodPost, path: PathContinueGeneration, body: []byte(`{}`)}
		if k == route.EngineVLLM {
			c = call{w: wk, method: http.MethodPost, path: PathResume}
		}
		if k == client && len(body) > 0 {
			c.body = body
		}
		return []call{c}
	}
}

// quiesce waits until nothing is in flight to any worker, aborting what
// is (abort: in waves, at the owners, in their dialects), until ctx ends
// or the pause is no longer ours (a resume took over). It reports whether
// the fleet went quiet and the waves sent.
func (e *Engine) quiesce(ctx context.Context, auth string, abort bool, ours func() bool) (bool, int) {
	waves := 0
	var last time.Time
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		busy := e.admitted()
		if len(busy) == 0 {
			return true, waves
		}
		if ctx.Err() != nil || !ours() {
			return false, waves
		}
		if abort && (waves == 0 || time.Since(last) >= e.cfg.WaveInterval) {
			e.fanoutDialect(ctx, auth, busy, route.EngineSGLang, 0, abortAll)
			waves++
			last = time.Now()
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
}

// admitted returns the workers with requests admitted (past tetherd's
// gates, on their way to or in the engine).
func (e *Engine) admitted() []*route.Worker {
	var out []*route.Worker
	for _, w := range e.workers() {
		if w.Admitted() > 0 {
			out = append(out, w)
		}
	}
	return out
}

// running lists what is still in flight, per worker.
func (e *Engine) running() []Running {
	out := []Running{}
	for _, wk := range e.admitted() {
		run := Running{Worker: wk.Slot, InFlight: uint64(wk.Admitted())}
		if e.cfg.Owners != nil {
			run.Rids = e.cfg.Owners.OnWorker(wk.Slot, 100)
		}
		out = append(out, run)
	}
	return out
}

// ResumeAnswer is the answer of a resume.
type ResumeAnswer struct {
	Phase      string   `json:"phase"`
	Released   int      `json:"released"` // held requests released, in arrival order
	Epoch      uint64   `json:"epoch"`
	Fenced     []int    `json:"fenced"` // workers whose weight version is not the fleet's: no new work
	Successful []Result `json:"successful"`
	Failed     []Result `json:"failed"`
	Message    string   `json:"message"`
	// ClusterError: the cluster store was not written (other replicas
	// still hold).
	ClusterError string `json:"cluster_error,omitempty"`
}

func (e *Engine) resume(w http.ResponseWriter, r *http.Request, client route.EngineKind) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		writeError(w, http.StatusBadRequest, "could not read the body")
		return
	}
	f := e.cfg.Fleet
	auth := e.auth(r)
	ctx, cancel := context.WithTimeout(r.Context(), e.cfg.Timeout)
	defer cancel()
	ws := e.workers()
	var clientBody []byte
	if len(bytes.TrimSpace(body)) > 0 {
		clientBody = body
	}
	res := e.fanoutDialect(ctx, auth, ws, client, 0, nativeResume(client, clientBody))
	held := f.HeldNow()
	// Released whatever the engines said: a dead engine never keeps the
	// fleet held (it is reported, and health checks take it out).
	f.SetPhase(fleet.Serving, "")
	cerr := e.phaseChanged()
	ans := ResumeAnswer{Phase: f.Phase().String(), Released: held, Epoch: e.cfg.Table.Epoch(), Fenced: e.fenced(),
		Successful: res.Successful, Failed: res.Failed}
	code := http.StatusOK
	if len(res.Failed) > 0 {
		code = http.StatusBadGateway
		ans.Message = "resumed on " + strconv.Itoa(len(res.Successful)) + " of " + strconv.Itoa(len(ws)) + " workers; held requests released"
	} else {
		ans.Message = "fleet resumed: " + strconv.Itoa(len(ws)) + " workers; held requests released"
	}
	if ans.Phase != fleet.Serving.String() {
		ans.Message += "; still holding: another replica's pause or the cluster store is out of sight"
	}
	code = clusterFailed(cerr, code, &ans.ClusterError, &ans.Message)
	writeJSON(w, code, ans)
}

// fenced lists the workers kept from new work by their weight version.
func (e *Engine) fenced() []int {
	out := []int{}
	for _, wk := range e.workers() {
		if wk.Fenced()&route.FenceVersion != 0 {
			out = append(out, wk.Slot)
		}
	}
	return out
}
