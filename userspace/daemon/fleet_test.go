package daemon

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/userspace/fleet"
	"github.com/tether-rl/tether/userspace/route"
)

// A weight sync driven through tetherd the way RL stacks drive it (pause,
// update, resume), many cycles, under keyed and keyless load, against fake
// SGLang and vLLM engines: nothing parked in a paused engine, no output
// spanning two weight versions, no failed request, every aborted request
// answered with its partial output, no request that arrived after the
// pause aborted, every pause within its bound.

// syncOut is one generation request's outcome.
type syncOut struct {
	start, end time.Time
	status     int
	finish     string // "length", "stop", "abort"
	versions   []string
	tokens     int
	err        error
}

// fleetFixture is tetherd in front of n fake engines.
type fleetFixture struct {
	d       *Daemon
	engines []*fakeengine.Engine
	base    string
	client  *http.Client
}

func newFleetFixture(t *testing.T, n int, kind fakeengine.Kind, opts Options) *fleetFixture {
	t.Helper()
	return newFleetFixtureCfg(t, n, fakeengine.Config{Kind: kind, DecodeStep: time.Millisecond, MaxRunning: 32, UpdateDelay: 20 * time.Millisecond}, opts)
}

func newFleetFixtureCfg(t *testing.T, n int, cfg fakeengine.Config, opts Options) *fleetFixture {
	t.Helper()
	engines, err := fakeengine.StartFleet(n, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, e := range engines {
			e.Close()
		}
	})
	for _, e := range engines {
		opts.Workers = append(opts.Workers, e.URL())
	}
	d := startDaemon(t, opts)
	tr := &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &fleetFixture{d: d, engines: engines, base: "http://" + d.Addr(), client: &http.Client{Transport: tr, Timeout: 60 * time.Second}}
}

// generate sends one generation request in the engine's own API; key, if
// set, is the X-Session-ID routing key.
func (fx *fleetFixture) generate(kind fakeengine.Kind, key string, prompt string, tokens int) syncOut {
	return fx.generateStream(kind, key, prompt, tokens, false)
}

