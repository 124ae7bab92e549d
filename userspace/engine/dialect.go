package engine

import (
	"context"
	"encoding/json"
	"net/http"
	"slices"
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// Each worker is spoken to in its own dialect: SGLang (/abort_request,
// /pause_generation, /continue_generation, /flush_cache) or vLLM
// (/abort_requests, /pause?mode=, /resume, /reset_prefix_cache). The kind
// is learned per worker (route.Worker.Engine): by the load poller (SGLang
// answers /v1/loads, vLLM's /metrics has vllm: names), or here, from a
// call that got 404 in one dialect and succeeded in the other. A worker
// of unknown kind is spoken to in the client's dialect first.

// dialect returns the engine kind to speak to w: the one learned, else
// the client's (prefer).
func dialect(w *worker.Worker, prefer worker.EngineKind) worker.EngineKind {
	switch k := w.Engine(); k {
	case worker.EngineSGLang, worker.EngineVLLM:
		return k
	}
	return prefer
}

// other is the other engine's dialect.
func other(k worker.EngineKind) worker.EngineKind {
	if k == worker.EngineVLLM {
		return worker.EngineSGLang
	}
	return worker.EngineVLLM
}

// fanoutDialect fans out to ws the calls build makes for each worker in
// its dialect (prefer: the client's, for a worker not learned yet). A
// worker not learned yet that answers 404 to every call is asked again
// in the other dialect, and what answered is learned: no call is a silent
// 404 because tetherd guessed the engine wrong.
func (e *Engine) fanoutDialect(ctx context.Context, auth string, ws []*worker.Worker, prefer worker.EngineKind, limit time.Duration,
	build func(w *worker.Worker, k worker.EngineKind) []call) Results {
	var calls []call
	for _, w := range ws {
		calls = append(calls, build(w, dialect(w, prefer))...)
	}
	res := e.fanoutTimeout(ctx, auth, calls, limit)
	var retry []*worker.Worker
	for _, w := range ws {
		if k := w.Engine(); k == worker.EngineSGLang || k == worker.EngineVLLM {
			continue
		}
		ok, notFound := false, false
		for _, r := range res.Successful {
			ok = ok || r.Worker == w.Slot
		}
		for _, r := range res.Failed {
			notFound = notFound || r.Worker == w.Slot && r.Status == http.StatusNotFound
		}
		// A success proves only that the worker takes that path (a
		// session server or a wrapper may take both): nothing is learned
		// from it. A 404 to one dialect and a success in the other is
		// learned.
		if !ok && notFound {
			retry = append(retry, w)
		}
	}
	if len(retry) == 0 {
		return res
	}
	calls = calls[:0]
	for _, w := range retry {
		calls = append(calls, build(w, other(prefer))...)
	}
	again := e.fanoutTimeout(ctx, auth, calls, limit)
	redone := func(slot int) bool {
		for _, w := range retry {
			if w.Slot == slot {
				return true
			}
		}
		return false
	}
	keep := func(rs []Result) []Result {
		out := rs[:0]
		for _, r := range rs {
			if !redone(r.Worker) {
				out = append(out, r)
			}
		}
		return out
	}
	res.Successful, res.Failed = keep(res.Successful), keep(res.Failed)
	for _, w := range retry {
		learned := false
		for _, r := range again.Successful {
			learned = learned || r.Worker == w.Slot
		}
		if learned {
			w.SetEngine(other(prefer))
		}
	}
	res.Successful = append(res.Successful, again.Successful...)
	res.Failed = append(res.Failed, again.Failed...)
	bySlot := func(a, b Result) int { return a.Worker - b.Worker }
	slices.SortStableFunc(res.Successful, bySlot)
	slices.SortStableFunc(res.Failed, bySlot)
	return res
}

// abortAll builds the abort-everything call of fanoutDialect.
func abortAll(w *worker.Worker, k worker.EngineKind) []call { return []call{abortAllCall(w, k)} }

// abortAllCall is the call that aborts everything on a worker of kind k
// (running, waiting and, for vLLM's delete-type abort, parked requests).
func abortAllCall(w *worker.Worker, k worker.EngineKind) call {
	if k == worker.EngineVLLM {
		return call{w: w, method: http.MethodPost, path: PathAbortRequests, body: []byte(`{}`)}
	}
	return call{w: w, method: http.MethodPost, path: PathAbortRequest, body: []byte(`{"abort_all":true}`)}
}

// abortIDsCalls are the calls that abort ids on a worker of kind k: one
// vLLM /abort_requests with the list, or one SGLang /abort_request per id.
func abortIDsCalls(w *worker.Worker, k worker.EngineKind, ids []string) []call {
	if k == worker.EngineVLLM {
		body, _ := json.Marshal(map[string]any{"request_ids": ids})
		return []call{{w: w, method: http.MethodPost, path: PathAbortRequests, body: body, rids: ids}}
	}
	out := make([]call, 0, len(ids))
	for _, id := range ids {
		body, _ := json.Marshal(map[string]any{"rid": id})
		out = append(out, call{w: w, method: http.MethodPost, path: PathAbortRequest, body: body, rids: []string{id}})
	}
	return out
}
