package fakeengine

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

func TestMain(m *testing.M) { os.Exit(testenv.RunNoLeaks(m)) }

var client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}

func start(t *testing.T, cfg Config) *Engine {
	t.Helper()
	e, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.Close()
		client.CloseIdleConnections()
	})
	return e
}

// call sends a request and returns the status and the body.
func call(t testing.TB, method, url, body string) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, []byte(err.Error()) // a killed engine: the caller checks
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, []byte(err.Error())
	}
	return resp.StatusCode, b
}

func mustJSON(t testing.TB, b []byte) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("not a JSON object: %v: %s", err, b)
	}
	return m
}

// out is what a test reads back from any generation answer.
type out struct {
	status   int
	tokens   []int
	finish   string
	version  string
	versions []string
	cached   int
	raw      map[string]any
}

func ints(v any) []int {
	var r []int
	for _, x := range v.([]any) {
		r = append(r, int(x.(float64)))
	}
	return r
}

func strs(v any) []string {
	var r []string
	for _, x := range v.([]any) {
		r = append(r, x.(string))
	}
	return r
}

// parseOut reads a generation answer of any shape.
func parseOut(t testing.TB, status int, b []byte) out {
	t.Helper()
	o := out{status: status}
	if status != 200 {
		return o
	}
	m := mustJSON(t, b)
	o.raw = m
	if mi, ok := m["meta_info"].(map[string]any); ok { // SGLang native
		o.tokens = ints(m["output_ids"])
		if fr, ok := mi["finish_reason"].(map[string]any); ok {
			o.finish = fr["type"].(string)
		}
		o.version = mi["weight_version"].(string)
		o.versions = strs(mi["weight_versions"])
		o.cached = int(mi["cached_tokens"].(float64))
		return o
	}
	c := m["choices"].([]any)[0].(map[string]any)
	if ids, ok := c["token_ids"]; ok {
		o.tokens = ints(ids)
	}
	if fr, ok := c["finish_reason"].(string); ok {
		o.finish = fr
	}
	o.version = m["weight_version"].(string)
	o.versions = strs(m["weight_versions"])
	if u, ok := m["usage"].(map[string]any); ok {
		o.cached = int(u["prompt_tokens_details"].(map[string]any)["cached_tokens"].(float64))
	}
	return o
}

// gen sends a generation of prompt ids with maxNew tokens to the native
// path of e's kind.
func gen(t testing.TB, e *Engine, rid string, prompt []int, maxNew int) out {
	t.Helper()
	ids, _ := json.Marshal(prompt)
	var path, body string
	if e.Kind() == SGLang {
		path = "/generate"
		body = fmt.Sprintf(`{"rid":%q,"input_ids":%s,"sampling_params":{"max_new_tokens":%d}}`, rid, ids, maxNew)
	} else {
		path = "/v1/completions"
		body = fmt.Sprintf(`{"request_id":%q,"prompt":%s,"max_tokens":%d}`, rid, ids, maxNew)
	}
	st, b := call(t, "POST", e.URL()+path, body)
	return parseOut(t, st, b)
}

// async runs gen in a goroutine; the result comes on the channel.
func async(t testing.TB, e *Engine, rid string, prompt []int, maxNew int) <-chan out {
	ch := make(chan out, 1)
	go func() { ch <- gen(t, e, rid, prompt, maxNew) }()
	return ch
}

func seq(n, base int) []int {
	s := make([]int, n)
	for i := range s {
		s[i] = base + i
	}
	return s
}

func expected(prompt []int, n int) []int {
	r := make([]int, n)
	for i := range r {
		r[i] = OutputToken(prompt, 0, i)
	}
	return r
}

var kinds = []Kind{SGLang, VLLM}

func TestGenerateShapes(t *testing.T) {
	cases := []struct {
		kind Kind
		path string
		body string
	}{
		{SGLang, "/generate", `{"text":"hello world","sampling_params":{"max_new_tokens":5}}`},
		{SGLang, "/generate", `{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":5}}`},
		{SGLang, "/v1/completions", `{"model":"m","prompt":"hello world","max_tokens":5}`},
		{SGLang, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}`},
		{VLLM, "/v1/completions", `{"model":"m","prompt":[1,2,3],"max_tokens":5}`},
		{VLLM, "/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":5}`},
		{VLLM, "/inference/v1/generate", `{"token_ids":[1,2,3],"sampling_params":{"max_tokens":5}}`},
	}
	engines := map[Kind]*Engine{}
	for _, k := range kinds {
		engines[k] = start(t, Config{Kind: k})
	}
	for _, c := range cases {
		t.Run(c.kind.String()+c.path, func(t *testing.T) {
			st, b := call(t, "POST", engines[c.kind].URL()+c.path, c.body)
			if st != 200 {
				t.Fatalf("status %d: %s", st, b)
			}
			o := parseOut(t, st, b)
			if o.version != "v0" || !slices.Equal(o.versions, []string{"v0"}) {
				t.Errorf("versions %q %q", o.version, o.versions)
			}
			if o.finish != "length" {
				t.Errorf("finish %q: %s", o.finish, b)
			}
			if c.path != "/v1/chat/completions" && len(o.tokens) != 5 {
				t.Errorf("tokens %v", o.tokens)
			}
			if strings.Contains(c.body, "[1,2,3]") && !slices.Equal(o.tokens, expected([]int{1, 2, 3}, 5)) {
				t.Errorf("tokens %v, want %v", o.tokens, expected([]int{1, 2, 3}, 5))
			}
		})
	}
}

