package registry

import (
	"time"

	"github.com/tether-rl/tether/userspace/worker"
)

// EngineInfo is a worker's engine as the load poller last read it
// (userspace/loadpoll): GET /workers shows it per worker.
type EngineInfo struct {
	Kind    string `json:"kind"`    // sglang, vllm, unknown
	Source  string `json:"source"`  // v1/loads, metrics; "" while none answered
	Signals bool   `json:"signals"` // placement uses them (answered recently)
	Running int    `json:"running"`
	Waiting int    `json:"waiting"`
	// KVUsage and PrefixHitRate: 0..1, null when the engine does not say.
	KVUsage       *float64   `json:"kv_usage"`
	PrefixHitRate *float64   `json:"prefix_hit_rate"`
	MaxRunning    int        `json:"max_running,omitempty"`
	WeightVersion string     `json:"weight_version,omitempty"`
	Vetoed        bool       `json:"vetoed"`         // takes no new keys, sessions or keyless work
	Hold          int        `json:"hold,omitempty"` // every engine vetoed: admissions held at this many in flight
	PolledAt      *time.Time `json:"polled_at,omitempty"`
	PollFailures  int        `json:"poll_failures,omitempty"`
	LastPollError string     `json:"last_poll_error,omitempty"`
}

func engineInfo(w *worker.Worker) *EngineInfo {
	v, ok := w.EngineState()
	if !ok {
		return nil
	}
	in := &EngineInfo{Kind: w.Engine().String(), Source: v.Source, Signals: v.Known,
		Running: v.Running, Waiting: v.Waiting, MaxRunning: v.MaxRunning, WeightVersion: v.WeightVersion,
		Vetoed: v.Known && v.Vetoed, Hold: v.Held, PollFailures: v.Failures, LastPollError: v.LastErr}
	if v.KVUsage >= 0 && v.Source != "" {
		u := v.KVUsage
		in.KVUsage = &u
	}
	if v.HitRate >= 0 && v.Source != "" {
		h := v.HitRate
		in.PrefixHitRate = &h
	}
	if !v.PolledAt.IsZero() {
		t := v.PolledAt
		in.PolledAt = &t
	}
	return in
}
