package daemon

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tether-rl/tether/testenv"
	"github.com/tether-rl/tether/testenv/fakeengine"
	"github.com/tether-rl/tether/testenv/fakepd"
	"github.com/tether-rl/tether/userspace/kvevents"
	"github.com/tether-rl/tether/userspace/kvindex"
	"github.com/tether-rl/tether/userspace/worker"
)

// pdKVFleet starts 2 prefills publishing KV events (ec) and 2 decodes of
// proto behind a tetherd subscribed to the prefills' events (the admin
// API's kv_events: SetWorkerKVEvents), and waits until it is subscribed.
func pdKVFleet(t *testing.T, proto PDProtocol, ec fakepd.KVEventsConfig) *pdFleet {
	t.Helper()
	o := fakepd.Options{WaitTimeout: 10 * time.Second, CacheTokens: 1 << 16, KVEvents: &ec}
	f := startPDFleet(t, proto, []fakepd.Options{o, o}, []fakepd.Options{o, o}, func(opts *Options) {
		opts.Routing.KVEvents.On = true
	})
	type publisher interface {
		URL() string
		KVEventsEndpoint() string
		KVEventsReplayEndpoint() string
		KVEventsSubscribers() int
	}
	for _, e := range f.prefills {
		p := e.(publisher)
		var url string
		for _, w := range f.d.Table.Snapshot() {
			if w != nil && w.Role() == worker.Prefill && strings.HasPrefix(w.URL, p.URL()) {
				url = w.URL
			}
		}
		if err := f.d.SetWorkerKVEvents(url, p.KVEventsEndpoint(), p.KVEventsReplayEndpoint()); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, "tetherd subscribed to both prefills' events", func() bool {
		for _, e := range f.prefills {
			if e.(publisher).KVEventsSubscribers() == 0 {
				return false
			}
		}
		return true
	})
	return f
}

// pdIDsBody is a generation request of token ids in proto's API.
func pdIDsBody(proto PDProtocol, ids []int, maxNew int) (string, string) {
	var b strings.Builder
	for i, t := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(t))
	}
	if proto == PDSGLang {
		return "/generate", fmt.Sprintf(`{"input_ids":[%s],"sampling_params":{"max_new_tokens":%d}}`, b.String(), maxNew)
	}
	return "/v1/completions", fmt.Sprintf(`{"model":"m","prompt":[%s],"max_tokens":%d}`, b.String(), maxNew)
}

// TestPDKVEventsKeylessSession: prefills publishing KV-cache events (each
// engine in its wire form), keyless multi-turn sessions (no key: each
// turn's prompt is another prompt group) behind tetherd: every turn after
// the first goes to the prefill that computed the session's last prompt,
// placed by what it holds (route header "prefill-kv"), and finds that
// prompt in its cache.
func TestPDKVEventsKeylessSession(t *testing.T) {
	for _, tc := range []struct {
		proto PDProtocol
		ec    fakepd.KVEventsConfig
	}{
		{PDSGLang, fakepd.KVEventsConfig{Form: kvevents.MapForm, Hashes: kvevents.HashInt}},
		{PDVLLM, fakepd.KVEventsConfig{Form: kvevents.ArrayForm, Hashes: kvevents.HashUint, Replay: true}},
	} {
		t.Run(string(tc.proto), func(t *testing.T) {
			f := pdKVFleet(t, tc.proto, tc.ec)
			base := "http://" + f.d.Addr()
			c := &http.Client{Timeout: 30 * time.Second}
			pp := f.d.Router.PrefixPlacement()
			const sessions, turns = 6, 5
			shared := make([]int, 64) // a system prompt: every session's start
			for i := range shared {
				shared[i] = 1000 + i
			}
			ctxs := make([][]int, sessions)
			slots := make([]string, sessions)
			for s := range ctxs {
				ctxs[s] = append([]int(nil), shared...)
				for i := 0; i < 40+7*s; i++ {
					ctxs[s] = append(ctxs[s], 5000+1000*s+i)
				}
			}
			// The sessions' turns interleaved, one request at a time.
			for turn := 0; turn < turns; turn++ {
				for s := range ctxs {
					ids := ctxs[s]
					path, body := pdIDsBody(tc.proto, ids, 4)
					resp, out, err := pdPost(c, base, path, body, nil)
					if err != nil || resp.StatusCode != 200 {
						t.Fatalf("session %d turn %d: %v %v %s", s, turn, err, resp, out)
					}
					route := resp.Header.Get(RouteHeaderName)
					p, _, _ := strings.Cut(route, "+")
					var a struct {
						MetaInfo struct {
							CachedTokens int `json:"cached_tokens"`
						} `json:"meta_info"`
						Usage struct {
							Details struct {
								CachedTokens int `json:"cached_tokens"`
							} `json:"prompt_tokens_details"`
						} `json:"usage"`
					}
					if err := json.Unmarshal(out, &a); err != nil {
						t.Fatalf("answer %q: %v", out, err)
					}
					cached := a.MetaInfo.CachedTokens + a.Usage.Details.CachedTokens
					if turn > 0 {
						if p != slots[s] || !strings.Contains(route, " prefill-kv ") {
							t.Errorf("session %d turn %d: %q, its last prompt on %s", s, turn, route, slots[s])
						}
						if prev := len(ids) - 4 - 20; cached < prev/16*16 {
							t.Errorf("session %d turn %d on %s: %d tokens cached, its last prompt's %d were computed there", s, turn, p, cached, prev/16*16)
						}
					}
					slots[s] = p
					// The next turn: this prompt, the answer, a tool's output.
					for i := 0; i < 4; i++ {
						ids = append(ids, fakeengine.OutputToken(ids[:len(ctxs[s])], 0, i))
					}
					for i := 0; i < 20; i++ {
						ids = append(ids, 50000+1000*s+100*turn+i)
					}
					ctxs[s] = ids
					// The prefill's events of this prompt indexed before the
					// next turn is sent (they are published as it computes).
					slot, _ := strconv.Atoi(strings.TrimPrefix(p, "p"))
					_, next := pdIDsBody(tc.proto, ids, 4)
					testenv.WaitFor(t, "the prompt's blocks indexed", func() bool {
						var m kvindex.Match
						if !pp.Index().Scan([]byte(next), int64(len(next)), &m) {
							return false
						}
						held := 0
						for _, id := range pp.Engines(slot) {
							held = max(held, m.Matched(id))
						}
						return held >= (len(ids)-24)/16*16
					})
				}
			}
			testenv.WaitFor(t, "nothing held", func() bool { return f.held() == 0 })
		})
	}
}
