// Command tether-rlsim replays RL rollout workloads on a fleet of fake
// inference engines (testenv/fakeengine: paged KV, prefix cache, waiting
// queue, the engine's load endpoints) through an in-process tetherd, once
// per routing mode, and prints its figures: prefix hit rate,
// prefill tokens computed, makespan, per-engine KV spread (max/mean of the
// engines' peak KV usage), preemptions, and for GRPO the engines a
// prompt's samples landed on.
//
// -engine picks the fakes and the client's wire (client.go): sglang
// (/generate with input_ids) or vllm (/v1/completions with the prompt as
// a token-id list, the id in X-Request-Id). The workloads' token counts
// are MIN-MAX flags (lengths.go: -task-tokens, -tool-tokens,
// -new-tokens, -question-tokens, -sample-tokens).
//
// Workloads (-workload):
//
//	grpo     keyless requests: waves × prompts × samples, each prompt a
//	         shared system prompt plus its own question, token ids
//	sessions keyed (X-Session-ID) agent sessions, turns in sequence, each
//	         turn's prompt the whole context so far
//	skewed   sessions where one in -skew-every has -skew× the context
//	keyless  the sessions sent without a key (token ids, as slime sends them)
//	restart  keyless sessions, engine 0 restarted (-restart-after): how
//	         long its entries in tetherd's KV index took to go
//
// Modes (-modes): before (tetherd with --engine-poll 0: placement by its
// in-flight counts, as before engine signals), default (tetherd's default
// flags), prefix (--keyless=prefix --engine-poll 0), sticky
// (--policy=sticky), random (no router: a random engine per request; a
// session keeps its engine for all turns in random mode would be sticky,
// so every request draws again), hash (no router: crc32 of the key modulo
// the engines, keyless requests random), kv (tetherd placing by the
// engines' KV-cache events; the fake engines publish them in
// -kv-form with replay).
//
//	go run ./cmd/tether-rlsim            # all workloads, all modes
//	make rlsim
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	settings "github.com/tether-rl/tether/userspace/config"
	"github.com/tether-rl/tether/userspace/daemon"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/proxy"
	"github.com/tether-rl/tether/userspace/route"
)

type config struct {
	engines    int
	kvBlocks   int
	blockToks  int
	maxRunning int
	prefillPer time.Duration
	decode     time.Duration

	waves, prompts, samples int
	sysTokens               int
	lengths                 lengths // drawn token counts (-task-tokens...)

	sessions, turns int
	skewEvery, skew int

	seed uint64

	engine       string // routing-mode runs: the fake engines' kind and wire, sglang or vllm
	kvForm       kvevents.Form
	restartAfter time.Duration
	perEngine    bool
	log          io.Writer // tetherd's log (-log; io.Discard)
}

