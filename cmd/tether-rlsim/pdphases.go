package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/daemon"
)

// pdRun is one protocol's and workload's figures, phase by phase.
type pdRun struct {
	proto, wl string

	// pd: tetherd and the direct client at once.
	tether, direct         *pdClient
	tetherSpan, directSpan time.Duration
	heldPrefill, heldDec   int   // after the run settled: orphaned
	recomputes             int64 // decodes that recomputed (silently, in vLLM)
	protocolErrs           int64 // refused legs, bad prefill legs, room timeouts
	retries, missingKV     float64
	legFailed              [2]float64 // tetherd's prefill and decode legs failed before the client had a byte
	probes, mismatched     int        // the same prompts by both clients: different answers

	// regular: the same workload on regular engines; regular-prefills:
	// on the prefill engines alone as regular engines (the P/D fleet's
	// prefix caches, without P/D).
	regular, regularOther *pdClient
	regularP              *pdClient

	// sync: tetherd alone, a weight sync under load.
	synced                *pdClient
	syncErr               string
	parked, mixed         int64
	atVersion, engines    int
	syncHeldP, syncHeldD  int
	orphans               []string // what the prefills held after a phase
	pauseS, updS, resumeS float64
	syncRetries           float64 // tetherd's second attempts (a leg that failed, or an aborted vLLM prefill)
}

func (r *pdRun) throughput(c *pdClient, span time.Duration) float64 {
	if span <= 0 {
		return 0
	}
	return float64(c.outToks) / span.Seconds()
}

// Zeros lists the run's non-zero failures (empty: all zero).
func (r *pdRun) Zeros() []string {
	var bad []string
	add := func(what string, n int64) {
		if n != 0 {
			bad = append(bad, fmt.Sprintf("%s %d", what, n))
		}
	}
	for _, c := range []*pdClient{r.tether, r.direct, r.regular, r.regularOther, r.regularP, r.synced} {
		if c == nil {
			continue
		}
		add(c.name+" failed", c.failed)
		add(c.name+" hung", c.hung)
		add(c.name+" wrong", c.wrong)
		if len(c.errs) > 0 {
			bad = append(bad, c.name+": "+strings.Join(c.errs, "; "))
		}
	}
	add("answers that differ between tetherd and the direct client", int64(r.mismatched))
	add("orphaned on prefills", int64(r.heldPrefill+r.syncHeldP))
	if len(r.orphans) > 0 {
		bad = append(bad, "orphans: "+strings.Join(r.orphans, ", "))
	}
	add("held by decodes", int64(r.heldDec+r.syncHeldD))
	add("recomputes", r.recomputes)
	add("protocol errors", r.protocolErrs)
	add("parked", r.parked)
	add("spanning outputs (engines)", r.mixed)
	if r.synced != nil {
		add("spanning outputs (answers)", r.synced.spanning)
		add("engines not at the new version", int64(r.engines-r.atVersion))
		if r.syncErr != "" {
			bad = append(bad, "sync: "+r.syncErr)
		}
	}
	return bad
}

func runPDAll(c config, pc pdConfig, workloads []string) error {
	if pc.out == nil {
		pc.out = os.Stdout
	}
	w := pc.out
	fmt.Fprintf(w, "tether-rlsim P/D: %d prefills + %d decodes per protocol; prefix cache %d tokens per engine in %d-token blocks; prefill %v per uncached token, %d prompts at once; decode %v per token, %d at once; notify %v; KV events %v\n\n",
		pc.prefills, pc.decodes, pc.cacheTokens, c.blockToks, c.prefillPer, pc.maxPrefill, c.decode, c.maxRunning, pc.notify, pc.kvEvents)
	var runs []*pdRun
	for _, proto := range strings.Split(pc.protocols, ",") {
		if proto != "sglang" && proto != "vllm" {
			return fmt.Errorf("-pd %q: sglang or vllm", proto)
		}
		for _, wl := range workloads {
			r, err := runPD(c, pc, proto, wl)
			if err != nil {
				return fmt.Errorf("%s/%s: %w", proto, wl, err)
			}
			runs = append(runs, r)
		}
	}
	printPD(w, runs)
	for _, r := range runs {
		if bad := r.Zeros(); len(bad) > 0 {
			return fmt.Errorf("%s/%s: not all zero: %s", r.proto, r.wl, strings.Join(bad, ", "))
		}
	}
	return nil
}

