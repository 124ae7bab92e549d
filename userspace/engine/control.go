package engine

// The sync's other calls, fanned out with a report: weight updates and
// their groups, memory, versions (see fleet.go's header).

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
)

// MaxControlBody bounds the body of a fanned-out control call (the
// proxy's MaxLocalBody): serialized tensors of an update from tensors
// fit; larger weights go by disk or a distributed group.
const MaxControlBody = 16 << 20

// ControlAnswer is the answer of a fanned-out control call.
type ControlAnswer struct {
	Success       bool     `json:"success"`
	Message       string   `json:"message"`
	WeightVersion string   `json:"weight_version,omitempty"` // the fleet's target after the call
	Epoch         uint64   `json:"epoch"`
	Fenced        []int    `json:"fenced"`
	Successful    []Result `json:"successful"`
	Failed        []Result `json:"failed"`
	ClusterError  string   `json:"cluster_error,omitempty"` // the cluster store was not written
}

func (e *Engine) control(w http.ResponseWriter, r *http.Request, kind dialect.Update) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxControlBody+1))
	if err == nil && len(body) > MaxControlBody {
		writeError(w, http.StatusRequestEntityTooLarge, "body larger than "+strconv.Itoa(MaxControlBody)+" bytes")
		return
	}
	if err != nil {
		writeError(w, http.StatusBadRequest, "could not read the body")
		return
	}
	var fields map[string]json.RawMessage
	if b := bytes.TrimSpace(body); len(b) > 0 {
		if b[0] != '{' || json.Unmarshal(b, &fields) != nil {
			writeError(w, http.StatusBadRequest, "body must be a JSON object")
			return
		}
	}
	version := dialect.BodyVersion(fields)
	if kind == dialect.SetVersion && version == "" {
		writeError(w, http.StatusBadRequest, dialect.SetVersionMissing)
		return
	}
	f := e.cfg.Fleet
	path := r.URL.Path
	if r.URL.RawQuery != "" {
		path += "?" + r.URL.RawQuery
	}
	epoch := e.cfg.Table.Epoch()
	ws := e.workers()
	if v := r.Header.Get(route.TargetWorkerHeader); v != "" {
		// One engine's own call (an NCCL group's init carries each
		// engine's rank_offset): to that worker only, still tracked.
		wk := e.targetWorker(v)
		if wk == nil {
			writeError(w, http.StatusBadRequest, route.TargetWorkerHeader+" names no worker: "+strconv.Quote(v))
			return
		}
		ws = []*worker.Worker{wk}
	}
	changes := kind == dialect.Weights || kind == dialect.OpenUpdate || kind == dialect.CloseUpdate
	if kind == dialect.Weights && f.UpdateOpen() {
		// A chunked update (OpenUpdate): the version changes at its close.
		kind, changes = dialect.Plain, true
	}
	if changes {
		for _, wk := range ws {
			f.Updating(wk, true)
		}
	}
	calls := make([]call, len(ws))
	for i, wk := range ws {
		calls[i] = call{w: wk, Call: dialect.Call{Method: http.MethodPost, Path: path, Body: body}}
	}
	ctx, cancel := context.WithTimeout(r.Context(), e.cfg.UpdateTimeout)
	defer cancel()
	res := e.fanoutTimeout(ctx, e.auth(r), calls, e.cfg.UpdateTimeout)
	newVersion := kind == dialect.Weights || kind == dialect.CloseUpdate || kind == dialect.SetVersion
	if newVersion && len(res.Successful) > 0 {
		if version == "" {
			version = f.RoundVersion()
		}
		// The workers called, by slot (not the table now: a worker put
		// into a slot during the fan-out did not get the update).
		called := make(map[int]*worker.Worker, len(ws))
		for _, wk := range ws {
			called[wk.Slot] = wk
		}
		for _, s := range res.Successful {
			if wk := called[s.Worker]; wk != nil {
				f.SetVersion(wk.URL, version)
			}
		}
		f.SetTarget(version)
	}
	var cerr error
	if newVersion && len(res.Successful) > 0 {
		cerr = e.syncChanged(false)
	}
	switch kind {
	case dialect.OpenUpdate:
		f.SetUpdateOpen(true, e.cfg.UpdateTimeout)
	case dialect.CloseUpdate:
		f.SetUpdateOpen(false, 0)
	}
	if newVersion && len(ws) > 1 {
		f.CloseRound() // a fleet-wide update is the sync's last word
	}
	if !f.UpdateOpen() {
		for _, wk := range ws {
			f.Updating(wk, false)
		}
	}
	now := e.cfg.Table.Epoch()
	ans := ControlAnswer{WeightVersion: f.Target(), Epoch: now, Fenced: e.fenced(), Successful: res.Successful, Failed: res.Failed}
	code := http.StatusOK
	switch {
	case now != epoch:
		code = http.StatusConflict
		ans.Message = "workers were added or removed during the fan-out (epoch " + strconv.FormatUint(epoch, 10) + " → " + strconv.FormatUint(now, 10) + "): the fleet as it is now did not all get the call"
	case len(ws) == 0:
		code = http.StatusServiceUnavailable
		ans.Message = "no workers"
	case len(res.Failed) > 0:
		code = http.StatusBadGateway
		if c := res.Failed[0].Status; c >= 400 && c < 500 {
			code = c
			for _, x := range res.Failed {
				if x.Status != c {
					code = http.StatusBadGateway
				}
			}
		}
		ans.Message = "failed on " + strconv.Itoa(len(res.Failed)) + " of " + strconv.Itoa(len(ws)) + " workers"
		if newVersion && len(res.Successful) > 0 {
			ans.Message += "; they take no new work until their weight version is " + version
		}
	default:
		ans.Success = true
		ans.Message = "done on all " + strconv.Itoa(len(ws)) + " workers"
	}
	if code = clusterFailed(cerr, code, &ans.ClusterError, &ans.Message); cerr != nil {
		ans.Success = false
	}
	writeJSON(w, code, ans)
}