func main() {
	var c config
	flag.IntVar(&c.engines, "engines", 8, "fake engines")
	flag.IntVar(&c.kvBlocks, "kv-blocks", 1280, "KV blocks per engine at 16 tokens each (scaled for -block-tokens: the same tokens)")
	flag.IntVar(&c.blockToks, "block-tokens", 16, "tokens per KV block (the engines' page size; -kv-blocks scales so that the KV cache holds the same tokens)")
	flag.IntVar(&c.maxRunning, "max-running", 64, "running batch bound per engine")
	// An engine's time scale: a decode step of a batch (20 ms) and the
	// prefill of 500 uncached tokens (20 ms) are close to a 7B model's on
	// one GPU; tetherd's --engine-poll (1s) is 50 decode steps.
	flag.DurationVar(&c.prefillPer, "prefill-per-token", 40*time.Microsecond, "simulated prefill compute per uncached prompt token")
	flag.DurationVar(&c.decode, "decode-step", 20*time.Millisecond, "simulated decode step")
	flag.IntVar(&c.waves, "waves", 2, "GRPO waves")
	flag.IntVar(&c.prompts, "prompts", 48, "GRPO prompts per wave")
	flag.IntVar(&c.samples, "samples", 8, "GRPO samples per prompt")
	flag.IntVar(&c.sysTokens, "system-tokens", 1024, "shared system prompt tokens (GRPO prompts, agent sessions)")
	c.lengths = defaultLengths
	lengthFlags(flag.CommandLine, &c.lengths)
	flag.IntVar(&c.sessions, "sessions", 96, "agent sessions")
	flag.IntVar(&c.turns, "turns", 6, "turns per session")
	flag.IntVar(&c.skewEvery, "skew-every", 8, "skewed workload: one session in this many is long")
	flag.IntVar(&c.skew, "skew", 10, "skewed workload: how many times the context of a long session")
	workloads := flag.String("workload", "grpo,sessions,skewed", "workloads, comma-separated (also keyless: sessions sent without a key; restart: keyless sessions with engine 0 restarted mid-run)")
	modes := flag.String("modes", "before,default,prefix,sticky,random", "routing modes, comma-separated (also kv: tetherd with the engines' KV-cache events; hash: no router, crc32 of the key, keyless random)")
	form := flag.String("kv-form", "map", "KV-event wire form of the fake engines: map or array")
	flag.StringVar(&c.engine, "engine", engineSGLang, "routing-mode runs (not -pd): the fake engines and the client's wire, sglang (/generate with input_ids, rid) or vllm (/v1/completions with the prompt's token ids, X-Request-Id; load from /metrics)")
	flag.DurationVar(&c.restartAfter, "restart-after", 2*time.Second, "restart workload: engine 0 restarts this long after the start")
	runs := flag.Int("runs", 1, "runs per cell (the median makespan's run is reported)")
	flag.BoolVar(&c.perEngine, "per-engine", false, "print each run's figures per engine (requests, sessions, long sessions, prompt and prefill tokens, preemptions, last answer, the engine model's busy time) and the sessions' moves, and the sessions workloads' bounds (bound.go)")
	seed := flag.Uint64("seed", 1, "workload seed")
	logPath := flag.String("log", "", "write tetherd's log (info and above) to this file")
	var pc pdConfig
	pdFlags(&pc)
	flag.Parse()
	c.seed = *seed
	c.log = io.Discard
	if *logPath != "" {
		f, err := os.Create(*logPath)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		defer f.Close()
		c.log = f
	}
	if pc.protocols == "" && c.engine != engineSGLang && c.engine != engineVLLM {
		fmt.Fprintf(os.Stderr, "-engine %q: sglang or vllm\n", c.engine)
		os.Exit(2)
	}
	kvBlocks := c.kvBlocks * 16 / max(c.blockToks, 1)
	kvTokens := kvBlocks * max(c.blockToks, 1)
	if pc.protocols != "" {
		kvTokens = 0 // the P/D fakes' caches are -pd-cache-tokens; they answer what does not fit
	}
	if err := checkLengths(c, strings.Split(*workloads, ","), kvTokens); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if pc.protocols != "" {
		// The P/D run (pd.go) instead of the routing modes.
		if err := runPDAll(c, pc, strings.Split(*workloads, ",")); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	var err error
	if c.kvForm, err = parseKVForm(*form); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}

	engines, err := startFleet(c)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer func() {
		for _, e := range engines {
			e.Close()
		}
	}()
	fmt.Printf("tether-rlsim: %d fake %s engines, %d KV blocks × %d tokens, max running %d, prefill %v/token, decode step %v\n\n",
		c.engines, engineName(c.engine), kvBlocks, c.blockToks, c.maxRunning, c.prefillPer, c.decode)
	fmt.Printf("| workload | mode | makespan | hit rate | prefill tokens | KV spread (peak max/mean) | peak KV | preemptions | engines per prompt | decisions | restart: entries gone after |\n")
	fmt.Printf("|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, wl := range strings.Split(*workloads, ",") {
		// Runs interleave the modes (run 1 of each, then run 2...), so
		// that a busy spell of the host falls on every mode alike.
		ms := strings.Split(*modes, ",")
		all := make([][]result, len(ms))
		for r := 0; r < *runs; r++ {
			for i, mode := range ms {
				res, err := runOne(c, engines, wl, mode)
				if err != nil {
					fmt.Fprintf(os.Stderr, "%s/%s: %v\n", wl, mode, err)
					os.Exit(1)
				}
				all[i] = append(all[i], res)
			}
		}
		if *runs > 1 {
			// Each run's makespans, mode by mode: compare within a run.
			var parts []string
			for i, mode := range ms {
				var v []string
				for _, res := range all[i] {
					v = append(v, fmt.Sprintf("%.2f", res.makespan.Seconds()))
				}
				parts = append(parts, mode+"="+strings.Join(v, "/"))
			}
			fmt.Fprintf(os.Stderr, "%s makespans by run (s): %s\n", wl, strings.Join(parts, " "))
		}
		medians := make([]time.Duration, len(ms))
		for i, mode := range ms {
			rs := all[i]
			sort.Slice(rs, func(i, j int) bool { return rs[i].makespan < rs[j].makespan })
			r := rs[len(rs)/2]
			gpp := "-"
			if r.groupEngines > 0 {
				gpp = fmt.Sprintf("%.2f", r.groupEngines)
			}
			gone := "-"
			if r.gone > 0 {
				gone = r.gone.Round(time.Millisecond).String()
			}
			fmt.Printf("| %s | %s | %.2f s | %.3f | %d | %.2f | %.2f | %d | %s | %s | %s |\n",
				wl, mode, r.makespan.Seconds(), r.hit, r.prefill, r.kvSpread, r.peakKV, r.preempt, gpp, r.decisions, gone)
			medians[i] = r.makespan
		}
		if skew, ok := sessionsSkew(c, wl); ok && c.perEngine {
			sys, plans := sessionPlans(c, skew)
			printBounds(os.Stdout, wl, boundsOf(c, sessionCosts(c, sys, plans)), ms, medians)
		}
	}
}