func has(list, x string) bool {
	for _, s := range strings.Split(list, ",") {
		if s == x {
			return true
		}
	}
	return false
}

// runPD runs the phases for one protocol and workload, each on fresh engines.
func runPD(c config, pc pdConfig, proto, wl string) (*pdRun, error) {
	r := &pdRun{proto: proto, wl: wl}
	other := c // the direct client's workload: the same, on other tokens (pdClient.shift)
	if has(pc.phases, "pd") {
		if err := phasePD(c, other, pc, r); err != nil {
			return nil, fmt.Errorf("pd: %w", err)
		}
	}
	if has(pc.phases, "regular") {
		if err := phaseRegular(c, other, pc, r, false); err != nil {
			return nil, fmt.Errorf("regular: %w", err)
		}
	}
	if has(pc.phases, "regular-prefills") {
		if err := phaseRegular(c, other, pc, r, true); err != nil {
			return nil, fmt.Errorf("regular-prefills: %w", err)
		}
	}
	if has(pc.phases, "sync") {
		if err := phaseSync(c, pc, r); err != nil {
			return nil, fmt.Errorf("sync: %w", err)
		}
	}
	return r, nil
}

// both runs two clients' workloads at once and returns their makespans.
func both(c, other config, wl string, a, b *pdClient) (time.Duration, time.Duration) {
	var sa, sb time.Duration
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); sa, _ = runWorkload(c, wl, a) }()
	go func() { defer wg.Done(); sb, _ = runWorkload(other, wl, b) }()
	wg.Wait()
	return sa, sb
}

func phasePD(c, other config, pc pdConfig, r *pdRun) error {
	fa, err := startPDFleet(c, pc, r.proto, false)
	if err != nil {
		return err
	}
	defer fa.close()
	d, err := fa.tetherd()
	if err != nil {
		return err
	}
	defer d.Shutdown(context.Background())
	r.tether = newPDClient("tetherd", r.proto, "http://"+d.Addr(), fa, pc.timeout)
	r.tether.groupKey = pc.groupKey
	defer r.tether.http.CloseIdleConnections()
	if pc.together {
		r.direct = newPDClient("direct", r.proto, "", fa, pc.timeout)
		r.direct.shift = fakeengine.Vocab
		defer r.direct.http.CloseIdleConnections()
		r.tetherSpan, r.directSpan = both(c, other, r.wl, r.tether, r.direct)
		probe(r)
		r.measure(fa, d)
		return nil
	}
	// One after the other, each alone on a fleet of its own (the same
	// engines' settings, fresh): the same workload.
	r.tetherSpan, _ = runWorkload(c, r.wl, r.tether)
	fb, err := startPDFleet(c, pc, r.proto, false)
	if err != nil {
		return err
	}
	defer fb.close()
	r.direct = newPDClient("direct", r.proto, "", fb, pc.timeout)
	defer r.direct.http.CloseIdleConnections()
	r.directSpan, _ = runWorkload(c, r.wl, r.direct)
	probe(r)
	r.measure(fa, d)
	r.measure(fb, nil)
	return nil
}

// measure adds what f's engines (and tetherd d in front of them) still
// hold and counted once a phase is over.
func (r *pdRun) measure(f *pdFleet, d *daemon.Daemon) {
	p, dec := settle(f)
	r.heldPrefill += p
	r.heldDec += dec
	r.orphans = append(r.orphans, f.heldIDs("pd")...)
	r.recomputes += f.sum(func(s *fakepd.Stats) int64 { return s.Recomputes.Load() })
	r.protocolErrs += f.sum(func(s *fakepd.Stats) int64 { return s.Refused.Load() + s.BadPrefill.Load() + s.Timeouts.Load() })
	if d != nil {
		r.recomputes += int64(pdMetric(d, "passed_without_kv_params", r.proto))
		r.retries, r.missingKV = pdMetric(d, "retries", r.proto), pdMetric(d, "missing_kv_params", r.proto)
		r.legFailed = [2]float64{pdMetric(d, "prefill_failed", r.proto), pdMetric(d, "decode_failed", r.proto)}
	}
}

