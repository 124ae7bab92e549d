package engine

// Aborts that reach the worker owning a request, in its dialect
// (speak.go), and /abort_until_idle's waves.

import (
	"context"
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/worker"
)

// AbortAnswer is the answer of an abort.
type AbortAnswer struct {
	Rid        string   `json:"rid,omitempty"`
	RequestIDs int      `json:"request_ids,omitempty"` // how many were asked
	Routed     string   `json:"routed"`                // "owner", "owners" or "all"
	Successful []Result `json:"successful"`
	Failed     []Result `json:"failed"`
}

// abort serves an engine's abort in client's words (dialect ParseAbort):
// to the owners of the ids named when known, else to every worker, each
// in its own dialect; a worker of the client's kind gets the client's
// body (or fields) as they came.
func (e *Engine) abort(w http.ResponseWriter, r *http.Request, client dialect.Kind) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	m, ok := readObject(w, r)
	if !ok {
		return
	}
	d := dialect.For(client)
	a, msg := d.ParseAbort(m)
	if msg != "" {
		writeError(w, http.StatusBadRequest, msg)
		return
	}
	if d.AbortForm == dialect.OneID {
		e.abortOne(w, r, client, m, a)
		return
	}
	e.abortList(w, r, client, m, a)
}

// abortOne aborts one id, or everything, in the words of an engine whose
// abort names one id.
func (e *Engine) abortOne(w http.ResponseWriter, r *http.Request, client dialect.Kind, m map[string]json.RawMessage, a dialect.Abort) {
	var rid string
	if len(a.IDs) > 0 {
		rid = a.IDs[0]
	}
	body, _ := json.Marshal(m) // the client's fields, forwarded
	targets := e.workers()
	routed := "all"
	if !a.All && e.cfg.Owners != nil {
		if slot, ok := e.cfg.Owners.Owner([]byte(rid)); ok {
			if wk := e.cfg.Table.Get(slot); wk != nil {
				targets, routed = []*worker.Worker{wk}, "owner"
			}
		}
	}
	auth := e.auth(r)
	res := e.fanoutDialect(r.Context(), auth, targets, client, 0, func(wk *worker.Worker, d *dialect.Dialect) []call {
		switch {
		case d.Kind == client:
			return []call{{w: wk, Call: d.AbortAsClient(body)}}
		case a.All:
			return abortAll(wk, d)
		}
		return toCalls(wk, d.AbortIDs([]string{rid}, nil))
	})
	writeJSON(w, fanoutStatus(res), AbortAnswer{Rid: rid, Routed: routed, Successful: res.Successful, Failed: res.Failed})
}

// abortList aborts ids, or everything, in the words of an engine whose
// abort names a list.
func (e *Engine) abortList(w http.ResponseWriter, r *http.Request, client dialect.Kind, m map[string]json.RawMessage, a dialect.Abort) {
	if a.All {
		// Everything: as it came, to every worker.
		body, _ := json.Marshal(m)
		ws := e.workers()
		auth := e.auth(r)
		res := e.fanoutDialect(r.Context(), auth, ws, client, 0, func(wk *worker.Worker, d *dialect.Dialect) []call {
			if d.Kind != client {
				return abortAll(wk, d)
			}
			return []call{{w: wk, Call: d.AbortAsClient(body)}}
		})
		writeJSON(w, fanoutStatus(res), AbortAnswer{Routed: "all", Successful: res.Successful, Failed: res.Failed})
		return
	}
	ids := dedupe(a.IDs)

	// Group by owner; unknown ids go to every worker.
	known := map[int][]string{}
	var unknown []string
	for _, id := range ids {
		if e.cfg.Owners != nil {
			if slot, ok := e.cfg.Owners.Owner([]byte(id)); ok && e.cfg.Table.Get(slot) != nil {
				known[slot] = append(known[slot], id)
				continue
			}
		}
		unknown = append(unknown, id)
	}
	auth := e.auth(r)
	sends := map[int][]string{}
	var targets []*worker.Worker
	for _, wk := range e.workers() {
		if send := append(slices.Clone(known[wk.Slot]), unknown...); len(send) > 0 {
			sends[wk.Slot] = send
			targets = append(targets, wk)
		}
	}
	build := func(wk *worker.Worker, d *dialect.Dialect) []call {
		return toCalls(wk, d.AbortIDs(sends[wk.Slot], m)) // the client's other fields go to its own kind
	}
	routed := "owners"
	if len(unknown) > 0 {
		routed = "all"
	}
	res := e.fanoutDialect(r.Context(), auth, targets, client, 0, build)
	writeJSON(w, fanoutStatus(res), AbortAnswer{RequestIDs: len(ids), Routed: routed, Successful: res.Successful, Failed: res.Failed})
}

func dedupe(s []string) []string {
	seen := make(map[string]bool, len(s))
	out := s[:0]
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}

// --- /abort_until_idle ---

// Running is what a worker still has in flight.
type Running struct {
	Worker   int      `json:"worker"`
	InFlight uint64   `json:"in_flight"`      // tetherd's count
	Rids     []string `json:"rids,omitempty"` // tracked ids (at most 100)
}

// IdleAnswer is the answer of /abort_until_idle.
type IdleAnswer struct {
	Idle         bool      `json:"idle"`
	Waves        int       `json:"waves"`
	ElapsedS     float64   `json:"elapsed_s"`
	StillRunning []Running `json:"still_running"`
	Failed       []Result  `json:"failed"` // abort calls that failed in the last wave
}

func (e *Engine) busy() []*worker.Worker {
	var out []*worker.Worker
	for _, w := range e.workers() {
		if w.Stats.Pending() > 0 {
			out = append(out, w)
		}
	}
	return out
}

func (e *Engine) abortUntilIdle(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	timeout := 30 * time.Second
	if v := r.URL.Query().Get("timeout_s"); v != "" {
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || math.IsNaN(f) || f < 0 || f > e.cfg.MaxIdleTimeout.Seconds() {
			writeError(w, http.StatusBadRequest, "timeout_s must be a number of seconds from 0 to "+strconv.FormatFloat(e.cfg.MaxIdleTimeout.Seconds(), 'f', -1, 64))
			return
		}
		timeout = time.Duration(f * float64(time.Second))
	}
	start := time.Now()
	deadline := start.Add(timeout)
	ctx, cancel := context.WithDeadline(r.Context(), deadline)
	defer cancel()
	auth := e.auth(r)
	var ans IdleAnswer
	ans.Failed = []Result{}
	var lastWave time.Time
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		busy := e.busy()
		if len(busy) == 0 {
			ans.Idle = true
			break
		}
		if ctx.Err() != nil {
			break
		}
		if ans.Waves == 0 || time.Since(lastWave) >= e.cfg.WaveInterval {
			res := e.fanoutDialect(ctx, auth, busy, dialect.Default(), 0, abortAll)
			ans.Failed = res.Failed
			ans.Waves++
			lastWave = time.Now()
		}
		select {
		case <-ctx.Done():
		case <-tick.C:
		}
	}
	ans.ElapsedS = math.Round(time.Since(start).Seconds()*1000) / 1000
	ans.StillRunning = []Running{}
	for _, wk := range e.busy() {
		run := Running{Worker: wk.Slot, InFlight: wk.Stats.Pending()}
		if e.cfg.Owners != nil {
			run.Rids = e.cfg.Owners.OnWorker(wk.Slot, 100)
			slices.Sort(run.Rids)
		}
		ans.StillRunning = append(ans.StillRunning, run)
	}
	ans.Idle = len(ans.StillRunning) == 0
	writeJSON(w, http.StatusOK, ans)
}