// generateStream is generate, streamed (server-sent events) if stream:
// the outcome is the last event's, and the stream must end with [DONE].
func (fx *fleetFixture) generateStream(kind fakeengine.Kind, key string, prompt string, tokens int, stream bool) syncOut {
	var path, body string
	if kind == fakeengine.SGLang {
		path = "/generate"
		body = fmt.Sprintf(`{"text":%q,"sampling_params":{"max_new_tokens":%d},"stream":%t}`, prompt, tokens, stream)
	} else {
		path = "/v1/completions"
		body = fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d,"stream":%t}`, prompt, tokens, stream)
	}
	o := syncOut{start: time.Now()}
	req, _ := http.NewRequest("POST", fx.base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("X-Session-ID", key)
	}
	resp, err := fx.client.Do(req)
	if err != nil {
		o.err = err
		o.end = time.Now()
		return o
	}
	var v struct {
		MetaInfo struct {
			FinishReason struct {
				Type string `json:"type"`
			} `json:"finish_reason"`
			WeightVersions   []string `json:"weight_versions"`
			CompletionTokens int      `json:"completion_tokens"`
		} `json:"meta_info"`
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		WeightVersions []string `json:"weight_versions"`
		Usage          struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if stream {
		b, err := io.ReadAll(resp.Body)
		o.err = err
		events := strings.Split(strings.TrimSpace(string(b)), "\n\n")
		if n := len(events); err == nil && (n < 2 || events[n-1] != "data: [DONE]") {
			o.err = fmt.Errorf("a stream that did not end with [DONE]: %.200q", b)
		} else if err == nil {
			o.err = json.Unmarshal([]byte(strings.TrimPrefix(events[n-2], "data: ")), &v)
		}
	} else {
		o.err = json.NewDecoder(resp.Body).Decode(&v)
	}
	resp.Body.Close()
	o.end, o.status = time.Now(), resp.StatusCode
	if kind == fakeengine.SGLang {
		o.finish, o.versions, o.tokens = v.MetaInfo.FinishReason.Type, v.MetaInfo.WeightVersions, v.MetaInfo.CompletionTokens
	} else {
		if len(v.Choices) > 0 {
			o.finish = v.Choices[0].FinishReason
		}
		o.versions, o.tokens = v.WeightVersions, v.Usage.CompletionTokens
	}
	return o
}

// call posts a control call to tetherd and decodes the answer.
func (fx *fleetFixture) call(t *testing.T, path, body string) (int, map[string]any) {
	t.Helper()
	resp, err := fx.client.Post(fx.base+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatalf("POST %s: answer: %v", path, err)
	}
	return resp.StatusCode, m
}

type syncRecipe struct {
	name     string
	kind     fakeengine.Kind
	pause    string // path and body/query of the pause
	body     string
	update   string
	resume   string
	aborting bool // the pause aborts what runs
	// frozen: the pause keeps what runs (in_place, retract, keep): it
	// carries on across the update, on the new weights, by design.
	frozen bool
}

func TestWeightSyncUnderLoad(t *testing.T) {
	recipes := []syncRecipe{
		{name: "sglang-abort", kind: fakeengine.SGLang, pause: "/pause_generation", body: `{"mode":"abort"}`,
			update: "/update_weights_from_disk", resume: "/continue_generation", aborting: true},
		{name: "vllm-abort", kind: fakeengine.VLLM, pause: "/pause?mode=abort", update: "/update_weights", resume: "/resume", aborting: true},
		{name: "vllm-wait", kind: fakeengine.VLLM, pause: "/pause?mode=wait", update: "/update_weights", resume: "/resume"},
		{name: "sglang-in_place", kind: fakeengine.SGLang, pause: "/pause_generation", body: `{"mode":"in_place"}`,
			update: "/update_weights_from_disk", resume: "/continue_generation", frozen: true},
		{name: "vllm-keep", kind: fakeengine.VLLM, pause: "/pause?mode=keep", update: "/update_weights", resume: "/resume", frozen: true},
	}
	for _, rc := range recipes {
		t.Run(rc.name, func(t *testing.T) { runSyncCycles(t, rc) })
	}
}

func runSyncCycles(t *testing.T, rc syncRecipe) {
	const (
		engines = 4
		cycles  = 6
		keyed   = 12 // sessions, each its own X-Session-ID
		keyless = 12
	)
	fx := newFleetFixture(t, engines, rc.kind, Options{})
	var (
		mu   sync.Mutex
		outs []syncOut
		stop atomic.Bool
		wg   sync.WaitGroup
	)
	client := func(key string, id int) {
		defer wg.Done()
		for turn := 0; !stop.Load(); turn++ {
			// Prompts of different lengths; a session's turns extend its
			// prompt (its prefix stays cached on its engine).
			prompt := strings.Repeat(fmt.Sprintf("client %d says hello. ", id), 2+id%5+turn%3)
			o := fx.generateStream(rc.kind, key, prompt, 20+id%3*15, id%3 == 0)
			mu.Lock()
			outs = append(outs, o)
			mu.Unlock()
		}
	}
	for i := 0; i < keyed; i++ {
		wg.Add(1)
		go client(fmt.Sprintf("session-%d", i), i)
	}
	for i := 0; i < keyless; i++ {
		wg.Add(1)
		go client("", keyed+i)
	}

	type window struct{ pauseAt, resumed time.Time }
	var windows []window
	const bound = 40 * time.Second // the pause's timeout_s, and its fan-out
	for c := 1; c <= cycles; c++ {
		// Let requests run (and pile up in the engines) between syncs.
		testenv.WaitFor(t, "requests between syncs", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(outs) >= c*20
		})
		version := fmt.Sprintf("v%d", c)
		w := window{pauseAt: time.Now()}
		code, ans := fx.call(t, rc.pause+sep(rc.pause)+"timeout_s=30", rc.body)
		if took := time.Since(w.pauseAt); code != 200 || took > bound {
			t.Fatalf("cycle %d: pause: %d after %v: %v", c, code, took, ans)
		}
		if ans["quiet"] != true || ans["phase"] != "paused" {
			t.Fatalf("cycle %d: pause answered %v", c, ans)
		}
		// The hold's own start: a request sent after it reached no engine
		// before the resume.
		since, err := time.Parse(time.RFC3339Nano, fmt.Sprint(ans["held_since"]))
		if err != nil || since.Before(w.pauseAt) {
			t.Fatalf("cycle %d: held_since %v (%v)", c, ans["held_since"], err)
		}
		w.pauseAt = since
		for i, e := range fx.engines {
			if !e.Paused() {
				t.Fatalf("cycle %d: engine %d not paused after the fleet's pause", c, i)
			}
			if st := e.Stats(); !rc.frozen && st.Running+st.Waiting != 0 {
				t.Fatalf("cycle %d: engine %d still has %d running, %d waiting while the fleet is quiet", c, i, st.Running, st.Waiting)
			}
		}
		code, ans = fx.call(t, rc.update, fmt.Sprintf(`{"model_path":"/ckpt/%s","weight_version":%q}`, version, version))
		if code != 200 || ans["weight_version"] != version {
			t.Fatalf("cycle %d: update: %d %v", c, code, ans)
		}
		for i, e := range fx.engines {
			if got := e.WeightVersion(); got != version {
				t.Fatalf("cycle %d: engine %d at %q after the fleet's update to %q", c, i, got, version)
			}
		}
		// Paused and quiet: the engines' caches can be flushed (SGLang
		// refuses while anything runs or waits).
		if code, ans := fx.call(t, "/flush_cache", ""); !rc.frozen && code != 200 {
			t.Fatalf("cycle %d: flush while paused: %d %v", c, code, ans)
		}
		if rep := fx.d.Fleet.Report(); rep.Phase != "paused" || rep.TargetVersion != version {
			t.Fatalf("cycle %d: /fleet says %+v", c, rep)
		}
		code, ans = fx.call(t, rc.resume, "")
		if code != 200 || ans["phase"] != "serving" {
			t.Fatalf("cycle %d: resume: %d %v", c, code, ans)
		}
		w.resumed = time.Now()
		windows = append(windows, w)
	}
	stop.Store(true)
	wg.Wait()

	var aborted, held int
	for _, o := range outs {
		if o.err != nil || o.status != 200 {
			t.Fatalf("a request failed: status %d, err %v", o.status, o.err)
		}
		if len(o.versions) > 1 {
			// Only a request frozen by its pause may span two versions:
			// it ran before the pause and ended after the update.
			spans := false
			for _, w := range windows {
				spans = spans || rc.frozen && o.start.Before(w.pauseAt) && o.end.After(w.pauseAt)
			}
			if !spans {
				t.Errorf("an output spans weight versions %v (%v to %v)", o.versions, o.start, o.end)
			}
		}
		if o.finish == "abort" {
			aborted++
			if !rc.aborting {
				t.Errorf("a request was aborted by a %s pause", rc.name)
			}
			// It must have arrived before some pause began and been
			// answered after it: aborted by that pause, not held.
			ok := false
			for _, w := range windows {
				ok = ok || o.start.Before(w.pauseAt) && o.end.After(w.pauseAt)
			}
			if !ok {
				t.Errorf("an aborted request (%v to %v) did not run across any pause", o.start, o.end)
			}
		}
		for k, w := range windows {
			if o.start.After(w.pauseAt) && o.start.Before(w.resumed) {
				held++
				// Held through pause k and released at its resume, it may
				// only be aborted by a later pause.
				if o.finish == "abort" && (k+1 == len(windows) || o.end.Before(windows[k+1].pauseAt)) {
					t.Errorf("a request that arrived during pause %d was aborted (%v to %v)", k+1, o.start, o.end)
				}
			}
		}
	}
	var parked, mixed int64
	for _, e := range fx.engines {
		st := e.Stats()
		parked += st.ParkedWhilePaused
		mixed += st.MixedVersionOutputs
	}
	if rc.frozen {
		// By design: checked per output above. And a request tetherd
		// admitted just before the pause may reach the engine just after
		// its native pause: it waits there and runs, wholly on the new
		// weights, after the resume (nothing drains a frozen pause).
		mixed, parked = 0, 0
	}
	if parked != 0 || mixed != 0 {
		t.Fatalf("engines: %d requests parked while paused, %d outputs spanning two versions", parked, mixed)
	}
	if counts := fx.d.Fleet.Counts(); counts.Cycles != cycles {
		t.Errorf("%d pauses counted, want %d", counts.Cycles, cycles)
	}
	t.Logf("%s: %d requests, %d aborted with their partial output, %d arrived during a pause (held, none aborted)", rc.name, len(outs), aborted, held)
}

func sep(path string) string {
	if strings.Contains(path, "?") {
		return "&"
	}
	return "?"
}

// While paused, arrivals wait in tetherd and reach no engine; resume
// releases them. A held request whose client gives up is not sent later.
func TestPauseHoldsArrivals(t *testing.T) {
	fx := newFleetFixture(t, 2, fakeengine.SGLang, Options{})
	if code, ans := fx.call(t, "/pause_generation", `{"mode":"abort"}`); code != 200 {
		t.Fatalf("pause: %d %v", code, ans)
	}
	before := fx.engines[0].Stats().Requests + fx.engines[1].Stats().Requests
	done := make(chan syncOut, 4)
	for i := 0; i < 4; i++ {
		go func() { done <- fx.generate(fakeengine.SGLang, "", fmt.Sprintf("held %d", i), 5) }()
	}
	testenv.WaitFor(t, "4 requests held", func() bool { return fx.d.Fleet.HeldNow() == 4 })
	if got := fx.engines[0].Stats().Requests + fx.engines[1].Stats().Requests; got != before {
		t.Fatalf("%d requests reached a paused engine", got-before)
	}
	// GETs are not held.
	if r, err := do(fx.client, "GET", fx.base+"/v1/models", ""); err != nil || r.status != 200 {
		t.Fatalf("GET while paused: %v %v", r.status, err)
	}
	rep := fx.d.Fleet.Report()
	if rep.Phase != "paused" || rep.Held != 4 {
		t.Fatalf("/fleet while holding: %+v", rep)
	}
	if code, ans := fx.call(t, "/continue_generation", ""); code != 200 || ans["released"] != float64(4) {
		t.Fatalf("resume: %d %v", code, ans)
	}
	for i := 0; i < 4; i++ {
		if o := <-done; o.status != 200 || o.finish == "abort" {
			t.Fatalf("a held request: %d %q %v", o.status, o.finish, o.err)
		}
	}
}

// The hold is bounded: past --pause-timeout a held request gets 503 with
// Retry-After, never a silent drop.
func TestHoldTimeout(t *testing.T) {
	fx := newFleetFixture(t, 1, fakeengine.VLLM, Options{Fleet: fleet.Settings{HoldTimeout: 200 * time.Millisecond}})
	if code, ans := fx.call(t, "/pause?mode=keep", ""); code != 200 {
		t.Fatalf("pause: %d %v", code, ans)
	}
	req, _ := http.NewRequest("POST", fx.base+"/v1/completions", strings.NewReader(`{"prompt":"x","max_tokens":2}`))
	resp, err := fx.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 503 || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("held past the pause timeout: %d, Retry-After %q", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if c := fx.d.Fleet.Counts(); c.Timeouts != 1 {
		t.Fatalf("hold timeouts: %+v", c)
	}
}

// An engine that refuses the update is not a 200; it is fenced (no new
// work) until its version matches, and reported.
func TestUpdateRefusedFences(t *testing.T) {
	fx := newFleetFixture(t, 3, fakeengine.SGLang, Options{})
	fx.engines[1].SetFailUpdates(true)
	code, ans := fx.call(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v7"}`)
	if code == 200 || ans["success"] != false {
		t.Fatalf("update with a refusing engine: %d %v", code, ans)
	}
	if f, _ := ans["fenced"].([]any); len(f) != 1 || f[0] != float64(1) {
		t.Fatalf("fenced: %v", ans["fenced"])
	}
	rep := fx.d.Fleet.Report()
	if rep.Workers[1].State != "fenced" || rep.Workers[0].WeightVersion != "v7" {
		t.Fatalf("/fleet: %+v", rep.Workers)
	}
	before := fx.engines[1].Stats().Requests
	for i := 0; i < 20; i++ {
		if o := fx.generate(fakeengine.SGLang, fmt.Sprintf("k%d", i), "after the update", 2); o.status != 200 || len(o.versions) != 1 || o.versions[0] != "v7" {
			t.Fatalf("request after a partial update: %d %v %v", o.status, o.versions, o.err)
		}
	}
	if got := fx.engines[1].Stats().Requests; got != before {
		t.Fatalf("the fenced engine took %d requests", got-before)
	}
	// Fixed and updated again: it serves.
	fx.engines[1].SetFailUpdates(false)
	if code, ans := fx.call(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v8"}`); code != 200 || len(ans["fenced"].([]any)) != 0 {
		t.Fatalf("second update: %d %v", code, ans)
	}
}

