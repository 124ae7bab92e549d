package worker

import "github.com/tether-rl/tether/userspace/dialect"

// The engine kind is what serves behind a worker's URL, as tetherd learned
// it (the load poller from the answers dialect detects, the fleet control
// from the answers to its calls): it picks the dialect of every call
// tetherd makes to the worker on its own account (userspace/dialect).

// Engine returns the kind of engine learned for the worker
// (dialect.Unknown until one is).
func (w *Worker) Engine() dialect.Kind { return dialect.Kind(w.engine.Load()) }

// SetEngine records the kind of engine the worker serves.
func (w *Worker) SetEngine(k dialect.Kind) { w.engine.Store(int32(k)) }
