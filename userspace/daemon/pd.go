package daemon

// P/D: a fleet of prefill and decode workers (--prefill, --decode, the
// admin API's worker_type, or learned from the engine's /server_info)
// serves its generation requests over pairs: the proxy hands each to
// pdPlane.Serve (proxy.Config.PD), which drives userspace/pd with the
// pair chooser over the worker table (pdchoose.go). The control calls
// (pause, updates, resume, flush, aborts, memory) reach prefill and decode
// engines alike: they are workers of the table, which the engine
// endpoints and the fleet's hold fan out to.

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tether-rl/tether/userspace/dialect"
	"github.com/tether-rl/tether/userspace/pd"
	"github.com/tether-rl/tether/userspace/registry"
	"github.com/tether-rl/tether/userspace/route"
	"github.com/tether-rl/tether/userspace/worker"
	"github.com/tether-rl/tether/userspace/workerclient"
)

// PDProtocol picks the P/D protocol (--pd-protocol).
type PDProtocol string

const (
	// PDAuto: vLLM's NIXL where the prefills' engine is vLLM, else
	// SGLang's bootstrap rooms (and always for /generate).
	PDAuto   PDProtocol = "auto"
	PDSGLang PDProtocol = "sglang"
	PDVLLM   PDProtocol = "vllm"
)

// ParsePDProtocol parses a --pd-protocol value.
func ParsePDProtocol(s string) (PDProtocol, error) {
	switch p := PDProtocol(s); p {
	case PDAuto, PDSGLang, PDVLLM:
		return p, nil
	}
	return "", fmt.Errorf("--pd-protocol %q: want auto, sglang or vllm", s)
}

// pdPlane is the proxy's P/D hook (proxy.PD).
type pdPlane struct {
	table   *worker.Table
	proto   PDProtocol
	sglang  *pd.Server
	vllm    *pd.Server
	chooser *pairChooser
	client  *workerclient.Client
	// hasPair caches whether the table has a prefill and a decode, for
	// the table's epoch and the role changes it was made at (Takes runs
	// on the event loops for every generation request).
	hasPair atomic.Pointer[pairView]
}

type pairView struct {
	epoch, roles uint64
	both         bool
}

func newPDPlane(d *Daemon, opts Options) *pdPlane {
	keys := opts.Routing.Keys.KeyHeaders
	if keys == nil {
		keys = route.DefaultKeyHeaders
	}
	cfg := pd.Config{RouteHeader: opts.Routing.RouteHeader, LetMissingKVParamsThrough: opts.PDLetMissingKVParams, Log: d.log}
	sg, vl := cfg, cfg
	sg.Protocol, vl.Protocol = pd.SGLang, pd.VLLM
	proto := opts.PDProtocol
	if proto == "" {
		proto = PDAuto
	}
	return &pdPlane{
		table:   d.Table,
		proto:   proto,
		sglang:  pd.New(sg),
		vllm:    pd.New(vl),
		chooser: &pairChooser{table: d.Table, fleet: d.Fleet, keyHeaders: keyHeadersOf(keys), observe: d.observe},
		client:  workerclient.New(workerclient.Options{Timeout: 5 * time.Second, DisableCompression: true, APIKey: opts.WorkerAPIKey}),
	}
}

func (p *pdPlane) close() {
	p.sglang.Close()
	p.vllm.Close()
	p.client.Close()
}

// roles reports whether the table has a prefill and a decode, and whether
// a healthy one of each.
func (p *pdPlane) roles() (both, healthy bool) {
	var pre, dec, hp, hd bool
	for _, w := range p.table.Snapshot() {
		if w == nil {
			continue
		}
		switch w.Role() {
		case worker.Prefill:
			pre = true
			hp = hp || w.State() == worker.Healthy
		case worker.Decode:
			dec = true
			hd = hd || w.State() == worker.Healthy
		}
	}
	return pre && dec, hp && hd
}

// Takes implements proxy.PD: generation requests, and GET
// /health_generate, while the fleet has prefill and decode workers.
func (p *pdPlane) Takes(method, path []byte) bool {
	switch string(method) {
	case http.MethodPost:
		if !dialect.IsGeneration(dialect.Unknown, path) {
			return false
		}
	case http.MethodGet:
		if !isHealthGenerate(path) {
			return false
		}
	default:
		return false
	}
	return p.isPD()
}

// isPD reports whether the table has a prefill and a decode: two atomic
// loads while neither the membership nor a role changed.
func (p *pdPlane) isPD() bool {
	epoch, roles := p.table.Epoch(), worker.RoleChanges()
	if v := p.hasPair.Load(); v != nil && v.epoch == epoch && v.roles == roles {
		return v.both
	}
	both, _ := p.roles()
	p.hasPair.Store(&pairView{epoch: epoch, roles: roles, both: both})
	return both
}