func TestBadRequests(t *testing.T) {
	for _, k := range kinds {
		e := start(t, Config{Kind: k, KVBlocks: 4, BlockTokens: 4})
		path := "/v1/completions"
		cases := []struct {
			method, path, body string
			want               int
		}{
			{"POST", path, `{`, 400},
			{"POST", path, `{"prompt":[-1]}`, 400},
			{"POST", path, `{"prompt":"x","max_tokens":0}`, 400},
			{"POST", path, `{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`, 400}, // over the KV
			{"POST", path, `[]`, 400},
			{"GET", path, ``, 405},
			{"POST", "/nope", `{}`, 404},
		}
		for _, c := range cases {
			st, b := call(t, c.method, e.URL()+c.path, c.body)
			if st != c.want {
				t.Errorf("%v %s %s %s: %d, want %d: %s", k, c.method, c.path, c.body, st, c.want, b)
			}
			if m := mustJSON(t, b); m["error"] == nil {
				t.Errorf("no error object: %s", b)
			}
		}
	}
	e := start(t, Config{Kind: VLLM})
	if st, _ := call(t, "GET", e.URL()+"/v1/loads", ""); st != 404 {
		t.Errorf("vLLM /v1/loads: %d, want 404", st)
	}
}

func TestPrefixCacheHit(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.String(), func(t *testing.T) {
			e := start(t, Config{Kind: k})
			p := seq(70, 100)
			a := gen(t, e, "a", p, 4)
			b := gen(t, e, "b", p, 4)
			if a.cached != 0 || b.cached != 64 {
				t.Errorf("cached %d then %d, want 0 then 64", a.cached, b.cached)
			}
			if !slices.Equal(a.tokens, b.tokens) || !slices.Equal(a.tokens, expected(p, 4)) {
				t.Errorf("outputs differ: %v %v", a.tokens, b.tokens)
			}
			// A shared prefix of 2 blocks, then a different tail.
			c := gen(t, e, "c", append(seq(32, 100), seq(30, 5000)...), 4)
			if c.cached != 32 {
				t.Errorf("shared prefix: cached %d, want 32", c.cached)
			}
			s := e.Stats()
			if s.PromptTokens != 70+70+62 || s.CachedTokens != 96 || s.PrefillTokens != s.PromptTokens-s.CachedTokens {
				t.Errorf("stats %+v", s)
			}
		})
	}
}

// A full cache evicts a context's tail first (vLLM frees a request's
// blocks in reverse order, SGLang's radix cache evicts leaves): what
// stays is still a prefix, and hits.
func TestEvictionFromTheTail(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.String(), func(t *testing.T) {
			e := start(t, Config{Kind: k, KVBlocks: 10, BlockTokens: 4})
			ctx := seq(32, 100)
			gen(t, e, "a", ctx, 1) // 8 blocks cached
			// 16 tokens and one decoded: 5 blocks, 2 free: 3 evicted.
			gen(t, e, "b", seq(16, 5000), 1)
			if c := gen(t, e, "c", ctx, 1); c.cached != 20 {
				t.Fatalf("cached %d of the evicted context, want its first 5 blocks (20 tokens)", c.cached)
			}
		})
	}
}

func TestPreemptionAtCapacity(t *testing.T) {
	for _, k := range kinds {
		t.Run(k.String(), func(t *testing.T) {
			// 8 blocks of 4 tokens; 6 requests of 4+20 tokens (6 blocks
			// each at the end) cannot all run at once.
			e := start(t, Config{Kind: k, KVBlocks: 8, BlockTokens: 4, DecodeStep: 200 * time.Microsecond})
			var chans []<-chan out
			for i := range 6 {
				chans = append(chans, async(t, e, fmt.Sprint("r", i), seq(4, 1000*i), 20))
			}
			for i, ch := range chans {
				o := <-ch
				if o.status != 200 || o.finish != "length" || !slices.Equal(o.tokens, expected(seq(4, 1000*i), 20)) {
					t.Errorf("r%d: %+v", i, o)
				}
			}
			s := e.Stats()
			if s.Preemptions == 0 || s.PeakKVUsage > 1 || s.PeakKVUsage < 0.75 || s.Completed != 6 {
				t.Errorf("stats %+v", s)
			}
			testenv.WaitFor(t, "KV released", func() bool { return e.Stats().KVUsage == 0 })
		})
	}
}

