package engine

// The fleet's weight sync, driven through tetherd in the engines' own
// words (userspace/fleet holds the state; this file the fan-outs; the
// words are userspace/dialect's):
//
//	pause (each engine's pause, in its words and modes)
//	     From the first moment tetherd admits no new generation request to
//	     any engine (they wait in its hold). abort: what is in flight is
//	     aborted at its owner, in waves, until nothing is (partial outputs
//	     return on their streams); wait: until nothing is in flight; both
//	     bounded by ?timeout_s= (default 30). Then the pause goes to every
//	     engine in its own dialect, and the answer reports each worker and
//	     the requests held: 200, or 504 when the fleet did not go quiet in
//	     time, or 502 when an engine refused (the hold stays either way).
//	     keep and retract freeze what runs, by design.
//	resume (each engine's)
//	     to every engine, then the held requests are released in arrival
//	     order (even if an engine failed: reported, never a stuck fleet).
//	weight updates, their groups, memory and sleep (dialect OpUpdate)
//	     to every worker with the body and query byte-for-byte; each
//	     worker is fenced (no new work) while its call runs; per-worker
//	     results; any failure is not a 200; a worker added or removed
//	     during the fan-out is a 409 naming the epoch. A call that changes
//	     weights sets the fleet's target version (the body's version field,
//	     dialect.BodyVersion, else "tether-<n>") and every worker it failed
//	     on stays fenced until its version matches.
//	is paused, the weight version (dialect OpIsPaused, OpVersion); GET /fleet

import (
	"bytes"
	"context"
	"io"
	"math"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/worker"
)

// PathFleet is tetherd's own fleet report.
const PathFleet = "/fleet"

// fleetLocal returns the handler of a fleet path (ep: what dialect says
// of it), or nil. It runs on every proxied request: no allocation
// (string(path) in a switch and a map index is not converted).
func (e *Engine) fleetLocal(path []byte, ep dialect.Endpoint) http.Handler {
	if e.cfg.Fleet == nil {
		return nil
	}
	if e.cfg.Fleet.Forwarding() != nil && string(path) != PathFleet {
		// Retiring: the successor owns the fleet's phase; the call is
		// proxied there (a POST is held, so forwarded).
		return nil
	}
	if string(path) == PathFleet {
		return e.FleetHandler()
	}
	switch ep.Op {
	case dialect.OpPause:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.pause(w, r, ep.Kind) })
	case dialect.OpResume:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.resume(w, r, ep.Kind) })
	case dialect.OpIsPaused:
		return http.HandlerFunc(e.isPaused)
	case dialect.OpVersion:
		return http.HandlerFunc(e.getWeightVersion)
	case dialect.OpUpdate:
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { e.control(w, r, ep.Update) })
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

func (e *Engine) pause(w http.ResponseWriter, r *http.Request, client dialect.Kind) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	d := dialect.For(client)
	var body []byte
	if d.PauseInBody {
		var err error
		if body, err = io.ReadAll(io.LimitReader(r.Body, 1<<20)); err != nil {
			writeError(w, http.StatusBadRequest, "could not read the body")
			return
		}
	}
	mode, clientBody, msg := d.ClientPause(body, r.URL.Query())
	if msg != "" {
		writeError(w, http.StatusBadRequest, msg)
		return
	}
	m, ok := d.PauseMode(mode)
	if !ok {
		writeError(w, http.StatusBadRequest, "mode must be "+d.PauseModes+", not "+strconv.Quote(mode))
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
	case dialect.PauseAbort:
		ans.Quiet, ans.AbortWaves = e.quiesce(ctx, auth, true, stillOurs)
	case dialect.PauseWait:
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
	// The client's own words go to engines of its kind: its body, or its
	// query without tetherd's own timeout_s (with the engine's mode).
	var query url.Values
	if r.URL.RawQuery != "" {
		query = r.URL.Query()
		query.Del("timeout_s")
	}
	res := e.fanoutDialect(pctx, auth, ws, client, 0, func(wk *worker.Worker, d *dialect.Dialect) []call {
		c := d.Pause(m, ans.Quiet)
		if d.Kind == client {
			c = d.PauseAsClient(c, m, ans.Quiet, clientBody, query)
		}
		return []call{{w: wk, Call: c}}
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
func nativeResume(client dialect.Kind, body []byte) func(wk *worker.Worker, d *dialect.Dialect) []call {
	return func(wk *worker.Worker, d *dialect.Dialect) []call {
		c := d.Resume()
		if d.Kind == client && len(body) > 0 {
			c.Body = body
		}
		return []call{{w: wk, Call: c}}
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
			e.fanoutDialect(ctx, auth, busy, dialect.Default(), 0, abortAll)
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
func (e *Engine) admitted() []*worker.Worker {
	var out []*worker.Worker
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

func (e *Engine) resume(w http.ResponseWriter, r *http.Request, client dialect.Kind) {
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
		if wk.Fenced()&worker.FenceVersion != 0 {
			out = append(out, wk.Slot)
		}
	}
	return out
}
