package fakepd

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
)

func TestPrefixCache(t *testing.T) {
	seq := func(from, n int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = from + i
		}
		return s
	}
	c := newPrefixCache(64, 16) // 4 blocks
	for _, tc := range []struct {
		name   string
		prompt []int
		want   int
	}{
		{"cold", seq(0, 40), 0},
		{"the same: its two full blocks", seq(0, 40), 32},
		{"a longer prompt with that start", seq(0, 50), 32},
		{"another start", append(seq(1000, 16), seq(16, 32)...), 0},
		{"the first prompt again, its blocks evicted in part", seq(0, 40), 16},
	} {
		if got := c.take(tc.prompt); got != tc.want {
			t.Errorf("%s: %d cached, want %d", tc.name, got, tc.want)
		}
	}
	var none *prefixCache
	if none.take(seq(0, 40)) != 0 || newPrefixCache(0, 16).take(seq(0, 40)) != 0 {
		t.Error("no cache found tokens")
	}
}

// versionsOf reads an answer's versions and cached tokens, in either shape.
func versionsOf(t *testing.T, b []byte) ([]string, int, string) {
	t.Helper()
	var a struct {
		MetaInfo struct {
			WeightVersions []string `json:"weight_versions"`
			CachedTokens   int      `json:"cached_tokens"`
			FinishReason   struct {
				Type string `json:"type"`
			} `json:"finish_reason"`
		} `json:"meta_info"`
		WeightVersions []string `json:"weight_versions"`
		Usage          struct {
			Details struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &a); err != nil {
		t.Fatalf("answer %s: %v", b, err)
	}
	if a.MetaInfo.WeightVersions != nil {
		return a.MetaInfo.WeightVersions, a.MetaInfo.CachedTokens, a.MetaInfo.FinishReason.Type
	}
	fin := ""
	if len(a.Choices) > 0 {
		fin = a.Choices[0].FinishReason
	}
	return a.WeightVersions, a.Usage.Details.CachedTokens, fin
}

type pdPair struct {
	prefill, decode interface {
		URL() string
		Held() int
	}
	pstats, dstats *Stats
	direct         func(body string) (int, []byte, error)
	path           string
	body           func(prompt string, n int) string
}

func pairOf(t *testing.T, proto string, popts, dopts Options) *pdPair {
	if proto == "sglang" {
		p, d := sglangPair(t, popts, dopts)
		return &pdPair{p, d, &p.Stats, &d.Stats, func(b string) (int, []byte, error) {
			return DirectSGLang(context.Background(), http.DefaultClient, p.URL(), p.BootstrapPort(), d.URL(), "/generate", []byte(b))
		}, "/generate", func(prompt string, n int) string {
			return fmt.Sprintf(`{"text":%q,"rid":%q,"sampling_params":{"max_new_tokens":%d}}`, prompt, "r-"+prompt, n)
		}}
	}
	p, d := vllmPair(t, popts, dopts)
	return &pdPair{p, d, &p.Stats, &d.Stats, func(b string) (int, []byte, error) {
		return DirectVLLM(context.Background(), http.DefaultClient, p.URL(), d.URL(), "/v1/completions", []byte(b))
	}, "/v1/completions", func(prompt string, n int) string {
		return fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d}`, prompt, n)
	}}
}

func update(t *testing.T, url, version string) {
	t.Helper()
	if st, b := post(context.Background(), url+"/update_weights", map[string]any{"weight_version": version}); st != 200 {
		t.Fatalf("update %s: %d %s", url, st, b)
	}
}

// TestVersionsAndCache: an answer lists the prefill's version and the
// decode's, and the prompt tokens the prefill found cached; a pair on two
// versions makes an answer that spans them, counted by the decode.
func TestVersionsAndCache(t *testing.T) {
	for _, proto := range []string{"sglang", "vllm"} {
		t.Run(proto, func(t *testing.T) {
			pp := pairOf(t, proto, Options{CacheTokens: 1 << 12}, Options{})
			prompt := "a prompt long enough to fill a few blocks of sixteen tokens each, and then some more text"
			update(t, pp.prefill.URL(), "v1")
			update(t, pp.decode.URL(), "v1")
			st, b, err := pp.direct(pp.body(prompt, 3))
			if v, cached, _ := versionsOf(t, b); err != nil || st != 200 || fmt.Sprint(v) != "[v1]" || cached != 0 {
				t.Fatalf("%d %v %s: versions %v, cached %d", st, err, b, v, cached)
			}
			update(t, pp.decode.URL(), "v2")
			st, b, err = pp.direct(pp.body(prompt, 3))
			if v, cached, _ := versionsOf(t, b); err != nil || st != 200 || fmt.Sprint(v) != "[v1 v2]" || cached == 0 {
				t.Fatalf("%d %v %s: versions %v, cached %d", st, err, b, v, cached)
			}
			if pp.dstats.MixedVersionOutputs.Load() != 1 || pp.pstats.CachedTokens.Load() == 0 || pp.pstats.PromptTokens.Load() <= pp.pstats.CachedTokens.Load() {
				t.Errorf("mixed %d, prompt tokens %d, cached %d", pp.dstats.MixedVersionOutputs.Load(), pp.pstats.PromptTokens.Load(), pp.pstats.CachedTokens.Load())
			}
			testenv.WaitFor(t, "nothing held", func() bool { return pp.prefill.Held() == 0 && pp.decode.Held() == 0 })
		})
	}
}

// TestPausedParksAndAbortEndsWithPartialOutput: a request that reaches a
// paused decode is counted and waits for the resume; an abort of a
// running decode answers its partial output with finish reason abort.
func TestPausedParksAndAbortEndsWithPartialOutput(t *testing.T) {
	for _, proto := range []string{"sglang", "vllm"} {
		t.Run(proto, func(t *testing.T) {
			pp := pairOf(t, proto, Options{}, Options{TokenDelay: 5 * time.Millisecond})
			if st, b := post(context.Background(), pp.decode.URL()+"/pause?mode=keep", nil); st != 200 {
				t.Fatalf("pause: %d %s", st, b)
			}
			type res struct {
				st  int
				b   []byte
				err error
			}
			done := make(chan res, 1)
			go func() { st, b, err := pp.direct(pp.body("parked", 2)); done <- res{st, b, err} }()
			testenv.WaitFor(t, "the request parked", func() bool { return pp.dstats.ParkedWhilePaused.Load() == 1 })
			post(context.Background(), pp.decode.URL()+"/resume", nil)
			if r := <-done; r.err != nil || r.st != 200 {
				t.Fatalf("parked request: %d %v %s", r.st, r.err, r.b)
			}
			go func() { st, b, err := pp.direct(pp.body("aborted", 10000)); done <- res{st, b, err} }()
			testenv.WaitFor(t, "the decode running", func() bool {
				// An SGLang decode holds its request while it waits for
				// its room too (before the prefill has registered it):
				// running is holding it and waiting for nothing.
				if w, ok := pp.decode.(interface{ Waiting() int }); ok && w.Waiting() != 0 {
					return false
				}
				return pp.decode.Held() == 1 && pp.prefill.Held() == 0
			})
			if st, b := post(context.Background(), pp.decode.URL()+"/pause_generation", map[string]any{"mode": "abort"}); st != 200 {
				t.Fatalf("pause: %d %s", st, b)
			}
			r := <-done
			if _, _, fin := versionsOf(t, r.b); r.err != nil || r.st != 200 || fin != "abort" {
				t.Fatalf("aborted request: %d %v %s", r.st, r.err, r.b)
			}
			testenv.WaitFor(t, "nothing held", func() bool { return pp.prefill.Held() == 0 && pp.decode.Held() == 0 })
		})
	}
}
