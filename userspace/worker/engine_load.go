package worker

import (
	"math"
	"sync/atomic"
	"time"
)

// Engine signals: what the load poller (userspace/loadpoll) last read from
// a worker's engine (its JSON load endpoint or its Prometheus metrics, as
// userspace/dialect reads them). The poller writes them once per --engine-poll; the data
// path reads two atomics per worker (sig, base) next to the in-flight count
// it reads today, and never waits for the poller.

// EngineSignals are one reading of an engine's load.
type EngineSignals struct {
	Running int // requests in the running batch
	Waiting int // requests queued in the engine
	// KVUsage: the share of the KV cache in use, 0..1 (negative: unknown).
	KVUsage float64
	// HitRate: the prefix cache's hit rate, 0..1 (negative: unknown).
	HitRate    float64
	MaxRunning int // the engine's running batch bound (0: unknown)
	// WeightVersion, when the engine says.
	WeightVersion string
	Source        string // "v1/loads", "get_load" or "metrics"
}

// EngineView is a worker's engine state for display (admin /workers,
// /metrics): the last signals, whether placement uses them, the veto.
type EngineView struct {
	EngineSignals
	Known    bool      // placement uses the signals (fresh)
	Vetoed   bool      // takes no new keys, sessions or keyless work
	Held     int       // all engines vetoed: admissions held at this many in flight (0: none)
	PolledAt time.Time // the last successful reading
	Failures int       // polls failed in a row
	LastErr  string    // the last failure
}

// Packed signals (engineLoad.sig): one atomic word, so that the data path
// sees one consistent reading.
const (
	sigKnown  = 1 << 0
	sigVetoed = 1 << 1
	sigKVOnly = 1 << 2 // vetoed for its KV usage alone: lifts once tetherd's requests there drop it below the low mark
	sigLowOff = 3      // the KV low mark in 1/8192, 13 bits
	sigKVOff  = 16     // KV usage in 1/10000, 16 bits
	sigWork   = 32     // running + waiting, 32 bits
)

// engineLoad is a worker's part of the engine signals (Worker.load).
type engineLoad struct {
	sig  atomic.Uint64 // packed, see sig*
	base atomic.Uint64 // Stats.Pending() when the signals were read
	// hold: admissions held at this many in flight while every engine is
	// vetoed (0: no hold); the gate reads it (admitLimit).
	hold atomic.Int64
	view atomic.Pointer[EngineView]
}

// SetEngineSignals records a reading of the worker's engine (the poller):
// placement uses it from now on, with the requests routed to the worker
// since (the change of its in-flight count) credited on top. vetoed is
// the veto the caller decided (route.EnginePlacement.Veto, with hysteresis);
// kvLow, when above 0, says it is for the KV usage alone and lifts as
// soon as the usage, scaled by the share of the reported work still in
// flight, is below kvLow (placement moves no more keys off the engine
// than it takes to get there before the next reading).
func (w *Worker) SetEngineSignals(s EngineSignals, vetoed bool, kvLow float64, at time.Time) {
	sig := uint64(sigKnown)
	if vetoed {
		sig |= sigVetoed
		if kvLow > 0 && kvLow < 1 {
			sig |= sigKVOnly | uint64(kvLow*8192)<<sigLowOff
		}
	}
	kv := s.KVUsage
	if !(kv >= 0) { // negative or NaN: unknown, no penalty
		kv = 0
	}
	sig |= uint64(math.Round(min(kv, 1)*10000)) << sigKVOff
	work := int64(max(s.Running, 0)) + int64(max(s.Waiting, 0))
	sig |= uint64(min(work, math.MaxUint32)) << sigWork
	w.load.base.Store(w.Stats.Pending())
	w.load.sig.Store(sig)
	w.load.view.Store(&EngineView{EngineSignals: s, Known: true, Vetoed: vetoed, Held: int(w.load.hold.Load()), PolledAt: at})
}

// ForgetEngineSignals stops placement from using the worker's signals (its
// engine stopped answering its load endpoint, or never had one): the
// worker is placed by its in-flight count, as without signals, and is not
// vetoed. failures and err are kept for display; source names the
// endpoint last read ("" when none ever answered).
func (w *Worker) ForgetEngineSignals(failures int, err error) {
	w.load.sig.Store(0)
	w.SetEngineHold(0)
	v := EngineView{Failures: failures}
	if old := w.load.view.Load(); old != nil {
		v.EngineSignals, v.PolledAt = old.EngineSignals, old.PolledAt
	}
	if err != nil {
		v.LastErr = err.Error()
	}
	w.load.view.Store(&v)
}