func TestKVAccounting(t *testing.T) {
	e := start(t, Config{Kind: SGLang, KVBlocks: 100, BlockTokens: 4, DecodeStep: time.Hour})
	// DecodeStep of an hour: requests are admitted, then sit there.
	ch := async(t, e, "a", seq(10, 1), 5) // 3 blocks
	ch2 := async(t, e, "b", seq(10, 1), 5)
	testenv.WaitFor(t, "two running", func() bool { return e.Stats().Running == 2 })
	s := e.Stats()
	// a: 2 full blocks shared + 1 private; b shares the 2, 1 private.
	if s.KVUsage != 0.04 {
		t.Errorf("KV usage %v, want 0.04", s.KVUsage)
	}
	call(t, "POST", e.URL()+"/abort_request", `{"abort_all":true}`)
	for _, c := range []<-chan out{ch, ch2} {
		if o := <-c; o.finish != "abort" || len(o.tokens) != 0 {
			t.Errorf("abort: %+v", o)
		}
	}
	s = e.Stats()
	if s.KVUsage != 0 || s.CachedBlocks != 2 || s.Aborted != 2 {
		t.Errorf("after abort: %+v", s)
	}
}

func TestSGLangPauseAbort(t *testing.T) {
	e := start(t, Config{Kind: SGLang, DecodeStep: time.Millisecond})
	running := async(t, e, "long", seq(8, 1), 20000)
	testenv.WaitFor(t, "running with tokens", func() bool { return e.Stats().GeneratedTokens > 2 })
	st, b := call(t, "POST", e.URL()+"/pause_generation", `{"mode":"abort"}`)
	if st != 200 {
		t.Fatalf("pause: %d %s", st, b)
	}
	o := <-running
	if o.finish != "abort" || len(o.tokens) < 2 || !slices.Equal(o.tokens, expected(seq(8, 1), len(o.tokens))) {
		t.Errorf("aborted: %+v", o)
	}
	// Arriving while paused: held at the gate, out of abort_request's reach.
	gated := async(t, e, "gated", seq(8, 50), 3)
	testenv.WaitFor(t, "held at the gate", func() bool { return e.Stats().Gated == 1 })
	call(t, "POST", e.URL()+"/abort_request", `{"abort_all":true}`)
	call(t, "POST", e.URL()+"/abort_request", `{"rid":"gated"}`)
	if s := e.Stats(); s.Gated != 1 || s.ParkedWhilePaused != 1 || s.Waiting != 0 {
		t.Errorf("stats %+v", s)
	}
	call(t, "POST", e.URL()+"/continue_generation", `{}`)
	if o := <-gated; o.finish != "length" || len(o.tokens) != 3 {
		t.Errorf("released: %+v", o)
	}
	s := e.Stats()
	if s.Pauses != 1 || s.Resumes != 1 || s.Aborted != 1 || s.Completed != 1 {
		t.Errorf("stats %+v", s)
	}
}

func TestSGLangPauseInPlaceSpansVersions(t *testing.T) {
	e := start(t, Config{Kind: SGLang, DecodeStep: time.Millisecond, UpdateDelay: time.Millisecond})
	ch := async(t, e, "r", seq(8, 1), 40)
	testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 3 })
	call(t, "POST", e.URL()+"/pause_generation", `{"mode":"in_place"}`)
	before := e.Stats()
	if before.Running != 1 || before.KVUsage == 0 {
		t.Fatalf("in_place keeps the batch and its KV: %+v", before)
	}
	st, b := call(t, "POST", e.URL()+"/update_weights_from_disk", `{"model_path":"/ckpt/1","weight_version":"step-1"}`)
	if st != 200 || mustJSON(t, b)["success"] != true {
		t.Fatalf("update: %d %s", st, b)
	}
	if after := e.Stats(); after.GeneratedTokens != before.GeneratedTokens {
		t.Errorf("a frozen batch decoded: %d -> %d", before.GeneratedTokens, after.GeneratedTokens)
	}
	call(t, "POST", e.URL()+"/continue_generation", ``)
	o := <-ch
	if !slices.Equal(o.versions, []string{"v0", "step-1"}) || o.version != "step-1" || len(o.tokens) != 40 {
		t.Errorf("output %+v", o)
	}
	if s := e.Stats(); s.MixedVersionOutputs != 1 || s.Updates != 1 {
		t.Errorf("stats %+v", s)
	}
	st, b = call(t, "GET", e.URL()+"/get_weight_version", "")
	if st != 200 || mustJSON(t, b)["weight_version"] != "step-1" {
		t.Errorf("get_weight_version: %s", b)
	}
}