// probe sends the same prompts by both clients and counts the answers
// that differ.
func probe(r *pdRun) {
	// The workload's own figures stay the workload's.
	type figures struct {
		requests, outToks, prompt, cached int64
		byPrefill                         map[string]int64
	}
	saved := [2]figures{}
	for i, c := range []*pdClient{r.tether, r.direct} {
		saved[i] = figures{c.requests, c.outToks, c.prompt, c.cached, map[string]int64{}}
		for k, v := range c.byPrefill {
			saved[i].byPrefill[k] = v
		}
	}
	defer func() {
		for i, c := range []*pdClient{r.tether, r.direct} {
			f := saved[i]
			c.requests, c.outToks, c.prompt, c.cached, c.byPrefill = f.requests, f.outToks, f.prompt, f.cached, f.byPrefill
		}
	}()
	const n = 8
	for i := 0; i < n; i++ {
		ids := make([]int, 40+i*17)
		for k := range ids {
			ids[k] = 1000 + (k*7919+i*104729)%30000
		}
		a, _, errA := r.tether.generate("", ids, 5+i, fmt.Sprintf("probe-%d", i))
		b, _, errB := r.direct.sendPlain(ids, 5+i, fmt.Sprintf("probe-%d", i))
		r.probes++
		if errA != nil || errB != nil || fmt.Sprint(a) != fmt.Sprint(b) {
			r.mismatched++
		}
	}
}

// phaseRegular runs the workload on the fleet's engines as regular
// workers (prefillsOnly: the prefill engines alone, the P/D fleet's
// prefix caches) behind tetherd.
func phaseRegular(c, other config, pc pdConfig, r *pdRun, prefillsOnly bool) error {
	if prefillsOnly {
		pc.decodes = 0
	}
	f, err := startPDFleet(c, pc, r.proto, true)
	if err != nil {
		return err
	}
	defer f.close()
	d, err := f.tetherd()
	if err != nil {
		return err
	}
	defer d.Shutdown(context.Background())
	base := "http://" + d.Addr()
	if prefillsOnly {
		r.regularP = newPDClient("regular-prefills", r.proto, base, f, pc.timeout)
		defer r.regularP.http.CloseIdleConnections()
		runWorkload(c, r.wl, r.regularP)
		settle(f)
		return nil
	}
	r.regular = newPDClient("regular", r.proto, base, f, pc.timeout)
	defer r.regular.http.CloseIdleConnections()
	if !pc.together {
		runWorkload(c, r.wl, r.regular)
		settle(f)
		return nil
	}
	// Both workloads, as the P/D phase ran them.
	r.regularOther = newPDClient("regular-other", r.proto, base, f, pc.timeout)
	r.regularOther.shift = fakeengine.Vocab
	defer r.regularOther.http.CloseIdleConnections()
	both(c, other, r.wl, r.regular, r.regularOther)
	settle(f)
	return nil
}

// control posts a control call to tetherd: its status and seconds.
func control(cl *http.Client, base, path, body string) (int, string, float64) {
	start := time.Now()
	resp, err := cl.Post(base+path, "application/json", strings.NewReader(body))
	if err != nil {
		return 0, err.Error(), 0
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), time.Since(start).Seconds()
}

