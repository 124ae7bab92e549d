// Package loadpoll reads the load of every worker's inference engine each
// --engine-poll and hands it to placement (route.Worker.SetEngineSignals):
// SGLang's GET /v1/loads when it answers (running, waiting, token usage,
// cache hit rate, per DP rank), else the Prometheus GET /metrics of vLLM
// (vllm:*) or SGLang (sglang:*), parsed by metric name whatever the
// labels. It detects which one a worker serves and records it
// (Worker.SetEngine). A worker that exposes neither is placed as before.
//
// Polls run in their own goroutines with the health checks' habits (the
// worker API key, a timeout, no HTTP proxy); the data path only reads the
// atomics they write. An engine that stops answering keeps its last
// reading for two more rounds, then placement forgets it (the worker is
// placed by its in-flight count, and not vetoed) until it answers again.
package loadpoll

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/userspace/route"
)

// Defaults.
const (
	DefaultInterval = time.Second
	// staleRounds: a reading is used for this many failed rounds after it.
	staleRounds = 3
	// redetectRounds: a worker without a load endpoint is asked again
	// this often (an engine that came up late).
	redetectRounds = 10
	// versionRounds: SGLang's weight version is read this often.
	versionRounds = 5
	maxBody       = 4 << 20
)

// Options configure a Poller.
type Options struct {
	Interval time.Duration // between rounds; default 1s
	// Timeout of one poll; default min(Interval, 2s).
	Timeout time.Duration
	APIKey  string // sent as "Authorization: Bearer KEY"
	Table   *route.Table
	// Router: its EnginePlacement (the veto thresholds, SetKnown) is read
	// at each round, so a reload applies.
	Router *route.Router
	Log    *slog.Logger
	// Now is the clock (tests); default time.Now.
	Now func() time.Time
}

// Poller polls the engines of a worker table.
type Poller struct {
	opts   Options
	client *http.Client

	mu      sync.Mutex
	state   map[*route.Worker]*wstate
	stop    chan struct{}
	kick    chan struct{}
	wg      sync.WaitGroup
	started bool
	once    sync.Once
	rounds  uint64
}

// endpoint is what a worker's engine serves.
type endpoint int

const (
	epUnknown endpoint = iota
	epLoads            // SGLang GET /v1/loads
	epMetrics          // GET /metrics with vllm:* or sglang:* names
	epNone             // neither
)

type wstate struct {
	ep       endpoint
	polled   uint64 // rounds polled
	failures int
	lastOK   time.Time
	version  string
	// vLLM prefix cache counters at the previous reading (hit rate over
	// the interval).
	queries, hits float64
}

// New returns a poller; Start runs it.
func New(o Options) *Poller {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Timeout <= 0 {
		o.Timeout = min(o.Interval, 2*time.Second)
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	tr := &http.Transport{
		Proxy:                  nil, // never through an HTTP proxy from the environment
		DialContext:            (&net.Dialer{Timeout: o.Timeout}).DialContext,
		MaxIdleConnsPerHost:    1,
		IdleConnTimeout:        max(3*o.Interval, 30*time.Second),
		ResponseHeaderTimeout:  o.Timeout,
		MaxResponseHeaderBytes: 64 << 10,
	}
	return &Poller{opts: o, state: map[*route.Worker]*wstate{},
		client: &http.Client{Transport: tr, Timeout: o.Timeout,
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }},
		stop: make(chan struct{}), kick: make(chan struct{}, 1)}
}

// Start polls at once, then every Interval.
func (p *Poller) Start() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.started {
		return
	}
	p.started = true
	p.wg.Add(1)
	go p.run()
}

// Stop ends the polls and waits for those in progress.
func (p *Poller) Stop() {
	p.once.Do(func() { close(p.stop) })
	p.wg.Wait()
	p.client.CloseIdleConnections()
}

// PollNow asks for a round as soon as possible.
func (p *Poller) PollNow() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Rounds returns how many rounds completed.
func (p *Poller) Rounds() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.rounds
}