func TestSGLangPauseRetract(t *testing.T) {
	e := start(t, Config{Kind: SGLang, DecodeStep: time.Millisecond})
	ch := async(t, e, "r", seq(40, 1), 30)
	testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 3 })
	call(t, "POST", e.URL()+"/pause_generation", `{"mode":"retract"}`)
	s := e.Stats()
	if s.Running != 0 || s.Waiting != 1 || s.KVUsage != 0 {
		t.Errorf("retract: %+v", s)
	}
	if st, _ := call(t, "POST", e.URL()+"/flush_cache", ""); st != 400 {
		t.Errorf("flush with a waiting request: %d, want 400", st)
	}
	call(t, "POST", e.URL()+"/continue_generation", ``)
	if o := <-ch; o.finish != "length" || !slices.Equal(o.tokens, expected(seq(40, 1), 30)) {
		t.Errorf("output %+v", o)
	}
	if st, _ := call(t, "POST", e.URL()+"/flush_cache", ""); st != 200 {
		t.Errorf("flush idle: %d, want 200", st)
	}
	if s := e.Stats(); s.Flushes != 1 || s.FlushRefused != 1 || s.CachedBlocks != 0 {
		t.Errorf("stats %+v", s)
	}
}

func TestSGLangUpdateWriterLock(t *testing.T) {
	e := start(t, Config{Kind: SGLang, DecodeStep: time.Millisecond, UpdateDelay: time.Millisecond})
	first := async(t, e, "first", seq(8, 1), 60)
	testenv.WaitFor(t, "running", func() bool { return e.Stats().GeneratedTokens > 0 })
	upd := make(chan int, 1)
	go func() {
		st, _ := call(t, "POST", e.URL()+"/update_weights_from_disk", `{"model_path":"x"}`)
		upd <- st
	}()
	testenv.WaitFor(t, "the gate shut", func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		return e.gate != nil
	})
	second := async(t, e, "second", seq(8, 2), 5)
	o := <-first
	if !slices.Equal(o.versions, []string{"v0"}) || len(o.tokens) != 60 {
		t.Errorf("in-flight output %+v", o)
	}
	if st := <-upd; st != 200 {
		t.Errorf("update: %d", st)
	}
	o = <-second
	if !slices.Equal(o.versions, []string{"v1"}) {
		t.Errorf("held output %+v", o)
	}
	if s := e.Stats(); s.HeldForUpdate != 1 || s.MixedVersionOutputs != 0 || s.ParkedWhilePaused != 0 {
		t.Errorf("stats %+v", s)
	}
}

func TestVLLMPauseModes(t *testing.T) {
	t.Run("abort", func(t *testing.T) {
		e := start(t, Config{Kind: VLLM, DecodeStep: time.Millisecond})
		ch := async(t, e, "r", seq(8, 1), 20000)
		testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 2 })
		if st, b := call(t, "POST", e.URL()+"/pause?mode=abort", ""); st != 200 || mustJSON(t, b)["status"] != "paused" {
			t.Fatalf("pause: %d %s", st, b)
		}
		if o := <-ch; o.finish != "abort" || len(o.tokens) < 2 {
			t.Errorf("aborted: %+v", o)
		}
		_, b := call(t, "GET", e.URL()+"/is_paused", "")
		if mustJSON(t, b)["is_paused"] != true {
			t.Errorf("is_paused: %s", b)
		}
		// Parked, released by /resume.
		parked := async(t, e, "p", seq(8, 9), 3)
		testenv.WaitFor(t, "parked", func() bool { return e.Stats().Waiting == 1 })
		if s := e.Stats(); s.ParkedWhilePaused != 1 || s.Flushes != 1 {
			t.Errorf("stats %+v", s)
		}
		call(t, "POST", e.URL()+"/resume", "")
		if o := <-parked; o.finish != "length" {
			t.Errorf("parked: %+v", o)
		}
	})
	t.Run("wait", func(t *testing.T) {
		e := start(t, Config{Kind: VLLM, DecodeStep: time.Millisecond})
		ch := async(t, e, "r", seq(8, 1), 50)
		testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 2 })
		paused := make(chan struct{})
		go func() {
			call(t, "POST", e.URL()+"/pause?mode=wait", "")
			close(paused)
		}()
		testenv.WaitFor(t, "paused", e.Paused)
		parked := async(t, e, "p", seq(8, 9), 3)
		o := <-ch
		if o.finish != "length" || len(o.tokens) != 50 {
			t.Errorf("drained: %+v", o)
		}
		<-paused
		if s := e.Stats(); s.Waiting != 1 || s.ParkedWhilePaused != 1 || s.Running != 0 {
			t.Errorf("stats %+v", s)
		}
		// The delete-type abort reaches the parked request.
		_, b := call(t, "POST", e.URL()+"/abort_requests", `{"request_ids":["p"]}`)
		if got := strs(mustJSON(t, b)["aborted"]); !slices.Equal(got, []string{"p"}) {
			t.Errorf("aborted %v", got)
		}
		if o := <-parked; o.finish != "abort" || len(o.tokens) != 0 {
			t.Errorf("parked: %+v", o)
		}
		if s := e.Stats(); s.Waiting != 0 {
			t.Errorf("stats %+v", s)
		}
	})
	t.Run("keep", func(t *testing.T) {
		e := start(t, Config{Kind: VLLM, DecodeStep: time.Millisecond, UpdateDelay: time.Millisecond})
		ch := async(t, e, "r", seq(8, 1), 30)
		testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 2 })
		call(t, "POST", e.URL()+"/pause?mode=keep", "")
		call(t, "POST", e.URL()+"/init_weight_transfer_engine", `{"init_info":{"master_port":1}}`)
		call(t, "POST", e.URL()+"/start_weight_update", `{}`)
		call(t, "POST", e.URL()+"/update_weights", `{"update_info":{"names":["w"]}}`)
		if v := e.WeightVersion(); v != "v0" {
			t.Errorf("version before finish: %s", v)
		}
		call(t, "POST", e.URL()+"/finish_weight_update", `{}`)
		if v := e.WeightVersion(); v != "v1" {
			t.Errorf("version after finish: %s", v)
		}
		call(t, "POST", e.URL()+"/resume", "")
		o := <-ch
		if !slices.Equal(o.versions, []string{"v0", "v1"}) || len(o.tokens) != 30 {
			t.Errorf("output %+v", o)
		}
		if s := e.Stats(); s.MixedVersionOutputs != 1 {
			t.Errorf("stats %+v", s)
		}
		// Without start: /update_weights applies, naming the version.
		call(t, "POST", e.URL()+"/update_weights", `{"update_info":{},"weight_version":"w7"}`)
		if v := e.WeightVersion(); v != "w7" {
			t.Errorf("version %s", v)
		}
	})
}

