package fakepd

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/kvindex"
)

type indexHandler struct {
	x  *kvindex.Index
	id kvindex.EngineID
}

func (h indexHandler) Apply(b *kvevents.Batch)    { h.x.Apply(h.id, b.Events) }
func (h indexHandler) Clear(kvevents.ClearReason) { h.x.Clear(h.id) }

func idsJSON(field string, ids []int) string {
	var b strings.Builder
	fmt.Fprintf(&b, `{%q:[`, field)
	for i, t := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(t))
	}
	b.WriteString(`]`)
	return b.String()
}

// TestPrefillKVEvents: a prefill's events, in each wire form, build an
// index that finds what its prefix cache holds: a prompt's full blocks
// once computed, a prompt sharing its start adding only its own blocks,
// none of a prompt evicted; a killed prefill's publisher goes.
func TestPrefillKVEvents(t *testing.T) {
	seq := func(from, n int) []int {
		s := make([]int, n)
		for i := range s {
			s[i] = from + i
		}
		return s
	}
	for _, proto := range []string{"sglang", "vllm"} {
		for _, ec := range []KVEventsConfig{
			{Form: kvevents.ArrayForm, Hashes: kvevents.HashUint, Replay: true},
			{Form: kvevents.MapForm, Hashes: kvevents.HashInt},
		} {
			t.Run(fmt.Sprintf("%s-form%d", proto, ec.Form), func(t *testing.T) {
				o := Options{Regular: true, BlockTokens: 4, CacheTokens: 32, KVEvents: &ec}
				var e interface {
					URL() string
					KVEventsEndpoint() string
					KVEventsReplayEndpoint() string
					KVEventsSubscribers() int
					Kill()
				}
				path, field := "/generate", "input_ids"
				if proto == "sglang" {
					p, err := StartSGLangPrefill(o)
					if err != nil {
						t.Fatal(err)
					}
					e = p
				} else {
					p, err := StartVLLMPrefill(o)
					if err != nil {
						t.Fatal(err)
					}
					e, path, field = p, "/v1/completions", "prompt"
				}
				defer e.Kill()
				x := kvindex.New(kvindex.Config{})
				id, _ := x.Register("p")
				sub, err := kvevents.Start(kvevents.Config{Endpoint: e.KVEventsEndpoint(), Replay: e.KVEventsReplayEndpoint()}, indexHandler{x, id})
				if err != nil {
					t.Fatal(err)
				}
				defer sub.Close()
				testenv.WaitFor(t, "subscribed", func() bool { return e.KVEventsSubscribers() == 1 })
				send := func(ids []int) {
					t.Helper()
					body := idsJSON(field, ids)
					if proto == "sglang" {
						body += `,"sampling_params":{"max_new_tokens":2}}`
					} else {
						body += `,"max_tokens":2}`
					}
					resp, err := http.Post(e.URL()+path, "application/json", strings.NewReader(body))
					if err != nil {
						t.Fatal(err)
					}
					resp.Body.Close()
					if resp.StatusCode != http.StatusOK {
						t.Fatalf("%s: %d", path, resp.StatusCode)
					}
				}
				held := func(ids []int) int {
					var m kvindex.Match
					b := idsJSON(field, ids) + "}"
					if !x.Scan([]byte(b), int64(len(b)), &m) {
						return -1
					}
					return m.Matched(id)
				}
				a := seq(100, 18) // 4 full blocks
				send(a)
				testenv.WaitFor(t, "the prompt's blocks indexed", func() bool { return held(a) == 16 })
				b := append(seq(100, 8), seq(500, 8)...) // shares 2 blocks
				send(b)
				testenv.WaitFor(t, "the second prompt's blocks indexed", func() bool { return held(b) == 16 })
				if got := held(a); got != 16 {
					t.Fatalf("the first prompt: %d tokens held, want 16", got)
				}
				// 8 blocks of cache: two prompts of 4 new blocks each evict a's
				// and b's own blocks (the shared start too, once unused).
				send(seq(1000, 16))
				send(seq(2000, 16))
				testenv.WaitFor(t, "evicted blocks removed", func() bool { return held(a) == 0 && held(b) == 0 })
				if got := held(seq(2000, 16)); got != 16 {
					t.Fatalf("the last prompt: %d tokens held, want 16", got)
				}
				e.Kill()
				testenv.WaitFor(t, "the killed prefill's entries cleared", func() bool { return held(seq(2000, 16)) == 0 })
			})
		}
	}
}
