// Package metrics exports tetherd's figures to Prometheus (names tether_*).
//
// Per-worker and per-listener figures are read at scrape time from the
// counters memory (stats.Table: the BPF maps when BPF is on, so the figures
// cover every process sharing them) by a prometheus.Collector, as
// cloudflare/tubular does; nothing on the data path updates a metric for
// them. The only data-path hook is Observe (proxy.Config.Observe), once per
// proxied request at its end: a counter by status class and a duration
// histogram whose children are created per worker slot when a worker takes
// the slot, so the hook does one atomic pointer load, one counter add and
// one histogram observation (no allocation, no map lookup, no lock).
//
// Label sets are bounded: worker slot and url (at most stats.MaxWorkers
// workers; a slot's series are replaced when another url takes it),
// listener slot (stats.MaxSlots), status class, reason and state.
package metrics

import (
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/stats"
	"github.com/tether-rl/tether/userspace/upstream"
	"github.com/tether-rl/tether/userspace/worker"
)

// Steering is what the BPF program decided (optional; see Sources).
type Steering struct {
	Selected   []uint64 // new connections steered to each listener slot
	MigratedTo []uint64 // queued connections moved to each listener slot
	Fallbacks  map[string]uint64
}

// Sources are what the collector reads at scrape time. Nil fields are
// skipped.
type Sources struct {
	Stats    *stats.Table
	Table    *worker.Table
	Router   *route.Router
	Registry *registry.Registry
	Proxy    *proxy.Counters
	// Listeners returns the number of listener slots in use.
	Listeners func() int
	// Steering returns the BPF program's decisions; ok=false without BPF.
	Steering func() (s Steering, ok bool)
	// Cluster returns the etcd link (up, changes applied, bad entries
	// skipped); ok=false without --cluster.
	Cluster func() (up bool, applied, skipped uint64, ok bool)
	// Fleet is the weight sync's state (fleet.go); nil: no tether_fleet_*.
	Fleet *fleet.Fleet
}

// Code classes passed to Observe: 0 when no response status was relayed
// (the client left, or the request was refused mid-body), else status/100.
var classNames = [6]string{"none", "1xx", "2xx", "3xx", "4xx", "5xx"}

// DurationBuckets span a quick local answer to a long agent turn.
var DurationBuckets = []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800}

type slotObs struct {
	url   string
	codes [len(classNames)]prometheus.Counter
	dur   prometheus.Observer
}

// Metrics is tetherd's Prometheus registry.
type Metrics struct {
	reg       *prometheus.Registry
	src       Sources
	responses *prometheus.CounterVec
	duration  *prometheus.HistogramVec
	upgrades  *prometheus.CounterVec

	mu  sync.Mutex // serializes SetWorker
	obs [stats.MaxWorkers]atomic.Pointer[slotObs]
}

