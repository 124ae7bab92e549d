package pd_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/pd"
)

var protocols = []pd.Protocol{pd.SGLang, pd.VLLM}

func pathsFor(p pd.Protocol) []string {
	if p == pd.SGLang {
		return []string{"/generate", "/v1/completions", "/v1/chat/completions"}
	}
	return []string{"/v1/completions", "/v1/chat/completions"}
}

func promptText(path, prompt string) string {
	if path == "/v1/chat/completions" {
		return chatPrompt(prompt)
	}
	return prompt
}

// TestServeUnderLoad: a fleet of 2 prefills and 6 decodes, every path,
// streamed and not, many at once, through Serve and through the direct
// client in the same run: every answer right, nothing hung, held,
// recomputed or refused, the loads back to 0.
func TestServeUnderLoad(t *testing.T) {
	for _, proto := range protocols {
		t.Run(proto.String(), func(t *testing.T) {
			f := newFleet(t, proto, 2, 6, fakepd.Options{WaitTimeout: 5 * time.Second}, fakepd.Options{WaitTimeout: 5 * time.Second})
			r := newRouter(t, f, pd.Config{})
			direct := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
			defer direct.CloseIdleConnections()
			const n = 96
			var wg sync.WaitGroup
			errs := make(chan error, 2*n)
			sem := make(chan struct{}, 12)
			for i := 0; i < n; i++ {
				path := pathsFor(proto)[i%len(pathsFor(proto))]
				prompt := fmt.Sprintf("prompt %d of a GRPO group %d, long enough for blocks", i, i/8)
				b := body(path, prompt, 8, i%2 == 0, "")
				want := expected(promptText(path, prompt), 8)
				wg.Add(2)
				go func() {
					defer wg.Done()
					sem <- struct{}{}
					defer func() { <-sem }()
					resp, out := r.post(t, path, b)
					if resp.StatusCode != 200 {
						errs <- fmt.Errorf("routed %s: %d %s", path, resp.StatusCode, out)
						return
					}
					if got := textOf(t, path, out); got != want {
						errs <- fmt.Errorf("routed %s: text %q, want %q", path, got, want)
					}
					if !strings.HasPrefix(resp.Header.Get("X-Tether-Route"), "p") {
						errs <- fmt.Errorf("no route header: %v", resp.Header)
					}
				}()
				go func() {
					defer wg.Done()
					sem <- struct{}{}
					defer func() { <-sem }()
					pi, di := i%2, i%6
					var st int
					var out []byte
					var err error
					if proto == pd.SGLang {
						st, out, err = fakepd.DirectSGLang(context.Background(), direct, f.workersP[pi].URL, f.workersP[pi].BootstrapPort, f.workersD[di].URL, path, []byte(b))
					} else {
						st, out, err = fakepd.DirectVLLM(context.Background(), direct, f.workersP[pi].URL, f.workersD[di].URL, path, []byte(b))
					}
					if err != nil || st != 200 {
						errs <- fmt.Errorf("direct %s: %d %v %s", path, st, err, out)
						return
					}
					if got := textOf(t, path, out); got != want {
						errs <- fmt.Errorf("direct %s: text %q, want %q", path, got, want)
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			// A whole answer can reach the client before Serve returns.
			testenv.WaitFor(t, "every Serve to return", func() bool { return r.ch.load.Load() == 0 })
			v := r.srv.Counters.Values()
			if v.Served != n || v.Retries != 0 || v.GaveUp != 0 || v.MidStream != 0 || v.MissingKVParams != 0 {
				t.Errorf("counters %+v", v)
			}
			if got := f.sum(func(s *fakepd.Stats) int64 { return s.Recomputes.Load() }); got != 0 {
				t.Errorf("%d silent recomputes", got)
			}
			if got := f.sum(func(s *fakepd.Stats) int64 { return s.BadPrefill.Load() + s.Refused.Load() + s.Timeouts.Load() }); got != 0 {
				t.Errorf("%d bad prefill legs, refusals or timeouts", got)
			}
		})
	}
}

// TestRefuseSamples: n > 1 in a form not split into requests of one
// sample (streamed, seeded, with the client's rid, a batch, too many) is
// refused with a 400 that says why, and no engine sees it.
func TestRefuseSamples(t *testing.T) {
	for _, proto := range protocols {
		t.Run(proto.String(), func(t *testing.T) {
			f := newFleet(t, proto, 1, 1, fakepd.Options{}, fakepd.Options{})
			r := newRouter(t, f, pd.Config{})
			cases := []struct{ path, body string }{
				{"/v1/completions", body("/v1/completions", "x", 4, false, `"n":2,"seed":7`)},
				{"/v1/chat/completions", body("/v1/chat/completions", "x", 4, true, `"n":4`)},
				{"/v1/completions", body("/v1/completions", "x", 4, false, `"n":65`)},
				{"/v1/completions", body("/v1/completions", "x", 4, false, `"n":2.5`)},
				{"/v1/completions", body("/v1/completions", "x", 4, false, `"n":2,"request_id":"mine"`)},
			}
			if proto == pd.SGLang {
				cases = append(cases,
					struct{ path, body string }{"/generate", `{"text":"x","rid":"mine","sampling_params":{"n":3,"max_new_tokens":2}}`},
					struct{ path, body string }{"/generate", `{"text":["x","y"],"sampling_params":{"n":3,"max_new_tokens":2}}`},
					struct{ path, body string }{"/generate", `{"text":"x","sampling_params":{"n":3,"sampling_seed":1}}`})
			}
			for _, c := range cases {
				resp, out := r.post(t, c.path, c.body)
				if resp.StatusCode != 400 || !strings.Contains(string(out), "n > 1") {
					t.Errorf("%s: %d %s", c.path, resp.StatusCode, out)
				}
			}
			resp, out := r.post(t, "/v1/completions", `{"prompt": [`)
			if resp.StatusCode != 400 {
				t.Errorf("bad JSON: %d %s", resp.StatusCode, out)
			}
			if got := f.sum(func(s *fakepd.Stats) int64 { return s.Requests.Load() }); got != 0 {
				t.Errorf("engines saw %d requests", got)
			}
			if v := r.srv.Counters.Values(); v.RefusedN != uint64(len(cases)) || v.BadRequest != 1 {
				t.Errorf("counters %+v", v)
			}
		})
	}
}

// TestSGLangWithoutBootstrapRefused: the fakes refuse a request without
// bootstrap fields as SGLang does (what a router that does not speak the
// protocol gets).
func TestSGLangWithoutBootstrapRefused(t *testing.T) {
	f := newFleet(t, pd.SGLang, 1, 1, fakepd.Options{}, fakepd.Options{})
	for _, e := range []engine{f.prefills[0], f.decodes[0]} {
		resp, err := http.Post(e.URL()+"/generate", "application/json", strings.NewReader(`{"text":"hi"}`))
		if err != nil {
			t.Fatal(err)
		}
		var a struct {
			Error struct{ Message string } `json:"error"`
		}
		json.NewDecoder(resp.Body).Decode(&a)
		resp.Body.Close()
		if resp.StatusCode != 400 || a.Error.Message != "Disaggregated request received without bootstrap room id" {
			t.Errorf("%s: %d %q", e.URL(), resp.StatusCode, a.Error.Message)
		}
	}
}

// TestSGLangLogprobMerge: with return_logprob, P's input_token_logprobs
// go in front of D's, in the whole answer and in every stream event.
func TestSGLangLogprobMerge(t *testing.T) {
	f := newFleet(t, pd.SGLang, 1, 1, fakepd.Options{}, fakepd.Options{})
	r := newRouter(t, f, pd.Config{})
	prompt := "a prompt of several tokens for the logprob rows"
	rows := len(fakeengine.Tokenize(prompt))
	for _, stream := range []bool{false, true} {
		_, out := r.post(t, "/generate", body("/generate", prompt, 4, stream, `"return_logprob":true`))
		var answers []string
		if stream {
			for _, l := range strings.Split(string(out), "\n\n") {
				if p, ok := strings.CutPrefix(l, "data: "); ok && p != "[DONE]" {
					answers = append(answers, p)
				}
			}
			if !strings.HasSuffix(string(out), "data: [DONE]\n\n") {
				t.Errorf("stream does not end with [DONE]: %q", out)
			}
		} else {
			answers = []string{string(out)}
		}
		if len(answers) == 0 {
			t.Fatalf("stream %v: no answer: %s", stream, out)
		}
		for _, a := range answers {
			var v struct {
				MetaInfo struct {
					Input  [][3]any `json:"input_token_logprobs"`
					Output [][3]any `json:"output_token_logprobs"`
				} `json:"meta_info"`
			}
			if err := json.Unmarshal([]byte(a), &v); err != nil {
				t.Fatalf("%s: %v", a, err)
			}
			if len(v.MetaInfo.Input) != rows || v.MetaInfo.Input[0][0] != nil {
				t.Errorf("stream %v: %d input rows (want %d): %s", stream, len(v.MetaInfo.Input), rows, a)
			}
		}
	}
	r.settled(t)
	if got := r.srv.Counters.LogprobMerges.Load(); got < 5 {
		t.Errorf("%d merges", got)
	}
}

// TestVLLMMissingKVParams: a prefill answering without kv_transfer_params
// is counted and answered 502, or let through when configured (the decode
// then recomputes, and says so).
func TestVLLMMissingKVParams(t *testing.T) {
	for _, let := range []bool{false, true} {
		t.Run(fmt.Sprint("let=", let), func(t *testing.T) {
			f := newFleet(t, pd.VLLM, 1, 1, fakepd.Options{}, fakepd.Options{})
			f.prefills[0].(*fakepd.VLLMPrefill).OmitParams(true)
			r := newRouter(t, f, pd.Config{LetMissingKVParamsThrough: let})
			resp, out := r.post(t, "/v1/completions", body("/v1/completions", "hello there", 4, false, ""))
			r.settled(t)
			v := r.srv.Counters.Values()
			rec := f.decodes[0].(*fakepd.VLLMDecode).Stats.Recomputes.Load()
			if v.MissingKVParams != 1 {
				t.Errorf("MissingKVParams %d", v.MissingKVParams)
			}
			if !let && (resp.StatusCode != 502 || !strings.Contains(string(out), "kv_transfer_params") || rec != 0) {
				t.Errorf("%d %s, %d recomputes", resp.StatusCode, out, rec)
			}
			if let && (resp.StatusCode != 200 || v.PassedWithoutKVParams != 1 || rec != 1) {
				t.Errorf("%d %s, %+v, %d recomputes", resp.StatusCode, out, v, rec)
			}
		})
	}
}
