package daemon

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// KV-event placement's metrics, read at scrape time.

type kvCollector struct{ d *Daemon }

var (
	kvLabels  = []string{"url", "rank"}
	kvSubDesc = map[string]*prometheus.Desc{}
	kvSubHelp = [][3]string{
		{"tether_kv_events_total", "counter", "KV-cache events received from the worker's engine (DP rank), in batches applied."},
		{"tether_kv_event_batches_total", "counter", "KV-event batches applied."},
		{"tether_kv_event_malformed_total", "counter", "KV-event messages dropped as malformed."},
		{"tether_kv_event_gaps_total", "counter", "Sequence gaps seen."},
		{"tether_kv_event_replays_total", "counter", "Replays asked of the engine's replay endpoint."},
		{"tether_kv_event_replay_failures_total", "counter", "Replays that failed or came back short (the engine's entries cleared)."},
		{"tether_kv_event_restarts_total", "counter", "Engine restarts seen (sequence going backwards)."},
		{"tether_kv_event_lost_total", "counter", "Connections to the publisher lost (entries cleared)."},
		{"tether_kv_event_clears_total", "counter", "Times the engine's entries were cleared by the subscriber."},
		{"tether_kv_event_connected", "gauge", "1 while subscribed to the publisher."},
		{"tether_kv_blocks_indexed", "gauge", "Blocks of the engine's cache in the index now."},
	}
	kvIndexEntries  = prometheus.NewDesc("tether_kv_index_entries", "Engine × block entries in the KV index.", nil, nil)
	kvIndexBytes    = prometheus.NewDesc("tether_kv_index_bytes", "Estimated memory of the KV index.", nil, nil)
	kvIndexMax      = prometheus.NewDesc("tether_kv_index_max_entries", "The KV index's bound (--kv-index-max).", nil, nil)
	kvIndexCapDrops = prometheus.NewDesc("tether_kv_index_cap_drops_total", "Stored blocks dropped because the index was at its bound.", nil, nil)
	kvIndexOrphans  = prometheus.NewDesc("tether_kv_index_orphans_total", "Stored blocks whose parent the engine never announced (not indexed).", nil, nil)
	kvIndexMismatch = prometheus.NewDesc("tether_kv_index_mismatched_total", "Events of another block size or with a partial block (not indexed).", nil, nil)
	kvHealthClears  = prometheus.NewDesc("tether_kv_health_clears_total", "Workers' entries cleared because they turned unhealthy, draining or fenced.", nil, nil)
	kvDecisions     = prometheus.NewDesc("tether_kv_prefix_decisions_total", "Requests placed by what the engines hold.", nil, nil)
	kvMatchedTokens = prometheus.NewDesc("tether_kv_prefix_matched_tokens_total", "Prompt tokens the chosen engine held, summed over those decisions.", nil, nil)
	kvPromptTokens  = prometheus.NewDesc("tether_kv_prefix_prompt_tokens_total", "Prompt tokens of those decisions (estimated past the peeked bytes).", nil, nil)
	kvMovedKeys     = prometheus.NewDesc("tether_kv_prefix_moved_keys_total", "Keys moved to a clearly cheaper engine.", nil, nil)
)

func init() {
	for _, h := range kvSubHelp {
		kvSubDesc[h[0]] = prometheus.NewDesc(h[0], h[2], kvLabels, nil)
	}
}

// registerKVMetrics adds the collector when KV-event placement is on.
func (d *Daemon) registerKVMetrics() {
	if d.kv != nil && d.Metrics != nil {
		d.Metrics.Registry().MustRegister(kvCollector{d})
	}
}

func (c kvCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range kvSubDesc {
		ch <- d
	}
	for _, d := range []*prometheus.Desc{kvIndexEntries, kvIndexBytes, kvIndexMax, kvIndexCapDrops, kvIndexOrphans,
		kvIndexMismatch, kvHealthClears, kvDecisions, kvMatchedTokens, kvPromptTokens, kvMovedKeys} {
		ch <- d
	}
}

func (c kvCollector) Collect(ch chan<- prometheus.Metric) {
	st, ix, ok := c.d.KVEventsStatus()
	if !ok {
		return
	}
	for url, subs := range st {
		for _, s := range subs {
			r := strconv.Itoa(s.Rank)
			conn := 0.0
			if s.Connected {
				conn = 1
			}
			vals := map[string]float64{
				"tether_kv_events_total": float64(s.Events), "tether_kv_event_batches_total": float64(s.Batches),
				"tether_kv_event_malformed_total": float64(s.Malformed), "tether_kv_event_gaps_total": float64(s.Gaps),
				"tether_kv_event_replays_total": float64(s.Replays), "tether_kv_event_replay_failures_total": float64(s.ReplayFailures),
				"tether_kv_event_restarts_total": float64(s.Restarts), "tether_kv_event_lost_total": float64(s.Lost),
				"tether_kv_event_clears_total": float64(s.Clears), "tether_kv_event_connected": conn,
				"tether_kv_blocks_indexed": float64(s.Blocks),
			}
			for _, h := range kvSubHelp {
				t := prometheus.CounterValue
				if h[1] == "gauge" {
					t = prometheus.GaugeValue
				}
				ch <- prometheus.MustNewConstMetric(kvSubDesc[h[0]], t, vals[h[0]], url, r)
			}
		}
	}
	g := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	cn := func(d *prometheus.Desc, v uint64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	g(kvIndexEntries, float64(ix.Entries))
	g(kvIndexBytes, float64(ix.Bytes))
	g(kvIndexMax, float64(ix.MaxEntries))
	cn(kvIndexCapDrops, ix.CapDrops)
	cn(kvIndexOrphans, ix.Orphans)
	cn(kvIndexMismatch, ix.Mismatched)
	c.d.kv.mu.Lock()
	hc := c.d.kv.healthClr
	c.d.kv.mu.Unlock()
	cn(kvHealthClears, hc)
	pc := c.d.kv.place.Counts()
	cn(kvDecisions, pc.Decisions)
	cn(kvMatchedTokens, pc.MatchedTokens)
	cn(kvPromptTokens, pc.ScannedTokens)
	cn(kvMovedKeys, pc.Moved)
}
