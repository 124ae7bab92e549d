package route

import "github.com/tether-rl/tether/userspace/dialect"

// EngineKind is what serves behind a worker's URL, as tetherd learned it
// (the load poller from the answers dialect detects, the fleet control
// from the answers to its calls). It picks the dialect of every call
// tetherd makes to the worker on its own account (userspace/dialect).
type EngineKind = dialect.Kind

// The kinds, as dialect declares them (kept here for route's callers).
const (
	EngineUnknown = dialect.Unknown // not learned yet (or a plain session worker)
	EngineSGLang  = dialect.SGLang
	EngineVLLM    = dialect.VLLM
	EngineOther   = dialect.Other // answers HTTP but is neither engine: no engine calls
)

// Engine returns the kind of engine learned for the worker.
func (w *Worker) Engine() EngineKind { return EngineKind(w.engine.Load()) }

// SetEngine records the kind of engine the worker serves.
func (w *Worker) SetEngine(k EngineKind) { w.engine.Store(int32(k)) }