func TestFailUpdates(t *testing.T) {
	for _, c := range []struct {
		kind Kind
		path string
	}{{SGLang, "/update_weights_from_disk"}, {SGLang, "/update_weights_from_distributed"}, {VLLM, "/update_weights"}, {VLLM, "/finish_weight_update"}} {
		e := start(t, Config{Kind: c.kind})
		e.SetFailUpdates(true)
		if st, b := call(t, "POST", e.URL()+c.path, `{"weight_version":"x"}`); st != 500 {
			t.Errorf("%v %s: %d %s", c.kind, c.path, st, b)
		}
		if s := e.Stats(); s.FailedUpdates != 1 || s.Updates != 0 || e.WeightVersion() != "v0" {
			t.Errorf("stats %+v version %s", s, e.WeightVersion())
		}
		e.SetFailUpdates(false)
		if st, _ := call(t, "POST", e.URL()+c.path, `{"weight_version":"x"}`); st != 200 || e.WeightVersion() != "x" {
			t.Errorf("%v %s after: %d %s", c.kind, c.path, st, e.WeightVersion())
		}
	}
}

func TestLastBody(t *testing.T) {
	e := start(t, Config{Kind: SGLang})
	body := `{"names":["a"],"dtypes":["bf16"],"shapes":[[2,3]],  "group_name":"g"}`
	if st, _ := call(t, "POST", e.URL()+"/init_weights_update_group", body); st != 200 {
		t.Fatal(st)
	}
	if got := e.LastBody("/init_weights_update_group"); string(got) != body {
		t.Errorf("LastBody %q", got)
	}
	if e.LastBody("/destroy_weights_update_group") != nil {
		t.Error("LastBody of a path never called")
	}
}

func TestKill(t *testing.T) {
	e, err := Start(Config{Kind: VLLM, DecodeStep: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ch := async(t, e, "r", seq(8, 1), 20000)
	testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 2 })
	e.Kill()
	if o := <-ch; o.status != 0 && o.status != 200 {
		t.Errorf("killed request: %+v", o)
	}
	if _, err := http.Get(e.URL() + "/health"); err == nil {
		t.Error("a killed engine answered")
	}
	e.Close() // a no-op after Kill
	client.CloseIdleConnections()
}