// New returns the metrics of one tetherd, with the Go runtime and process
// collectors.
func New(src Sources) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry(), src: src}
	m.responses = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_responses_total",
		Help: "Proxied requests by worker and response status class (none: no status relayed), counted by this process at the end of each request.",
	}, []string{"slot", "url", "code_class"})
	m.duration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "tether_request_duration_seconds",
		Help:    "Time from routing a request to the end of its response, by worker.",
		Buckets: DurationBuckets,
	}, []string{"slot", "url"})
	m.upgrades = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "tether_upgrades_total",
		Help: "In-place upgrades (SIGUSR2) this process tried, by outcome: handed_over (the new process serves; this one drains and exits), failed (this process keeps serving).",
	}, []string{"outcome"})
	m.upgrades.WithLabelValues("handed_over")
	m.upgrades.WithLabelValues("failed")
	if src.Table != nil {
		m.reg.MustRegister(engineCollector{tab: src.Table}) // engine.go
	}
	if src.Fleet != nil {
		m.reg.MustRegister(fleetCollector{f: src.Fleet, tab: src.Table})
	}
	m.reg.MustRegister(m.responses, m.duration, m.upgrades, &collector{src: src},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry returns the Prometheus registry, for more collectors.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the metrics in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// SetWorker creates the Observe series of the worker now in w.Slot
// (registry.Options.OnPut). If another url held the slot, its series go.
func (m *Metrics) SetWorker(w *worker.Worker) {
	if w == nil || w.Slot < 0 || w.Slot >= stats.MaxWorkers {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	old := m.obs[w.Slot].Load()
	if old != nil && old.url == w.URL {
		return
	}
	slot := strconv.Itoa(w.Slot)
	o := &slotObs{url: w.URL}
	for i, c := range classNames {
		o.codes[i] = m.responses.WithLabelValues(slot, w.URL, c)
	}
	o.dur = m.duration.WithLabelValues(slot, w.URL)
	m.obs[w.Slot].Store(o)
	if old != nil {
		for _, c := range classNames {
			m.responses.DeleteLabelValues(slot, old.url, c)
		}
		m.duration.DeleteLabelValues(slot, old.url)
	}
}

// CountUpgrade counts an in-place upgrade tried: handed over or failed.
func (m *Metrics) CountUpgrade(ok bool) {
	if ok {
		m.upgrades.WithLabelValues("handed_over").Inc()
	} else {
		m.upgrades.WithLabelValues("failed").Inc()
	}
}

// Observe records one proxied request (proxy.Config.Observe): worker slot,
// status class (0 for none) and duration. It never allocates.
func (m *Metrics) Observe(worker, codeClass int, d time.Duration) {
	if uint(worker) >= stats.MaxWorkers {
		return
	}
	o := m.obs[worker].Load()
	if o == nil {
		return
	}
	if uint(codeClass) >= uint(len(classNames)) {
		codeClass = 0
	}
	o.codes[codeClass].Inc()
	o.dur.Observe(d.Seconds())
}

// collector reads the counters memory and the registry at scrape time.
type collector struct{ src Sources }

var (
	dWorkerRequests = prometheus.NewDesc("tether_worker_requests_total",
		"Requests routed to the worker (slot counters: every process sharing them).", []string{"slot", "url"}, nil)
	dWorkerErrors = prometheus.NewDesc("tether_worker_errors_total",
		"Requests to the worker that failed (502, 504, truncated response).", []string{"slot", "url"}, nil)
	dWorkerInFlight = prometheus.NewDesc("tether_worker_in_flight",
		"Requests in flight to the worker (its load for routing and /get_loads).", []string{"slot", "url"}, nil)
	dWorkerQueued = prometheus.NewDesc("tether_worker_queued",
		"Requests waiting in the worker's queue (it is at its max_in_flight).", []string{"slot", "url"}, nil)
	dWorkerBytes = prometheus.NewDesc("tether_worker_bytes_total",
		"Bytes relayed to (up) and from (down) the worker, heads included.", []string{"slot", "url", "direction"}, nil)
	dWorkerRetries = prometheus.NewDesc("tether_worker_retries_total",
		"Upstream retries by reason: connect (a failed connect tried again), dead_pooled (a pooled connection found closed).", []string{"slot", "url", "reason"}, nil)
	dWorkerConns = prometheus.NewDesc("tether_worker_upstream_connections",
		"Open connections to the worker.", []string{"slot", "url"}, nil)
	dWorkerHealthy = prometheus.NewDesc("tether_worker_healthy",
		"1 if the worker's last health verdict is healthy.", []string{"slot", "url"}, nil)
	dWorkerState = prometheus.NewDesc("tether_worker_state",
		"1 for the worker's current state (healthy, unhealthy, draining).", []string{"slot", "url", "state"}, nil)
	dWorkers = prometheus.NewDesc("tether_workers",
		"Workers by state (pending: waiting for a first good health check; removed: finishing requests after removal).", []string{"state"}, nil)
	dPanic = prometheus.NewDesc("tether_panic",
		"1 while every routable worker is unhealthy and requests are routed to all of them anyway.", nil, nil)
	dPanicEntered = prometheus.NewDesc("tether_panic_entered_total",
		"Times every routable worker became unhealthy.", nil, nil)
	dWorkerDecisions = prometheus.NewDesc("tether_worker_decisions_total",
		"Requests this process routed to the worker, by reason (as tether_route_decisions_total, per worker).", []string{"slot", "url", "reason"}, nil)
	dDecisions = prometheus.NewDesc("tether_route_decisions_total",
		"Routing decisions by reason: session (w<idx>- id), learned (bare session id), spread, hash (ring owner), hash_spill / hash_spilled / hash_return (overload spills: new, kept, back to the owner), hash_failover, sticky, sticky_new, sticky_failover, prefix, rid, target, reroute (the first worker refused the connection: another one), veto (a key moved off an engine whose KV cache or queue is full), group (a GRPO sample to where its prompt's samples are), engine-least (placed by engine load), pd_prefill and pd_decode (the two sides of a prefill/decode pair, each request counted on both), and the fallbacks bad_session_spread, bad_session_reject, bad_target, no_worker, panic.", []string{"reason"}, nil)
	dLearned = prometheus.NewDesc("tether_learned_sessions_total",
		"Learned bare session ids by event: learned (stored from a create answer), no_id (2xx create answer without an id in the bytes read), forgotten (DELETE /sessions/{id}).", []string{"event"}, nil)
	dListenerActive = prometheus.NewDesc("tether_listener_connections_active",
		"Client connections open on the listener.", []string{"listener"}, nil)
	dListenerAccepted = prometheus.NewDesc("tether_listener_connections_accepted_total",
		"Client connections accepted by the listener.", []string{"listener"}, nil)
	dListenerClosed = prometheus.NewDesc("tether_listener_connections_closed_total",
		"Client connections closed on the listener.", []string{"listener"}, nil)
	dListenerSelected = prometheus.NewDesc("tether_listener_selections_total",
		"New connections the BPF program steered to the listener.", []string{"listener"}, nil)
	dListenerMigrated = prometheus.NewDesc("tether_listener_migrations_total",
		"Queued connections the BPF program moved to the listener.", []string{"listener"}, nil)
	dSteeringFallbacks = prometheus.NewDesc("tether_steering_fallbacks_total",
		"Connections the BPF program left to the kernel's hash, by reason.", []string{"reason"}, nil)
	dProxyAccepted = prometheus.NewDesc("tether_proxy_connections_accepted_total",
		"Client connections accepted by this process.", nil, nil)
	dProxyRequests = prometheus.NewDesc("tether_proxy_requests_total",
		"Requests read from clients by this process.", nil, nil)
	dProxyLocal = prometheus.NewDesc("tether_proxy_local_requests_total",
		"Requests answered by tetherd itself on the data port (/health, control endpoints).", nil, nil)
	dProxyErrors = prometheus.NewDesc("tether_proxy_errors_total",
		"Data-plane failures by reason.", []string{"reason"}, nil)
	dClusterUp = prometheus.NewDesc("tether_cluster_up",
		"1 while etcd answers (--cluster); 0: routing on the last table seen, admin writes answer 503.", nil, nil)
	dClusterApplied = prometheus.NewDesc("tether_cluster_changes_applied_total",
		"Changes of the cluster's worker table applied to this replica.", nil, nil)
	dClusterSkipped = prometheus.NewDesc("tether_cluster_bad_entries_total",
		"Entries under the cluster's prefix that could not be read (logged and skipped).", nil, nil)
	dProxyOpen = prometheus.NewDesc("tether_proxy_connections_open",
		"Client connections open in this process (capped by --max-conns).", nil, nil)
	dProxyAcceptPauses = prometheus.NewDesc("tether_proxy_accept_pauses_total",
		"Episodes in which accepting paused: at --max-conns, or accept failing (out of descriptors).", nil, nil)
	dProxyParked = prometheus.NewDesc("tether_proxy_connections_parked",
		"Client connections held by the event loops (idle, reading a head, or in an exchange the loop runs): none has a goroutine.", nil, nil)
	dProxyQueued = prometheus.NewDesc("tether_proxy_queued",
		"Requests waiting in a worker's queue now.", nil, nil)
	dProxyBuffers = prometheus.NewDesc("tether_proxy_buffers",
		"16 KiB connection buffers held now (idle keep-alive connections hold none).", nil, nil)
	dProxyLargeBytes = prometheus.NewDesc("tether_proxy_large_buffer_bytes",
		"Bytes held now by connection buffers larger than 16 KiB: long heads, bodies read further before routing (--kv-peek-max, within --kv-peek-budget).", nil, nil)
	dProxyPeekMore = prometheus.NewDesc("tether_proxy_peek_more_total",
		"Requests whose body was read past --peek-bytes before routing because the router asked (the engines held every block of token ids read).", nil, nil)
	dProxyPeekBudgetFull = prometheus.NewDesc("tether_proxy_peek_budget_full_total",
		"Requests routed on the body bytes they had although the router asked for more: the large buffers at --kv-peek-budget.", nil, nil)
	dProxyRingOps = prometheus.NewDesc("tether_proxy_ring_operations_total",
		"Socket reads and writes the event loops batched through io_uring (--io-uring; withdrawn ones, made NOPs, included).", nil, nil)
	dProxyRingSubmits = prometheus.NewDesc("tether_proxy_ring_submits_total",
		"Batches the event loops submitted to io_uring, one io_uring_enter each unless the kernel takes one in parts: operations / submits is the batching factor.", nil, nil)
)

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{dWorkerRequests, dWorkerErrors, dWorkerInFlight, dWorkerBytes,
		dWorkerRetries, dWorkerConns, dWorkerHealthy, dWorkerState, dWorkers, dPanic, dPanicEntered,
		dDecisions, dWorkerDecisions, dLearned, dListenerActive, dListenerAccepted, dListenerClosed, dListenerSelected,
		dListenerMigrated, dSteeringFallbacks, dProxyAccepted, dProxyRequests, dProxyLocal, dProxyErrors, dProxyBuffers,
		dWorkerQueued, dProxyOpen, dProxyAcceptPauses, dProxyQueued, dProxyParked, dClusterUp, dClusterApplied, dClusterSkipped,
		dProxyRingOps, dProxyRingSubmits, dProxyLargeBytes, dProxyPeekMore, dProxyPeekBudgetFull} {
		ch <- d
	}
}

func counter(d *prometheus.Desc, v uint64, lv ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), lv...)
}

