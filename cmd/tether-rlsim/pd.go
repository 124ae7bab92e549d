package main

// The P/D run (-pd sglang,vllm): a fake prefill/decode fleet
// (testenv/fakepd, -prefills + -decodes engines, with the service model:
// a prefix cache per prefill, -prefill-per-token under -pd-max-prefill
// prompts at once, -decode-step per token under -max-running decodes)
// per protocol, and four phases on fresh engines (-pd-kv-events: the
// engines that compute prompts publish KV-cache events, tetherd places
// by them):
//
//	pd       the workload through an in-process tetherd (--prefill,
//	         --decode, --pd-protocol) and the same workload (another
//	         seed) by a direct client doing the P/D protocol itself
//	         (fakepd.DirectSGLang, DirectVLLM: prefill by the key's or the
//	         prompt's hash, decode by its own least outstanding), both at
//	         once on the same fleet: failed, hung (no answer within
//	         -pd-timeout), wrong answers, throughput (output tokens per
//	         second of each client's makespan) and its ratio, each
//	         client's prefill hit rate (the answers' cached tokens); then
//	         what the engines still hold (orphaned rooms, pinned blocks),
//	         silent recomputes, protocol errors;
//	regular  the same fleet size of regular engines (the prefill engines
//	         in fakepd's Regular mode: the same cache, compute and decode
//	         model) behind tetherd, both seeds through it at once: the
//	         hit rate the P/D phase is measured against;
//	regular-prefills
//	         the prefill engines alone as regular engines (the P/D
//	         fleet's prefix caches, without P/D) behind tetherd: the hit
//	         rate of the same caches placed without P/D;
//	sync     the workload through tetherd alone, with a weight sync
//	         (pause, update, resume: SGLang in -pd-sglang-pause mode,
//	         vLLM in -pd-vllm-pause mode) after a third of its requests:
//	         requests parked in a paused engine, outputs spanning two
//	         weight versions (the answers' and the engines' counts),
//	         engines at the new version, aborted requests (sent again by
//	         the client, as RL loops do).
//
//	go run ./cmd/tether-rlsim -pd sglang,vllm -workload grpo,sessions
//	make rlsim-pd

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/worker"
)

type pdConfig struct {
	protocols        string
	prefills         int
	decodes          int
	cacheTokens      int
	maxPrefill       int
	timeout          time.Duration
	sglangPause      string
	vllmPause        string
	notify           bool
	phases           string
	groupKey         bool
	together         bool
	kvEvents         bool
	out              io.Writer
	quietEngineStats bool
}

func pdFlags(pc *pdConfig) {
	flag.StringVar(&pc.protocols, "pd", "", "P/D run instead of the routing modes: the protocols, comma-separated (sglang, vllm); see pd.go")
	flag.IntVar(&pc.prefills, "prefills", 2, "P/D run: prefill engines")
	flag.IntVar(&pc.decodes, "decodes", 6, "P/D run: decode engines")
	flag.IntVar(&pc.cacheTokens, "pd-cache-tokens", 20480, "P/D run: prefix cache tokens per engine (prefills, and the regular engines it is compared with)")
	flag.IntVar(&pc.maxPrefill, "pd-max-prefill", 1, "P/D run: prompts an engine computes at once (0: no bound)")
	flag.DurationVar(&pc.timeout, "pd-timeout", 120*time.Second, "P/D run: a request not answered in this long is hung")
	flag.StringVar(&pc.sglangPause, "pd-sglang-pause", "abort", "P/D run, sync phase: SGLang's pause mode (abort, in_place, retract)")
	flag.StringVar(&pc.vllmPause, "pd-vllm-pause", "wait", "P/D run, sync phase: vLLM's pause mode (abort, wait, keep)")
	flag.BoolVar(&pc.notify, "pd-notify", false, "P/D run: the engines tell each other of aborts (newer engines)")
	flag.StringVar(&pc.phases, "pd-phases", "pd,regular,regular-prefills,sync", "P/D run: phases, comma-separated (pd, regular, regular-prefills, sync)")
	flag.BoolVar(&pc.together, "pd-together", false, "P/D run: tetherd and the direct client at once on one fleet (the direct client's prompts on tokens of its own), not one after the other on fleets of their own")
	flag.BoolVar(&pc.kvEvents, "pd-kv-events", true, "P/D run: the engines that compute prompts (prefills, regular engines) publish KV-cache events (SGLang's map form, vLLM's array form) and tetherd places by them")
	flag.BoolVar(&pc.groupKey, "pd-group-key", false, "P/D run: GRPO through tetherd sends its group as X-Session-ID (default keyless, as slime sends it)")
}