// NoteEngineFailure records a failed poll while the last signals are still
// in use (display only).
func (w *Worker) NoteEngineFailure(failures int, err error) {
	old := w.load.view.Load()
	if old == nil {
		old = &EngineView{}
	}
	v := *old
	v.Failures = failures
	if err != nil {
		v.LastErr = err.Error()
	}
	w.load.view.Store(&v)
}

// EngineState returns the worker's engine state; ok false when nothing was
// ever read or tried.
func (w *Worker) EngineState() (EngineView, bool) {
	v := w.load.view.Load()
	if v == nil {
		return EngineView{}, false
	}
	out := *v
	out.Held = int(w.load.hold.Load())
	return out, true
}

// EngineKnown reports whether placement uses engine signals for w.
func (w *Worker) EngineKnown() bool { return w.load.sig.Load()&sigKnown != 0 }

// EngineVetoed reports whether w's engine is vetoed (KV or queue full) at
// its last reading.
func (w *Worker) EngineVetoed() bool { return w.load.sig.Load()&sigVetoed != 0 }

// EngineVetoedNow is the veto with the requests that left since the
// reading taken into account (see SetEngineSignals).
func (w *Worker) EngineVetoedNow() bool {
	if w.load.sig.Load()&sigVetoed == 0 {
		return false
	}
	_, v := w.EngineScore()
	return v
}

// SetEngineHold holds the worker's admissions at n requests in flight (0:
// no hold): while every engine is vetoed, requests wait in tetherd's queue
// (the gate: --max-queue, --queue-timeout, 503 + Retry-After when full)
// instead of piling onto engines whose KV cache is full. Lifting it lets
// the waiters in.
func (w *Worker) SetEngineHold(n int64) {
	if n < 0 {
		n = 0
	}
	if w.load.hold.Swap(n) == n {
		return
	}
	w.gate.mu.Lock()
	w.handOffLocked()
	w.gate.mu.Unlock()
}

// EngineHold returns the hold set by SetEngineHold (0: none).
func (w *Worker) EngineHold() int64 { return w.load.hold.Load() }

// admitLimit is the gate's limit: max_in_flight, lowered to the engine
// hold while one is set (0: no limit).
func (w *Worker) admitLimit() int64 {
	limit := int64(w.maxInFlight.Load())
	if h := w.load.hold.Load(); h > 0 && (limit == 0 || h < limit) {
		return h
	}
	return limit
}

// EngineScore is the expected time to serve one more request on w, in
// requests: the work the engine reported (running + waiting) plus the
// requests tetherd routed to it since (never less than tetherd's own in
// flight there), plus this one, times a penalty that rises toward a full
// KV cache. Without signals it is the in-flight count plus one. vetoed
// reports the engine's veto.
func (w *Worker) EngineScore() (score float64, vetoed bool) {
	score, vetoed, _ = w.EngineEstimate()
	return score, vetoed
}

// EngineEstimate is EngineScore with the KV usage it used.
func (w *Worker) EngineEstimate() (score float64, vetoed bool, u float64) {
	pend := w.Stats.Pending()
	sig := w.load.sig.Load()
	if sig&sigKnown == 0 {
		return float64(pend + 1), false, 0
	}
	work := int64(sig >> sigWork)
	est := work + int64(pend) - int64(w.load.base.Load())
	if est < int64(pend) {
		est = int64(pend)
	}
	u = float64((sig>>sigKVOff)&0xffff) / 10000
	if est < work {
		// Requests ended or moved since the reading: their KV is free.
		u = u * float64(est) / float64(work)
	}
	vetoed = sig&sigVetoed != 0
	if vetoed && sig&sigKVOnly != 0 && u < float64((sig>>sigLowOff)&0x1fff)/8192 {
		vetoed = false
	}
	return float64(est+1) * kvPenalty(u), vetoed, u
}

// kvPenalty is 1/(1-u²): 1 when the KV cache is empty, 1.33 at half, 2.8
// at 0.8, 5.3 at 0.9, 10 at 0.95 (capped at 50): an engine whose cache is
// nearly full soon preempts or evicts, so it is worth a longer queue
// elsewhere.
func kvPenalty(u float64) float64 {
	d := 1 - u*u
	if d < 0.02 {
		d = 0.02
	}
	return 1 / d
}