func phaseSync(c config, pc pdConfig, r *pdRun) error {
	f, err := startPDFleet(c, pc, r.proto, false)
	if err != nil {
		return err
	}
	defer f.close()
	d, err := f.tetherd()
	if err != nil {
		return err
	}
	defer d.Shutdown(context.Background())
	base := "http://" + d.Addr()
	cl := newPDClient("sync", r.proto, base, f, pc.timeout)
	cl.resend = true
	defer cl.http.CloseIdleConnections()
	r.synced = cl
	// A third of the workload's requests, then the sync.
	total := int64(c.waves * c.prompts * c.samples)
	if r.wl != "grpo" {
		total = int64(c.sessions * c.turns)
	}
	done := make(chan struct{})
	go func() { defer close(done); runWorkload(c, r.wl, cl) }()
	for {
		cl.mu.Lock()
		n := cl.requests
		cl.mu.Unlock()
		if n >= total/3 {
			break
		}
		select {
		case <-done:
			return fmt.Errorf("the workload ended before a third of its requests were sent")
		case <-time.After(5 * time.Millisecond):
		}
	}
	pause, pbody, upd, resume := "/pause_generation", fmt.Sprintf(`{"mode":%q}`, pc.sglangPause), "/update_weights_from_disk", "/continue_generation"
	if r.proto == "vllm" {
		pause, pbody, upd, resume = "/pause?mode="+pc.vllmPause, "", "/update_weights", "/resume"
	}
	sep := "?"
	if strings.Contains(pause, "?") {
		sep = "&"
	}
	ctl := &http.Client{Timeout: 2 * time.Minute}
	st, ans, secs := control(ctl, base, pause+sep+"timeout_s=60", pbody)
	r.pauseS = secs
	if st != http.StatusOK {
		r.syncErr = fmt.Sprintf("pause: %d %.300s", st, ans)
	}
	st, ans, r.updS = control(ctl, base, upd, `{"model_path":"/ckpt/v1","weight_version":"v1"}`)
	if st != http.StatusOK && r.syncErr == "" {
		r.syncErr = fmt.Sprintf("update: %d %.300s", st, ans)
	}
	st, ans, r.resumeS = control(ctl, base, resume, "")
	if st != http.StatusOK && r.syncErr == "" {
		r.syncErr = fmt.Sprintf("resume: %d %.300s", st, ans)
	}
	<-done
	r.syncHeldP, r.syncHeldD = settle(f)
	r.orphans = append(r.orphans, f.heldIDs("sync")...)
	r.syncRetries = pdMetric(d, "retries", r.proto)
	r.parked = f.sum(func(s *fakepd.Stats) int64 { return s.ParkedWhilePaused.Load() })
	r.mixed = f.sum(func(s *fakepd.Stats) int64 { return s.MixedVersionOutputs.Load() })
	for _, e := range f.all() {
		r.engines++
		if e.WeightVersion() == "v1" {
			r.atVersion++
		}
	}
	return nil
}

func printPD(w io.Writer, runs []*pdRun) {
	fmt.Fprintf(w, "| engine | workload | requests (tetherd, direct) | failed | hung | wrong | orphaned rooms/blocks | decodes holding | silent recomputes | protocol errors | throughput tetherd | direct | ratio | hit tetherd | direct | regular (no P/D): all engines | the prefills alone | busiest prefill's share: tetherd, direct | session turns moved: tetherd, direct | placed by KV | retries (prefill, decode failed) |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	hit := func(c *pdClient) string {
		if c == nil {
			return "-"
		}
		return fmt.Sprintf("%.3f", c.hit())
	}
	for _, r := range runs {
		if r.tether == nil {
			continue
		}
		tt, td := r.throughput(r.tether, r.tetherSpan), r.throughput(r.direct, r.directSpan)
		moved := "-"
		if r.tether.turns > 0 {
			moved = fmt.Sprintf("%.2f, %.2f", r.tether.movedShare(), r.direct.movedShare())
		}
		fmt.Fprintf(w, "| %s | %s | %d, %d | %d | %d | %d | %d | %d | %d | %d | %.0f tok/s | %.0f tok/s | %.3f | %.3f | %.3f | %s | %s | %.2f, %.2f | %s | %d | %.0f (%.0f, %.0f) |\n",
			r.proto, r.wl, r.tether.requests, r.direct.requests, r.tether.failed+r.direct.failed, r.tether.hung+r.direct.hung,
			r.tether.wrong+r.direct.wrong, r.heldPrefill, r.heldDec, r.recomputes, r.protocolErrs, tt, td, tt/td,
			r.tether.hit(), r.direct.hit(), hit(r.regular), hit(r.regularP), r.tether.busiest(), r.direct.busiest(), moved,
			r.tether.byKV, r.retries, r.legFailed[0], r.legFailed[1])
	}
	fmt.Fprintf(w, "\n| engine | workload | weight sync under load: requests | aborted, sent again | failed | hung | parked | spanning (answers, engines) | at v1 | pause, update, resume | retries | error |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range runs {
		if r.synced == nil {
			continue
		}
		s := r.synced
		fmt.Fprintf(w, "| %s | %s | %d | %d | %d | %d | %d | %d, %d | %d/%d | %.2f s, %.2f s, %.2f s | %.0f | %s |\n",
			r.proto, r.wl, s.requests, s.aborted, s.failed, s.hung, r.parked, s.spanning, r.mixed, r.atVersion, r.engines,
			r.pauseS, r.updS, r.resumeS, r.syncRetries, r.syncErr)
	}
	fmt.Fprintln(w)
}
