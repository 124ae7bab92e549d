package fleet

import (
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// Weight versions and the fences they set (route/fence.go).

// onChange runs as the table's membership changes. A worker put into it
// is fenced before it is routable (Putting) and again once it is
// (PutDone: a target set in between reached it too) if the fleet has a
// target and the worker's version differs or is unknown. Once a worker is
// in the table or removed, held requests are woken to be placed again (it
// may be theirs, or theirs may be gone).
func (f *Fleet) onChange(w *worker.Worker, ev worker.TableEvent) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ev == worker.Removed {
		if len(f.waiters) > 0 {
			f.wakeLocked()
		}
		return
	}
	f.fenceLocked(w)
	if ev == worker.Putting {
		return
	}
	if f.target != "" && f.versions[w.URL] == "" && f.ask != nil {
		go f.ask(w)
	}
	if len(f.waiters) > 0 {
		f.wakeLocked()
	}
}

func (f *Fleet) fenceLocked(w *worker.Worker) {
	if f.updating[w.URL] {
		w.Fence(worker.FenceUpdating)
	} else {
		w.Unfence(worker.FenceUpdating)
	}
	if f.target != "" && f.versions[w.URL] != f.target {
		w.Fence(worker.FenceVersion)
	} else {
		w.Unfence(worker.FenceVersion)
	}
}

// refenceLocked recomputes every worker's fence and wakes the hold if
// some worker became free (f.mu held).
func (f *Fleet) refenceLocked() {
	if f.cfg.Table == nil {
		return
	}
	freed := false
	for _, w := range f.cfg.Table.Snapshot() {
		if w == nil {
			continue
		}
		before := w.Fenced()
		f.fenceLocked(w)
		if before != 0 && w.Fenced() == 0 {
			freed = true
		}
	}
	if freed {
		f.wakeLocked()
	}
}

// Updating fences (true) or frees (false) a worker while a weight update
// call runs on it.
func (f *Fleet) Updating(w *worker.Worker, on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if on {
		f.updating[w.URL] = true
	} else {
		delete(f.updating, w.URL)
	}
	f.refenceLocked()
}

// SetVersion records a worker's weight version.
func (f *Fleet) SetVersion(url, v string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.versions[url] = v
	f.refenceLocked()
}

// SetVersions records workers' versions and sets the target, at once
// (the cluster's fleet key): no worker is fenced in between.
func (f *Fleet) SetVersions(target string, versions map[string]string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for u, v := range versions {
		f.versions[u] = v
	}
	f.target = target
	f.refenceLocked()
}

// Version returns a worker's weight version ("": unknown).
func (f *Fleet) Version(url string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.versions[url]
}

// SetTarget sets the fleet's weight version: a worker at another version
// takes no new work until it matches. "" lifts the gate.
func (f *Fleet) SetTarget(v string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.target = v
	f.refenceLocked()
}

// Target returns the fleet's weight version ("": none set).
func (f *Fleet) Target() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.target
}

// SetUpdateOpen records that a chunked (vLLM start/finish) weight update
// is open: the workers stay fenced as updating until it closes, or until
// bound passes (a trainer that died mid-update does not fence the fleet
// for good).
func (f *Fleet) SetUpdateOpen(on bool, bound time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.open = on
	f.openSeq++
	if !on || bound <= 0 {
		return
	}
	seq := f.openSeq
	time.AfterFunc(bound, func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.open && f.openSeq == seq {
			f.open = false
			clear(f.updating)
			f.refenceLocked()
		}
	})
}

// UpdateOpen reports whether a chunked weight update is open.
func (f *Fleet) UpdateOpen() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.open
}