// An engine killed mid-sync never blocks the release: the failure is
// reported, held requests are released to the others.
func TestEngineKilledMidSync(t *testing.T) {
	fx := newFleetFixture(t, 3, fakeengine.VLLM, Options{})
	if code, ans := fx.call(t, "/pause?mode=abort", ""); code != 200 {
		t.Fatalf("pause: %d %v", code, ans)
	}
	done := make(chan syncOut, 1)
	go func() { done <- fx.generate(fakeengine.VLLM, "", "held across a death", 3) }()
	testenv.WaitFor(t, "1 request held", func() bool { return fx.d.Fleet.HeldNow() == 1 })
	fx.engines[2].Kill()
	code, ans := fx.call(t, "/update_weights", `{"weight_version":"v2"}`)
	if code == 200 {
		t.Fatalf("update with a dead engine answered 200: %v", ans)
	}
	start := time.Now()
	code, ans = fx.call(t, "/resume", "")
	if code != http.StatusBadGateway || ans["phase"] != "serving" || time.Since(start) > 10*time.Second {
		t.Fatalf("resume with a dead engine: %d %v", code, ans)
	}
	if o := <-done; o.status != 200 || len(o.versions) != 1 || o.versions[0] != "v2" {
		t.Fatalf("the held request: %d %v %v", o.status, o.versions, o.err)
	}
}

