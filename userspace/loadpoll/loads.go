package loadpoll

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"

	"github.com/tether-rl/tether/userspace/worker"
)

// parseLoads reads SGLang's /v1/loads: the sum over DP ranks of running
// and waiting, the token usage of all ranks together, the mean hit rate.
func parseLoads(body []byte) (worker.EngineSignals, error) {
	var v struct {
		Loads []struct {
			Running    *float64 `json:"num_running_reqs"`
			Waiting    *float64 `json:"num_waiting_reqs"`
			Used       *float64 `json:"num_used_tokens"`
			MaxTotal   *float64 `json:"max_total_num_tokens"`
			Usage      *float64 `json:"token_usage"`
			HitRate    *float64 `json:"cache_hit_rate"`
			MaxRunning *float64 `json:"max_running_requests"`
		} `json:"loads"`
	}
	if err := json.Unmarshal(body, &v); err != nil {
		return worker.EngineSignals{}, fmt.Errorf("GET /v1/loads: %w", err)
	}
	if len(v.Loads) == 0 {
		return worker.EngineSignals{}, errors.New("GET /v1/loads: no loads")
	}
	s := worker.EngineSignals{KVUsage: -1, HitRate: -1, Source: "v1/loads"}
	var used, total, usage, hit float64
	nUsage, nHit := 0, 0
	for _, l := range v.Loads {
		s.Running += count(l.Running)
		s.Waiting += count(l.Waiting)
		s.MaxRunning += count(l.MaxRunning)
		if l.Used != nil && l.MaxTotal != nil && *l.MaxTotal > 0 {
			used += *l.Used
			total += *l.MaxTotal
		}
		if u, ok := ratio(l.Usage); ok {
			usage += u
			nUsage++
		}
		if h, ok := ratio(l.HitRate); ok {
			hit += h
			nHit++
		}
	}
	switch {
	case nUsage > 0:
		s.KVUsage = usage / float64(nUsage)
	case total > 0:
		s.KVUsage = clamp01(used / total)
	}
	if nHit > 0 {
		s.HitRate = hit / float64(nHit)
	}
	return s, nil
}

// count is a non-negative whole count (NaN, negative, absent: 0).
func count(p *float64) int {
	if p == nil || !(*p > 0) || math.IsInf(*p, 0) {
		return 0
	}
	return int(min(*p, 1e9))
}

// ratio reads a 0..1 share; a value in (1, 100] is taken as a percentage,
// anything else (negative, NaN, above 100) as unknown: an engine that
// lies cannot veto itself forever or claim room it has not.
func ratio(p *float64) (float64, bool) {
	if p == nil {
		return 0, false
	}
	v := *p
	switch {
	case v >= 0 && v <= 1:
		return v, true
	case v > 1 && v <= 100:
		return v / 100, true
	}
	return 0, false
}

func clamp01(v float64) float64 { return max(0, min(v, 1)) }