type result struct {
	makespan     time.Duration
	hit          float64
	prefill      int64
	kvSpread     float64
	peakKV       float64
	preempt      int64
	groupEngines float64
	decisions    string
	gone         time.Duration // restart: the restarted engine's entries gone this long after
}

// parseKVForm parses -kv-form. kvevents.ArrayForm is Form's zero, so
// "map" must be set, not assumed (the default map once ran arrays).
func parseKVForm(s string) (kvevents.Form, error) {
	switch s {
	case "map":
		return kvevents.MapForm, nil
	case "array":
		return kvevents.ArrayForm, nil
	}
	return 0, fmt.Errorf("-kv-form %q: map or array", s)
}

// startFleet starts the routing-mode runs' fake engines: -engine's kind,
// publishing KV-cache events in -kv-form with replay (SGLang's hashes as
// int64; vLLM's as uint64, its replay replies led by the topic from the
// map form on, as vLLM 0.26 sends them).
func startFleet(c config) ([]*fakeengine.Engine, error) {
	ev := &fakeengine.KVEventsConfig{Form: c.kvForm, Hashes: kvevents.HashInt, Replay: true}
	kind := fakeengine.SGLang
	if c.engine == engineVLLM {
		kind = fakeengine.VLLM
		ev.Hashes, ev.TopicInReplies = kvevents.HashUint, c.kvForm == kvevents.MapForm
	}
	return fakeengine.StartFleet(c.engines, fakeengine.Config{
		Kind: kind, KVBlocks: c.kvBlocks * 16 / max(c.blockToks, 1), BlockTokens: c.blockToks, MaxRunning: c.maxRunning,
		PrefillPerToken: c.prefillPer, DecodeStep: c.decode, KVEvents: ev,
	})
}

// engineName is how the header line names -engine's engines.
func engineName(engine string) string {
	if engine == engineVLLM {
		return "vLLM"
	}
	return "SGLang"
}