func gauge(d *prometheus.Desc, v float64, lv ...string) prometheus.Metric {
	return prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, lv...)
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

var stateNames = [...]worker.State{worker.Healthy, worker.Unhealthy, worker.Draining}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	src := c.src
	if src.Table != nil {
		for _, w := range src.Table.Snapshot() {
			if w == nil {
				continue
			}
			slot := strconv.Itoa(w.Slot)
			s := w.Stats.Load()
			ch <- counter(dWorkerRequests, s.Requests, slot, w.URL)
			ch <- counter(dWorkerErrors, s.Errors, slot, w.URL)
			ch <- gauge(dWorkerInFlight, float64(s.InFlight), slot, w.URL)
			ch <- gauge(dWorkerQueued, float64(w.Queued()), slot, w.URL)
			for reason, n := range route.Decisions(w) {
				ch <- counter(dWorkerDecisions, n, slot, w.URL, reason)
			}
			ch <- counter(dWorkerBytes, s.BytesUp, slot, w.URL, "up")
			ch <- counter(dWorkerBytes, s.BytesDown, slot, w.URL, "down")
			ch <- gauge(dWorkerConns, float64(s.Conns), slot, w.URL)
			if w.Pool != nil {
				ch <- counter(dWorkerRetries, w.Pool.Retries(upstream.RetryConnect), slot, w.URL, "connect")
				ch <- counter(dWorkerRetries, w.Pool.Retries(upstream.RetryDeadPooled), slot, w.URL, "dead_pooled")
			}
			st := w.BaseState()
			healthy := st == worker.Healthy
			if src.Registry != nil {
				if h, ok := src.Registry.Health(w.Slot); ok {
					healthy = h
				}
			}
			ch <- gauge(dWorkerHealthy, b2f(healthy), slot, w.URL)
			for _, s := range stateNames {
				ch <- gauge(dWorkerState, b2f(st == s), slot, w.URL, s.String())
			}
		}
	}
	if src.Registry != nil {
		for state, n := range src.Registry.Counts() {
			ch <- gauge(dWorkers, float64(n), state)
		}
		ch <- gauge(dPanic, b2f(src.Registry.Panic()))
		ch <- counter(dPanicEntered, src.Registry.PanicEntered())
	}
	if src.Router != nil {
		for r := route.Reason(0); r < route.NumReasons; r++ {
			ch <- counter(dDecisions, src.Router.Count(r), r.String())
		}
		if l := src.Router.CurrentLearning(); l != nil {
			c := l.Counts()
			ch <- counter(dLearned, c.Learned, "learned")
			ch <- counter(dLearned, c.NoID, "no_id")
			ch <- counter(dLearned, c.Forgotten, "forgotten")
		}
	}
	if src.Stats != nil && src.Listeners != nil {
		n := min(src.Listeners(), stats.MaxSlots)
		for i := 0; i < n; i++ {
			l := src.Stats.Slot(i).Load()
			ls := strconv.Itoa(i)
			ch <- gauge(dListenerActive, float64(l.Active), ls)
			ch <- counter(dListenerAccepted, l.Accepted, ls)
			ch <- counter(dListenerClosed, l.Closed, ls)
		}
		if src.Steering != nil {
			if s, ok := src.Steering(); ok {
				for i := 0; i < n && i < len(s.Selected); i++ {
					ch <- counter(dListenerSelected, s.Selected[i], strconv.Itoa(i))
				}
				for i := 0; i < n && i < len(s.MigratedTo); i++ {
					ch <- counter(dListenerMigrated, s.MigratedTo[i], strconv.Itoa(i))
				}
				for reason, v := range s.Fallbacks {
					ch <- counter(dSteeringFallbacks, v, reason)
				}
			}
		}
	}
	if src.Cluster != nil {
		if up, applied, skipped, ok := src.Cluster(); ok {
			ch <- gauge(dClusterUp, b2f(up))
			ch <- counter(dClusterApplied, applied)
			ch <- counter(dClusterSkipped, skipped)
		}
	}
	if p := src.Proxy; p != nil {
		ch <- counter(dProxyAccepted, p.Accepted.Load())
		ch <- counter(dProxyRequests, p.Requests.Load())
		ch <- counter(dProxyLocal, p.Local.Load())
		ch <- counter(dProxyErrors, p.Rejected.Load(), "rejected")
		ch <- counter(dProxyErrors, p.BadGateway.Load(), "bad_gateway")
		ch <- counter(dProxyErrors, p.Timeouts.Load(), "timeout")
		ch <- counter(dProxyErrors, p.Truncated.Load(), "truncated")
		ch <- counter(dProxyErrors, p.ClientAborted.Load(), "client_aborted")
		ch <- counter(dProxyErrors, p.QueueFull.Load(), "queue_full")
		ch <- counter(dProxyErrors, p.QueueTimeouts.Load(), "queue_timeout")
		ch <- counter(dProxyErrors, p.LocalBusy.Load(), "local_busy")
		ch <- gauge(dProxyBuffers, float64(p.Buffers.Load()))
		ch <- gauge(dProxyLargeBytes, float64(p.LargeBytes.Load()))
		ch <- counter(dProxyPeekMore, p.PeekMore.Load())
		ch <- counter(dProxyPeekBudgetFull, p.PeekBudgetFull.Load())
		ch <- gauge(dProxyOpen, float64(p.Open.Load()))
		ch <- counter(dProxyAcceptPauses, p.AcceptPauses.Load())
		ch <- gauge(dProxyQueued, float64(p.Queued.Load()))
		ch <- gauge(dProxyParked, float64(p.Parked.Load()))
		ch <- counter(dProxyRingOps, p.RingOps.Load())
		ch <- counter(dProxyRingSubmits, p.RingSubmits.Load())
	}
}