func (p *Poller) run() {
	defer p.wg.Done()
	t := time.NewTicker(p.opts.Interval)
	defer t.Stop()
	for {
		p.Round()
		select {
		case <-p.stop:
			return
		case <-t.C:
		case <-p.kick:
		}
	}
}

// Round polls every worker once (concurrently, each within Timeout), then
// updates placement: how many workers have signals, and the hold when
// every engine is vetoed.
func (p *Poller) Round() {
	ws := p.opts.Table.Snapshot()
	ctx, cancel := context.WithTimeout(context.Background(), p.opts.Timeout)
	defer cancel()
	go func() {
		select {
		case <-p.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	var wg sync.WaitGroup
	p.mu.Lock()
	live := make(map[*route.Worker]bool, len(ws))
	for _, w := range ws {
		if w == nil {
			continue
		}
		live[w] = true
		st := p.state[w]
		if st == nil {
			st = &wstate{}
			p.state[w] = st
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.poll(ctx, w, st)
		}()
	}
	for w := range p.state {
		if !live[w] {
			delete(p.state, w)
		}
	}
	p.mu.Unlock()
	wg.Wait()
	p.settle(ws)
	p.mu.Lock()
	p.rounds++
	p.mu.Unlock()
}

// settle publishes the count of workers with signals and holds admissions
// while every healthy engine is vetoed.
func (p *Poller) settle(ws []*route.Worker) {
	known, healthy, vetoed := 0, 0, 0
	for _, w := range ws {
		if w == nil {
			continue
		}
		k := w.EngineKnown()
		if k {
			known++
		}
		if w.State() == route.Healthy {
			healthy++
			if k && w.EngineVetoed() {
				vetoed++
			}
		}
	}
	all := healthy > 0 && vetoed == healthy
	for _, w := range ws {
		if w == nil {
			continue
		}
		if all && w.EngineVetoed() {
			if w.EngineHold() == 0 {
				w.SetEngineHold(int64(max(w.Admitted(), 1)))
				p.opts.Log.Info("every engine vetoed: holding new requests in tetherd's queue", "slot", w.Slot, "in_flight", w.Admitted())
			}
		} else if w.EngineHold() != 0 {
			w.SetEngineHold(0)
		}
	}
	if e := p.placement(); e != nil {
		e.SetKnown(known)
	}
}

func (p *Poller) placement() *route.EnginePlacement {
	if p.opts.Router == nil {
		return nil
	}
	return p.opts.Router.EnginePlacement()
}

// poll reads one worker's engine.
func (p *Poller) poll(ctx context.Context, w *route.Worker, st *wstate) {
	st.polled++
	if st.ep == epNone && st.polled%redetectRounds != 1 {
		return
	}
	sig, ep, err := p.read(ctx, w, st)
	select {
	case <-p.stop:
		return
	default:
	}
	if err != nil {
		st.failures++
		if errors.Is(err, errNoEndpoint) {
			st.ep = epNone
			if w.EngineKnown() {
				w.ForgetEngineSignals(st.failures, err)
			}
			return
		}
		if w.EngineKnown() && st.failures < staleRounds {
			w.NoteEngineFailure(st.failures, err)
		} else {
			if w.EngineKnown() {
				p.opts.Log.Warn("engine load endpoint not answering: placing the worker by its in-flight count", "slot", w.Slot, "url", w.URL, "err", err)
			}
			w.ForgetEngineSignals(st.failures, err)
		}
		return
	}
	if st.failures >= staleRounds && st.ep != epUnknown {
		p.opts.Log.Info("engine load endpoint answering again", "slot", w.Slot, "url", w.URL)
	}
	st.failures = 0
	st.ep = ep
	st.lastOK = p.opts.Now()
	if sig.WeightVersion == "" {
		sig.WeightVersion = st.version
	}
	vetoed, low := false, 0.0
	if e := p.placement(); e != nil {
		vetoed = e.Veto(w.EngineVetoed(), sig)
		low = e.VetoLow(sig)
	}
	if vetoed != w.EngineVetoed() {
		p.opts.Log.Info("engine veto", "slot", w.Slot, "vetoed", vetoed, "kv_usage", sig.KVUsage, "waiting", sig.Waiting)
	}
	w.SetEngineSignals(sig, vetoed, low, st.lastOK)
}

var errNoEndpoint = errors.New("no load endpoint (neither /v1/loads nor engine metrics on /metrics)")

// read reads the signals from the endpoint known to work, or detects one.
func (p *Poller) read(ctx context.Context, w *route.Worker, st *wstate) (route.EngineSignals, endpoint, error) {
	base := strings.TrimSuffix(w.URL, "/")
	if st.ep == epUnknown || st.ep == epNone || st.ep == epLoads {
		body, code, err := p.get(ctx, base+"/v1/loads")
		if err != nil {
			return route.EngineSignals{}, epUnknown, err
		}
		if code == http.StatusOK {
			sig, err := parseLoads(body)
			if err == nil {
				w.SetEngine(route.EngineSGLang)
				if st.polled%versionRounds == 1 {
					if v, ok := p.weightVersion(ctx, base); ok {
						st.version = v
					}
				}
				return sig, epLoads, nil
			}
			if st.ep == epLoads {
				return route.EngineSignals{}, epUnknown, err
			}
		} else if st.ep == epLoads && code != http.StatusNotFound {
			return route.EngineSignals{}, epUnknown, fmt.Errorf("GET /v1/loads: %d", code)
		}
	}
	body, code, err := p.get(ctx, base+"/metrics")
	if err != nil {
		return route.EngineSignals{}, epUnknown, err
	}
	if code != http.StatusOK {
		if st.ep == epMetrics && code != http.StatusNotFound {
			return route.EngineSignals{}, epUnknown, fmt.Errorf("GET /metrics: %d", code)
		}
		return route.EngineSignals{}, epNone, errNoEndpoint
	}
	sig, kind, ok := parseMetrics(body, st)
	if !ok {
		return route.EngineSignals{}, epNone, errNoEndpoint
	}
	w.SetEngine(kind)
	if kind == route.EngineSGLang && st.polled%versionRounds == 1 {
		if v, ok := p.weightVersion(ctx, base); ok {
			st.version = v
		}
	}
	return sig, epMetrics, nil
}

func (p *Poller) get(ctx context.Context, url string) ([]byte, int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, 0, err
	}
	req.Header.Set("User-Agent", "tetherd-loadpoll")
	if p.opts.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+p.opts.APIKey)
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return nil, 0, err
	}
	return body, resp.StatusCode, nil
}

