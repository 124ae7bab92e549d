package worker

// EngineKind is what serves behind a worker's URL, as tetherd learned it
// (the load poller from /v1/loads or /metrics, the fleet control from the
// answers to its calls). It picks the dialect of every call tetherd makes
// to the worker on its own account: SGLang's /abort_request and
// /pause_generation, vLLM's /abort_requests and /pause.
type EngineKind int32

const (
	EngineUnknown EngineKind = iota // not learned yet (or a plain session worker)
	EngineSGLang
	EngineVLLM
	EngineOther // answers HTTP but is neither engine: no engine calls
)

func (k EngineKind) String() string {
	switch k {
	case EngineSGLang:
		return "sglang"
	case EngineVLLM:
		return "vllm"
	case EngineOther:
		return "other"
	}
	return "unknown"
}

// Engine returns the kind of engine learned for the worker.
func (w *Worker) Engine() EngineKind { return EngineKind(w.engine.Load()) }

// SetEngine records the kind of engine the worker serves.
func (w *Worker) SetEngine(k EngineKind) { w.engine.Store(int32(k)) }
