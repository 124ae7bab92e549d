package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tether-rl/tether/userspace/worker"
)

// Engine signals (userspace/loadpoll, route/engine_load.go): what each
// worker's engine last reported, and its veto. Series exist for the
// workers whose load endpoint was ever read or tried.
var (
	dEngineUp = prometheus.NewDesc("tether_engine_up",
		"1 while placement uses the engine's load signals (its load endpoint answered recently), 0 once it stopped answering.", []string{"slot", "url"}, nil)
	dEngineInfo = prometheus.NewDesc("tether_engine_info",
		"The engine kind tetherd learned and the endpoint its load is read from (1).", []string{"slot", "url", "kind", "source"}, nil)
	dEngineRunning = prometheus.NewDesc("tether_engine_running",
		"Requests in the engine's running batch, as last read.", []string{"slot", "url"}, nil)
	dEngineWaiting = prometheus.NewDesc("tether_engine_waiting",
		"Requests waiting in the engine's queue, as last read.", []string{"slot", "url"}, nil)
	dEngineKV = prometheus.NewDesc("tether_engine_kv_usage",
		"The engine's KV cache usage (0..1), as last read.", []string{"slot", "url"}, nil)
	dEngineHit = prometheus.NewDesc("tether_engine_prefix_hit_rate",
		"The engine's prefix cache hit rate (0..1), as last read (vLLM: over the last poll interval).", []string{"slot", "url"}, nil)
	dEngineVetoed = prometheus.NewDesc("tether_engine_vetoed",
		"1 while the engine takes no new keys, sessions or keyless work (KV usage >= --kv-veto or more than --waiting-veto waiting, with hysteresis).", []string{"slot", "url"}, nil)
	dEngineHeld = prometheus.NewDesc("tether_engine_hold",
		"While every engine is vetoed: the requests in flight the worker's admissions are held at (0: no hold).", []string{"slot", "url"}, nil)
	dEngineFailures = prometheus.NewDesc("tether_engine_poll_failures",
		"Load polls of the engine failed in a row.", []string{"slot", "url"}, nil)
	dEngineVersion = prometheus.NewDesc("tether_engine_weight_version_info",
		"The weight version the engine reported (1).", []string{"slot", "url", "version"}, nil)
)

type engineCollector struct{ tab *worker.Table }

func (c engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dEngineUp, dEngineInfo, dEngineRunning, dEngineWaiting, dEngineKV, dEngineHit,
		dEngineVetoed, dEngineHeld, dEngineFailures, dEngineVersion} {
		ch <- d
	}
}

func (c engineCollector) Collect(ch chan<- prometheus.Metric) {
	for _, w := range c.tab.Snapshot() {
		if w == nil {
			continue
		}
		v, ok := w.EngineState()
		if !ok {
			continue
		}
		slot := strconv.Itoa(w.Slot)
		ch <- gauge(dEngineUp, b2f(v.Known), slot, w.URL)
		ch <- gauge(dEngineFailures, float64(v.Failures), slot, w.URL)
		if v.Source == "" {
			continue
		}
		ch <- gauge(dEngineInfo, 1, slot, w.URL, w.Engine().String(), v.Source)
		ch <- gauge(dEngineRunning, float64(v.Running), slot, w.URL)
		ch <- gauge(dEngineWaiting, float64(v.Waiting), slot, w.URL)
		if v.KVUsage >= 0 {
			ch <- gauge(dEngineKV, v.KVUsage, slot, w.URL)
		}
		if v.HitRate >= 0 {
			ch <- gauge(dEngineHit, v.HitRate, slot, w.URL)
		}
		ch <- gauge(dEngineVetoed, b2f(v.Known && v.Vetoed), slot, w.URL)
		ch <- gauge(dEngineHeld, float64(v.Held), slot, w.URL)
		if v.WeightVersion != "" {
			ch <- gauge(dEngineVersion, 1, slot, w.URL, v.WeightVersion)
		}
	}
}
