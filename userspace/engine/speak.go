package engine

import (
	"context"
	"net/http"
	"slices"
	"time"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/worker"
)

// Each worker is spoken to in its own dialect (userspace/dialect). The
// kind is learned per worker (worker.Worker.Engine): by the load poller
// (from what dialect detects in its answers), or here, from a call that
// got 404 in one dialect and succeeded in the other. A worker of unknown
// kind is spoken to in the client's dialect first.

// speak returns the dialect to speak to w: the one learned, else the
// client's (prefer).
func speak(w *worker.Worker, prefer dialect.Kind) *dialect.Dialect {
	if d := dialect.For(w.Engine()); d != nil {
		return d
	}
	return dialect.For(prefer)
}

// fanoutDialect fans out to ws the calls build makes for each worker in
// its dialect (prefer: the client's, for a worker not learned yet). A
// worker not learned yet that answers 404 to every call is asked again
// in another dialect, and what answered is learned: no call is a silent
// 404 because tetherd guessed the engine wrong.
func (e *Engine) fanoutDialect(ctx context.Context, auth string, ws []*worker.Worker, prefer dialect.Kind, limit time.Duration,
	build func(w *worker.Worker, d *dialect.Dialect) []call) Results {
	var calls []call
	for _, w := range ws {
		calls = append(calls, build(w, speak(w, prefer))...)
	}
	res := e.fanoutTimeout(ctx, auth, calls, limit)
	var retry []*worker.Worker
	for _, w := range ws {
		if dialect.Speaks(w.Engine()) {
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
	other := dialect.OtherThan(prefer)
	calls = calls[:0]
	for _, w := range retry {
		calls = append(calls, build(w, dialect.For(other))...)
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
			w.SetEngine(other)
		}
	}
	res.Successful = append(res.Successful, again.Successful...)
	res.Failed = append(res.Failed, again.Failed...)
	bySlot := func(a, b Result) int { return a.Worker - b.Worker }
	slices.SortStableFunc(res.Successful, bySlot)
	slices.SortStableFunc(res.Failed, bySlot)
	return res
}

// abortAll builds the abort-everything call of fanoutDialect (running,
// waiting and, where the engine's abort reaches them, parked requests).
func abortAll(w *worker.Worker, d *dialect.Dialect) []call {
	return []call{{w: w, Call: d.AbortAll()}}
}

// toCalls puts dialect calls to w.
func toCalls(w *worker.Worker, cs []dialect.Call) []call {
	out := make([]call, len(cs))
	for i, c := range cs {
		out[i] = call{w: w, Call: c}
	}
	return out
}