// A worker added while a fan-out runs makes it a 409 naming the epoch; a
// worker added while paused starts paused (no work until the resume) and
// fenced until its version matches.
func TestMembershipChangeDuringFanOut(t *testing.T) {
	cfg := fakeengine.Config{Kind: fakeengine.SGLang, UpdateDelay: 300 * time.Millisecond}
	fx := newFleetFixtureCfg(t, 2, cfg, Options{})
	extra, err := fakeengine.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer extra.Close()
	fx.call(t, "/pause_generation", `{"mode":"abort"}`)
	type res struct {
		code int
		ans  map[string]any
	}
	got := make(chan res, 1)
	go func() {
		c, a := fx.call(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v3"}`)
		got <- res{c, a}
	}()
	testenv.WaitFor(t, "worker 0 updating", func() bool { return fx.d.Fleet.WorkerState(fx.d.Table.Get(0)) == "updating" })
	if _, err := fx.d.Registry.Put(2, extra.URL(), "admin"); err != nil {
		t.Fatal(err)
	}
	r := <-got
	if r.code != http.StatusConflict || !strings.Contains(fmt.Sprint(r.ans["message"]), "epoch") {
		t.Fatalf("update across a membership change: %d %v", r.code, r.ans)
	}
	if st := fx.d.Fleet.WorkerState(fx.d.Table.Get(2)); st != "fenced" {
		t.Fatalf("the worker added mid-fan-out is %q, want fenced (not at v3)", st)
	}
	if fx.d.Fleet.Phase() != fleet.Paused {
		t.Fatalf("phase %v", fx.d.Fleet.Phase())
	}
}

// The sync is visible in /metrics and on the admin listener's /fleet.
func TestFleetVisible(t *testing.T) {
	fx := newFleetFixture(t, 2, fakeengine.SGLang, Options{Admin: "127.0.0.1:0"})
	fx.call(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v9"}`)
	fx.call(t, "/pause_generation", `{"mode":"in_place"}`)
	admin := "http://" + fx.d.AdminAddr()
	r, err := do(fx.client, "GET", admin+"/fleet", "")
	if err != nil || r.status != 200 {
		t.Fatalf("GET /fleet: %d %v", r.status, err)
	}
	var rep fleet.Report
	if err := json.Unmarshal(r.body, &rep); err != nil || rep.Phase != "paused" || rep.Mode != "in_place" || rep.TargetVersion != "v9" || len(rep.Workers) != 2 || rep.Workers[1].WeightVersion != "v9" {
		t.Fatalf("/fleet: %s (%v)", r.body, err)
	}
	r, err = do(fx.client, "GET", admin+"/workers", "")
	if err != nil || !strings.Contains(string(r.body), `"weight_version":"v9","sync_state":"paused"`) {
		t.Fatalf("GET /workers: %s %v", r.body, err)
	}
	r, err = do(fx.client, "GET", admin+"/metrics", "")
	if err != nil || r.status != 200 {
		t.Fatalf("GET /metrics: %d %v", r.status, err)
	}
	for _, want := range []string{`tether_fleet_phase{phase="paused"} 1`, `tether_fleet_target_version_info{version="v9"} 1`,
		`tether_worker_sync_state{slot="0",state="paused"`, `tether_worker_weight_version_info{slot="1"`} {
		if !strings.Contains(string(r.body), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if r, _ := do(fx.client, "GET", fx.base+"/is_paused", ""); !strings.Contains(string(r.body), `"is_paused":true`) {
		t.Errorf("/is_paused: %s", r.body)
	}
}

// A worker that joins once the fleet has a target is asked its version:
// at the target it serves at once, at another it stays fenced.
func TestJoiningWorkerVersion(t *testing.T) {
	fx := newFleetFixture(t, 2, fakeengine.SGLang, Options{})
	if code, ans := fx.call(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v3"}`); code != 200 {
		t.Fatalf("update: %d %v", code, ans)
	}
	for i, v := range []string{"v3", "v1"} {
		e, err := fakeengine.Start(fakeengine.Config{Kind: fakeengine.SGLang, WeightVersion: v})
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close()
		if _, err := fx.d.Registry.Put(2+i, e.URL(), "admin"); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, "the worker at v3 serving", func() bool {
		w := fx.d.Table.Get(2)
		return w != nil && fx.d.Fleet.WorkerState(w) == "serving" && fx.d.Fleet.Version(w.URL) == "v3"
	})
	testenv.WaitFor(t, "the worker at v1 known", func() bool {
		w := fx.d.Table.Get(3)
		return w != nil && fx.d.Fleet.Version(w.URL) == "v1"
	})
	if st := fx.d.Fleet.WorkerState(fx.d.Table.Get(3)); st != "fenced" {
		t.Fatalf("a worker at v1 in a v3 fleet is %q", st)
	}
}

// A control call for one engine (an NCCL group's init carries each
// engine's rank_offset) goes to the worker X-SMG-Target-Worker names, its
// body byte for byte; without the header the same body goes to all.
func TestControlPerWorker(t *testing.T) {
	fx := newFleetFixture(t, 2, fakeengine.SGLang, Options{})
	for i := range fx.engines {
		body := fmt.Sprintf(`{"master_address":"10.0.0.1","master_port":29500,"rank_offset":%d,"world_size":3,"group_name":"g"}`, 1+i)
		req, _ := http.NewRequest("POST", fx.base+"/init_weights_update_group", strings.NewReader(body))
		req.Header.Set("X-SMG-Target-Worker", fmt.Sprint(i))
		resp, err := fx.client.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("init on worker %d: %v %v", i, resp, err)
		}
		resp.Body.Close()
		if got := string(fx.engines[i].LastBody("/init_weights_update_group")); got != body {
			t.Fatalf("engine %d got %q, want %q", i, got, body)
		}
		if other := fx.engines[1-i].LastBody("/init_weights_update_group"); i == 0 && other != nil {
			t.Fatalf("engine 1 got worker 0's init: %q", other)
		}
	}
	req, _ := http.NewRequest("POST", fx.base+"/init_weights_update_group", strings.NewReader(`{}`))
	req.Header.Set("X-SMG-Target-Worker", "7")
	resp, err := fx.client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Fatalf("a target naming no worker: %d", resp.StatusCode)
	}
	body := `{"names":["w"],"dtypes":["bfloat16"],"shapes":[[2,2]],"group_name":"g","weight_version":"v2"}`
	if code, ans := fx.call(t, "/update_weights_from_distributed", body); code != 200 || ans["weight_version"] != "v2" {
		t.Fatalf("update from distributed: %d %v", code, ans)
	}
	for i, e := range fx.engines {
		if got := string(e.LastBody("/update_weights_from_distributed")); got != body {
			t.Fatalf("engine %d got %q", i, got)
		}
	}
}

// A resume that comes while a pause still drains ends the pause: the
// pause answers 409 and does not pause the engines afterwards, and the
// fleet serves (the review's "a pause can undo a resume").
func TestResumeDuringPause(t *testing.T) {
	fx := newFleetFixtureCfg(t, 2, fakeengine.Config{Kind: fakeengine.VLLM, DecodeStep: 20 * time.Millisecond}, Options{})
	long := make(chan syncOut, 1)
	// Long enough (40 s) to be in flight whatever the machine's load;
	// aborted at the end.
	go func() { long <- fx.generate(fakeengine.VLLM, "", "a long one", 2000) }()
	testenv.WaitFor(t, "the long request in flight", func() bool {
		return fx.engines[0].Stats().Running+fx.engines[1].Stats().Running == 1
	})
	type res struct {
		code int
		ans  map[string]any
	}
	paused := make(chan res, 1)
	go func() {
		c, a := fx.call(t, "/pause?mode=wait&timeout_s=20", "")
		paused <- res{c, a}
	}()
	testenv.WaitFor(t, "the pause draining", func() bool { return fx.d.Fleet.Phase() == fleet.Pausing })
	if code, ans := fx.call(t, "/resume", ""); code != 200 {
		t.Fatalf("resume: %d %v", code, ans)
	}
	r := <-paused
	if r.code != http.StatusConflict || fx.d.Fleet.Phase() != fleet.Serving {
		t.Fatalf("the overtaken pause: %d %v; phase %v", r.code, r.ans, fx.d.Fleet.Phase())
	}
	for i, e := range fx.engines {
		if e.Paused() {
			t.Fatalf("engine %d paused after the resume", i)
		}
	}
	if code, ans := fx.call(t, "/abort_requests", `{}`); code != 200 {
		t.Fatalf("abort: %d %v", code, ans)
	}
	if o := <-long; o.status != 200 {
		t.Fatalf("the long request: %d %q %v", o.status, o.finish, o.err)
	}
}

// Per-engine updates without a version name, in one sync, get one name
// (no engine fenced against another's); the next sync gets a new one.
func TestUnnamedUpdatesShareTheSyncsVersion(t *testing.T) {
	fx := newFleetFixture(t, 2, fakeengine.SGLang, Options{})
	names := map[string]bool{}
	for cycle := 0; cycle < 2; cycle++ {
		fx.call(t, "/pause_generation", `{"mode":"abort"}`)
		for i := range fx.engines {
			req, _ := http.NewRequest("POST", fx.base+"/update_weights_from_tensor", strings.NewReader(`{"serialized_named_tensors":["x"]}`))
			req.Header.Set("X-SMG-Target-Worker", fmt.Sprint(i))
			resp, err := fx.client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("cycle %d, worker %d: %d", cycle, i, resp.StatusCode)
			}
		}
		rep := fx.d.Fleet.Report()
		if rep.TargetVersion == "" || rep.Workers[0].WeightVersion != rep.TargetVersion || rep.Workers[1].WeightVersion != rep.TargetVersion {
			t.Fatalf("cycle %d: %+v", cycle, rep)
		}
		names[rep.TargetVersion] = true
		if code, ans := fx.call(t, "/continue_generation", ""); code != 200 || len(ans["fenced"].([]any)) != 0 {
			t.Fatalf("cycle %d: resume: %d %v", cycle, code, ans)
		}
	}
	if len(names) != 2 {
		t.Fatalf("two syncs got the names %v", names)
	}
}

// An engine's own control call a trainer may make while paused
// (/tokenize, /collective_rpc, ...) is not held.
func TestControlCallsNotHeld(t *testing.T) {
	fx := newFleetFixture(t, 1, fakeengine.VLLM, Options{Fleet: fleet.Settings{HoldTimeout: time.Minute}})
	fx.call(t, "/pause?mode=abort", "")
	resp, err := fx.client.Post(fx.base+"/collective_rpc", "application/json", strings.NewReader(`{"method":"check"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode == 503 || fx.d.Fleet.Counts().Held != 0 {
		t.Fatalf("a control call was held: %d, %+v", resp.StatusCode, fx.d.Fleet.Counts())
	}
}

// A request held for its own worker (fenced: its update failed) is placed
// again when that worker leaves the table, instead of waiting out its
// hold.
func TestHeldForRemovedWorker(t *testing.T) {
	fx := newFleetFixture(t, 2, fakeengine.SGLang, Options{Fleet: fleet.Settings{HoldTimeout: time.Minute}, BadSession: route.BadSessionSpread})
	fx.engines[1].SetFailUpdates(true)
	fx.call(t, "/update_weights_from_disk", `{"model_path":"/m","weight_version":"v2"}`)
	done := make(chan reply, 1)
	go func() {
		r, _ := do(fx.client, "POST", fx.base+"/sessions/w1-0123456789abcdef0123456789abcdef/generate", `{"text":"x","sampling_params":{"max_new_tokens":2}}`)
		done <- r
	}()
	testenv.WaitFor(t, "the session's request held", func() bool { return fx.d.Fleet.HeldNow() == 1 })
	if _, err := fx.d.Registry.Remove("1"); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if r.status == 503 {
			t.Fatalf("held out its timeout: %d %s", r.status, r.body)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("still held 30 s after its worker left")
	}
}