// runOne runs one workload in one mode on freshly reset engines.
func runOne(c config, engines []*fakeengine.Engine, wl, mode string) (result, error) {
	for _, e := range engines {
		e.Reset()
	}
	urls := make([]string, len(engines))
	for i, e := range engines {
		urls[i] = e.URL()
	}
	target := ""
	var d *daemon.Daemon
	if mode != "random" && mode != "hash" {
		ro := daemon.RoutingOptions{StickyStore: daemon.StickyMemory, RouteHeader: daemon.RouteHeaderName}
		off := settings.Some(time.Duration(0)) // no engine polling
		switch mode {
		case "before":
			ro.EnginePoll = off
		case "default":
		case "prefix":
			ro.EnginePoll, ro.Keyless = off, route.KeylessPrefix
		case "sticky":
			ro.Policy = route.PolicySticky
		case "kv":
			ro.KVEvents.On = true
		default:
			return result{}, fmt.Errorf("unknown mode %q", mode)
		}
		var err error
		d, err = daemon.New(daemon.Options{
			Listen: "127.0.0.1:0", Workers: urls, BPF: "off", Routing: ro,
			Log: slog.New(slog.NewTextHandler(c.log, nil)), Proxy: proxy.Config{QueueSize: 4096},
		})
		if err != nil {
			return result{}, err
		}
		d.Serve()
		defer d.Shutdown(context.Background())
		target = "http://" + d.Addr()
		if mode == "kv" {
			for _, e := range engines {
				if err := d.SetWorkerKVEvents(e.URL(), e.KVEventsEndpoint(), e.KVEventsReplayEndpoint()); err != nil {
					return result{}, err
				}
			}
			deadline := time.Now().Add(10 * time.Second)
			for !allSubscribed(engines) {
				if time.Now().After(deadline) {
					return result{}, fmt.Errorf("KV events not subscribed within 10s")
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
		if ro.EnginePoll != off {
			deadline := time.Now().Add(10 * time.Second)
			for !allKnown(d) {
				if time.Now().After(deadline) {
					return result{}, fmt.Errorf("engine signals not read within 10s")
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	cl := &client{http: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2048, MaxConnsPerHost: 0, IdleConnTimeout: 30 * time.Second}},
		target: target, engines: urls, rng: rand.New(rand.NewPCG(c.seed, 7)), hashKeys: mode == "hash", vllm: c.engine == engineVLLM,
		trace: newTrace(len(urls))}
	defer cl.http.CloseIdleConnections()
	start := time.Now()
	cl.trace.start = start
	var err error
	var groupEngines float64
	var restartGone time.Duration
	switch wl {
	case "grpo":
		groupEngines, err = runGRPO(c, cl)
	case "sessions", "skewed", "keyless":
		skew, _ := sessionsSkew(c, wl)
		err = runSessions(c, cl, skew, wl != "keyless")
	case "restart":
		done := make(chan time.Duration, 1)
		go func() { done <- restartOne(c, engines[0], d) }()
		err = runSessions(c, cl, 1, false)
		gone := <-done
		if err == nil && gone < 0 {
			err = fmt.Errorf("the restarted engine's entries were not gone within 5 s")
		}
		restartGone = gone
	default:
		err = fmt.Errorf("unknown workload %q", wl)
	}
	if err != nil {
		return result{}, err
	}
	r := result{makespan: time.Since(start), groupEngines: groupEngines, gone: restartGone}
	var prompt, cached int64
	var sumPeak float64
	for _, e := range engines {
		s := e.Stats()
		prompt += s.PromptTokens
		cached += s.CachedTokens
		r.prefill += s.PrefillTokens
		r.preempt += s.Preemptions
		sumPeak += s.PeakKVUsage
		r.peakKV = max(r.peakKV, s.PeakKVUsage)
	}
	if prompt > 0 {
		r.hit = float64(cached) / float64(prompt)
	}
	if sumPeak > 0 {
		r.kvSpread = r.peakKV / (sumPeak / float64(len(engines)))
	}
	if c.perEngine {
		cl.trace.print(os.Stdout, wl, mode, engines, c)
	}
	if d != nil {
		rc := d.RoutingCounts()
		var parts []string
		for k, v := range rc.Decisions {
			if v > 0 {
				parts = append(parts, k+"="+strconv.FormatUint(v, 10))
			}
		}
		sort.Strings(parts)
		if pp := d.Router.PrefixPlacement(); pp != nil {
			if n := pp.Counts().Moved; n > 0 {
				parts = append(parts, "keys_moved="+strconv.FormatUint(n, 10))
			}
		}
		r.decisions = strings.Join(parts, " ")
	} else {
		r.decisions = "-"
	}
	return r, nil
}

// sessionsSkew says whether wl is a sessions workload (sessions, skewed,
// keyless: the same draw, keyless without keys) and its skew.
func sessionsSkew(c config, wl string) (int, bool) {
	switch wl {
	case "sessions", "keyless":
		return 1, true
	case "skewed":
		return c.skew, true
	}
	return 0, false
}

func allKnown(d *daemon.Daemon) bool {
	for _, w := range d.Table.Snapshot() {
		if w != nil && !w.EngineKnown() {
			return false
		}
	}
	return true
}

// runGRPO: waves of prompts × samples sent at once; it returns the mean
// number of engines a prompt's samples went to.
func runGRPO(c config, cl generator) (float64, error) {
	rng := rand.New(rand.NewPCG(c.seed, 1))
	sys := make([]int, c.sysTokens)
	for i := range sys {
		sys[i] = 1000 + rng.IntN(30000)
	}
	var sumEngines float64
	for wave := 0; wave < c.waves; wave++ {
		type job struct {
			prompt []int
			maxNew int
			p, s   int
		}
		var jobs []job
		for p := 0; p < c.prompts; p++ {
			q := make([]int, c.lengths.question.draw(rng))
			for i := range q {
				q[i] = 1000 + rng.IntN(30000)
			}
			prompt := append(append([]int(nil), sys...), q...)
			for s := 0; s < c.samples; s++ {
				jobs = append(jobs, job{prompt: prompt, maxNew: c.lengths.sample.draw(rng), p: p, s: s})
			}
		}
		slots := make([][]int, c.prompts)
		for p := range slots {
			slots[p] = make([]int, c.samples)
		}
		var wg sync.WaitGroup
		errs := make(chan error, len(jobs))
		for _, j := range jobs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, slot, err := cl.generate("", j.prompt, j.maxNew, fmt.Sprintf("w%d-p%d-s%d", wave, j.p, j.s))
				if err != nil {
					errs <- err
					return
				}
				slots[j.p][j.s] = slot
			}()
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			return 0, err
		}
		for _, ss := range slots {
			seen := map[int]bool{}
			for _, s := range ss {
				seen[s] = true
			}
			sumEngines += float64(len(seen))
		}
	}
	return sumEngines / float64(c.waves*c.prompts), nil
}

// sessionPlan is one agent session: its task, each turn's tool result and
// max new tokens.
type sessionPlan struct {
	task   []int
	tools  [][]int
	maxNew []int
}

// sessionPlans draws the sessions workload (runSessions): the shared
// system prompt and each session's plan, from c.seed.
func sessionPlans(c config, skew int) ([]int, []sessionPlan) {
	rng := rand.New(rand.NewPCG(c.seed, 2))
	sys := make([]int, c.sysTokens)
	for i := range sys {
		sys[i] = 1000 + rng.IntN(30000)
	}
	toks := func(n int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = 1000 + rng.IntN(30000)
		}
		return s
	}
	plans := make([]sessionPlan, c.sessions)
	for s := range plans {
		mult := 1
		if skew > 1 && s%c.skewEvery == 0 {
			mult = skew
		}
		p := sessionPlan{task: toks(mult * c.lengths.task.draw(rng))}
		for t := 0; t < c.turns; t++ {
			p.tools = append(p.tools, toks(c.lengths.tool.draw(rng)))
			p.maxNew = append(p.maxNew, c.lengths.newToks.draw(rng))
		}
		plans[s] = p
	}
	return sys, plans
}

// runSessions: agent sessions, all at once, turns in sequence; each turn
// sends the whole context (shared system prompt, task, earlier turns'
// outputs and tool results). One session in skewEvery has skew× the
// context: a task (document, repository) that long; its turns add what
// the others' do.
func runSessions(c config, cl generator, skew int, keyed bool) error {
	sys, plans := sessionPlans(c, skew)
	var wg sync.WaitGroup
	errs := make(chan error, c.sessions)
	for s := range plans {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := plans[s]
			key := fmt.Sprintf("agent-%d", s)
			send := key
			if !keyed {
				send = ""
			}
			ctx := append(append([]int(nil), sys...), p.task...)
			for t := 0; t < c.turns; t++ {
				out, _, err := cl.generate(send, ctx, p.maxNew[t], fmt.Sprintf("%s-t%d", key, t))
				if err != nil {
					errs <- err
					return
				}
				ctx = append(append(ctx, out...), p.tools[t]...)
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func allSubscribed(engines []*fakeengine.Engine) bool {
	for _, e := range engines {
		if e.KVEventsSubscribers() == 0 {
			return false
		}
	}
	return true
}

// restartOne restarts engine e after c.restartAfter and returns how long
// its entries in tetherd's index took to go (-1: not within 5 s; 0: no
// index, a baseline mode).
func restartOne(c config, e *fakeengine.Engine, d *daemon.Daemon) time.Duration {
	time.Sleep(c.restartAfter)
	blocks := func() int64 {
		st, _, ok := d.KVEventsStatus()
		if !ok {
			return 0
		}
		var n int64
		for _, s := range st[e.URL()] {
			n += s.Blocks
		}
		return n
	}
	on := d != nil
	if on {
		if _, _, ok := d.KVEventsStatus(); !ok {
			on = false
		}
	}
	before := int64(0)
	if on {
		before = blocks()
	}
	t0 := time.Now()
	e.Restart()
	if !on {
		return 0
	}
	for time.Since(t0) < 5*time.Second {
		if blocks() == 0 {
			if before == 0 {
				return time.Nanosecond // nothing was indexed to begin with
			}
			return time.Since(t0)
		}
		time.Sleep(time.Millisecond)
	}
	return -1
}