// pdEngine is what the run asks of a fake P/D engine.
type pdEngine interface {
	URL() string
	Held() int
	Kill()
	Statistics() *fakepd.Stats
	WeightVersion() string
}

// pdFleet is one protocol's fake engines, P/D or regular.
type pdFleet struct {
	proto    string
	prefills []pdEngine
	ports    []int
	decodes  []pdEngine
	regular  bool
	kvEvents bool // the prefills publish KV events, tetherd subscribes
}

// kvPublisher is a fake engine publishing its KV-cache events.
type kvPublisher interface {
	KVEventsEndpoint() string
	KVEventsReplayEndpoint() string
	KVEventsSubscribers() int
}

func (f *pdFleet) all() []pdEngine { return append(append([]pdEngine{}, f.prefills...), f.decodes...) }

func (f *pdFleet) close() {
	for _, e := range f.all() {
		e.Kill()
	}
}

// held is what the engines still hold: prefills (rooms, pinned blocks)
// and decodes (waiting or running requests).
func (f *pdFleet) held() (prefill, decode int) {
	for _, e := range f.prefills {
		prefill += e.Held()
	}
	for _, e := range f.decodes {
		decode += e.Held()
	}
	return
}

// heldIDs names what the prefills hold, for the report.
func (f *pdFleet) heldIDs(phase string) []string {
	var out []string
	for i, p := range f.prefills {
		if h, ok := p.(interface{ HeldIDs() []string }); ok {
			for _, id := range h.HeldIDs() {
				out = append(out, fmt.Sprintf("%s: prefill %d: %s", phase, i, id))
			}
		}
	}
	return out
}

func (f *pdFleet) sum(get func(*fakepd.Stats) int64) int64 {
	var n int64
	for _, e := range f.all() {
		n += get(e.Statistics())
	}
	return n
}

func startPDFleet(c config, pc pdConfig, proto string, regular bool) (*pdFleet, error) {
	o := fakepd.Options{
		PrefillPerToken: c.prefillPer, TokenDelay: c.decode, MaxPrefill: pc.maxPrefill, MaxRunning: c.maxRunning,
		CacheTokens: pc.cacheTokens, BlockTokens: c.blockToks, Notify: pc.notify, Regular: regular,
		WaitTimeout: pc.timeout, Lease: pc.timeout,
	}
	if pc.kvEvents {
		o.KVEvents = &fakepd.KVEventsConfig{Form: kvevents.MapForm, Hashes: kvevents.HashInt}
		if proto == "vllm" {
			o.KVEvents = &fakepd.KVEventsConfig{Form: kvevents.ArrayForm, Hashes: kvevents.HashUint, Replay: true}
		}
	}
	f := &pdFleet{proto: proto, regular: regular, kvEvents: pc.kvEvents}
	nP, nD := pc.prefills, pc.decodes
	if regular {
		nP, nD = pc.prefills+pc.decodes, 0
	}
	for i := 0; i < nP; i++ {
		if proto == "sglang" {
			p, err := fakepd.StartSGLangPrefill(o)
			if err != nil {
				f.close()
				return nil, err
			}
			f.prefills, f.ports = append(f.prefills, p), append(f.ports, p.BootstrapPort())
		} else {
			p, err := fakepd.StartVLLMPrefill(o)
			if err != nil {
				f.close()
				return nil, err
			}
			f.prefills, f.ports = append(f.prefills, p), append(f.ports, 0)
		}
	}
	for i := 0; i < nD; i++ {
		var d pdEngine
		var err error
		if proto == "sglang" {
			d, err = fakepd.StartSGLangDecode(o)
		} else {
			d, err = fakepd.StartVLLMDecode(o)
		}
		if err != nil {
			f.close()
			return nil, err
		}
		f.decodes = append(f.decodes, d)
	}
	return f, nil
}

