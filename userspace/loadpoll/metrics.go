package loadpoll

import (
	"bufio"
	"bytes"
	"strconv"

	"github.com/tether-rl/tether/userspace/worker"
)

// parseMetrics reads the Prometheus text exposition: vLLM's or SGLang's
// gauges and counters by name (summed over label sets, usage the highest).
func parseMetrics(body []byte, st *wstate) (worker.EngineSignals, worker.EngineKind, bool) {
	s := worker.EngineSignals{KVUsage: -1, HitRate: -1, Source: "metrics"}
	var vllm, sgl bool
	var usage, queries, hits, sglHit float64
	haveUsage, haveQ, haveSglHit := false, false, false
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 || line[0] == '#' {
			continue
		}
		name, v, ok := metricLine(line)
		if !ok {
			continue
		}
		switch name {
		case "vllm:num_requests_running":
			vllm = true
			s.Running += count(&v)
		case "vllm:num_requests_waiting":
			vllm = true
			s.Waiting += count(&v)
		case "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc":
			vllm = true
			if u, ok := ratio(&v); ok && (!haveUsage || u > usage) {
				usage, haveUsage = u, true
			}
		case "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total":
			vllm, haveQ = true, true
			queries += max(v, 0)
		case "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total":
			vllm = true
			hits += max(v, 0)
		case "sglang:num_running_reqs":
			sgl = true
			s.Running += count(&v)
		case "sglang:num_queue_reqs":
			sgl = true
			s.Waiting += count(&v)
		case "sglang:token_usage":
			sgl = true
			if u, ok := ratio(&v); ok && (!haveUsage || u > usage) {
				usage, haveUsage = u, true
			}
		case "sglang:cache_hit_rate":
			sgl = true
			if h, ok := ratio(&v); ok {
				sglHit, haveSglHit = h, true
			}
		case "sglang:max_running_requests":
			s.MaxRunning += count(&v)
		}
	}
	if !vllm && !sgl {
		return s, worker.EngineUnknown, false
	}
	if haveUsage {
		s.KVUsage = usage
	}
	kind := worker.EngineSGLang
	if vllm {
		kind = worker.EngineVLLM
		if haveQ {
			dq, dh := queries-st.queries, hits-st.hits
			if dq > 0 && dh >= 0 && dh <= dq {
				s.HitRate = dh / dq
			} else if queries > 0 && hits <= queries {
				s.HitRate = hits / queries
			}
			st.queries, st.hits = queries, hits
		}
	} else if haveSglHit {
		s.HitRate = sglHit
	}
	return s, kind, true
}

// metricLine splits "name{labels} value [timestamp]".
func metricLine(line []byte) (string, float64, bool) {
	end := bytes.IndexAny(line, "{ \t")
	if end <= 0 {
		return "", 0, false
	}
	name := line[:end]
	rest := line[end:]
	if rest[0] == '{' {
		// Label values may hold '}' inside quotes: find the closing brace
		// outside them.
		inq := false
		i := 1
		for ; i < len(rest); i++ {
			c := rest[i]
			if inq {
				if c == '\\' {
					i++
				} else if c == '"' {
					inq = false
				}
				continue
			}
			if c == '"' {
				inq = true
			} else if c == '}' {
				break
			}
		}
		if i >= len(rest) {
			return "", 0, false
		}
		rest = rest[i+1:]
	}
	f := bytes.Fields(rest)
	if len(f) == 0 {
		return "", 0, false
	}
	v, err := strconv.ParseFloat(string(f[0]), 64)
	if err != nil {
		return "", 0, false
	}
	return string(name), v, true
}