func TestLoadEndpoints(t *testing.T) {
	e := start(t, Config{Kind: SGLang, DecodeStep: time.Hour, MaxRunning: 1})
	a := async(t, e, "a", seq(40, 1), 4)
	b := async(t, e, "b", seq(40, 1), 4)
	testenv.WaitFor(t, "one running, one waiting", func() bool {
		s := e.Stats()
		return s.Running == 1 && s.Waiting == 1
	})
	_, body := call(t, "GET", e.URL()+"/v1/loads", "")
	var loads struct {
		Timestamp string `json:"timestamp"`
		Version   string `json:"version"`
		Loads     []struct {
			DPRank             int     `json:"dp_rank"`
			NumRunningReqs     int     `json:"num_running_reqs"`
			NumWaitingReqs     int     `json:"num_waiting_reqs"`
			NumUsedTokens      int     `json:"num_used_tokens"`
			MaxTotalNumTokens  int     `json:"max_total_num_tokens"`
			TokenUsage         float64 `json:"token_usage"`
			CacheHitRate       float64 `json:"cache_hit_rate"`
			Utilization        float64 `json:"utilization"`
			MaxRunningRequests int     `json:"max_running_requests"`
		} `json:"loads"`
	}
	if err := json.Unmarshal(body, &loads); err != nil || len(loads.Loads) != 1 {
		t.Fatalf("/v1/loads: %v %s", err, body)
	}
	l := loads.Loads[0]
	if l.NumRunningReqs != 1 || l.NumWaitingReqs != 1 || l.MaxTotalNumTokens != 2048*16 ||
		l.NumUsedTokens != 48 || l.TokenUsage != 3.0/2048 || l.MaxRunningRequests != 1 || l.Utilization != 1 {
		t.Errorf("/v1/loads: %s", body)
	}
	_, body = call(t, "GET", e.URL()+"/get_load", "")
	var legacy []map[string]float64
	if err := json.Unmarshal(body, &legacy); err != nil || len(legacy) != 1 || legacy[0]["num_reqs"] != 2 || legacy[0]["num_waiting_reqs"] != 1 {
		t.Errorf("/get_load: %v %s", err, body)
	}
	_, body = call(t, "GET", e.URL()+"/metrics", "")
	m := parseProm(t, string(body))
	if m["sglang:num_running_reqs"] != 1 || m["sglang:num_queue_reqs"] != 1 || m["sglang:token_usage"] != 3.0/2048 {
		t.Errorf("/metrics: %v", m)
	}

	e.SetLoadMode(LoadLie)
	_, body = call(t, "GET", e.URL()+"/v1/loads", "")
	if err := json.Unmarshal(body, &loads); err != nil || loads.Loads[0].NumRunningReqs != 0 || loads.Loads[0].TokenUsage != 0 {
		t.Errorf("LoadLie: %s", body)
	}
	e.SetLoadMode(LoadNone)
	for _, p := range []string{"/v1/loads", "/get_load", "/metrics"} {
		if st, _ := call(t, "GET", e.URL()+p, ""); st != 404 {
			t.Errorf("LoadNone %s: %d", p, st)
		}
	}
	e.SetLoadMode(LoadTimeout)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	req, _ := http.NewRequestWithContext(ctx, "GET", e.URL()+"/v1/loads", nil)
	if _, err := client.Do(req); err == nil {
		t.Error("LoadTimeout answered")
	}
	cancel()
	e.SetLoadMode(LoadOK)
	call(t, "POST", e.URL()+"/abort_request", `{"abort_all":true}`)
	<-a
	<-b
}

func TestVLLMMetrics(t *testing.T) {
	e := start(t, Config{Kind: VLLM})
	gen(t, e, "a", seq(40, 1), 2)
	gen(t, e, "b", seq(40, 1), 2)
	_, body := call(t, "GET", e.URL()+"/metrics", "")
	m := parseProm(t, string(body))
	if m["vllm:prefix_cache_queries_total"] != 80 || m["vllm:prefix_cache_hits_total"] != 32 ||
		m["vllm:num_requests_running"] != 0 || m["vllm:kv_cache_usage_perc"] != 0 {
		t.Errorf("metrics %v\n%s", m, body)
	}
}

// parseProm reads "name{labels} value" lines.
func parseProm(t *testing.T, s string) map[string]float64 {
	t.Helper()
	m := map[string]float64{}
	for _, line := range strings.Split(s, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		var name string
		var v float64
		i := strings.IndexAny(line, "{ ")
		name = line[:i]
		if _, err := fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v); err != nil {
			t.Fatalf("bad metric line %q", line)
		}
		if !strings.Contains(line, `model_name="`) {
			t.Errorf("no model_name label: %q", line)
		}
		m[name] = v
	}
	return m
}

func TestStreaming(t *testing.T) {
	cases := []struct {
		kind Kind
		path string
		body string
	}{
		{SGLang, "/generate", `{"input_ids":[1,2,3],"stream":true,"sampling_params":{"max_new_tokens":5}}`},
		{SGLang, "/v1/completions", `{"prompt":[1,2,3],"stream":true,"max_tokens":5}`},
		{SGLang, "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":5}`},
		{VLLM, "/v1/completions", `{"prompt":[1,2,3],"stream":true,"max_tokens":5}`},
		{VLLM, "/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":5}`},
		{VLLM, "/inference/v1/generate", `{"token_ids":[1,2,3],"stream":true,"sampling_params":{"max_tokens":5}}`},
	}
	engines := map[Kind]*Engine{}
	for _, k := range kinds {
		engines[k] = start(t, Config{Kind: k})
	}
	for _, c := range cases {
		t.Run(c.kind.String()+c.path, func(t *testing.T) {
			resp, err := client.Post(engines[c.kind].URL()+c.path, "application/json", strings.NewReader(c.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || ct != "text/event-stream" {
				t.Fatalf("%d %s", resp.StatusCode, ct)
			}
			events, done := readSSE(t, resp.Body)
			if !done || len(events) != 5 {
				t.Fatalf("%d events, done %v", len(events), done)
			}
			last := events[len(events)-1]
			var fin string
			if mi, ok := last["meta_info"].(map[string]any); ok {
				fin = mi["finish_reason"].(map[string]any)["type"].(string)
			} else {
				fin, _ = last["choices"].([]any)[0].(map[string]any)["finish_reason"].(string)
			}
			if fin != "length" {
				t.Errorf("last event %v", last)
			}
			for _, ev := range events[:4] {
				if mi, ok := ev["meta_info"].(map[string]any); ok && mi["finish_reason"] != nil {
					t.Errorf("early finish %v", ev)
				}
			}
		})
	}
}

// readSSE reads "data: " events up to [DONE], checking the framing.
func readSSE(t *testing.T, r io.Reader) (events []map[string]any, done bool) {
	t.Helper()
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	expectBlank := false
	for sc.Scan() {
		line := sc.Text()
		if expectBlank {
			if line != "" {
				t.Fatalf("event not followed by a blank line: %q", line)
			}
			expectBlank = false
			continue
		}
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			t.Fatalf("bad SSE line %q", line)
		}
		expectBlank = true
		if data == "[DONE]" {
			done = true
			continue
		}
		if done {
			t.Fatalf("event after [DONE]: %q", data)
		}
		var m map[string]any
		if err := json.Unmarshal([]byte(data), &m); err != nil {
			t.Fatalf("bad event %q: %v", data, err)
		}
		events = append(events, m)
	}
	return events, done
}

