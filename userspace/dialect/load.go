package dialect

import (
	"bufio"
	"bytes"
	"encoding/json"
	"math"
	"strconv"
)

// Load is one reading of an engine's load.
type Load struct {
	Running int // requests in the running batch
	Waiting int // requests queued in the engine
	// KVUsage: the share of the KV cache in use, 0..1 (negative: unknown).
	KVUsage float64
	// HitRate: the prefix cache's hit rate, 0..1 (negative: unknown).
	HitRate    float64
	MaxRunning int    // the engine's running batch bound (0: unknown)
	Source     string // "v1/loads" or "metrics"
}

// Counters are an engine's prefix cache counters at a reading, kept by
// the caller for the next (a hit rate over the interval).
type Counters struct{ Queries, Hits float64 }

// MetricsCall is the Prometheus exposition every engine serves.
var MetricsCall = Call{Method: "GET", Path: "/metrics"}

// LoadsCall returns the JSON load endpoint read before /metrics (the
// first engine that serves one) and the engine that serves it.
func LoadsCall() (Call, Kind, bool) {
	for _, d := range order {
		if d.Loads != nil {
			return *d.Loads, d.Kind, true
		}
	}
	return Call{}, Unknown, false
}

// ParseLoads reads the answer of LoadsCall in the words of k (its engine).
func ParseLoads(k Kind, body []byte) (Load, error) {
	return table[k].ParseLoads(body)
}

// ParseMetrics reads the Prometheus text exposition by the engines'
// metric names, whatever the labels (summed over label sets, usage the
// highest), and detects the engine; prev: the counters of the previous
// reading (the hit rate over the interval), next: this reading's. ok
// false: no engine's metric.
func ParseMetrics(body []byte, prev Counters) (l Load, kind Kind, next Counters, ok bool) {
	l = Load{KVUsage: -1, HitRate: -1, Source: "metrics"}
	next = prev
	var usage, queries, hits, gauge float64
	haveUsage, haveQ, haveGauge := false, false, false
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
		m, known := metrics[name]
		if !known {
			continue
		}
		if m.Detect && m.kind > kind {
			kind = m.kind
		}
		switch m.Field {
		case Running:
			l.Running += count(&v)
		case Waiting:
			l.Waiting += count(&v)
		case KVUsage:
			if u, ok := ratio(&v); ok && (!haveUsage || u > usage) {
				usage, haveUsage = u, true
			}
		case Queries:
			haveQ = true
			queries += max(v, 0)
		case Hits:
			hits += max(v, 0)
		case HitRate:
			if h, ok := ratio(&v); ok {
				gauge, haveGauge = h, true
			}
		case MaxRunning:
			l.MaxRunning += count(&v)
		}
	}
	if kind == Unknown {
		return l, Unknown, prev, false
	}
	if haveUsage {
		l.KVUsage = usage
	}
	if table[kind].HitRateFromCounters {
		if haveQ {
			dq, dh := queries-prev.Queries, hits-prev.Hits
			if dq > 0 && dh >= 0 && dh <= dq {
				l.HitRate = dh / dq
			} else if queries > 0 && hits <= queries {
				l.HitRate = hits / queries
			}
			next = Counters{queries, hits}
		}
	} else if haveGauge {
		l.HitRate = gauge
	}
	return l, kind, next, true
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

// VersionField names the weight version in a version answer (tetherd's
// own answers use it too, so a trainer reads tetherd as it reads an
// engine).
const VersionField = "weight_version"

// ParseVersion reads a weight version answer ({"weight_version": V}): V a
// string, or a number written in its shortest form; ok false for anything
// else (absent, null, another type, no JSON object). The one parser of an
// engine's weight version.
func ParseVersion(body []byte) (string, bool) {
	var v struct {
		WeightVersion any `json:"weight_version"`
	}
	if json.Unmarshal(body, &v) != nil || v.WeightVersion == nil {
		return "", false
	}
	switch x := v.WeightVersion.(type) {
	case string:
		return x, true
	case float64:
		return strconv.FormatFloat(x, 'f', -1, 64), true
	}
	return "", false
}