// Ready implements proxy.PD: P/D readiness needs a healthy prefill and a
// healthy decode.
func (p *pdPlane) Ready() (active, ready bool) {
	both, healthy := p.roles()
	return both, healthy
}

func isHealthGenerate(path []byte) bool {
	h := dialect.HealthGenerate
	return len(path) >= len(h) && string(path[:len(h)]) == h && (len(path) == len(h) || path[len(h)] == '?')
}

// Serve implements proxy.PD.
func (p *pdPlane) Serve(ctx context.Context, w pd.ResponseWriter, req *pd.Request) error {
	if isHealthGenerate([]byte(req.Path)) {
		return p.healthGenerate(ctx, w, req)
	}
	return p.server(req.Path).Serve(ctx, w, req, p.chooser)
}

// server is the protocol's driver for a request to path.
func (p *pdPlane) server(path string) *pd.Server {
	switch p.proto {
	case PDSGLang:
		return p.sglang
	case PDVLLM:
		return p.vllm
	}
	if k, only := dialect.GenerationOf([]byte(path)); only {
		return p.serverOf(dialect.PDProtocol(k))
	}
	for _, w := range p.table.Snapshot() {
		if w != nil && w.Role() == worker.Prefill {
			return p.serverOf(dialect.PDProtocol(w.Engine()))
		}
	}
	return p.sglang
}

// serverOf is the driver of a P/D protocol (dialect.PDProtocol's names);
// an engine not learned yet speaks SGLang's, the default.
func (p *pdPlane) serverOf(proto string) *pd.Server {
	if PDProtocol(proto) == PDVLLM {
		return p.vllm
	}
	return p.sglang
}

// healthGenerate asks one pair's engines their /health_generate: 200 when
// both answer 2xx.
func (p *pdPlane) healthGenerate(ctx context.Context, w pd.ResponseWriter, req *pd.Request) error {
	pair, err := p.chooser.pick(ctx, req, nil, false) // a probe: not counted among the choices
	if err != nil {
		writePDStatus(w, http.StatusServiceUnavailable, "no healthy prefill/decode pair")
		return err
	}
	bad := false
	defer func() { p.chooser.Release(pair, bad) }()
	call := dialect.Call{Method: http.MethodGet, Path: req.Path}
	for _, base := range []string{pair.Prefill.URL, pair.Decode.URL} {
		a, err := p.client.Do(ctx, base, call, req.Header.Get("Authorization"))
		if err == nil && !a.OK() {
			err = fmt.Errorf("%s answered %s", base, a.StatusText)
		}
		if err != nil {
			bad = true
			writePDStatus(w, http.StatusServiceUnavailable, "pair "+pair.String()+": "+err.Error())
			return err
		}
	}
	writePDStatus(w, http.StatusOK, "pair "+pair.String()+" healthy")
	return nil
}

func writePDStatus(w pd.ResponseWriter, code int, msg string) {
	b := fmt.Appendf(nil, "{\"status\":%q}\n", msg)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", fmt.Sprint(len(b)))
	w.WriteHeader(code)
	w.Write(b)
}

// learnRole asks the engine at w its P/D mode and bootstrap port
// (/server_info) where they were not given: a role given stays, a
// prefill's port given stays, else the engine's, else 8998.
func (p *pdPlane) learnRole(w *worker.Worker, given registry.RoleSpec, ok bool) {
	if ok && (given.Role != worker.Prefill || given.BootstrapPort != 0) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	call, has := dialect.ServerInfo(w.Engine())
	if !has {
		if call, has = dialect.AnyServerInfo(); !has {
			return
		}
	}
	a, err := p.client.Do(ctx, w.URL, call, "")
	var mode string
	var port int
	if err == nil && a.OK() {
		mode, port, _ = dialect.ParseDisaggregation(a.Body)
	}
	role := given.Role
	if !ok {
		switch mode {
		case "prefill":
			role = worker.Prefill
		case "decode":
			role = worker.Decode
		default:
			return
		}
	}
	switch {
	case role != worker.Prefill:
		port = 0 // only a prefill has a bootstrap server
	case port == 0:
		port = worker.DefaultBootstrapPort
	}
	w.SetRole(role, port)
}