// tetherd starts an in-process tetherd in front of f and waits until
// every worker is healthy (in its role).
func (f *pdFleet) tetherd() (*daemon.Daemon, error) {
	opts := daemon.Options{Listen: "127.0.0.1:0", BPF: "off", Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		Proxy: proxy.Config{QueueSize: 4096}, Routing: daemon.RoutingOptions{RouteHeader: daemon.RouteHeaderName}}
	for i, p := range f.prefills {
		switch {
		case f.regular:
			opts.Workers = append(opts.Workers, p.URL())
		case f.proto == "sglang":
			opts.Prefill = append(opts.Prefill, fmt.Sprintf("%s?bootstrap_port=%d", p.URL(), f.ports[i]))
		default:
			opts.Prefill = append(opts.Prefill, p.URL())
		}
	}
	for _, d := range f.decodes {
		opts.Decode = append(opts.Decode, d.URL())
	}
	if !f.regular {
		opts.PDProtocol = daemon.PDProtocol(f.proto)
	}
	opts.Routing.KVEvents.On = f.kvEvents
	d, err := daemon.New(opts)
	if err != nil {
		return nil, err
	}
	d.Serve()
	deadline := time.Now().Add(20 * time.Second)
	for {
		n := 0
		for _, w := range d.Table.Snapshot() {
			if w != nil && w.State() == worker.Healthy && (f.regular || w.Role() != worker.Regular) {
				n++
			}
		}
		if n == len(f.all()) {
			if err := f.subscribe(d); err != nil {
				d.Close()
				return nil, err
			}
			return d, nil
		}
		if time.Now().After(deadline) {
			d.Close()
			return nil, fmt.Errorf("%d of %d workers healthy in their roles after 20 s", n, len(f.all()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// subscribe gives tetherd every prefill's KV-events endpoints (the admin
// API's kv_events) and waits until it is subscribed to each.
func (f *pdFleet) subscribe(d *daemon.Daemon) error {
	if !f.kvEvents {
		return nil
	}
	for _, p := range f.prefills {
		var url string
		for _, w := range d.Table.Snapshot() {
			if w != nil && strings.HasPrefix(w.URL, p.URL()) {
				url = w.URL
			}
		}
		kp := p.(kvPublisher)
		if err := d.SetWorkerKVEvents(url, kp.KVEventsEndpoint(), kp.KVEventsReplayEndpoint()); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		n := 0
		for _, p := range f.prefills {
			if p.(kvPublisher).KVEventsSubscribers() > 0 {
				n++
			}
		}
		if n == len(f.prefills) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d of %d prefills' KV events subscribed after 20 s", n, len(f.prefills))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pdClient is one client of the run: through tetherd (base) or direct.
type pdClient struct {
	name   string
	proto  string
	base   string // tetherd; "": direct
	fleet  *pdFleet
	http   *http.Client
	resend bool // an answer aborted by a pause is sent again
	// groupKey: a keyless GRPO sample (rid w<wave>-p<prompt>-s<sample>)
	// is sent with its group as its key.
	groupKey bool
	// shift is added to every prompt token sent: the direct client's
	// workload is the tetherd client's (the same seed: the same lengths,
	// arrivals, sharing) on tokens of its own (no cache entry of one
	// serves the other).
	shift int

	outstanding []atomic.Int64 // direct: per decode

	mu        sync.Mutex
	byPrefill map[string]int64  // requests per prefill (tetherd's route header, or the direct client's pick)
	lastOf    map[string]string // a session's last turn's prefill
	turns     int64             // session turns after a session's first
	moved     int64             // of those, on another prefill than the turn before
	byKV      int64             // tetherd's prefills chosen by what their caches hold (prefill-kv)
	requests  int64
	failed    int64
	hung      int64
	wrong     int64
	aborted   int64
	spanning  int64
	outToks   int64
	prompt    int64
	cached    int64
	errs      []string
}

func newPDClient(name, proto, base string, f *pdFleet, timeout time.Duration) *pdClient {
	return &pdClient{name: name, proto: proto, base: base, fleet: f, outstanding: make([]atomic.Int64, len(f.decodes)),
		http: &http.Client{Timeout: timeout, Transport: &http.Transport{MaxIdleConnsPerHost: 2048, IdleConnTimeout: 30 * time.Second}}}
}

func (c *pdClient) fail(hung bool, format string, args ...any) error {
	err := fmt.Errorf(format, args...)
	c.mu.Lock()
	if hung {
		c.hung++
	} else {
		c.failed++
	}
	if len(c.errs) < 5 {
		c.errs = append(c.errs, err.Error())
	}
	c.mu.Unlock()
	return err
}

// pdAnswer is what the run reads of an answer, in either engine's shape.
type pdAnswer struct {
	OutputIDs []int `json:"output_ids"`
	MetaInfo  struct {
		FinishReason struct {
			Type string `json:"type"`
		} `json:"finish_reason"`
		CachedTokens   int      `json:"cached_tokens"`
		WeightVersions []string `json:"weight_versions"`
	} `json:"meta_info"`
	Choices []struct {
		Text         string `json:"text"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	Usage struct {
		Details struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	WeightVersions []string `json:"weight_versions"`
}

// read returns the output ids, finish reason, cached tokens and versions.
func (a *pdAnswer) read() ([]int, string, int, []string, error) {
	if a.MetaInfo.WeightVersions != nil || a.OutputIDs != nil {
		return a.OutputIDs, a.MetaInfo.FinishReason.Type, a.MetaInfo.CachedTokens, a.MetaInfo.WeightVersions, nil
	}
	if len(a.Choices) == 0 {
		return nil, "", 0, nil, errors.New("no choices")
	}
	var ids []int
	for _, f := range strings.Fields(a.Choices[0].Text) {
		t, err := strconv.Atoi(strings.TrimPrefix(f, "t"))
		if err != nil {
			return nil, "", 0, nil, fmt.Errorf("token %q", f)
		}
		ids = append(ids, t)
	}
	return ids, a.Choices[0].FinishReason, a.Usage.Details.CachedTokens, a.WeightVersions, nil
}

func (c *pdClient) body(ids []int, maxNew int, rid string) (string, []byte) {
	var b bytes.Buffer
	if c.proto == "sglang" {
		fmt.Fprintf(&b, `{"rid":%q,"input_ids":`, rid)
	} else {
		b.WriteString(`{"model":"m","prompt":`)
	}
	writeIDs(&b, ids)
	if c.proto == "sglang" {
		fmt.Fprintf(&b, `,"sampling_params":{"max_new_tokens":%d,"temperature":1.0}}`, maxNew)
		return "/generate", b.Bytes()
	}
	fmt.Fprintf(&b, `,"max_tokens":%d,"temperature":1.0}`, maxNew)
	return "/v1/completions", b.Bytes()
}

// send sends one request: the status, the body, and whether it timed out.
func (c *pdClient) send(key string, ids []int, maxNew int, rid string) (int, []byte, bool, error) {
	path, body := c.body(ids, maxNew, rid)
	if c.base != "" {
		req, err := http.NewRequest(http.MethodPost, c.base+path, bytes.NewReader(body))
		if err != nil {
			return 0, nil, false, err
		}
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("X-Session-ID", key)
		}
		resp, err := c.http.Do(req)
		if err != nil {
			return 0, nil, isTimeout(err), err
		}
		defer resp.Body.Close()
		rh := resp.Header.Get(daemon.RouteHeaderName)
		p, _, _ := strings.Cut(rh, "+")
		c.countPrefill(p, rid)
		if strings.Contains(rh, " prefill-kv") {
			c.mu.Lock()
			c.byKV++
			c.mu.Unlock()
		}
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, isTimeout(err), err
	}
	// Direct: the prefill by the key's hash (a GRPO group: the prompt's),
	// the decode least outstanding.
	h := fnv.New64a()
	if key != "" {
		h.Write([]byte(key))
	} else {
		for _, t := range ids {
			h.Write([]byte{byte(t), byte(t >> 8), byte(t >> 16)})
		}
	}
	pi := int(h.Sum64() % uint64(len(c.fleet.prefills)))
	di, least := 0, int64(math.MaxInt64)
	for i := range c.outstanding {
		if n := c.outstanding[i].Load(); n < least {
			di, least = i, n
		}
	}
	c.countPrefill("p"+strconv.Itoa(pi), rid)
	c.outstanding[di].Add(1)
	defer c.outstanding[di].Add(-1)
	ctx, cancel := context.WithTimeout(context.Background(), c.http.Timeout)
	defer cancel()
	p, d := c.fleet.prefills[pi].URL(), c.fleet.decodes[di].URL()
	var st int
	var out []byte
	var err error
	if c.proto == "sglang" {
		st, out, err = fakepd.DirectSGLang(ctx, c.http, p, c.fleet.ports[pi], d, path, body)
	} else {
		st, out, err = fakepd.DirectVLLM(ctx, c.http, p, d, path, body)
	}
	return st, out, ctx.Err() != nil, err
}

// countPrefill counts a request on prefill p; rid (name-rid-try) names
// a session's turn as <session>-t<turn>: a turn on another prefill than
// the session's turn before is a move.
func (c *pdClient) countPrefill(p, rid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byPrefill == nil {
		c.byPrefill, c.lastOf = map[string]int64{}, map[string]string{}
	}
	c.byPrefill[p]++
	rid = strings.TrimPrefix(rid, c.name+"-")
	if i := strings.LastIndexByte(rid, '-'); i > 0 {
		rid = rid[:i] // the try
	}
	i := strings.LastIndex(rid, "-t")
	if i <= 0 {
		return
	}
	s := rid[:i]
	if last, ok := c.lastOf[s]; ok {
		c.turns++
		if last != p {
			c.moved++
		}
	}
	c.lastOf[s] = p
}

// movedShare is the share of session turns (after the first) on another
// prefill than the turn before.
func (c *pdClient) movedShare() float64 {
	if c.turns == 0 {
		return 0
	}
	return float64(c.moved) / float64(c.turns)
}

// busiest is the share of the requests the busiest prefill (or regular
// engine) took.
func (c *pdClient) busiest() float64 {
	var most, all int64
	for _, n := range c.byPrefill {
		most, all = max(most, n), all+n
	}
	if all == 0 {
		return 0
	}
	return float64(most) / float64(all)
}

func isTimeout(err error) bool {
	var ue *url.Error
	return err != nil && (errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ue) && ue.Timeout())
}

// generate implements generator: one request, checked against the fake
// engines' output (token i of a prompt is fakeengine.OutputToken), sent
// again while a pause aborts it (c.resend).
func (c *pdClient) generate(key string, ids []int, maxNew int, rid string) ([]int, int, error) {
	if i := strings.LastIndex(rid, "-s"); c.groupKey && key == "" && i > 0 {
		key = rid[:i]
	}
	return c.generateShifted(key, ids, maxNew, rid, c.shift)
}

// sendPlain is generate without the client's shift (the same prompt by
// both clients).
func (c *pdClient) sendPlain(ids []int, maxNew int, rid string) ([]int, int, error) {
	return c.generateShifted("", ids, maxNew, rid, 0)
}

func (c *pdClient) generateShifted(key string, ids []int, maxNew int, rid string, shift int) ([]int, int, error) {
	if shift != 0 {
		s := make([]int, len(ids))
		for i, t := range ids {
			s[i] = t + shift
		}
		ids = s
	}
	for try := 0; ; try++ {
		c.mu.Lock()
		c.requests++
		c.mu.Unlock()
		st, b, hung, err := c.send(key, ids, maxNew, fmt.Sprintf("%s-%s-%d", c.name, rid, try))
		if hung {
			return nil, -1, c.fail(true, "%s: no answer within %v", rid, c.http.Timeout)
		}
		if err != nil || st != http.StatusOK {
			return nil, -1, c.fail(false, "%s: %d %v %.200s", rid, st, err, b)
		}
		var a pdAnswer
		if err := json.Unmarshal(b, &a); err != nil {
			return nil, -1, c.fail(false, "%s: answer %.200q: %v", rid, b, err)
		}
		out, finish, cached, versions, err := a.read()
		if err != nil {
			return nil, -1, c.fail(false, "%s: answer %.200q: %v", rid, b, err)
		}
		for i, t := range out {
			if t != fakeengine.OutputToken(ids, 0, i) {
				c.mu.Lock()
				c.wrong++
				c.mu.Unlock()
				return nil, -1, c.fail(false, "%s: token %d is %d, want %d", rid, i, t, fakeengine.OutputToken(ids, 0, i))
			}
		}
		c.mu.Lock()
		if len(versions) > 1 {
			c.spanning++
		}
		c.outToks += int64(len(out))
		c.mu.Unlock()
		if finish == "abort" && c.resend {
			c.mu.Lock()
			c.aborted++
			c.mu.Unlock()
			continue
		}
		if finish != "length" || len(out) != maxNew {
			return nil, -1, c.fail(false, "%s: finish %q with %d of %d tokens", rid, finish, len(out), maxNew)
		}
		c.mu.Lock()
		c.prompt += int64(len(ids))
		c.cached += int64(cached)
		c.mu.Unlock()
		return out, -1, nil
	}
}

func (c *pdClient) hit() float64 {
	if c.prompt == 0 {
		return 0
	}
	return float64(c.cached) / float64(c.prompt)
}

// runWorkload runs workload wl with cl and returns its makespan.
func runWorkload(c config, wl string, cl generator) (time.Duration, error) {
	start := time.Now()
	var err error
	switch wl {
	case "grpo":
		_, err = runGRPO(c, cl)
	case "sessions":
		err = runSessions(c, cl, 1, true)
	case "skewed":
		err = runSessions(c, cl, c.skew, true)
	case "keyless":
		err = runSessions(c, cl, 1, false)
	default:
		return 0, fmt.Errorf("the P/D run has no workload %q (grpo, sessions, skewed, keyless)", wl)
	}
	return time.Since(start), err
}

// pdMetric reads one of tetherd's tether_pd_* counters for proto.
func pdMetric(d *daemon.Daemon, name, proto string) float64 {
	rec := httptest.NewRecorder()
	d.Metrics.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	prefix := fmt.Sprintf("tether_pd_%s_total{protocol=%q} ", name, proto)
	for _, l := range strings.Split(rec.Body.String(), "\n") {
		if v, ok := strings.CutPrefix(l, prefix); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// settle waits up to 10 s for the engines to hold nothing and returns
// what they still hold.
func settle(f *pdFleet) (prefill, decode int) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		prefill, decode = f.held()
		if prefill+decode == 0 || time.Now().After(deadline) {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}