func (e *Engine) isPaused(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet, http.MethodHead) {
		return
	}
	p := e.cfg.Fleet.Phase()
	writeJSON(w, http.StatusOK, map[string]any{"is_paused": p != fleet.Serving, "phase": p.String()})
}

// getWeightVersion answers the fleet's target; with none set, the
// version the workers report (dialect.AnyVersionCall, fanned out), when
// they agree.
func (e *Engine) getWeightVersion(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodGet, http.MethodPost) {
		return
	}
	f := e.cfg.Fleet
	if t := f.Target(); t != "" {
		writeJSON(w, http.StatusOK, map[string]any{dialect.VersionField: t, "source": "fleet"})
		return
	}
	res := e.all(r, dialect.AnyVersionCall())
	seen := map[string]int{}
	var best string
	for _, s := range res.Successful {
		if v, ok := dialect.ParseVersion(s.Response); ok && v != "" {
			if wk := e.cfg.Table.Get(s.Worker); wk != nil {
				f.SetVersion(wk.URL, v)
			}
			seen[v]++
			if seen[v] > seen[best] {
				best = v
			}
		}
	}
	code := fanoutStatus(res)
	if best == "" && code == http.StatusOK {
		code = http.StatusBadGateway
	}
	writeJSON(w, code, map[string]any{dialect.VersionField: best, "agreed": len(seen) == 1, "successful": res.Successful, "failed": res.Failed})
}

// phaseChanged tells the cluster (if any) this replica's phase.
func (e *Engine) phaseChanged() error { return e.syncChanged(true) }

// syncChanged tells the cluster (if any) this replica's sync state: after
// a phase change (phase) or a change of target or versions.
func (e *Engine) syncChanged(phase bool) error {
	if e.cfg.OnPhase == nil {
		return nil
	}
	return e.cfg.OnPhase(e.cfg.Fleet.Export(), phase)
}

// clusterFailed reports a cluster store that was not written (err) in an
// answer: its message and cluster_error say so, and a 200 becomes a 503
// (the other replicas do not know).
func clusterFailed(err error, code int, field, msg *string) int {
	if err == nil {
		return code
	}
	*field = err.Error()
	*msg += "; the cluster store was not written: the other replicas do not know (" + err.Error() + ")"
	if code == http.StatusOK {
		code = http.StatusServiceUnavailable
	}
	return code
}

// timeoutParam reads ?timeout_s= (def when absent); it answers 400 itself.
func (e *Engine) timeoutParam(w http.ResponseWriter, r *http.Request, def time.Duration) (time.Duration, bool) {
	v := r.URL.Query().Get("timeout_s")
	if v == "" {
		return def, true
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || math.IsNaN(f) || f < 0 || f > e.cfg.MaxIdleTimeout.Seconds() {
		writeError(w, http.StatusBadRequest, "timeout_s must be a number of seconds from 0 to "+strconv.FormatFloat(e.cfg.MaxIdleTimeout.Seconds(), 'f', -1, 64))
		return 0, false
	}
	return time.Duration(f * float64(time.Second)), true
}

// askVersion asks a worker that joined the fleet its weight version
// (dialect.AnyVersionCall) and records what it says: one with the fleet's
// weights is unfenced at once; one that cannot say stays fenced until an
// update through tetherd.
func (e *Engine) askVersion(w *worker.Worker) {
	ctx, cancel := context.WithTimeout(context.Background(), e.cfg.Timeout)
	defer cancel()
	c := call{w: w, Call: dialect.AnyVersionCall()} // with the worker API key
	r := e.do(ctx, &c)
	v, ok := dialect.ParseVersion(r.Response)
	if r.Error != "" || !ok || v == "" {
		e.cfg.Log.Info("fleet: a joining worker could not say its weight version: fenced until an update", "worker", w.Slot, "url", w.URL, "target", e.cfg.Fleet.Target())
		return
	}
	if e.cfg.Table.Get(w.Slot) == w {
		e.cfg.Fleet.SetVersion(w.URL, v)
	}
}

// targetWorker returns the worker a X-SMG-Target-Worker value names (a
// slot or a URL), or nil.
func (e *Engine) targetWorker(v string) *worker.Worker {
	if n, err := strconv.Atoi(v); err == nil && strconv.Itoa(n) == v {
		return e.cfg.Table.Get(n)
	}
	for _, w := range e.workers() {
		if w.URL == v {
			return w
		}
	}
	return nil
}
