package pd_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/pd"
)

// TestSplitSamples: a request for n samples that is not streamed is sent
// as n requests of one sample, each over a pair with its own room or
// handoff, and the client gets one answer: n choices indexed 0..n-1 with
// the usage summed (OpenAI paths), or a list of n answers (SGLang's
// /generate); nothing held, recomputed or refused by the engines.
func TestSplitSamples(t *testing.T) {
	const n = 3
	for _, proto := range protocols {
		t.Run(proto.String(), func(t *testing.T) {
			f := newFleet(t, proto, 2, 2, fakepd.Options{}, fakepd.Options{})
			r := newRouter(t, f, pd.Config{})
			reqs := 0
			for _, path := range pathsFor(proto) {
				prompt := "split me into samples on " + path
				b := body(path, prompt, 4, false, `"n":3`)
				if path == "/generate" {
					b = `{"text":` + jsonString(prompt) + `,"sampling_params":{"n":3,"max_new_tokens":4}}`
				}
				resp, out := r.post(t, path, b)
				reqs++
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", path, resp.StatusCode, out)
				}
				if routes := strings.Split(resp.Header.Get("X-Tether-Route"), ", "); len(routes) != n {
					t.Errorf("%s: route header %q, want %d pairs", path, resp.Header.Get("X-Tether-Route"), n)
				}
				want := expected(promptText(path, prompt), 4)
				if path == "/generate" {
					var list []struct {
						Text string `json:"text"`
					}
					if err := json.Unmarshal(out, &list); err != nil || len(list) != n {
						t.Fatalf("%s: %v %s", path, err, out)
					}
					for i, a := range list {
						if a.Text != want {
							t.Errorf("%s: sample %d %q, want %q", path, i, a.Text, want)
						}
					}
					continue
				}
				var a struct {
					Choices []struct {
						Index   int    `json:"index"`
						Text    string `json:"text"`
						Message struct {
							Content string `json:"content"`
						} `json:"message"`
					} `json:"choices"`
					Usage struct {
						Prompt     int `json:"prompt_tokens"`
						Completion int `json:"completion_tokens"`
						Total      int `json:"total_tokens"`
					} `json:"usage"`
				}
				if err := json.Unmarshal(out, &a); err != nil || len(a.Choices) != n {
					t.Fatalf("%s: %v %s", path, err, out)
				}
				for i, c := range a.Choices {
					if c.Index != i || c.Text+c.Message.Content != want {
						t.Errorf("%s: choice %d: index %d, %q, want %q", path, i, c.Index, c.Text+c.Message.Content, want)
					}
				}
				if a.Usage.Completion != n*4 || a.Usage.Prompt == 0 || a.Usage.Total != a.Usage.Prompt+n*4 {
					t.Errorf("%s: usage %+v", path, a.Usage)
				}
			}
			testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
			// Every sample was a request of its own on both sides.
			if got := f.sum(func(s *fakepd.Stats) int64 { return s.Requests.Load() }); got != int64(2*n*reqs) {
				t.Errorf("engines saw %d requests, want %d", got, 2*n*reqs)
			}
			if got := f.sum(func(s *fakepd.Stats) int64 {
				return s.Recomputes.Load() + s.BadPrefill.Load() + s.Refused.Load() + s.Timeouts.Load()
			}); got != 0 {
				t.Errorf("%d recomputes, bad prefill legs, refusals or timeouts", got)
			}
			if v := r.srv.Counters.Values(); v.Expanded != uint64(reqs) || v.Served != uint64(n*reqs) || v.RefusedN+v.MergeFailed+v.GaveUp != 0 {
				t.Errorf("counters %+v", v)
			}
		})
	}
}

// TestSplitSamplesFailure: a sample that is not answered 2xx is the
// client's answer, as it came.
func TestSplitSamplesFailure(t *testing.T) {
	f := newFleet(t, pd.VLLM, 1, 1, fakepd.Options{}, fakepd.Options{})
	r := newRouter(t, f, pd.Config{})
	f.prefills[0].(*fakepd.VLLMPrefill).FailNext(429, 1)
	resp, out := r.post(t, "/v1/completions", body("/v1/completions", "one fails", 4, false, `"n":2`))
	if resp.StatusCode != 429 {
		t.Errorf("status %d %s, want the failed sample's 429", resp.StatusCode, out)
	}
	testenv.WaitFor(t, "the fleet to hold nothing", func() bool { return f.held() == 0 })
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}