// weightVersion reads SGLang's GET /get_weight_version.
func (p *Poller) weightVersion(ctx context.Context, base string) (string, bool) {
	body, code, err := p.get(ctx, base+"/get_weight_version")
	if err != nil || code != http.StatusOK {
		return "", false
	}
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

// parseLoads reads SGLang's /v1/loads: the sum over DP ranks of running
// and waiting, the token usage of all ranks together, the mean hit rate.
func parseLoads(body []byte) (route.EngineSignals, error) {
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
		return route.EngineSignals{}, fmt.Errorf("GET /v1/loads: %w", err)
	}
	if len(v.Loads) == 0 {
		return route.EngineSignals{}, errors.New("GET /v1/loads: no loads")
	}
	s := route.EngineSignals{KVUsage: -1, HitRate: -1, Source: "v1/loads"}
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

// parseMetrics reads the Prometheus text exposition: vLLM's or SGLang's
// gauges and counters by name (summed over label sets, usage the highest).
func parseMetrics(body []byte, st *wstate) (route.EngineSignals, route.EngineKind, bool) {
	s := route.EngineSignals{KVUsage: -1, HitRate: -1, Source: "metrics"}
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
		return s, route.EngineUnknown, false
	}
	if haveUsage {
		s.KVUsage = usage
	}
	kind := route.EngineSGLang
	if vllm {
		kind = route.EngineVLLM
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
