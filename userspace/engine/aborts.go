package engine

// Aborts that reach the worker owning a request, in its dialect
// (dialect.go), and /abort_until_idle's waves.

import (
	"context"
	"encoding/json"
	"math"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// AbortAnswer is the answer of /abort_request and /abort_requests.
type AbortAnswer struct {
	Rid        string   `json:"rid,omitempty"`
	RequestIDs int      `json:"request_ids,omitempty"` // how many were asked
	Routed     string   `json:"routed"`                // "owner", "owners" or "all"
	Successful []Result `json:"successful"`
	Failed     []Result `json:"failed"`
}

func (e *Engine) abortRequest(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	m, ok := readObject(w, r)
	if !ok {
		return
	}
	var rid string
	var all bool
	if raw, ok := m["rid"]; ok {
		if err := json.Unmarshal(raw, &rid); err != nil || jsonKind(raw) != "a string" {
			writeError(w, http.StatusBadRequest, `"rid" must be a string, not `+jsonKind(raw))
			return
		}
	}
	if raw, ok := m["abort_all"]; ok {
		if err := json.Unmarshal(raw, &all); err != nil || jsonKind(raw) != "a boolean" {
			writeError(w, http.StatusBadRequest, `"abort_all" must be a boolean, not `+jsonKind(raw))
			return
		}
	}
	if rid == "" && !all {
		writeError(w, http.StatusBadRequest, `give "rid" (a non-empty string) or "abort_all": true`)
		return
	}
	body, _ := json.Marshal(m) // the client's fields, forwarded
	targets := e.workers()
	routed := "all"
	if !all && e.cfg.Owners != nil {
		if slot, ok := e.cfg.Owners.Owner([]byte(rid)); ok {
			if wk := e.cfg.Table.Get(slot); wk != nil {
				targets, routed = []*worker.Worker{wk}, "owner"
			}
		}
	}
	auth := e.auth(r)
	res := e.fanoutDialect(r.Context(), auth, targets, worker.EngineSGLang, 0, func(wk *worker.Worker, k worker.EngineKind) []call {
		switch {
		case k != worker.EngineVLLM:
			return []call{{w: wk, method: http.MethodPost, path: PathAbortRequest, body: body}}
		case all:
			return []call{abortAllCall(wk, k)}
		}
		return abortIDsCalls(wk, k, []string{rid})
	})
	writeJSON(w, fanoutStatus(res), AbortAnswer{Rid: rid, Routed: routed, Successful: res.Successful, Failed: res.Failed})
}

// --- /abort_requests ---

func (e *Engine) abortRequests(w http.ResponseWriter, r *http.Request) {
	if !allowMethods(w, r, http.MethodPost) {
		return
	}
	m, ok := readObject(w, r)
	if !ok {
		return
	}
	raw, ok := m["request_ids"]
	if !ok && len(m) == 0 {
		// vLLM's abort-everything form, {}: as it came, to every worker.
		// (Any other body without ids is a mistake, refused below: an
		// SGLang {"rid":..} sent here must not abort everything.)
		body, _ := json.Marshal(m)
		ws := e.workers()
		auth := e.auth(r)
		res := e.fanoutDialect(r.Context(), auth, ws, worker.EngineVLLM, 0, func(wk *worker.Worker, k worker.EngineKind) []call {
			if k == worker.EngineSGLang {
				return []call{abortAllCall(wk, k)}
			}
			return []call{{w: wk, method: http.MethodPost, path: PathAbortRequests, body: body}}
		})
		writeJSON(w, fanoutStatus(res), AbortAnswer{Routed: "all", Successful: res.Successful, Failed: res.Failed})
		return
	}
	if !ok {
		writeError(w, http.StatusBadRequest, `missing "request_ids" (a list of strings; {} aborts everything)`)
		return
	}
	if k := jsonKind(raw); k != "a list" {
		writeError(w, http.StatusBadRequest, `"request_ids" must be a list of strings, not `+k)
		return
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		writeError(w, http.StatusBadRequest, `"request_ids" must be a list of strings`)
		return
	}
	if len(items) == 0 {
		writeError(w, http.StatusBadRequest, `"request_ids" is empty`)
		return
	}
	ids := make([]string, 0, len(items))
	for i, it := range items {
		var s string
		if jsonKind(it) != "a string" || json.Unmarshal(it, &s) != nil || s == "" {
			writeError(w, http.StatusBadRequest, `"request_ids"[`+strconv.Itoa(i)+`] must be a non-empty string, not `+jsonKind(it))
			return
		}
		ids = append(ids, s)
	}
	ids = dedupe(ids)

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
	build := func(wk *worker.Worker, k worker.EngineKind) []call {
		send := sends[wk.Slot]
		if k == worker.EngineSGLang {
			return abortIDsCalls(wk, k, send)
		}
		mm := make(map[string]json.RawMessage, len(m))
		for k, v := range m {
			mm[k] = v
		}
		mm["request_ids"], _ = json.Marshal(send)
		body, _ := json.Marshal(mm)
		return []call{{w: wk, method: http.MethodPost, path: PathAbortRequests, body: body, rids: send}}
	}
	routed := "owners"
	if len(unknown) > 0 {
		routed = "all"
	}
	res := e.fanoutDialect(r.Context(), auth, targets, worker.EngineVLLM, 0, build)
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
			res := e.fanoutDialect(ctx, auth, busy, worker.EngineSGLang, 0, abortAll)
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