// register exports pd's counters (tether_pd_*) and the pair chooser's.
func (p *pdPlane) register(reg *prometheus.Registry) {
	for _, s := range []struct {
		proto string
		srv   *pd.Server
	}{{"sglang", p.sglang}, {"vllm", p.vllm}} {
		c := &s.srv.Counters
		for _, m := range []struct {
			name, help string
			f          func() uint64
		}{
			{"requests", "requests served over a prefill/decode pair", c.Requests.Load},
			{"served", "decode answers relayed whole", c.Served.Load},
			{"retries", "attempts after a request's first", c.Retries.Load},
			{"paused_retries", "attempts after one a weight sync's pause failed (not charged to the pair)", c.PausedRetries.Load},
			{"prefill_failed", "prefills failed or 5xx before the client had a byte", c.PrefillFailed.Load},
			{"decode_failed", "decodes failed or 5xx before the client had a byte", c.DecodeFailed.Load},
			{"prefill_refused", "prefill 4xx answers passed to the client", c.PrefillRefused.Load},
			{"decode_refused", "decode 4xx answers passed to the client", c.DecodeRefused.Load},
			{"gave_up", "502s after the last attempt failed", c.GaveUp.Load},
			{"no_pair", "503s: no pair available", c.NoPair.Load},
			{"bad_request", "400s: the body is not a JSON object", c.BadRequest.Load},
			{"refused_n", "400s: n > 1 in a form not split (streamed, seeded, a client's request id, a batch)", c.RefusedN.Load},
			{"expanded", "requests for n samples served as n requests of one sample", c.Expanded.Load},
			{"merge_failed", "502s: the samples' answers could not be made one", c.MergeFailed.Load},
			{"mid_stream", "decodes failed after the client had bytes (the answer ended visibly)", c.MidStream.Load},
			{"client_gone", "clients that left: both legs cancelled", c.ClientGone.Load},
			{"legs_cancelled", "legs cancelled by a failure or a departure", c.LegsCancelled.Load},
			{"aborts_sent", "abort calls answered 2xx", c.AbortsSent.Load},
			{"aborts_failed", "abort calls that failed", c.AbortsFailed.Load},
			{"late_cancels", "prefills still running after the decode ended", c.LateCancels.Load},
			{"logprob_merges", "answers or events with the prefill's input logprobs merged in", c.LogprobMerges.Load},
			{"missing_kv_params", "vLLM prefills that answered without kv_transfer_params", c.MissingKVParams.Load},
			{"passed_without_kv_params", "decodes sent the body without kv_transfer_params (recompute)", c.PassedWithoutKVParams.Load},
		} {
			f := m.f
			reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "tether_pd_" + m.name + "_total", Help: "P/D: " + m.help + ".",
				ConstLabels: prometheus.Labels{"protocol": s.proto},
			}, func() float64 { return float64(f()) }))
		}
	}
	p.registerChoices(reg)
}

// registerChoices exports the pair chooser's counters: pairs by what
// decided the prefill, and the prompt tokens held where the prefills'
// KV events decided.
func (p *pdPlane) registerChoices(reg *prometheus.Registry) {
	c := p.chooser
	for i, name := range chooseByNames {
		reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name:        "tether_pd_prefill_choices_total",
			Help:        "P/D: pairs chosen for requests, by what decided the prefill (kv: what its cache holds, by the prefills' KV events; key; prompt: the prompt's group; load; spill: the one named was at its bound, the next).",
			ConstLabels: prometheus.Labels{"by": name},
		}, func() float64 { return float64(c.by[i].Load()) }))
	}
	reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "tether_pd_prefill_kv_held_tokens_total",
		Help: "P/D: prompt tokens the chosen prefill's cache held, summed over the pairs its KV events decided.",
	}, func() float64 { return float64(c.heldTokens.Load()) }))
}

// givePDRoles records the roles of --prefill and --decode (before their
// workers take slots) and returns their URLs, in that order.
func (d *Daemon) givePDRoles(opts Options) ([]string, error) {
	var urls []string
	for _, g := range []struct {
		flag string
		list []string
		role worker.Role
	}{{"--prefill", opts.Prefill, worker.Prefill}, {"--decode", opts.Decode, worker.Decode}} {
		for _, raw := range g.list {
			u, port, err := registry.SplitBootstrapPort(raw)
			if err == nil {
				u, err = d.Registry.SetRole(u, registry.RoleSpec{Role: g.role, BootstrapPort: port})
			}
			if err != nil {
				return nil, fmt.Errorf("%s %s: %w", g.flag, raw, err)
			}
			urls = append(urls, u)
		}
	}
	return urls, nil
}

// discoverEvery is how often the table is scanned for SGLang engines
// whose P/D role was not given.
const discoverEvery = time.Second

// discover asks each worker the load poller found to be an SGLang engine,
// once, for its P/D role and bootstrap port (/server_info) where they were
// not given, until stop closes. Workers of other engines, or of none
// known, are never asked.
func (p *pdPlane) discover(stop <-chan struct{}, reg *registry.Registry) {
	t := time.NewTicker(discoverEvery)
	defer t.Stop()
	asked := map[*worker.Worker]bool{}
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		seen := map[*worker.Worker]bool{}
		for _, w := range p.table.Snapshot() {
			if w == nil {
				continue
			}
			seen[w] = true
			if _, has := dialect.ServerInfo(w.Engine()); asked[w] || !has {
				continue
			}
			asked[w] = true
			spec, ok := reg.RoleOf(w.URL)
			p.learnRole(w, spec, ok)
		}
		for w := range asked {
			if !seen[w] {
				delete(asked, w)
			}
		}
	}
}