func TestAPIKey(t *testing.T) {
	for _, k := range kinds {
		e := start(t, Config{Kind: k, APIKey: "sekret"})
		if st, _ := call(t, "POST", e.URL()+"/v1/completions", `{"prompt":"x"}`); st != 401 {
			t.Errorf("%v without a key: %d", k, st)
		}
		req, _ := http.NewRequest("POST", e.URL()+"/v1/completions", strings.NewReader(`{"prompt":"x","max_tokens":1}`))
		req.Header.Set("Authorization", "Bearer sekret")
		resp, err := client.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Errorf("%v with the key: %v %v", k, err, resp)
		}
		if resp != nil {
			resp.Body.Close()
		}
		if st, _ := call(t, "GET", e.URL()+"/health", ""); st != 200 {
			t.Errorf("%v health: %d", k, st)
		}
	}
}

func TestFleetUnderLoad(t *testing.T) {
	es, err := StartFleet(4, Config{Kind: VLLM, KVBlocks: 64, BlockTokens: 16, MaxRunning: 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, e := range es {
			e.Close()
		}
		client.CloseIdleConnections()
	})
	var wg sync.WaitGroup
	errs := make(chan string, 400)
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			e := es[i%len(es)]
			p := append(seq(48, 7), i%5) // GRPO-ish groups: 5 distinct tails
			if o := gen(t, e, fmt.Sprint("g", i), p, 16); o.finish != "length" || !slices.Equal(o.tokens, expected(p, 16)) {
				errs <- fmt.Sprintf("%d: %+v", i, o)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for s := range errs {
		t.Error(s)
	}
	var hits int64
	for _, e := range es {
		s := e.Stats()
		hits += s.CachedTokens
		t.Logf("%s: %+v", e.Name(), s)
		if s.KVUsage != 0 || s.Running+s.Waiting != 0 {
			t.Errorf("%s: %+v", e.Name(), s)
		}
	}
	if hits == 0 {
		t.Error("no prefix-cache hit in a fleet of shared prompts")
	}
}

func TestClientGoneAborts(t *testing.T) {
	for _, k := range kinds {
		e := start(t, Config{Kind: k, DecodeStep: time.Millisecond})
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			req, _ := http.NewRequestWithContext(ctx, "POST", e.URL()+"/v1/completions", strings.NewReader(`{"prompt":"x","max_tokens":20000}`))
			if resp, err := client.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
		testenv.WaitFor(t, "running", func() bool { return e.Stats().GeneratedTokens > 0 })
		cancel()
		<-done
		testenv.WaitFor(t, "aborted and freed", func() bool {
			s := e.Stats()
			return s.Aborted == 1 && s.Running == 0 && s.KVUsage == 0
		})
	}
}

func TestStreamAbortPartial(t *testing.T) {
	e := start(t, Config{Kind: SGLang, DecodeStep: time.Millisecond})
	resp, err := client.Post(e.URL()+"/generate", "application/json", strings.NewReader(`{"rid":"s","text":"abc","stream":true,"sampling_params":{"max_new_tokens":20000}}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 3 })
	call(t, "POST", e.URL()+"/abort_request", `{"rid":"s"}`)
	events, done := readSSE(t, resp.Body)
	if !done || len(events) < 3 {
		t.Fatalf("%d events, done %v", len(events), done)
	}
	last := events[len(events)-1]["meta_info"].(map[string]any)
	if last["finish_reason"].(map[string]any)["type"] != "abort" {
		t.Errorf("last event %v", last)
	}
}

func TestCloseReleasesStuckRequests(t *testing.T) {
	for _, k := range kinds {
		e, err := Start(Config{Kind: k, DecodeStep: time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		path := "/pause_generation"
		if k == VLLM {
			path = "/pause?mode=keep"
		}
		frozen := async(t, e, "f", seq(8, 1), 20000)
		testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens > 0 })
		call(t, "POST", e.URL()+path, `{"mode":"in_place"}`)
		parked := async(t, e, "p", seq(8, 2), 3)
		testenv.WaitFor(t, "parked", func() bool { return e.Stats().ParkedWhilePaused == 1 })
		t0 := time.Now()
		e.Close()
		if d := time.Since(t0); d > 2*time.Second {
			t.Errorf("%v: Close took %v", k, d)
		}
		<-frozen
		<-parked
		client.CloseIdleConnections()
	}
}

func TestVLLMUnpausedUpdateMixes(t *testing.T) {
	// The hazard a router must prevent: vLLM does not wait for requests.
	e := start(t, Config{Kind: VLLM, DecodeStep: time.Millisecond, UpdateDelay: time.Millisecond})
	ch := async(t, e, "r", seq(8, 1), 40)
	testenv.WaitFor(t, "tokens", func() bool { return e.Stats().GeneratedTokens >= 2 })
	call(t, "POST", e.URL()+"/update_weights", `{"update_info":{}}`)
	if o := <-ch; !slices.Equal(o.versions, []string{"v0", "v1"}) {
		t.Errorf("output %+v", o)
	}
	if s := e.Stats(); s.MixedVersionOutputs != 1 {
		t.Errorf("stats %+v", s)
	}
}

func TestSleepWake(t *testing.T) {
	for _, c := range []struct {
		kind         Kind
		sleep, wake  string
		sleepingPath string
	}{{VLLM, "/sleep", "/wake_up", "/is_sleeping"}, {SGLang, "/release_memory_occupation", "/resume_memory_occupation", ""}} {
		e := start(t, Config{Kind: c.kind})
		call(t, "POST", e.URL()+c.sleep, "")
		if c.sleepingPath != "" {
			if _, b := call(t, "GET", e.URL()+c.sleepingPath, ""); mustJSON(t, b)["is_sleeping"] != true {
				t.Errorf("is_sleeping %s", b)
			}
		}
		ch := async(t, e, "r", seq(8, 1), 3)
		testenv.WaitFor(t, "waiting", func() bool { return e.Stats().Waiting == 1 })
		call(t, "POST", e.URL()+c.wake, "")
		if o := <-ch; o.finish != "length" {
			t.Errorf("%v: %+v", c.kind, o)
		}
	}
}

func TestSGLangVersionEndpoints(t *testing.T) {
	e := start(t, Config{Kind: SGLang, WeightVersion: "base"})
	if st, b := call(t, "POST", e.URL()+"/update_weight_version", `{"new_version":"v41"}`); st != 200 {
		t.Fatalf("%d %s", st, b)
	}
	call(t, "POST", e.URL()+"/update_weights_from_tensor", `{"serialized_named_tensors":[]}`)
	for _, p := range []string{"/get_weight_version", "/get_model_info", "/get_server_info"} {
		_, b := call(t, "GET", e.URL()+p, "")
		if v := mustJSON(t, b)["weight_version"]; v != "v42" {
			t.Errorf("%s: %v", p, v)
		}
	}
	if o := gen(t, e, "r", seq(4, 1), 2); o.version != "v42" {
		t.Errorf("output %+v", o)
	}
}

func TestStartFleetNames(t *testing.T) {
	es, err := StartFleet(2, Config{Kind: SGLang, Name: "m"})
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range es {
		if e.Name() != fmt.Sprint("m-", i) || e.URL() == "" {
			t.Errorf("%d: %s %s", i, e.Name(), e.URL())
		}
		e.Close()
	}
}

// TestRoutedDPRank: a fake SGLang engine takes routed_dp_rank (an integer
// in range) in /generate and OpenAI bodies, counts it by rank, and
// refuses another type or a rank out of range (400).
func TestRoutedDPRank(t *testing.T) {
	e, err := Start(Config{Kind: SGLang, DecodeStep: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for _, c := range []struct {
		path, body string
		status     int
	}{
		{"/generate", `{"routed_dp_rank":3,"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":2}}`, 200},
		{"/v1/completions", `{"prompt":[1,2,3],"max_tokens":2,"routed_dp_rank":3}`, 200},
		{"/generate", `{"input_ids":[1,2,3],"routed_dp_rank":1,"sampling_params":{"max_new_tokens":2}}`, 200},
		{"/generate", `{"routed_dp_rank":"1","input_ids":[1,2,3]}`, 400},
		{"/generate", `{"routed_dp_rank":8,"input_ids":[1,2,3]}`, 400},
		{"/generate", `{"routed_dp_rank":null,"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":2}}`, 200},
	} {
		resp, err := http.Post(e.URL()+c.path, "application/json", strings.NewReader(c.body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Errorf("%s %s: %d, want %d", c.path, c.body, resp.StatusCode, c.status)
		}
	}
	if got := e.Stats().RoutedRanks; got[3] != 2 || got[1] != 1 || got[0] != 0 {
		t.Fatalf("routed ranks %v", got)
	}
}
